//! The provider hop: the [`ChatTransport`] trait and [`HttpProvider`], the HTTP client of an
//! OpenAI-compatible `/v1/chat/completions` endpoint.
//!
//! Works with OpenAI, Groq, vLLM, llama.cpp server and Ollama. The API key is held in a
//! [`Secret`](super::secret::Secret) and never appears in `Debug`, `Display` or error text.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
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

type Body = http_body_util::Full<bytes::Bytes>;
type Connector = hyper_util::client::legacy::connect::HttpConnector;
type Tunnel = hyper_util::client::legacy::connect::proxy::Tunnel<Connector>;

/// How a provider's calls reach it: HTTP/1.1, a connection per call in flight, or HTTP/2,
/// calls sharing connections.
#[derive(Debug, Clone)]
enum Http {
    One(Box<HyperClient>),
    Shared(Arc<Multiplexed>),
}

impl Http {
    async fn exchange(
        &self,
        req: http::Request<Body>,
    ) -> Result<(u16, RateLimitInfo, bytes::Bytes), LlmError> {
        match self {
            Http::One(client) => client.exchange(req).await,
            Http::Shared(lanes) => {
                let lane = lanes.take();
                lane.0.client.exchange(req).await
            }
        }
    }
}

/// HTTP/2 calls spread over connections of at most `streams` calls each. Each connection is
/// a client of its own (hyper's pool keeps one HTTP/2 connection per client, and connects it
/// again when it drops or idles out); a call takes the first with room, and a client is added
/// when every one is full, so a server's limit on concurrent streams never makes calls wait
/// inside a connection while another could carry them.
struct Multiplexed {
    build: Box<dyn Fn() -> HyperClient + Send + Sync>,
    streams: usize,
    lanes: parking_lot::Mutex<Vec<Arc<Lane>>>,
}

struct Lane {
    client: HyperClient,
    calls: AtomicUsize,
}

/// A call's place on a lane, given back when the call ends.
struct LaneCall(Arc<Lane>);

impl Drop for LaneCall {
    fn drop(&mut self) {
        self.0.calls.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Multiplexed {
    fn take(&self) -> LaneCall {
        let mut lanes = self.lanes.lock();
        let lane = match lanes
            .iter()
            .find(|l| l.calls.load(Ordering::Relaxed) < self.streams)
        {
            Some(lane) => lane.clone(),
            None => {
                let lane = Arc::new(Lane {
                    client: (self.build)(),
                    calls: AtomicUsize::new(0),
                });
                lanes.push(lane.clone());
                lane
            }
        };
        // Counted under the lock: two calls never both take a lane's last place.
        lane.calls.fetch_add(1, Ordering::Relaxed);
        LaneCall(lane)
    }
}

impl std::fmt::Debug for Multiplexed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Multiplexed")
            .field("streams", &self.streams)
            .field("lanes", &self.lanes.lock().len())
            .finish()
    }
}

/// The connection-pooling HTTP client of a provider (TLS when the URL says `https`),
/// directly or through a proxy's `CONNECT` tunnel.
#[derive(Debug, Clone)]
enum HyperClient {
    Direct(hyper_util::client::legacy::Client<hyper_tls::HttpsConnector<Connector>, Body>),
    Proxied(hyper_util::client::legacy::Client<hyper_tls::HttpsConnector<Tunnel>, Body>),
}

impl HyperClient {
    /// Sends `req`: the answer's status, rate-limit headers and body.
    async fn exchange(
        &self,
        req: http::Request<Body>,
    ) -> Result<(u16, RateLimitInfo, bytes::Bytes), LlmError> {
        match self {
            HyperClient::Direct(c) => exchange(c, req).await,
            HyperClient::Proxied(c) => exchange(c, req).await,
        }
    }
}

