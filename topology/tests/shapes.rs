//! Exactly-once for every topology shape: a property test over random
//! topologies and random crash points, in process.
//!
//! Each case composes a topology at random from the DSL's parts — a source
//! fanning out, synchronous sinks beside async steps, two async stages, a
//! processor that writes its store before it spawns, an aggregation whose
//! updates go both to a sink and into an async step, repartitions, merged
//! sources — feeds it keyed records, opens the async calls' gates in a
//! random order, and commits and crashes at random points (a second crash
//! soon after a restart, often). The oracle is the same input through the
//! same topology without a crash: under exactly-once every sink's committed
//! output must equal it as a multiset per key; under at-least-once nothing
//! of it may be missing. A failing case prints its seed and its shape.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_topology::{
    Guarantee, InFlight, KStream, OutputRecord, ProcessError, Processor, ProcessorContext, Record,
    StreamBuilder, StringCodec, TimeWindows, TopologyTestDriver, Windowed,
};
use tokio::sync::oneshot;

mod common;

const WAIT: Duration = Duration::from_secs(10);

/// The gates of the calls in flight: each call waits for the test to open
/// its gate, so the test decides the completion order.
type Gates = Arc<Mutex<BTreeMap<u64, oneshot::Sender<()>>>>;

/// Numbers gates (unique across incarnations of a task).
static NEXT_GATE: AtomicU64 = AtomicU64::new(0);

/// What a gated step does besides passing its record on.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Gate {
    /// Nothing: an async pass-through.
    Pass,
    /// Its completion also emits the record to a topic of its own.
    EmitOnComplete,
    /// It counts the record in its key-value store, then spawns; the count
    /// goes on as the record's value.
    StoreThenSpawn,
}

impl Gated {
    /// Starts the call: it passes `r` on once its gate opens. A restart can
    /// start it again from the record (after the store write, if any).
    fn call(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, Record<String, String>>,
    ) {
        let (tx, rx) = oneshot::channel();
        self.gates
            .lock()
            .insert(NEXT_GATE.fetch_add(1, Ordering::Relaxed), tx);
        let content = common::content_of(&r);
        ctx.spawn_resumable(content, async move {
            let _ = rx.await;
            r
        });
    }
}

struct Gated {
    gates: Gates,
    kind: Gate,
    /// The topic `EmitOnComplete` writes, the store `StoreThenSpawn` keeps.
    name: String,
}

impl Processor<String, String> for Gated {
    type OutKey = String;
    type OutValue = String;
    type Output = Record<String, String>;

    fn process(
        &mut self,
        mut r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, Self::Output>,
    ) -> Result<(), ProcessError> {
        if self.kind == Gate::StoreThenSpawn {
            let mut store = ctx.kv::<String, u64>(&self.name)?;
            let n = store.get(&r.key)?.unwrap_or(0) + 1;
            store.put(&r.key, &n);
            r.value = format!("{}#{n}", r.value);
        }
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
        if self.kind == Gate::EmitOnComplete {
            ctx.emit(OutputRecord {
                topic: self.name.clone(),
                partition: None,
                key: Some(r.key.clone().into_bytes()),
                value: Some(r.value.clone().into_bytes()),
                timestamp: r.timestamp,
                headers: Vec::new(),
            })?;
        }
        ctx.forward(r)
    }
}

/// Holds records and forwards them from every second `flush` (so some
/// are held over a commit), outside of any input record (as a
/// micro-batcher's completion does).
#[derive(Default)]
struct Batcher {
    held: Vec<(InFlight, Record<String, String>)>,
    flushes: u64,
}

impl Batcher {
    fn keep(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, ()>,
    ) {
        let content = common::content_of(&r);
        if let Some(held) = ctx.hold_resumable(content) {
            self.held.push((held, r));
        }
    }
}

impl Processor<String, String> for Batcher {
    type OutKey = String;
    type OutValue = String;
    type Output = ();

    fn process(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, ()>,
    ) -> Result<(), ProcessError> {
        self.keep(r, ctx);
        Ok(())
    }

    fn resume(
        &mut self,
        content: &[u8],
        ctx: &mut ProcessorContext<'_, String, String, ()>,
    ) -> Result<(), ProcessError> {
        self.keep(common::record_from(content)?, ctx);
        Ok(())
    }

