//! The OpenAI-compatible `/v1/chat/completions` client: request and response types, rate-limit
//! header parsing, and the error type whose [`ErrorClass`] tells the caller what to do.
//!
//! Works with OpenAI, Groq, vLLM, llama.cpp server and Ollama. The API key is held in a
//! [`Secret`] and never appears in `Debug`, `Display` or error text.

use std::time::Duration;

use futures::future::BoxFuture;
use http::HeaderMap;
use serde::{Deserialize, Serialize};

use super::config::ProviderConfig;
use crate::envelope::DlqCategory;

/// A string that must never be printed (API keys). `Debug` and `Display` print `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself; call only where it is sent, never where it is logged.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// Author of a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions.
    System,
    /// The input.
    User,
    /// A model answer.
    Assistant,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// What is said.
    pub content: String,
}

impl Message {
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self {
            role: Role::System,
            content: content.into(),
        }
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: Role::User,
            content: content.into(),
        }
    }
}

/// The `response_format` of a chat request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Free text.
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON matching a schema (`{"name": …, "schema": …}`).
    JsonSchema {
        /// The schema wrapper as OpenAI expects it.
        json_schema: serde_json::Value,
    },
}

/// A chat completion request (the subset Sluice uses).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatRequest {
    /// Upstream model id; the composed client overwrites it with the configured one.
    pub model: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Completion token cap.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Sampling temperature.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Output format constraint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ResponseFormat>,
}

impl ChatRequest {
    /// Worst-case token estimate used for limiter admission: about 4 characters per prompt
    /// token plus a small per-message overhead, plus the completion cap.
    pub fn estimated_tokens(&self) -> u32 {
        let chars: usize = self.messages.iter().map(|m| m.content.len() + 16).sum();
        let prompt = u32::try_from(chars.div_ceil(4)).unwrap_or(u32::MAX);
        prompt.saturating_add(self.max_tokens.unwrap_or(256))
    }
}

/// Token usage reported by the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens billed (cached ones included).
    pub prompt_tokens: u64,
    /// Completion tokens billed.
    pub completion_tokens: u64,
    /// Prompt tokens served from cache (`prompt_tokens_details.cached_tokens`, 0 if absent).
    pub cached_tokens: u64,
}

impl Usage {
    /// Prompt plus completion tokens.
    pub fn total(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }
}

/// Rate-limit state reported by the provider in response headers. All fields are optional:
/// vLLM, llama.cpp and Ollama send none of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateLimitInfo {
    /// `x-ratelimit-limit-requests`.
    pub limit_requests: Option<u64>,
    /// `x-ratelimit-remaining-requests`.
    pub remaining_requests: Option<u64>,
    /// `x-ratelimit-reset-requests` (e.g. `1s`, `6m0s`, `120ms`).
    pub reset_requests: Option<Duration>,
    /// `x-ratelimit-limit-tokens`.
    pub limit_tokens: Option<u64>,
    /// `x-ratelimit-remaining-tokens`.
    pub remaining_tokens: Option<u64>,
    /// `x-ratelimit-reset-tokens`.
    pub reset_tokens: Option<Duration>,
    /// `retry-after-ms`, else `Retry-After` (seconds or HTTP date).
    pub retry_after: Option<Duration>,
}

/// Header names read by [`RateLimitInfo::from_headers`].
pub mod rate_limit_headers {
    /// Request quota.
    pub const LIMIT_REQUESTS: &str = "x-ratelimit-limit-requests";
    /// Requests left.
    pub const REMAINING_REQUESTS: &str = "x-ratelimit-remaining-requests";
    /// Time until the request quota is replenished.
    pub const RESET_REQUESTS: &str = "x-ratelimit-reset-requests";
    /// Token quota.
    pub const LIMIT_TOKENS: &str = "x-ratelimit-limit-tokens";
    /// Tokens left.
    pub const REMAINING_TOKENS: &str = "x-ratelimit-remaining-tokens";
    /// Time until the token quota is replenished.
    pub const RESET_TOKENS: &str = "x-ratelimit-reset-tokens";
    /// Standard HTTP header, seconds or HTTP date.
    pub const RETRY_AFTER: &str = "retry-after";
    /// Millisecond variant (OpenAI, Azure).
    pub const RETRY_AFTER_MS: &str = "retry-after-ms";
}

