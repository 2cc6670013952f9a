//! `sluice demo`: the main job end to end on a local broker with the simulated
//! provider. It publishes a batch of AI tasks (with a few bad ones), runs the
//! LLM pipeline until every task has its result, then prints the per-tenant
//! usage the pipeline kept in its one-minute windows (from the usage topic),
//! checked against the sum of the results.
//!
//! The pipeline runs as a child `sluice run` process whose logs go to a file
//! (its path is printed; `SLUICE_LOG` sets their level), so the terminal shows
//! only the demo: the pipeline's `/metrics` URL, a progress line taken from
//! that endpoint and the results topics, then the summary.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::Message;
use sluice_topology::Windowed;
use tokio::io::AsyncBufReadExt;

use crate::config::Config;
use crate::envelope::TaskResult;
use crate::kafka::{produce, read_topics, OutRecord};
use crate::sim::SimConfig;
use crate::steps::account::UsageRecord;

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
    let log_path = std::env::temp_dir().join(format!("sluice-demo-{run}.log"));
    let config_path = std::env::temp_dir().join(format!("sluice-demo-{run}.toml"));
    let text = config_text(
        &args.bootstrap,
        &run,
        &sim.base_url(),
        &state.display().to_string(),
    );
    let config = Config::from_toml_with_env(&text, std::iter::empty())?;
    std::fs::write(&config_path, &text)?;
    let topics = config.topics.clone();
    tokio::task::spawn_blocking(move || crate::cli::run::create_topics(&config)).await??;
    println!(
        "demo: simulated provider at {} (5% server errors, lognormal latency)",
        sim.base_url()
    );
    println!(
        "demo: pipeline logs go to {} (level: SLUICE_LOG)",
        log_path.display()
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

    // The LLM pipeline: `sluice run` on the demo's config, as a child process.
    let mut pipeline = Pipeline::start(&config_path, &log_path).await?;
    println!("demo: metrics at http://{}/metrics", pipeline.addr);
    let done = Arc::new(AtomicUsize::new(0));
    let (stop_progress, progress_stopped) = tokio::sync::oneshot::channel::<()>();
    let progress = tokio::spawn(show_progress(
        format!("http://{}/metrics", pipeline.addr),
        done.clone(),
        args.tasks,
        progress_stopped,
    ));
    // Read on a thread of its own, so that a failed pipeline does not leave
    // the runtime waiting for the read's timeout.
    let (results_tx, results_rx) = tokio::sync::oneshot::channel();
    let (b, completed, failed, n) = (
        args.bootstrap.clone(),
        topics.results_completed.clone(),
        topics.results_failed.clone(),
        args.tasks,
    );
    std::thread::spawn(move || {
        let _ = results_tx.send(read_topics(
            &b,
            &[&completed, &failed],
            true,
            Duration::from_secs(300),
            |m| {
                done.store(m.len(), Ordering::Relaxed);
                m.len() >= n
            },
        ));
    });
    let results: Vec<OwnedMessage> = tokio::select! {
        r = results_rx => r??,
        status = pipeline.child.wait() => {
            let _ = stop_progress.send(());
            let _ = progress.await;
            let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
            return Err(pipeline.failed(&format!(
                "sluice run exited ({status}) before every task had its result"
            )));
        }
    };
    let _ = stop_progress.send(());
    let _ = progress.await;
    pipeline.stop().await?;
    let _ = std::fs::remove_file(&config_path);
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
            .map(serde_json::from_slice::<crate::steps::account::AlertRecord>)
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
        .filter(|r| r.error_code.as_deref() == Some(crate::steps::invoke_llm::QUOTA_EXCEEDED))
        .collect();
    let capped_tokens: u64 = results
        .iter()
        .filter(|r| r.accounted() && r.tenant_id == "initech")
        .map(|r| r.input_tokens + r.output_tokens)
        .sum();
    println!(
        "
hard quota: initech used {capped_tokens} of {QUOTA_TOKENS} tokens ({:.0} %); {} tasks refused (quota_exceeded, no call)",
        capped_tokens as f64 * 100.0 / QUOTA_TOKENS as f64,
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

/// The `sluice run` child process and the address of its HTTP listener.
struct Pipeline {
    child: tokio::process::Child,
    addr: String,
    log: PathBuf,
}

impl Pipeline {
    /// Starts `sluice run --config <config>` with its logs (stderr) going to
    /// `log`, and waits for the address it listens at.
    async fn start(config: &Path, log: &Path) -> anyhow::Result<Pipeline> {
        let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
        cmd.arg("run")
            .arg("--config")
            .arg(config)
            // Plain text in the log file.
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .kill_on_drop(true);
        // The demo's config is complete; `SLUICE_<SECTION>__<KEY>` variables
        // meant for other runs stay out (`SLUICE_LOG` is passed on).
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if k.starts_with(crate::config::ENV_PREFIX) && k.contains("__") {
                cmd.env_remove(&*k);
            }
        }
        let mut child = cmd.spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("demo: no stdout from sluice run"))?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let listening = tokio::time::timeout(Duration::from_secs(120), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(addr) = line.strip_prefix("LISTENING ") {
                    return Some(addr.trim().to_string());
                }
            }
            None
        })
        .await;
        let mut pipeline = Pipeline {
            child,
            addr: String::new(),
            log: log.to_path_buf(),
        };
        match listening {
            Ok(Some(addr)) => pipeline.addr = addr,
            Ok(None) => {
                let status = pipeline.child.wait().await?;
                return Err(pipeline.failed(&format!("sluice run exited ({status}) at start")));
            }
            Err(_) => {
                return Err(pipeline.failed("sluice run did not listen within 120 s"));
            }
        }
        // Whatever else it prints is not the demo's.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(pipeline)
    }

    /// Stops the pipeline as an operator would (SIGTERM), and checks it
    /// exited cleanly.
    async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            let sent = tokio::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await
                .is_ok_and(|s| s.success());
            if !sent {
                self.child.start_kill()?;
            }
        }
        match tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await {
            Ok(status) if status.as_ref().is_ok_and(|s| s.success()) => Ok(()),
            Ok(status) => {
                let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                Err(self.failed(&format!("sluice run exited ({status}) when stopped")))
            }
            Err(_) => {
                let _ = self.child.kill().await;
                Err(self.failed("sluice run did not stop within 60 s of SIGTERM"))
            }
        }
    }

    /// An error naming what failed, with the end of the pipeline's log.
    fn failed(&self, what: &str) -> anyhow::Error {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(20)..].join("\n");
        anyhow::anyhow!(
            "demo: {what}; the end of its log ({}):\n{tail}",
            self.log.display()
        )
    }
}

