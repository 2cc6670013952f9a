//! `make bench-peer`: Sluice side by side with Kafka Streams, its peer, on the
//! same broker, the same data and the same two jobs, in one run.
//!
//! The jobs are the ones `make bench-engine` and `make bench-usage` measure:
//! the windowed per-key count (`sluice::cli::example::windowed_count`: 1-minute
//! tumbling windows, an hour's grace, the latest count of each updated window
//! written once per commit) and the per-tenant accounting (`account` with its
//! default windows of 1 minute, 1 hour, 1 day and 30 days, every updated
//! window written to a usage topic once per commit). The Kafka Streams side
//! (`benches/peers/kafka-streams`, built by `scripts/bench.sh peer`) writes
//! both in its DSL with JSON serdes, RocksDB window stores and the default
//! record cache. Both sides run under exactly-once (Kafka Streams'
//! `exactly_once_v2`) with a 100 ms commit interval and as many processing
//! threads (Kafka Streams' `num.stream.threads`) as Sluice uses by default.
//!
//! Each dataset is produced once (the count's: 400,000 records of 10,000
//! keys; the accounting's: 200,000 results of 10,000 tenants; both over 4
//! partitions and 10 minutes of event time, as in those benches). Each round
//! runs Sluice, then Kafka Streams, each with fresh state, a fresh
//! application id and a fresh output topic.
//!
//! A rate is input records over the time from the first record in to the
//! last output. The first record in: the moment the side processed its first
//! input record (Sluice: its processing-time histogram, which times the
//! record at offset 0 of every partition, watched every millisecond; Kafka
//! Streams: its main consumer's first poll that returned records, stamped by
//! a consumer interceptor; the partitions of tasks it has not restored yet
//! are paused, so records come back only for tasks ready to process them).
//! The last output: the broker's append time of the last record on the
//! output topic (created with `message.timestamp.type=LogAppendTime`); it goes
//! out in the last commit's transaction, committed right after. Start-up
//! (JVM, group join, topic metadata, the first restores) before the first
//! record counts on neither side; what happens after it counts on both. A
//! side is done when its consumer group's committed offsets reach the end of
//! the input (under exactly-once, the outputs of every record are then
//! committed); it is then stopped and its output read back `read_committed`.
//! The rates compared are the medians of three rounds
//! (`SLUICE_BENCH_ROUNDS`).
//!
//! Both outputs are checked against the counts and totals the dataset must
//! give, and against each other: the final count of every key and window,
//! and every tenant's final totals (requests, tokens, cost to the
//! micro-dollar, per-model shares) of every window. Any difference panics.

/// The same allocator as the `sluice` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdKafkaError;
use rdkafka::message::Timestamp;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sluice::cli::example::windowed_count;
use sluice::envelope::TaskResult;
use sluice::kafka::{create_topics, produce, OutRecord};
use sluice::steps::account::{
    default_windows, AccountStreamExt, Accounting, AccountingSettings, TenantUsage, UsageRecord,
    WindowUsage,
};
use sluice_topology::runtime::metrics::names;
use sluice_topology::runtime::{
    AppState, EngineMetrics, Guarantee, RunningApp, StreamsApp, StreamsConfig,
};
use sluice_topology::{JsonCodec, SourceOptions, StreamBuilder, StringCodec, Windowed};

// The plain read (`raw_read`) is not used: this bench compares two engines.
#[allow(dead_code)]
mod common;
#[path = "common/results.rs"]
mod results;
use results::task_results;

use common::{env_usize, PARTITIONS};

/// Keys of the count's dataset.
const KEYS: usize = 10_000;
/// The count's window size.
const MINUTE_MS: i64 = 60_000;
/// The count's grace (as bench-engine's).
const COUNT_GRACE: Duration = Duration::from_secs(3600);
/// How long a side may take for anything (start, a run, a stop).
const DEADLINE: Duration = Duration::from_secs(300);

/// The two sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Sluice,
    KafkaStreams,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Sluice => "sluice",
            Side::KafkaStreams => "kstreams",
        }
    }
}