    fn flush(
        &mut self,
        ctx: &mut ProcessorContext<'_, String, String, ()>,
    ) -> Result<(), ProcessError> {
        self.flushes += 1;
        if self.flushes % 2 == 1 {
            return Ok(());
        }
        // Forwarded first, released after: each held record stays in
        // flight until what it became is on its way.
        let held = std::mem::take(&mut self.held);
        for (_, r) in &held {
            ctx.forward(r.clone())?;
        }
        drop(held);
        Ok(())
    }
}

/// A step of a random topology; its children each get every record it
/// passes on (a fan-out when there are two).
#[derive(Clone, Debug)]
enum Step {
    /// Writes to an output topic of its own (a leaf).
    Sink,
    /// Changes the value synchronously.
    Map(Vec<Step>),
    /// An async call (see [`Gate`]).
    Async(Gate, Vec<Step>),
    /// A per-key count, every update forwarded (its value the count).
    Count(Vec<Step>),
    /// Through a repartition topic into a sub-topology of its own.
    Repartition(Vec<Step>),
    /// A per-key count over tumbling 10 s windows (no grace: records late
    /// by the stream time they arrived at are dropped), every update
    /// forwarded, keyed `key@start`.
    Window(Vec<Step>),
    /// Holds records until the next commit, and forwards them from its
    /// flush: records a processor derives outside of an input record.
    Batch(Vec<Step>),
}

/// A random topology: the steps below its source (`in`), and whether a
/// second source (`in-b`) is merged into it first.
#[derive(Clone, Debug)]
struct Shape {
    merged: bool,
    steps: Vec<Step>,
}

/// What lies above a step, as far as which records a window drops as late
/// depends on it.
#[derive(Clone, Copy, Default)]
struct Above {
    /// An async step or a batch: records go on in completion order.
    reordered: bool,
    /// A repartition below a reordering: the next sub-topology reads its
    /// input in completion order, and its stream time follows that order.
    unordered: bool,
    /// A batch: a record its flush forwards is as late as the stream time
    /// at that flush, which depends on when commits happen.
    batched: bool,
}

impl Above {
    /// Whether a window's late records are the same in every run: not
    /// below a batch, nor below a repartition that reads in completion
    /// order (those are the shapes' own nondeterminism, crash or not).
    fn window_deterministic(self) -> bool {
        !self.batched && !self.unordered
    }
}

fn random_steps(rng: &mut StdRng, depth: u32, above: Above) -> Vec<Step> {
    let n = if rng.random_bool(0.35) { 2 } else { 1 };
    (0..n).map(|_| random_step(rng, depth, above)).collect()
}

fn random_step(rng: &mut StdRng, depth: u32, above: Above) -> Step {
    if depth == 0 || rng.random_bool(0.2) {
        return Step::Sink;
    }
    let reordered = Above {
        reordered: true,
        ..above
    };
    let below = |rng: &mut StdRng, above| random_steps(rng, depth - 1, above);
    match rng.random_range(0..11) {
        0 => Step::Map(below(rng, above)),
        1..=2 => Step::Async(Gate::Pass, below(rng, reordered)),
        3 => Step::Async(Gate::EmitOnComplete, below(rng, reordered)),
        4 => Step::Async(Gate::StoreThenSpawn, below(rng, reordered)),
        5 => Step::Count(below(rng, above)),
        6 if above.window_deterministic() => Step::Window(below(rng, above)),
        7 => Step::Repartition(below(
            rng,
            Above {
                unordered: above.reordered,
                ..above
            },
        )),
        8 => Step::Batch(below(
            rng,
            Above {
                batched: true,
                ..reordered
            },
        )),
        _ => Step::Sink,
    }
}

impl Shape {
    fn random(rng: &mut StdRng) -> Shape {
        Shape {
            merged: rng.random_bool(0.2),
            steps: random_steps(rng, 4, Above::default()),
        }
    }

