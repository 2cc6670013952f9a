//! The default pipeline as `sluice run` assembles it from a configuration,
//! in the in-process `TopologyTestDriver`, against the
//! simulated provider over a real socket.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use prometheus::Registry;
use sluice_topology::{OutputRecord, TopologyTestDriver};

use crate::config::Config;
use crate::envelope::TaskResult;
use crate::llm::LlmClient;
use crate::sim::{SimConfig, SimHandle};
use crate::steps::health::Health;

struct Setup {
    _rt: tokio::runtime::Runtime,
    sim: SimHandle,
    driver: TopologyTestDriver,
}

fn setup(extra: &str) -> Setup {
    setup_with(extra, None)
}

/// The pipeline against the simulator, or against `provider` (a base URL).
fn setup_with(extra: &str, provider: Option<&dyn Fn(&tokio::runtime::Runtime) -> String>) -> Setup {
    setup_model(extra, "", provider)
}

/// As [`setup_with`], with `model_keys` added to the model's table.
fn setup_model(
    extra: &str,
    model_keys: &str,
    provider: Option<&dyn Fn(&tokio::runtime::Runtime) -> String>,
) -> Setup {
    setup_full(extra, model_keys, SimConfig::default(), provider)
}

/// As [`setup_model`], with the simulator configured by `sim_config`.
fn setup_full(
    extra: &str,
    model_keys: &str,
    sim_config: SimConfig,
    provider: Option<&dyn Fn(&tokio::runtime::Runtime) -> String>,
) -> Setup {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let sim = rt
        .block_on(crate::sim::start(
            sim_config,
            "127.0.0.1:0".parse().unwrap(),
        ))
        .unwrap();
    let base_url = provider.map_or_else(|| sim.base_url(), |f| f(&rt));
    let text = format!(
        r#"
[app]
guarantee = "at_least_once"

[kafka]
bootstrap_servers = "unused:9092"

[[llm.providers]]
name = "sim"
base_url = "{}"

[[llm.models]]
name = "small"
provider = "sim"
{model_keys}

[prices.small]
input = 150000
output = 600000
cached = 75000
{extra}
"#,
        base_url
    );
    let config = Config::from_toml_with_env(&text, []).unwrap();
    let registry = Registry::new();
    let client = LlmClient::from_config(&config.llm, &registry).unwrap();
    let steps = super::steps(
        &config,
        super::TaskPartitions::Unknown,
        client,
        &registry,
        Health::default(),
    )
    .unwrap();
    let driver = TopologyTestDriver::new(crate::steps::default_topology(&steps).unwrap()).unwrap();
    Setup {
        _rt: rt,
        sim,
        driver,
    }
}

fn task(i: usize) -> Vec<u8> {
    tenant_task(i, "acme")
}

fn tenant_task(i: usize, tenant: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "taskId": format!("t{i}"),
        "taskType": "classify",
        "tenantId": tenant,
        "requesterId": "svc",
        "priority": "normal",
        "submittedAt": "2026-12-01T10:00:00Z",
        "attemptNumber": 1,
        "payload": { "content": format!("Item {i}: markets rallied today."), "labels": ["news", "sports"] },
    }))
    .unwrap()
}

/// Pipes classify tasks `0..n` of `acme` and waits up to `secs` for every
/// call they start.
fn classify_all(s: &mut Setup, n: usize, secs: u64) {
    for i in 0..n {
        s.driver
            .pipe_raw("ai.tasks.classify", Some(b"acme"), Some(&task(i)), 0)
            .unwrap();
    }
    assert_eq!(
        s.driver.wait_for_async(Duration::from_secs(secs)).unwrap(),
        0
    );
}

fn results(out: Vec<OutputRecord>) -> HashMap<String, TaskResult> {
    let mut by_id = HashMap::new();
    for r in out {
        let result: TaskResult = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
        assert!(
            by_id.insert(result.task_id.clone(), result).is_none(),
            "one result per task"
        );
    }
    by_id
}

#[test]
fn the_default_pipeline_batches_answers_and_dead_letters_in_the_test_driver() {
    let mut s = setup("");
    for i in 0..40 {
        s.driver
            .pipe_raw("ai.tasks.classify", Some(b"acme"), Some(&task(i)), 0)
            .unwrap();
    }
    s.driver
        .pipe_raw("ai.tasks.classify", Some(b"acme"), Some(b"{not json"), 0)
        .unwrap();
    assert_eq!(s.driver.wait_for_async(Duration::from_secs(20)).unwrap(), 0);
    let done = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(done.len(), 40);
    let calls = s.sim.stats().requests_total;
    assert!(calls <= 2, "{calls} calls for 40 tasks (max_items 32)");
    assert!(done.values().all(|r| r.success && r.batch_id.is_some()));
    let stats = s.sim.stats();
    let input: u64 = done.values().map(|r| r.input_tokens).sum();
    assert_eq!(
        input, stats.prompt_tokens,
        "batch usage apportioned exactly"
    );
    let dead = s.driver.read_output("ai.tasks.classify.dlq");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].value.as_deref(), Some(&b"{not json"[..]));
    // A redelivered task is answered from the idempotency store.
    s.driver
        .pipe_raw("ai.tasks.classify", Some(b"acme"), Some(&task(3)), 0)
        .unwrap();
    assert_eq!(s.driver.wait_for_async(Duration::from_secs(20)).unwrap(), 0);
    let again = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(again["t3"].output, done["t3"].output);
    assert_eq!(s.sim.stats().requests_total, calls, "no second call");
}

