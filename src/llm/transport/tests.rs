//! Transport tests: a real HTTP round trip against a tiny axum server with canned answers, and
//! the configuration errors caught when a provider is built.

use super::*;
use crate::llm::error::{ErrorClass, PermanentKind};
use crate::llm::wire::{Message, ResponseFormat, Usage};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use parking_lot::Mutex;
use serde_json::json;
use std::sync::Arc;

// --- HTTP round trip --------------------------------------------------------------------

#[derive(Default)]
struct Seen {
    auth: Vec<Option<String>>,
    bodies: Vec<serde_json::Value>,
}

fn canned(model: &str) -> Response {
    let err = |status: StatusCode, body: serde_json::Value| (status, Json(body)).into_response();
    match model {
        "ok" => {
            let mut r = Json(json!({
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 120, "completion_tokens": 8, "total_tokens": 128,
                          "prompt_tokens_details": {"cached_tokens": 64}}
            }))
            .into_response();
            let h = r.headers_mut();
            h.insert("x-ratelimit-limit-requests", HeaderValue::from_static("50"));
            h.insert(
                "x-ratelimit-remaining-requests",
                HeaderValue::from_static("49"),
            );
            h.insert(
                "x-ratelimit-reset-requests",
                HeaderValue::from_static("20ms"),
            );
            h.insert(
                "x-ratelimit-remaining-tokens",
                HeaderValue::from_static("9000"),
            );
            h.insert(
                "x-ratelimit-reset-tokens",
                HeaderValue::from_static("1m30s"),
            );
            r
        }
        "no-cache-details" => Json(json!({
            "choices": [{"message": {"content": "hi"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1}
        }))
        .into_response(),
        "limited" => {
            let mut r = err(
                StatusCode::TOO_MANY_REQUESTS,
                json!({"error": {"message": "Rate limit reached", "type": "requests",
                                 "code": "rate_limit_exceeded"}}),
            );
            let h = r.headers_mut();
            h.insert("retry-after", HeaderValue::from_static("1"));
            h.insert("retry-after-ms", HeaderValue::from_static("340"));
            h.insert(
                "x-ratelimit-remaining-requests",
                HeaderValue::from_static("0"),
            );
            h.insert(
                "x-ratelimit-reset-requests",
                HeaderValue::from_static("0.34s"),
            );
            r
        }
        "policy" => err(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": "Your request was rejected", "type":
                             "invalid_request_error", "code": "content_policy_violation"}}),
        ),
        "huge" => err(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": "maximum context length is 8192 tokens",
                             "type": "invalid_request_error", "code": "context_length_exceeded"}}),
        ),
        "vllm" => err(
            StatusCode::BAD_REQUEST,
            json!({"object": "error", "message": "bad temperature", "type": "BadRequestError",
                   "code": 400}),
        ),
        "unauthorized" => err(
            StatusCode::UNAUTHORIZED,
            json!({"error": {"message": "Incorrect API key", "type": "invalid_request_error",
                             "code": "invalid_api_key"}}),
        ),
        "gone" => err(
            StatusCode::NOT_FOUND,
            json!({"error": {"message": "model does not exist", "code": "model_not_found"}}),
        ),
        "unavailable" => (StatusCode::SERVICE_UNAVAILABLE, "upstream overloaded").into_response(),
        "malformed" => (StatusCode::OK, "{\"choices\": [").into_response(),
        "no-usage" => Json(json!({"choices": [{"message": {"content": "x"}}]})).into_response(),
        "filtered" => Json(json!({
            "choices": [{"message": {"content": null}, "finish_reason": "content_filter"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 0}
        }))
        .into_response(),
        // Over the response limit: announced, and streamed without a length.
        "huge-announced" => (StatusCode::OK, vec![b' '; MAX_RESPONSE_BYTES + 1]).into_response(),
        "huge-streamed" => {
            let chunk = bytes::Bytes::from(vec![b' '; 1 << 20]);
            let chunks = (0..(MAX_RESPONSE_BYTES >> 20) + 2)
                .map(move |_| Ok::<_, std::convert::Infallible>(chunk.clone()));
            axum::body::Body::from_stream(futures::stream::iter(chunks)).into_response()
        }
        _ => (StatusCode::IM_A_TEAPOT, "?").into_response(),
    }
}