async fn exchange<C>(
    client: &hyper_util::client::legacy::Client<C, Body>,
    req: http::Request<Body>,
) -> Result<(u16, RateLimitInfo, bytes::Bytes), LlmError>
where
    C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
{
    use http_body_util::BodyExt as _;
    let response = client.request(req).await.map_err(map_client_error)?;
    let status = response.status().as_u16();
    let rate_limit = RateLimitInfo::from_headers(response.headers());
    // Read at most MAX_RESPONSE_BYTES: a server sending more (or saying it
    // will) is answering off-contract, not something to hold in memory.
    let announced = response
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if announced.is_some_and(|n| n > MAX_RESPONSE_BYTES as u64) {
        return Err(too_large_response());
    }
    let body = http_body_util::Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                too_large_response()
            } else {
                LlmError::Transport(format!("reading the response: {e}"))
            }
        })?
        .to_bytes();
    Ok((status, rate_limit, body))
}

/// Bytes hyper reads from a provider's connection at a time.
const READ_BUF_BYTES: usize = 2048;

/// The most of a response body read (a batch of the largest answers is a
/// few megabytes).
pub const MAX_RESPONSE_BYTES: usize = 32 << 20;

fn too_large_response() -> LlmError {
    LlmError::Malformed(format!(
        "the response body is over {} MiB",
        MAX_RESPONSE_BYTES >> 20
    ))
}

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
    /// `Authorization: Bearer …` (or the configured key header), marked sensitive.
    auth: Option<(http::HeaderName, http::HeaderValue)>,
    /// Extra headers of every request.
    headers: http::HeaderMap,
    http: Http,
}

