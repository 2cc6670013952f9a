//! Crashes and restarts in process: the test driver drops everything since the
//! last commit, restores the stores from the changelogs and replays the input
//! from the committed offsets, as the runtime does. Random completion orders,
//! commits and crashes — often two in a row, the second soon after the
//! restart — must give exact results, judged by every output record a
//! `read_committed` reader sees, under both guarantees.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Display;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_topology::runtime::Guarantee;
use sluice_topology::{
    CommitStep, Data, JsonCodec, KStream, OutputRecord, ProcessError, Processor, ProcessorContext,
    Record, StreamBuilder, StringCodec, TimeWindows, TopologyTestDriver, Windowed,
};
use tokio::sync::oneshot;

mod common;

const WAIT: Duration = Duration::from_secs(10);

/// The gates of records whose async call waits for the test to release it,
/// by `key/value` (unique per record in every shape).
type Gates = Arc<Mutex<BTreeMap<String, oneshot::Sender<()>>>>;

/// Holds each record in an async call until the test opens its gate, then
/// forwards it unchanged: the test decides the completion order.
struct Gated {
    gates: Gates,
}

impl<V: Data + Display> Processor<String, V> for Gated {
    type OutKey = String;
    type OutValue = V;
    type Output = Record<String, V>;

    fn process(
        &mut self,
        r: Record<String, V>,
        ctx: &mut ProcessorContext<'_, String, V, Self::Output>,
    ) -> Result<(), ProcessError> {
        let (tx, rx) = oneshot::channel();
        self.gates
            .lock()
            .insert(format!("{}/{}", r.key, r.value), tx);
        ctx.spawn(async move {
            let _ = rx.await;
            r
        });
        Ok(())
    }

    fn complete(
        &mut self,
        r: Record<String, V>,
        ctx: &mut ProcessorContext<'_, String, V, Self::Output>,
    ) -> Result<(), ProcessError> {
        ctx.forward(r)
    }
}

/// The topologies under test.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Shape {
    /// (a) A per-key count in one-minute windows (cached results).
    WindowedCount,
    /// (b) Async, out of order, into a per-key count in the same sub-topology.
    AsyncCount,
    /// (c) A per-key count forwarding every update into an async step.
    CountThenAsync,
    /// (d) Two inputs merged into one per-key count.
    MergedCount,
    /// (e) A cached per-key count (results at each commit) into an async step.
    CachedCountThenAsync,
    /// Async, out of order, straight to the output (no state).
    AsyncEcho,
}

impl Shape {
    fn inputs(self) -> &'static [&'static str] {
        match self {
            Shape::MergedCount => &["in-a", "in-b"],
            _ => &["in"],
        }
    }

    fn gated(self) -> bool {
        !matches!(self, Shape::WindowedCount | Shape::MergedCount)
    }

    fn build(self, gates: &Gates, guarantee: Guarantee) -> TopologyTestDriver {
        let b = StreamBuilder::new();
        let count_out = (StringCodec, JsonCodec::<u64>::default());
        let gated = || {
            let gates = gates.clone();
            move || Gated {
                gates: gates.clone(),
            }
        };
        match self {
            Shape::WindowedCount => {
                b.stream(&["in"], StringCodec, StringCodec)
                    .group_by_key()
                    .windowed_by(TimeWindows::tumbling(Duration::from_secs(60)))
                    .count("counts")
                    .to_stream()
                    .to(
                        "out",
                        JsonCodec::<Windowed<String>>::default(),
                        JsonCodec::<u64>::default(),
                    );
            }
            Shape::AsyncCount => {
                b.stream(&["in"], StringCodec, StringCodec)
                    .process("gated", &[], gated())
                    .group_by_key()
                    .count("counts")
                    .to_stream()
                    .to("out", count_out.0, count_out.1);
            }
            Shape::CountThenAsync | Shape::CachedCountThenAsync => {
                let grouped = b.stream(&["in"], StringCodec, StringCodec).group_by_key();
                let grouped = match self {
                    Shape::CountThenAsync => grouped.emit_on_update(),
                    _ => grouped,
                };
                grouped
                    .count("counts")
                    .to_stream()
                    .process("gated", &[], gated())
                    .to("out", count_out.0, count_out.1);
            }
            Shape::MergedCount => {
                let a = b.stream(&["in-a"], StringCodec, StringCodec);
                let c = b.stream(&["in-b"], StringCodec, StringCodec);
                a.merge(&c).group_by_key().count("counts").to_stream().to(
                    "out",
                    count_out.0,
                    count_out.1,
                );
            }
            Shape::AsyncEcho => {
                b.stream(&["in"], StringCodec, StringCodec)
                    .process("gated", &[], gated())
                    .to("out", StringCodec, StringCodec);
            }
        }
        TopologyTestDriver::with_guarantee(b.build().unwrap(), guarantee).unwrap()
    }
}

