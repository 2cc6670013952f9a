//! The HTTP side of the simulator: the OpenAI-compatible routes, the chat completion pipeline
//! (checks, limits, injected faults, deterministic answer) and the admin API.
//!
//! Pipeline order for `POST /v1/chat/completions`: `status_override` → API key → request
//! validation → model → context length → content policy → `burst_429` → rate limits → slot
//! (queueing mode) → hang → latency → `error_rate` → `reset_rate` → `malformed_rate` → answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use parking_lot::{Mutex, RwLock};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use super::config::{
    ConfigError, ContextErrorStyle, EffectiveLimits, Latency, LimitScope, SimConfig,
};
use super::limits::{format_reset, LimitSnapshot, RateDecision, RateLimiter};
use super::prompt::{
    batch_answer, fnv1a64, fnv1a64_parts, malformed_batch_answer, output_text, parse_batch_items,
    parse_spec, reordered_batch_answer, task_output, tokens_for_message, tokens_for_text,
    truncate_to_tokens, unit_fraction,
};
use super::stats::{CallIndex, PromptCache, SimStats};

/// Largest request body accepted (micro-batches can be large).
const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// `system_fingerprint` of every answer.
const SYSTEM_FINGERPRINT: &str = "sluice-sim";

/// OpenAI error `type` values.
mod error_type {
    pub const INVALID_REQUEST: &str = "invalid_request_error";
    pub const RATE_LIMIT: &str = "rate_limit_error";
    pub const SERVER: &str = "server_error";
}

/// OpenAI error `code` values.
mod error_code {
    pub const INVALID_API_KEY: &str = "invalid_api_key";
    pub const MODEL_NOT_FOUND: &str = "model_not_found";
    pub const RATE_LIMIT_EXCEEDED: &str = "rate_limit_exceeded";
    pub const CONTENT_POLICY: &str = "content_policy_violation";
    pub const CONTEXT_LENGTH: &str = "context_length_exceeded";
    pub const INVALID_CONFIG: &str = "invalid_config";
    pub const UNKNOWN_URL: &str = "unknown_url";
}

/// Names of the headers the simulator sends: OpenAI's rate-limit headers, and
/// a request id. (Written here from the wire protocol, not taken from the
/// client the simulator is used to test.)
mod header {
    pub const LIMIT_REQUESTS: &str = "x-ratelimit-limit-requests";
    pub const REMAINING_REQUESTS: &str = "x-ratelimit-remaining-requests";
    pub const RESET_REQUESTS: &str = "x-ratelimit-reset-requests";
    pub const LIMIT_TOKENS: &str = "x-ratelimit-limit-tokens";
    pub const REMAINING_TOKENS: &str = "x-ratelimit-remaining-tokens";
    pub const RESET_TOKENS: &str = "x-ratelimit-reset-tokens";
    pub const RETRY_AFTER: &str = "retry-after";
    pub const RETRY_AFTER_MS: &str = "retry-after-ms";
    pub const REQUEST_ID: &str = "x-request-id";
}

/// Error-diffusion counters that pick which requests get a rate-based fault: over `n`
/// requests at rate `r`, exactly `floor(n * r)` are picked, evenly spread.
#[derive(Debug, Default)]
struct FaultClock {
    error: f64,
    hang: f64,
    malformed: f64,
    reset: f64,
    errors_sent: u64,
    malformed_sent: u64,
}

fn fire(acc: &mut f64, rate: f64) -> bool {
    if rate <= 0.0 {
        return false;
    }
    *acc += rate;
    if *acc >= 1.0 - 1e-9 {
        *acc = (*acc - 1.0).max(0.0);
        true
    } else {
        false
    }
}

/// Everything the request handlers share.
pub(crate) struct SimState {
    config: RwLock<Arc<SimConfig>>,
    /// When the current `burst_429` setting was applied; storms are timed from it.
    burst_epoch: Mutex<Instant>,
    limiter: Mutex<RateLimiter>,
    /// Slots of the queueing mode per limit key: the configured count and its semaphore
    /// (tokio's is fair: waiters are served in arrival order).
    slots: Mutex<HashMap<String, (u32, Arc<Semaphore>)>>,
    stats: Mutex<SimStats>,
    calls: Mutex<CallIndex>,
    prompt_cache: Mutex<PromptCache>,
    faults: Mutex<FaultClock>,
    rng: Mutex<StdRng>,
    seq: AtomicU64,
    shutdown: watch::Receiver<bool>,
}

impl SimState {
    /// State for a validated `config`; `shutdown` turns true when the server stops.
    pub(crate) fn new(config: SimConfig, shutdown: watch::Receiver<bool>) -> Self {
        Self {
            rng: Mutex::new(StdRng::seed_from_u64(config.seed)),
            config: RwLock::new(Arc::new(config)),
            burst_epoch: Mutex::new(Instant::now()),
            limiter: Mutex::new(RateLimiter::default()),
            slots: Mutex::new(HashMap::new()),
            stats: Mutex::new(SimStats::default()),
            calls: Mutex::new(CallIndex::default()),
            prompt_cache: Mutex::new(PromptCache::default()),
            faults: Mutex::new(FaultClock::default()),
            seq: AtomicU64::new(0),
            shutdown,
        }
    }

    /// The configuration in force.
    pub(crate) fn config(&self) -> Arc<SimConfig> {
        self.config.read().clone()
    }

