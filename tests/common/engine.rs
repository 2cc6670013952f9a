//! The engine's example processes (`sluice example …`, which the tests can
//! kill) and what their tests read back and check: keyed records over
//! one-minute windows, every count read `read_committed`, two instances
//! sharing a topology's tasks, a group's committed offsets.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sluice::cli::demo::latest_counts;
use sluice::cli::example::Echo;
use sluice::kafka::{create_topics, read_topics, OutRecord};

use super::{bootstrap, eventually, unique, Proc};

pub const MINUTE: i64 = 60_000;

pub struct Example {
    pub kind: &'static str,
    pub app: String,
    pub input: String,
    pub output: String,
    pub extra: Vec<String>,
}

impl Example {
    /// A windowed count with an hour of grace (no record is late), its input
    /// and output topics created with `partitions` partitions.
    pub fn windowed_count(app: &str, guarantee: &str, partitions: i32) -> Self {
        let ex = Example {
            kind: "windowed-count",
            app: unique(app),
            input: unique("in"),
            output: unique("out"),
            extra: vec![
                "--guarantee".into(),
                guarantee.into(),
                "--grace-ms".into(),
                "3600000".into(),
            ],
        };
        create_topics(
            &bootstrap(),
            &[(&ex.input, partitions, &[]), (&ex.output, partitions, &[])],
        )
        .unwrap();
        ex
    }

    pub fn args(&self, state_dir: &std::path::Path) -> Vec<String> {
        let mut a: Vec<String> = [
            "example",
            self.kind,
            "--bootstrap",
            &bootstrap(),
            "--app-id",
            &self.app,
            "--input",
            &self.input,
            "--output",
            &self.output,
            "--state-dir",
            &state_dir.display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(self.extra.iter().cloned());
        a
    }

    pub fn spawn(&self, name: &str, state_dir: &std::path::Path) -> Proc {
        eprintln!(
            "[{name}] app {} input {} output {}",
            self.app, self.input, self.output
        );
        Proc::spawn(name, &self.args(state_dir))
    }
}

/// `n` keyed records over `keys` keys and `minutes` one-minute windows, in
/// timestamp order; returns them and the expected count per (window, key).
pub fn keyed_records(
    n: usize,
    keys: usize,
    minutes: i64,
    base: i64,
) -> (Vec<OutRecord>, BTreeMap<(i64, String), u64>) {
    let mut expected = BTreeMap::new();
    let recs = (0..n)
        .map(|i| {
            let key = format!("k{}", (i * 7919) % keys);
            let ts = base + (i as i64 * minutes * MINUTE) / n as i64;
            *expected
                .entry((ts - ts % MINUTE, key.clone()))
                .or_insert(0u64) += 1;
            OutRecord {
                key: Some(key.into_bytes()),
                value: Some(format!("{i}").into_bytes()),
                timestamp: Some(ts),
                ..Default::default()
            }
        })
        .collect();
    (recs, expected)
}

pub fn base_time() -> i64 {
    (chrono::Utc::now().timestamp_millis() / MINUTE - 60) * MINUTE
}

pub fn wait_counts(
    output: &str,
    expected: &BTreeMap<(i64, String), u64>,
    timeout: Duration,
) -> BTreeMap<(i64, String), u64> {
    latest_counts(&wait_outputs(output, expected, timeout)).unwrap()
}

/// Every record of `output` (read_committed) once each window's latest
/// count is the expected one.
pub fn wait_outputs(
    output: &str,
    expected: &BTreeMap<(i64, String), u64>,
    timeout: Duration,
) -> Vec<rdkafka::message::OwnedMessage> {
    read_topics(&bootstrap(), &[output], true, timeout, |m| {
        latest_counts(m).is_ok_and(|got| &got == expected)
    })
    .unwrap()
}

/// Checks every count read, not only the latest: per window, each count
/// appears once and they strictly increase (a record applied twice, or an
/// update emitted twice, breaks it), and the latest is the final one.
pub fn assert_each_window_count_once(
    msgs: &[rdkafka::message::OwnedMessage],
    expected: &BTreeMap<(i64, String), u64>,
) {
    let mut seen: BTreeMap<(i64, String), Vec<u64>> = BTreeMap::new();
    for m in msgs {
        let one = latest_counts(std::slice::from_ref(m)).unwrap();
        for (k, v) in one {
            seen.entry(k).or_default().push(v);
        }
    }
    for (window, want) in expected {
        let counts = seen.get(window).map(Vec::as_slice).unwrap_or_default();
        assert!(
            counts.windows(2).all(|w| w[0] < w[1]),
            "{window:?}: counts not strictly increasing: {counts:?}"
        );
        assert_eq!(counts.last(), Some(want), "{window:?}: {counts:?}");
    }
    assert_eq!(seen.len(), expected.len(), "windows nobody wrote to");
}

pub fn assert_counts_equal(
    got: &BTreeMap<(i64, String), u64>,
    expected: &BTreeMap<(i64, String), u64>,
) {
    if got != expected {
        let wrong: Vec<_> = expected
            .iter()
            .filter(|(k, v)| got.get(k) != Some(v))
            .take(10)
            .map(|(k, v)| format!("{k:?}: want {v}, got {:?}", got.get(k)))
            .collect();
        panic!(
            "{} of {} windows differ (got {} windows); first: {wrong:#?}",
            expected
                .iter()
                .filter(|(k, v)| got.get(k) != Some(v))
                .count(),
            expected.len(),
            got.len()
        );
    }
}

/// Starts instances A and B of an example and waits until they share its
/// four tasks, both ready, before any data flows.
pub fn two_instances(
    ex: &Example,
    dir_a: &tempfile::TempDir,
    dir_b: &tempfile::TempDir,
) -> (Proc, Proc) {
    let a = ex.spawn("A", dir_a.path());
    let b = ex.spawn("B", dir_b.path());
    eventually(
        Duration::from_secs(90),
        "partitions split between A and B",
        || (!a.tasks().is_empty() && !b.tasks().is_empty() && a.ready() && b.ready()).then_some(()),
    );
    let (ta, tb) = (a.tasks(), b.tasks());
    assert_eq!(ta.len() + tb.len(), 4, "A {ta:?} B {tb:?}");
    (a, b)
}

/// Waits until `a` owns all four tasks (it took over the other instance's:
/// fenced them, the broker aborted what they left open, and it restored
/// them).
pub fn takes_over_every_task(a: &Proc) {
    eventually(Duration::from_secs(120), "A owns every task", || {
        (a.tasks().len() == 4 && a.ready()).then_some(())
    });
}

/// Committed offsets of a group for a topic's partitions.
pub fn committed(group: &str, topic: &str, partitions: i32) -> HashMap<i32, i64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("group.id", group)
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    // A loaded broker may time a look-up out: asked again, up to three times.
    let got = (0..3)
        .find_map(|_| {
            consumer
                .committed_offsets(tpl.clone(), Duration::from_secs(10))
                .ok()
        })
        .expect("committed offsets within three tries of 10 s");
    got.elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) => Some((e.partition(), o)),
            _ => None,
        })
        .collect()
}

pub fn echoed(output: &str, read_committed: bool, expect: usize, timeout: Duration) -> Vec<String> {
    read_topics(&bootstrap(), &[output], read_committed, timeout, |m| {
        m.iter()
            .filter_map(|m| m.key())
            .collect::<HashSet<_>>()
            .len()
            >= expect
    })
    .unwrap()
    .iter()
    .map(|m| {
        serde_json::from_slice::<Echo>(m.payload().unwrap_or_default())
            .unwrap()
            .value
    })
    .collect()
}
