//! Tests of the composed client with a scripted transport on paused time.

use super::*;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};

/// Answers from a script; `None` entries hang forever.
#[derive(Default)]
struct Scripted {
    script: Mutex<VecDeque<Option<Result<ChatResponse, LlmError>>>>,
    calls: AtomicU32,
    /// The requests sent, in order.
    seen: Mutex<Vec<ChatRequest>>,
}

impl Scripted {
    fn new(items: Vec<Option<Result<ChatResponse, LlmError>>>) -> Arc<Self> {
        Arc::new(Self {
            script: Mutex::new(items.into()),
            calls: AtomicU32::new(0),
            seen: Mutex::default(),
        })
    }
}

impl ChatTransport for Scripted {
    fn send<'a>(
        &'a self,
        request: &'a ChatRequest,
    ) -> BoxFuture<'a, Result<ChatResponse, LlmError>> {
        assert_eq!(request.model, "upstream-small");
        self.seen.lock().push(request.clone());
        self.calls.fetch_add(1, Ordering::SeqCst);
        let next = self.script.lock().pop_front().flatten();
        Box::pin(async move {
            match next {
                Some(r) => r,
                None => futures::future::pending().await,
            }
        })
    }
}

fn answer() -> Option<Result<ChatResponse, LlmError>> {
    Some(Ok(ChatResponse {
        content: "done".into(),
        usage: Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
            cached_tokens: 0,
            cache_write_tokens: 0,
        },
        usage_missing: false,
        finish_reason: Some("stop".into()),
        refusal: None,
        rate_limit: RateLimitInfo::default(),
    }))
}

fn status(code: u16, retry_after: Option<Duration>) -> Option<Result<ChatResponse, LlmError>> {
    Some(Err(LlmError::Status {
        status: code,
        code: None,
        kind: None,
        message: String::new(),
        rate_limit: Box::new(RateLimitInfo {
            retry_after,
            ..Default::default()
        }),
    }))
}

fn client(transport: Arc<Scripted>, breaker: BreakerConfig) -> (LlmClient, prometheus::Registry) {
    client_with(transport, |cfg| cfg.breaker = breaker)
}

fn client_with(
    transport: Arc<Scripted>,
    configure: impl FnOnce(&mut ModelConfig),
) -> (LlmClient, prometheus::Registry) {
    let mut cfg = ModelConfig::new("small", "sim");
    cfg.upstream_model = Some("upstream-small".into());
    cfg.timeout_ms = 2_000;
    configure(&mut cfg);
    let registry = prometheus::Registry::new();
    let metrics = LlmMetrics::register(&registry).unwrap();
    let retry = RetryPolicy {
        max_attempts: 3,
        base_ms: 100,
        max_delay_ms: 1_000,
        max_total_delay_ms: 2_000,
    };
    let c = LlmClient::new(vec![ModelEndpoint::new(&cfg, transport)], retry, metrics);
    (c, registry)
}

fn request() -> ChatRequest {
    ChatRequest {
        model: "ignored".into(),
        messages: vec![Message::user("hi")],
        max_tokens: Some(16),
        max_completion_tokens: None,
        temperature: None,
        response_format: None,
    }
}

fn metric(registry: &prometheus::Registry, name: &str, labels: &[(&str, &str)]) -> f64 {
    for family in registry.gather() {
        if family.name() != name {
            continue;
        }
        for m in family.get_metric() {
            let matches = labels.iter().all(|(k, v)| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == *k && l.value() == *v)
            });
            if matches {
                if m.counter.is_some() {
                    return m.get_counter().value();
                }
                if m.gauge.is_some() {
                    return m.get_gauge().value();
                }
            }
        }
    }
    0.0
}

#[tokio::test(start_paused = true)]
async fn transient_failure_is_retried_then_succeeds() {
    let t = Scripted::new(vec![status(503, None), status(502, None), answer()]);
    let (c, reg) = client(t.clone(), BreakerConfig::default());
    let out = c.call("small", request(), Priority::High).await.unwrap();
    assert_eq!(out.response.content, "done");
    assert_eq!(out.attempts, 3);
    assert_eq!(t.calls.load(Ordering::SeqCst), 3);
    assert_eq!(
        metric(&reg, metrics::names::RETRIES_TOTAL, &[("model", "small")]),
        2.0
    );
    assert_eq!(
        metric(
            &reg,
            metrics::names::LLM_REQUESTS_TOTAL,
            &[("model", "small"), ("status", "transient")]
        ),
        2.0
    );
    assert_eq!(
        metric(
            &reg,
            metrics::names::LLM_REQUESTS_TOTAL,
            &[("model", "small"), ("status", "ok")]
        ),
        1.0
    );
    assert_eq!(
        metric(
            &reg,
            metrics::names::PRIORITY_SERVED_TOTAL,
            &[("priority", "high")]
        ),
        3.0
    );
    assert!(metric(&reg, metrics::names::LIMITER_RATE, &[("kind", "rps")]) > 0.0);
}