    /// Replaces the configuration; applies to the next request.
    pub(crate) fn set_config(&self, new: SimConfig) -> Result<(), ConfigError> {
        new.validate()?;
        let mut guard = self.config.write();
        if guard.burst_429 != new.burst_429 {
            *self.burst_epoch.lock() = Instant::now();
        }
        if guard.seed != new.seed {
            *self.rng.lock() = StdRng::seed_from_u64(new.seed);
        }
        *guard = Arc::new(new);
        Ok(())
    }

    /// A snapshot of the counters.
    pub(crate) fn stats(&self) -> SimStats {
        let mut stats = self.stats.lock().clone();
        stats.distinct_user_contents = self.calls.lock().len() as u64;
        stats
    }

    /// Zeroes the counters, the call index, the prompt cache and the fault counters. Rate
    /// limit buckets and the configuration are kept.
    pub(crate) fn reset(&self) {
        {
            // Requests under way stay counted (they will be answered or abandoned).
            let mut stats = self.stats.lock();
            let in_flight = stats.in_flight;
            *stats = SimStats {
                in_flight,
                peak_in_flight: in_flight,
                ..SimStats::default()
            };
        }
        *self.calls.lock() = CallIndex::default();
        *self.prompt_cache.lock() = PromptCache::default();
        *self.faults.lock() = FaultClock::default();
    }

    /// `(calls, distinct contents)` of successful calls whose user content contains `needle`.
    pub(crate) fn calls_containing(&self, needle: &str) -> (u64, u64) {
        self.calls.lock().count_containing(needle)
    }

    /// Waits `duration` (forever when `None`) unless the server shuts down first; returns
    /// false on shutdown.
    async fn hold(&self, duration: Option<Duration>) -> bool {
        let mut shutdown = self.shutdown.clone();
        let stopping = async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        };
        match duration {
            Some(d) if d.is_zero() => true,
            Some(d) => tokio::select! {
                _ = tokio::time::sleep(d) => true,
                _ = stopping => false,
            },
            None => {
                stopping.await;
                false
            }
        }
    }

    /// Waits in arrival order for a free slot of `key` (queueing mode); `Ok(None)` without
    /// slots, `Err(())` when the server shuts down first. A changed slot count applies to
    /// requests arriving after the change.
    async fn take_slot(
        &self,
        key: &str,
        slots: Option<u32>,
    ) -> Result<Option<OwnedSemaphorePermit>, ()> {
        let Some(n) = slots else { return Ok(None) };
        let semaphore = {
            let mut all = self.slots.lock();
            let entry = all
                .entry(key.to_owned())
                .or_insert_with(|| (n, Arc::new(Semaphore::new(n as usize))));
            if entry.0 != n {
                *entry = (n, Arc::new(Semaphore::new(n as usize)));
            }
            entry.1.clone()
        };
        if let Ok(permit) = semaphore.clone().try_acquire_owned() {
            return Ok(Some(permit));
        }
        self.stats.lock().queued += 1;
        let mut shutdown = self.shutdown.clone();
        tokio::select! {
            permit = semaphore.acquire_owned() => permit.map(Some).map_err(|_| ()),
            _ = shutdown.wait_for(|stop| *stop) => Err(()),
        }
    }

    fn sample_latency(&self, latency: Latency) -> Duration {
        let ms = match latency {
            Latency::Fixed { ms } => ms as f64,
            Latency::Uniform { min_ms, max_ms } => {
                self.rng.lock().random_range(min_ms..=max_ms) as f64
            }
            Latency::Lognormal { median_ms, p99_ms } => {
                // Box-Muller; sigma chosen so that the 99th percentile lands on p99_ms.
                const Z99: f64 = 2.326_347_874;
                let mu = (median_ms as f64).ln();
                let sigma = ((p99_ms as f64).ln() - mu) / Z99;
                let (u1, u2): (f64, f64) = {
                    let mut rng = self.rng.lock();
                    (1.0 - rng.random::<f64>(), rng.random::<f64>())
                };
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                (mu + sigma * z).exp().min(10.0 * p99_ms as f64)
            }
        };
        Duration::from_secs_f64(ms.max(0.0) / 1000.0)
    }
}

/// The router serving the OpenAI-compatible and admin endpoints.
pub(crate) fn router(state: Arc<SimState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(list_models))
        .route("/admin/stats", get(admin_stats))
        .route("/admin/config", get(admin_get_config).put(admin_put_config))
        .route("/admin/reset", post(admin_reset))
        .route("/admin/calls", get(admin_calls))
        .route("/healthz", get(healthz))
        .fallback(unknown_url)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// An OpenAI-style error answer: `{"error":{"message","type","param","code"}}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    code: Option<&'static str>,
    param: Option<&'static str>,
}

impl ApiError {
    fn new(
        status: StatusCode,
        message: impl Into<String>,
        kind: &'static str,
        code: Option<&'static str>,
        param: Option<&'static str>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            code,
            param,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        (self.status, Json(body)).into_response()
    }
}

/// An OpenAI-style error answer as a response.
fn error_response(
    status: StatusCode,
    message: impl Into<String>,
    kind: &'static str,
    code: Option<&'static str>,
    param: Option<&'static str>,
) -> Response {
    ApiError::new(status, message, kind, code, param).into_response()
}

/// A 400 `invalid_request_error`.
fn invalid_request(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        message,
        error_type::INVALID_REQUEST,
        None,
        param,
    )
}