    fn inputs(&self) -> &'static [&'static str] {
        if self.merged {
            &["in", "in-b"]
        } else {
            &["in"]
        }
    }

    /// A line of its steps, for a failing case's message.
    fn describe(&self) -> String {
        fn walk(steps: &[Step], out: &mut String) {
            out.push('[');
            for (i, s) in steps.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                match s {
                    Step::Sink => out.push_str("sink"),
                    Step::Map(k) => {
                        out.push_str("map ");
                        walk(k, out);
                    }
                    Step::Async(g, k) => {
                        let _ = write!(out, "async({g:?}) ");
                        walk(k, out);
                    }
                    Step::Count(k) => {
                        out.push_str("count ");
                        walk(k, out);
                    }
                    Step::Repartition(k) => {
                        out.push_str("repartition ");
                        walk(k, out);
                    }
                    Step::Window(k) => {
                        out.push_str("window ");
                        walk(k, out);
                    }
                    Step::Batch(k) => {
                        out.push_str("batch ");
                        walk(k, out);
                    }
                }
            }
            out.push(']');
        }
        let mut out = String::from(if self.merged { "merge " } else { "" });
        walk(&self.steps, &mut out);
        out
    }

    /// The topology, and the topics its sinks and emitting steps write.
    fn build(&self, gates: &Gates, guarantee: Guarantee) -> (TopologyTestDriver, Vec<String>) {
        let b = StreamBuilder::new();
        let mut s = b.stream(&["in"], StringCodec, StringCodec);
        if self.merged {
            s = s.merge(&b.stream(&["in-b"], StringCodec, StringCodec));
        }
        let mut outputs = Vec::new();
        let mut n = 0;
        add(&b, &s, &self.steps, gates, &mut n, &mut outputs);
        let d = TopologyTestDriver::with_guarantee(b.build().unwrap(), guarantee).unwrap();
        (d, outputs)
    }
}

/// Adds `steps` below `s`; `n` numbers the steps' names.
fn add(
    b: &StreamBuilder,
    s: &KStream<String, String>,
    steps: &[Step],
    gates: &Gates,
    n: &mut usize,
    outputs: &mut Vec<String>,
) {
    for step in steps {
        *n += 1;
        let id = *n;
        match step {
            Step::Sink => {
                let topic = format!("out-{id}");
                s.to(&topic, StringCodec, StringCodec);
                outputs.push(topic);
            }
            Step::Map(kids) => {
                let next = s.map_values(|_, v: String| format!("{v}'"));
                add(b, &next, kids, gates, n, outputs);
            }
            Step::Async(kind, kids) => {
                let name = match kind {
                    Gate::EmitOnComplete => {
                        let topic = format!("emit-{id}");
                        outputs.push(topic.clone());
                        topic
                    }
                    Gate::StoreThenSpawn => {
                        let store = format!("store-{id}");
                        b.add_kv_store(&store, true);
                        store
                    }
                    Gate::Pass => String::new(),
                };
                let stores: Vec<&str> = match kind {
                    Gate::StoreThenSpawn => vec![name.as_str()],
                    _ => vec![],
                };
                let (g, kind) = (gates.clone(), *kind);
                let store_name = name.clone();
                let next = s.process(&format!("async-{id}"), &stores, move || Gated {
                    gates: g.clone(),
                    kind,
                    name: store_name.clone(),
                });
                add(b, &next, kids, gates, n, outputs);
            }
            Step::Count(kids) => {
                let next = s
                    .group_by_key()
                    .emit_on_update()
                    .count(&format!("count-{id}"))
                    .to_stream()
                    .map_values(|_, c: u64| format!("#{c}"));
                add(b, &next, kids, gates, n, outputs);
            }
            Step::Repartition(kids) => {
                let next = s.repartition(&format!("rp-{id}"));
                add(b, &next, kids, gates, n, outputs);
            }
            Step::Window(kids) => {
                let next = s
                    .group_by_key()
                    .emit_on_update()
                    .windowed_by(TimeWindows::tumbling(Duration::from_secs(10)))
                    .count(&format!("window-{id}"))
                    .to_stream()
                    .map(|r: Record<Windowed<String>, u64>| Record {
                        key: format!("{}@{}", r.key.key, r.key.window.start),
                        value: format!("#{}", r.value),
                        timestamp: r.timestamp,
                        headers: r.headers,
                    });
                add(b, &next, kids, gates, n, outputs);
            }
            Step::Batch(kids) => {
                let next = s.process(&format!("batch-{id}"), &[], Batcher::default);
                add(b, &next, kids, gates, n, outputs);
            }
        }
    }
}

