//! `make bench-batching`, in one run against the simulated provider: a
//! classify workload at 1,000 tasks/s (16 services of one company) through
//! the whole `sluice run` pipeline (Kafka in, route, micro-batch, provider
//! call, Kafka out), once with micro-batching off and once on, each on fresh
//! topics; then the seeds' load, 25 tasks/s from 5 services, unbatched,
//! batched across the services (`across_tenants = true`) and batched per
//! tenant.
//!
//! - provider calls per task: the simulator's request count over the tasks;
//! - time to result: each task's `completedAt` minus the time the bench
//!   handed it to the producer (carried in its metadata), over every task
//!   after the first second; `added_*` is batched minus unbatched at the
//!   same percentile.
//!
//! Environment: `SLUICE_BENCH_RATE` (tasks/s, default 1000),
//! `SLUICE_BENCH_SECS` (seconds of load per run, default 15),
//! `SLUICE_BENCH_SLOW_SECS` (seconds of each 25 tasks/s run, default 30).

/// The same allocator as the `sluice` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "common/config.rs"]
mod config;
#[path = "common/process.rs"]
mod process;

use std::time::{Duration, Instant};

use config::BenchPipeline;
use rdkafka::Message as _;
use sluice::envelope::TaskResult;
use sluice::kafka::{produce, read_topics, OutRecord};
use sluice::sim::{SimConfig, SimHandle};

struct Run {
    calls_per_task: f64,
    /// Time to result of each task after the warm-up, ms, sorted.
    latencies: Vec<i64>,
}

