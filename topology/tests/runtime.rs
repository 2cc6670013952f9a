//! The Kafka runtime in process against the test broker: a windowed count
//! under both guarantees, checked against the input.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sluice_topology::runtime::{
    EngineMetrics, GroupProtocol, Guarantee, StreamsApp, StreamsConfig,
};
use sluice_topology::{JsonCodec, StreamBuilder, StringCodec, TimeWindows, Windowed};

fn bootstrap() -> String {
    std::env::var("SLUICE_TEST_BOOTSTRAP").expect(
        "SLUICE_TEST_BOOTSTRAP is not set: run the tests with `make test`, which starts the broker",
    )
}

fn unique(p: &str) -> String {
    format!("{p}-{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

fn create(topics: &[(&str, i32)]) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .unwrap();
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|(t, p)| NewTopic::new(t, *p, TopicReplication::Fixed(1)))
        .collect();
    futures::executor::block_on(admin.create_topics(&new, &AdminOptions::new())).unwrap();
}

fn producer() -> ThreadedProducer<DefaultProducerContext> {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("linger.ms", "5")
        .create()
        .unwrap()
}

/// A consumer of committed records in a group of its own, with `extra`
/// settings.
fn committed_reader(extra: &[(&str, &str)]) -> BaseConsumer {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap())
        .set("group.id", unique("reader"))
        .set("isolation.level", "read_committed");
    for (k, v) in extra {
        config.set(*k, *v);
    }
    config.create().unwrap()
}

/// Assigns partitions `0..partitions` of `topic` to `c` from their start.
fn assign_from_start(c: &BaseConsumer, topic: &str, partitions: i32) {
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    c.assign(&tpl).unwrap();
}

fn read_all(
    topic: &str,
    partitions: i32,
    done: impl Fn(&BTreeMap<(i64, String), u64>) -> bool,
) -> BTreeMap<(i64, String), u64> {
    let c = committed_reader(&[]);
    assign_from_start(&c, topic, partitions);
    let mut latest = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        match c.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let k: Windowed<String> = serde_json::from_slice(m.key().unwrap()).unwrap();
                let v: u64 = serde_json::from_slice(m.payload().unwrap()).unwrap();
                latest.insert((k.window.start, k.key), v);
            }
            _ => {
                if done(&latest) {
                    break;
                }
            }
        }
    }
    latest
}

fn windowed_count_round_trip(guarantee: Guarantee) {
    let (input, output, app) = (unique("rt-in"), unique("rt-out"), unique("rt-app"));
    create(&[(&input, 3), (&output, 3)]);
    let producer = producer();
    let base = 1_700_000_000_000i64;
    let mut expected: BTreeMap<(i64, String), u64> = BTreeMap::new();
    for i in 0..10_000i64 {
        let key = format!("k{}", i % 37);
        let ts = base + i * 30;
        *expected
            .entry((ts - ts.rem_euclid(60_000), key.clone()))
            .or_default() += 1;
        producer
            .send(
                BaseRecord::<str, str>::to(&input)
                    .key(&key)
                    .payload("x")
                    .timestamp(ts),
            )
            .map_err(|(e, _)| e)
            .unwrap();
    }
    producer.flush(Duration::from_secs(30)).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StreamsConfig::new(&app, &bootstrap(), dir.path());
    cfg.guarantee = guarantee;
    cfg.session_timeout = Duration::from_secs(6);
    let metrics = EngineMetrics::unregistered();
    let running = StreamsApp::new(windowed_count(&input, &output), cfg, metrics.clone())
        .start()
        .unwrap();
    let got = read_all(&output, 3, |m| m == &expected);
    running.shutdown();
    running.join().unwrap();
    assert_eq!(got, expected);
    assert_eq!(metrics.records_in(), 10_000);
    assert!(metrics.commit_count() > 0);
}

