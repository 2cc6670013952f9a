//! `sluice demo`: the main job end to end on a local broker with the simulated
//! provider. It publishes a batch of AI tasks (with a few bad ones), runs the
//! LLM pipeline until every task has its result, then prints the per-tenant
//! usage the pipeline kept in its one-minute windows (from the usage topic),
//! checked against the sum of the results.

use std::collections::BTreeMap;
use std::time::Duration;

use clap::Args;
use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::Message;
use sluice_topology::Windowed;

use crate::accounting::UsageRecord;
use crate::config::Config;
use crate::envelope::TaskResult;
use crate::kafka::{produce, read_topics, OutRecord};
use crate::sim::SimConfig;

/// Arguments of `sluice demo`.
#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Kafka bootstrap servers of the (local) broker.
    #[arg(long, env = "SLUICE_BOOTSTRAP", default_value = "127.0.0.1:9092")]
    pub bootstrap: String,
    /// Number of tasks to publish.
    #[arg(long, default_value_t = 400)]
    pub tasks: usize,
}

const TENANTS: [&str; 4] = ["acme", "globex", "initech", "umbrella"];
const TYPES: [&str; 3] = ["summarize", "classify", "extract"];
const REFUSED_MARKER: &str = "[forbidden-topic]";
/// globex's hourly budget, micro-dollars.
const BUDGET_MICROS: i64 = 7_000;
/// initech's hourly hard quota, tokens.
const QUOTA_TOKENS: u64 = 8_000;

fn config_text(bootstrap: &str, run: &str, sim_url: &str, state: &str) -> String {
    format!(
        r#"
[app]
id = "demo-{run}"
state_dir = "{state}"
guarantee = "exactly_once"

[kafka]
bootstrap_servers = "{bootstrap}"
session_timeout_ms = 6000

[topics]
tasks_prefix = "demo-{run}.tasks."
results_completed = "demo-{run}.results.completed"
results_failed = "demo-{run}.results.failed"
usage = "demo-{run}.usage"
alerts = "demo-{run}.alerts"
partitions = 4

[[llm.providers]]
name = "sim"
base_url = "{sim_url}"

[[llm.models]]
name = "small"
provider = "sim"
limiter = {{ initial_rps = 50 }}

[[llm.models]]
name = "large"
provider = "sim"

[routing]
default_model = "small"
by_task_type = {{ extract = "large" }}
fallbacks = {{ small = "large" }}

[prices.small]
input = 150000
output = 600000
cached = 75000

[prices.large]
input = 2500000
output = 10000000
cached = 1250000

[http]
listen = "127.0.0.1:0"

# globex has a cost budget of {BUDGET_MICROS} µ$ an hour (alerts at 50/80/100 %);
# initech a hard quota of {QUOTA_TOKENS} tokens an hour.
[accounting.budgets.tenants.globex]
1h = {BUDGET_MICROS}

[accounting.quotas.tenants.initech]
window = "1h"
tokens = {QUOTA_TOKENS}
"#
    )
}

fn task(i: usize) -> (String, serde_json::Value) {
    let ty = TYPES[i % TYPES.len()];
    let tenant = TENANTS[(i / 3) % TENANTS.len()];
    let mut content = format!(
        "Ticket {i} from {tenant}: the checkout page times out after the payment step, \
         customers see an error and retry, which charges their card twice."
    );
    if i == 7 {
        content.push_str(REFUSED_MARKER);
    }
    let mut payload = serde_json::json!({ "content": content });
    match ty {
        "summarize" => payload["maxWords"] = 12.into(),
        "classify" => payload["labels"] = serde_json::json!(["billing", "bug", "feature-request"]),
        _ => {
            payload["schema"] = serde_json::json!({
                "type": "object",
                "properties": { "component": {"type": "string"}, "severity": {"type": "integer"} }
            })
        }
    }
    let priority = ["high", "normal", "batch"][i % 3];
    let task = serde_json::json!({
        "taskId": format!("demo-task-{i}"),
        "taskType": ty,
        "tenantId": tenant,
        "requesterId": "support-portal",
        "priority": priority,
        "submittedAt": chrono::Utc::now().to_rfc3339(),
        "attemptNumber": 1,
        "payload": payload,
        "metadata": { "ticket": i.to_string() },
    });
    (tenant.to_string(), task)
}

