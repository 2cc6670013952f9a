//! `make bench-gateway`, in one run on one broker:
//!
//! - accepted POSTs per second through `sluice gateway` at a fixed
//!   concurrency (64 connections of Debian's `wrk`, on loopback), against a
//!   plain idempotent produce loop of the same task records with the same
//!   number of records in flight, each waiting for its acknowledgement, in
//!   rounds that alternate (`accept_ratio` = gateway / produce loop); the
//!   time to each 202 (p50, p99);
//! - the time from a 202 to its result's server-sent event, with `sluice run`
//!   answering through the simulated provider at zero latency (its 100 ms
//!   batching window included), for tasks submitted at a steady rate with
//!   their event streams opened right after each 202;
//! - CPU time per accepted POST (the gateway, the broker, `wrk`) and per
//!   acknowledged record (the produce loop's process, the broker), the
//!   mean of the measured rounds': the accept rounds saturate the two cores, so
//!   their rate follows these (the broker's only with
//!   `SLUICE_BENCH_BROKER_PID`, which `make bench-gateway` sets).
//!
//! Environment: `SLUICE_BENCH_SECS` (seconds of each accept round, default
//! 8), `SLUICE_BENCH_ROUNDS` (rounds of each, default 2),
//! `SLUICE_BENCH_WARMUP_SECS` (one round of each first, not measured,
//! default 5),
//! `SLUICE_BENCH_EVENT_TASKS` (tasks of the latency run, default 500).

/// The same allocator as the `sluice` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[allow(dead_code)]
mod common;
#[path = "common/config.rs"]
mod config;
#[path = "common/process.rs"]
mod process;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{broker_pid, cpu_secs, own_cpu_secs, stat_secs};
use config::BenchPipeline;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use sluice::sim::SimConfig;

/// Connections (and records in flight) of the accept rounds.
const CONCURRENCY: usize = 64;
/// Partitions of the topics.
const PARTITIONS: i32 = 4;
/// Tenants the tasks are spread over.
const TENANTS: usize = 10;

fn token(t: usize) -> String {
    format!("bench-tenant-{t}-token-0123456789")
}

fn task(i: u64) -> serde_json::Value {
    serde_json::json!({
        "taskType": "classify",
        "payload": {
            "content": format!("Item {i}: shares rose after the quarterly report."),
            "labels": ["news", "sports", "tech"],
        },
    })
}

/// The record the gateway publishes for a task, as the produce loop sends it.
fn record(i: u64) -> (String, Vec<u8>) {
    let tenant = format!("tenant-{}", i as usize % TENANTS);
    let mut v = task(i);
    v["taskId"] = format!("p{i}").into();
    v["tenantId"] = tenant.clone().into();
    v["submittedAt"] = chrono::Utc::now().to_rfc3339().into();
    v["attemptNumber"] = 1.into();
    (tenant, serde_json::to_vec(&v).unwrap())
}