/// The answer forced by `status_override`.
fn overridden_response(status: u16) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let (message, kind, code_str) = match status {
        401 => (
            "Incorrect API key provided (simulated).",
            error_type::INVALID_REQUEST,
            Some(error_code::INVALID_API_KEY),
        ),
        403 => (
            "You are not allowed to use this model (simulated).",
            error_type::INVALID_REQUEST,
            Some("permission_denied"),
        ),
        404 => (
            "The model does not exist or you do not have access to it (simulated).",
            error_type::INVALID_REQUEST,
            Some(error_code::MODEL_NOT_FOUND),
        ),
        429 => (
            "Rate limit reached (simulated).",
            error_type::RATE_LIMIT,
            Some(error_code::RATE_LIMIT_EXCEEDED),
        ),
        500..=599 => (
            "The server had an error while processing your request (simulated).",
            error_type::SERVER,
            None,
        ),
        _ => (
            "Invalid request (simulated).",
            error_type::INVALID_REQUEST,
            None,
        ),
    };
    error_response(code, message, kind, code_str, None)
}

fn set_header(headers: &mut HeaderMap, name: &'static str, value: String) {
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert(HeaderName::from_static(name), value);
    }
}

/// Adds the `x-ratelimit-*` headers (limits that are not configured are left out).
fn add_limit_headers(headers: &mut HeaderMap, snapshot: &LimitSnapshot) {
    if let Some(r) = snapshot.requests {
        set_header(headers, header::LIMIT_REQUESTS, r.limit.to_string());
        set_header(headers, header::REMAINING_REQUESTS, r.remaining.to_string());
        set_header(headers, header::RESET_REQUESTS, format_reset(r.reset));
    }
    if let Some(t) = snapshot.tokens {
        set_header(headers, header::LIMIT_TOKENS, t.limit.to_string());
        set_header(headers, header::REMAINING_TOKENS, t.remaining.to_string());
        set_header(headers, header::RESET_TOKENS, format_reset(t.reset));
    }
}

/// Adds `Retry-After` (whole seconds, rounded up, at least 1) and `retry-after-ms`.
fn add_retry_after(headers: &mut HeaderMap, wait: Duration) {
    let ms = wait.as_nanos().div_ceil(1_000_000).max(1);
    let secs = ms.div_ceil(1000).max(1);
    set_header(headers, header::RETRY_AFTER, secs.to_string());
    set_header(headers, header::RETRY_AFTER_MS, ms.to_string());
}

/// Checks the required headers and query parameters.
fn check_deployment(
    config: &SimConfig,
    headers: &HeaderMap,
    query: Option<&str>,
) -> Result<(), ApiError> {
    for (name, value) in &config.required_headers {
        let got = headers.get(name.as_str()).and_then(|v| v.to_str().ok());
        if got != Some(value.as_str()) {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                format!("Header {name} missing or not valid for this key (simulated)."),
                error_type::INVALID_REQUEST,
                Some("invalid_header"),
                None,
            ));
        }
    }
    let pairs: Vec<(String, String)> = query
        .map(|q| {
            reqwest::Url::parse(&format!("http://q/?{q}"))
                .map(|u| u.query_pairs().into_owned().collect())
                .unwrap_or_default()
        })
        .unwrap_or_default();
    for (name, value) in &config.required_query {
        if !pairs.iter().any(|(k, v)| k == name && v == value) {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "Resource not found (simulated).",
                error_type::INVALID_REQUEST,
                Some("404"),
                None,
            ));
        }
    }
    Ok(())
}

/// Checks `Authorization: Bearer <key>` (or the configured key header) against the
/// configured keys.
fn check_api_key(headers: &HeaderMap, config: &SimConfig) -> Result<(), ApiError> {
    // Without configured keys the simulator behaves like vLLM or Ollama.
    if config.api_keys.is_empty() {
        return Ok(());
    }
    let unauthorized = |message: &str| {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            message,
            error_type::INVALID_REQUEST,
            Some(error_code::INVALID_API_KEY),
            None,
        )
    };
    let key = match &config.api_key_header {
        Some(name) => headers
            .get(name.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::trim),
        None => headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, key) = v.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(key.trim())
            }),
    }
    .filter(|key| !key.is_empty());
    let Some(key) = key else {
        return Err(unauthorized(
            "You didn't provide an API key. You need to provide your API key in an \
             Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        ));
    };
    if !config.api_keys.is_empty() && !config.api_keys.iter().any(|k| k == key) {
        return Err(unauthorized("Incorrect API key provided."));
    }
    Ok(())
}

/// The subset of an OpenAI chat completion request the simulator reads; other fields are
/// accepted and ignored.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f64>,
    stream: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
}

/// A validated request.
struct Prompt {
    model: String,
    system: String,
    user: String,
    prompt_tokens: u64,
    system_tokens: u64,
    max_tokens: Option<u64>,
    /// The request set `max_tokens` (not `max_completion_tokens`).
    sets_max_tokens: bool,
    /// The request set `temperature`.
    sets_temperature: bool,
}

fn message_text(content: Option<&Value>, index: usize) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter_map(|part| match part {
                    Value::String(s) => Some(s.as_str()),
                    Value::Object(map) => map.get("text").and_then(Value::as_str),
                    _ => None,
                })
                .collect();
            Ok(texts.join("\n"))
        }
        Some(_) => Err(invalid_request(
            format!("messages[{index}].content: expected a string or an array of content parts"),
            Some("messages"),
        )),
    }
}

