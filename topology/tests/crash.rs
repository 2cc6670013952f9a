//! Crashes and restarts in process: the test driver drops everything since the
//! last commit, restores the stores from the changelogs and replays the input
//! from the committed offsets. Random completion orders, commits and crash
//! points must give the same final state, and every output a `read_committed`
//! reader sees must be counted once.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_topology::{
    CommitStep, JsonCodec, OutputRecord, ProcessError, Processor, ProcessorContext, Record,
    StreamBuilder, StringCodec, TimeWindows, TopologyTestDriver, Windowed,
};
use tokio::sync::oneshot;

const WAIT: Duration = Duration::from_secs(10);

/// The gates of records whose async call waits for the test to release it,
/// by record value (each input value is unique).
type Gates = Arc<Mutex<BTreeMap<String, oneshot::Sender<()>>>>;

/// Holds each record in an async call until the test opens its gate, then
/// forwards it unchanged: the test decides the completion order.
struct Gated {
    gates: Gates,
}

impl Processor<String, String> for Gated {
    type OutKey = String;
    type OutValue = String;
    type Output = Record<String, String>;

    fn process(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, Self::Output>,
    ) -> Result<(), ProcessError> {
        let (tx, rx) = oneshot::channel();
        self.gates.lock().insert(r.value.clone(), tx);
        ctx.spawn(async move {
            let _ = rx.await;
            r
        });
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

/// The topologies under test.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// Async, out of order, into a per-key count in the same sub-topology.
    AsyncCount,
    /// Async, out of order, straight to the output (no state).
    AsyncEcho,
    /// A per-key count in one-minute windows.
    WindowedCount,
    /// Two inputs merged into one per-key count.
    MergedCount,
}

impl Shape {
    fn inputs(self) -> &'static [&'static str] {
        match self {
            Shape::MergedCount => &["in-a", "in-b"],
            _ => &["in"],
        }
    }

    fn gated(self) -> bool {
        matches!(self, Shape::AsyncCount | Shape::AsyncEcho)
    }

    fn build(self, gates: &Gates) -> TopologyTestDriver {
        let b = StreamBuilder::new();
        let count_out = (StringCodec, JsonCodec::<u64>::default());
        match self {
            Shape::AsyncCount => {
                let gates = gates.clone();
                b.stream(&["in"], StringCodec, StringCodec)
                    .process("gated", &[], move || Gated {
                        gates: gates.clone(),
                    })
                    .group_by_key()
                    .count("counts")
                    .to_stream()
                    .to("out", count_out.0, count_out.1);
            }
            Shape::AsyncEcho => {
                let gates = gates.clone();
                b.stream(&["in"], StringCodec, StringCodec)
                    .process("gated", &[], move || Gated {
                        gates: gates.clone(),
                    })
                    .to("out", StringCodec, StringCodec);
            }
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
            Shape::MergedCount => {
                let a = b.stream(&["in-a"], StringCodec, StringCodec);
                let c = b.stream(&["in-b"], StringCodec, StringCodec);
                a.merge(&c).group_by_key().count("counts").to_stream().to(
                    "out",
                    count_out.0,
                    count_out.1,
                );
            }
        }
        TopologyTestDriver::new(b.build().unwrap()).unwrap()
    }
}

/// What a run fed in: each record's key, window and value.
struct Fed {
    /// (key, window start) → records.
    per_key: HashMap<(String, i64), u64>,
    values: Vec<String>,
}

/// Decodes an output record into its counting key and its count (or, for the
/// echo, its value and 1).
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

