//! `make bench-llm`, in one run against the simulated provider:
//!
//! - quota utilisation: the simulator enforces 50 requests/s (token bucket,
//!   burst 5) for 60 s, halved to 25 at 30 s; a backlog of callers goes through
//!   the client's adaptive limiter, once with the simulator sending
//!   `x-ratelimit-*`/`Retry-After` headers and once sending none. `util` is the
//!   lower of the two halves' steady-state rate over the limit.
//! - overhead: a zero-latency provider; tasks/s through the whole operator
//!   (Kafka in, HTTP call, Kafka out) against the rate a plain async HTTP
//!   client (reqwest) reaches on the same simulator at the same concurrency.
//!   Each round also times hyper's pooled client alone (the transport under
//!   Sluice's provider client; printed, not in `RESULT`) and prints the CPU
//!   time per task of the operator, the simulator (this process) and the
//!   broker, between the first and the last result.
//!
//! - queueing provider: the simulator in queueing mode (4 slots, 200 ms per
//!   call, no 429s), 1,000 tasks through `sluice run` with a 5 s call timeout
//!   and the default limiter: `util_queue` is the calls/s achieved over the
//!   slots' capacity (4 / 0.2 s), `timeouts_queue` the calls that hit the
//!   timeout (the simulator counts each request its client gave up).
//!
//! Diagnostics (environment): `SLUICE_BENCH_SKIP_QUOTA` (overhead rounds only),
//! `SLUICE_BENCH_SKIP_QUEUE` (no queueing round),
//! `SLUICE_BENCH_TASKS` (tasks per round), `SLUICE_BENCH_LOG` (the operator's
//! log filter), `SLUICE_BENCH_HIST` (results per 50 ms), `SLUICE_BENCH_PERF`
//! (`perf record` of the operator into that file; `SLUICE_BENCH_PERF_FLAT`
//! without call graphs), `SLUICE_BENCH_APP` / `SLUICE_BENCH_KAFKA` (extra
//! `[app]` / `[kafka]` lines of the operator's config), `SLUICE_BENCH_COMPARE`
//! (another `sluice` binary run side by side each round) and
//! `SLUICE_BENCH_CLIENT` (the LLM client alone, without Kafka, each round).

/// The same allocator as the `sluice` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[allow(dead_code)]
mod common;
#[path = "common/config.rs"]
mod config;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{broker_pid, cpu_secs, own_cpu_secs};
use config::BenchPipeline;
use rdkafka::Message as _;
use sluice::envelope::{Priority, TaskResult};
use sluice::kafka::{produce, read_topics, OutRecord};
use sluice::llm::{
    ChatRequest, LimiterConfig, LlmClient, LlmConfig, Message, ModelConfig, ProviderConfig,
};
use sluice::sim::{SimConfig, SimHandle};

const HALF: Duration = Duration::from_secs(30);
/// Seconds after the start and after the change not counted as steady state.
const SETTLE: u64 = 10;

struct QuotaRun {
    util: f64,
    rate_429: f64,
    reconverge_s: f64,
}

fn request(i: u64) -> ChatRequest {
    ChatRequest {
        model: String::new(),
        messages: vec![
            Message::system("Task: classify\nLabels: a, b, c"),
            Message::user(format!("item {i}: the quick brown fox")),
        ],
        max_tokens: Some(8),
        max_completion_tokens: None,
        temperature: None,
        response_format: None,
    }
}

/// `request(i)` for model `m`, as a plain client sends it.
fn plain_request(i: u64) -> ChatRequest {
    ChatRequest {
        model: "m".into(),
        ..request(i)
    }
}

/// An LLM client with one model, `m`, on the simulator.
fn sim_client(sim: &SimHandle, limiter: LimiterConfig) -> LlmClient {
    let mut model = ModelConfig::new("m", "sim");
    model.limiter = limiter;
    let cfg = LlmConfig {
        providers: vec![ProviderConfig::new("sim", sim.base_url())],
        models: vec![model],
        ..LlmConfig::default()
    };
    LlmClient::from_config(&cfg, &prometheus::Registry::new()).unwrap()
}