fn parse_request(body: &[u8]) -> Result<Prompt, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let request: ChatRequest = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let message = if path == "." {
            format!(
                "We could not parse the JSON body of your request: {}",
                e.inner()
            )
        } else {
            format!("Invalid value for '{path}': {}", e.inner())
        };
        invalid_request(message, None)
    })?;
    if de.end().is_err() {
        return Err(invalid_request(
            "We could not parse the JSON body of your request: trailing characters",
            None,
        ));
    }
    let model = match request.model {
        Some(m) if !m.trim().is_empty() => m,
        _ => {
            return Err(invalid_request(
                "you must provide a model parameter",
                Some("model"),
            ))
        }
    };
    let messages = match request.messages {
        Some(m) if !m.is_empty() => m,
        _ => {
            return Err(invalid_request(
                "'messages' must contain at least one message",
                Some("messages"),
            ))
        }
    };
    if request.stream == Some(true) {
        return Err(invalid_request(
            "stream=true is not supported by the simulated provider",
            Some("stream"),
        ));
    }
    if let Some(t) = request.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(invalid_request(
                format!("{t} is greater than the maximum of 2 - 'temperature'"),
                Some("temperature"),
            ));
        }
    }
    let sets_max_tokens = request.max_tokens.is_some();
    let max_tokens = request.max_completion_tokens.or(request.max_tokens);
    if max_tokens == Some(0) {
        return Err(invalid_request(
            "max_tokens must be at least 1",
            Some("max_tokens"),
        ));
    }
    let mut system = Vec::new();
    let mut user = Vec::new();
    let mut prompt_tokens = 0;
    let mut system_tokens = 0;
    for (index, message) in messages.iter().enumerate() {
        let text = message_text(message.content.as_ref(), index)?;
        let tokens = tokens_for_message(&text);
        prompt_tokens += tokens;
        match message.role.as_str() {
            "system" | "developer" => {
                system_tokens += tokens;
                system.push(text);
            }
            "user" => user.push(text),
            "assistant" | "tool" | "function" => {}
            other => {
                return Err(invalid_request(
                    format!("Invalid value for 'messages[{index}].role': '{other}'"),
                    Some("messages"),
                ))
            }
        }
    }
    Ok(Prompt {
        model,
        system: system.join("\n"),
        user: user.join("\n"),
        prompt_tokens,
        system_tokens,
        max_tokens,
        sets_max_tokens,
        sets_temperature: request.temperature.is_some(),
    })
}

/// The deterministic answer to a prompt.
struct Answer {
    content: String,
    /// The model declined: `content` is sent as `null` and this as `message.refusal`.
    refusal: Option<String>,
    finish_reason: &'static str,
    completion_tokens: u64,
    /// Hidden reasoning tokens among `completion_tokens`.
    reasoning_tokens: u64,
    /// Items in the request when it is a micro-batch.
    batch_items: Option<usize>,
    batch_malformed: bool,
}

fn compose_answer(prompt: &Prompt, config: &SimConfig) -> Answer {
    let spec = parse_spec(&prompt.system);
    let mut batch_items = None;
    let mut batch_malformed = false;
    let content = if spec.batch {
        let items = parse_batch_items(&prompt.user);
        batch_items = Some(items.len());
        let hash = fnv1a64_parts(&[prompt.system.as_str(), prompt.user.as_str(), "batch"]);
        let reorder = fnv1a64_parts(&[prompt.user.as_str(), "reorder"]);
        if unit_fraction(hash) < config.batch_malformed_rate {
            batch_malformed = true;
            malformed_batch_answer(&spec.kind, &items, hash)
        } else if unit_fraction(reorder) < config.batch_reorder_rate {
            reordered_batch_answer(&spec.kind, &items)
        } else {
            batch_answer(&spec.kind, &items)
        }
    } else {
        output_text(&task_output(&spec.kind, &prompt.user))
    };
    let refused = config
        .refusal_marker
        .as_deref()
        .is_some_and(|m| !m.is_empty() && prompt.user.contains(m));
    if refused {
        let refusal = REFUSAL.to_owned();
        return Answer {
            completion_tokens: tokens_for_text(&refusal),
            content: String::new(),
            refusal: Some(refusal),
            finish_reason: "stop",
            reasoning_tokens: 0,
            batch_items,
            batch_malformed,
        };
    }
    let content = if config.think_prefix {
        format!("<think>\nThe task lines say what to answer.\n</think>\n\n{content}")
    } else {
        content
    };
    // A reasoning model spends its hidden tokens first, from the same cap.
    let reasoning = config
        .model_overrides
        .get(&prompt.model)
        .and_then(|o| o.reasoning_tokens)
        .unwrap_or(0);
    let reasoning = prompt
        .max_tokens
        .map_or(reasoning, |cap| reasoning.min(cap));
    let cap = prompt.max_tokens.map(|m| m - reasoning);
    let full_tokens = tokens_for_text(&content).max(1);
    match cap {
        Some(max) if full_tokens > max => Answer {
            content: truncate_to_tokens(&content, max),
            refusal: None,
            finish_reason: "length",
            completion_tokens: reasoning + max,
            reasoning_tokens: reasoning,
            batch_items,
            batch_malformed,
        },
        _ => Answer {
            content,
            refusal: None,
            finish_reason: "stop",
            completion_tokens: reasoning + full_tokens,
            reasoning_tokens: reasoning,
            batch_items,
            batch_malformed,
        },
    }
}