/// A count per key and one-minute window (store `counts`, a changelogged
/// window store), each window's count out once per commit.
fn windowed_count(input: &str, output: &str) -> sluice_topology::Topology {
    let b = StreamBuilder::new();
    b.stream(&[input], StringCodec, StringCodec)
        .group_by_key()
        .windowed_by(
            TimeWindows::tumbling(Duration::from_secs(60)).grace(Duration::from_secs(3600)),
        )
        .count("counts")
        .to_stream()
        .to(
            output,
            JsonCodec::<Windowed<String>>::default(),
            JsonCodec::<u64>::default(),
        );
    b.build().unwrap()
}

#[test]
fn windowed_count_at_least_once() {
    windowed_count_round_trip(Guarantee::AtLeastOnce);
}

#[test]
fn windowed_count_exactly_once() {
    windowed_count_round_trip(Guarantee::ExactlyOnce);
}

/// Records each value when processing starts, then completes it after a short
/// delay that varies per record, so completions come back out of order.
struct Recorder {
    started: std::sync::Arc<parking_lot::Mutex<Vec<String>>>,
    /// Calls running, and the most seen at once, by partition (the record
    /// values are "partition:index").
    running: std::sync::Arc<[[AtomicUsize; 2]; 2]>,
}

fn partition_of(value: &str) -> usize {
    value[..value.find(':').expect("partition:index")]
        .parse()
        .expect("a partition number")
}

impl sluice_topology::Processor<String, String> for Recorder {
    type OutKey = String;
    type OutValue = String;
    type Output = sluice_topology::Record<String, String>;

    fn process(
        &mut self,
        r: sluice_topology::Record<String, String>,
        ctx: &mut sluice_topology::ProcessorContext<'_, String, String, Self::Output>,
    ) -> Result<(), sluice_topology::ProcessError> {
        self.started.lock().push(r.value.clone());
        let [now, peak] = &self.running[partition_of(&r.value)];
        peak.fetch_max(now.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
        let delay = r.value.bytes().map(u64::from).sum::<u64>() % 4;
        ctx.spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            r
        });
        Ok(())
    }

    fn complete(
        &mut self,
        r: Self::Output,
        ctx: &mut sluice_topology::ProcessorContext<'_, String, String, Self::Output>,
    ) -> Result<(), sluice_topology::ProcessError> {
        self.running[partition_of(&r.value)][0].fetch_sub(1, Ordering::SeqCst);
        ctx.forward(r)
    }
}

/// With a tiny in-flight bound the driver reads each partition's queue only as
/// room frees up: no partition ever has more calls running than the bound,
/// every record is still started exactly once, in offset order per
/// partition, and the committed offsets reach the end of the input.
#[test]
fn bounded_intake_keeps_partition_order_and_commits_to_the_end() {
    bounded_intake(false);
}

/// As above with every record taking two places under the bound: a count in
/// hopping windows (emitting on update) forwards two derived records per
/// record, one per window it falls in, each an async call. A batch taken for
/// the room left holds more records than the bound lets in: the rest waits
/// in the task's backlog, in order.
#[test]
fn records_that_take_two_places_keep_the_bound_and_partition_order() {
    bounded_intake(true);
}

