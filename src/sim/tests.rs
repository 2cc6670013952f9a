//! Tests of the simulated provider: pure units (hash, prompt parsing, buckets with a fake
//! clock, config) and the server over a real socket with reqwest.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};

use super::config::EffectiveLimits;
use super::limits::{format_reset, Bucket, RateDecision, RateLimiter};
use super::prompt::{
    fnv1a64, parse_batch_items, parse_spec, task_output, tokens_for_message, TaskKind,
};
use super::*;

const KEY: &str = "sk-sim-test";
const MODEL: &str = "sim-small";

// ---------------------------------------------------------------------------------------
// Helpers

/// A running simulator and one HTTP client for the test (building a client loads the TLS
/// roots, which is too slow to do per request).
struct TestSim {
    handle: SimHandle,
    http: reqwest::Client,
}

impl std::ops::Deref for TestSim {
    type Target = SimHandle;

    fn deref(&self) -> &SimHandle {
        &self.handle
    }
}

async fn start_sim(config: SimConfig) -> TestSim {
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
    TestSim {
        handle: start(config, addr).await.expect("simulator starts"),
        http: client(),
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("client")
}

fn request(system: &str, user: &str) -> Value {
    json!({
        "model": MODEL,
        "messages": [
            { "role": "system", "content": system },
            { "role": "user", "content": user },
        ],
        "temperature": 0.0,
    })
}

struct Answer {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    text: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text))
    }

    fn content(&self) -> String {
        self.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_else(|| panic!("no content in {}", self.text))
            .to_owned()
    }

    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ascii header").to_owned())
    }

    fn error_code(&self) -> Value {
        self.json()["error"]["code"].clone()
    }
}

async fn post_with(
    client: &reqwest::Client,
    sim: &SimHandle,
    key: Option<&str>,
    body: &Value,
) -> Answer {
    let mut builder = client
        .post(format!("{}/chat/completions", sim.base_url()))
        .json(body);
    if let Some(key) = key {
        builder = builder.bearer_auth(key);
    }
    let response = builder.send().await.expect("request sent");
    Answer {
        status: response.status(),
        headers: response.headers().clone(),
        text: response.text().await.expect("body"),
    }
}

async fn post(sim: &TestSim, body: &Value) -> Answer {
    post_with(&sim.http, sim, Some(KEY), body).await
}

async fn admin_json(sim: &TestSim, path: &str) -> Value {
    let response = sim
        .http
        .get(format!("{}{path}", sim.root_url()))
        .send()
        .await
        .expect("admin request");
    assert_eq!(response.status(), StatusCode::OK, "GET {path}");
    response.json().await.expect("admin JSON")
}

async fn put_config(sim: &TestSim, patch: Value) -> reqwest::Response {
    sim.http
        .put(format!("{}/admin/config", sim.root_url()))
        .json(&patch)
        .send()
        .await
        .expect("config request")
}

async fn calls_containing(sim: &TestSim, text: &str) -> u64 {
    let url = reqwest::Url::parse_with_params(
        &format!("{}/admin/calls", sim.root_url()),
        &[("contains", text)],
    )
    .expect("url");
    let value: Value = sim
        .http
        .get(url)
        .send()
        .await
        .expect("calls request")
        .json()
        .await
        .expect("calls JSON");
    value["calls"].as_u64().expect("calls is a number")
}

// ---------------------------------------------------------------------------------------
// Units

#[test]
fn fnv1a64_matches_reference_vectors() {
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
}

#[test]
fn reset_durations_are_formatted_like_openai() {
    assert_eq!(format_reset(Duration::ZERO), "0s");
    assert_eq!(format_reset(Duration::from_millis(120)), "120ms");
    assert_eq!(format_reset(Duration::from_secs(1)), "1s");
    assert_eq!(format_reset(Duration::from_millis(17_280)), "17.28s");
    assert_eq!(format_reset(Duration::from_secs(360)), "6m0s");
    assert_eq!(format_reset(Duration::from_millis(90_500)), "1m30.5s");
    assert_eq!(format_reset(Duration::from_secs(3723)), "1h2m3s");
}

#[test]
fn prompt_spec_is_parsed_tolerantly() {
    let spec = parse_spec("You are a helper.\n  task: Summarize\nMAX WORDS: 7 words\n");
    assert_eq!(spec.kind, TaskKind::Summarize { max_words: 7 });
    assert!(!spec.batch);

    let spec = parse_spec("Task: classify\nLabels: spam, ham , ,eggs\nBatch: v1");
    assert_eq!(
        spec.kind,
        TaskKind::Classify {
            labels: vec!["spam".into(), "ham".into(), "eggs".into()]
        }
    );
    assert!(spec.batch);

    let spec = parse_spec(
        "Task: extract\nSchema: {\"type\":\"object\",\n \"properties\":{\"a\":{\"type\":\"string\"}}}\nBe brief.",
    );
    let TaskKind::Extract { schema } = spec.kind else {
        panic!("not extract: {:?}", spec.kind);
    };
    assert_eq!(schema["properties"]["a"]["type"], "string");

    // Task lines come first; later look-alike lines in free-text instructions are ignored.
    let spec = parse_spec("Task: summarize\nMax words: 3\n\nTask: be brief.\nMax words: 9");
    assert_eq!(spec.kind, TaskKind::Summarize { max_words: 3 });

    assert_eq!(parse_spec("Task: translate").kind, TaskKind::Generic);
    assert_eq!(parse_spec("").kind, TaskKind::Generic);
}

#[test]
fn batch_items_are_split_on_item_headers() {
    let user = "preamble ignored\n### item t-1\nfirst line\n ### item escaped\n\n### item t 2\n### items are not headers\n###item x\n";
    let items = parse_batch_items(user);
    let got: Vec<(&str, &str)> = items
        .iter()
        .map(|i| (i.id.as_str(), i.content.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("t-1", "first line\n ### item escaped"),
            ("t 2", "### items are not headers"),
            ("x", ""),
        ]
    );
}