#[test]
fn with_batching_off_every_task_is_its_own_call() {
    let mut s = setup("[batching]\nenabled = false\n");
    classify_all(&mut s, 10, 20);
    let done = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(done.len(), 10);
    assert!(done.values().all(|r| r.success && r.batch_id.is_none()));
    assert_eq!(s.sim.stats().requests_total, 10);
}

/// A summarize task of `tenant` whose text says whose it is.
fn summarize_task(i: usize, tenant: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "taskId": format!("{tenant}-{i}"),
        "taskType": "summarize",
        "tenantId": tenant,
        "requesterId": "svc",
        "submittedAt": "2026-12-01T10:00:00Z",
        "payload": { "content": format!("{tenant} private text {i}"), "maxWords": 20 },
    }))
    .unwrap()
}

/// Runs 20 tasks of each of two tenants, interleaved, through the pipeline;
/// returns the tenants found in each batch, after checking that every task
/// got its own answer.
fn batches_of_two_tenants(extra: &str) -> Vec<std::collections::BTreeSet<String>> {
    let mut s = setup(extra);
    for i in 0..20 {
        for tenant in ["alpha", "beta"] {
            s.driver
                .pipe_raw(
                    "ai.tasks.summarize",
                    Some(tenant.as_bytes()),
                    Some(&summarize_task(i, tenant)),
                    0,
                )
                .unwrap();
        }
    }
    assert_eq!(s.driver.wait_for_async(Duration::from_secs(20)).unwrap(), 0);
    let done = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(done.len(), 40);
    let mut batches: HashMap<String, std::collections::BTreeSet<String>> = HashMap::new();
    for r in done.values() {
        assert!(r.success, "{r:?}");
        let (tenant, i) = r.task_id.split_once('-').unwrap();
        assert_eq!(r.tenant_id, tenant);
        assert_eq!(
            r.output.as_str(),
            Some(format!("{tenant} private text {i}").as_str()),
            "each task its own answer"
        );
        let batch = r.batch_id.clone().expect("batched");
        batches
            .entry(batch)
            .or_default()
            .insert(r.tenant_id.clone());
    }
    batches.into_values().collect()
}

#[test]
fn a_batch_holds_one_tenants_tasks_unless_tenants_may_share() {
    let batches = batches_of_two_tenants("");
    assert!(batches.len() >= 2);
    assert!(
        batches.iter().all(|tenants| tenants.len() == 1),
        "a batch mixed tenants: {batches:?}"
    );
    // A single-company deployment lets its services share prompts.
    let batches = batches_of_two_tenants("[batching]\nacross_tenants = true\n");
    assert!(
        batches.iter().any(|tenants| tenants.len() == 2),
        "tenants never shared a batch: {batches:?}"
    );
}

const QUOTA_WINDOW_MS: i64 = 6_000;

/// Pipes a summarize task of `acme` (without waiting).
fn pipe_summary(s: &mut Setup, id: &str, content: &str, max_words: u32) {
    let task = serde_json::json!({
        "taskId": id,
        "taskType": "summarize",
        "tenantId": "acme",
        "submittedAt": "2026-12-01T10:00:00Z",
        "payload": { "content": content, "maxWords": max_words },
    });
    s.driver
        .pipe_raw(
            "ai.tasks.summarize",
            Some(b"acme"),
            Some(&serde_json::to_vec(&task).unwrap()),
            0,
        )
        .unwrap();
}

/// Pipes classify tasks `range` of `tenant` and waits for every call they
/// start.
fn pipe_classify(s: &mut Setup, tenant: &str, range: std::ops::Range<usize>) {
    for i in range {
        s.driver
            .pipe_raw(
                "ai.tasks.classify",
                Some(tenant.as_bytes()),
                Some(&tenant_task(i, tenant)),
                0,
            )
            .unwrap();
    }
    assert_eq!(s.driver.wait_for_async(Duration::from_secs(20)).unwrap(), 0);
}

/// Waits for the start of the next quota window (plus a little).
fn next_quota_window() {
    let now = chrono::Utc::now().timestamp_millis();
    let wait = QUOTA_WINDOW_MS - now.rem_euclid(QUOTA_WINDOW_MS) + 50;
    std::thread::sleep(Duration::from_millis(wait as u64));
}

/// A hard-quota tenant's batches all come back unsplittable: each task
/// carries its share of the spoiled call, and its reservation grows by it
/// before its own call, or it is refused. Refused or answered, every token
/// the provider billed is on a result (before, a refused task's share was
/// dropped), and the tenant is never billed past its quota.
#[test]
fn spoiled_shares_of_a_hard_quota_tenant_land_on_its_results() {
    // Room for the twenty tasks' reservations (62 tokens each at most),
    // not for their spoiled shares on top.
    let quota = 20 * 62 + 20u64;
    let sim = SimConfig {
        batch_malformed_rate: 1.0,
        ..Default::default()
    };
    let mut s = setup_full(
        &format!(
            r#"
[batching]
max_items = 10

[[accounting.windows]]
name = "q"
size_ms = {QUOTA_WINDOW_MS}
retention_ms = 60000

[accounting.quotas.tenants.capped]
window = "q"
tokens = {quota}
"#
        ),
        "",
        sim,
        None,
    );
    next_quota_window();
    pipe_classify(&mut s, "capped", 0..20);
    let done = results(s.driver.read_output("ai.results.completed"));
    let failed = results(s.driver.read_output("ai.results.failed"));
    assert_eq!(done.len() + failed.len(), 20, "one result per task");
    let tokens = |r: &TaskResult| r.input_tokens + r.output_tokens;
    let billed: u64 = done.values().chain(failed.values()).map(tokens).sum();
    let stats = s.sim.stats();
    assert!(stats.injected.batch_malformed > 0);
    assert_eq!(billed, stats.prompt_tokens + stats.completion_tokens);
    assert!(billed <= quota, "billed {billed} over a quota of {quota}");
    let refused_with_shares = failed
        .values()
        .filter(|r| r.error_code.as_deref() == Some("quota_exceeded") && tokens(r) > 0)
        .count();
    assert!(refused_with_shares > 0, "{failed:?}");
}