fn bounded_intake(doubled: bool) {
    let (input, output, app) = (unique("ord-in"), unique("ord-out"), unique("ord-app"));
    create(&[(&input, 2), (&output, 2)]);
    let producer = producer();
    let per_partition = 3_000;
    for i in 0..per_partition {
        for p in 0..2 {
            let v = format!("{p}:{i}");
            producer
                .send(
                    BaseRecord::<str, str>::to(&input)
                        .key(&v)
                        .payload(&v)
                        .partition(p),
                )
                .map_err(|(e, _)| e)
                .unwrap();
        }
    }
    producer.flush(Duration::from_secs(30)).unwrap();

    let started = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let b = StreamBuilder::new();
    let log = started.clone();
    let calls: std::sync::Arc<[[AtomicUsize; 2]; 2]> = Default::default();
    let recorded = calls.clone();
    let recorder = move || Recorder {
        started: log.clone(),
        running: recorded.clone(),
    };
    let per_record = if doubled { 2 } else { 1 };
    let source = b.stream(&[&input], StringCodec, StringCodec);
    let source = if doubled {
        source
            .group_by_key()
            .windowed_by(TimeWindows::hopping(
                Duration::from_secs(60),
                Duration::from_secs(30),
            ))
            .emit_on_update()
            .count("counts")
            .to_stream()
            .map(|r: sluice_topology::Record<Windowed<String>, u64>| {
                let value = format!("{}:{}", r.key.key, r.key.window.start);
                r.with(String::new(), value)
            })
    } else {
        source
    };
    source
        .process("recorder", &[], recorder)
        .to(&output, StringCodec, StringCodec);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StreamsConfig::new(&app, &bootstrap(), dir.path());
    cfg.guarantee = Guarantee::AtLeastOnce;
    cfg.session_timeout = Duration::from_secs(6);
    cfg.max_in_flight_per_partition = 4;
    let metrics = EngineMetrics::unregistered();
    let running = StreamsApp::new(b.build().unwrap(), cfg, metrics.clone())
        .start()
        .unwrap();
    let total = (2 * per_partition * per_record) as u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    while metrics.records_out() < total && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    running.shutdown();
    running.join().unwrap();

    let started = started.lock().clone();
    // A record is taken while fewer than 4 are in flight; one that takes
    // two places can pass the bound by one.
    let most = 4 + per_record - 1;
    for (p, [_, peak]) in calls.iter().enumerate() {
        let peak = peak.load(Ordering::SeqCst);
        assert!(
            (2..=most).contains(&peak),
            "partition {p}: at most {peak} calls at once, bound 4"
        );
    }
    for p in 0..2 {
        // The record's index (the windows' starts after it vary).
        let seq: Vec<usize> = started
            .iter()
            .filter_map(|v| v.strip_prefix(&format!("{p}:")))
            .map(|i| i.split(':').next().unwrap().parse().unwrap())
            .collect();
        let expected: Vec<usize> = (0..per_partition)
            .flat_map(|i| std::iter::repeat_n(i, per_record))
            .collect();
        assert!(
            seq == expected,
            "partition {p}: {} starts, first out of order at {:?}",
            seq.len(),
            seq.iter().zip(&expected).position(|(a, b)| a != b)
        );
    }
    assert_eq!(metrics.records_out(), total);
    // Offsets moved to the end of both partitions.
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("group.id", &app)
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(&input, 0);
    tpl.add_partition(&input, 1);
    let committed = c.committed_offsets(tpl, Duration::from_secs(10)).unwrap();
    for e in committed.elements() {
        assert_eq!(e.offset(), Offset::Offset(per_partition as i64), "{e:?}");
    }
}

/// Passes records on; every punctuation writes `per_tick` new keys into a
/// store without changelog.
struct Scribbler {
    per_tick: usize,
    next: u64,
}

impl sluice_topology::Processor<String, String> for Scribbler {
    type OutKey = String;
    type OutValue = String;
    type Output = ();

    fn process(
        &mut self,
        r: sluice_topology::Record<String, String>,
        ctx: &mut sluice_topology::ProcessorContext<'_, String, String, ()>,
    ) -> Result<(), sluice_topology::ProcessError> {
        ctx.forward(r)
    }

    fn punctuate(
        &mut self,
        _: sluice_topology::Punctuation,
        ctx: &mut sluice_topology::ProcessorContext<'_, String, String, ()>,
    ) -> Result<(), sluice_topology::ProcessError> {
        let mut scratch = ctx.kv::<u64, u64>("scratch")?;
        for _ in 0..self.per_tick {
            scratch.put(&self.next, &self.next);
            self.next += 1;
        }
        Ok(())
    }
}