/// What a run fed in.
struct Fed {
    /// (key, window start) → records.
    per_key: HashMap<(String, i64), u64>,
    values: Vec<String>,
}

/// Decodes an output record into its counting key and its count (or, for the
/// echo, its value).
fn decode(shape: Shape, r: &OutputRecord) -> ((String, i64), String) {
    let key = r.key.as_deref().unwrap();
    let value = String::from_utf8(r.value.clone().unwrap()).unwrap();
    match shape {
        Shape::WindowedCount => {
            let w: Windowed<String> = serde_json::from_slice(key).unwrap();
            ((w.key, w.window.start), value)
        }
        _ => ((String::from_utf8(key.to_vec()).unwrap(), 0), value),
    }
}

/// Every output record, per key, in the order written.
fn sequences(shape: Shape, out: &[OutputRecord]) -> BTreeMap<(String, i64), Vec<u64>> {
    let mut seqs: BTreeMap<(String, i64), Vec<u64>> = BTreeMap::new();
    for r in out {
        let (key, v) = decode(shape, r);
        seqs.entry(key).or_default().push(v.parse().unwrap());
    }
    seqs
}

/// Exactly-once, judged by every committed output record: per key, the counts
/// appear once each and (in order, or — behind an async step, where they
/// finish out of order — as a set) reach exactly the input count; an update
/// forwarded into an async step is answered once for every update; the echo
/// emits each value once.
fn check_exactly_once(shape: Shape, out: &[OutputRecord], fed: &Fed, what: &str) {
    if shape == Shape::AsyncEcho {
        let mut seen: HashMap<String, u32> = HashMap::new();
        for r in out {
            *seen.entry(decode(shape, r).1).or_default() += 1;
        }
        for v in &fed.values {
            assert_eq!(seen.get(v), Some(&1), "{what}: value {v} emitted {seen:?}");
        }
        assert_eq!(seen.len(), fed.values.len(), "{what}: extra outputs");
        return;
    }
    let seqs = sequences(shape, out);
    assert_eq!(
        seqs.keys().collect::<Vec<_>>(),
        fed.per_key
            .keys()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>(),
        "{what}: keys"
    );
    for (key, counts) in &seqs {
        let want = fed.per_key[key];
        match shape {
            Shape::CountThenAsync | Shape::CachedCountThenAsync => {
                let mut sorted = counts.clone();
                sorted.sort_unstable();
                let mut unique = sorted.clone();
                unique.dedup();
                assert_eq!(sorted, unique, "{what}: {key:?} answered twice: {counts:?}");
                assert_eq!(sorted.last(), Some(&want), "{what}: {key:?} {counts:?}");
                if shape == Shape::CountThenAsync {
                    assert_eq!(sorted, (1..=want).collect::<Vec<_>>(), "{what}: {key:?}");
                }
            }
            _ => {
                assert!(
                    counts.windows(2).all(|w| w[0] < w[1]),
                    "{what}: {key:?} counts not strictly increasing: {counts:?}"
                );
                assert_eq!(counts.last(), Some(&want), "{what}: {key:?} {counts:?}");
            }
        }
    }
}

/// At-least-once, judged by every output record: outputs may repeat after a
/// crash, but no record is applied twice (no count ever goes above the
/// input count) and none is lost (the last count is the input count; every
/// update behind an async step, and every echoed value, is answered).
fn check_at_least_once(shape: Shape, out: &[OutputRecord], fed: &Fed, what: &str) {
    if shape == Shape::AsyncEcho {
        let seen: std::collections::HashSet<String> =
            out.iter().map(|r| decode(shape, r).1).collect();
        for v in &fed.values {
            assert!(seen.contains(v), "{what}: value {v} lost");
        }
        return;
    }
    for (key, counts) in sequences(shape, out) {
        let want = fed.per_key[&key];
        let over: Vec<&u64> = counts.iter().filter(|c| **c > want).collect();
        assert!(over.is_empty(), "{what}: {key:?} counted twice: {counts:?}");
        match shape {
            Shape::CountThenAsync => {
                for n in 1..=want {
                    assert!(
                        counts.contains(&n),
                        "{what}: {key:?} update {n} lost: {counts:?}"
                    );
                }
            }
            Shape::CachedCountThenAsync => {
                assert!(counts.contains(&want), "{what}: {key:?} {counts:?}");
            }
            _ => assert_eq!(counts.last(), Some(&want), "{what}: {key:?} {counts:?}"),
        }
    }
}

