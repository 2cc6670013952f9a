//! `make bench-overload`: `sluice run`'s memory under overload, in one run on
//! one broker, the simulated provider in this process (its memory is not
//! counted), the instance's resident memory sampled from `/proc` every 50 ms
//! and its kernel-kept peak (`VmHWM`) read at the end of each part:
//!
//! - **calls in flight**: a provider taking 10 s per call, no rate limit, no
//!   batching, the adaptive concurrency limit off (nothing to learn: the
//!   provider does not queue); `SLUICE_BENCH_INFLIGHT_TASKS` tasks (default
//!   10,400) of 100 tenants published at once to 4 partitions of 4,000 in
//!   flight each; once with the provider spoken to over HTTP/2 (`http2 =
//!   true`: calls share connections of 100 each; `inflight_peak`,
//!   `inflight_rss_mib`), once over HTTP/1.1, the default (a connection per
//!   call; `*_http1`). The peak of calls in flight is counted by the
//!   provider, the instance's peak resident memory over the part is
//!   `inflight_rss_mib`;
//! - **a backlog**: `SLUICE_BENCH_BACKLOG_TASKS` tasks (default 1,000,000)
//!   published before the instance starts, a provider taking 2 s per call for
//!   `SLUICE_BENCH_SLOW_SECS` (default 60), then answering at once: the
//!   instance's peak resident memory over the whole part
//!   (`backlog_peak_rss_mib`), the seconds from the provider turning fast to
//!   the group's committed offsets reaching the end of the task topic
//!   (`drained_s`), and the rebalances the instance saw after its first
//!   assignment (none expected).
//!
//! Beside each run of the first part, the floor it stands on: the same HTTP
//! client (`HttpProvider`, as `sluice run` builds it) alone in a process of
//! its own (this bench run again with `--transport-floor`), holding as many
//! calls in flight to the same provider: its memory per call is what the
//! connections cost before Sluice holds anything (`transport_kib_per_call`,
//! `transport_kib_per_call_http1`).
//!
//! Both parts run the default pipeline otherwise (exactly-once, routing,
//! accounting), on fresh topics of their own. `SLUICE_BENCH_PARTS`
//! (`inflight,backlog`) runs one of them, without a RESULT line.

/// The same allocator as the `sluice` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "common/config.rs"]
mod config;
#[path = "common/process.rs"]
mod process;

use std::io::BufRead;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use config::BenchPipeline;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use sluice::kafka::{OutRecord, Publisher};
use sluice::sim::{Latency, SimConfig, SimHandle};

/// Partitions of the task topics.
const PARTITIONS: i32 = 4;
/// Tenants the tasks are spread over (enough for an even spread over the
/// partitions).
const TENANTS: usize = 100;

/// A number from the environment, or `default`.
fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A `sluice run` process, stopped (SIGTERM) when dropped.
struct Instance {
    child: std::process::Child,
    addr: String,
}

impl Instance {
    fn start(cfg: &str) -> Instance {
        // `SLUICE_BENCH_WRAP` runs the instance under a profiler (e.g.
        // `heaptrack -o /tmp/sluice`); its memory figures are then the
        // profiler's process.
        let wrap = std::env::var("SLUICE_BENCH_WRAP").unwrap_or_default();
        let mut words = wrap.split_whitespace();
        let mut command = match words.next() {
            Some(program) => {
                let mut c = std::process::Command::new(program);
                c.args(words).arg(env!("CARGO_BIN_EXE_sluice"));
                c
            }
            None => std::process::Command::new(env!("CARGO_BIN_EXE_sluice")),
        };
        command.args(["run", "--config", cfg]);
        let (child, addr) = process::spawn_listening(command);
        let instance = Instance { child, addr };
        let deadline = Instant::now() + Duration::from_secs(120);
        while instance.get("/readyz").0 != 200 {
            assert!(Instant::now() < deadline, "sluice run never became ready");
            std::thread::sleep(Duration::from_millis(200));
        }
        instance
    }

    /// Status and body of a GET on the instance's HTTP listener.
    fn get(&self, path: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(&self.addr) else {
            return (0, String::new());
        };
        let _ = write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
        let mut buf = String::new();
        let _ = s.read_to_string(&mut buf);
        let status = buf
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = buf
            .split_once("\r\n\r\n")
            .map_or("", |(_, b)| b)
            .to_string();
        (status, body)
    }