#[tokio::test(start_paused = true)]
async fn permanent_failure_stops_at_once() {
    let t = Scripted::new(vec![status(400, None), answer()]);
    let (c, _) = client(t.clone(), BreakerConfig::default());
    let f = c
        .call("small", request(), Priority::Normal)
        .await
        .unwrap_err();
    assert_eq!(f.attempts, 1);
    assert_eq!(f.class(), ErrorClass::Permanent(PermanentKind::BadRequest));
    assert_eq!(t.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn exhausted_transient_failure_is_handed_back_with_its_class() {
    let t = Scripted::new(vec![status(500, None); 5]);
    let (c, _) = client(t.clone(), BreakerConfig::default());
    let f = c
        .call("small", request(), Priority::Normal)
        .await
        .unwrap_err();
    assert_eq!(f.attempts, 3);
    assert_eq!(f.class(), ErrorClass::Transient);
    assert!(f.class().is_retryable());
}

#[tokio::test(start_paused = true)]
async fn hung_call_times_out_and_is_retried() {
    let t = Scripted::new(vec![None, answer()]);
    let (c, _) = client(t.clone(), BreakerConfig::default());
    let start = Instant::now();
    let out = c.call("small", request(), Priority::Normal).await.unwrap();
    assert_eq!(out.attempts, 2);
    assert!(start.elapsed() >= Duration::from_secs(2));
    assert!(out.latency >= Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn rate_limited_call_honours_retry_after_and_slows_the_limiter() {
    let t = Scripted::new(vec![
        status(429, Some(Duration::from_millis(800))),
        answer(),
    ]);
    let (c, _) = client(t.clone(), BreakerConfig::default());
    let before = c.endpoint("small").unwrap().limiter.current_rps();
    let start = Instant::now();
    let out = c.call("small", request(), Priority::Normal).await.unwrap();
    assert_eq!(out.attempts, 2);
    assert!(start.elapsed() >= Duration::from_millis(800));
    let limiter = &c.endpoint("small").unwrap().limiter;
    assert!(limiter.current_rps() < before);
    assert_eq!(limiter.rate_limited_total(), 1);
    // A 429 is not a provider failure for the breaker.
    assert_eq!(
        c.endpoint("small").unwrap().breaker.state(),
        BreakerState::Closed
    );
}

#[tokio::test(start_paused = true)]
async fn open_breaker_refuses_immediately() {
    let t = Scripted::new(vec![status(500, None); 10]);
    let breaker = BreakerConfig {
        consecutive_failures: 3,
        open_ms: 30_000,
        ..Default::default()
    };
    let (c, reg) = client(t.clone(), breaker);
    let f = c
        .call("small", request(), Priority::Normal)
        .await
        .unwrap_err();
    assert_eq!(f.attempts, 3);
    assert!(c.is_open("small"));
    assert_eq!(
        metric(&reg, metrics::names::BREAKER_STATE, &[("model", "small")]),
        2.0
    );
    let start = Instant::now();
    let f = c
        .call("small", request(), Priority::Normal)
        .await
        .unwrap_err();
    assert_eq!(f.class(), ErrorClass::CircuitOpen);
    assert_eq!(f.attempts, 0);
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(t.calls.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn unknown_model_is_a_config_error() {
    let (c, _) = client(Scripted::new(vec![]), BreakerConfig::default());
    let f = c
        .call("large", request(), Priority::Normal)
        .await
        .unwrap_err();
    assert_eq!(f.class(), ErrorClass::Config);
    assert_eq!(f.attempts, 0);
}

#[test]
fn from_config_wires_providers_and_rejects_unknown_ones() {
    let mut cfg = LlmConfig::default();
    cfg.providers
        .push(ProviderConfig::new("sim", "http://127.0.0.1:9"));
    cfg.models.push(ModelConfig::new("small", "sim"));
    let c = LlmClient::from_config(&cfg, &prometheus::Registry::new()).unwrap();
    assert_eq!(c.models().collect::<Vec<_>>(), vec!["small"]);
    cfg.models.push(ModelConfig::new("large", "nope"));
    let err = LlmClient::from_config(&cfg, &prometheus::Registry::new()).unwrap_err();
    assert_eq!(err.class(), ErrorClass::Config);
}

/// A reasoning model (`max_completion_tokens`) gets no sampling parameters and room to
/// reason on top of the task's cap by default; per-model settings override both.
#[tokio::test(start_paused = true)]
async fn reasoning_models_get_no_temperature_and_room_to_reason() {
    let sent = |configure: fn(&mut ModelConfig)| async move {
        let t = Scripted::new(vec![answer()]);
        let (c, _) = client_with(t.clone(), configure);
        let mut req = request();
        req.temperature = Some(0.0);
        c.call("small", req, Priority::Normal).await.unwrap();
        let seen = t.seen.lock()[0].clone();
        (
            seen.temperature,
            seen.max_tokens,
            seen.max_completion_tokens,
        )
    };
    assert_eq!(sent(|_| {}).await, (Some(0.0), Some(16), None));
    assert_eq!(
        sent(|c| c.max_tokens_field = config::MaxTokensField::MaxCompletionTokens).await,
        (None, None, Some(16 + config::DEFAULT_REASONING_TOKENS))
    );
    assert_eq!(
        sent(|c| {
            c.max_tokens_field = config::MaxTokensField::MaxCompletionTokens;
            c.send_sampling = Some(true);
            c.reasoning_tokens = Some(100);
        })
        .await,
        (Some(0.0), None, Some(116))
    );
    assert_eq!(
        sent(|c| c.reasoning_tokens = Some(2_000)).await,
        (Some(0.0), Some(2_016), None),
        "a reasoning model served through max_tokens (vLLM, DeepSeek) gets room too"
    );
}