/// A store without changelog that punctuation fills while no offset moves
/// still reaches RocksDB at the commits: its write cache empties, and the
/// task keeps taking records (a task whose write cache is full takes none
/// until a commit empties it).
#[test]
fn a_store_without_changelog_filled_by_punctuation_never_stalls_its_task() {
    let (input, output, app) = (unique("scr-in"), unique("scr-out"), unique("scr-app"));
    create(&[(&input, 1), (&output, 1)]);
    let b = StreamBuilder::new();
    b.add_kv_store("scratch", false);
    b.stream(&[&input], StringCodec, StringCodec)
        .process("scribbler", &["scratch"], || Scribbler {
            per_tick: 50,
            next: 0,
        })
        .to(&output, StringCodec, StringCodec);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StreamsConfig::new(&app, &bootstrap(), dir.path());
    cfg.guarantee = Guarantee::ExactlyOnce;
    cfg.session_timeout = Duration::from_secs(6);
    cfg.cache_max_entries = 100;
    let metrics = EngineMetrics::unregistered();
    let running = StreamsApp::new(b.build().unwrap(), cfg, metrics.clone())
        .start()
        .unwrap();
    // Punctuation fills the store past the bound before any record comes.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !running.status().is_ready() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    let producer = producer();
    for i in 0..500 {
        let v = i.to_string();
        producer
            .send(BaseRecord::<str, str>::to(&input).key(&v).payload(&v))
            .map_err(|(e, _)| e)
            .unwrap();
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics.records_out() < 500 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    running.shutdown();
    running.join().unwrap();
    assert_eq!(metrics.records_out(), 500, "every record went through");
}

/// A per-key count of `inputs` (one stream), every update out as
/// `key → count`.
fn key_count(inputs: &[&str], output: &str) -> sluice_topology::Topology {
    let b = StreamBuilder::new();
    b.stream(inputs, StringCodec, StringCodec)
        .group_by_key()
        .emit_on_update()
        .count("counts")
        .to_stream()
        .to(output, StringCodec, JsonCodec::<u64>::default());
    b.build().unwrap()
}

/// The latest count per key of a `key_count` output (read committed), once
/// `done` says so.
fn latest_key_counts(
    topic: &str,
    done: impl Fn(&BTreeMap<String, u64>) -> bool,
) -> BTreeMap<String, u64> {
    let c = committed_reader(&[("auto.offset.reset", "earliest")]);
    c.subscribe(&[topic]).unwrap();
    let mut latest = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline && !done(&latest) {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(200)) {
            let k = String::from_utf8(m.key().unwrap().to_vec()).unwrap();
            let v: u64 = serde_json::from_slice(m.payload().unwrap()).unwrap();
            latest.insert(k, v);
        }
    }
    latest
}

fn run_key_count(app: &str, input: &str, output: &str, dir: &std::path::Path, until: u64) {
    let mut cfg = StreamsConfig::new(app, &bootstrap(), dir);
    cfg.guarantee = Guarantee::ExactlyOnce;
    cfg.session_timeout = Duration::from_secs(6);
    let metrics = EngineMetrics::unregistered();
    let running = StreamsApp::new(key_count(&[input], output), cfg, metrics.clone())
        .start()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics.records_in() < until && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    running.shutdown();
    running.join().unwrap();
    assert_eq!(metrics.records_in(), until, "records processed by this run");
}