#[test]
fn a_hard_token_quota_is_never_passed_in_a_burst_and_resets_with_its_window() {
    let quota = 2_000u64;
    let mut s = setup(&format!(
        r#"
[[accounting.windows]]
name = "q"
size_ms = {QUOTA_WINDOW_MS}
retention_ms = 60000

[accounting.quotas.tenants.capped]
window = "q"
tokens = {quota}
"#
    ));
    next_quota_window();
    // A burst: every task of both tenants under way at once.
    for i in 0..100 {
        for tenant in ["capped", "free"] {
            let key = tenant.as_bytes();
            s.driver
                .pipe_raw(
                    "ai.tasks.classify",
                    Some(key),
                    Some(&tenant_task(i, tenant)),
                    0,
                )
                .unwrap();
        }
    }
    assert_eq!(s.driver.wait_for_async(Duration::from_secs(20)).unwrap(), 0);
    let done = s.driver.read_output("ai.results.completed");
    let failed = s.driver.read_output("ai.results.failed");
    let all: Vec<TaskResult> = done
        .iter()
        .chain(&failed)
        .map(|r| serde_json::from_slice(r.value.as_deref().unwrap()).unwrap())
        .collect();
    let of = |tenant: &str, ok: bool| -> Vec<&TaskResult> {
        all.iter()
            .filter(|r| r.tenant_id == tenant && r.success == ok)
            .collect()
    };
    assert_eq!(
        of("free", true).len(),
        100,
        "another tenant is not affected"
    );
    let (capped, refused) = (of("capped", true), of("capped", false));
    assert_eq!(capped.len() + refused.len(), 100, "one result per task");
    let billed: u64 = capped
        .iter()
        .map(|r| r.input_tokens + r.output_tokens)
        .sum();
    assert!(
        billed <= quota,
        "billed {billed} tokens over a quota of {quota}"
    );
    assert!(
        !refused.is_empty() && capped.len() >= 20,
        "{} completed",
        capped.len()
    );
    assert!(refused
        .iter()
        .all(|r| r.error_code.as_deref() == Some("quota_exceeded") && r.input_tokens == 0));
    assert!(
        s.driver.read_output("ai.tasks.classify.dlq").is_empty(),
        "not dead letters"
    );
    // Every token the provider billed is on a completed result.
    let all_billed: u64 = all.iter().map(|r| r.input_tokens + r.output_tokens).sum();
    let stats = s.sim.stats();
    assert_eq!(all_billed, stats.prompt_tokens + stats.completion_tokens);
    // The next window starts with a fresh quota.
    next_quota_window();
    pipe_classify(&mut s, "capped", 100..110);
    let next = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(
        next.len(),
        10,
        "{:?}",
        results(s.driver.read_output("ai.results.failed"))
    );
}

/// Serves `chat` as a provider's `/v1/chat/completions` on a free port; its
/// base URL.
fn serve(rt: &tokio::runtime::Runtime, chat: axum::routing::MethodRouter) -> String {
    let app = axum::Router::new().route("/v1/chat/completions", chat);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/v1")
}

/// The user message of a chat request (a task's text, or a batch's items).
fn user_text(req: &serde_json::Value) -> String {
    req["messages"][1]["content"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// A provider that answers every call with the same usage: 2,000 prompt
/// tokens of which 1,500 cached, 300 completion tokens.
fn fixed_usage_provider(rt: &tokio::runtime::Runtime) -> String {
    let app = axum::routing::post(|| async {
        axum::Json(serde_json::json!({
            "id": "chatcmpl-fixture", "object": "chat.completion", "created": 0, "model": "small",
            "choices": [{ "index": 0, "finish_reason": "stop",
                          "message": { "role": "assistant", "content": "news" } }],
            "usage": { "prompt_tokens": 2000, "completion_tokens": 300, "total_tokens": 2300,
                       "prompt_tokens_details": { "cached_tokens": 1500 } }
        }))
    });
    serve(rt, app)
}

#[test]
fn cached_tokens_are_priced_at_the_cached_rate_to_the_micro_dollar() {
    let mut s = setup_with("[batching]\nenabled = false\n", Some(&fixed_usage_provider));
    s.driver
        .pipe_raw("ai.tasks.classify", Some(b"acme"), Some(&task(1)), 0)
        .unwrap();
    assert_eq!(s.driver.wait_for_async(Duration::from_secs(20)).unwrap(), 0);
    let done = results(s.driver.read_output("ai.results.completed"));
    let r = &done["t1"];
    // Prices per million tokens: input 150,000 µ$, cached 75,000 µ$, output
    // 600,000 µ$. By hand: 500 uncached × 0.15 = 75, 1,500 cached × 0.075 =
    // 112.5, 300 output × 0.6 = 180: 367.5 µ$, rounded half up to 368.
    assert_eq!(
        (r.input_tokens, r.cached_tokens, r.output_tokens),
        (2000, 1500, 300)
    );
    assert_eq!(r.cost_micros, 368);
    // The window updates go out at the commit.
    s.driver.commit().unwrap();
    let usage: Vec<crate::steps::account::UsageRecord> = s
        .driver
        .read_output("ai.usage.tenant")
        .iter()
        .map(|m| serde_json::from_slice(m.value.as_deref().unwrap()).unwrap())
        .collect();
    assert_eq!(usage.len(), 4, "one update per default window");
    assert!(usage.iter().map(|u| &u.usage).all(|u| u.cost_micros == 368
        && u.cached_tokens == 1500
        && u.by_model["small"].cost_micros == 368));
}

/// A provider answering the way real servers do, chosen by the task's text:
/// cut at the cap, a refusal, a word outside the labels, a reasoning block
/// before the answer, no usage at all. Counts its calls.
fn real_shapes_provider(
    calls: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> impl Fn(&tokio::runtime::Runtime) -> String {
    move |rt| {
        let calls = calls.clone();
        let app = axum::routing::post(move |axum::Json(req): axum::Json<serde_json::Value>| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let text = user_text(&req);
            async move {
                let (content, finish, refusal) = if text.contains("cut") {
                    (serde_json::json!("The quarterly"), "length", None)
                } else if text.contains("decline") {
                    (
                        serde_json::Value::Null,
                        "stop",
                        Some("I can't help with that."),
                    )
                } else if text.contains("weather") {
                    (serde_json::json!("weather"), "stop", None)
                } else if text.contains("reasoner") {
                    (
                        serde_json::json!("<think>\nit is a match report\n</think>\n\nsports"),
                        "stop",
                        None,
                    )
                } else {
                    (serde_json::json!("news"), "stop", None)
                };
                let mut body = serde_json::json!({
                    "id": "chatcmpl-shapes", "object": "chat.completion", "created": 0, "model": "small",
                    "choices": [{ "index": 0, "finish_reason": finish,
                                  "message": { "role": "assistant", "content": content, "refusal": refusal } }],
                    "usage": { "prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110 }
                });
                if text.contains("nousage") {
                    body["usage"] = serde_json::Value::Null;
                }
                axum::Json(body)
            }
        });
        serve(rt, app)
    }
}

fn classify_text_task(id: &str, content: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "taskId": id,
        "taskType": "classify",
        "tenantId": "acme",
        "submittedAt": "2026-12-01T10:00:00Z",
        "payload": { "content": content, "labels": ["news", "sports"] },
    }))
    .unwrap()
}