/// Every committed record of the output topics: per topic and key, the
/// values, sorted (a multiset).
type Outputs = BTreeMap<(String, String), Vec<String>>;

fn committed(d: &TopologyTestDriver, topics: &[String]) -> Outputs {
    let mut out = Outputs::new();
    for topic in topics {
        for r in d.committed_output(topic) {
            let key = String::from_utf8(r.key.unwrap_or_default()).unwrap();
            let value = String::from_utf8(r.value.unwrap_or_default()).unwrap();
            out.entry((topic.clone(), key)).or_default().push(value);
        }
    }
    for values in out.values_mut() {
        values.sort();
    }
    out
}

/// The input of a case: (topic, key, value, timestamp).
fn input(rng: &mut StdRng, shape: &Shape) -> Vec<(&'static str, String, String, i64)> {
    let n = rng.random_range(10..40);
    (0..n)
        .map(|i| {
            let topic = shape.inputs()[rng.random_range(0..shape.inputs().len())];
            let key = format!("k{}", rng.random_range(0..3));
            (topic, key, format!("v{i}"), 1_000 * i as i64)
        })
        .collect()
}

/// Opens one gate at random (its call completes); false when none is open.
fn open_one(d: &mut TopologyTestDriver, gates: &Gates, rng: &mut StdRng) -> bool {
    let tx = {
        let mut g = gates.lock();
        let keys: Vec<u64> = g.keys().copied().collect();
        if keys.is_empty() {
            return false;
        }
        g.remove(&keys[rng.random_range(0..keys.len())])
    };
    if let Some(tx) = tx {
        let _ = tx.send(());
        assert_eq!(
            d.handle_completions(1, WAIT).unwrap(),
            1,
            "a call completes"
        );
    }
    true
}

/// Finishes everything: reads what a restart has to read again, opens every
/// gate (completions may open more), and commits.
fn finish(d: &mut TopologyTestDriver, gates: &Gates, rng: &mut StdRng, topics: &[String]) {
    d.replay(usize::MAX).unwrap();
    let written = |d: &TopologyTestDriver| -> usize {
        topics.iter().map(|t| d.committed_output(t).len()).sum()
    };
    let mut quiet = 0;
    // Until no call runs and four commits in a row wrote nothing (batchers
    // forward at every second commit, repartitions take a commit to pass).
    while quiet < 4 {
        let before = written(d);
        d.commit().unwrap();
        let opened = open_one(d, gates, rng);
        quiet = if opened || written(d) != before || !gates.lock().is_empty() {
            0
        } else {
            quiet + 1
        };
    }
}

/// The input through the topology without a crash.
fn oracle(shape: &Shape, records: &[(&str, String, String, i64)], seed: u64) -> Outputs {
    let gates: Gates = Arc::default();
    let (mut d, topics) = shape.build(&gates, Guarantee::ExactlyOnce);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    for (topic, k, v, ts) in records {
        d.pipe(topic, k, v, &StringCodec, &StringCodec, *ts)
            .unwrap();
    }
    finish(&mut d, &gates, &mut rng, &topics);
    committed(&d, &topics)
}

/// The input through the topology with random completion orders, commits
/// and crashes.
fn crashed_run(
    shape: &Shape,
    records: &[(&str, String, String, i64)],
    guarantee: Guarantee,
    rng: &mut StdRng,
) -> Outputs {
    let gates: Gates = Arc::default();
    let (mut d, topics) = shape.build(&gates, guarantee);
    let mut next = 0;
    let mut crashes = 0;
    while next < records.len() || !gates.lock().is_empty() {
        match rng.random_range(0..20) {
            0..=7 if next < records.len() => {
                let (topic, k, v, ts) = &records[next];
                d.pipe(topic, k, v, &StringCodec, &StringCodec, *ts)
                    .unwrap();
                next += 1;
            }
            8..=14 => {
                open_one(&mut d, &gates, rng);
            }
            15..=16 => {
                d.commit().unwrap();
            }
            17 => {
                d.replay(rng.random_range(1..10)).unwrap();
            }
            18..=19 if crashes < 3 => {
                crashes += 1;
                // The calls in flight die with the instance; what the restart
                // runs again opens gates of its own.
                gates.lock().clear();
                d.crash_deferring_replay().unwrap();
            }
            _ => {}
        }
    }
    finish(&mut d, &gates, rng, &topics);
    committed(&d, &topics)
}