/// What a model that declines says.
const REFUSAL: &str = "I'm sorry, I can't help with that request.";

/// Counts a request as abandoned when its handler is dropped before it answered (the
/// client went away, e.g. timed out).
struct Answering<'a> {
    state: &'a SimState,
    answered: bool,
}

impl Drop for Answering<'_> {
    fn drop(&mut self) {
        let mut stats = self.state.stats.lock();
        stats.in_flight = stats.in_flight.saturating_sub(1);
        if !self.answered {
            stats.abandoned += 1;
        }
    }
}

async fn chat_completions(
    State(state): State<Arc<SimState>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    version: axum::http::Version,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    {
        let mut stats = state.stats.lock();
        stats.requests_total += 1;
        stats.http2_requests += u64::from(version == axum::http::Version::HTTP_2);
        stats.in_flight += 1;
        stats.peak_in_flight = stats.peak_in_flight.max(stats.in_flight);
    }
    let mut answering = Answering {
        state: &state,
        answered: false,
    };
    let response = match check_deployment(&state.config(), &headers, query.as_deref()) {
        Err(e) => e.into_response(),
        Ok(()) => chat_pipeline(&state, &headers, &body).await,
    };
    answering.answered = true;
    *state
        .stats
        .lock()
        .by_status
        .entry(response.status().as_u16())
        .or_default() += 1;
    response
}

/// A stage's outcome: on to the next stage, or an early answer (boxed: an
/// answer is large, and rare).
type Stage<T = ()> = Result<T, Box<Response>>;

/// An early answer of a stage.
fn early(answer: impl IntoResponse) -> Box<Response> {
    Box::new(answer.into_response())
}

/// `POST /v1/chat/completions` past its deployment check: the stages of the
/// module's pipeline, in its order. Each stage lets the request on or
/// answers it early (its `Err`).
async fn chat_pipeline(state: &SimState, headers: &HeaderMap, body: &[u8]) -> Response {
    match run_chat_stages(state, headers, body).await {
        Ok(response) => response,
        Err(early) => *early,
    }
}

async fn run_chat_stages(state: &SimState, headers: &HeaderMap, body: &[u8]) -> Stage<Response> {
    let config = state.config();
    let seq = state.seq.fetch_add(1, Ordering::Relaxed);
    injected_status(state, &config)?;
    check_api_key(headers, &config).map_err(early)?;
    let prompt = parse_request(body).map_err(early)?;
    check_model(state, &config, &prompt)?;
    check_context_length(state, &config, &prompt)?;
    check_content_policy(state, &config, &prompt)?;
    let answer = compose_answer(&prompt, &config);
    let limits = RequestLimits::of(&config, &prompt);
    burst_429(state, &config, &limits)?;
    let snapshot = rate_limits(state, &prompt, &answer, &limits)?;
    // Queueing mode: the slot is held through the hang and the latency.
    let _slot = state
        .take_slot(limits.key, config.slots)
        .await
        .map_err(|()| early(shutting_down()))?;
    hang(state, &config).await?;
    latency(state, &config, &prompt, &answer).await?;
    let mut response_headers = HeaderMap::new();
    if limits.headers_on {
        add_limit_headers(&mut response_headers, &snapshot);
    }
    set_header(
        &mut response_headers,
        header::REQUEST_ID,
        format!("req_sim_{seq}"),
    );
    injected_server_error(state, &config, &mut response_headers)?;
    injected_reset(state, &config, seq, &mut response_headers)?;
    injected_malformed(state, &config, &prompt, seq, &mut response_headers)?;
    Ok(answer_response(
        state,
        &config,
        &prompt,
        &answer,
        seq,
        response_headers,
    ))
}

/// `status_override`: every request answered with one status.
fn injected_status(state: &SimState, config: &SimConfig) -> Stage {
    let Some(status) = config.status_override else {
        return Ok(());
    };
    state.stats.lock().injected.status_override += 1;
    let mut response = overridden_response(status);
    if status == 429 && config.rate_limit_headers {
        add_retry_after(response.headers_mut(), Duration::from_secs(1));
    }
    Err(early(response))
}

/// The model: its own injected status, the parameters a reasoning model
/// refuses, and whether it is served at all.
fn check_model(state: &SimState, config: &SimConfig, prompt: &Prompt) -> Stage {
    let overrides = config.model_overrides.get(&prompt.model);
    if let Some(status) = overrides.and_then(|o| o.status_override) {
        state.stats.lock().injected.status_override += 1;
        return Err(early(overridden_response(status)));
    }
    if prompt.sets_max_tokens && overrides.is_some_and(|o| o.reject_max_tokens) {
        return Err(early(error_response(
            StatusCode::BAD_REQUEST,
            "Unsupported parameter: 'max_tokens' is not supported with this model. \
             Use 'max_completion_tokens' instead.",
            error_type::INVALID_REQUEST,
            Some("unsupported_parameter"),
            Some("max_tokens"),
        )));
    }
    if prompt.sets_temperature && overrides.is_some_and(|o| o.reasoning_tokens.is_some()) {
        return Err(early(error_response(
            StatusCode::BAD_REQUEST,
            "Unsupported value: 'temperature' does not support 0.0 with this model. \
             Only the default (1) value is supported.",
            error_type::INVALID_REQUEST,
            Some("unsupported_value"),
            Some("temperature"),
        )));
    }
    match &config.models {
        Some(models) if !models.contains(&prompt.model) => Err(early(error_response(
            StatusCode::NOT_FOUND,
            format!(
                "The model `{}` does not exist or you do not have access to it.",
                prompt.model
            ),
            error_type::INVALID_REQUEST,
            Some(error_code::MODEL_NOT_FOUND),
            Some("model"),
        ))),
        _ => Ok(()),
    }
}