#[test]
fn classify_spreads_over_labels_and_extract_fills_every_property() {
    let labels: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
    let kind = TaskKind::Classify {
        labels: labels.clone(),
    };
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..100 {
        let out = task_output(&kind, &format!("content number {i}"));
        let label = out.as_str().expect("a string").to_owned();
        assert!(labels.contains(&label));
        seen.insert(label);
    }
    assert_eq!(seen.len(), 3, "a stable hash should use every label");

    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"},
        "ok": {"type": "boolean"}, "tags": {"type": "array"}, "mood": {"enum": ["up", "down"]},
        "maybe": {"type": ["null", "string"]}
    }});
    let out = task_output(&TaskKind::Extract { schema }, "Alice met Bob, in Paris.");
    let obj = out.as_object().expect("an object");
    assert_eq!(obj.len(), 7);
    let words = ["Alice", "met", "Bob", "in", "Paris"];
    assert!(words.contains(&obj["name"].as_str().expect("string")));
    assert!(words.contains(&obj["maybe"].as_str().expect("string")));
    assert!(obj["n"].is_u64());
    assert!(obj["x"].is_f64());
    assert!(obj["ok"].is_boolean());
    assert!(obj["tags"].is_null());
    assert!(["up", "down"].contains(&obj["mood"].as_str().expect("string")));
}

#[test]
fn token_bucket_refills_with_a_fake_clock() {
    let t0 = Instant::now();
    let limits = EffectiveLimits {
        rps: Some(10.0),
        burst: Some(2),
        ..Default::default()
    };
    let mut limiter = RateLimiter::default();
    assert!(matches!(
        limiter.admit("m", &limits, 1, t0),
        RateDecision::Allowed(_)
    ));
    assert!(matches!(
        limiter.admit("m", &limits, 1, t0),
        RateDecision::Allowed(_)
    ));
    match limiter.admit("m", &limits, 1, t0) {
        RateDecision::Limited {
            retry_after,
            snapshot,
            ..
        } => {
            assert_eq!(retry_after, Duration::from_millis(100));
            let requests = snapshot.requests.expect("request limit reported");
            assert_eq!((requests.limit, requests.remaining), (2, 0));
            assert_eq!(requests.reset, Duration::from_millis(200));
        }
        other => panic!("expected a 429, got {other:?}"),
    }
    // Another key has its own bucket.
    assert!(matches!(
        limiter.admit("other", &limits, 1, t0),
        RateDecision::Allowed(_)
    ));
    // 100 ms later one request fits again.
    let t1 = t0 + Duration::from_millis(100);
    assert!(matches!(
        limiter.admit("m", &limits, 1, t1),
        RateDecision::Allowed(_)
    ));
    assert!(matches!(
        limiter.admit("m", &limits, 1, t1),
        RateDecision::Limited { .. }
    ));

    // Halving the rate applies at once and clamps the fill to the new burst.
    let slower = EffectiveLimits {
        rps: Some(5.0),
        burst: Some(1),
        ..Default::default()
    };
    let t2 = t1 + Duration::from_secs(10);
    assert!(matches!(
        limiter.admit("m", &slower, 1, t2),
        RateDecision::Allowed(_)
    ));
    match limiter.admit("m", &slower, 1, t2) {
        RateDecision::Limited { retry_after, .. } => {
            assert_eq!(retry_after, Duration::from_millis(200))
        }
        other => panic!("expected a 429, got {other:?}"),
    }
}

#[test]
fn token_limit_charges_tokens_and_caps_oversized_requests() {
    let t0 = Instant::now();
    let limits = EffectiveLimits {
        tpm: Some(600),
        ..Default::default()
    };
    let mut limiter = RateLimiter::default();
    assert!(matches!(
        limiter.admit("m", &limits, 500, t0),
        RateDecision::Allowed(_)
    ));
    match limiter.admit("m", &limits, 200, t0) {
        // 100 tokens missing at 10 tokens/s.
        RateDecision::Limited { retry_after, .. } => {
            assert_eq!(retry_after, Duration::from_secs(10))
        }
        other => panic!("expected a 429, got {other:?}"),
    }
    // A request larger than the whole bucket passes once the bucket is full.
    let mut bucket = Bucket::new(600.0, 10.0, t0);
    assert_eq!(bucket.wait_for(5000.0), Duration::ZERO);
    assert_eq!(bucket.remaining(), 600);
    bucket = Bucket::new(600.0, 10.0, t0);
    assert_eq!(bucket.until_full(), Duration::ZERO);
}

#[test]
fn config_rejects_unknown_keys_and_bad_ranges() {
    let config = SimConfig::from_toml_str(
        r#"
        models = ["a", "b"]
        rps = 50.0
        burst = 5
        latency = { kind = "lognormal", median_ms = 200, p99_ms = 900 }
        [model_overrides.b]
        rps = 10.0
        latency = { kind = "fixed", ms = 5 }
        "#,
    )
    .expect("valid config");
    assert_eq!(config.limits_for("a").rps, Some(50.0));
    assert_eq!(config.limits_for("b").rps, Some(10.0));
    assert_eq!(config.limits_for("b").burst, Some(5));
    assert_eq!(config.latency_for("b"), Latency::Fixed { ms: 5 });

    let err = SimConfig::from_toml_str("rps = 5.0\nbogus = 1\n").expect_err("unknown key");
    assert!(err.to_string().contains("bogus"), "{err}");
    let err = SimConfig::from_toml_str("latency = { kind = \"fixed\", msec = 1 }")
        .expect_err("unknown latency field");
    assert!(err.to_string().contains("latency"), "{err}");
    assert!(SimConfig::from_toml_str("error_rate = 1.5").is_err());
    assert!(SimConfig::from_toml_str("status_override = 200").is_err());
    assert!(SimConfig::from_toml_str("burst = 0\nrps = 1.0").is_err());

    let merged = config
        .merged_with(json!({"rps": 25.0, "status_override": 503}))
        .expect("merge");
    assert_eq!(merged.rps, Some(25.0));
    assert_eq!(merged.burst, Some(5));
    assert_eq!(merged.status_override, Some(503));
    assert_eq!(merged.models, config.models);
    assert!(config.merged_with(json!({"nope": 1})).is_err());
}

#[test]
fn cli_flags_override_the_file() {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sim.toml");
    std::fs::write(&path, "rps = 50.0\nerror_rate = 0.1\napi_keys = [\"k\"]\n").expect("write");
    let cli = Cli::try_parse_from([
        "sim",
        "--config",
        path.to_str().expect("utf-8 path"),
        "--rps",
        "25",
        "--models",
        "a,b",
        "--no-rate-limit-headers",
        "--latency-ms",
        "7",
        "--slots",
        "2",
    ])
    .expect("parses");
    assert_eq!(
        cli.sim.listen,
        "127.0.0.1:8089".parse::<SocketAddr>().expect("addr")
    );
    let config = cli.sim.to_config().expect("config");
    assert_eq!(config.rps, Some(25.0));
    assert_eq!(config.error_rate, 0.1);
    assert_eq!(config.api_keys, vec!["k".to_owned()]);
    assert_eq!(config.models, Some(vec!["a".to_owned(), "b".to_owned()]));
    assert!(!config.rate_limit_headers);
    assert_eq!(config.latency, Latency::Fixed { ms: 7 });
    assert_eq!(config.slots, Some(2));
    assert!(SimConfig::from_toml_str("slots = 0").is_err());
}