/// How a run crashes.
#[derive(Clone, Copy, Debug)]
enum Crash {
    /// Between commits (anywhere an instance can die).
    Anywhere,
    /// Inside an at-least-once commit, after this step.
    During(CommitStep),
}

/// Runs one random schedule: records fed one by one, gates opened in random
/// order, commits and crashes at random points — after a crash, often a
/// second one a few steps later; then everything finished and committed.
fn run(shape: Shape, guarantee: Guarantee, seed: u64, crash: Crash) -> (Vec<OutputRecord>, Fed) {
    let mut rng = StdRng::seed_from_u64(seed);
    let gates: Gates = Arc::default();
    let mut d = shape.build(&gates, guarantee);
    let mut fed = Fed {
        per_key: HashMap::new(),
        values: Vec::new(),
    };
    let total = 150;
    let mut crashes = 0;
    // Steps until a crash right after a restart, when one is due.
    let mut again: Option<u32> = None;
    while fed.values.len() < total || !gates.lock().is_empty() || d.pending_replay() > 0 {
        if let Some(n) = again.as_mut() {
            if *n == 0 {
                again = None;
                gates.lock().clear();
                d.crash_deferring_replay().unwrap();
                continue;
            }
            *n -= 1;
        }
        match rng.random_range(0..21) {
            0..=8 if fed.values.len() < total => {
                let i = fed.values.len();
                let key = format!("k{}", rng.random_range(0..4));
                let ts = 1_000 * i as i64;
                let topic = shape.inputs()[rng.random_range(0..shape.inputs().len())];
                let value = format!("v{i}");
                d.pipe(topic, &key, &value, &StringCodec, &StringCodec, ts)
                    .unwrap();
                let window = match shape {
                    Shape::WindowedCount => ts - ts % 60_000,
                    _ => 0,
                };
                *fed.per_key.entry((key, window)).or_default() += 1;
                fed.values.push(value);
            }
            9..=15 if shape.gated() => {
                let open = {
                    let mut g = gates.lock();
                    let keys: Vec<String> = g.keys().cloned().collect();
                    if keys.is_empty() {
                        None
                    } else {
                        g.remove(&keys[rng.random_range(0..keys.len())])
                    }
                };
                if let Some(tx) = open {
                    let _ = tx.send(());
                    assert_eq!(d.handle_completions(1, WAIT).unwrap(), 1);
                }
            }
            16..=17 => {
                d.commit().unwrap();
            }
            19 => {
                // A restarted instance reads its input again a bit at a time.
                d.replay(rng.random_range(1..40)).unwrap();
            }
            18 if crashes < 4 => {
                crashes += 1;
                // The calls in flight die with the instance; what the
                // restart runs again opens gates of its own.
                gates.lock().clear();
                match crash {
                    Crash::During(step) => d.crash_during_commit(step).unwrap(),
                    Crash::Anywhere => d.crash_deferring_replay().unwrap(),
                }
                if rng.random_bool(0.5) {
                    again = Some(rng.random_range(0..4));
                }
            }
            _ => {}
        }
    }
    // The last commit forwards cached results, which may go into calls of
    // their own: those finish and commit too.
    d.replay(usize::MAX).unwrap();
    loop {
        d.commit().unwrap();
        let open: Vec<oneshot::Sender<()>> =
            std::mem::take(&mut *gates.lock()).into_values().collect();
        if open.is_empty() {
            break;
        }
        let n = open.len();
        for tx in open {
            let _ = tx.send(());
        }
        assert_eq!(d.handle_completions(n, WAIT).unwrap(), n);
    }
    (d.committed_output("out"), fed)
}

const SEEDS: u64 = 40;

const SHAPES: [Shape; 6] = [
    Shape::WindowedCount,
    Shape::AsyncCount,
    Shape::CountThenAsync,
    Shape::MergedCount,
    Shape::CachedCountThenAsync,
    Shape::AsyncEcho,
];