/// A prompt over `context_length`.
fn check_context_length(state: &SimState, config: &SimConfig, prompt: &Prompt) -> Stage {
    match config.context_length {
        Some(limit) if prompt.prompt_tokens > u64::from(limit) => {
            state.stats.lock().injected.context_length += 1;
            Err(early(context_error(
                config.context_error_style,
                limit,
                prompt.prompt_tokens,
            )))
        }
        _ => Ok(()),
    }
}

/// The content policy: a marker in the text, or a share of prompts.
fn check_content_policy(state: &SimState, config: &SimConfig, prompt: &Prompt) -> Stage {
    let marked = config
        .content_policy_marker
        .as_deref()
        .is_some_and(|m| !m.is_empty() && prompt.user.contains(m));
    let by_rate = config.content_policy_rate > 0.0
        && unit_fraction(fnv1a64_parts(&[prompt.user.as_str(), "content-policy"]))
            < config.content_policy_rate;
    if !(marked || by_rate) {
        return Ok(());
    }
    state.stats.lock().injected.content_policy += 1;
    Err(early(error_response(
        StatusCode::BAD_REQUEST,
        "Your request was rejected as a result of our safety system (simulated).",
        error_type::INVALID_REQUEST,
        Some(error_code::CONTENT_POLICY),
        None,
    )))
}

/// The rate limits a request is counted against.
struct RequestLimits<'a> {
    /// The limiter's key: one for every model, or the model's own.
    key: &'a str,
    limits: EffectiveLimits,
    /// Whether answers carry the limits' headers.
    headers_on: bool,
}

impl<'a> RequestLimits<'a> {
    fn of(config: &SimConfig, prompt: &'a Prompt) -> Self {
        RequestLimits {
            key: match config.limit_scope {
                LimitScope::Global => "",
                LimitScope::PerModel => prompt.model.as_str(),
            },
            limits: config.limits_for(&prompt.model),
            headers_on: config.rate_limit_headers,
        }
    }
}

/// `burst_429`: a storm of 429s for part of every period.
fn burst_429(state: &SimState, config: &SimConfig, limits: &RequestLimits<'_>) -> Stage {
    let Some(storm) = config.burst_429 else {
        return Ok(());
    };
    let elapsed = state.burst_epoch.lock().elapsed().as_secs_f64();
    let phase = elapsed % storm.every_s;
    if phase >= storm.duration_s {
        return Ok(());
    }
    state.stats.lock().injected.burst_429 += 1;
    let wait = Duration::from_secs_f64(storm.duration_s - phase);
    let mut response = error_response(
        StatusCode::TOO_MANY_REQUESTS,
        "Rate limit reached: the provider is overloaded (simulated storm).",
        error_type::RATE_LIMIT,
        Some(error_code::RATE_LIMIT_EXCEEDED),
        None,
    );
    if limits.headers_on {
        let mut snapshot = state
            .limiter
            .lock()
            .peek(limits.key, &limits.limits, Instant::now());
        if let Some(r) = snapshot.requests.as_mut() {
            r.remaining = 0;
            r.reset = r.reset.max(wait);
        }
        add_limit_headers(response.headers_mut(), &snapshot);
        add_retry_after(response.headers_mut(), wait);
    }
    Err(early(response))
}

/// The RPM/RPS/TPM buckets: the request's cost taken, or a 429.
fn rate_limits(
    state: &SimState,
    prompt: &Prompt,
    answer: &Answer,
    limits: &RequestLimits<'_>,
) -> Stage<LimitSnapshot> {
    let token_cost = prompt.prompt_tokens + prompt.max_tokens.unwrap_or(answer.completion_tokens);
    let decision =
        state
            .limiter
            .lock()
            .admit(limits.key, &limits.limits, token_cost, Instant::now());
    match decision {
        RateDecision::Allowed(snapshot) => Ok(snapshot),
        RateDecision::Limited {
            kind,
            limit,
            retry_after,
            snapshot,
        } => {
            state.stats.lock().injected.rate_limited += 1;
            let mut response = error_response(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "Rate limit reached for {} in organization sim on {}: Limit {limit}. \
                     Please try again in {}.",
                    prompt.model,
                    kind.describe(),
                    format_reset(retry_after)
                ),
                error_type::RATE_LIMIT,
                Some(error_code::RATE_LIMIT_EXCEEDED),
                None,
            );
            if limits.headers_on {
                add_limit_headers(response.headers_mut(), &snapshot);
                add_retry_after(response.headers_mut(), retry_after);
            }
            Err(early(response))
        }
    }
}

/// `hang_rate`: a request held for `hang_ms` (or until shutdown).
async fn hang(state: &SimState, config: &SimConfig) -> Stage {
    if !fire(&mut state.faults.lock().hang, config.hang_rate) {
        return Ok(());
    }
    state.stats.lock().injected.hangs += 1;
    let duration = (config.hang_ms > 0).then(|| Duration::from_millis(config.hang_ms));
    match state.hold(duration).await {
        true => Ok(()),
        false => Err(early(shutting_down())),
    }
}