struct Proc(std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

/// Starts `sluice <cmd> --config <cfg>` and returns it with its address.
fn start(cmd: &str, cfg: &str) -> (Proc, String) {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    command.args([cmd, "--config", cfg]);
    let (child, addr) = process::spawn_listening(command);
    (Proc(child), addr)
}

async fn wait_ready(client: &reqwest::Client, addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        if let Ok(r) = client.get(format!("http://{addr}/readyz")).send().await {
            if r.status() == 200 {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{addr} never became ready");
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// CPU time (seconds) of this process's children that ended and were
/// waited for (`wrk`'s runs), NaN where `/proc` cannot tell.
fn children_cpu_secs() -> f64 {
    stat_secs("/proc/self/stat", 13).unwrap_or(f64::NAN)
}

/// CPU time (seconds) so far of the gateway, the broker (0 unless `make
/// bench-gateway` passes its pid), this process (the produce loop) and its
/// ended children (the load generator).
fn cpu_of(gateway: u32) -> [f64; 4] {
    [
        cpu_secs(gateway).unwrap_or(f64::NAN),
        broker_pid().and_then(cpu_secs).unwrap_or(0.0),
        own_cpu_secs(),
        children_cpu_secs(),
    ]
}

/// Adds one of `rounds` rounds to `mean`: the CPU-µs per record of each of
/// [`cpu_of`]'s processes between two samples.
fn add_round(mean: &mut [f64; 4], before: [f64; 4], after: [f64; 4], records: f64, rounds: u64) {
    for (m, (b, a)) in mean.iter_mut().zip(before.into_iter().zip(after)) {
        *m += (a - b) * 1e6 / records / rounds as f64;
    }
}

/// The load generator's script: each request a classify task (its content
/// numbered per wrk thread), the tenants' tokens in turn; at the end one
/// line with the counts and the latency percentiles (µs).
fn wrk_script() -> String {
    let tokens: Vec<String> = (0..TENANTS).map(|t| format!("\"{}\"", token(t))).collect();
    format!(
        r#"local tokens = {{ {tokens} }}
local threads = 0
function setup(thread)
  thread:set("base", threads * 1000000000)
  threads = threads + 1
end
local i = 0
function request()
  i = i + 1
  local body = string.format(
    '{{"taskType":"classify","payload":{{"content":"Item %d: shares rose after the quarterly report.","labels":["news","sports","tech"]}}}}',
    base + i)
  return wrk.format("POST", "/v1/tasks", {{
    ["Authorization"] = "Bearer " .. tokens[i % #tokens + 1],
    ["Content-Type"] = "application/json",
  }}, body)
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK requests=%d duration_us=%d failed=%d p50_us=%d p99_us=%d\n",
    summary.requests, summary.duration,
    e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"#,
        tokens = tokens.join(", ")
    )
}

/// One accept round's figures.
struct Accepted {
    /// Accepted POSTs per second.
    rate: f64,
    /// POSTs answered.
    requests: f64,
    /// Time to the 202, ms.
    p50_ms: f64,
    p99_ms: f64,
}

/// The `/metrics` page of the application at `addr`.
async fn metrics(client: &reqwest::Client, addr: &str) -> reqwest::Result<String> {
    client
        .get(format!("http://{addr}/metrics"))
        .send()
        .await?
        .text()
        .await
}

/// The value of a metric without labels on a `/metrics` page.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The gateway's count of accepted tasks.
async fn accepted_total(client: &reqwest::Client, addr: &str) -> u64 {
    const NAME: &str = "sluice_gateway_tasks_accepted_total";
    let text = metrics(client, addr).await.expect("metrics");
    metric(&text, NAME).expect(NAME) as u64
}

/// POSTs for `secs` from `CONCURRENCY` connections of `wrk` (Debian's
/// HTTP load generator: a C event loop per thread, so the load costs the
/// two cores less than a client in this process would). Every answer must
/// be a 2xx, and the gateway must count as many tasks accepted.
async fn accept_round(client: &reqwest::Client, addr: &str, secs: u64, script: &Path) -> Accepted {
    let before = accepted_total(client, addr).await;
    let out = tokio::process::Command::new("wrk")
        .args([
            "-t2",
            &format!("-c{CONCURRENCY}"),
            &format!("-d{secs}s"),
            "-s",
        ])
        .arg(script)
        .arg(format!("http://{addr}/v1/tasks"))
        .output()
        .await
        .expect("wrk (Debian's `wrk`; scripts/bench.sh installs it)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "wrk: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("WRK "))
        .unwrap_or_else(|| panic!("no summary from wrk: {text}"));
    let field = |name: &str| -> f64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("wrk summary without {name}: {line}"))
    };
    assert_eq!(field("failed"), 0.0, "POSTs not accepted: {text}");
    let requests = field("requests");
    let accepted = (accepted_total(client, addr).await - before) as f64;
    // Requests still in flight when wrk stopped may be accepted after it
    // counted: at most one per connection.
    assert!(
        accepted >= requests && accepted <= requests + CONCURRENCY as f64,
        "wrk counted {requests} answers, the gateway {accepted} tasks accepted"
    );
    Accepted {
        rate: requests / (field("duration_us") / 1e6),
        requests,
        p50_ms: field("p50_us") / 1000.0,
        p99_ms: field("p99_us") / 1000.0,
    }
}

/// The produce loop: `CONCURRENCY` records in flight, each awaited, for
/// `secs`: acknowledged per second, and how many.
async fn produce_round(
    producer: &FutureProducer,
    topic: &str,
    secs: u64,
    next: &Arc<AtomicU64>,
) -> (f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..CONCURRENCY {
        let (producer, topic, stop, next) = (
            producer.clone(),
            topic.to_string(),
            stop.clone(),
            next.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let (key, value) = record(i);
                producer
                    .send(
                        FutureRecord::to(&topic).key(&key).payload(&value),
                        Duration::from_secs(10),
                    )
                    .await
                    .expect("acknowledged");
                n += 1;
            }
            n
        }));
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut n = 0;
    for w in workers {
        n += w.await.unwrap();
    }
    (n as f64 / start.elapsed().as_secs_f64(), n as f64)
}

/// Submits `n` tasks at `rate` per second, each followed by its event
/// stream: the time from each 202 to its event, ms.
/// One task's times, ms: from its 202 to its event, and of that, from
/// its acceptance to its result's `completedAt` (the pipeline, batching
/// window included) and from `completedAt` to the event (the pipeline's
/// commit, the gateway's read, the stream).
#[derive(Clone, Copy)]
struct EventTimes {
    total: f64,
    pipeline: f64,
    delivery: f64,
}

async fn accept_to_event(
    client: &reqwest::Client,
    addr: &str,
    n: u64,
    rate: u64,
) -> Vec<EventTimes> {
    let start = Instant::now();
    let mut jobs = Vec::new();
    for i in 0..n {
        let due = start + Duration::from_micros(i * 1_000_000 / rate);
        tokio::time::sleep_until(due.into()).await;
        let (client, addr) = (client.clone(), addr.to_string());
        jobs.push(tokio::spawn(async move {
            let t = token(i as usize % TENANTS);
            let r = client
                .post(format!("http://{addr}/v1/tasks"))
                .bearer_auth(&t)
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&task(1_000_000_000 + i)).unwrap())
                .send()
                .await
                .expect("POST");
            let accepted = Instant::now();
            assert_eq!(r.status(), 202);
            let v: serde_json::Value = r.json().await.unwrap();
            let mut stream = client
                .get(format!("http://{addr}{}", v["eventsUrl"].as_str().unwrap()))
                .bearer_auth(&t)
                .send()
                .await
                .expect("events");
            let mut text = String::new();
            while let Some(chunk) = stream.chunk().await.expect("event stream") {
                text.push_str(&String::from_utf8_lossy(&chunk));
                if let Some(data) = text
                    .split("\n\n")
                    .find(|e| e.contains("event: completed"))
                    .and_then(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
                {
                    let total = accepted.elapsed().as_secs_f64() * 1000.0;
                    let now = chrono::Utc::now();
                    let v: serde_json::Value = serde_json::from_str(data).unwrap();
                    let at = |s: &serde_json::Value| {
                        chrono::DateTime::parse_from_rfc3339(s.as_str().unwrap()).unwrap()
                    };
                    let completed = at(&v["result"]["completedAt"]);
                    let accepted_at = at(&v["acceptedAt"]);
                    let ms = |d: chrono::TimeDelta| d.num_microseconds().unwrap() as f64 / 1000.0;
                    return EventTimes {
                        total,
                        pipeline: ms(completed.to_utc() - accepted_at.to_utc()),
                        delivery: ms(now - completed.to_utc()),
                    };
                }
            }
            panic!("the stream closed without a completed event: {text}");
        }));
    }
    let mut out = Vec::new();
    for j in jobs {
        out.push(j.await.unwrap());
    }
    out
}