// ---------------------------------------------------------------------------------------
// Over a socket: answers

#[tokio::test]
async fn same_request_gets_the_same_answer() {
    let sim = start_sim(SimConfig::default()).await;
    let body = request("Task: classify\nLabels: red, green, blue", "a ripe tomato");
    let first = post(&sim, &body).await;
    let second = post(&sim, &body).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.content(), second.content());
    let (a, b) = (first.json(), second.json());
    assert_eq!(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]);
    assert_eq!(
        a["usage"]["completion_tokens"],
        b["usage"]["completion_tokens"]
    );
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["model"], MODEL);
    assert_eq!(a["choices"][0]["index"], 0);
    assert_eq!(a["choices"][0]["message"]["role"], "assistant");
    assert_eq!(a["choices"][0]["finish_reason"], "stop");
    assert!(a["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("chatcmpl-")));
    assert!(a["created"].as_u64().is_some());
    // A fresh simulator gives the same output too.
    let other = start_sim(SimConfig::default()).await;
    assert_eq!(post(&other, &body).await.content(), first.content());
}

#[tokio::test]
async fn summarize_returns_the_first_words() {
    let sim = start_sim(SimConfig::default()).await;
    let text = "one two  three\nfour five six seven";
    let answer = post(&sim, &request("Task: summarize\nMax words: 4", text)).await;
    assert_eq!(answer.content(), "one two three four");
    let answer = post(&sim, &request("Task: summarize\nMax words: 40", text)).await;
    assert_eq!(answer.content(), "one two three four five six seven");
}

#[tokio::test]
async fn classify_returns_one_of_the_labels() {
    let sim = start_sim(SimConfig::default()).await;
    let labels = ["billing", "bug", "praise"];
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..30 {
        let answer = post(
            &sim,
            &request(
                "Task: classify\nLabels: billing, bug, praise",
                &format!("ticket {i}"),
            ),
        )
        .await;
        let label = answer.content();
        assert!(labels.contains(&label.as_str()), "{label}");
        seen.insert(label);
    }
    assert!(seen.len() >= 2, "30 contents all got {seen:?}");
}

#[tokio::test]
async fn extract_returns_a_json_object_following_the_schema() {
    let sim = start_sim(SimConfig::default()).await;
    let system = "Task: extract\nSchema: {\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"year\":{\"type\":\"integer\"},\"open\":{\"type\":\"boolean\"}}}";
    let answer = post(&sim, &request(system, "Founded in Lyon in 1872")).await;
    let content = answer.content();
    assert!(!content.contains(' '), "compact JSON expected: {content}");
    let out: Value = serde_json::from_str(&content).expect("content is JSON");
    let obj = out.as_object().expect("object");
    assert_eq!(obj.len(), 3);
    assert!(["Founded", "in", "Lyon", "1872"].contains(&obj["city"].as_str().expect("string")));
    assert!(obj["year"].is_u64());
    assert!(obj["open"].is_boolean());
}

#[tokio::test]
async fn micro_batch_round_trips_in_order_with_single_task_outputs() {
    let sim = start_sim(SimConfig::default()).await;
    let task = "Task: summarize\nMax words: 3";
    let contents = [
        ("a1", "alpha beta gamma delta"),
        ("b-2", "one"),
        ("c3", "x y z w v"),
    ];
    let mut user = String::new();
    for (id, content) in contents {
        user.push_str(&format!("### item {id}\n{content}\n"));
    }
    let answer = post(&sim, &request(&format!("{task}\nBatch: v1"), &user)).await;
    assert_eq!(answer.status, StatusCode::OK);
    let parsed: Value = serde_json::from_str(&answer.content()).expect("batch answer is JSON");
    let items = parsed["items"].as_array().expect("items");
    assert_eq!(items.len(), 3);
    for (item, (id, content)) in items.iter().zip(contents) {
        assert_eq!(item["id"], id);
        let single = post(&sim, &request(task, content)).await.content();
        assert_eq!(item["output"], single.as_str());
    }
    // Classify: the label of an item equals the label of the same content sent alone, even
    // with surrounding whitespace and free-text instructions in the system prompt.
    let task = "Task: classify\nLabels: l1, l2, l3, l4\n\nPick one label. Note: be terse.";
    let contents: Vec<String> = (0..8).map(|i| format!("  review number {i}\n")).collect();
    let user: String = contents
        .iter()
        .enumerate()
        .map(|(i, c)| format!("### item r{i}\n{c}\n"))
        .collect();
    let answer = post(&sim, &request(&format!("Batch: v1\n{task}"), &user)).await;
    let parsed: Value = serde_json::from_str(&answer.content()).expect("batch answer is JSON");
    for (i, content) in contents.iter().enumerate() {
        let single = post(&sim, &request(task, content)).await.content();
        assert_eq!(parsed["items"][i]["id"], format!("r{i}"));
        assert_eq!(parsed["items"][i]["output"], single.as_str(), "item {i}");
    }

    // Extract items carry JSON values, not strings.
    let system = "Task: extract\nBatch: v1\nSchema: {\"properties\":{\"n\":{\"type\":\"number\"}}}";
    let answer = post(&sim, &request(system, "### item 1\nfoo\n### item 2\nbar")).await;
    let parsed: Value = serde_json::from_str(&answer.content()).expect("JSON");
    assert!(parsed["items"][0]["output"]["n"].is_number());
    assert!(parsed["items"][1]["output"]["n"].is_number());

    let stats = sim.stats();
    assert_eq!(stats.batch_requests, 3);
    assert_eq!(stats.batch_items, 13);
}

#[tokio::test]
async fn reordered_batch_answers_keep_each_items_id() {
    let sim = start_sim(SimConfig {
        batch_reorder_rate: 1.0,
        ..SimConfig::default()
    })
    .await;
    let system = "Task: summarize\nMax words: 3\nBatch: v1";
    let user = "### item a1\nalpha one two three\n### item b2\nbravo four five six\n";
    let answer = post(&sim, &request(system, user)).await;
    let parsed: Value = serde_json::from_str(&answer.content()).expect("JSON");
    let items = parsed["items"].as_array().unwrap();
    assert_eq!(items[0]["id"], "b2");
    assert_eq!(items[1]["id"], "a1");
    assert!(items[0]["output"].as_str().unwrap().starts_with("bravo"));
}

#[tokio::test]
async fn malformed_batches_cannot_be_split_and_are_deterministic() {
    let sim = start_sim(SimConfig {
        batch_malformed_rate: 1.0,
        ..SimConfig::default()
    })
    .await;
    let system = "Task: classify\nLabels: x, y\nBatch: v1";
    for n in 0..12 {
        let user: String = (0..3)
            .map(|i| format!("### item {n}-{i}\ntext {n} {i}\n"))
            .collect();
        let first = post(&sim, &request(system, &user)).await;
        assert_eq!(first.status, StatusCode::OK);
        let content = first.content();
        let splittable = serde_json::from_str::<Value>(&content)
            .ok()
            .and_then(|v| v["items"].as_array().map(|items| items.len() == 3))
            .unwrap_or(false);
        assert!(!splittable, "batch {n} was splittable: {content}");
        assert_eq!(post(&sim, &request(system, &user)).await.content(), content);
    }
    assert_eq!(sim.stats().injected.batch_malformed, 24);

    // Single-task requests are unaffected by the batch knob.
    let single = post(
        &sim,
        &request("Task: summarize\nMax words: 1", "hello world"),
    )
    .await;
    assert_eq!(single.content(), "hello");
}

#[tokio::test]
async fn token_counts_and_cached_tokens() {
    let sim = start_sim(SimConfig::default()).await;
    let system = "Task: summarize\nMax words: 2"; // 28 chars -> 7 tokens + 4
    let user = "abcdefghij klmnop"; // 17 chars -> 5 tokens + 4
    let expected_prompt = tokens_for_message(system) + tokens_for_message(user);
    assert_eq!(expected_prompt, 20);
    let first = post(&sim, &request(system, user)).await.json();
    assert_eq!(first["usage"]["prompt_tokens"], 20);
    // "abcdefghij klmnop" (17 chars) -> 5 tokens
    assert_eq!(first["usage"]["completion_tokens"], 5);
    assert_eq!(first["usage"]["total_tokens"], 25);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // Same system prompt, other user content: the system message is cached.
    let second = post(&sim, &request(system, "x")).await.json();
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        11
    );
    assert_eq!(second["usage"]["completion_tokens"], 1);
    // A different system prompt is not.
    let third = post(&sim, &request("Task: summarize\nMax words: 3", "x"))
        .await
        .json();
    assert_eq!(third["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let stats = sim.stats();
    assert_eq!(stats.prompt_tokens, 20 + (11 + 5) + (11 + 5));
    assert_eq!(stats.completion_tokens, 5 + 1 + 1);
    assert_eq!(stats.cached_tokens, 11);
}

#[tokio::test]
async fn max_tokens_truncates_with_finish_reason_length() {
    let sim = start_sim(SimConfig::default()).await;
    let mut body = request(
        "Task: summarize\nMax words: 100",
        "aaaa bbbb cccc dddd eeee",
    );
    body["max_tokens"] = json!(2);
    let answer = post(&sim, &body).await.json();
    assert_eq!(answer["choices"][0]["message"]["content"], "aaaa bbb");
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    assert_eq!(answer["usage"]["completion_tokens"], 2);
}

// ---------------------------------------------------------------------------------------
// Over a socket: request validation and auth

#[tokio::test]
async fn api_keys_are_checked() {
    let sim = start_sim(SimConfig {
        api_keys: vec![KEY.to_owned()],
        ..SimConfig::default()
    })
    .await;
    let body = request("Task: summarize", "hi");
    let c = sim.http.clone();
    for key in [None, Some("sk-wrong")] {
        let answer = post_with(&c, &sim, key, &body).await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED, "{key:?}");
        assert_eq!(answer.error_code(), "invalid_api_key");
        assert_eq!(answer.json()["error"]["type"], "invalid_request_error");
        assert!(
            !answer.text.contains("sk-wrong"),
            "the key must not be echoed"
        );
    }
    assert_eq!(
        post_with(&c, &sim, Some(KEY), &body).await.status,
        StatusCode::OK
    );

    // Without configured keys any key or none works (like vLLM or Ollama).
    let open = start_sim(SimConfig::default()).await;
    assert_eq!(
        post_with(&c, &open, Some("anything"), &body).await.status,
        StatusCode::OK
    );
    assert_eq!(
        post_with(&c, &open, None, &body).await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn malformed_requests_get_openai_style_400s() {
    let sim = start_sim(SimConfig::default()).await;
    let c = sim.http.clone();
    let cases = [
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": true}),
        json!({"messages": [{"role": "user", "content": "hi"}]}),
        json!({"model": MODEL, "messages": []}),
        json!({"model": MODEL, "messages": [{"content": "no role"}]}),
        json!({"model": MODEL, "messages": [{"role": "user", "content": 42}]}),
        json!({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}),
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}),
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 7}),
        json!([1, 2, 3]),
    ];
    for body in &cases {
        let answer = post_with(&c, &sim, Some(KEY), body).await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{body}: {}",
            answer.text
        );
        assert_eq!(
            answer.json()["error"]["type"],
            "invalid_request_error",
            "{body}"
        );
    }
    // Not JSON at all.
    let response = c
        .post(format!("{}/chat/completions", sim.base_url()))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let body: Value = response.json().await.expect("JSON error body");
    assert!(body["error"]["message"].is_string());

    // Content parts and unknown fields are accepted.
    let parts = json!({"model": MODEL, "user": "u1", "n": 1, "response_format": {"type": "json_object"},
        "messages": [{"role": "system", "content": [{"type": "text", "text": "Task: summarize\nMax words: 1"}]},
                     {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]});
    let answer = post_with(&c, &sim, Some(KEY), &parts).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
    assert_eq!(answer.content(), "hello");
    assert_eq!(sim.stats().status(400), cases.len() as u64 + 1);
}