/// Runs the demo.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let sim_config = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "lognormal", "median_ms": 40, "p99_ms": 400 },
        "error_rate": 0.05,
        "content_policy_marker": REFUSED_MARKER,
    }))?;
    let sim = crate::sim::start(sim_config, "127.0.0.1:0".parse()?).await?;
    let state = std::env::temp_dir().join(format!("sluice-demo-{run}"));
    let config = Config::from_toml_with_env(
        &config_text(
            &args.bootstrap,
            &run,
            &sim.base_url(),
            &state.display().to_string(),
        ),
        std::iter::empty(),
    )?;
    let topics = config.topics.clone();
    let cfg = config.clone();
    tokio::task::spawn_blocking(move || crate::app::create_topics(&cfg)).await??;
    println!(
        "demo: simulated provider at {} (5% server errors, lognormal latency)",
        sim.base_url()
    );

    // Tasks, plus two records no service should have sent.
    let mut per_topic: BTreeMap<String, Vec<OutRecord>> = BTreeMap::new();
    for i in 0..args.tasks {
        let (tenant, t) = task(i);
        per_topic
            .entry(topics.task_topic(t["taskType"].as_str().unwrap_or("summarize")))
            .or_default()
            .push(OutRecord {
                key: Some(tenant.into_bytes()),
                value: Some(serde_json::to_vec(&t)?),
                ..Default::default()
            });
    }
    let summarize = topics.task_topic("summarize");
    per_topic.entry(summarize.clone()).or_default().extend([
        OutRecord {
            key: Some(b"acme".to_vec()),
            value: Some(b"{\"taskId\": \"broken".to_vec()),
            ..Default::default()
        },
        OutRecord {
            key: Some(b"acme".to_vec()),
            value: Some(serde_json::to_vec(&serde_json::json!({
                "taskId": "demo-unknown", "taskType": "translate", "tenantId": "acme",
                "submittedAt": chrono::Utc::now().to_rfc3339(), "payload": { "content": "hola" }
            }))?),
            ..Default::default()
        },
    ]);
    for (topic, records) in per_topic {
        let b = args.bootstrap.clone();
        tokio::task::spawn_blocking(move || produce(&b, &topic, records)).await??;
    }
    println!(
        "demo: published {} tasks and 2 malformed records to {}*",
        args.tasks, topics.tasks_prefix
    );

    // The LLM pipeline.
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let app = tokio::spawn(crate::app::run_until(config, async {
        let _ = stop_rx.await;
    }));
    let (b, completed, failed, n) = (
        args.bootstrap.clone(),
        topics.results_completed.clone(),
        topics.results_failed.clone(),
        args.tasks,
    );
    let results: Vec<OwnedMessage> = tokio::task::spawn_blocking(move || {
        read_topics(
            &b,
            &[&completed, &failed],
            true,
            Duration::from_secs(300),
            |m| m.len() >= n,
        )
    })
    .await??;
    let _ = stop_tx.send(());
    app.await??;
    let results: Vec<TaskResult> = results
        .iter()
        .filter_map(|m| serde_json::from_slice(m.payload()?).ok())
        .collect();
    report_results(&results, &sim.stats());

    let (b, dlq) = (args.bootstrap.clone(), topics.dlq_topic("summarize"));
    let dead = tokio::task::spawn_blocking(move || {
        read_topics(&b, &[&dlq], true, Duration::from_secs(3), |_| false)
    })
    .await??;
    let dead_classify = {
        let (b, dlq) = (args.bootstrap.clone(), topics.dlq_topic("classify"));
        tokio::task::spawn_blocking(move || {
            read_topics(&b, &[&dlq], true, Duration::from_secs(2), |_| false)
        })
        .await??
    };
    println!("\ndead letters (original bytes kept, reason in headers):");
    for m in dead.iter().chain(&dead_classify) {
        let h = |name: &str| {
            m.headers()
                .and_then(|hs| hs.iter().find(|h| h.key == name).and_then(|h| h.value))
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default()
        };
        println!(
            "  {:<28} category={:<15} reason={}",
            h("dlq.original.topic"),
            h("dlq.category"),
            h("dlq.reason")
        );
    }

    // The accounts sluice run kept in the same topology, per tenant and minute.
    let completed_count = results.iter().filter(|r| r.success).count() as u64;
    let usage = usage_per_minute(&args.bootstrap, &topics.usage, completed_count).await?;
    let mut by_tenant: BTreeMap<String, (u64, i64)> = BTreeMap::new();
    for r in results.iter().filter(|r| r.success) {
        let e = by_tenant.entry(r.tenant_id.clone()).or_default();
        e.0 += 1;
        e.1 += r.cost_micros;
    }
    let mut from_windows: BTreeMap<String, (u64, i64)> = BTreeMap::new();
    println!(
        "\nusage per tenant and minute (sluice run's 1-minute windows, from {}):",
        topics.usage
    );
    println!(
        "  {:<18} {:<10} {:>7} {:>14}",
        "window (UTC)", "tenant", "tasks", "cost (µ$)"
    );
    for ((start, tenant), (count, cost)) in &usage {
        let when = chrono::DateTime::from_timestamp_millis(*start)
            .map(|d| d.format("%Y-%m-%d %H:%M").to_string())
            .unwrap_or_default();
        println!("  {when:<18} {tenant:<10} {count:>7} {cost:>14}");
        let e = from_windows.entry(tenant.clone()).or_default();
        e.0 += count;
        e.1 += cost;
    }
    // Budget alerts and quota refusals.
    let (b, alerts_topic) = (args.bootstrap.clone(), topics.alerts.clone());
    let alerts = tokio::task::spawn_blocking(move || {
        read_topics(&b, &[&alerts_topic], true, Duration::from_secs(3), |_| {
            false
        })
    })
    .await??;
    println!(
        "
cost alerts (from {}):",
        topics.alerts
    );
    for m in &alerts {
        if let Some(Ok(a)) = m
            .payload()
            .map(serde_json::from_slice::<crate::accounting::AlertRecord>)
        {
            println!(
                "  {:<10} window {:<4} {:>4.0} % of {} µ$ (spent {} µ$)",
                a.tenant_id,
                a.window,
                a.threshold * 100.0,
                a.budget_micros,
                a.spent_micros
            );
        }
    }
    let refused: Vec<&TaskResult> = results
        .iter()
        .filter(|r| r.error_code.as_deref() == Some(crate::operator::QUOTA_EXCEEDED))
        .collect();
    let capped_tokens: u64 = results
        .iter()
        .filter(|r| r.success && r.tenant_id == "initech")
        .map(|r| r.input_tokens + r.output_tokens)
        .sum();
    println!(
        "
hard quota: initech used {capped_tokens} of {QUOTA_TOKENS} tokens; {} tasks refused (quota_exceeded, no call)",
        refused.len()
    );
    let _ = std::fs::remove_dir_all(&state);
    if alerts.is_empty() {
        anyhow::bail!("demo: globex passed its budget but no alert was emitted");
    }
    if capped_tokens > QUOTA_TOKENS || refused.iter().any(|r| r.tenant_id != "initech") {
        anyhow::bail!("demo: the hard quota was passed or refused another tenant");
    }
    if from_windows == by_tenant {
        println!("\ndemo: OK — every task has exactly one result; windowed usage equals the sum of the results");
        Ok(())
    } else {
        anyhow::bail!(
            "demo: windowed usage {from_windows:?} differs from the results {by_tenant:?}"
        )
    }
}