/// Runs `seeds` random schedules of `shape` and checks each.
fn over_seeds(shape: Shape, guarantee: Guarantee, crash: Crash, seeds: u64) {
    for seed in 0..seeds {
        let (out, fed) = run(shape, guarantee, seed, crash);
        let what = format!("{shape:?} {guarantee:?} {crash:?} seed {seed}");
        match guarantee {
            Guarantee::ExactlyOnce => check_exactly_once(shape, &out, &fed, &what),
            Guarantee::AtLeastOnce => check_at_least_once(shape, &out, &fed, &what),
        }
    }
}

#[test]
fn exactly_once_is_exact_for_every_shape_under_any_completion_order_and_crash() {
    for shape in SHAPES {
        over_seeds(shape, Guarantee::ExactlyOnce, Crash::Anywhere, SEEDS);
    }
}

#[test]
fn at_least_once_applies_nothing_twice_and_loses_nothing_across_crashes() {
    for shape in SHAPES {
        over_seeds(shape, Guarantee::AtLeastOnce, Crash::Anywhere, SEEDS);
    }
}

/// At-least-once commits write the progress record after the changelog and
/// before the offsets: a crash after it applies nothing twice.
#[test]
fn at_least_once_crash_after_the_progress_record_applies_nothing_twice() {
    for shape in SHAPES {
        over_seeds(
            shape,
            Guarantee::AtLeastOnce,
            Crash::During(CommitStep::AfterProgress),
            SEEDS / 2,
        );
    }
}

/// A crash between the changelog and the progress record of an at-least-once
/// commit loses nothing. What it may do is the guarantee's: the state already
/// holds records the offsets and the progress record do not cover, and they
/// are applied again — so no key's last count is below its input count, and
/// that is all at-least-once promises here.
#[test]
fn at_least_once_crash_after_the_changelog_loses_nothing() {
    for shape in [Shape::AsyncCount, Shape::MergedCount, Shape::WindowedCount] {
        for seed in 0..SEEDS / 2 {
            let crash = Crash::During(CommitStep::AfterChangelog);
            let (out, fed) = run(shape, Guarantee::AtLeastOnce, seed, crash);
            let mut last: HashMap<(String, i64), u64> = HashMap::new();
            for r in &out {
                let (key, v) = decode(shape, r);
                last.insert(key, v.parse().unwrap());
            }
            for (key, n) in &fed.per_key {
                let got = last.get(key).copied().unwrap_or(0);
                assert!(got >= *n, "{shape:?} seed {seed}: {key:?} {got} < {n}");
            }
        }
    }
}

/// Counts `s` per key in one-minute windows, each window's count out to
/// `out` once it closes (no grace).
fn count_final_minutes(s: &KStream<String, String>) {
    s.group_by_key()
        .windowed_by(TimeWindows::tumbling(Duration::from_secs(60)))
        .emit_final()
        .count("counts")
        .to_stream()
        .to(
            "out",
            JsonCodec::<Windowed<String>>::default(),
            JsonCodec::<u64>::default(),
        );
}

/// Pipes value `v` with key `k` into `in` at `ts`.
fn pipe(d: &mut TopologyTestDriver, v: &str, ts: i64) {
    d.pipe(
        "in",
        &"k".to_string(),
        &v.to_string(),
        &StringCodec,
        &StringCodec,
        ts,
    )
    .unwrap();
}