/// The latency drawn from the model's distribution, plus the generation
/// time, which grows with the answer.
async fn latency(state: &SimState, config: &SimConfig, prompt: &Prompt, answer: &Answer) -> Stage {
    let generation = Duration::from_secs_f64(
        config.ms_per_output_token.max(0.0) * answer.completion_tokens as f64 / 1000.0,
    );
    let latency = state.sample_latency(config.latency_for(&prompt.model)) + generation;
    match state.hold(Some(latency)).await {
        true => Ok(()),
        false => Err(early(shutting_down())),
    }
}

/// `error_rate`: a 500, 502 or 503 in turn.
fn injected_server_error(
    state: &SimState,
    config: &SimConfig,
    response_headers: &mut HeaderMap,
) -> Stage {
    let server_error = {
        let mut faults = state.faults.lock();
        if fire(&mut faults.error, config.error_rate) {
            faults.errors_sent += 1;
            Some(faults.errors_sent)
        } else {
            None
        }
    };
    let Some(n) = server_error else {
        return Ok(());
    };
    state.stats.lock().injected.server_errors += 1;
    let status = match n % 3 {
        1 => StatusCode::INTERNAL_SERVER_ERROR,
        2 => StatusCode::BAD_GATEWAY,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    let mut response = error_response(
        status,
        "The server had an error while processing your request (simulated).",
        error_type::SERVER,
        None,
        None,
    );
    response
        .headers_mut()
        .extend(std::mem::take(response_headers));
    Err(early(response))
}

/// `reset_rate`: the start of a completion, then the connection dropped
/// mid-body.
fn injected_reset(
    state: &SimState,
    config: &SimConfig,
    seq: u64,
    response_headers: &mut HeaderMap,
) -> Stage {
    if !fire(&mut state.faults.lock().reset, config.reset_rate) {
        return Ok(());
    }
    state.stats.lock().injected.resets += 1;
    response_headers.insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let start = format!("{{\"id\":\"chatcmpl-sim-{seq}\",\"object\":\"chat.completion\",");
    let cut = async {
        // After the headers and the first bytes went out.
        tokio::time::sleep(Duration::from_millis(20)).await;
        Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "simulated reset",
        ))
    };
    let parts = futures::StreamExt::chain(
        futures::stream::once(async { Ok(bytes::Bytes::from(start)) }),
        futures::stream::once(cut),
    );
    let body = axum::body::Body::from_stream(parts);
    Err(early((
        StatusCode::OK,
        std::mem::take(response_headers),
        body,
    )))
}

/// `malformed_rate`: a 200 whose body is cut short or lacks `choices`, in
/// turn (the call counts as served: a provider bills it).
fn injected_malformed(
    state: &SimState,
    config: &SimConfig,
    prompt: &Prompt,
    seq: u64,
    response_headers: &mut HeaderMap,
) -> Stage {
    let malformed = {
        let mut faults = state.faults.lock();
        if fire(&mut faults.malformed, config.malformed_rate) {
            faults.malformed_sent += 1;
            Some(faults.malformed_sent)
        } else {
            None
        }
    };
    let Some(n) = malformed else {
        return Ok(());
    };
    record_success(state, prompt, None);
    state.stats.lock().injected.malformed += 1;
    let body = if n % 2 == 1 {
        format!(
            "{{\"id\":\"chatcmpl-sim-{seq}\",\"object\":\"chat.completion\",\"choices\":[{{\"index\":0,"
        )
    } else {
        json!({
            "id": format!("chatcmpl-sim-{seq}"),
            "object": "chat.completion",
            "model": prompt.model,
        })
        .to_string()
    };
    response_headers.insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Err(early((
        StatusCode::OK,
        std::mem::take(response_headers),
        body,
    )))
}

/// The answer: the completion, its usage (cached tokens when the system
/// prompt was seen recently) and the call counted as served.
fn answer_response(
    state: &SimState,
    config: &SimConfig,
    prompt: &Prompt,
    answer: &Answer,
    seq: u64,
    response_headers: HeaderMap,
) -> Response {
    let cached_tokens = if prompt.system.is_empty() {
        0
    } else {
        let seen = state.prompt_cache.lock().check_and_insert(
            fnv1a64(prompt.system.as_bytes()),
            config.prompt_cache_entries,
        );
        if seen {
            prompt.system_tokens
        } else {
            0
        }
    };
    record_success(state, prompt, Some((answer, cached_tokens)));
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let request_hash = fnv1a64_parts(&[
        prompt.model.as_str(),
        prompt.system.as_str(),
        prompt.user.as_str(),
    ]);
    let content = match answer.refusal {
        Some(_) => Value::Null,
        None => Value::String(answer.content.clone()),
    };
    let mut body = json!({
        "id": format!("chatcmpl-sim-{request_hash:016x}-{seq}"),
        "object": "chat.completion",
        "created": created,
        "model": prompt.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": content, "refusal": answer.refusal },
            "logprobs": null,
            "finish_reason": answer.finish_reason,
        }],
        "usage": {
            "prompt_tokens": prompt.prompt_tokens,
            "completion_tokens": answer.completion_tokens,
            "total_tokens": prompt.prompt_tokens + answer.completion_tokens,
            "prompt_tokens_details": { "cached_tokens": cached_tokens },
            "completion_tokens_details": { "reasoning_tokens": answer.reasoning_tokens },
        },
    });
    if config.omit_usage {
        body["usage"] = Value::Null;
    }
    (StatusCode::OK, response_headers, Json(body)).into_response()
}