/// Truncated, refused and off-contract answers are failed results with their
/// code, billed, neither retried nor dead-lettered; reasoning blocks and
/// missing usage are read as answers.
#[test]
fn real_servers_answers_become_the_right_results_and_are_billed() {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let provider = real_shapes_provider(calls.clone());
    let mut s = setup_with("[batching]\nenabled = false\n", Some(&provider));
    let tasks = [
        ("ok", "markets rallied"),
        ("cut", "cut this short"),
        ("decline", "please decline"),
        ("weather", "weather today"),
        ("reasoner", "reasoner on a match"),
        ("nousage", "nousage markets"),
    ];
    for (id, content) in tasks {
        s.driver
            .pipe_raw(
                "ai.tasks.classify",
                Some(b"acme"),
                Some(&classify_text_task(id, content)),
                0,
            )
            .unwrap();
    }
    assert_eq!(s.driver.wait_for_async(Duration::from_secs(20)).unwrap(), 0);
    let done = results(s.driver.read_output("ai.results.completed"));
    let failed = results(s.driver.read_output("ai.results.failed"));
    assert_eq!(done.len() + failed.len(), tasks.len(), "one result each");
    // The cut answer is asked once more with the template's larger cap
    // (still cut: truncated); nothing else is retried.
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 7);
    assert!(s.driver.read_output("ai.tasks.classify.dlq").is_empty());
    for (id, label) in [("ok", "news"), ("reasoner", "sports"), ("nousage", "news")] {
        let r = &done[id];
        assert!(r.success, "{r:?}");
        assert_eq!(r.output, serde_json::json!(label), "{id}");
    }
    assert!(done["nousage"].input_tokens > 0 && done["nousage"].output_tokens > 0);
    assert!(done["nousage"].cost_micros > 0, "estimated usage is billed");
    for (id, code, calls) in [
        ("cut", "truncated", 2),
        ("decline", "refused", 1),
        ("weather", "invalid_output", 1),
    ] {
        let r = &failed[id];
        assert!(!r.success);
        assert_eq!(r.error_code.as_deref(), Some(code), "{id}");
        assert_eq!(
            (r.input_tokens, r.output_tokens),
            (100 * calls, 10 * calls),
            "{id} is billed for its calls"
        );
        assert!(r.cost_micros > 0);
    }
}

/// A batch's tokens go to its tasks as they were spent (completion tokens by
/// each task's answer), and its tasks' costs sum to the call's cost to the
/// micro-dollar.
#[test]
fn a_batch_bills_each_task_its_own_answer_and_sums_to_the_calls_cost() {
    let mut s = setup("");
    for i in 0..25 {
        pipe_summary(
            &mut s,
            &format!("s{i:02}"),
            &"word ".repeat(3 * (i + 1)),
            200,
        );
    }
    assert_eq!(s.driver.wait_for_async(Duration::from_secs(20)).unwrap(), 0);
    let done = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(done.len(), 25);
    let stats = s.sim.stats();
    assert_eq!(stats.requests_total, 1, "one batch");
    let mut by_id: Vec<&TaskResult> = done.values().collect();
    by_id.sort_by(|a, b| a.task_id.cmp(&b.task_id));
    let output: Vec<u64> = by_id.iter().map(|r| r.output_tokens).collect();
    assert!(
        output.windows(2).all(|w| w[0] <= w[1]) && output[24] > 5 * output[0].max(1),
        "completion tokens follow each task's answer: {output:?}"
    );
    let sum = |f: fn(&TaskResult) -> u64| by_id.iter().map(|r| f(r)).sum::<u64>();
    assert_eq!(sum(|r| r.input_tokens), stats.prompt_tokens);
    assert_eq!(sum(|r| r.output_tokens), stats.completion_tokens);
    assert_eq!(sum(|r| r.cached_tokens), stats.cached_tokens);
    let price = crate::steps::account::pricing::Price {
        cached: Some(75_000),
        ..crate::steps::account::pricing::Price::new(150_000, 600_000)
    };
    let call = crate::steps::account::pricing::cost_micros(
        &price,
        &crate::llm::Usage {
            prompt_tokens: stats.prompt_tokens,
            completion_tokens: stats.completion_tokens,
            cached_tokens: stats.cached_tokens,
            cache_write_tokens: 0,
        },
    );
    assert_eq!(by_id.iter().map(|r| r.cost_micros).sum::<i64>(), call);
}