#[tokio::test]
async fn models_are_listed_and_unknown_models_rejected() {
    let sim = start_sim(SimConfig {
        models: Some(vec![MODEL.to_owned(), "sim-large".to_owned()]),
        ..SimConfig::default()
    })
    .await;
    let list: Value = sim
        .http
        .get(format!("{}/models", sim.base_url()))
        .bearer_auth(KEY)
        .send()
        .await
        .expect("sent")
        .json()
        .await
        .expect("JSON");
    let ids: Vec<&str> = list["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, vec![MODEL, "sim-large"]);

    let mut body = request("Task: summarize", "hi");
    body["model"] = json!("gpt-unknown");
    let answer = post(&sim, &body).await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    assert_eq!(answer.error_code(), "model_not_found");
}

#[tokio::test]
async fn context_length_and_content_policy_are_enforced() {
    let sim = start_sim(SimConfig {
        context_length: Some(30),
        content_policy_marker: Some("FORBIDDEN".to_owned()),
        ..SimConfig::default()
    })
    .await;
    let long = "word ".repeat(40);
    let answer = post(&sim, &request("Task: summarize", &long)).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.error_code(), "context_length_exceeded");

    let answer = post(&sim, &request("Task: summarize", "this is FORBIDDEN text")).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.error_code(), "content_policy_violation");
    assert_eq!(
        post(&sim, &request("Task: summarize", "fine text"))
            .await
            .status,
        StatusCode::OK
    );

    // By rate: decided by the content, so the same content always gets the same verdict.
    sim.update(|c| c.content_policy_rate = 0.5).expect("valid");
    let mut rejected = 0;
    for i in 0..40 {
        let body = request("Task: summarize", &format!("message {i}"));
        let first = post(&sim, &body).await.status;
        assert_eq!(post(&sim, &body).await.status, first);
        if first == StatusCode::BAD_REQUEST {
            rejected += 1;
        }
    }
    assert!(
        (8..=32).contains(&rejected),
        "rejected {rejected} of 40 at rate 0.5"
    );
}