/// The two jobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Job {
    /// bench-engine's windowed per-key count.
    Count,
    /// bench-usage's per-tenant accounting.
    Usage,
}

impl Job {
    fn name(self) -> &'static str {
        match self {
            Job::Count => "count",
            Job::Usage => "usage",
        }
    }
}

/// The input of a job, produced once.
struct Input {
    topic: String,
    records: usize,
    /// The end offset of each partition.
    ends: Vec<i64>,
}

/// An output record as read back.
struct Output {
    key: Vec<u8>,
    value: Vec<u8>,
    /// The broker's append time, ms.
    appended_ms: i64,
}

/// What a side's run came to.
struct Run {
    /// Input records per second, from the first in to the last output.
    rps: f64,
    /// The output records, per partition in offset order.
    outputs: Vec<Vec<Output>>,
}

fn unique(what: &str) -> String {
    format!(
        "bench-{what}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// Wall-clock time, ms since the epoch (the clock the broker stamps with).
fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64()
        * 1000.0
}

/// bench-engine's dataset: `n` records of 10,000 keys over ten minutes of
/// event time, half an hour ago.
fn count_records(n: usize, base: i64) -> impl Iterator<Item = OutRecord> {
    let minutes = 10i64;
    (0..n).map(move |i| OutRecord {
        key: Some(format!("key-{}", (i * 7919) % KEYS).into_bytes()),
        value: Some(format!("{{\"n\":{i},\"pad\":\"0123456789abcdef\"}}").into_bytes()),
        timestamp: Some(base + (i as i64 * minutes * MINUTE_MS) / n as i64),
        ..Default::default()
    })
}

/// The final count of every key and window the count's dataset must give.
fn expected_counts(n: usize, base: i64) -> HashMap<(String, i64), u64> {
    let mut counts = HashMap::new();
    for r in count_records(n, base) {
        let key = String::from_utf8(r.key.unwrap()).unwrap();
        let at = r.timestamp.unwrap();
        *counts
            .entry((key, at - at.rem_euclid(MINUTE_MS)))
            .or_default() += 1;
    }
    counts
}

/// A usage window's identity: tenant, window size name, window start.
type UsageKey = (String, String, i64);

/// The final usage record of every tenant and window the accounting's
/// dataset must give.
fn expected_usage(n: usize, tenants: usize, now: i64) -> HashMap<UsageKey, UsageRecord> {
    let windows = default_windows();
    let mut usage: HashMap<(String, usize, i64), TenantUsage> = HashMap::new();
    for r in task_results(n, tenants, now) {
        let at = r.completed_at.timestamp_millis();
        for (i, w) in windows.iter().enumerate() {
            let start = w.start_of(at);
            usage
                .entry((r.tenant_id.clone(), i, start))
                .or_default()
                .add(&r);
        }
    }
    usage
        .into_iter()
        .map(|((tenant, i, start), u)| {
            let w = &windows[i];
            let record = UsageRecord {
                tenant_id: tenant.clone(),
                usage: WindowUsage::new(w, start, u),
            };
            ((tenant, w.name.clone(), start), record)
        })
        .collect()
}

/// Produces a dataset and notes where each partition ends.
fn produce_input(bootstrap: &str, what: &str, records: impl Iterator<Item = OutRecord>) -> Input {
    let topic = unique(what);
    create_topics(bootstrap, &[(&topic, PARTITIONS, &[])]).unwrap();
    let t = Instant::now();
    let n = produce(bootstrap, &topic, records).unwrap();
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("consumer");
    let ends: Vec<i64> = (0..PARTITIONS)
        .map(|p| {
            consumer
                .fetch_watermarks(&topic, p, Duration::from_secs(10))
                .expect("watermarks")
                .1
        })
        .collect();
    assert_eq!(
        ends.iter().sum::<i64>() as usize,
        n,
        "{topic} holds {ends:?}"
    );
    eprintln!(
        "produced {n} records to {topic} in {:.2}s",
        t.elapsed().as_secs_f64()
    );
    Input {
        topic,
        records: n,
        ends,
    }
}

/// A topic whose records the broker stamps with their append time.
fn create_output(bootstrap: &str, topic: &str) {
    create_topics(
        bootstrap,
        &[(
            topic,
            PARTITIONS,
            &[("message.timestamp.type", "LogAppendTime")],
        )],
    )
    .unwrap();
}

/// Whether the group's committed offsets have reached the end of the input.
struct CommitWatch {
    consumer: BaseConsumer,
    tpl: TopicPartitionList,
    ends: Vec<i64>,
}

impl CommitWatch {
    fn new(bootstrap: &str, group: &str, input: &Input) -> Self {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create()
            .expect("consumer");
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            tpl.add_partition(&input.topic, p);
        }
        CommitWatch {
            consumer,
            tpl,
            ends: input.ends.clone(),
        }
    }

    fn at_end(&self) -> bool {
        let Ok(committed) = self
            .consumer
            .committed_offsets(self.tpl.clone(), Duration::from_secs(5))
        else {
            return false;
        };
        (0..PARTITIONS).all(|p| {
            let at = committed
                .elements()
                .iter()
                .find(|e| e.partition() == p)
                .and_then(|e| match e.offset() {
                    Offset::Offset(o) => Some(o),
                    _ => None,
                });
            at.is_some_and(|o| o >= self.ends[p as usize])
        })
    }
}

