//! The default pipeline in the in-process `TopologyTestDriver`, against the
//! simulated provider over a real socket.

use std::collections::HashMap;
use std::time::Duration;

use prometheus::Registry;
use sluice_topology::{OutputRecord, TopologyTestDriver};

use crate::config::Config;
use crate::envelope::TaskResult;
use crate::llm::LlmClient;
use crate::operator::Health;
use crate::sim::{SimConfig, SimHandle};

struct Setup {
    _rt: tokio::runtime::Runtime,
    sim: SimHandle,
    driver: TopologyTestDriver,
}

fn setup(extra: &str) -> Setup {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let sim = rt
        .block_on(crate::sim::start(
            SimConfig::default(),
            "127.0.0.1:0".parse().unwrap(),
        ))
        .unwrap();
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

[prices.small]
input = 150000
output = 600000
{extra}
"#,
        sim.base_url()
    );
    let config = Config::from_toml_with_env(&text, []).unwrap();
    let registry = Registry::new();
    let client = LlmClient::from_config(&config.llm, &registry).unwrap();
    let steps = crate::app::steps(&config, client, &registry, Health::default()).unwrap();
    let driver = TopologyTestDriver::new(super::default_topology(&steps).unwrap()).unwrap();
    Setup {
        _rt: rt,
        sim,
        driver,
    }
}

fn task(i: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "taskId": format!("t{i}"),
        "taskType": "classify",
        "tenantId": "acme",
        "requesterId": "svc",
        "priority": "normal",
        "submittedAt": "2026-12-01T10:00:00Z",
        "attemptNumber": 1,
        "payload": { "content": format!("Item {i}: markets rallied today."), "labels": ["news", "sports"] },
    }))
    .unwrap()
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
    for i in 0..10 {
        s.driver
            .pipe_raw("ai.tasks.classify", Some(b"acme"), Some(&task(i)), 0)
            .unwrap();
    }
    assert_eq!(s.driver.wait_for_async(Duration::from_secs(20)).unwrap(), 0);
    let done = results(s.driver.read_output("ai.results.completed"));
    assert_eq!(done.len(), 10);
    assert!(done.values().all(|r| r.success && r.batch_id.is_none()));
    assert_eq!(s.sim.stats().requests_total, 10);
}