// ---------------------------------------------------------------------------------------
// Over a socket: rate limits

#[tokio::test]
async fn rate_limit_429_carries_openai_headers() {
    let sim = start_sim(SimConfig {
        rps: Some(1.0),
        burst: Some(2),
        tpm: Some(100_000),
        ..SimConfig::default()
    })
    .await;
    let body = request("Task: summarize", "hello");
    let first = post(&sim, &body).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        first.header("x-ratelimit-limit-requests").as_deref(),
        Some("2")
    );
    assert_eq!(
        first.header("x-ratelimit-remaining-requests").as_deref(),
        Some("1")
    );
    assert!(first.header("x-ratelimit-reset-requests").is_some());
    assert_eq!(
        first.header("x-ratelimit-limit-tokens").as_deref(),
        Some("100000")
    );
    let remaining: u64 = first
        .header("x-ratelimit-remaining-tokens")
        .expect("remaining tokens")
        .parse()
        .expect("number");
    assert!(remaining < 100_000 && remaining > 99_900, "{remaining}");
    assert!(first.header("retry-after").is_none());

    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
    let limited = post(&sim, &body).await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(limited.error_code(), "rate_limit_exceeded");
    assert_eq!(limited.json()["error"]["type"], "rate_limit_error");
    assert_eq!(limited.header("retry-after").as_deref(), Some("1"));
    let ms: u64 = limited
        .header("retry-after-ms")
        .expect("retry-after-ms")
        .parse()
        .expect("number");
    assert!((500..=1000).contains(&ms), "retry-after-ms {ms}");
    assert_eq!(
        limited.header("x-ratelimit-remaining-requests").as_deref(),
        Some("0")
    );

    // Waiting as told is enough.
    tokio::time::sleep(Duration::from_millis(ms)).await;
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
    let stats = sim.stats();
    assert_eq!(stats.status(429), 1);
    assert_eq!(stats.injected.rate_limited, 1);
}

#[tokio::test]
async fn rate_limit_429_without_headers_is_bare() {
    let sim = start_sim(SimConfig {
        rpm: Some(2),
        rate_limit_headers: false,
        ..SimConfig::default()
    })
    .await;
    let body = request("Task: summarize", "hello");
    let ok = post(&sim, &body).await;
    assert_eq!(ok.status, StatusCode::OK);
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
    let limited = post(&sim, &body).await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(limited.error_code(), "rate_limit_exceeded");
    for answer in [&ok, &limited] {
        let names: Vec<&str> = answer
            .headers
            .keys()
            .map(|k| k.as_str())
            .filter(|k| k.starts_with("x-ratelimit") || k.starts_with("retry-after"))
            .collect();
        assert!(names.is_empty(), "unexpected headers {names:?}");
    }
}

#[tokio::test]
async fn tokens_per_minute_limit_counts_prompt_and_max_tokens() {
    let sim = start_sim(SimConfig {
        tpm: Some(1000),
        ..SimConfig::default()
    })
    .await;
    let mut body = request("Task: summarize", "hello");
    body["max_tokens"] = json!(400);
    // prompt (2+4)+(2+4)... small; each request costs prompt + 400.
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
    let limited = post(&sim, &body).await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(limited.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("TPM")));
    // Without max_tokens only the (tiny) completion counts.
    body.as_object_mut().expect("object").remove("max_tokens");
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
}