/// Every committed output is counted: per key the counts appear once each,
/// strictly increasing, the last one equal to the input count (the echo: each
/// value exactly once).
fn check_exact(shape: Shape, out: &[OutputRecord], fed: &Fed, what: &str) {
    if let Shape::AsyncEcho = shape {
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
    let mut last: HashMap<(String, i64), u64> = HashMap::new();
    for r in out {
        let (key, v) = decode(shape, r);
        let n: u64 = v.parse().unwrap();
        let prev = last.insert(key.clone(), n).unwrap_or(0);
        assert!(n > prev, "{what}: {key:?} went from {prev} to {n}");
    }
    assert_eq!(last, fed.per_key, "{what}: final counts");
}

/// Runs one random schedule: records fed one by one, gates opened in random
/// order, commits and crashes at random points; then everything finished and
/// committed.
fn run(shape: Shape, seed: u64, crash_step: Option<CommitStep>) -> (Vec<OutputRecord>, Fed) {
    let mut rng = StdRng::seed_from_u64(seed);
    let gates: Gates = Arc::default();
    let mut d = shape.build(&gates);
    let mut fed = Fed {
        per_key: HashMap::new(),
        values: Vec::new(),
    };
    let total = 150;
    let mut crashes = 0;
    while fed.values.len() < total || !gates.lock().is_empty() {
        match rng.random_range(0..20) {
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
            18 if crashes < 4 => {
                crashes += 1;
                match crash_step {
                    Some(step) => d.crash_during_commit(step).unwrap(),
                    None => d.crash().unwrap(),
                }
            }
            _ => {}
        }
    }
    d.commit().unwrap();
    (d.committed_output("out"), fed)
}

const SEEDS: u64 = 40;

/// Runs `seeds` random schedules of `shape` (crashing at `step`, or between
/// commits) and checks each exactly.
fn exact_over_seeds(shape: Shape, step: Option<CommitStep>, seeds: u64) {
    for seed in 0..seeds {
        let (out, fed) = run(shape, seed, step);
        check_exact(shape, &out, &fed, &format!("{shape:?} seed {seed}"));
    }
}

#[test]
fn async_operator_into_a_count_is_exact_under_any_completion_order_and_crash() {
    exact_over_seeds(Shape::AsyncCount, None, SEEDS);
}

#[test]
fn async_operator_outputs_are_emitted_once_across_crashes() {
    exact_over_seeds(Shape::AsyncEcho, None, SEEDS);
}

#[test]
fn windowed_count_is_exact_across_crashes() {
    exact_over_seeds(Shape::WindowedCount, None, SEEDS);
}

#[test]
fn merged_inputs_are_counted_once_across_crashes() {
    exact_over_seeds(Shape::MergedCount, None, SEEDS);
}

/// At-least-once commits write the progress record after the changelog and
/// before the offsets: a crash after it loses nothing and counts nothing twice.
#[test]
fn at_least_once_crash_after_the_progress_record_is_exact() {
    for shape in [Shape::AsyncCount, Shape::MergedCount, Shape::WindowedCount] {
        exact_over_seeds(shape, Some(CommitStep::AfterProgress), SEEDS / 2);
    }
}

/// A crash between the changelog and the progress record of an at-least-once
/// commit loses nothing: every key's final count is at least its input count.
#[test]
fn at_least_once_crash_after_the_changelog_loses_nothing() {
    for shape in [Shape::AsyncCount, Shape::MergedCount, Shape::WindowedCount] {
        for seed in 0..SEEDS / 2 {
            let (out, fed) = run(shape, seed, Some(CommitStep::AfterChangelog));
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

/// Behind an async operator, whether a record is late for its window depends
/// on the stream time when it arrived (input order), never on when its call
/// ended: both completion orders give the same windows.
#[test]
fn late_record_decisions_do_not_depend_on_completion_order() {
    let run = |release_old_first: bool| {
        let gates: Gates = Arc::default();
        let b = StreamBuilder::new();
        let g = gates.clone();
        b.stream(&["in"], StringCodec, StringCodec)
            .process("gated", &[], move || Gated { gates: g.clone() })
            .group_by_key()
            .windowed_by(TimeWindows::tumbling(Duration::from_secs(60)))
            .emit_final()
            .count("counts")
            .to_stream()
            .to(
                "out",
                JsonCodec::<Windowed<String>>::default(),
                JsonCodec::<u64>::default(),
            );
        let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
        // v0 at 10 s arrives first; v1 at 200 s closes its window (grace 0).
        for (v, ts) in [("v0", 10_000), ("v1", 200_000), ("v2", 400_000)] {
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
        let order = if release_old_first {
            ["v0", "v1", "v2"]
        } else {
            ["v2", "v1", "v0"]
        };
        for v in order {
            let tx = gates.lock().remove(v).unwrap();
            tx.send(()).unwrap();
            assert_eq!(d.handle_completions(1, WAIT).unwrap(), 1);
        }
        // A later record moves stream time on and closes what is done.
        d.pipe(
            "in",
            &"k".to_string(),
            &"v3".to_string(),
            &StringCodec,
            &StringCodec,
            600_000,
        )
        .unwrap();
        let gate = gates.lock().remove("v3").unwrap();
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