fn report_results(results: &[TaskResult], sim: &crate::sim::SimStats) {
    let mut per_id: BTreeMap<&str, usize> = BTreeMap::new();
    for r in results {
        *per_id.entry(r.task_id.as_str()).or_default() += 1;
    }
    let dupes = per_id.values().filter(|n| **n > 1).count();
    let ok = results.iter().filter(|r| r.success).count();
    println!(
        "\nresults: {} tasks, {} completed, {} failed, {} with more than one result",
        per_id.len(),
        ok,
        results.len() - ok,
        dupes
    );
    println!(
        "provider: {} calls answered, {} server errors retried, {} refused by content policy",
        sim.served_ok, sim.injected.server_errors, sim.injected.content_policy
    );
    println!(
        "\n  {:<10} {:>6} {:>9} {:>9} {:>8} {:>12}",
        "tenant", "tasks", "in tok", "out tok", "cached", "cost (µ$)"
    );
    let mut per_tenant: BTreeMap<&str, (u64, u64, u64, u64, i64)> = BTreeMap::new();
    for r in results.iter().filter(|r| r.success) {
        let e = per_tenant.entry(r.tenant_id.as_str()).or_default();
        e.0 += 1;
        e.1 += r.input_tokens;
        e.2 += r.output_tokens;
        e.3 += r.cached_tokens;
        e.4 += r.cost_micros;
    }
    for (t, (n, i, o, c, cost)) in per_tenant {
        println!("  {t:<10} {n:>6} {i:>9} {o:>9} {c:>8} {cost:>12}");
    }
    println!("\nsample answers:");
    for ty in TYPES {
        if let Some(r) = results.iter().find(|r| r.success && r.task_type == ty) {
            println!(
                "  {ty:<10} model={:<6} route={} → {}",
                r.model, r.route.reason, r.output
            );
        }
    }
    let failed: Vec<&TaskResult> = results.iter().filter(|r| !r.success).collect();
    // One example per error code.
    let mut shown = std::collections::BTreeSet::new();
    for r in failed.iter().filter(|r| shown.insert(r.error_code.clone())) {
        let n = failed
            .iter()
            .filter(|f| f.error_code == r.error_code)
            .count();
        println!(
            "  {n} failed with {}, e.g.:",
            r.error_code.as_deref().unwrap_or("?")
        );
        println!(
            "  failed {} ({}): {}",
            r.task_id,
            r.error_code.as_deref().unwrap_or("?"),
            r.error_message.as_deref().unwrap_or("")
        );
    }
}