/// A prompt over the context, answered as OpenAI, vLLM or llama.cpp's server does.
fn context_error(style: ContextErrorStyle, limit: u32, tokens: u64) -> Response {
    match style {
        ContextErrorStyle::Openai => error_response(
            StatusCode::BAD_REQUEST,
            format!(
                "This model's maximum context length is {limit} tokens. However, your \
                 messages resulted in {tokens} tokens. Please reduce the length of the messages."
            ),
            error_type::INVALID_REQUEST,
            Some(error_code::CONTEXT_LENGTH),
            Some("messages"),
        ),
        ContextErrorStyle::Vllm => (
            StatusCode::BAD_REQUEST,
            Json(json!({
                "object": "error",
                "message": format!(
                    "This model's maximum context length is {limit} tokens. However, you \
                     requested {tokens} tokens in the messages. Please reduce the length of \
                     the messages or completion."
                ),
                "type": "BadRequestError",
                "param": null,
                "code": 400,
            })),
        )
            .into_response(),
        ContextErrorStyle::LlamaCpp => (
            StatusCode::BAD_REQUEST,
            Json(json!({
                "error": {
                    "code": 400,
                    "message": "the request exceeds the available context size, try increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": tokens,
                    "n_ctx": limit,
                }
            })),
        )
            .into_response(),
    }
}

/// Counts a 200 answer; `usage` is absent for malformed bodies (which report none).
fn record_success(state: &SimState, prompt: &Prompt, usage: Option<(&Answer, u64)>) {
    state.calls.lock().record(&prompt.user);
    let mut stats = state.stats.lock();
    stats.served_ok += 1;
    stats.count_model(&prompt.model);
    if let Some((answer, cached)) = usage {
        stats.prompt_tokens += prompt.prompt_tokens;
        stats.completion_tokens += answer.completion_tokens;
        stats.cached_tokens += cached;
        if let Some(items) = answer.batch_items {
            stats.batch_requests += 1;
            stats.batch_items += items as u64;
            if answer.batch_malformed {
                stats.injected.batch_malformed += 1;
            }
        }
    }
}

fn shutting_down() -> Response {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "The simulated provider is shutting down.",
        error_type::SERVER,
        None,
        None,
    )
}

async fn list_models(State(state): State<Arc<SimState>>, headers: HeaderMap) -> Response {
    let config = state.config();
    if let Some(status) = config.status_override {
        return overridden_response(status);
    }
    if let Err(error) = check_api_key(&headers, &config) {
        return error.into_response();
    }
    let names: Vec<String> = match &config.models {
        Some(models) => models.clone(),
        None => {
            let mut names: Vec<String> = config.model_overrides.keys().cloned().collect();
            for model in state.stats.lock().by_model.keys() {
                if !names.contains(model) {
                    names.push(model.clone());
                }
            }
            names
        }
    };
    let data: Vec<Value> = names
        .iter()
        .map(|id| json!({ "id": id, "object": "model", "created": 0, "owned_by": "sluice-sim" }))
        .collect();
    Json(json!({ "object": "list", "data": data })).into_response()
}

async fn admin_stats(State(state): State<Arc<SimState>>) -> Json<SimStats> {
    Json(state.stats())
}

async fn admin_get_config(State(state): State<Arc<SimState>>) -> Json<SimConfig> {
    Json((*state.config()).clone())
}

/// Query of `PUT /admin/config`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PutConfigQuery {
    /// Replace the whole configuration instead of merging the given top-level fields.
    replace: bool,
}

async fn admin_put_config(
    State(state): State<Arc<SimState>>,
    Query(query): Query<PutConfigQuery>,
    body: Bytes,
) -> Response {
    let invalid = |message: String| {
        error_response(
            StatusCode::BAD_REQUEST,
            message,
            error_type::INVALID_REQUEST,
            Some(error_code::INVALID_CONFIG),
            None,
        )
    };
    let patch: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return invalid(format!("config body is not JSON: {e}")),
    };
    let new = if query.replace {
        SimConfig::from_json_value(patch)
    } else {
        state.config().merged_with(patch)
    };
    let applied = new.and_then(|config| {
        state.set_config(config.clone())?;
        Ok(config)
    });
    match applied {
        Ok(config) => Json(config).into_response(),
        Err(e) => invalid(e.to_string()),
    }
}

async fn admin_reset(State(state): State<Arc<SimState>>) -> StatusCode {
    state.reset();
    StatusCode::NO_CONTENT
}

/// Query of `GET /admin/calls`.
#[derive(Debug, Deserialize)]
struct CallsQuery {
    contains: Option<String>,
}

async fn admin_calls(
    State(state): State<Arc<SimState>>,
    Query(query): Query<CallsQuery>,
) -> Response {
    let Some(needle) = query.contains else {
        return invalid_request("missing query parameter 'contains'", Some("contains"))
            .into_response();
    };
    let (calls, matched) = state.calls_containing(&needle);
    Json(json!({ "contains": needle, "calls": calls, "matched_contents": matched })).into_response()
}

async fn healthz() -> &'static str {
    "ok"
}

async fn unknown_url(method: Method, uri: Uri) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        format!("Unknown request URL: {method} {}", uri.path()),
        error_type::INVALID_REQUEST,
        Some(error_code::UNKNOWN_URL),
        None,
    )
}