impl RateLimitInfo {
    /// Parses the `x-ratelimit-*` and retry-after headers; malformed values are ignored.
    pub fn from_headers(headers: &HeaderMap) -> Self {
        use rate_limit_headers::*;
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
        };
        let num = |name: &str| text(name).and_then(parse_count);
        let dur = |name: &str| text(name).and_then(parse_reset_duration);
        let mut info = Self {
            limit_requests: num(LIMIT_REQUESTS),
            remaining_requests: num(REMAINING_REQUESTS),
            reset_requests: dur(RESET_REQUESTS),
            limit_tokens: num(LIMIT_TOKENS),
            remaining_tokens: num(REMAINING_TOKENS),
            reset_tokens: dur(RESET_TOKENS),
            retry_after: None,
        };
        let precise = text(RETRY_AFTER_MS)
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|ms| ms.is_finite() && *ms >= 0.0)
            .map(|ms| Duration::from_secs_f64(ms / 1000.0));
        info.retry_after = precise.or_else(|| {
            let raw = text(RETRY_AFTER)?;
            let after = parse_retry_after(raw)?;
            Some(if raw.bytes().all(|b| b.is_ascii_digit()) {
                info.refine_whole_seconds(after)
            } else {
                after
            })
        });
        info
    }

    /// A whole-second `Retry-After` is rounded up: the true wait lies in `(n - 1 s, n]`.
    /// When the same answer says when the exhausted budget resets, that refines it.
    fn refine_whole_seconds(&self, after: Duration) -> Duration {
        let exhausted = |remaining: Option<u64>, reset: Option<Duration>| {
            reset.filter(|_| remaining == Some(0))
        };
        let reset = exhausted(self.remaining_requests, self.reset_requests)
            .into_iter()
            .chain(exhausted(self.remaining_tokens, self.reset_tokens))
            .max();
        match reset {
            Some(reset) => reset
                .min(after)
                .max(after.saturating_sub(Duration::from_secs(1))),
            None => after,
        }
    }

    /// True when no header was present.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// Counts are integers, but some proxies send `12.0`.
fn parse_count(s: &str) -> Option<u64> {
    s.parse::<u64>().ok().or_else(|| {
        s.parse::<f64>()
            .ok()
            .filter(|f| f.is_finite() && *f >= 0.0)
            .map(|f| f as u64)
    })
}

/// Parses a reset duration in Go's format (`1s`, `6m0s`, `120ms`, `0.5s`, `1h2m3.5s`); a bare
/// number is seconds.
pub fn parse_reset_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    if let Ok(secs) = s.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    let mut total = 0.0_f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_end == 0 {
            return None;
        }
        let value: f64 = rest[..num_end].parse().ok()?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    total.is_finite().then(|| Duration::from_secs_f64(total))
}

/// `Retry-After`: delta seconds (integer or decimal) or an HTTP date.
fn parse_retry_after(s: &str) -> Option<Duration> {
    if let Ok(secs) = s.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    let when = chrono::DateTime::parse_from_rfc2822(s).ok()?;
    let delta = when.with_timezone(&chrono::Utc) - chrono::Utc::now();
    Some(delta.to_std().unwrap_or(Duration::ZERO))
}

/// A parsed chat completion.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatResponse {
    /// Text of the first choice.
    pub content: String,
    /// Token usage.
    pub usage: Usage,
    /// Why generation stopped (`stop`, `length`, …).
    pub finish_reason: Option<String>,
    /// Rate-limit headers of the response.
    pub rate_limit: RateLimitInfo,
}

/// Why a request that reached the provider cannot succeed as is; maps to a DLQ category.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermanentKind {
    /// Malformed or unsupported request.
    BadRequest,
    /// Refused by the provider's content policy.
    ContentPolicy,
    /// Prompt exceeds the context window or the request size limit.
    TooLarge,
}

impl PermanentKind {
    /// The dead-letter category.
    pub fn dlq_category(self) -> DlqCategory {
        match self {
            PermanentKind::BadRequest => DlqCategory::BadRequest,
            PermanentKind::ContentPolicy => DlqCategory::ContentPolicy,
            PermanentKind::TooLarge => DlqCategory::TooLarge,
        }
    }
}

/// What the caller should do about an [`LlmError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retry with backoff (408/409/5xx, timeouts, connection errors).
    Transient,
    /// 429: retry after the hint; the limiter slows down.
    RateLimited {
        /// The provider's `Retry-After`, if any.
        retry_after: Option<Duration>,
    },
    /// Never retry; dead-letter under this category.
    Permanent(PermanentKind),
    /// 401/403/404-model: stop intake, report unhealthy, keep the messages.
    Config,
    /// 2xx with an unparsable body; retried like a transient error.
    Malformed,
    /// The model's circuit breaker is open: use the fallback model or hold intake.
    CircuitOpen,
}