/// Behind an async operator, whether a record is late for its window depends
/// on the stream time when it arrived (input order), never on when its call
/// ended: both completion orders give the same windows.
#[test]
fn late_record_decisions_do_not_depend_on_completion_order() {
    let run = |release_old_first: bool| {
        let gates: Gates = Arc::default();
        let b = StreamBuilder::new();
        let g = gates.clone();
        count_final_minutes(&b.stream(&["in"], StringCodec, StringCodec).process(
            "gated",
            &[],
            move || Gated { gates: g.clone() },
        ));
        let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
        // v0 at 10 s arrives first; v1 at 200 s closes its window (grace 0).
        for (v, ts) in [("v0", 10_000), ("v1", 200_000), ("v2", 400_000)] {
            pipe(&mut d, v, ts);
        }
        let order = if release_old_first {
            ["v0", "v1", "v2"]
        } else {
            ["v2", "v1", "v0"]
        };
        for v in order {
            let tx = gates.lock().remove(&format!("k/{v}")).unwrap();
            tx.send(()).unwrap();
            assert_eq!(d.handle_completions(1, WAIT).unwrap(), 1);
        }
        // A later record moves stream time on and closes what is done.
        pipe(&mut d, "v3", 600_000);
        let gate = gates.lock().remove("k/v3").unwrap();
        gate.send(()).unwrap();
        assert_eq!(d.handle_completions(1, WAIT).unwrap(), 1);
        d.commit().unwrap();
        let out: Vec<(Windowed<String>, u64)> = d
            .read_typed(
                "out",
                &JsonCodec::<Windowed<String>>::default(),
                &JsonCodec::<u64>::default(),
            )
            .unwrap();
        let mut windows: Vec<(i64, u64)> = out.iter().map(|(w, n)| (w.window.start, *n)).collect();
        windows.sort_unstable();
        (windows, d.counters().late_dropped)
    };
    let in_order = run(true);
    let reversed = run(false);
    assert_eq!(in_order, reversed);
    assert_eq!(
        in_order.0,
        vec![(0, 1), (180_000, 1)],
        "every record counted in its window, each closed window emitted once"
    );
    assert_eq!(in_order.1, 0, "nothing was late when it arrived");
}

/// A restarted task judges lateness by the stream time its state was
/// committed with, not by its first record's own time: a record for a window
/// that closed before the crash is late after it too.
#[test]
fn stream_time_is_restored_with_the_state() {
    let b = StreamBuilder::new();
    count_final_minutes(&b.stream(&["in"], StringCodec, StringCodec));
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    pipe(&mut d, "v0", 10_000);
    pipe(&mut d, "v1", 200_000); // closes [0, 60 s)
    d.commit().unwrap();
    d.crash().unwrap();
    pipe(&mut d, "late", 20_000); // for the closed window: late
    pipe(&mut d, "v2", 400_000); // closes [180 s, 240 s)
    d.commit().unwrap();
    let out: Vec<(Windowed<String>, u64)> = d
        .read_typed(
            "out",
            &JsonCodec::<Windowed<String>>::default(),
            &JsonCodec::<u64>::default(),
        )
        .unwrap();
    let windows: Vec<(i64, u64)> = out.iter().map(|(w, n)| (w.window.start, *n)).collect();
    assert_eq!(
        windows,
        vec![(0, 1), (180_000, 1)],
        "the closed window emitted once, unchanged"
    );
    assert_eq!(
        d.counters().late_dropped,
        1,
        "the record for the closed window was late"
    );
}

/// A record in an async call when its task crashed is judged, when read
/// again, by the stream time it arrived at, not by the later one the task
/// restarted with: which records count does not depend on a crash (and a
/// window it may still update does not close before it is read again).
#[test]
fn a_record_in_flight_at_a_crash_keeps_its_arrival_stream_time() {
    let gates: Gates = Arc::default();
    let g = gates.clone();
    let b = StreamBuilder::new();
    count_final_minutes(&b.stream(&["in"], StringCodec, StringCodec).process(
        "gated",
        &[],
        move || Gated { gates: g.clone() },
    ));
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    let open = |d: &mut TopologyTestDriver, v: &str| {
        let gate = gates.lock().remove(&format!("k/{v}")).expect("gated");
        gate.send(()).unwrap();
        assert_eq!(d.handle_completions(1, WAIT).unwrap(), 1);
    };
    pipe(&mut d, "v0", 10_000); // arrives at stream time 10 s
    pipe(&mut d, "v1", 200_000); // arrives at 200 s: both in their calls
    d.commit().unwrap();
    d.crash().unwrap(); // both read again, called again
    d.commit().unwrap(); // the window v0 belongs to must not close yet
    open(&mut d, "v1");
    open(&mut d, "v0");
    // Windows close as later records reach the count: v2 closes [0, 60 s),
    // v3 [180 s, 240 s).
    pipe(&mut d, "v2", 400_000);
    open(&mut d, "v2");
    pipe(&mut d, "v3", 600_000);
    open(&mut d, "v3");
    d.commit().unwrap();
    let windows: Vec<(i64, u64)> = d
        .committed_output("out")
        .iter()
        .map(|r| {
            let w: Windowed<String> = serde_json::from_slice(r.key.as_deref().unwrap()).unwrap();
            let n: u64 = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
            (w.window.start, n)
        })
        .collect();
    assert_eq!(
        windows,
        vec![(0, 1), (180_000, 1)],
        "each window counted its record, as without the crash"
    );
    assert_eq!(d.counters().late_dropped, 0, "no record was late");
}