/// The latest (tasks, cost) per (window start, tenant) of the 1-minute
/// windows on the usage topic, once they add up to `expected_tasks`.
async fn usage_per_minute(
    bootstrap: &str,
    usage_topic: &str,
    expected_tasks: u64,
) -> anyhow::Result<BTreeMap<(i64, String), (u64, i64)>> {
    let (b, topic) = (bootstrap.to_string(), usage_topic.to_string());
    let msgs = tokio::task::spawn_blocking(move || {
        read_topics(&b, &[&topic], true, Duration::from_secs(120), |m| {
            latest_usage(m).values().map(|(n, _)| n).sum::<u64>() >= expected_tasks
        })
    })
    .await??;
    Ok(latest_usage(&msgs))
}

/// The latest (tasks, cost) per (window start, tenant) of the 1-minute
/// windows in usage updates.
fn latest_usage(msgs: &[OwnedMessage]) -> BTreeMap<(i64, String), (u64, i64)> {
    let mut latest = BTreeMap::new();
    for m in msgs {
        let Ok(u) = serde_json::from_slice::<UsageRecord>(m.payload().unwrap_or_default()) else {
            continue;
        };
        let w = u.usage;
        if w.window == "1m" {
            latest.insert((w.window_start, u.tenant_id), (w.requests, w.cost_micros));
        }
    }
    latest
}

/// The last count per (window start, key) in windowed-count output.
pub fn latest_counts(msgs: &[OwnedMessage]) -> anyhow::Result<BTreeMap<(i64, String), u64>> {
    let mut out = BTreeMap::new();
    for m in msgs {
        let key: Windowed<String> = serde_json::from_slice(m.key().unwrap_or_default())?;
        let count: u64 = serde_json::from_slice(m.payload().unwrap_or_default())?;
        out.insert((key.window.start, key.key), count);
    }
    Ok(out)
}