/// Every committed record of `topic`, per partition in offset order.
fn read_output(bootstrap: &str, topic: &str) -> Vec<Vec<Output>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("bench-peer-reader"))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut out: Vec<Vec<Output>> = (0..PARTITIONS).map(|_| Vec::new()).collect();
    let mut at_end = vec![false; PARTITIONS as usize];
    let deadline = Instant::now() + DEADLINE;
    while at_end.iter().any(|e| !e) {
        assert!(Instant::now() < deadline, "reading {topic} timed out");
        match consumer.poll(Duration::from_millis(100)) {
            None => {}
            Some(Err(RdKafkaError::PartitionEOF(p))) => at_end[p as usize] = true,
            Some(Err(e)) => panic!("reading {topic}: {e}"),
            Some(Ok(m)) => {
                let Timestamp::LogAppendTime(appended_ms) = m.timestamp() else {
                    panic!("{topic} is not stamped with append times");
                };
                out[m.partition() as usize].push(Output {
                    key: m.key().unwrap_or_default().to_vec(),
                    value: m.payload().unwrap_or_default().to_vec(),
                    appended_ms,
                });
            }
        }
    }
    out
}

/// Waits until `done` or the deadline; `alive` panics when the side died.
fn wait_until(what: &str, mut done: impl FnMut() -> bool, mut alive: impl FnMut()) {
    let deadline = Instant::now() + DEADLINE;
    while !done() {
        alive();
        assert!(Instant::now() < deadline, "{what}: timed out");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The Sluice side of a job.
fn sluice_topology(job: Job, input: &str, output: &str, app_id: &str) -> sluice_topology::Topology {
    match job {
        Job::Count => windowed_count(&[input], output, None, COUNT_GRACE),
        Job::Usage => {
            let accounting = Accounting::new(AccountingSettings {
                name: "usage".into(),
                windows: default_windows(),
                usage_topic: output.to_string(),
                usage_updates: Default::default(),
                budgets: Default::default(),
                thresholds: vec![0.5, 0.8, 1.0],
                alerts_topic: format!("{app_id}-alerts"),
                quotas: Default::default(),
                downgrade_at: None,
            });
            let b = StreamBuilder::new();
            b.stream_with(
                &[input],
                StringCodec,
                JsonCodec::<TaskResult>::default(),
                SourceOptions::default(),
            )
            .account(&accounting);
            b.build().expect("topology")
        }
    }
}

/// Sluice's configuration in this bench (as bench-engine's and bench-usage's).
fn sluice_config(app_id: &str, bootstrap: &str, state: &Path) -> StreamsConfig {
    let mut cfg = StreamsConfig::new(app_id, bootstrap, state);
    cfg.guarantee = Guarantee::ExactlyOnce;
    cfg.session_timeout = Duration::from_secs(6);
    cfg
}

/// Records Sluice has processed, as far as its processing-time histogram
/// says: it times the records at offsets divisible by 32, so the first
/// record of every partition (offset 0) counts the moment it is processed,
/// while the records-in counter is added to only after a feeding round.
fn processed(registry: &prometheus::Registry) -> u64 {
    registry
        .gather()
        .iter()
        .find(|f| f.name() == names::PROCESS_SECONDS)
        .and_then(|f| f.get_metric().first())
        .map_or(0, |m| m.get_histogram().get_sample_count())
}

/// Runs a job on Sluice; returns when its outputs are committed and it has
/// stopped, with the time its first record was processed, ms.
fn run_sluice(bootstrap: &str, job: Job, input: &Input, app_id: &str, output: &str) -> f64 {
    if job == Job::Usage {
        create_topics(bootstrap, &[(&format!("{app_id}-alerts"), PARTITIONS, &[])]).unwrap();
    }
    let state = tempfile::tempdir().unwrap();
    let registry = prometheus::Registry::new();
    let metrics = EngineMetrics::register(&registry).expect("metrics");
    let app: RunningApp = StreamsApp::new(
        sluice_topology(job, &input.topic, output, app_id),
        sluice_config(app_id, bootstrap, state.path()),
        metrics.clone(),
    )
    .start()
    .expect("start");
    let alive = || {
        if app.is_finished() {
            panic!("sluice stopped: {:?}", app.status().state());
        }
    };
    wait_until("sluice: first record", || processed(&registry) > 0, alive);
    let first_in = now_ms();
    let watch = CommitWatch::new(bootstrap, app_id, input);
    let mut last_look = Instant::now();
    wait_until(
        "sluice: input committed",
        || {
            // A look every 50 ms (the group coordinator is asked each time).
            if last_look.elapsed() < Duration::from_millis(50) {
                return false;
            }
            last_look = Instant::now();
            watch.at_end()
        },
        alive,
    );
    assert_eq!(metrics.records_in() as usize, input.records);
    assert_ne!(app.status().state(), AppState::Starting);
    app.shutdown();
    app.join().expect("clean stop");
    first_in
}

/// The Kafka Streams peer's process, and the lines it printed.
struct PeerProcess {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl PeerProcess {
    fn start(classpath: &str, job: Job, args: &[(&str, String)]) -> Self {
        let mut cmd = Command::new("java");
        cmd.args(["-Xms1g", "-Xmx2g"]);
        // SLUICE_BENCH_KSTREAMS_JAVA_OPTS: more JVM options (e.g.
        // -Dorg.slf4j.simpleLogger.defaultLogLevel=info for its log).
        if let Ok(opts) = std::env::var("SLUICE_BENCH_KSTREAMS_JAVA_OPTS") {
            cmd.args(opts.split_whitespace());
        }
        cmd.args(["-cp", classpath, "sluice.peer.KafkaStreamsPeer"])
            .arg(job.name());
        for (k, v) in args {
            cmd.arg(format!("--{k}")).arg(v);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("java (run through `make bench-peer`)");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        PeerProcess { child, lines }
    }

    /// Panics if the process ended.
    fn alive(&mut self) {
        if let Some(status) = self.child.try_wait().expect("wait") {
            panic!("kafka streams peer exited: {status}");
        }
    }

    /// Waits for a line starting with each of `prefixes`, in any order;
    /// returns the rest of each, in the order asked.
    fn expect_lines(&mut self, prefixes: &[&str]) -> Vec<String> {
        let mut found: Vec<Option<String>> = vec![None; prefixes.len()];
        let deadline = Instant::now() + DEADLINE;
        while found.iter().any(Option::is_none) {
            assert!(
                Instant::now() < deadline,
                "kafka streams peer: no {prefixes:?}"
            );
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    let hit = prefixes.iter().enumerate().find_map(|(i, p)| {
                        let rest = line.strip_prefix(p)?;
                        rest.starts_with(' ').then(|| (i, rest.trim().to_string()))
                    });
                    match hit {
                        Some((i, rest)) => found[i] = Some(rest),
                        None => eprintln!("kstreams: {line}"),
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => self.alive(),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("kafka streams peer: output ended before {prefixes:?}")
                }
            }
        }
        found.into_iter().map(Option::unwrap).collect()
    }

    /// Closes its input (its signal to stop) and waits for a clean exit.
    fn stop(mut self) {
        drop(self.child.stdin.take());
        self.expect_lines(&["CLOSED"]);
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "kafka streams peer: {status}");
    }
}

/// Runs a job on Kafka Streams; returns when its outputs are committed and it
/// has stopped, with the time its first records were polled and the time the
/// client reached `RUNNING` (every task restored and processing), ms.
fn run_kafka_streams(
    bootstrap: &str,
    job: Job,
    input: &Input,
    app_id: &str,
    output: &str,
    threads: usize,
) -> (f64, Option<f64>) {
    let classpath = std::env::var("SLUICE_BENCH_KSTREAMS_CP")
        .expect("SLUICE_BENCH_KSTREAMS_CP: run through `make bench-peer`");
    let state = tempfile::tempdir().unwrap();
    let mut args = vec![
        ("bootstrap", bootstrap.to_string()),
        ("app-id", app_id.to_string()),
        ("input", input.topic.clone()),
        ("output", output.to_string()),
        ("state-dir", state.path().display().to_string()),
        ("threads", threads.to_string()),
        ("grace-ms", COUNT_GRACE.as_millis().to_string()),
    ];
    // SLUICE_BENCH_KSTREAMS_CACHE_BYTES: a record cache other than the
    // default 10 MB (`statestore.cache.max.bytes`), to see what it changes.
    if let Ok(bytes) = std::env::var("SLUICE_BENCH_KSTREAMS_CACHE_BYTES") {
        args.push(("cache-bytes", bytes));
    }
    let mut peer = PeerProcess::start(&classpath, job, &args);
    let times = peer.expect_lines(&["RUNNING", "FIRST_IN"]);
    let ms = |t: &str| -> f64 { t.parse().expect("epoch ms") };
    let (running, first_in) = (ms(&times[0]), ms(&times[1]));
    let watch = CommitWatch::new(bootstrap, app_id, input);
    let mut last_look = Instant::now();
    let mut peer = Some(peer);
    wait_until(
        "kafka streams: input committed",
        || {
            if last_look.elapsed() < Duration::from_millis(50) {
                return false;
            }
            last_look = Instant::now();
            watch.at_end()
        },
        || peer.as_mut().unwrap().alive(),
    );
    peer.take().unwrap().stop();
    (first_in, Some(running))
}

/// One side's run of a job on a fresh application id, output topic and state.
fn run(bootstrap: &str, side: Side, job: Job, input: &Input, threads: usize) -> Run {
    let app_id = unique(&format!("peer-{}-{}", job.name(), side.name()));
    let output = format!("{app_id}-out");
    create_output(bootstrap, &output);
    let started = Instant::now();
    let (first_in, running) = match side {
        Side::Sluice => (run_sluice(bootstrap, job, input, &app_id, &output), None),
        Side::KafkaStreams => run_kafka_streams(bootstrap, job, input, &app_id, &output, threads),
    };
    let wall = started.elapsed().as_secs_f64();
    let outputs = read_output(bootstrap, &output);
    let last_out = outputs
        .iter()
        .flatten()
        .map(|o| o.appended_ms)
        .max()
        .expect("some output") as f64;
    let secs = (last_out - first_in).max(1.0) / 1000.0;
    let rps = input.records as f64 / secs;
    eprintln!(
        "{} {}: {} records in {secs:.2}s from the first in to the last output ({rps:.0}/s; {} outputs; {wall:.1}s from start to stop)",
        side.name(),
        job.name(),
        input.records,
        outputs.iter().map(Vec::len).sum::<usize>()
    );
    // Kafka Streams processes the tasks it has restored while it restores
    // the others (one at a time per thread, even when their changelogs are
    // empty): what its rate would be from the moment every task runs (the
    // records processed before still counted, so this flatters it).
    if let Some(running) = running.filter(|r| *r > first_in) {
        let secs = (last_out - running).max(1.0) / 1000.0;
        eprintln!(
            "{} {}: running {:.2}s after its first record; {:.0}/s from then (not the measure)",
            side.name(),
            job.name(),
            (running - first_in) / 1000.0,
            input.records as f64 / secs
        );
    }
    Run { rps, outputs }
}

/// The latest value of each key, decoded by `decode`; every key must live
/// in one partition (its latest value is then its last in offset order).
fn finals<K: Hash + Eq + Debug, V>(
    outputs: &[Vec<Output>],
    decode: impl Fn(&Output) -> (K, V),
) -> HashMap<K, V> {
    let mut latest: HashMap<K, (usize, V)> = HashMap::new();
    for (p, records) in outputs.iter().enumerate() {
        for o in records {
            let (k, v) = decode(o);
            if let Some((q, _)) = latest.get(&k) {
                assert_eq!(*q, p, "{k:?} written to two partitions");
            }
            latest.insert(k, (p, v));
        }
    }
    latest.into_iter().map(|(k, (_, v))| (k, v)).collect()
}

/// The final counts of a count's output.
fn count_finals(outputs: &[Vec<Output>]) -> HashMap<(String, i64), u64> {
    finals(outputs, |o| {
        let key: Windowed<String> = serde_json::from_slice(&o.key).expect("windowed key JSON");
        let count: u64 = serde_json::from_slice(&o.value).expect("count JSON");
        assert_eq!(key.window.end - key.window.start, MINUTE_MS, "window");
        ((key.key, key.window.start), count)
    })
}

/// The final usage records of an accounting's output.
fn usage_finals(outputs: &[Vec<Output>]) -> HashMap<UsageKey, UsageRecord> {
    finals(outputs, |o| {
        let r: UsageRecord = serde_json::from_slice(&o.value).expect("usage record JSON");
        assert_eq!(o.key, r.tenant_id.as_bytes(), "usage record key");
        (
            (
                r.tenant_id.clone(),
                r.usage.window.clone(),
                r.usage.window_start,
            ),
            r,
        )
    })
}

/// Panics, naming a few differences, unless `got` equals `want`.
fn check_equal<K: Hash + Eq + Debug + Ord + Clone, V: PartialEq + Debug>(
    what: &str,
    want: &HashMap<K, V>,
    got: &HashMap<K, V>,
) {
    let mut missing: Vec<&K> = want.keys().filter(|k| !got.contains_key(k)).collect();
    let mut extra: Vec<&K> = got.keys().filter(|k| !want.contains_key(k)).collect();
    let mut differ: Vec<&K> = want
        .iter()
        .filter(|(k, v)| got.get(*k).is_some_and(|g| g != *v))
        .map(|(k, _)| k)
        .collect();
    if missing.is_empty() && extra.is_empty() && differ.is_empty() {
        eprintln!("{what}: all {} equal", want.len());
        return;
    }
    missing.sort();
    extra.sort();
    differ.sort();
    let examples: Vec<String> = differ
        .iter()
        .take(3)
        .map(|k| format!("{k:?}: {:?} != {:?}", want[*k], got[*k]))
        .collect();
    panic!(
        "{what}: MISMATCH: {} missing (e.g. {:?}), {} extra (e.g. {:?}), {} different (e.g. {examples:?})",
        missing.len(),
        missing.iter().take(3).collect::<Vec<_>>(),
        extra.len(),
        extra.iter().take(3).collect::<Vec<_>>(),
        differ.len(),
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs both sides on a job's input `rounds` times, checks every output;
/// returns the median rates (Sluice, Kafka Streams).
fn compare<K: Hash + Eq + Debug + Ord + Clone, V: PartialEq + Debug>(
    bootstrap: &str,
    job: Job,
    input: &Input,
    rounds: usize,
    threads: usize,
    want: &HashMap<K, V>,
    decode: impl Fn(&[Vec<Output>]) -> HashMap<K, V>,
) -> (f64, f64) {
    let (mut sluice, mut kstreams) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let s = run(bootstrap, Side::Sluice, job, input, threads);
        let s_finals = decode(&s.outputs);
        check_equal(
            &format!("sluice {} vs expected", job.name()),
            want,
            &s_finals,
        );
        let k = run(bootstrap, Side::KafkaStreams, job, input, threads);
        let k_finals = decode(&k.outputs);
        check_equal(
            &format!("kstreams {} vs expected", job.name()),
            want,
            &k_finals,
        );
        check_equal(
            &format!("sluice vs kstreams {}", job.name()),
            &s_finals,
            &k_finals,
        );
        sluice.push(s.rps);
        kstreams.push(k.rps);
    }
    (median(sluice), median(kstreams))
}

fn main() {
    let bootstrap = std::env::var("SLUICE_BENCH_BOOTSTRAP").expect("run through `make bench-peer`");
    let count_n = env_usize("SLUICE_BENCH_COUNT_RECORDS", 400_000);
    let usage_n = env_usize("SLUICE_BENCH_USAGE_RECORDS", 200_000);
    let tenants = env_usize("SLUICE_BENCH_TENANTS", 10_000);
    let rounds = env_usize("SLUICE_BENCH_ROUNDS", 3).max(1);
    // SLUICE_BENCH_LOG=<filter> shows the engine's log (stderr).
    if let Ok(filter) = std::env::var("SLUICE_BENCH_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    // Kafka Streams gets as many stream threads as Sluice has processing threads.
    let threads = sluice_config("bench-peer", &bootstrap, Path::new(".")).processing_threads;
    eprintln!("processing threads (Sluice) = stream threads (Kafka Streams) = {threads}; {rounds} round(s)");

    // SLUICE_BENCH_ONLY=count|usage runs one job (for profiling).
    let only = std::env::var("SLUICE_BENCH_ONLY").ok();
    let runs = |job: Job| only.as_deref().is_none_or(|o| o == job.name());

    let (mut sluice_count, mut kstreams_count) = (f64::NAN, f64::NAN);
    if runs(Job::Count) {
        let base = (chrono::Utc::now().timestamp_millis() / MINUTE_MS - 30) * MINUTE_MS;
        let counts = produce_input(&bootstrap, "peer-count-in", count_records(count_n, base));
        let want_counts = expected_counts(count_n, base);
        (sluice_count, kstreams_count) = compare(
            &bootstrap,
            Job::Count,
            &counts,
            rounds,
            threads,
            &want_counts,
            count_finals,
        );
    }

    let (mut sluice_usage, mut kstreams_usage) = (f64::NAN, f64::NAN);
    if runs(Job::Usage) {
        let now = chrono::Utc::now().timestamp_millis();
        let results = task_results(usage_n, tenants, now).map(|r| OutRecord {
            key: Some(r.tenant_id.clone().into_bytes()),
            value: Some(serde_json::to_vec(&r).unwrap()),
            timestamp: Some(r.completed_at.timestamp_millis()),
            ..Default::default()
        });
        let usage = produce_input(&bootstrap, "peer-results", results);
        let want_usage = expected_usage(usage_n, tenants, now);
        (sluice_usage, kstreams_usage) = compare(
            &bootstrap,
            Job::Usage,
            &usage,
            rounds,
            threads,
            &want_usage,
            usage_finals,
        );
    }

    println!("sluice_count_rps={sluice_count:.0} sluice_usage_rps={sluice_usage:.0}");
    println!(
        "RESULT count_vs_kstreams={:.2} usage_vs_kstreams={:.2} sluice_count_rps={sluice_count:.0} sluice_usage_rps={sluice_usage:.0} kstreams_count_rps={kstreams_count:.0} kstreams_usage_rps={kstreams_usage:.0}",
        sluice_count / kstreams_count,
        sluice_usage / kstreams_usage
    );
}