/// [`Gated`] for string values, resumable: a commit may make its call the
/// record's resume point (see `Processor::resume`).
struct ResumableGate {
    gates: Gates,
}

impl ResumableGate {
    fn call(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, Record<String, String>>,
    ) {
        let (tx, rx) = oneshot::channel();
        self.gates
            .lock()
            .insert(format!("{}/{}", r.key, r.value), tx);
        let content = common::content_of(&r);
        ctx.spawn_resumable(content, async move {
            let _ = rx.await;
            r
        });
    }
}

impl Processor<String, String> for ResumableGate {
    type OutKey = String;
    type OutValue = String;
    type Output = Record<String, String>;

    fn process(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, Self::Output>,
    ) -> Result<(), ProcessError> {
        self.call(r, ctx);
        Ok(())
    }

    fn resume(
        &mut self,
        content: &[u8],
        ctx: &mut ProcessorContext<'_, String, String, Self::Output>,
    ) -> Result<(), ProcessError> {
        self.call(common::record_from(content)?, ctx);
        Ok(())
    }

    fn complete(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, Self::Output>,
    ) -> Result<(), ProcessError> {
        ctx.forward(r)
    }
}

/// Opens every gate, handling the completions.
fn open_all(d: &mut TopologyTestDriver, gates: &Gates) {
    let open: Vec<_> = std::mem::take(&mut *gates.lock()).into_values().collect();
    let n = open.len();
    for gate in open {
        gate.send(()).unwrap();
    }
    assert_eq!(d.handle_completions(n, WAIT).unwrap(), n);
}

/// Committed values of a topic, in order.
fn values(d: &TopologyTestDriver, topic: &str) -> Vec<String> {
    d.committed_output(topic)
        .iter()
        .map(|r| String::from_utf8(r.value.clone().unwrap()).unwrap())
        .collect()
}

#[test]
fn a_source_fanning_out_to_a_sink_and_an_async_step_commits_each_once_across_a_crash() {
    for guarantee in [Guarantee::ExactlyOnce, Guarantee::AtLeastOnce] {
        let gates: Gates = Arc::default();
        let g = gates.clone();
        let b = StreamBuilder::new();
        let s = b.stream(&["in"], StringCodec, StringCodec);
        s.to("copy", StringCodec, StringCodec);
        s.process("call", &[], move || ResumableGate { gates: g.clone() })
            .to("out", StringCodec, StringCodec);
        let mut d = TopologyTestDriver::with_guarantee(b.build().unwrap(), guarantee).unwrap();
        for i in 0..3 {
            pipe(&mut d, &format!("v{i}"), i);
        }
        // The copies commit while the calls run; the crash kills the calls.
        d.commit().unwrap();
        gates.lock().clear();
        d.crash().unwrap();
        open_all(&mut d, &gates);
        d.commit().unwrap();
        let want = vec!["v0", "v1", "v2"];
        assert_eq!(values(&d, "copy"), want, "{guarantee:?}: each copy once");
        let mut out = values(&d, "out");
        out.sort();
        assert_eq!(out, want, "{guarantee:?}: each call's output once");
    }
}

#[test]
fn an_aggregation_fanning_out_to_a_sink_and_an_async_step_counts_each_update_once() {
    let gates: Gates = Arc::default();
    let g = gates.clone();
    let b = StreamBuilder::new();
    let counts = b
        .stream(&["in"], StringCodec, StringCodec)
        .group_by_key()
        .emit_on_update()
        .count("counts")
        .to_stream()
        .map_values(|_, n: u64| n.to_string());
    counts.to("sync", StringCodec, StringCodec);
    counts
        .process("call", &[], move || ResumableGate { gates: g.clone() })
        .to("out", StringCodec, StringCodec);
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    for i in 0..3 {
        pipe(&mut d, &format!("v{i}"), i);
    }
    d.commit().unwrap();
    gates.lock().clear();
    d.crash().unwrap();
    open_all(&mut d, &gates);
    d.commit().unwrap();
    assert_eq!(values(&d, "sync"), vec!["1", "2", "3"], "each update once");
    let mut out = values(&d, "out");
    out.sort();
    assert_eq!(out, vec!["1", "2", "3"], "each update called once");
}