/// A provider that answers batches of at most `max_items` items (each item
/// `news`) and fails larger ones with a 503, as a server whose batches time
/// out would; counts the requests by item count.
fn small_batches_provider(
    max_items: usize,
    sizes: std::sync::Arc<parking_lot::Mutex<Vec<usize>>>,
) -> impl Fn(&tokio::runtime::Runtime) -> String {
    move |rt| {
        let sizes = sizes.clone();
        let app = axum::routing::post(move |axum::Json(req): axum::Json<serde_json::Value>| {
            let user = user_text(&req);
            let ids: Vec<String> = user
                .lines()
                .filter_map(|l| l.strip_prefix("### item "))
                .map(str::to_string)
                .collect();
            sizes.lock().push(ids.len().max(1));
            async move {
                if ids.len() > max_items {
                    return axum::response::IntoResponse::into_response((
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        "batch too large to answer in time",
                    ));
                }
                let content = if ids.is_empty() {
                    "news".to_string()
                } else {
                    let items: Vec<_> = ids
                        .iter()
                        .map(|id| serde_json::json!({"id": id, "output": "news"}))
                        .collect();
                    serde_json::json!({ "items": items }).to_string()
                };
                axum::response::IntoResponse::into_response(axum::Json(serde_json::json!({
                    "choices": [{ "index": 0, "finish_reason": "stop",
                                  "message": { "role": "assistant", "content": content } }],
                    "usage": { "prompt_tokens": 50, "completion_tokens": 5 }
                })))
            }
        });
        serve(rt, app)
    }
}

/// A batch whose call fails is halved until its halves are answered: every
/// task gets its answer, none is re-published or spends an attempt.
#[test]
fn a_failed_batch_is_halved_until_answered_without_republishing() {
    let sizes = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let provider = small_batches_provider(4, sizes.clone());
    // The breaker is not what this shows (each failed call counts against
    // it, as a timeout would).
    let mut s = setup_model(
        "",
        "breaker = { consecutive_failures = 1000, error_rate = 1.0 }",
        Some(&provider),
    );
    classify_all(&mut s, 16, 30);
    let done = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(done.len(), 16);
    assert!(done
        .values()
        .all(|r| r.success && r.attempts == 1 && r.batch_id.is_some()));
    let sizes = sizes.lock().clone();
    let answered: usize = sizes.iter().filter(|n| **n <= 4).sum();
    assert_eq!(
        answered, 16,
        "the halves answered every task once: {sizes:?}"
    );
    assert!(sizes.contains(&16) && sizes.contains(&8));
}

/// A 32-item summary batch against a model writing 3 ms per output token
/// (the simulator's `ms_per_output_token`; 4-5 s for the batch's answer)
/// with a 1 s call timeout: the batch's call gets the time its expected
/// output needs, and is answered at once. Before, it timed out and was
/// halved down to batches small enough to answer within the second.
#[test]
fn a_long_batch_answer_gets_the_time_its_output_needs() {
    let sim = SimConfig {
        ms_per_output_token: 3.0,
        ..Default::default()
    };
    let mut s = setup_full(
        "[batching]\nmax_items = 32\nwindow_ms = 10000\n",
        "timeout_ms = 1000\nms_per_output_token = 3\nmax_output_tokens = 20000",
        sim,
        None,
    );
    let words: Vec<String> = (0..40).map(|w| format!("word{w}")).collect();
    for i in 0..32 {
        let content = format!("Report {i}: {}", words.join(" "));
        pipe_summary(&mut s, &format!("s{i}"), &content, 30);
    }
    assert_eq!(s.driver.wait_for_async(Duration::from_secs(60)).unwrap(), 0);
    let done = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(done.len(), 32);
    let batches: HashSet<_> = done.values().map(|r| r.batch_id.clone()).collect();
    assert!(
        done.values().all(|r| r.success && r.attempts == 1),
        "{done:?}"
    );
    assert_eq!(batches.len(), 1, "{batches:?}");
    let stats = s.sim.stats();
    assert_eq!(
        stats.requests_total, 1,
        "one call, not timed out: {stats:?}"
    );
}