async fn quota_run(headers: bool) -> QuotaRun {
    let sim = sluice::sim::start(
        SimConfig::from_json_value(serde_json::json!({
            "rps": 50.0, "burst": 5, "rate_limit_headers": headers,
        }))
        .unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let client = sim_client(
        &sim,
        LimiterConfig {
            initial_rps: 20.0,
            ..LimiterConfig::default()
        },
    );
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let total = 2 * HALF.as_secs() as usize;
    let per_second: Arc<Vec<AtomicU64>> =
        Arc::new((0..total + 2).map(|_| AtomicU64::new(0)).collect());
    let mut workers = Vec::new();
    for w in 0..300u64 {
        let (client, stop, per_second) = (client.clone(), stop.clone(), per_second.clone());
        workers.push(tokio::spawn(async move {
            let mut i = w;
            while !stop.load(Ordering::Relaxed) {
                if client.call("m", request(i), Priority::Normal).await.is_ok() {
                    let s = start.elapsed().as_secs() as usize;
                    if let Some(c) = per_second.get(s) {
                        c.fetch_add(1, Ordering::Relaxed);
                    }
                }
                i += 300;
            }
        }));
    }
    tokio::time::sleep(HALF).await;
    sim.update(|c| c.rps = Some(25.0)).unwrap();
    tokio::time::sleep(HALF).await;
    stop.store(true, Ordering::Relaxed);
    let stats = sim.stats();
    for w in workers {
        w.abort();
    }
    let rates: Vec<f64> = per_second
        .iter()
        .map(|c| c.load(Ordering::Relaxed) as f64)
        .collect();
    let half = HALF.as_secs() as usize;
    let avg = |from: usize, to: usize| rates[from..to].iter().sum::<f64>() / (to - from) as f64;
    let first = avg(SETTLE as usize, half) / 50.0;
    let second = avg(half + SETTLE as usize, total) / 25.0;
    // Re-converged: first second after the change from which every 1 s window
    // stays within 10 % of the new limit (rolling 2 s average).
    let mut reconverge = SETTLE as f64;
    for s in half..total - 1 {
        let ok = (s..total - 1).all(|t| {
            let r = (rates[t] + rates[t + 1]) / 2.0;
            (r - 25.0).abs() <= 2.5
        });
        if ok {
            reconverge = (s - half) as f64;
            break;
        }
    }
    let calls = stats.requests_total.max(1) as f64;
    let rate_429 = stats.status(429) as f64 / calls;
    eprintln!(
        "quota headers={headers}: first half {:.3}, second half {:.3}, 429s {} of {} ({:.2}%), re-converged after {reconverge}s",
        first,
        second,
        stats.status(429),
        stats.requests_total,
        rate_429 * 100.0
    );
    QuotaRun {
        util: first.min(second),
        rate_429,
        reconverge_s: reconverge,
    }
}

/// Samples the CPU time of some processes every 10 ms, with the wall clock
/// (Unix ms), so the CPU spent between two result timestamps can be read.
struct CpuTrace {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(i64, Vec<f64>)>>,
}

impl CpuTrace {
    fn start(pids: Vec<u32>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let cpu = pids
                    .iter()
                    .map(|p| cpu_secs(*p).unwrap_or(f64::NAN))
                    .collect();
                samples.push((chrono::Utc::now().timestamp_millis(), cpu));
                std::thread::sleep(Duration::from_millis(10));
            }
            samples
        });
        CpuTrace { stop, thread }
    }

    /// CPU seconds per process between the Unix-ms instants `lo` and `hi`.
    fn between(self, lo: i64, hi: i64) -> Vec<f64> {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self.thread.join().unwrap();
        let at = |t: i64, before: bool| {
            let found = if before {
                samples.iter().rev().find(|s| s.0 <= t)
            } else {
                samples.iter().find(|s| s.0 >= t)
            };
            found
                .or(samples.last())
                .map(|s| s.1.clone())
                .unwrap_or_default()
        };
        let (a, b) = (at(lo, true), at(hi, false));
        a.iter().zip(&b).map(|(a, b)| b - a).collect()
    }
}