async fn serve() -> (String, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let s = seen.clone();
    let app = Router::new().route(
        "/v1/chat/completions",
        post(
            move |headers: axum::http::HeaderMap, Json(body): Json<serde_json::Value>| {
                let s = s.clone();
                async move {
                    let auth = headers
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string);
                    let model = body["model"].as_str().unwrap_or_default().to_string();
                    let mut seen = s.lock();
                    seen.auth.push(auth);
                    seen.bodies.push(body);
                    canned(&model)
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), seen)
}

fn request(model: &str) -> ChatRequest {
    ChatRequest {
        model: model.into(),
        messages: vec![Message::system("Task: summarize"), Message::user("text")],
        max_tokens: Some(64),
        max_completion_tokens: None,
        temperature: Some(0.0),
        response_format: Some(ResponseFormat::JsonObject),
    }
}

fn provider(base: &str, key: Option<&str>) -> HttpProvider {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ProviderConfig::new("test", base);
    if let Some(k) = key {
        let path = dir.path().join("key");
        std::fs::write(&path, k).unwrap();
        cfg.api_key_file = Some(path);
    }
    HttpProvider::new(&cfg).unwrap()
}

#[tokio::test]
async fn success_parses_content_usage_cached_tokens_and_headers() {
    let (base, seen) = serve().await;
    let p = provider(&base, Some("sk-test"));
    let r = p.chat(&request("ok")).await.unwrap();
    assert_eq!(r.content, "hello");
    assert_eq!(
        r.usage,
        Usage {
            prompt_tokens: 120,
            completion_tokens: 8,
            cached_tokens: 64,
            cache_write_tokens: 0
        }
    );
    assert_eq!(r.finish_reason.as_deref(), Some("stop"));
    assert_eq!(r.rate_limit.limit_requests, Some(50));
    assert_eq!(r.rate_limit.remaining_requests, Some(49));
    assert_eq!(r.rate_limit.reset_requests, Some(Duration::from_millis(20)));
    assert_eq!(r.rate_limit.remaining_tokens, Some(9000));
    assert_eq!(r.rate_limit.reset_tokens, Some(Duration::from_secs(90)));
    {
        let seen = seen.lock();
        assert_eq!(seen.auth[0].as_deref(), Some("Bearer sk-test"));
        let body = &seen.bodies[0];
        assert_eq!(body["model"], "ok");
        assert_eq!(body["messages"][0]["role"], "system");
        assert_eq!(body["messages"][1]["content"], "text");
        assert_eq!(body["max_tokens"], 64);
        assert_eq!(body["response_format"]["type"], "json_object");
    }

    // Without prompt_tokens_details, cached tokens are 0; base URL with /v1 works too.
    let p = provider(&format!("{base}/v1/"), None);
    let r = p.chat(&request("no-cache-details")).await.unwrap();
    assert_eq!(r.usage.cached_tokens, 0);
    assert_eq!(r.finish_reason.as_deref(), Some("length"));
    assert!(r.rate_limit.is_empty());
}

#[tokio::test]
async fn error_answers_are_classified() {
    let (base, seen) = serve().await;
    let p = provider(&base, None);

    let err = p.chat(&request("limited")).await.unwrap_err();
    assert_eq!(
        err.class(),
        ErrorClass::RateLimited {
            retry_after: Some(Duration::from_millis(340))
        }
    );
    let rl = err.rate_limit().unwrap();
    assert_eq!(rl.remaining_requests, Some(0));
    assert_eq!(rl.reset_requests, Some(Duration::from_millis(340)));

    let expect = [
        (
            "policy",
            ErrorClass::Permanent(PermanentKind::ContentPolicy),
        ),
        ("huge", ErrorClass::Permanent(PermanentKind::TooLarge)),
        ("vllm", ErrorClass::Permanent(PermanentKind::BadRequest)),
        ("unauthorized", ErrorClass::Config),
        ("gone", ErrorClass::Config),
        ("unavailable", ErrorClass::Transient),
        ("malformed", ErrorClass::Malformed),
        (
            "filtered",
            ErrorClass::Permanent(PermanentKind::ContentPolicy),
        ),
    ];
    for (model, class) in expect {
        let err = p.chat(&request(model)).await.unwrap_err();
        assert_eq!(err.class(), class, "{model}: {err:?}");
    }
    // An answer without usage is an answer (its usage is estimated by the
    // client), not a malformed body.
    let answered = p.chat(&request("no-usage")).await.unwrap();
    assert_eq!(
        (answered.content.as_str(), answered.usage_missing),
        ("x", true)
    );
    let err = p.chat(&request("vllm")).await.unwrap_err();
    match err {
        LlmError::Status {
            status,
            code,
            kind,
            message,
            ..
        } => {
            assert_eq!(status, 400);
            assert_eq!(code.as_deref(), Some("400"));
            assert_eq!(kind.as_deref(), Some("BadRequestError"));
            assert_eq!(message, "bad temperature");
        }
        other => panic!("{other:?}"),
    }
    // No key configured: no Authorization header.
    assert!(seen.lock().auth.iter().all(Option::is_none));
}

/// A body over the limit is a classified failure, read no further than
/// the limit (or not at all, when its length says so).
#[tokio::test]
async fn a_response_over_the_size_limit_is_malformed_not_read_whole() {
    let (base, _) = serve().await;
    let p = provider(&base, None);
    for model in ["huge-announced", "huge-streamed"] {
        let err = p.chat(&request(model)).await.unwrap_err();
        assert!(
            matches!(&err, LlmError::Malformed(m) if m.contains("MiB")),
            "{model}: {err:?}"
        );
    }
}

#[tokio::test]
async fn connection_refused_is_transient() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let p = provider(&format!("http://{addr}"), None);
    let err = p.chat(&request("ok")).await.unwrap_err();
    assert!(matches!(err, LlmError::Connect(_)), "{err:?}");
    assert_eq!(err.class(), ErrorClass::Transient);
}