/// A provider refusing every task whose text holds `BAD` with the same 400,
/// at once, and answering the others after 300 ms.
fn bad_tasks_provider(rt: &tokio::runtime::Runtime) -> String {
    let app = axum::routing::post(
        |axum::Json(req): axum::Json<serde_json::Value>| async move {
            if user_text(&req).contains("BAD") {
                return axum::response::IntoResponse::into_response((
                    axum::http::StatusCode::BAD_REQUEST,
                    axum::Json(serde_json::json!({ "error": {
                    "message": "Unsupported input.", "type": "invalid_request_error" } })),
                ));
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            axum::response::IntoResponse::into_response(axum::Json(serde_json::json!({
                "id": "chatcmpl-fixture", "object": "chat.completion", "created": 0, "model": "small",
                "choices": [{ "index": 0, "finish_reason": "stop",
                              "message": { "role": "assistant", "content": "news" } }],
                "usage": { "prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21 }
            })))
        },
    );
    serve(rt, app)
}

/// Four bad tasks in a row trap the model (three alike make a fault), and
/// the good tasks after them are held. A probe of a good task is answered:
/// the bad tasks, refused again while the model answers others, are
/// dead-lettered, once each. Before, each recovery called them again, their
/// refusals trapped the model again, and they were never settled.
#[test]
fn a_few_bad_tasks_in_a_row_never_hold_their_model_for_good() {
    let mut s = setup_with(
        "[batching]\nenabled = false\n[tasks]\nbad_request_trap_after = 3\n\
         bad_request_wait_ms = 600000\nprobe_interval_ms = 10\n",
        Some(&bad_tasks_provider),
    );
    let pipe = |s: &mut Setup, id: String, content: &str| {
        let task = serde_json::json!({
            "taskId": id, "taskType": "classify", "tenantId": "acme", "requesterId": "svc",
            "priority": "normal", "submittedAt": "2026-12-01T10:00:00Z", "attemptNumber": 1,
            "payload": { "content": content, "labels": ["news", "sports"] },
        });
        let bytes = serde_json::to_vec(&task).unwrap();
        s.driver
            .pipe_raw("ai.tasks.classify", Some(b"acme"), Some(&bytes), 0)
            .unwrap();
    };
    for i in 0..4 {
        pipe(&mut s, format!("bad{i}"), "BAD input");
    }
    s.driver.wait_for_async(Duration::from_secs(10)).unwrap();
    for i in 0..6 {
        pipe(
            &mut s,
            format!("good{i}"),
            &format!("Item {i}: markets rallied."),
        );
    }
    let (mut done, mut failed) = (Vec::new(), Vec::new());
    let mut now = chrono::Utc::now().timestamp_millis();
    for _ in 0..40 {
        now += 1_000;
        s.driver.punctuate(now).unwrap();
        s.driver.wait_for_async(Duration::from_secs(10)).unwrap();
        done.extend(s.driver.read_output("ai.results.completed"));
        failed.extend(s.driver.read_output("ai.results.failed"));
        if done.len() + failed.len() >= 10 {
            break;
        }
    }
    let (done, failed) = (results(done), results(failed));
    assert_eq!(done.len(), 6, "good tasks answered: {:?}", done.keys());
    assert!(done.keys().all(|k| k.starts_with("good")));
    let mut bad: Vec<_> = failed.keys().cloned().collect();
    bad.sort();
    assert_eq!(bad, ["bad0", "bad1", "bad2", "bad3"], "bad tasks settled");
    assert!(failed
        .values()
        .all(|r| r.error_code.as_deref() == Some("bad_request")));
    assert_eq!(s.driver.read_output("ai.tasks.classify.dlq").len(), 4);
}

/// An answer withheld by the provider's content filter (200, `content:
/// null`, `finish_reason: content_filter`) is billed: the task's failed
/// result carries the usage (before, the tokens were dropped), alone and
/// as its share of a batch's.
#[test]
fn a_withheld_answer_is_billed_to_its_task() {
    use std::sync::atomic::{AtomicU64, Ordering};
    for batched in [false, true] {
        let calls = std::sync::Arc::new(AtomicU64::new(0));
        let counted = calls.clone();
        let filtered = move |rt: &tokio::runtime::Runtime| {
            let counted = counted.clone();
            serve(
                rt,
                axum::routing::post(move || async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    axum::Json(serde_json::json!({
                        "id": "chatcmpl-fixture", "object": "chat.completion", "created": 0,
                        "model": "small",
                        "choices": [{ "index": 0, "finish_reason": "content_filter",
                                      "message": { "role": "assistant", "content": null } }],
                        "usage": { "prompt_tokens": 400, "completion_tokens": 0,
                                   "total_tokens": 400 }
                    }))
                }),
            )
        };
        let extra = if batched {
            ""
        } else {
            "[batching]\nenabled = false\n"
        };
        let mut s = setup_with(extra, Some(&filtered));
        classify_all(&mut s, 4, 20);
        let failed = results(s.driver.read_output("ai.results.failed"));
        assert_eq!(failed.len(), 4, "batched {batched}");
        assert_eq!(s.driver.read_output("ai.tasks.classify.dlq").len(), 4);
        for r in failed.values() {
            assert_eq!(r.error_code.as_deref(), Some("content_policy"), "{r:?}");
            assert!(r.input_tokens > 0 && r.cost_micros > 0, "{r:?}");
        }
        // Every call's 400 tokens, a batch's call's too, are on the results.
        let billed: u64 = failed.values().map(|r| r.input_tokens).sum();
        let calls = calls.load(Ordering::SeqCst);
        assert_eq!(billed, 400 * calls, "batched {batched}");
        assert_eq!(calls > 4, batched, "a batch's call, then one per task");
    }
}

/// A batch's answer cannot be split (each task carries its share of the
/// call's 1,000 prompt tokens); each task's own call then fails with a 503
/// and the task is re-published; its next attempt is answered. The shares
/// go with the re-published attempts (header `sluice.billed`) into their
/// results: the results bill every token the provider billed. Before, the
/// shares were dropped at the re-publish.
#[test]
fn a_spoiled_batchs_shares_go_with_re_published_attempts() {
    let seen = std::sync::Arc::new(parking_lot::Mutex::new(HashSet::new()));
    let calls = seen.clone();
    let provider = move |rt: &tokio::runtime::Runtime| {
        let seen = seen.clone();
        serve(
            rt,
            axum::routing::post(move |axum::Json(req): axum::Json<serde_json::Value>| {
                let user = user_text(&req);
                let batch = user.contains("### item");
                let first = seen.lock().insert(user);
                async move {
                    let (content, prompt) = match (batch, first) {
                        (true, _) => ("not the items' JSON", 1000),
                        (false, true) => {
                            return axum::response::IntoResponse::into_response((
                                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                                "overloaded",
                            ))
                        }
                        (false, false) => ("news", 10),
                    };
                    axum::response::IntoResponse::into_response(axum::Json(serde_json::json!({
                        "id": "chatcmpl-fixture", "object": "chat.completion", "created": 0,
                        "model": "small",
                        "choices": [{ "index": 0, "finish_reason": "stop",
                                      "message": { "role": "assistant", "content": content } }],
                        "usage": { "prompt_tokens": prompt, "completion_tokens": 1,
                                   "total_tokens": prompt + 1 }
                    })))
                }
            }),
        )
    };
    let mut s = setup_with(
        "[llm.retry]\nmax_attempts = 1\n[tasks]\nretry_backoff_ms = 10\nretry_backoff_max_ms = 10\n",
        Some(&provider),
    );
    classify_all(&mut s, 4, 30);
    let done = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(done.len(), 4);
    assert!(
        done.values().all(|r| r.success && r.attempts == 2),
        "{done:?}"
    );
    let prompt: u64 = done.values().map(|r| r.input_tokens).sum();
    let completion: u64 = done.values().map(|r| r.output_tokens).sum();
    let batches = calls
        .lock()
        .iter()
        .filter(|u| u.contains("### item"))
        .count() as u64;
    assert!(batches >= 1);
    assert_eq!(
        (prompt, completion),
        (batches * 1000 + 4 * 10, batches + 4),
        "{done:?}"
    );
}

/// Batch answers as models give them: items in another order (each still
/// its own task's answer), or an item given twice (the batch cannot be
/// trusted: each task is asked alone). Every task gets its own summary,
/// once.
#[test]
fn reordered_or_duplicated_batch_items_still_give_each_task_its_answer() {
    for (reorder, malformed) in [(1.0, 0.0), (0.0, 1.0)] {
        let sim = SimConfig {
            batch_reorder_rate: reorder,
            batch_malformed_rate: malformed,
            ..Default::default()
        };
        let mut s = setup_full("[batching]\nmax_items = 8\n", "", sim, None);
        for i in 0..16 {
            pipe_summary(
                &mut s,
                &format!("s{i}"),
                &format!("Report{i} says markets rallied"),
                3,
            );
        }
        assert_eq!(s.driver.wait_for_async(Duration::from_secs(30)).unwrap(), 0);
        let done = results(s.driver.read_output("ai.results.completed"));
        assert_eq!(done.len(), 16, "reorder {reorder} malformed {malformed}");
        for (id, r) in &done {
            let own = format!("Report{}", &id[1..]);
            let out = r.output.as_str().unwrap_or_default();
            assert!(out.starts_with(&own), "{id}: {out:?}");
        }
        let stats = s.sim.stats();
        assert!(stats.batch_requests >= 2, "{stats:?}");
        if malformed > 0.0 {
            assert_eq!(stats.injected.batch_malformed, stats.batch_requests);
        }
    }
}

/// A batch's summed completion caps stay within its model's output limit:
/// classify's 16 tokens and a 24-token wrapper per item, 100 at most.
#[test]
fn a_batch_stays_within_its_models_output_limit() {
    let mut s = setup_model("", "max_output_tokens = 100", None);
    classify_all(&mut s, 10, 20);
    let done = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(done.len(), 10);
    let mut batches: HashMap<Option<String>, usize> = HashMap::new();
    for r in done.values() {
        assert!(r.success, "{r:?}");
        *batches.entry(r.batch_id.clone()).or_default() += 1;
    }
    assert!(
        batches.iter().all(|(id, n)| id.is_none() || *n <= 2),
        "{batches:?}"
    );
    assert!(s.sim.stats().requests_total >= 5);
}

/// A reasoning model (refusing `temperature`, spending hidden tokens of the
/// cap) answers classify tasks out of the box once configured as one; sent
/// the templates' temperature, as before, every call was the same 400.
#[test]
fn a_reasoning_model_answers_out_of_the_box() {
    let mut sim = SimConfig::default();
    sim.model_overrides.insert(
        "small".into(),
        crate::sim::ModelOverrides {
            reasoning_tokens: Some(300),
            ..Default::default()
        },
    );
    let run = |model_keys: &str| {
        let mut s = setup_full(
            "[batching]\nenabled = false\n",
            model_keys,
            sim.clone(),
            None,
        );
        for i in 0..5 {
            s.driver
                .pipe_raw("ai.tasks.classify", Some(b"acme"), Some(&task(i)), 0)
                .unwrap();
        }
        s.driver.wait_for_async(Duration::from_secs(20)).unwrap();
        (
            results(s.driver.read_output("ai.results.completed")),
            s.driver.read_output("ai.tasks.classify.dlq").len(),
        )
    };
    let (done, dead) = run("max_tokens_field = \"max_completion_tokens\"");
    assert_eq!((done.len(), dead), (5, 0));
    assert!(done.values().all(|r| r.success && r.output.is_string()));
    assert!(
        done.values().all(|r| r.output_tokens > 300),
        "reasoning billed"
    );
    // Forced to send the template's temperature: refused every time.
    let (done, _) = run("max_tokens_field = \"max_completion_tokens\"\nsend_sampling = true");
    assert!(done.is_empty());
}

/// A provider whose batch answers cannot be split (billed 80 + 8 tokens a
/// call) and whose single calls fail with a 503.
fn spoiling_provider(rt: &tokio::runtime::Runtime) -> String {
    let app = axum::routing::post(
        |axum::Json(req): axum::Json<serde_json::Value>| async move {
            let user = user_text(&req);
            if !user.contains("### item ") {
                return axum::response::IntoResponse::into_response((
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                ));
            }
            axum::response::IntoResponse::into_response(axum::Json(serde_json::json!({
                "choices": [{ "index": 0, "finish_reason": "stop",
                              "message": { "role": "assistant", "content": "not json" } }],
                "usage": { "prompt_tokens": 80, "completion_tokens": 8 }
            })))
        },
    );
    serve(rt, app)
}

/// Tokens a provider billed for a batch whose answer was unusable stay with
/// its tasks even when they then fail for good: on their failed results.
#[test]
fn a_failed_result_carries_what_its_spoiled_batch_billed() {
    let mut s = setup_model(
        "[tasks]\nmax_attempts = 1\n",
        "breaker = { consecutive_failures = 1000, error_rate = 1.0 }",
        Some(&spoiling_provider),
    );
    classify_all(&mut s, 4, 30);
    let failed = results(s.driver.read_output("ai.results.failed"));
    assert_eq!(failed.len(), 4);
    assert!(failed
        .values()
        .all(|r| r.error_code.as_deref() == Some("exhausted")));
    let sum = |f: fn(&TaskResult) -> u64| failed.values().map(f).sum::<u64>();
    assert_eq!((sum(|r| r.input_tokens), sum(|r| r.output_tokens)), (80, 8));
    assert!(failed.values().map(|r| r.cost_micros).sum::<i64>() > 0);
}

fn classify_not_before(id: &str, not_before: chrono::DateTime<chrono::Utc>) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "taskId": id,
        "taskType": "classify",
        "tenantId": "acme",
        "submittedAt": "2026-12-01T10:00:00Z",
        "attemptNumber": 2,
        "notBefore": not_before.to_rfc3339(),
        "payload": { "content": format!("{id} markets rallied"), "labels": ["news", "sports"] },
    }))
    .unwrap()
}