/// Tasks/s through `sluice run` (zero-latency provider).
fn operator_rate(bin: &str, bootstrap: &str, sim: &SimHandle, n: usize, concurrency: usize) -> f64 {
    let prefix = format!(
        "bench-llm-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let dir = tempfile::tempdir().unwrap();
    // SLUICE_BENCH_APP=<toml lines>: extra `[app]` settings to compare.
    let app = std::env::var("SLUICE_BENCH_APP").unwrap_or_default();
    let kafka = format!(
        "session_timeout_ms = 6000\n{}",
        std::env::var("SLUICE_BENCH_KAFKA").unwrap_or_default()
    );
    let config = BenchPipeline {
        prefix: &prefix,
        bootstrap,
        sim_url: &sim.base_url(),
        partitions: 2,
        app: &app,
        kafka: &kafka,
    }
    .write(
        dir.path(),
        &format!(
            r#"
[[llm.models]]
name = "m"
provider = "sim"
limiter = {{ initial_rps = 1000000, max_rps = 1000000, max_concurrency = {concurrency} }}

[prices.m]
input = 150000
output = 600000

# The overhead is measured per provider call: one call per task.
[batching]
enabled = false

[http]
listen = "127.0.0.1:0"
"#,
        ),
    );
    let topic = create_and_fill(bin, bootstrap, &config, &prefix, "t", n);
    // SLUICE_BENCH_PERF=<file> profiles the operator with `perf record`.
    let mut cmd = match std::env::var("SLUICE_BENCH_PERF") {
        Ok(out) => {
            let mut c = std::process::Command::new("perf");
            c.args(["record", "-e", "cpu-clock", "-F", "999"]);
            // SLUICE_BENCH_PERF_FLAT=1: no call graphs (cheaper, self time only).
            if std::env::var("SLUICE_BENCH_PERF_FLAT").is_err() {
                c.args(["--call-graph", "dwarf,16384"]);
            }
            c.args(["-o", &out, bin]);
            c
        }
        Err(_) => std::process::Command::new(bin),
    };
    let mut child = cmd
        .args(["run", "--config", &config.display().to_string()])
        // SLUICE_BENCH_LOG=<filter> shows the operator's own log (stderr).
        .env(
            "SLUICE_LOG",
            std::env::var("SLUICE_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let cpu = CpuTrace::start(vec![
        child.id(),
        std::process::id(),
        broker_pid().unwrap_or(0),
    ]);
    // Wait for the operator's committed offsets to reach the end of the input
    // (a cheap request every 100 ms), then read the results: a reader running
    // alongside would take CPU from the operator.
    wait_committed(bootstrap, &format!("{prefix}-app"), &topic, 2, n);
    let completed = format!("{prefix}.results.completed");
    let msgs = read_topics(
        bootstrap,
        &[&completed],
        true,
        Duration::from_secs(600),
        |m| m.len() >= n,
    )
    .unwrap();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    let times: Vec<i64> = msgs
        .iter()
        .filter_map(|m| serde_json::from_slice::<TaskResult>(m.payload()?).ok())
        .map(|r| r.completed_at.timestamp_millis())
        .collect();
    let (lo, hi) = (times.iter().min().unwrap(), times.iter().max().unwrap());
    // SLUICE_BENCH_HIST=1 prints the results completed per 50 ms.
    if std::env::var("SLUICE_BENCH_HIST").is_ok() {
        let mut buckets = vec![0usize; ((hi - lo) / 50 + 1) as usize];
        for t in &times {
            buckets[((t - lo) / 50) as usize] += 1;
        }
        eprintln!("results per 50 ms: {buckets:?}");
    }
    let secs = ((hi - lo) as f64 / 1000.0).max(0.001);
    let per_task = |s: f64| s * 1e6 / times.len() as f64;
    let cpu = cpu.between(*lo, *hi);
    eprintln!(
        "operator: {} results over {secs:.2}s; CPU per task: operator {:.0} µs, simulator {:.0} µs, broker {:.0} µs",
        times.len(),
        per_task(cpu[0]),
        per_task(cpu[1]),
        per_task(cpu[2]),
    );
    times.len() as f64 / secs
}

/// Waits until `group` has committed `n` records of `topic` in total.
/// Creates the topics of `config` with `sluice topics create` and publishes `n` small
/// classify tasks (ids `<id_prefix><i>`, eight tenants) to its task topic, which it returns.
fn create_and_fill(
    bin: &str,
    bootstrap: &str,
    config: &std::path::Path,
    prefix: &str,
    id_prefix: &str,
    n: usize,
) -> String {
    config::create_topics(bin, config);
    let topic = format!("{prefix}.tasks.classify");
    let tasks = (0..n).map(|i| OutRecord {
        key: Some(format!("tenant-{}", i % 8).into_bytes()),
        value: Some(
            serde_json::to_vec(&serde_json::json!({
                "taskId": format!("{id_prefix}{i}"), "taskType": "classify", "tenantId": format!("tenant-{}", i % 8),
                "submittedAt": chrono::Utc::now().to_rfc3339(),
                "payload": { "content": format!("item {i}: the quick brown fox"), "labels": ["a", "b", "c"] },
            }))
            .unwrap(),
        ),
        ..Default::default()
    });
    produce(bootstrap, &topic, tasks).unwrap();
    topic
}

fn wait_committed(bootstrap: &str, group: &str, topic: &str, partitions: i32, n: usize) {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .create()
        .unwrap();
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let done: i64 = consumer
            .committed_offsets(tpl.clone(), Duration::from_secs(5))
            .map(|c| {
                c.elements()
                    .iter()
                    .filter_map(|e| e.offset().to_raw())
                    .filter(|o| *o > 0)
                    .sum()
            })
            .unwrap_or(0);
        if done >= n as i64 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "operator stalled at {done} of {n}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Slots and latency of the queueing round.
const QUEUE_SLOTS: u32 = 4;
const QUEUE_LATENCY_MS: u64 = 200;
const QUEUE_TASKS: usize = 1_000;

/// The queueing round: `(util_queue, timeouts_queue)`.
fn queue_round(bin: &str, bootstrap: &str, rt: &tokio::runtime::Runtime) -> (f64, u64) {
    let sim = rt
        .block_on(sluice::sim::start(
            SimConfig {
                slots: Some(QUEUE_SLOTS),
                latency: sluice::sim::Latency::Fixed {
                    ms: QUEUE_LATENCY_MS,
                },
                ..SimConfig::default()
            },
            "127.0.0.1:0".parse().unwrap(),
        ))
        .unwrap();
    let prefix = format!(
        "bench-queue-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let dir = tempfile::tempdir().unwrap();
    let config = BenchPipeline {
        prefix: &prefix,
        bootstrap,
        sim_url: &sim.base_url(),
        partitions: 2,
        app: "",
        kafka: "session_timeout_ms = 6000",
    }
    .write(
        dir.path(),
        r#"
# The default limiter: its adaptive concurrency limit is what is measured.
[[llm.models]]
name = "m"
provider = "sim"
timeout_ms = 5000

[prices.m]
input = 150000
output = 600000

[batching]
enabled = false

[http]
listen = "127.0.0.1:0"
"#,
    );
    let topic = create_and_fill(bin, bootstrap, &config, &prefix, "q", QUEUE_TASKS);
    let mut child = std::process::Command::new(bin)
        .args(["run", "--config", &config.display().to_string()])
        .env(
            "SLUICE_LOG",
            std::env::var("SLUICE_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_committed(bootstrap, &format!("{prefix}-app"), &topic, 2, QUEUE_TASKS);
    let completed = format!("{prefix}.results.completed");
    let msgs = read_topics(
        bootstrap,
        &[&completed],
        true,
        Duration::from_secs(600),
        |m| m.len() >= QUEUE_TASKS,
    )
    .unwrap();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    let stats = sim.stats();
    let times: Vec<i64> = msgs
        .iter()
        .filter_map(|m| serde_json::from_slice::<TaskResult>(m.payload()?).ok())
        .map(|r| r.completed_at.timestamp_millis())
        .collect();
    let (lo, hi) = (times.iter().min().unwrap(), times.iter().max().unwrap());
    // The first answer comes one latency after the first call.
    let secs = (hi - lo) as f64 / 1000.0 + QUEUE_LATENCY_MS as f64 / 1000.0;
    let capacity = f64::from(QUEUE_SLOTS) * 1000.0 / QUEUE_LATENCY_MS as f64;
    let util = stats.served_ok as f64 / secs / capacity;
    eprintln!(
        "queue: {} results, {} calls answered in {secs:.1}s ({:.1} calls/s of {capacity:.0}), {} queued at the simulator, {} given up (timeouts)",
        times.len(),
        stats.served_ok,
        stats.served_ok as f64 / secs,
        stats.queued,
        stats.abandoned,
    );
    rt.block_on(sim.shutdown());
    (util, stats.abandoned)
}

const ROUNDS: usize = 3;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Requests/s of `concurrency` workers making `n` calls of `call` (the call's
/// number) between them; prints them with this process's CPU per request
/// (the caller's and the simulator's).
async fn closed_loop<F, Fut>(label: &str, n: usize, concurrency: usize, call: F) -> f64
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicU64::new(0));
    let cpu0 = own_cpu_secs();
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (call, next) = (call.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n as u64 {
                    break;
                }
                call(i).await;
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = own_cpu_secs() - cpu0;
    eprintln!(
        "{label}: {n} requests in {secs:.2}s; CPU per request (client and simulator): {:.0} µs",
        cpu * 1e6 / n as f64
    );
    n as f64 / secs
}

/// Requests/s of a plain reqwest client at `concurrency` against the simulator.
async fn plain_rate(sim: &SimHandle, n: usize, concurrency: usize) -> f64 {
    let target = Arc::new((
        reqwest::Client::new(),
        format!("{}/chat/completions", sim.base_url()),
    ));
    closed_loop("plain client", n, concurrency, move |i| {
        let target = target.clone();
        async move {
            let (client, url) = &*target;
            let r = client
                .post(url)
                .json(&plain_request(i))
                .send()
                .await
                .unwrap();
            let _ = r.bytes().await.unwrap();
        }
    })
    .await
}

/// Requests/s of hyper's pooled client (the transport under Sluice's provider
/// client, with the request prepared the same way) at `concurrency` against
/// the simulator: the leanest plain client, printed beside the reqwest one.
async fn plain_hyper_rate(sim: &SimHandle, n: usize, concurrency: usize) -> f64 {
    use http_body_util::BodyExt as _;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let uri: http::Uri = format!("{}/chat/completions", sim.base_url())
        .parse()
        .unwrap();
    let target = Arc::new((client, uri));
    closed_loop("plain hyper client", n, concurrency, move |i| {
        let target = target.clone();
        async move {
            let (client, uri) = &*target;
            let req = http::Request::post(uri.clone())
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(serde_json::to_vec(&plain_request(i)).unwrap().into())
                .unwrap();
            let r = client.request(req).await.unwrap();
            let _ = r.into_body().collect().await.unwrap().to_bytes();
        }
    })
    .await
}

/// Requests/s of the LLM client (its whole middleware, no Kafka) at
/// `concurrency` against the simulator (`SLUICE_BENCH_CLIENT=1`; diagnostic).
async fn client_rate(sim: &SimHandle, n: usize, concurrency: usize) -> f64 {
    let client = Arc::new(sim_client(
        sim,
        LimiterConfig {
            initial_rps: 1e6,
            max_rps: 1e6,
            max_concurrency: Some(concurrency),
            ..LimiterConfig::default()
        },
    ));
    closed_loop("llm client", n, concurrency, move |i| {
        let client = client.clone();
        async move {
            client
                .call("m", request(i), Priority::Normal)
                .await
                .unwrap();
        }
    })
    .await
}

fn main() {
    let bootstrap = std::env::var("SLUICE_BENCH_BOOTSTRAP").expect("run through `make bench-llm`");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let quota = std::env::var("SLUICE_BENCH_SKIP_QUOTA").is_err();
    let skipped = || QuotaRun {
        util: f64::NAN,
        rate_429: f64::NAN,
        reconverge_s: f64::NAN,
    };
    let hdr = if quota {
        rt.block_on(quota_run(true))
    } else {
        skipped()
    };
    let nohdr = if quota {
        rt.block_on(quota_run(false))
    } else {
        skipped()
    };
    let (util_queue, timeouts_queue) = if std::env::var("SLUICE_BENCH_SKIP_QUEUE").is_err() {
        queue_round(env!("CARGO_BIN_EXE_sluice"), &bootstrap, &rt)
    } else {
        (f64::NAN, 0)
    };
    let sim = rt
        .block_on(sluice::sim::start(
            SimConfig::default(),
            "127.0.0.1:0".parse().unwrap(),
        ))
        .unwrap();
    let n: usize = std::env::var("SLUICE_BENCH_TASKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let concurrency = 64;
    // Three interleaved rounds; the medians are compared (the machine is noisy).
    let (mut plain, mut hyper, mut op) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        plain.push(rt.block_on(plain_rate(&sim, n, concurrency)));
        hyper.push(rt.block_on(plain_hyper_rate(&sim, n, concurrency)));
        if std::env::var("SLUICE_BENCH_CLIENT").is_ok() {
            rt.block_on(client_rate(&sim, n, concurrency));
        }
        op.push(operator_rate(
            env!("CARGO_BIN_EXE_sluice"),
            &bootstrap,
            &sim,
            n,
            concurrency,
        ));
        // SLUICE_BENCH_COMPARE=<sluice binary>: also runs that build each round
        // (side by side with this one; its figures are printed, not compared).
        if let Ok(other) = std::env::var("SLUICE_BENCH_COMPARE") {
            eprint!("compare ");
            operator_rate(&other, &bootstrap, &sim, n, concurrency);
        }
    }
    let (plain, hyper, op) = (median(plain), median(hyper), median(op));
    eprintln!(
        "overhead: medians plain {plain:.0} requests/s, plain hyper {hyper:.0} requests/s, operator {op:.0} tasks/s ({:.2} of plain hyper)",
        op / hyper
    );
    println!(
        "RESULT util_hdr={:.3} rate_429_hdr={:.4} util_nohdr={:.3} rate_429_nohdr={:.4} reconverge_s={:.0} overhead_ratio={:.2} util_queue={:.3} timeouts_queue={}",
        hdr.util,
        hdr.rate_429,
        nohdr.util,
        nohdr.rate_429,
        hdr.reconverge_s.max(nohdr.reconverge_s),
        op / plain,
        util_queue,
        timeouts_queue
    );
}