impl ErrorClass {
    /// Whether an in-operator retry may help.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ErrorClass::Transient | ErrorClass::RateLimited { .. } | ErrorClass::Malformed
        )
    }

    /// Whether the circuit breaker counts this as a provider failure.
    pub fn counts_as_provider_failure(&self) -> bool {
        matches!(self, ErrorClass::Transient | ErrorClass::Malformed)
    }
}

/// A provider call failure.
///
/// `Display` never includes the provider's message body (which may quote input); it is kept
/// in [`LlmError::Status::message`] for the result's `errorMessage`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LlmError {
    /// The provider answered with a non-success status.
    #[error("provider answered HTTP {status} (code {code:?}, type {kind:?})")]
    Status {
        /// HTTP status.
        status: u16,
        /// OpenAI `error.code`.
        code: Option<String>,
        /// OpenAI `error.type`.
        kind: Option<String>,
        /// OpenAI `error.message`, truncated.
        message: String,
        /// Rate-limit headers of the response (boxed: keeps the error small).
        rate_limit: Box<RateLimitInfo>,
    },
    /// A 2xx whose only choice was withheld by the provider's content filter.
    #[error("answer withheld by the provider's content filter")]
    ContentFiltered,
    /// No answer within the model's timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// Could not connect.
    #[error("connection failed: {0}")]
    Connect(String),
    /// Other transport failure (reset, truncated body).
    #[error("transport error: {0}")]
    Transport(String),
    /// A 2xx whose body could not be understood.
    #[error("malformed response: {0}")]
    Malformed(String),
    /// The breaker of this model is open.
    #[error("circuit open for model {0}")]
    CircuitOpen(String),
    /// Local configuration problem (unknown model, unreadable API key file).
    #[error("configuration error: {0}")]
    Config(String),
}

/// OpenAI error codes that mean the content was refused.
const CONTENT_POLICY_CODES: [&str; 4] = [
    "content_policy_violation",
    "content_filter",
    "moderation_blocked",
    "content_policy",
];
/// OpenAI error codes that mean the input is too large.
const TOO_LARGE_CODES: [&str; 4] = [
    "context_length_exceeded",
    "string_above_max_length",
    "request_too_large",
    "tokens_exceeded",
];
/// OpenAI error codes that mean a configuration or account problem.
const CONFIG_CODES: [&str; 5] = [
    "model_not_found",
    "invalid_api_key",
    "insufficient_quota",
    "account_deactivated",
    "unsupported_model",
];

impl LlmError {
    /// The class the caller acts on.
    pub fn class(&self) -> ErrorClass {
        match self {
            LlmError::Status {
                status,
                code,
                kind,
                rate_limit,
                ..
            } => classify_status(*status, code.as_deref(), kind.as_deref(), rate_limit),
            LlmError::ContentFiltered => ErrorClass::Permanent(PermanentKind::ContentPolicy),
            LlmError::Timeout(_) | LlmError::Connect(_) | LlmError::Transport(_) => {
                ErrorClass::Transient
            }
            LlmError::Malformed(_) => ErrorClass::Malformed,
            LlmError::CircuitOpen(_) => ErrorClass::CircuitOpen,
            LlmError::Config(_) => ErrorClass::Config,
        }
    }

    /// A bounded label for metrics and `errorCode`.
    pub fn code(&self) -> &'static str {
        match self.class() {
            ErrorClass::Transient => match self {
                LlmError::Timeout(_) => "timeout",
                _ => "transient",
            },
            ErrorClass::RateLimited { .. } => "rate_limited",
            ErrorClass::Permanent(k) => k.dlq_category().as_str(),
            ErrorClass::Config => "config",
            ErrorClass::Malformed => "malformed",
            ErrorClass::CircuitOpen => "circuit_open",
        }
    }

    /// Rate-limit headers carried by the error, if any.
    pub fn rate_limit(&self) -> Option<&RateLimitInfo> {
        match self {
            LlmError::Status { rate_limit, .. } => Some(rate_limit.as_ref()),
            _ => None,
        }
    }
}

