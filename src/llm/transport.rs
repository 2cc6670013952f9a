//! The provider hop: the [`ChatTransport`] trait and [`HttpProvider`], the HTTP client of an
//! OpenAI-compatible `/v1/chat/completions` endpoint.
//!
//! Works with OpenAI, Groq, vLLM, llama.cpp server and Ollama. The API key is held in a
//! [`Secret`](super::secret::Secret) and never appears in `Debug`, `Display` or error text.

use std::time::Duration;

use futures::future::BoxFuture;

use super::config::ProviderConfig;
use super::error::{parse_error_body, LlmError};
use super::ratelimit::RateLimitInfo;
use super::wire::{parse_chat_body, ChatRequest, ChatResponse};

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