/// Under exactly-once a task's outputs are readable once its transaction
/// commits. An instance with no fetched record left to process commits the
/// outputs it holds after a quarter of the commit interval rather than the
/// whole one (at light load a caller waits for a result, not for the
/// interval): with a 40 s interval, a count's updates are readable long
/// before the first interval ends.
#[test]
fn an_instance_with_nothing_left_to_process_commits_held_outputs_early() {
    let (input, output, app) = (unique("early-in"), unique("early-out"), unique("early-app"));
    create(&[(&input, 1), (&output, 1)]);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StreamsConfig::new(&app, &bootstrap(), dir.path());
    cfg.guarantee = Guarantee::ExactlyOnce;
    cfg.session_timeout = Duration::from_secs(6);
    let interval = Duration::from_secs(40);
    cfg.commit_interval = Some(interval);
    let metrics = EngineMetrics::unregistered();
    let started = Instant::now();
    let running = StreamsApp::new(key_count(&[&input], &output), cfg, metrics.clone())
        .start()
        .unwrap();
    let producer = producer();
    for key in ["k0", "k1", "k2"] {
        producer
            .send(BaseRecord::<str, str>::to(&input).key(key).payload("x"))
            .map_err(|(e, _)| e)
            .unwrap();
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    let latest = latest_key_counts(&output, |m| m.len() == 3);
    let readable_after = started.elapsed();
    running.shutdown();
    running.join().unwrap();
    let want: BTreeMap<String, u64> = ["k0", "k1", "k2"]
        .into_iter()
        .map(|k| (k.to_string(), 1))
        .collect();
    assert_eq!(latest, want);
    assert!(
        readable_after < interval * 3 / 4,
        "the counts became readable {readable_after:?} after the start: held for the {interval:?} commit interval"
    );
}

/// Instances of one group running different topologies, as during a rolling
/// update that adds an input topic (a task type) to a sub-topology: the
/// group's assignor gives the topic only the newer instance reads to it
/// alone, and the older one's topic to both, so the newer is given tasks
/// of which the older runs the other partition. Such a task waits for its
/// missing partition (never two instances run one task: at-least-once, two
/// writers of one changelog) and does not hold the instance's readiness
/// back; once the older instance leaves, it restores what the older one
/// counted and counts the rest.
#[test]
fn a_task_assigned_without_all_its_partitions_waits_for_them() {
    two_topologies_in_one_group(false, Guarantee::AtLeastOnce, GroupProtocol::Consumer);
}

/// The same under exactly-once (where two instances running one task
/// would fence each other in turn).
#[test]
fn a_task_assigned_without_all_its_partitions_waits_for_them_exactly_once() {
    two_topologies_in_one_group(false, Guarantee::ExactlyOnce, GroupProtocol::Consumer);
}

/// The same under the classic protocol's eager rebalances, the newer
/// instance first: a suspended task given back without all its partitions
/// does not resume, and waits.
#[test]
fn a_suspended_task_given_back_in_part_waits_for_the_rest() {
    two_topologies_in_one_group(true, Guarantee::AtLeastOnce, GroupProtocol::Classic);
}

/// The same with the newer instance first: it runs every task whole until
/// the older one joins and takes half of the older topic's partitions.
/// Those tasks close after their commit; the partitions of them that stay
/// are read again from their commit once the others come back, not left
/// assigned and unread.
#[test]
fn a_task_whose_partitions_are_revoked_in_part_waits_for_them() {
    two_topologies_in_one_group(true, Guarantee::AtLeastOnce, GroupProtocol::Consumer);
}

fn two_topologies_in_one_group(newer_first: bool, guarantee: Guarantee, protocol: GroupProtocol) {
    let (a, b, output) = (unique("mix-a"), unique("mix-b"), unique("mix-out"));
    let app = unique("mix-app");
    create(&[(&a, 4), (&b, 4), (&output, 4)]);
    let start = |inputs: &[&str], dir: &std::path::Path| {
        let mut cfg = StreamsConfig::new(&app, &bootstrap(), dir);
        cfg.guarantee = guarantee;
        cfg.group_protocol = protocol;
        cfg.session_timeout = Duration::from_secs(6);
        let metrics = EngineMetrics::unregistered();
        let running = StreamsApp::new(key_count(inputs, &output), cfg, metrics.clone())
            .start()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !running.status().is_ready() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            running.status().is_ready(),
            "{:?}",
            running.status().state()
        );
        (running, metrics)
    };
    // 40 keys, key `k{j}` on partition j % 4 of both topics, 10 records of
    // each key on each, in two halves.
    let producer = producer();
    let send = |from: i32| {
        for topic in [&a, &b] {
            for i in from..from + 200 {
                let key = format!("k{}", i % 40);
                producer
                    .send(
                        BaseRecord::<str, str>::to(topic)
                            .key(&key)
                            .payload("x")
                            .partition(i % 4),
                    )
                    .map_err(|(e, _)| e)
                    .unwrap();
            }
        }
        producer.flush(Duration::from_secs(30)).unwrap();
    };
    let until = |n: &dyn Fn() -> u64, want: u64| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while n() < want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        // Then nothing more.
        std::thread::sleep(Duration::from_secs(3));
    };
    let (older_dir, newer_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ((older, older_metrics), (newer, newer_metrics), newer_alone) = if newer_first {
        // The first half, the newer instance alone: every task whole.
        let (newer, metrics) = start(&[&a, &b], newer_dir.path());
        send(0);
        until(&|| metrics.records_in(), 400);
        assert_eq!(metrics.records_in(), 400);
        (start(&[&a], older_dir.path()), (newer, metrics), 400)
    } else {
        let older = start(&[&a], older_dir.path());
        let newer = start(&[&a, &b], newer_dir.path());
        send(0);
        (older, newer, 0)
    };
    send(200);
    // Both instances read `a` (two partitions each); the newer alone reads
    // `b`: its partitions whose `a` partition the older holds wait.
    let older_half = if newer_first { 100 } else { 200 };
    let counted = || older_metrics.records_in() + newer_metrics.records_in();
    until(&counted, newer_alone + 3 * older_half);
    assert_eq!(
        (older_metrics.records_in(), newer_metrics.records_in()),
        (older_half, newer_alone + 2 * older_half),
        "each `a` record once; `b` only where the newer instance has the whole task"
    );
    older.shutdown();
    older.join().unwrap();
    let want: BTreeMap<String, u64> = (0..40).map(|k| (format!("k{k}"), 20)).collect();
    let latest = latest_key_counts(&output, |m| m == &want);
    newer.shutdown();
    newer.join().unwrap();
    assert_eq!(latest, want, "every key counted over both topics, once");
}