    /// The sum of a metric's series (every label set) on `/metrics`.
    fn metric(&self, name: &str) -> f64 {
        self.get("/metrics")
            .1
            .lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with([' ', '{']))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// A `/proc/<pid>/status` field, MiB.
    fn mem_mib(&self, field: &str) -> f64 {
        mem_mib(self.child.id(), field)
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

/// A `/proc/<pid>/status` field (`VmRSS`, `VmHWM`), MiB; 0 when gone.
fn mem_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .strip_prefix(':')?
                .split_whitespace()
                .next()?
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(0.0)
        / 1024.0
}

/// Samples a process's resident memory every 50 ms until stopped: the
/// highest sample, MiB.
struct RssSampler {
    stop: Arc<AtomicBool>,
    peak_kib: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssSampler {
    fn start(pid: u32) -> RssSampler {
        let (stop, peak_kib) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let thread = std::thread::spawn({
            let (stop, peak_kib) = (stop.clone(), peak_kib.clone());
            move || {
                while !stop.load(Ordering::Relaxed) {
                    let kib = (mem_mib(pid, "VmRSS") * 1024.0) as u64;
                    peak_kib.fetch_max(kib, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        });
        RssSampler {
            stop,
            peak_kib,
            thread: Some(thread),
        }
    }

    fn peak_mib(&self) -> f64 {
        self.peak_kib.load(Ordering::Relaxed) as f64 / 1024.0
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Task `i` of a part: a classify task of one of the tenants, keyed by it.
fn task(part: &str, i: usize) -> OutRecord {
    let tenant = format!("tenant-{}", i % TENANTS);
    OutRecord {
        key: Some(tenant.clone().into_bytes()),
        value: Some(
            serde_json::to_vec(&serde_json::json!({
                "taskId": format!("{part}-{i}"), "taskType": "classify", "tenantId": tenant,
                "submittedAt": chrono::Utc::now().timestamp_millis(),
                "payload": {
                    "content": format!("Item {i}: shares rose after the quarterly report."),
                    "labels": ["news", "sports", "tech"],
                },
            }))
            .unwrap(),
        ),
        ..Default::default()
    }
}

/// A pipeline on fresh topics (`prefix`), configured with `app` lines,
/// `batching` and `http2` to the provider, its topics created: the directory
/// (kept while it runs), the config path and the task topic.
fn pipeline(
    bootstrap: &str,
    sim: &SimHandle,
    prefix: &str,
    app: &str,
    batching: bool,
    http2: bool,
) -> (tempfile::TempDir, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let config = BenchPipeline {
        prefix,
        bootstrap,
        sim_url: &sim.base_url(),
        partitions: PARTITIONS,
        app,
        kafka: "",
    }
    .write(
        dir.path(),
        &format!(
            r#"http2 = {http2}

[[llm.models]]
name = "m"
provider = "sim"
limiter = {{ initial_rps = 1000000, max_rps = 1000000, concurrency = {{ enabled = false }} }}

[prices.m]
input = 150000
output = 600000

[batching]
enabled = {batching}

[http]
listen = "127.0.0.1:0"
"#
        ),
    );
    config::create_topics(env!("CARGO_BIN_EXE_sluice"), &config);
    let cfg = config.display().to_string();
    (dir, cfg, format!("{prefix}.tasks.classify"))
}

fn prefix(part: &str) -> String {
    format!(
        "bench-{part}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

fn publish(bootstrap: &str, topic: &str, part: &str, n: usize) {
    let publisher = Publisher::new(bootstrap).unwrap();
    for i in 0..n {
        publisher.send(topic, &task(part, i)).unwrap();
    }
    let delivered = publisher.finish(Duration::from_secs(300)).unwrap();
    assert_eq!(delivered.acked, n as u64, "{delivered:?}");
}

/// Records of `group` behind the end of `topic` (by its committed offsets).
fn group_lag(consumer: &BaseConsumer, topic: &str) -> i64 {
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition(topic, p);
    }
    let Ok(committed) = consumer.committed_offsets(tpl, Duration::from_secs(10)) else {
        return i64::MAX;
    };
    (0..PARTITIONS)
        .map(|p| {
            let end = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .map_or(i64::MAX / 8, |(_, high)| high);
            let at = match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => 0,
            };
            (end - at).max(0)
        })
        .sum()
}

struct InFlight {
    peak: u64,
    rss_mib: f64,
    idle_mib: f64,
}

fn calls_in_flight(bootstrap: &str, sim: &SimHandle, http2: bool) -> InFlight {
    let n = env("SLUICE_BENCH_INFLIGHT_TASKS", 10_400) as usize;
    let how = if http2 { "HTTP/2" } else { "HTTP/1.1" };
    sim.update(|c| c.latency = Latency::Fixed { ms: 10_000 })
        .unwrap();
    let part = prefix("inflight");
    let (_dir, cfg, topic) = pipeline(
        bootstrap,
        sim,
        &part,
        "max_in_flight_per_partition = 4000",
        false,
        http2,
    );
    let instance = Instance::start(&cfg);
    let idle_mib = instance.mem_mib("VmRSS");
    sim.reset_stats();
    let sampler = RssSampler::start(instance.child.id());
    let started = Instant::now();
    publish(bootstrap, &topic, &part, n);
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut last = Instant::now();
    while sim.stats().served_ok < n as u64 {
        assert!(
            Instant::now() < deadline,
            "calls in flight: {} of {n} answered after 300 s: {:?}",
            sim.stats().served_ok,
            sim.stats()
        );
        if last.elapsed() >= Duration::from_secs(2) {
            let s = sim.stats();
            eprintln!(
                "  {:>5.1}s: {} calls in flight (peak {}), {} answered, rss {:.0} MiB",
                started.elapsed().as_secs_f64(),
                s.in_flight,
                s.peak_in_flight,
                s.served_ok,
                instance.mem_mib("VmRSS")
            );
            last = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let stats = sim.stats();
    assert_eq!(
        stats.http2_requests,
        if http2 { stats.requests_total } else { 0 },
        "every call over {how}: {stats:?}"
    );
    let peak = stats.peak_in_flight;
    let rss_mib = instance.mem_mib("VmHWM").max(sampler.peak_mib());
    eprintln!(
        "calls in flight over {how}: {n} tasks, peak {peak} calls in flight, rss idle {idle_mib:.0} MiB, peak {rss_mib:.0} MiB ({:.1} KiB a call above idle), all answered after {:.1}s",
        (rss_mib - idle_mib) * 1024.0 / peak.max(1) as f64,
        started.elapsed().as_secs_f64()
    );
    InFlight {
        peak,
        rss_mib,
        idle_mib,
    }
}

struct Backlog {
    peak_rss_mib: f64,
    drained_s: f64,
    rebalances: f64,
}

fn backlog(bootstrap: &str, sim: &SimHandle) -> Backlog {
    let n = env("SLUICE_BENCH_BACKLOG_TASKS", 1_000_000) as usize;
    let slow_secs = env("SLUICE_BENCH_SLOW_SECS", 60);
    sim.update(|c| c.latency = Latency::Fixed { ms: 2_000 })
        .unwrap();
    let part = prefix("backlog");
    let (_dir, cfg, topic) = pipeline(bootstrap, sim, &part, "", true, false);
    let t = Instant::now();
    publish(bootstrap, &topic, &part, n);
    eprintln!(
        "backlog: {n} tasks published in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let instance = Instance::start(&cfg);
    let sampler = RssSampler::start(instance.child.id());
    let rebalances_at_start = instance.metric("sluice_rebalances_total");
    let consumer: BaseConsumer = sluice::kafka::base(bootstrap)
        .set("group.id", format!("{part}-app"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let report = |what: &str, since: Instant| {
        eprintln!(
            "  {what} {:>5.1}s: lag {}, in flight {}, {} calls in flight at the provider, rss {:.0} MiB (peak {:.0})",
            since.elapsed().as_secs_f64(),
            group_lag(&consumer, &topic),
            instance.metric("sluice_in_flight_records"),
            sim.stats().in_flight,
            instance.mem_mib("VmRSS"),
            sampler.peak_mib(),
        );
    };
    let slow = Instant::now();
    while slow.elapsed() < Duration::from_secs(slow_secs) {
        std::thread::sleep(Duration::from_secs(5));
        report("slow", slow);
    }
    sim.update(|c| c.latency = Latency::Fixed { ms: 0 })
        .unwrap();
    let fast = Instant::now();
    let deadline = fast + Duration::from_secs(env("SLUICE_BENCH_DRAIN_LIMIT_SECS", 1800));
    let mut last = Instant::now();
    while group_lag(&consumer, &topic) > 0 {
        assert!(
            Instant::now() < deadline,
            "backlog: the lag did not drain (lag {})",
            group_lag(&consumer, &topic)
        );
        if last.elapsed() >= Duration::from_secs(10) {
            report("fast", fast);
            last = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let drained_s = fast.elapsed().as_secs_f64();
    let completed = instance.metric("sluice_results_total");
    let rebalances = instance.metric("sluice_rebalances_total") - rebalances_at_start;
    let peak_rss_mib = instance.mem_mib("VmHWM").max(sampler.peak_mib());
    eprintln!(
        "backlog: {n} tasks, {slow_secs}s slow (2 s a call) then drained in {drained_s:.1}s; {completed} results emitted, {rebalances} rebalances after the first assignment, peak rss {peak_rss_mib:.0} MiB"
    );
    Backlog {
        peak_rss_mib,
        drained_s,
        rebalances,
    }
}

/// `--transport-floor <url> <n> <http2>`: a process holding `n` calls in
/// flight through the provider client alone. Prints `IDLE` once built,
/// starts the calls on a line from stdin, and runs until killed.
fn transport_floor(url: &str, n: usize, http2: bool) {
    use sluice::llm::transport::HttpProvider;
    use sluice::llm::wire::{ChatRequest, Message};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut config = sluice::llm::ProviderConfig::new("sim", url);
    config.http2 = http2;
    let provider = Arc::new(HttpProvider::new(&config).unwrap());
    println!("IDLE");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    rt.block_on(async {
        for i in 0..n {
            let provider = provider.clone();
            tokio::spawn(async move {
                let request = ChatRequest {
                    model: "m".into(),
                    messages: vec![
                        Message::system("Classify the text into one of the labels: news, sports, tech. Answer with JSON: {\"label\": \"...\"}."),
                        Message::user(format!("Item {i}: shares rose after the quarterly report.")),
                    ],
                    max_tokens: Some(64),
                    max_completion_tokens: None,
                    temperature: None,
                    response_format: None,
                };
                let _ = provider.chat(&request).await;
            });
        }
        std::future::pending::<()>().await
    });
}

/// The transport floor beside `sluice run`: resident MiB per call of the
/// provider client alone holding `n` calls in flight.
fn transport_kib_per_call(sim: &SimHandle, n: usize, http2: bool) -> f64 {
    sim.update(|c| c.latency = Latency::Fixed { ms: 10_000 })
        .unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--transport-floor",
            &sim.base_url(),
            &n.to_string(),
            &http2.to_string(),
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "IDLE");
    let pid = child.id();
    let idle = mem_mib(pid, "VmRSS");
    sim.reset_stats();
    {
        use std::io::Write;
        writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while sim.stats().in_flight < n as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let in_flight = sim.stats().in_flight;
    let rss = mem_mib(pid, "VmRSS");
    let _ = child.kill();
    let _ = child.wait();
    let kib = (rss - idle) * 1024.0 / in_flight.max(1) as f64;
    let how = if http2 { "HTTP/2" } else { "HTTP/1.1" };
    eprintln!(
        "transport floor over {how}: the provider client alone, {in_flight} calls in flight: rss idle {idle:.0} MiB, {rss:.0} MiB ({kib:.1} KiB a call)"
    );
    // Let the simulator's held requests end before the next part.
    let deadline = Instant::now() + Duration::from_secs(30);
    while sim.stats().in_flight > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    kib
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--transport-floor") {
        transport_floor(
            &args[i + 1],
            args[i + 2].parse().unwrap(),
            args[i + 3] == "true",
        );
        return;
    }
    let bootstrap =
        std::env::var("SLUICE_BENCH_BOOTSTRAP").expect("run through `make bench-overload`");
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
    let parts = std::env::var("SLUICE_BENCH_PARTS").unwrap_or("inflight,backlog".into());
    let n = env("SLUICE_BENCH_INFLIGHT_TASKS", 10_400) as usize;
    let inflight = parts.contains("inflight").then(|| {
        (
            calls_in_flight(&bootstrap, &sim, false),
            transport_kib_per_call(&sim, n, false),
            calls_in_flight(&bootstrap, &sim, true),
            transport_kib_per_call(&sim, n, true),
        )
    });
    let backlog = parts.contains("backlog").then(|| backlog(&bootstrap, &sim));
    let (Some((http1, floor1, http2, floor2)), Some(backlog)) = (inflight, backlog) else {
        eprintln!("(part of the bench run: no RESULT)");
        return;
    };
    let per_call = |r: &InFlight| (r.rss_mib - r.idle_mib) * 1024.0 / r.peak.max(1) as f64;
    println!(
        "RESULT backlog_peak_rss_mib={:.0} drained_s={:.1} inflight_peak={} inflight_rss_mib={:.0} inflight_peak_http1={} inflight_rss_mib_http1={:.0} inflight_idle_rss_mib={:.0} backlog_rebalances={} inflight_kib_per_call={:.1} inflight_kib_per_call_http1={:.1} transport_kib_per_call={floor2:.1} transport_kib_per_call_http1={floor1:.1}",
        backlog.peak_rss_mib,
        backlog.drained_s,
        http2.peak,
        http2.rss_mib,
        http1.peak,
        http1.rss_mib,
        http1.idle_mib,
        backlog.rebalances,
        per_call(&http2),
        per_call(&http1),
    );
}