/// A re-published attempt waits for its `notBefore` without holding up the
/// tasks behind it, and never longer than the longest backoff.
#[test]
fn a_re_published_attempt_waits_its_backoff_without_holding_up_others() {
    let mut s = setup(
        "[batching]\nenabled = false\n[tasks]\nretry_backoff_ms = 100\nretry_backoff_max_ms = 1500\n",
    );
    let now = chrono::Utc::now();
    let later = now + chrono::TimeDelta::milliseconds(700);
    for value in [
        classify_not_before("waits", later),
        classify_not_before("far", now + chrono::TimeDelta::days(1)),
        task(1),
    ] {
        s.driver
            .pipe_raw("ai.tasks.classify", Some(b"acme"), Some(&value), 0)
            .unwrap();
    }
    assert_eq!(s.driver.wait_for_async(Duration::from_secs(20)).unwrap(), 0);
    let done = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(done.len(), 3);
    let (waits, far, first) = (&done["waits"], &done["far"], &done["t1"]);
    assert!(first.completed_at < waits.completed_at, "not held up");
    assert!(waits.completed_at >= later, "called after its notBefore");
    assert!(
        far.completed_at < now + chrono::TimeDelta::milliseconds(1500 + 1000),
        "a wait is at most the longest backoff"
    );
}