/// Offsets reset on purpose (as `kafka-consumer-groups --reset-offsets`
/// does, while the application is stopped) are obeyed: the restarted task
/// processes those records again, although its progress record says it
/// did, and its local state stays as it was.
#[test]
fn an_offset_reset_on_purpose_reprocesses_the_records() {
    let (input, output, app) = (unique("rst-in"), unique("rst-out"), unique("rst-app"));
    create(&[(&input, 1), (&output, 1)]);
    let producer = producer();
    for i in 0..300 {
        let key = format!("k{}", i % 3);
        producer
            .send(BaseRecord::<str, str>::to(&input).key(&key).payload("x"))
            .map_err(|(e, _)| e)
            .unwrap();
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    run_key_count(&app, &input, &output, dir.path(), 300);
    // Back to offset 100, as the reset tool commits it.
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("group.id", &app)
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&input, 0, Offset::Offset(100))
        .unwrap();
    c.commit(&tpl, rdkafka::consumer::CommitMode::Sync).unwrap();
    drop(c);
    run_key_count(&app, &input, &output, dir.path(), 200);
    let latest = latest_key_counts(&output, |m| m.values().sum::<u64>() == 500);
    let mut want: BTreeMap<String, u64> = BTreeMap::new();
    for i in (0..300).chain(100..300) {
        *want.entry(format!("k{}", i % 3)).or_default() += 1;
    }
    assert_eq!(latest, want, "records 100..300 counted again");
}