impl HttpProvider {
    /// Builds the client, reading the API key from the configured env var or file.
    pub fn new(config: &ProviderConfig) -> Result<Self, LlmError> {
        let api_key = config.resolve_api_key()?;
        let invalid = |e: &dyn std::fmt::Display| {
            LlmError::Config(format!("provider {}: invalid base_url: {e}", config.name))
        };
        let url = with_query(&completions_url(&config.base_url), &config.query)
            .map_err(|e| invalid(&e))?;
        let bad = |key: &str, what: &str| {
            LlmError::Config(format!("provider {}: {key}: {what}", config.name))
        };
        let key_header = match &config.api_key_header {
            None => http::header::AUTHORIZATION,
            Some(h) => http::HeaderName::try_from(h.as_str())
                .map_err(|_| bad("api_key_header", "not a valid header name"))?,
        };
        let mut headers = http::HeaderMap::new();
        for (k, v) in &config.headers {
            let name = http::HeaderName::try_from(k.as_str())
                .map_err(|_| bad(&format!("headers.{k}"), "not a valid header name"))?;
            let value = http::HeaderValue::try_from(v.as_str())
                .map_err(|_| bad(&format!("headers.{k}"), "not a valid header value"))?;
            headers.insert(name, value);
        }
        let uri: http::Uri = url.parse().map_err(|e| invalid(&e))?;
        match uri.scheme_str() {
            Some("http" | "https") if uri.host().is_some() => {}
            _ => return Err(invalid(&"expected http:// or https:// and a host")),
        }
        let auth = api_key
            .map(|key| {
                let value = match config.api_key_header {
                    None => format!("Bearer {}", key.expose()),
                    Some(_) => key.expose().to_string(),
                };
                let mut v = http::HeaderValue::try_from(value).map_err(|_| {
                    LlmError::Config(format!(
                        "provider {}: the API key is not a valid header value",
                        config.name
                    ))
                })?;
                v.set_sensitive(true);
                Ok::<_, LlmError>((key_header.clone(), v))
            })
            .transpose()?;
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.enforce_http(false);
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_millis(config.connect_timeout_ms)));
        let mut tls = hyper_tls::native_tls::TlsConnector::builder();
        if config.http2 {
            // HTTP/2 over TLS is agreed in the handshake (RFC 9113, 3.2).
            tls.request_alpns(&["h2"]);
        }
        let tls = tls
            .build()
            .map_err(|e| LlmError::Config(format!("http client: tls: {e}")))?;
        let mut builder =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new());
        builder.pool_max_idle_per_host(config.max_idle_connections);
        // Each HTTP/1.1 call in flight holds a connection, and hyper's
        // adaptive read buffer starts at 8 KiB, reserved while the call waits
        // for its answer. Reads of 2 KiB take a typical answer (headers and a
        // short completion) in one or two reads and keep a waiting call's
        // buffer small; longer answers are read in more of them.
        builder.http1_read_buf_exact_size(READ_BUF_BYTES);
        builder.http2_only(config.http2);
        let proxy = proxy_for(config, &uri)?;
        let build = move || match &proxy {
            None => HyperClient::Direct(builder.build(hyper_tls::HttpsConnector::from((
                connector.clone(),
                tls.clone().into(),
            )))),
            Some((proxy, auth)) => {
                let mut tunnel = Tunnel::new(proxy.clone(), connector.clone());
                if let Some(auth) = auth {
                    tunnel = tunnel.with_auth(auth.clone());
                }
                HyperClient::Proxied(builder.build(hyper_tls::HttpsConnector::from((
                    tunnel,
                    tls.clone().into(),
                ))))
            }
        };
        let http = if config.http2 {
            Http::Shared(Arc::new(Multiplexed {
                build: Box::new(build),
                streams: config.http2_max_streams.max(1),
                lanes: Default::default(),
            }))
        } else {
            Http::One(Box::new(build()))
        };
        Ok(Self {
            name: config.name.clone(),
            url,
            uri,
            auth,
            headers,
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

    /// HTTP/2 connections opened so far (each carries up to `http2_max_streams` calls);
    /// `None` over HTTP/1.1.
    pub fn http2_connections(&self) -> Option<usize> {
        match &self.http {
            Http::One(_) => None,
            Http::Shared(lanes) => Some(lanes.lanes.lock().len()),
        }
    }

    /// Sends one chat completion request.
    pub async fn chat(&self, request: &ChatRequest) -> Result<ChatResponse, LlmError> {
        let body = serde_json::to_vec(request)
            .map_err(|e| LlmError::Transport(format!("request body: {e}")))?;
        let mut builder =
            http::Request::post(self.uri.clone()).header(http::header::CONTENT_TYPE, JSON);
        if let Some((name, value)) = &self.auth {
            builder = builder.header(name, value.clone());
        }
        if let Some(h) = builder.headers_mut() {
            h.extend(self.headers.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        let req = builder
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .map_err(|e| LlmError::Transport(e.to_string()))?;
        let (status, rate_limit, body) = self.http.exchange(req).await?;
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

/// The proxy the provider's requests go through, with its credentials: the configured one
/// (`"none"`: none), else the one the environment gives for `uri`.
fn proxy_for(
    config: &ProviderConfig,
    uri: &http::Uri,
) -> Result<Option<(http::Uri, Option<http::HeaderValue>)>, LlmError> {
    use hyper_util::client::proxy::matcher::Matcher;
    let matcher = match config.proxy.as_ref().map(|p| p.expose()) {
        Some("none") => return Ok(None),
        Some(p) => {
            let ok = p
                .parse::<http::Uri>()
                .is_ok_and(|u| matches!(u.scheme_str(), Some("http")) && u.host().is_some());
            if !ok {
                return Err(LlmError::Config(format!(
                    "provider {}: proxy: expected http://host:port",
                    config.name
                )));
            }
            Matcher::builder().all(p.to_string()).build()
        }
        None => Matcher::from_env(),
    };
    Ok(matcher
        .intercept(uri)
        .map(|i| (i.uri().clone(), i.basic_auth().cloned())))
}

/// `base_url` may or may not already end in `/v1`; one ending in `/chat/completions` is
/// the endpoint itself.
fn completions_url(base_url: &str) -> String {
    let base = base_url.trim_end_matches('/');
    if base.ends_with("/chat/completions") {
        base.to_string()
    } else if base.ends_with("/v1") {
        format!("{base}/chat/completions")
    } else {
        format!("{base}/v1/chat/completions")
    }
}

/// `url` with `query` appended (percent-encoded).
fn with_query(
    url: &str,
    query: &std::collections::BTreeMap<String, String>,
) -> Result<String, String> {
    if query.is_empty() {
        return Ok(url.to_string());
    }
    let mut u = reqwest::Url::parse(url).map_err(|e| e.to_string())?;
    u.query_pairs_mut().extend_pairs(query.iter());
    Ok(u.to_string())
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