#[test]
fn unusable_base_urls_and_keys_are_config_errors_at_start() {
    for base in ["ftp://example.com/v1", "not a url", "/v1"] {
        let err = HttpProvider::new(&ProviderConfig::new("p", base)).unwrap_err();
        assert!(matches!(err, LlmError::Config(_)), "{base}: {err:?}");
        assert!(err.to_string().contains("base_url"), "{base}: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("key");
    std::fs::write(&path, "sk-sec\u{7f}ret").unwrap();
    let mut cfg = ProviderConfig::new("p", "https://example.com/v1");
    cfg.api_key_file = Some(path);
    let err = HttpProvider::new(&cfg).unwrap_err();
    assert!(matches!(err, LlmError::Config(_)), "{err:?}");
    assert!(err.to_string().contains("API key"), "{err}");
    assert!(!err.to_string().contains("sk-sec"), "{err}");
}

// --- HTTP/2 -----------------------------------------------------------------------------

/// `calls` requests at once through a provider configured as `cfg` to a simulator answering
/// after 1.5 s: the simulator's view of them, and the provider.
async fn at_once(mut cfg: ProviderConfig, calls: usize) -> (crate::sim::SimStats, HttpProvider) {
    let sim = crate::sim::start(
        crate::sim::SimConfig {
            latency: crate::sim::Latency::Fixed { ms: 1_500 },
            ..Default::default()
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    cfg.base_url = sim.base_url();
    let provider = Arc::new(HttpProvider::new(&cfg).unwrap());
    let tasks: Vec<_> = (0..calls)
        .map(|i| {
            let p = provider.clone();
            tokio::spawn(async move { p.chat(&request(&format!("m{i}"))).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().expect("answered");
    }
    let stats = sim.stats();
    sim.shutdown().await;
    (stats, Arc::try_unwrap(provider).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_calls_share_connections_each_within_its_stream_limit() {
    // The simulator (hyper's server) allows 200 streams per connection: 250
    // calls at once fit only when they are spread over connections.
    let mut cfg = ProviderConfig::new("sim", "http://127.0.0.1:1");
    cfg.http2 = true;
    cfg.http2_max_streams = 100;
    let (stats, p) = at_once(cfg, 250).await;
    assert_eq!(stats.http2_requests, 250, "{stats:?}");
    assert_eq!(
        stats.peak_in_flight, 250,
        "every call went out at once: {stats:?}"
    );
    assert_eq!(
        p.http2_connections(),
        Some(3),
        "250 calls of at most 100 a connection"
    );

    // The default: HTTP/1.1, a connection per call.
    let cfg = ProviderConfig::new("sim", "http://127.0.0.1:1");
    let (stats, p) = at_once(cfg, 250).await;
    assert_eq!(stats.http2_requests, 0, "{stats:?}");
    assert_eq!(stats.served_ok, 250);
    assert_eq!(p.http2_connections(), None);
}

/// The context-length errors of vLLM's and llama.cpp's servers, as the
/// simulator answers them, are `too_large` to the client.
#[tokio::test]
async fn context_errors_in_other_servers_shapes_are_too_large() {
    for style in [
        crate::sim::ContextErrorStyle::Vllm,
        crate::sim::ContextErrorStyle::LlamaCpp,
    ] {
        let sim = crate::sim::start(
            crate::sim::SimConfig {
                context_length: Some(10),
                context_error_style: style,
                ..Default::default()
            },
            "127.0.0.1:0".parse().unwrap(),
        )
        .await
        .unwrap();
        let p = provider(&sim.base_url(), None);
        let mut req = request("sim-small");
        req.messages[1] = Message::user("long ".repeat(100));
        let err = p.chat(&req).await.expect_err("over the context");
        assert_eq!(
            err.class(),
            ErrorClass::Permanent(PermanentKind::TooLarge),
            "{style:?}: {err:?}"
        );
        sim.shutdown().await;
    }
}