/// Repartition topics keep their records until they are consumed: no
/// retention by time, and what the reading task committed is deleted.
#[test]
fn repartition_topics_keep_records_until_consumed_then_drop_them() {
    let (input, output, app) = (unique("rp-in"), unique("rp-out"), unique("rp-app"));
    create(&[(&input, 2), (&output, 2)]);
    let producer = producer();
    for i in 0..1_000 {
        let v = format!("v{i}");
        producer
            .send(BaseRecord::<str, str>::to(&input).key(&v).payload(&v))
            .map_err(|(e, _)| e)
            .unwrap();
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    let b = StreamBuilder::new();
    b.stream(&[&input], StringCodec, StringCodec)
        .group_by(|r| format!("{}", r.value.len()))
        .count("by-length")
        .to_stream()
        .to(&output, StringCodec, JsonCodec::<u64>::default());
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StreamsConfig::new(&app, &bootstrap(), dir.path());
    cfg.guarantee = Guarantee::ExactlyOnce;
    cfg.session_timeout = Duration::from_secs(6);
    cfg.repartition_purge_interval = Duration::from_millis(500);
    let metrics = EngineMetrics::unregistered();
    let running = StreamsApp::new(b.build().unwrap(), cfg, metrics.clone())
        .start()
        .unwrap();
    let repartition = format!("{app}-by-length-repartition");
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .unwrap();
    // Once every record went through, each partition of the repartition
    // topic starts where the reading task committed (nothing it read is
    // kept).
    let group: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("group.id", &app)
        .create()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let seen = loop {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&repartition, 0);
        tpl.add_partition(&repartition, 1);
        let committed: Vec<i64> = group
            .committed_offsets(tpl, Duration::from_secs(5))
            .unwrap()
            .elements()
            .iter()
            .map(|e| match e.offset() {
                Offset::Offset(o) => o,
                _ => 0,
            })
            .collect();
        let low: Vec<i64> = (0..2)
            .map(|p| {
                c.fetch_watermarks(&repartition, p, Duration::from_secs(5))
                    .unwrap()
                    .0
            })
            .collect();
        let done = metrics.records_in() == 2_000
            && committed.iter().sum::<i64>() >= 1_000
            && low == committed;
        if done || Instant::now() > deadline {
            break (low, committed);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    running.shutdown();
    running.join().unwrap();
    assert_eq!(
        metrics.records_in(),
        2_000,
        "each record read twice: input and repartition"
    );
    assert_eq!(
        seen.0, seen.1,
        "the repartition topic starts where its reader committed"
    );
    assert!(seen.1.iter().sum::<i64>() >= 1_000, "{seen:?}");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .unwrap();
    let resource = rdkafka::admin::ResourceSpecifier::Topic(&repartition);
    let configs =
        futures::executor::block_on(admin.describe_configs([&resource], &AdminOptions::new()))
            .unwrap();
    let config = configs[0].as_ref().unwrap();
    let retention = config.get("retention.ms").and_then(|e| e.value.clone());
    assert_eq!(retention.as_deref(), Some("-1"), "kept until consumed");
}

/// Offsets of the committed records of partition 0 of `topic`, to its end.
fn record_offsets(topic: &str) -> Vec<i64> {
    let c = committed_reader(&[("enable.partition.eof", "true")]);
    assign_from_start(&c, topic, 1);
    let mut offsets = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        match c.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => offsets.push(m.offset()),
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(_))) => return offsets,
            _ => {}
        }
    }
    panic!("{topic} not read to its end");
}

/// A store restored from nothing (a new instance, no local state) reads its
/// changelog from the start, and when retention has deleted that start (a
/// window store's changelog is `compact,delete`) from where the changelog
/// now begins: what is left is restored, and the task becomes ready.
/// Starts the windowed count of `input` to `output` under exactly-once, its
/// state in `dir`.
fn start_count_exactly_once(
    app: &str,
    input: &str,
    output: &str,
    dir: &std::path::Path,
) -> (sluice_topology::runtime::RunningApp, EngineMetrics) {
    let mut cfg = StreamsConfig::new(app, &bootstrap(), dir);
    cfg.guarantee = Guarantee::ExactlyOnce;
    cfg.session_timeout = Duration::from_secs(6);
    let metrics = EngineMetrics::unregistered();
    let running = StreamsApp::new(windowed_count(input, output), cfg, metrics.clone())
        .start()
        .unwrap();
    (running, metrics)
}