fn classify_status(
    status: u16,
    code: Option<&str>,
    kind: Option<&str>,
    rate_limit: &RateLimitInfo,
) -> ErrorClass {
    let is = |set: &[&str]| {
        code.is_some_and(|c| set.contains(&c)) || kind.is_some_and(|k| set.contains(&k))
    };
    if is(&CONFIG_CODES) {
        return ErrorClass::Config;
    }
    match status {
        429 => ErrorClass::RateLimited {
            retry_after: rate_limit.retry_after,
        },
        401 | 403 | 404 => ErrorClass::Config,
        408 | 409 | 425 => ErrorClass::Transient,
        413 => ErrorClass::Permanent(PermanentKind::TooLarge),
        500..=599 => ErrorClass::Transient,
        400..=499 if is(&CONTENT_POLICY_CODES) => {
            ErrorClass::Permanent(PermanentKind::ContentPolicy)
        }
        400..=499 if is(&TOO_LARGE_CODES) => ErrorClass::Permanent(PermanentKind::TooLarge),
        400..=499 => ErrorClass::Permanent(PermanentKind::BadRequest),
        // 1xx/3xx reaching us means a misbehaving proxy: retry.
        _ => ErrorClass::Transient,
    }
}

/// Longest provider error message kept.
const MAX_ERROR_MESSAGE: usize = 300;

/// The body of an error answer: OpenAI's `{"error":{…}}` or vLLM's flat `{"message":…}`.
fn parse_error_body(body: &[u8]) -> (Option<String>, Option<String>, String) {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return (None, None, String::new());
    };
    let e = match v.get("error") {
        Some(inner @ serde_json::Value::Object(_)) => inner,
        _ => &v,
    };
    let text = |key: &str| match e.get(key) {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    let mut message = text("message").unwrap_or_default();
    if message.len() > MAX_ERROR_MESSAGE {
        let mut cut = MAX_ERROR_MESSAGE;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    (text("code"), text("type"), message)
}

#[derive(Deserialize)]
struct WireResponse {
    #[serde(default)]
    choices: Vec<WireChoice>,
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct WireChoice {
    message: Option<WireMessage>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct WireMessage {
    content: Option<String>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    prompt_tokens_details: Option<WireUsageDetails>,
}

#[derive(Deserialize)]
struct WireUsageDetails {
    cached_tokens: Option<u64>,
}

/// Parses a 2xx body.
pub fn parse_chat_body(body: &[u8], rate_limit: RateLimitInfo) -> Result<ChatResponse, LlmError> {
    let wire: WireResponse = serde_json::from_slice(body).map_err(|e| {
        LlmError::Malformed(format!(
            "body is not a chat completion: {}",
            e.classify_str()
        ))
    })?;
    let choice = wire
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| LlmError::Malformed("no choices".into()))?;
    let usage = wire
        .usage
        .ok_or_else(|| LlmError::Malformed("no usage".into()))?;
    let content = match choice.message.and_then(|m| m.content) {
        Some(c) => c,
        None if choice.finish_reason.as_deref() == Some("content_filter") => {
            return Err(LlmError::ContentFiltered)
        }
        None => return Err(LlmError::Malformed("no message content".into())),
    };
    Ok(ChatResponse {
        content,
        usage: Usage {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            cached_tokens: usage
                .prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0),
        },
        finish_reason: choice.finish_reason,
        rate_limit,
    })
}

/// Short category of a serde_json error, without the input excerpt.
trait ClassifyStr {
    fn classify_str(&self) -> &'static str;
}

impl ClassifyStr for serde_json::Error {
    fn classify_str(&self) -> &'static str {
        match self.classify() {
            serde_json::error::Category::Io => "io",
            serde_json::error::Category::Syntax => "syntax",
            serde_json::error::Category::Data => "unexpected shape",
            serde_json::error::Category::Eof => "truncated",
        }
    }
}

/// One hop to a provider; the HTTP client implements it, tests inject fakes.
pub trait ChatTransport: Send + Sync + 'static {
    /// Sends one request and parses the answer. No retries, no timeout: the layers above add
    /// them.
    fn send<'a>(
        &'a self,
        request: &'a ChatRequest,
    ) -> BoxFuture<'a, Result<ChatResponse, LlmError>>;
}

/// The connection-pooling HTTP/1.1 client of a provider (TLS when the URL says `https`).
type HyperClient = hyper_util::client::legacy::Client<
    hyper_tls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    http_body_util::Full<bytes::Bytes>,
>;