fn percentile(sorted: &[i64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64
}

/// Who sends the tasks: `tenants` tenants (one company's services when they
/// may share batches, `across`).
#[derive(Clone, Copy)]
struct Senders {
    tenants: usize,
    across: bool,
}

fn run(
    bootstrap: &str,
    sim: &SimHandle,
    batched: bool,
    rate: u64,
    secs: u64,
    senders: Senders,
) -> Run {
    let bin = env!("CARGO_BIN_EXE_sluice");
    let prefix = format!(
        "bench-batch-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let dir = tempfile::tempdir().unwrap();
    let config = BenchPipeline {
        prefix: &prefix,
        bootstrap,
        sim_url: &sim.base_url(),
        partitions: 2,
        app: "",
        kafka: "",
    }
    .write(
        dir.path(),
        &format!(
            r#"
[[llm.models]]
name = "m"
provider = "sim"
limiter = {{ initial_rps = 1000000, max_rps = 1000000, max_concurrency = 512 }}

[prices.m]
input = 150000
output = 600000

[batching]
enabled = {batched}
across_tenants = {across}

[http]
listen = "127.0.0.1:0"
"#,
            across = senders.across,
        ),
    );
    config::create_topics(bin, &config);
    let cfg = config.display().to_string();
    let mut command = std::process::Command::new(bin);
    command.args(["run", "--config", &cfg]);
    let (mut child, addr) = process::spawn_listening(command);
    wait_ready(&addr);
    sim.reset_stats();
    let n = (rate * secs) as usize;
    let start = Instant::now();
    let topic = format!("{prefix}.tasks.classify");
    // Paced: task i is handed to the producer at i / rate seconds.
    let tasks = (0..n).map(|i| {
        let due = start + Duration::from_micros(i as u64 * 1_000_000 / rate);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let tenant = format!("service-{}", i % senders.tenants);
        OutRecord {
            key: Some(tenant.clone().into_bytes()),
            value: Some(
                serde_json::to_vec(&serde_json::json!({
                    "taskId": format!("t{i}"), "taskType": "classify", "tenantId": tenant,
                    "submittedAt": chrono::Utc::now().timestamp_millis(),
                    "metadata": { "sentAt": chrono::Utc::now().timestamp_millis().to_string() },
                    "payload": {
                        "content": format!("Item {i}: shares rose after the quarterly report."),
                        "labels": ["news", "sports", "tech"],
                    },
                }))
                .unwrap(),
            ),
            ..Default::default()
        }
    });
    produce(bootstrap, &topic, tasks).unwrap();
    let completed = format!("{prefix}.results.completed");
    let msgs = read_topics(
        bootstrap,
        &[&completed],
        true,
        Duration::from_secs(300),
        |m| m.len() >= n,
    )
    .unwrap();
    let calls = sim.stats().requests_total;
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    let results: Vec<TaskResult> = msgs
        .iter()
        .filter_map(|m| serde_json::from_slice(m.payload()?).ok())
        .collect();
    assert_eq!(results.len(), n, "every task has one result");
    let warm_up = rate as usize;
    let mut latencies: Vec<i64> = results
        .iter()
        .filter(|r| r.task_id[1..].parse::<usize>().unwrap() >= warm_up)
        .map(|r| {
            let sent: i64 = r.metadata["sentAt"].parse().unwrap();
            r.completed_at.timestamp_millis() - sent
        })
        .collect();
    latencies.sort_unstable();
    Run {
        calls_per_task: calls as f64 / n as f64,
        latencies,
    }
}

fn wait_ready(addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while Instant::now() < deadline {
        if let Ok(mut s) = std::net::TcpStream::connect(addr) {
            use std::io::{Read, Write};
            let _ = write!(s, "GET /readyz HTTP/1.0\r\nHost: x\r\n\r\n");
            let mut buf = String::new();
            let _ = s.read_to_string(&mut buf);
            if buf.starts_with("HTTP/1.1 200") || buf.starts_with("HTTP/1.0 200") {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("sluice run never became ready");
}

fn main() {
    let bootstrap =
        std::env::var("SLUICE_BENCH_BOOTSTRAP").expect("run through `make bench-batching`");
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (rate, secs) = (env("SLUICE_BENCH_RATE", 1000), env("SLUICE_BENCH_SECS", 15));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sim_config = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 20, "max_ms": 60 },
    }))
    .unwrap();
    let sim = rt
        .block_on(sluice::sim::start(
            sim_config,
            "127.0.0.1:0".parse().unwrap(),
        ))
        .unwrap();
    // The high-rate round: 16 services of one company, which may share
    // prompts.
    let company = |tenants| Senders {
        tenants,
        across: true,
    };
    let off = run(&bootstrap, &sim, false, rate, secs, company(16));
    let on = run(&bootstrap, &sim, true, rate, secs, company(16));
    // The seeds' load: 25 tasks/s (2 M requests a day) from 5 services of one
    // company, batched across them as a single-company deployment runs it,
    // and with per-tenant batching beside it.
    let (slow, slow_secs) = (25, env("SLUICE_BENCH_SLOW_SECS", 30));
    let off_25 = run(&bootstrap, &sim, false, slow, slow_secs, company(5));
    let on_25 = run(&bootstrap, &sim, true, slow, slow_secs, company(5));
    let per_tenant_25 = run(
        &bootstrap,
        &sim,
        true,
        slow,
        slow_secs,
        Senders {
            tenants: 5,
            across: false,
        },
    );
    let show = |name: &str, r: &Run| {
        eprintln!(
            "{name}: {:.3} calls per task; time to result p50 {:.0} ms, p99 {:.0} ms ({} tasks after warm-up)",
            r.calls_per_task,
            percentile(&r.latencies, 0.5),
            percentile(&r.latencies, 0.99),
            r.latencies.len()
        );
    };
    show("unbatched", &off);
    show("batched", &on);
    show("25/s unbatched", &off_25);
    show("25/s batched across 5 services", &on_25);
    show("25/s batched per tenant", &per_tenant_25);
    let added =
        |on: &Run, off: &Run, p| percentile(&on.latencies, p) - percentile(&off.latencies, p);
    println!(
        "RESULT calls_per_task_batched={:.3} calls_per_task_unbatched={:.3} added_p50_ms={:.0} added_p99_ms={:.0} calls_per_task_25={:.3} added_p99_ms_25={:.0} calls_per_task_25_per_tenant={:.3} added_p99_ms_25_per_tenant={:.0}",
        on.calls_per_task,
        off.calls_per_task,
        added(&on, &off, 0.5),
        added(&on, &off, 0.99),
        on_25.calls_per_task,
        added(&on_25, &off_25, 0.99),
        per_tenant_25.calls_per_task,
        added(&per_tenant_25, &off_25, 0.99),
    );
}