/// A restore from nothing of more records than a write batch takes (applied
/// by ingesting a table file) gives every count back: the restoring
/// instance goes on counting from them.
#[test]
fn a_large_restore_gives_back_every_count() {
    let (input, output, app) = (unique("big-in"), unique("big-out"), unique("big-app"));
    create(&[(&input, 1), (&output, 1)]);
    let producer = producer();
    let keys = 6_000i64;
    let base = 1_700_000_000_000i64;
    let send = || {
        for i in 0..keys {
            producer
                .send(
                    BaseRecord::<str, str>::to(&input)
                        .key(&format!("k{i}"))
                        .payload("x")
                        .timestamp(base + i),
                )
                .map_err(|(e, _)| e)
                .unwrap();
        }
        producer.flush(Duration::from_secs(30)).unwrap();
    };
    let start = |dir: &std::path::Path| start_count_exactly_once(&app, &input, &output, dir);
    send();
    let first = tempfile::tempdir().unwrap();
    let (running, metrics) = start(first.path());
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics.records_in() < keys as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    running.shutdown();
    running.join().unwrap();
    assert_eq!(metrics.records_in(), keys as u64);

    // Another instance, nothing local: it restores every count first.
    let second = tempfile::tempdir().unwrap();
    let (running, metrics) = start(second.path());
    let deadline = Instant::now() + Duration::from_secs(60);
    while !running.status().is_ready() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        metrics.restored_records() >= keys as u64,
        "{} restored",
        metrics.restored_records()
    );
    send();
    let window = base - base.rem_euclid(60_000);
    let expected: BTreeMap<(i64, String), u64> =
        (0..keys).map(|i| ((window, format!("k{i}")), 2)).collect();
    let got = read_all(&output, 1, |m| m == &expected);
    running.shutdown();
    running.join().unwrap();
    let wrong: Vec<_> = got.iter().filter(|(_, n)| **n != 2).take(5).collect();
    assert_eq!(got.len(), expected.len(), "counts of {wrong:?}");
    assert!(wrong.is_empty(), "counts not carried over: {wrong:?}");
}

#[test]
fn a_restore_from_nothing_starts_where_retention_left_the_changelog() {
    let (input, output, app) = (unique("ret-in"), unique("ret-out"), unique("ret-app"));
    create(&[(&input, 1), (&output, 1)]);
    let producer = producer();
    let base = 1_700_000_000_000i64;
    for i in 0..600i64 {
        // Three keys over ten one-minute windows, sent in two halves so the
        // changelog holds records of more than one commit.
        let key = format!("k{}", i % 3);
        producer
            .send(
                BaseRecord::<str, str>::to(&input)
                    .key(&key)
                    .payload("x")
                    .timestamp(base + i * 1_000),
            )
            .map_err(|(e, _)| e)
            .unwrap();
        if i == 299 {
            producer.flush(Duration::from_secs(30)).unwrap();
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    let start = |dir: &std::path::Path| start_count_exactly_once(&app, &input, &output, dir);
    let first = tempfile::tempdir().unwrap();
    let (running, metrics) = start(first.path());
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics.records_in() < 600 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    running.shutdown();
    running.join().unwrap();
    assert_eq!(metrics.records_in(), 600);

    let counts = format!("{app}-counts-changelog");
    let progress = format!("{app}-sluice-progress-0-changelog");
    let written = record_offsets(&counts);
    assert!(
        written.len() >= 10,
        "one record per window at least: {written:?}"
    );
    // Retention deletes the first half of the counts' changelog.
    let cut = written[written.len() / 2];
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .unwrap();
    let mut below = TopicPartitionList::new();
    below
        .add_partition_offset(&counts, 0, Offset::Offset(cut))
        .unwrap();
    futures::executor::block_on(admin.delete_records(&below, &AdminOptions::new())).unwrap();
    let left = record_offsets(&counts);
    assert_eq!(left.first(), Some(&cut), "the changelog starts at the cut");
    // Read before the second instance starts: its clean stop commits a
    // progress record of its own.
    let progress_left = record_offsets(&progress);

    let second = tempfile::tempdir().unwrap();
    let (running, metrics) = start(second.path());
    let deadline = Instant::now() + Duration::from_secs(60);
    while !running.status().is_ready() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let ready = running.status().is_ready();
    running.shutdown();
    running.join().unwrap();
    assert!(ready, "the restoring instance never became ready");
    assert_eq!(
        metrics.restored_records(),
        (left.len() + progress_left.len()) as u64,
        "every record left in the two changelogs restored, none twice"
    );
}