/// The HTTP client for one OpenAI-compatible provider.
///
/// Built on hyper's pooled client rather than reqwest: a provider call is always one POST to
/// one fixed URL, so the URL, the headers and the key are prepared once, and none of reqwest's
/// per-request work (two URL parses in its redirect layer, its retry and timeout wrappers) is
/// paid on the hot path; timeouts and retries are the middleware's.
#[derive(Debug, Clone)]
pub struct HttpProvider {
    name: String,
    url: String,
    /// `url`, parsed once (not per request).
    uri: http::Uri,
    /// `Authorization: Bearer …`, marked sensitive.
    auth: Option<http::HeaderValue>,
    http: HyperClient,
}

impl HttpProvider {
    /// Builds the client, reading the API key from the configured env var or file.
    pub fn new(config: &ProviderConfig) -> Result<Self, LlmError> {
        let api_key = config.resolve_api_key()?;
        let url = completions_url(&config.base_url);
        let invalid = |e: &dyn std::fmt::Display| {
            LlmError::Config(format!("provider {}: invalid base_url: {e}", config.name))
        };
        let uri: http::Uri = url.parse().map_err(|e| invalid(&e))?;
        match uri.scheme_str() {
            Some("http" | "https") if uri.host().is_some() => {}
            _ => return Err(invalid(&"expected http:// or https:// and a host")),
        }
        let auth = api_key
            .map(|key| {
                let mut v = http::HeaderValue::try_from(format!("Bearer {}", key.expose()))
                    .map_err(|_| {
                        LlmError::Config(format!(
                            "provider {}: the API key is not a valid header value",
                            config.name
                        ))
                    })?;
                v.set_sensitive(true);
                Ok::<_, LlmError>(v)
            })
            .transpose()?;
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.enforce_http(false);
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_millis(config.connect_timeout_ms)));
        let tls = hyper_tls::native_tls::TlsConnector::new()
            .map_err(|e| LlmError::Config(format!("http client: tls: {e}")))?;
        let https = hyper_tls::HttpsConnector::from((connector, tls.into()));
        let http =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_max_idle_per_host(config.max_idle_connections)
                .build(https);
        Ok(Self {
            name: config.name.clone(),
            url,
            uri,
            auth,
            http,
        })
    }

    /// The provider's configured name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The full completions URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Sends one chat completion request.
    pub async fn chat(&self, request: &ChatRequest) -> Result<ChatResponse, LlmError> {
        use http_body_util::BodyExt as _;
        let body = serde_json::to_vec(request)
            .map_err(|e| LlmError::Transport(format!("request body: {e}")))?;
        let mut builder =
            http::Request::post(self.uri.clone()).header(http::header::CONTENT_TYPE, JSON);
        if let Some(auth) = &self.auth {
            builder = builder.header(http::header::AUTHORIZATION, auth.clone());
        }
        let req = builder
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .map_err(|e| LlmError::Transport(e.to_string()))?;
        let response = self.http.request(req).await.map_err(map_client_error)?;
        let status = response.status().as_u16();
        let rate_limit = RateLimitInfo::from_headers(response.headers());
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| LlmError::Transport(format!("reading the response: {e}")))?
            .to_bytes();
        if (200..300).contains(&status) {
            parse_chat_body(&body, rate_limit)
        } else {
            let (code, kind, message) = parse_error_body(&body);
            Err(LlmError::Status {
                status,
                code,
                kind,
                message,
                rate_limit: Box::new(rate_limit),
            })
        }
    }
}

const JSON: http::HeaderValue = http::HeaderValue::from_static("application/json");

impl ChatTransport for HttpProvider {
    fn send<'a>(
        &'a self,
        request: &'a ChatRequest,
    ) -> BoxFuture<'a, Result<ChatResponse, LlmError>> {
        Box::pin(self.chat(request))
    }
}

/// `base_url` may or may not already end in `/v1`.
fn completions_url(base_url: &str) -> String {
    let base = base_url.trim_end_matches('/');
    if base.ends_with("/v1") {
        format!("{base}/chat/completions")
    } else {
        format!("{base}/v1/chat/completions")
    }
}

fn map_client_error(e: hyper_util::client::legacy::Error) -> LlmError {
    // The innermost cause says what happened ("connection refused", "connection reset").
    let mut cause: &dyn std::error::Error = &e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    if e.is_connect() {
        LlmError::Connect(cause.to_string())
    } else {
        LlmError::Transport(cause.to_string())
    }
}

#[cfg(test)]
mod tests;