/// A number from the environment, or `default`.
fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let bootstrap =
        std::env::var("SLUICE_BENCH_BOOTSTRAP").expect("run through `make bench-gateway`");
    let secs = env("SLUICE_BENCH_SECS", 8);
    let rounds = env("SLUICE_BENCH_ROUNDS", 2);
    let event_tasks = env("SLUICE_BENCH_EVENT_TASKS", 500);
    let warmup = env("SLUICE_BENCH_WARMUP_SECS", 5);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sim = rt
        .block_on(sluice::sim::start(
            SimConfig::default(),
            "127.0.0.1:0".parse().unwrap(),
        ))
        .unwrap();
    let prefix = format!(
        "bench-gw-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    let lines: String = (0..TENANTS)
        .map(|t| format!("{} tenant:tenant-{t}\n", token(t)))
        .collect();
    std::fs::write(&tokens, lines).unwrap();
    let config = BenchPipeline {
        prefix: &prefix,
        bootstrap: &bootstrap,
        sim_url: &sim.base_url(),
        partitions: PARTITIONS,
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
enabled = true
window_ms = 100

[http]
listen = "127.0.0.1:0"
tokens_file = "{tokens}"

[gateway]
listen = "127.0.0.1:0"
max_backlog_per_tenant = 0
"#,
            tokens = tokens.display(),
        ),
    );
    config::create_topics(env!("CARGO_BIN_EXE_sluice"), &config);
    let cfg = config.display().to_string();
    // The produce loop's own topic (the pipeline does not take its records).
    let topic = format!("{prefix}.loop");
    sluice::kafka::create_topics(bootstrap.as_str(), &[(&topic, PARTITIONS, &[])]).unwrap();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(CONCURRENCY * 2)
        .build()
        .unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "1")
        .create()
        .unwrap();

    // Accept rounds: the gateway alone (no pipeline takes the tasks), beside
    // the produce loop, alternating.
    let (gateway, addr) = start("gateway", &cfg);
    let gateway_pid = gateway.0.id();
    rt.block_on(wait_ready(&client, &addr));
    let next = Arc::new(AtomicU64::new(0));
    let script = dir.path().join("post.lua");
    std::fs::write(&script, wrk_script()).unwrap();
    let (mut gw_rounds, mut loop_rates) = (Vec::new(), Vec::new());
    // CPU-µs per accepted POST (gateway, broker, load generator) and per
    // acknowledged record (broker, produce loop), the rounds' mean.
    let (mut gw_cpu, mut loop_cpu) = ([0.0; 4], [0.0; 4]);
    rt.block_on(async {
        // Warm-up: connections open, metadata known, the broker's first
        // seconds of each kind of traffic behind us.
        accept_round(&client, &addr, warmup, &script).await;
        produce_round(&producer, &topic, warmup, &next).await;
        for _ in 0..rounds {
            let before = cpu_of(gateway_pid);
            let (r, n) = produce_round(&producer, &topic, secs, &next).await;
            let after = cpu_of(gateway_pid);
            loop_rates.push(r);
            add_round(&mut loop_cpu, before, after, n, rounds);
            let a = accept_round(&client, &addr, secs, &script).await;
            add_round(&mut gw_cpu, after, cpu_of(gateway_pid), a.requests, rounds);
            gw_rounds.push(a);
        }
    });
    let gw_rates: Vec<f64> = gw_rounds.iter().map(|a| a.rate).collect();
    let gw: f64 = gw_rates.iter().sum::<f64>() / gw_rates.len() as f64;
    let plain: f64 = loop_rates.iter().sum::<f64>() / loop_rates.len() as f64;
    // The rounds' percentiles: the median of their p50s, the worst p99.
    let mut p50s: Vec<f64> = gw_rounds.iter().map(|a| a.p50_ms).collect();
    p50s.sort_by(f64::total_cmp);
    let (p50_accept, p99_accept) = (
        percentile(&p50s, 0.5),
        gw_rounds.iter().map(|a| a.p99_ms).fold(0.0, f64::max),
    );
    eprintln!(
        "accept: gateway {gw:.0}/s (rounds {gw_rates:.0?}) against the produce loop {plain:.0}/s ({loop_rates:.0?}), {CONCURRENCY} in flight; time to 202 p50 {p50_accept:.1} ms p99 {p99_accept:.1} ms (worst round)",
    );
    eprintln!(
        "CPU-µs per accepted POST: gateway {:.1}, broker {:.1}, load generator {:.1}; per looped record: produce loop {:.1}, broker {:.1}",
        gw_cpu[0], gw_cpu[1], gw_cpu[3], loop_cpu[2], loop_cpu[1],
    );

    // Accept to event: the pipeline answers (zero-latency provider), once
    // it worked off the accept rounds' tasks.
    let (_run, run_addr) = start("run", &cfg);
    rt.block_on(wait_ready(&client, &run_addr));
    // Until the pipeline has caught up: a task answered within a second.
    rt.block_on(async {
        loop {
            let t = accept_to_event(&client, &addr, 5, 50).await;
            if t.iter().all(|e| e.total < 1000.0) {
                break;
            }
        }
    });
    let times_of = rt.block_on(accept_to_event(&client, &addr, event_tasks, 50));
    let sorted = |f: fn(&EventTimes) -> f64| {
        let mut v: Vec<f64> = times_of.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let events = sorted(|e| e.total);
    let (pipeline, delivery) = (sorted(|e| e.pipeline), sorted(|e| e.delivery));
    eprintln!(
        "accept to event: p50 {:.0} ms p99 {:.0} ms over {} tasks at 50/s (zero-latency provider, 100 ms batching window); of it, accepted to completedAt p50 {:.0} p99 {:.0} ms, completedAt to event p50 {:.0} p99 {:.0} ms",
        percentile(&events, 0.5),
        percentile(&events, 0.99),
        events.len(),
        percentile(&pipeline, 0.5),
        percentile(&pipeline, 0.99),
        percentile(&delivery, 0.5),
        percentile(&delivery, 0.99),
    );
    // Where the time after completedAt goes under exactly-once: each
    // application's commits (a result is readable once its transaction is).
    for (who, a) in [("pipeline", &run_addr), ("gateway", &addr)] {
        let text = rt.block_on(metrics(&client, a)).unwrap_or_default();
        let value = |name: &str| metric(&text, name).unwrap_or(0.0);
        let (sum, count) = (
            value("sluice_commit_seconds_sum"),
            value("sluice_commit_seconds_count"),
        );
        eprintln!(
            "{who}: {count:.0} commits, {:.0} ms each on average",
            sum * 1000.0 / count.max(1.0)
        );
    }
    println!(
        "RESULT accept_ratio={:.2} p99_accept_ms={:.1} p99_accept_to_event_ms={:.0} gateway_rps={gw:.0} produce_rps={plain:.0} p50_accept_ms={:.1} p50_accept_to_event_ms={:.0} gateway_cpu_us={:.1} gateway_broker_cpu_us={:.1} loop_cpu_us={:.1} loop_broker_cpu_us={:.1}",
        gw / plain,
        p99_accept,
        percentile(&events, 0.99),
        p50_accept,
        percentile(&events, 0.5),
        gw_cpu[0],
        gw_cpu[1],
        loop_cpu[2],
        loop_cpu[1],
    );
}