/// What differs between `got` and `want`, per topic and key: under
/// exactly-once any difference; under at-least-once what was lost (an input
/// record's output not there at all, or a count that never reached its
/// number: re-applied records may change the values that follow them).
fn differences(got: &Outputs, want: &Outputs, guarantee: Guarantee) -> Vec<String> {
    let empty = Vec::new();
    let mut keys: Vec<&(String, String)> = got.keys().chain(want.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut diffs = Vec::new();
    for k in keys {
        let (g, w) = (got.get(k).unwrap_or(&empty), want.get(k).unwrap_or(&empty));
        let bad = match guarantee {
            Guarantee::ExactlyOnce => columns(g) != columns(w),
            Guarantee::AtLeastOnce => {
                let ids = |vs: &[String]| -> std::collections::BTreeSet<String> {
                    vs.iter().filter_map(|v| record_of(v)).collect()
                };
                let most = |vs: &[String]| vs.iter().filter_map(|v| count_of(v)).max();
                !ids(w).is_subset(&ids(g)) || most(g) < most(w)
            }
        };
        if bad {
            diffs.push(format!("{k:?}: want {w:?}, got {g:?}"));
        }
    }
    diffs
}

/// A multiset of output values, compared column by column: a value is the
/// input record's (`v12`) or a count (`#3`), then the counts of the stores
/// it went through (`#3`), marks of maps (`'`) anywhere. Where a count's
/// input came from an async step, which record got which number depends on
/// the completion order; each column's multiset does not (the n records of a
/// key that reach a count get 1 to n in some order). A record applied twice,
/// or lost, shows in every column.
fn columns(values: &[String]) -> Vec<Vec<String>> {
    let mut columns: Vec<Vec<String>> = Vec::new();
    for v in values {
        for (i, part) in v.split('#').enumerate() {
            if columns.len() <= i {
                columns.push(Vec::new());
            }
            columns[i].push(part.to_string());
        }
    }
    for c in &mut columns {
        c.sort();
    }
    columns
}

/// The input record an output value stems from (`v12` of `v12#3'`), when
/// it still names one (a count's output names none).
fn record_of(value: &str) -> Option<String> {
    let digits = value.strip_prefix('v')?;
    let n: String = digits.chars().take_while(char::is_ascii_digit).collect();
    Some(format!("v{n}"))
}

/// The count a count's output carries (`3` of `#3'`).
fn count_of(value: &str) -> Option<u64> {
    let digits = value.strip_prefix('#')?;
    digits
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .ok()
}

/// Runs `cases` random shapes under `guarantee`, each against its oracle.
fn over_cases(guarantee: Guarantee, cases: u64) {
    let base: u64 = std::env::var("SLUICE_SHAPES_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    for seed in base..base + cases {
        let mut rng = StdRng::seed_from_u64(seed);
        let shape = Shape::random(&mut rng);
        let records = input(&mut rng, &shape);
        let want = oracle(&shape, &records, seed);
        let got = crashed_run(&shape, &records, guarantee, &mut rng);
        let diffs = differences(&got, &want, guarantee);
        if std::env::var("SLUICE_SHAPES_ALL").is_ok() {
            if !diffs.is_empty() {
                eprintln!("FAIL seed {seed} {}: {}", shape.describe(), diffs[0]);
            }
            continue;
        }
        assert!(
            diffs.is_empty(),
            "{guarantee:?}, seed {seed} (SLUICE_SHAPES_SEED={seed} reruns it), shape {}:\n{}",
            shape.describe(),
            diffs.join("\n")
        );
    }
}

/// How many random cases a test run checks.
fn cases() -> u64 {
    std::env::var("SLUICE_SHAPES_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000)
}

#[test]
fn exactly_once_holds_for_every_shape_and_crash_point() {
    over_cases(Guarantee::ExactlyOnce, cases());
}

#[test]
fn at_least_once_loses_nothing_for_any_shape_and_crash_point() {
    over_cases(Guarantee::AtLeastOnce, cases());
}