/// Hammers the simulator from several connections for `window` and counts 200s.
async fn hammer(sim: &SimHandle, window: Duration, workers: usize) -> (u64, u64) {
    let clients: Vec<reqwest::Client> = (0..workers).map(|_| client()).collect();
    let deadline = Instant::now() + window;
    let mut tasks = Vec::new();
    for (w, c) in clients.into_iter().enumerate() {
        let url = format!("{}/chat/completions", sim.base_url());
        tasks.push(tokio::spawn(async move {
            let body = request("Task: summarize", &format!("worker {w}"));
            let (mut ok, mut limited) = (0u64, 0u64);
            while Instant::now() < deadline {
                let response = c
                    .post(&url)
                    .bearer_auth(KEY)
                    .json(&body)
                    .send()
                    .await
                    .expect("sent");
                match response.status() {
                    StatusCode::OK => ok += 1,
                    StatusCode::TOO_MANY_REQUESTS => limited += 1,
                    other => panic!("unexpected status {other}"),
                }
                let _ = response.bytes().await;
            }
            (ok, limited)
        }));
    }
    let mut totals = (0, 0);
    for task in tasks {
        let (ok, limited) = task.await.expect("worker");
        totals.0 += ok;
        totals.1 += limited;
    }
    totals
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_per_second_are_enforced_within_a_few_percent() {
    let sim = start_sim(SimConfig {
        rps: Some(100.0),
        burst: Some(10),
        ..SimConfig::default()
    })
    .await;
    let window = Duration::from_secs(2);
    let (ok, limited) = hammer(&sim, window, 8).await;
    // burst + rate * window
    let expected = 10.0 + 100.0 * window.as_secs_f64();
    let error = (ok as f64 - expected).abs() / expected;
    assert!(
        error < 0.05,
        "{ok} successes ({limited} 429s), expected about {expected}"
    );
    assert!(
        limited > ok,
        "the limiter was not saturated ({limited} 429s)"
    );
    assert_eq!(sim.stats().served_ok, ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn halving_the_rate_at_run_time_takes_effect_at_once() {
    let sim = start_sim(SimConfig {
        rps: Some(100.0),
        burst: Some(5),
        ..SimConfig::default()
    })
    .await;
    let (fast, _) = hammer(&sim, Duration::from_secs(1), 6).await;
    let response = put_config(&sim, json!({"rps": 50.0})).await;
    assert_eq!(response.status(), StatusCode::OK);
    let applied: Value = response.json().await.expect("config JSON");
    assert_eq!(applied["rps"], 50.0);
    assert_eq!(applied["burst"], 5, "fields not in the body are kept");
    let (slow, _) = hammer(&sim, Duration::from_secs(1), 6).await;
    assert!((100..=112).contains(&fast), "fast phase: {fast}");
    assert!((47..=58).contains(&slow), "slow phase: {slow}");
}

#[tokio::test]
async fn per_model_limits_are_separate_unless_global() {
    let config = SimConfig {
        rpm: Some(1),
        ..SimConfig::default()
    };
    let sim = start_sim(config.clone()).await;
    let mut body = request("Task: summarize", "hi");
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
    assert_eq!(
        post(&sim, &body).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    body["model"] = json!("sim-large");
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);

    let global = start_sim(SimConfig {
        limit_scope: LimitScope::Global,
        ..config
    })
    .await;
    body["model"] = json!(MODEL);
    assert_eq!(post(&global, &body).await.status, StatusCode::OK);
    body["model"] = json!("sim-large");
    assert_eq!(
        post(&global, &body).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn burst_429_storms_come_and_go() {
    let sim = start_sim(SimConfig::default()).await;
    let body = request("Task: summarize", "hi");
    sim.update(|c| {
        c.burst_429 = Some(Burst429 {
            every_s: 1.0,
            duration_s: 0.5,
        })
    })
    .expect("valid");
    let storm = post(&sim, &body).await;
    assert_eq!(storm.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(storm.header("retry-after").as_deref(), Some("1"));
    let ms: u64 = storm
        .header("retry-after-ms")
        .expect("ms")
        .parse()
        .expect("number");
    assert!(ms <= 500, "{ms}");
    tokio::time::sleep(Duration::from_millis(ms + 50)).await;
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
    sim.update(|c| c.burst_429 = None).expect("valid");
    assert_eq!(sim.stats().injected.burst_429, 1);
}

// ---------------------------------------------------------------------------------------
// Over a socket: faults and admin

#[tokio::test]
async fn status_override_scripts_an_outage_via_admin_config() {
    let sim = start_sim(SimConfig::default()).await;
    let body = request("Task: summarize", "hi");
    assert_eq!(
        put_config(&sim, json!({"status_override": 503}))
            .await
            .status(),
        StatusCode::OK
    );
    let answer = post(&sim, &body).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.json()["error"]["type"], "server_error");

    assert_eq!(
        put_config(&sim, json!({"status_override": 401}))
            .await
            .status(),
        StatusCode::OK
    );
    let answer = post(&sim, &body).await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    assert_eq!(answer.error_code(), "invalid_api_key");

    let config = admin_json(&sim, "/admin/config").await;
    assert_eq!(config["status_override"], 401);

    assert_eq!(
        put_config(&sim, json!({"status_override": null}))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);

    // Invalid configurations are refused and leave the old one in force.
    let refused = put_config(&sim, json!({"error_rate": 2.0})).await;
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    let refused = put_config(&sim, json!({"no_such_knob": true})).await;
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    assert_eq!(sim.config().error_rate, 0.0);

    // ?replace=true resets unspecified fields to their defaults.
    put_config(&sim, json!({"rps": 5.0})).await;
    let response = sim
        .http
        .put(format!("{}/admin/config?replace=true", sim.root_url()))
        .json(&json!({"error_rate": 0.0}))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(sim.config().rps, None);

    let stats = sim.stats();
    assert_eq!(stats.status(503), 1);
    assert_eq!(stats.status(401), 1);
    assert_eq!(stats.injected.status_override, 2);
}

#[tokio::test]
async fn error_rate_injects_exactly_that_fraction_of_5xx() {
    let sim = start_sim(SimConfig {
        error_rate: 0.3,
        ..SimConfig::default()
    })
    .await;
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..100 {
        let answer = post(&sim, &request("Task: summarize", &format!("m{i}"))).await;
        if answer.status.is_server_error() {
            assert_eq!(answer.json()["error"]["type"], "server_error");
        }
        *statuses.entry(answer.status.as_u16()).or_insert(0u64) += 1;
    }
    let errors: u64 = [500, 502, 503].iter().filter_map(|s| statuses.get(s)).sum();
    assert_eq!(errors, 30, "{statuses:?}");
    assert_eq!(statuses.get(&200), Some(&70));
    assert!(
        [500u16, 502, 503].iter().all(|s| statuses.contains_key(s)),
        "{statuses:?}"
    );
    assert_eq!(sim.stats().injected.server_errors, 30);
}

#[tokio::test]
async fn malformed_rate_gives_200s_that_are_not_completions() {
    let sim = start_sim(SimConfig {
        malformed_rate: 1.0,
        ..SimConfig::default()
    })
    .await;
    for i in 0..4 {
        let answer = post(&sim, &request("Task: summarize", &format!("m{i}"))).await;
        assert_eq!(answer.status, StatusCode::OK);
        let parsed: Option<Value> = serde_json::from_str(&answer.text).ok();
        let has_choices = parsed.as_ref().is_some_and(|v| v["choices"].is_array());
        assert!(!has_choices, "a well-formed completion: {}", answer.text);
    }
    assert_eq!(sim.stats().injected.malformed, 4);
}

#[tokio::test]
async fn resets_cut_the_answer_mid_body() {
    let sim = start_sim(SimConfig {
        reset_rate: 1.0,
        ..SimConfig::default()
    })
    .await;
    for i in 0..3 {
        let response = sim
            .http
            .post(format!("{}/chat/completions", sim.base_url()))
            .bearer_auth(KEY)
            .json(&request("Task: summarize", &format!("r{i}")))
            .send()
            .await
            .expect("the headers arrive");
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.text().await.is_err(), "the body is cut");
    }
    assert_eq!(sim.stats().injected.resets, 3);
}

#[tokio::test]
async fn hangs_hold_requests_for_hang_ms_or_until_the_client_gives_up() {
    let sim = start_sim(SimConfig {
        hang_rate: 1.0,
        hang_ms: 300,
        ..SimConfig::default()
    })
    .await;
    let body = request("Task: summarize", "hi");
    let started = Instant::now();
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(300));

    sim.update(|c| c.hang_ms = 0).expect("valid");
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(400))
        .build()
        .expect("client");
    let result = impatient
        .post(format!("{}/chat/completions", sim.base_url()))
        .bearer_auth(KEY)
        .json(&body)
        .send()
        .await;
    assert!(
        result.is_err_and(|e| e.is_timeout()),
        "a held request must time out"
    );

    // Shutdown releases held requests.
    let url = format!("{}/chat/completions", sim.base_url());
    let http = sim.http.clone();
    let held = tokio::spawn(async move {
        http.post(url)
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .await
            .map(|r| r.status())
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats = sim.stats();
    assert_eq!(stats.injected.hangs, 3);
    let stopped = Instant::now();
    sim.handle.shutdown().await;
    assert!(stopped.elapsed() < Duration::from_secs(3));
    let status = held.await.expect("task").expect("answered before shutdown");
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_queue_requests_in_arrival_order_without_429s() {
    let sim = start_sim(SimConfig {
        slots: Some(2),
        latency: Latency::Fixed { ms: 200 },
        ..SimConfig::default()
    })
    .await;
    // Six requests at once on two slots of 200 ms: answered in three waves.
    let started = Instant::now();
    let mut calls = Vec::new();
    for i in 0..6 {
        let (http, url) = (
            sim.http.clone(),
            format!("{}/chat/completions", sim.base_url()),
        );
        let body = request("Task: summarize", &format!("queued {i}"));
        calls.push(tokio::spawn(async move {
            let r = http.post(url).bearer_auth(KEY).json(&body).send().await;
            (r.expect("answered").status(), started.elapsed())
        }));
    }
    let mut waits = Vec::new();
    for c in calls {
        let (status, elapsed) = c.await.expect("task");
        assert_eq!(
            status,
            StatusCode::OK,
            "a queueing server never answers 429"
        );
        waits.push(elapsed);
    }
    waits.sort();
    assert!(waits[5] >= Duration::from_millis(600), "{waits:?}");
    let stats = sim.stats();
    assert_eq!(stats.status(200), 6);
    assert_eq!(stats.queued, 4, "two served at once, four waited");
    assert_eq!(stats.abandoned, 0);
    assert_eq!(stats.in_flight, 0, "every request answered");
    assert_eq!(stats.peak_in_flight, 6, "six were under way at once");

    // A client that gives up while its request waits leaves the queue: counted as
    // abandoned, and the slot goes on to the next request.
    sim.update(|c| c.slots = Some(1)).expect("valid");
    let (http, url) = (
        sim.http.clone(),
        format!("{}/chat/completions", sim.base_url()),
    );
    let holder = tokio::spawn(async move {
        let body = request("Task: summarize", "holds the slot");
        http.post(url)
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .await
            .map(|r| r.status())
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .build()
        .expect("client");
    let gave_up = impatient
        .post(format!("{}/chat/completions", sim.base_url()))
        .bearer_auth(KEY)
        .json(&request("Task: summarize", "gives up"))
        .send()
        .await;
    assert!(gave_up.is_err_and(|e| e.is_timeout()));
    assert_eq!(
        holder.await.expect("task").expect("answered"),
        StatusCode::OK
    );
    assert_eq!(
        post(&sim, &request("Task: summarize", "next")).await.status,
        StatusCode::OK
    );
    let stats = sim.stats();
    assert_eq!(stats.abandoned, 1, "{stats:?}");
    assert_eq!(stats.status(200), 8);
    assert_eq!(
        stats.in_flight, 0,
        "an abandoned request is no longer in flight"
    );
}

#[tokio::test]
async fn latency_is_applied() {
    let sim = start_sim(SimConfig {
        latency: Latency::Fixed { ms: 150 },
        model_overrides: [(
            "fast".to_owned(),
            ModelOverrides {
                latency: Some(Latency::Fixed { ms: 0 }),
                ..ModelOverrides::default()
            },
        )]
        .into_iter()
        .collect(),
        ..SimConfig::default()
    })
    .await;
    let mut body = request("Task: summarize", "hi");
    let started = Instant::now();
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(150));
    body["model"] = json!("fast");
    let started = Instant::now();
    assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
    assert!(started.elapsed() < Duration::from_millis(150));

    sim.update(|c| {
        c.latency = Latency::Lognormal {
            median_ms: 20,
            p99_ms: 60,
        }
    })
    .expect("valid");
    body["model"] = json!(MODEL);
    let started = Instant::now();
    for _ in 0..10 {
        assert_eq!(post(&sim, &body).await.status, StatusCode::OK);
    }
    let mean = started.elapsed() / 10;
    assert!(
        mean >= Duration::from_millis(10) && mean < Duration::from_millis(500),
        "{mean:?}"
    );
}

#[tokio::test]
async fn stats_and_calls_prove_how_many_calls_a_task_caused() {
    let sim = start_sim(SimConfig {
        rpm: Some(5),
        ..SimConfig::default()
    })
    .await;
    let system = "Task: summarize\nMax words: 3";
    for _ in 0..3 {
        assert_eq!(
            post(&sim, &request(system, "task-7f3a: some text"))
                .await
                .status,
            StatusCode::OK
        );
    }
    assert_eq!(
        post(&sim, &request(system, "task-0001: other"))
            .await
            .status,
        StatusCode::OK
    );
    let batch = "### item task-9b2c\nbatched text\n### item task-0002\nmore";
    assert_eq!(
        post(&sim, &request(&format!("{system}\nBatch: v1"), batch))
            .await
            .status,
        StatusCode::OK
    );
    // Over the limit: not a successful call.
    assert_eq!(
        post(&sim, &request(system, "task-7f3a: some text"))
            .await
            .status,
        StatusCode::TOO_MANY_REQUESTS
    );
    let mut other = request(system, "task-7f3a: some text");
    other["model"] = json!("sim-large");
    assert_eq!(post(&sim, &other).await.status, StatusCode::OK);

    assert_eq!(calls_containing(&sim, "task-7f3a").await, 4);
    assert_eq!(calls_containing(&sim, "task-0001").await, 1);
    assert_eq!(calls_containing(&sim, "task-9b2c").await, 1);
    assert_eq!(calls_containing(&sim, "task-").await, 6);
    assert_eq!(calls_containing(&sim, "never sent").await, 0);
    assert_eq!(sim.calls_containing("task-7f3a"), 4);

    let stats: SimStats =
        serde_json::from_value(admin_json(&sim, "/admin/stats").await).expect("stats");
    assert_eq!(stats.requests_total, 7);
    assert_eq!(stats.served_ok, 6);
    assert_eq!(stats.status(200), 6);
    assert_eq!(stats.status(429), 1);
    assert_eq!(stats.by_model.get(MODEL), Some(&5));
    assert_eq!(stats.by_model.get("sim-large"), Some(&1));
    assert_eq!(stats.batch_requests, 1);
    assert_eq!(stats.batch_items, 2);
    assert_eq!(stats.distinct_user_contents, 3);
    assert_eq!(stats, sim.stats());

    let response = sim
        .http
        .post(format!("{}/admin/reset", sim.root_url()))
        .send()
        .await
        .expect("sent");
    assert!(response.status().is_success());
    assert_eq!(sim.stats(), SimStats::default());
    assert_eq!(calls_containing(&sim, "task-").await, 0);

    let health = sim
        .http
        .get(format!("{}/healthz", sim.root_url()))
        .send()
        .await
        .expect("sent");
    assert_eq!(health.status(), StatusCode::OK);
    let missing = sim
        .http
        .get(format!("{}/admin/calls", sim.root_url()))
        .send()
        .await
        .expect("sent");
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
}

// ---------------------------------------------------------------------------------------
// Answers as real servers give them

/// A reasoning model refuses `temperature`, spends hidden tokens of the cap first (an
/// empty answer cut at a small cap) and reports them.
#[tokio::test]
async fn a_reasoning_model_refuses_temperature_and_spends_hidden_tokens() {
    let mut config = SimConfig::default();
    config.model_overrides.insert(
        MODEL.into(),
        ModelOverrides {
            reasoning_tokens: Some(64),
            ..Default::default()
        },
    );
    let sim = start_sim(config).await;
    let with_temperature = post(&sim, &request("Task: classify\nLabels: a, b", "text")).await;
    assert_eq!(with_temperature.status, StatusCode::BAD_REQUEST);
    assert_eq!(with_temperature.error_code(), "unsupported_value");

    let mut small = request("Task: classify\nLabels: a, b", "text");
    small.as_object_mut().unwrap().remove("temperature");
    small["max_completion_tokens"] = json!(16);
    let cut = post(&sim, &small).await.json();
    assert_eq!(cut["choices"][0]["finish_reason"], "length");
    assert_eq!(cut["choices"][0]["message"]["content"], "");
    assert_eq!(cut["usage"]["completion_tokens"], 16);
    assert_eq!(
        cut["usage"]["completion_tokens_details"]["reasoning_tokens"],
        16
    );

    small["max_completion_tokens"] = json!(200);
    let answered = post(&sim, &small).await.json();
    assert_eq!(answered["choices"][0]["finish_reason"], "stop");
    assert!(["a", "b"].contains(
        &answered["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
    ));
    assert_eq!(
        answered["usage"]["completion_tokens_details"]["reasoning_tokens"],
        64
    );
    assert!(answered["usage"]["completion_tokens"].as_u64().unwrap() > 64);
}

/// Refusals, missing usage and `<think>` prefixes, as some servers answer.
#[tokio::test]
async fn refusals_missing_usage_and_think_prefixes() {
    let sim = start_sim(SimConfig {
        refusal_marker: Some("forbidden".into()),
        omit_usage: true,
        think_prefix: true,
        ..Default::default()
    })
    .await;
    let refused = post(
        &sim,
        &request("Task: summarize\nMax words: 5", "a forbidden text"),
    )
    .await;
    let refused = refused.json();
    assert_eq!(refused["choices"][0]["message"]["content"], Value::Null);
    assert!(refused["choices"][0]["message"]["refusal"].is_string());
    assert_eq!(refused["usage"], Value::Null);
    let answered = post(
        &sim,
        &request("Task: summarize\nMax words: 5", "plain text here"),
    )
    .await;
    let content = answered.content();
    assert!(
        content.starts_with("<think>") && content.ends_with("plain text here"),
        "{content}"
    );
}

/// Context-length errors in vLLM's and llama.cpp's shapes (the client reads
/// both as `too_large`: `llm/transport/tests.rs`).
#[tokio::test]
async fn context_errors_in_other_servers_shapes() {
    for (style, check) in [
        (ContextErrorStyle::Vllm, "maximum context length"),
        (ContextErrorStyle::LlamaCpp, "exceed_context_size_error"),
    ] {
        let sim = start_sim(SimConfig {
            context_length: Some(10),
            context_error_style: style,
            ..Default::default()
        })
        .await;
        let answer = post(&sim, &request("Task: summarize", &"long ".repeat(100))).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);
        assert!(answer.text.contains(check), "{}", answer.text);
    }
}

/// Generation time grows with the answer at `ms_per_output_token`.
#[tokio::test]
async fn latency_grows_with_the_answer() {
    let sim = start_sim(SimConfig {
        ms_per_output_token: 20.0,
        latency: Latency::Fixed { ms: 0 },
        ..Default::default()
    })
    .await;
    let started = Instant::now();
    let answer = post(
        &sim,
        &request("Task: summarize\nMax words: 30", &"word ".repeat(30)),
    )
    .await;
    let tokens = answer.json()["usage"]["completion_tokens"]
        .as_u64()
        .unwrap();
    assert!(tokens >= 10);
    assert!(started.elapsed() >= Duration::from_millis(20 * tokens));
}