/// Figures the pipeline's `/metrics` shows.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Figures {
    /// Provider calls made (every answered or failed attempt).
    calls: f64,
    /// Input and output tokens of answered calls.
    tokens: f64,
    /// Their cost, micro-dollars.
    cost_micros: f64,
}

/// Sums the demo's figures from a Prometheus text exposition.
fn figures(text: &str) -> Figures {
    let mut f = Figures::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.trim().rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        match series.split('{').next().unwrap_or(series) {
            // An open breaker refuses a call without making it.
            "sluice_llm_requests_total" if !series.contains("status=\"circuit_open\"") => {
                f.calls += v
            }
            "sluice_tokens_total" if !series.contains("kind=\"cached\"") => f.tokens += v,
            "sluice_cost_micros_total" => f.cost_micros += v,
            _ => {}
        }
    }
    f
}

/// Shows progress until `stop` resolves: a line rewritten in place on a
/// terminal, a plain line every 2 s otherwise; then a last line.
async fn show_progress(
    metrics_url: String,
    done: Arc<AtomicUsize>,
    total: usize,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let tty = std::io::stdout().is_terminal();
    let every = Duration::from_millis(if tty { 250 } else { 2000 });
    let client = reqwest::Client::new();
    let started = Instant::now();
    let mut last = Figures::default();
    let mut width = 0;
    loop {
        let stopped = tokio::select! {
            _ = &mut stop => true,
            _ = tokio::time::sleep(every) => false,
        };
        let scraped = async {
            let r = client
                .get(&metrics_url)
                .timeout(Duration::from_secs(2))
                .send()
                .await?;
            r.error_for_status()?.text().await
        };
        if let Ok(text) = scraped.await {
            last = figures(&text);
        }
        let line = format!(
            "progress {:>4}s: {}/{total} tasks done, {} provider calls, {} tokens, {} µ$",
            started.elapsed().as_secs(),
            done.load(Ordering::Relaxed),
            last.calls as u64,
            last.tokens as u64,
            last.cost_micros as u64,
        );
        let mut out = std::io::stdout().lock();
        if tty {
            // Padded over what a longer previous line left.
            width = width.max(line.chars().count());
            let _ = write!(out, "\r{line:<width$}");
            if stopped {
                let _ = writeln!(out);
            }
        } else {
            let _ = writeln!(out, "{line}");
        }
        let _ = out.flush();
        if stopped {
            return;
        }
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