/// A provider failing every call with a 503, noting when each task's text
/// came.
fn failing_provider(
    seen: std::sync::Arc<parking_lot::Mutex<Vec<(String, std::time::Instant)>>>,
) -> impl Fn(&tokio::runtime::Runtime) -> String {
    move |rt| {
        let seen = seen.clone();
        let app = axum::routing::post(move |axum::Json(req): axum::Json<serde_json::Value>| {
            let user = user_text(&req);
            seen.lock().push((user, std::time::Instant::now()));
            async { (axum::http::StatusCode::SERVICE_UNAVAILABLE, "overloaded") }
        });
        serve(rt, app)
    }
}

/// A task re-published after a transient failure is called again only after
/// its backoff: drawn from zero to `retry_backoff_ms` for its second attempt
/// (full jitter), never at once for all of them.
#[test]
fn a_re_published_attempt_is_called_after_its_backoff() {
    let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let provider = failing_provider(seen.clone());
    let mut s = setup_model(
        "[batching]\nenabled = false\n[llm.retry]\nmax_attempts = 1\n[tasks]\nmax_attempts = 2\nretry_backoff_ms = 2000\nretry_backoff_max_ms = 60000\n",
        // Neither the breaker nor the limiter's pacing is what this shows.
        "breaker = { consecutive_failures = 1000, error_rate = 1.0 }\n\
         limiter = { initial_rps = 1000000, max_rps = 1000000, max_concurrency = 512 }",
        Some(&provider),
    );
    classify_all(&mut s, 10, 30);
    let failed = results(s.driver.read_output("ai.results.failed"));
    assert_eq!(failed.len(), 10);
    assert!(failed.values().all(|r| r.attempts == 2));
    let mut calls: HashMap<String, Vec<std::time::Instant>> = HashMap::new();
    for (text, at) in seen.lock().iter() {
        calls.entry(text.clone()).or_default().push(*at);
    }
    let gaps: Vec<Duration> = calls
        .values()
        .map(|at| {
            assert_eq!(at.len(), 2, "two attempts a task");
            at[1] - at[0]
        })
        .collect();
    assert!(
        gaps.iter().all(|g| *g <= Duration::from_millis(2_500)),
        "{gaps:?}"
    );
    // Ten uniform draws from 0–2 s all below 0.3 s: about 6 in a billion.
    assert!(
        gaps.iter().any(|g| *g >= Duration::from_millis(300)),
        "{gaps:?}"
    );
}
