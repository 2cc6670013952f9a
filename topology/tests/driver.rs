//! DSL behaviour through the in-process test driver (no broker).

use std::time::Duration;

use sluice_topology::{
    dlq_headers, header, EmitMode, JsonCodec, ProcessError, Processor, ProcessorContext, Record,
    SourceOptions, StreamBuilder, StringCodec, TimeWindows, TopologyTestDriver, Windowed,
};

const MIN: i64 = 60_000;

fn windowed_counts(emit: EmitMode) -> TopologyTestDriver {
    let b = StreamBuilder::new();
    let s = b.stream(&["in"], StringCodec, StringCodec);
    let w = s
        .group_by_key()
        .windowed_by(TimeWindows::tumbling(Duration::from_secs(60)).grace(Duration::from_secs(10)));
    let w = match emit {
        EmitMode::OnWindowClose => w.emit_final(),
        EmitMode::OnUpdate => w.emit_on_update(),
        EmitMode::OnCommit => w,
    };
    w.count("counts").to_stream().to(
        "out",
        JsonCodec::<Windowed<String>>::default(),
        JsonCodec::<u64>::default(),
    );
    TopologyTestDriver::new(b.build().unwrap()).unwrap()
}

fn pipe(d: &mut TopologyTestDriver, k: &str, ts: i64) {
    d.pipe(
        "in",
        &k.to_string(),
        &"v".to_string(),
        &StringCodec,
        &StringCodec,
        ts,
    )
    .unwrap();
}

#[test]
fn tumbling_count_emits_every_update() {
    let mut d = windowed_counts(EmitMode::OnUpdate);
    pipe(&mut d, "a", 1_000);
    pipe(&mut d, "a", 2_000);
    pipe(&mut d, "b", 3_000);
    pipe(&mut d, "a", MIN + 1);
    let out = d
        .read_typed(
            "out",
            &JsonCodec::<Windowed<String>>::default(),
            &JsonCodec::<u64>::default(),
        )
        .unwrap();
    let got: Vec<(String, i64, u64)> = out
        .into_iter()
        .map(|(k, v)| (k.key, k.window.start, v))
        .collect();
    assert_eq!(
        got,
        vec![
            ("a".into(), 0, 1),
            ("a".into(), 0, 2),
            ("b".into(), 0, 1),
            ("a".into(), MIN, 1)
        ]
    );
}

/// The default (cached) results: the latest count of each window changed
/// since the last commit, forwarded at the commit.
#[test]
fn a_cached_count_forwards_each_changed_window_once_per_commit() {
    let mut d = windowed_counts(EmitMode::OnCommit);
    pipe(&mut d, "a", 1_000);
    pipe(&mut d, "a", 2_000);
    pipe(&mut d, "b", 3_000);
    assert!(d.read_output("out").is_empty(), "nothing before the commit");
    d.commit().unwrap();
    pipe(&mut d, "a", MIN + 1);
    pipe(&mut d, "a", 4_000);
    d.commit().unwrap();
    let got: Vec<(String, i64, u64)> = d
        .read_typed(
            "out",
            &JsonCodec::<Windowed<String>>::default(),
            &JsonCodec::<u64>::default(),
        )
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k.key, k.window.start, v))
        .collect();
    assert_eq!(
        got,
        vec![
            ("a".into(), 0, 2),
            ("b".into(), 0, 1),
            ("a".into(), 0, 3),
            ("a".into(), MIN, 1)
        ]
    );
}

#[test]
fn late_records_past_grace_are_dropped_and_counted() {
    let mut d = windowed_counts(EmitMode::OnUpdate);
    pipe(&mut d, "a", 1_000);
    pipe(&mut d, "a", MIN + 5_000); // stream time 65 s: window [0,60) still open (grace 10 s)
    pipe(&mut d, "a", 2_000); // accepted
    pipe(&mut d, "a", MIN + 20_000); // stream time 80 s: window [0,60) closed
    pipe(&mut d, "a", 3_000); // late: dropped
    let out = d
        .read_typed(
            "out",
            &JsonCodec::<Windowed<String>>::default(),
            &JsonCodec::<u64>::default(),
        )
        .unwrap();
    let first_window: Vec<u64> = out
        .iter()
        .filter(|(k, _)| k.window.start == 0)
        .map(|(_, v)| *v)
        .collect();
    assert_eq!(first_window, vec![1, 2]);
    assert_eq!(d.counters().late_dropped, 1);
}

#[test]
fn emit_final_emits_each_window_once_after_grace() {
    let mut d = windowed_counts(EmitMode::OnWindowClose);
    for ts in [1_000, 2_000, 30_000] {
        pipe(&mut d, "a", ts);
    }
    pipe(&mut d, "b", 40_000);
    pipe(&mut d, "a", MIN + 5_000); // not closed yet (grace)
    assert!(d.read_output("out").is_empty());
    pipe(&mut d, "a", MIN + 10_000); // stream time 70 s: [0,60) closes
    let out = d
        .read_typed(
            "out",
            &JsonCodec::<Windowed<String>>::default(),
            &JsonCodec::<u64>::default(),
        )
        .unwrap();
    let got: Vec<(String, i64, u64)> = out
        .into_iter()
        .map(|(k, v)| (k.key, k.window.start, v))
        .collect();
    assert_eq!(got, vec![("a".into(), 0, 3), ("b".into(), 0, 1)]);
    pipe(&mut d, "a", MIN + 11_000);
    assert!(
        d.read_output("out").is_empty(),
        "closed windows are emitted once"
    );
}

#[test]
fn hopping_windows_count_each_record_in_every_window() {
    let b = StreamBuilder::new();
    b.stream(&["in"], StringCodec, StringCodec)
        .group_by_key()
        .windowed_by(TimeWindows::hopping(
            Duration::from_secs(60),
            Duration::from_secs(30),
        ))
        .emit_on_update()
        .count("hop")
        .to_stream()
        .to(
            "out",
            JsonCodec::<Windowed<String>>::default(),
            JsonCodec::<u64>::default(),
        );
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    pipe(&mut d, "k", 45_000); // windows [0,60) and [30,90)
    let starts: Vec<i64> = d
        .read_typed(
            "out",
            &JsonCodec::<Windowed<String>>::default(),
            &JsonCodec::<u64>::default(),
        )
        .unwrap()
        .into_iter()
        .map(|(k, _)| k.window.start)
        .collect();
    assert_eq!(starts, vec![0, 30_000]);
}

#[test]
fn group_by_repartitions_and_stateless_operators_compose() {
    let b = StreamBuilder::new();
    let words = b
        .stream(&["lines"], StringCodec, StringCodec)
        .flat_map(|r: Record<String, String>| {
            r.value
                .split_whitespace()
                .map(|w| Record::new(String::new(), w.to_lowercase(), r.timestamp))
                .collect::<Vec<_>>()
        })
        .filter(|r| r.value.len() > 2);
    let branches = words.branch(vec![
        Box::new(|r: &Record<String, String>| r.value.starts_with('x')),
        Box::new(|_: &Record<String, String>| true),
    ]);
    branches[0].to("x-words", StringCodec, StringCodec);
    branches[1]
        .map(|r| Record::new(r.value.clone(), 1u64, r.timestamp))
        .group_by(|r| r.key.clone())
        .aggregate("word-counts", || 0u64, |_, v, acc| acc + v)
        .to_stream()
        .to("counts", StringCodec, JsonCodec::<u64>::default());
    let topology = b.build().unwrap();
    assert_eq!(
        topology.subtopologies().len(),
        2,
        "{}",
        topology.describe("test")
    );
    let mut d = TopologyTestDriver::new(topology).unwrap();
    d.pipe(
        "lines",
        &String::new(),
        &"the cat and THE xylophone".to_string(),
        &StringCodec,
        &StringCodec,
        5,
    )
    .unwrap();
    d.pipe(
        "lines",
        &String::new(),
        &"a cat".to_string(),
        &StringCodec,
        &StringCodec,
        6,
    )
    .unwrap();
    // The counts are cached: they come at the commit.
    d.commit().unwrap();
    let x: Vec<(String, String)> = d.read_typed("x-words", &StringCodec, &StringCodec).unwrap();
    assert_eq!(x.len(), 1);
    let counts: Vec<(String, u64)> = d
        .read_typed("counts", &StringCodec, &JsonCodec::<u64>::default())
        .unwrap();
    let last = |w: &str| counts.iter().rev().find(|(k, _)| k == w).map(|(_, v)| *v);
    assert_eq!(last("the"), Some(2));
    assert_eq!(last("cat"), Some(2));
    assert_eq!(last("and"), Some(1));
}

/// Sleeps a key-dependent time, then forwards the value upper-cased.
struct SlowUpper;

impl Processor<String, String> for SlowUpper {
    type OutKey = String;
    type OutValue = String;
    type Output = (String, String);

    fn process(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, (String, String)>,
    ) -> Result<(), ProcessError> {
        let delay = (r.value.len() as u64 % 5) * 20;
        ctx.spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            (r.key, r.value.to_uppercase())
        });
        Ok(())
    }

    fn complete(
        &mut self,
        (k, v): (String, String),
        ctx: &mut ProcessorContext<'_, String, String, (String, String)>,
    ) -> Result<(), ProcessError> {
        let count: u64 = ctx.kv::<String, u64>("seen")?.get(&k)?.unwrap_or(0);
        ctx.kv::<String, u64>("seen")?.put(&k, &(count + 1));
        ctx.forward(Record::new(k, v, 0))
    }
}

#[test]
fn async_processor_completes_out_of_order_and_commits_only_the_finished_prefix() {
    let b = StreamBuilder::new();
    b.add_kv_store("seen", true);
    b.stream(&["in"], StringCodec, StringCodec)
        .process("upper", &["seen"], || SlowUpper)
        .to("out", StringCodec, StringCodec);
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    let values = ["aaaa", "a", "aaa", "aa", "aaaaa"]; // delays 80, 20, 60, 40, 0 ms
    for (i, v) in values.iter().enumerate() {
        d.pipe(
            "in",
            &format!("k{i}"),
            &v.to_string(),
            &StringCodec,
            &StringCodec,
            1,
        )
        .unwrap();
    }
    assert_eq!(
        d.committable_offset("in"),
        Some(0),
        "nothing finished past offset 0 yet"
    );
    assert_eq!(d.wait_for_async(Duration::from_secs(5)).unwrap(), 0);
    let out: Vec<(String, String)> = d.read_typed("out", &StringCodec, &StringCodec).unwrap();
    assert_eq!(out.len(), 5);
    assert_ne!(out[0].0, "k0", "completions arrive in completion order");
    assert_eq!(d.committable_offset("in"), Some(5));
    assert_eq!(
        d.commit().unwrap(),
        6,
        "one changelog record per key, and the progress record"
    );
}

#[test]
fn undecodable_records_go_to_the_dead_letter_topic_with_reasons() {
    let b = StreamBuilder::new();
    b.stream_with(
        &["in"],
        StringCodec,
        JsonCodec::<u32>::default(),
        SourceOptions {
            dead_letter_topic: Some("in.dlq".into()),
        },
    )
    .map_values(|_, v| v + 1)
    .to("out", StringCodec, JsonCodec::<u32>::default());
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    d.pipe_raw("in", Some(b"k"), Some(b"41"), 1).unwrap();
    d.pipe_raw("in", Some(b"k"), Some(b"{oops"), 2).unwrap();
    d.pipe_raw("in", Some(b"k"), Some(b"1"), 3).unwrap();
    let out = d
        .read_typed("out", &StringCodec, &JsonCodec::<u32>::default())
        .unwrap();
    assert_eq!(out.iter().map(|(_, v)| *v).collect::<Vec<_>>(), vec![42, 2]);
    let dlq = d.read_output("in.dlq");
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].value.as_deref(), Some(&b"{oops"[..]));
    assert_eq!(
        header(&dlq[0].headers, dlq_headers::CATEGORY),
        Some(&b"poison"[..])
    );
    assert_eq!(
        header(&dlq[0].headers, dlq_headers::ORIGINAL_OFFSET),
        Some(&b"1"[..])
    );
    assert!(header(&dlq[0].headers, dlq_headers::REASON).is_some());
    assert_eq!(d.committable_offset("in"), Some(3));
}

#[test]
fn undecodable_record_without_dead_letter_topic_stops_the_task() {
    let b = StreamBuilder::new();
    b.stream(&["in"], StringCodec, JsonCodec::<u32>::default())
        .to("out", StringCodec, JsonCodec::<u32>::default());
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    let err = d.pipe_raw("in", Some(b"k"), Some(b"nope"), 1).unwrap_err();
    assert!(matches!(err, ProcessError::Fatal(_)), "{err:?}");
}

#[test]
fn bad_topologies_fail_to_build() {
    let b = StreamBuilder::new();
    b.add_kv_store("orphan", true);
    b.stream(&["in"], StringCodec, StringCodec)
        .to("out", StringCodec, StringCodec);
    assert!(b.build().is_err());

    let b = StreamBuilder::new();
    let s = b.stream(&["in"], StringCodec, StringCodec);
    s.group_by_key().count("dup");
    s.group_by_key().count("dup");
    assert!(b.build().is_err());
}

/// Two topics whose source ids (a 31-bit hash of the name) collide, found
/// by trying names until two meet (about 2^16 names).
fn colliding_topics() -> (String, String) {
    let mut seen = std::collections::HashMap::new();
    for i in 0u64.. {
        let name = format!("topic-{i}");
        if let Some(other) = seen.insert(sluice_topology::source_id(&name), name.clone()) {
            return (other, name);
        }
    }
    unreachable!("the ids are 31 bits")
}

#[test]
fn source_topics_of_one_sub_topology_with_the_same_source_id_fail_to_build() {
    // A task tells its input partitions apart by source id (in state
    // positions and the progress record): two of its topics sharing one
    // would have each other's progress.
    let (a, b) = colliding_topics();
    let builder = StreamBuilder::new();
    builder
        .stream(&[a.as_str(), b.as_str()], StringCodec, StringCodec)
        .to("out", StringCodec, StringCodec);
    let err = builder.build().err().expect("a collision fails the build");
    let text = err.to_string();
    assert!(text.contains(&a) && text.contains(&b), "{text}");
    // In sub-topologies of their own they never meet in one task.
    let builder = StreamBuilder::new();
    for t in [&a, &b] {
        builder
            .stream(&[t.as_str()], StringCodec, StringCodec)
            .to("out", StringCodec, StringCodec);
    }
    assert!(builder.build().is_ok());
}

/// Counts per key and minute in a window store, and forwards the key's
/// windows so far as `start:count` pairs.
struct MinuteTally;

impl Processor<String, String> for MinuteTally {
    type OutKey = String;
    type OutValue = String;
    type Output = ();

    fn process(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, ()>,
    ) -> Result<(), ProcessError> {
        let start = r.timestamp - r.timestamp % MIN;
        let mut w = ctx.window::<String, u64>("tally")?;
        let n = w.get(&r.key, start)?.unwrap_or(0) + 1;
        w.put(&r.key, start, &n);
        let windows = w.fetch(&r.key, 0, i64::MAX)?;
        let all = w.fetch_all(0, i64::MAX)?.len();
        let text: Vec<String> = windows
            .iter()
            .map(|(s, n)| format!("{}:{n}", s / MIN))
            .collect();
        ctx.forward(Record::new(
            r.key,
            format!("{} of {all}", text.join(",")),
            r.timestamp,
        ))
    }

    fn complete(
        &mut self,
        _: (),
        _: &mut ProcessorContext<'_, String, String, ()>,
    ) -> Result<(), ProcessError> {
        Ok(())
    }
}

#[test]
fn processors_read_and_write_window_stores_through_their_context() {
    let b = StreamBuilder::new();
    b.add_window_store("tally", Duration::from_secs(3600));
    b.stream(&["in"], StringCodec, StringCodec)
        .process("minute-tally", &["tally"], || MinuteTally)
        .to("out", StringCodec, StringCodec);
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    for (k, ts) in [("a", 1_000), ("a", 2_000), ("b", 3_000), ("a", MIN + 5)] {
        pipe(&mut d, k, ts);
    }
    d.commit().unwrap();
    let out: Vec<(String, String)> = d.read_typed("out", &StringCodec, &StringCodec).unwrap();
    assert_eq!(
        out,
        vec![
            ("a".into(), "0:1 of 1".into()),
            ("a".into(), "0:2 of 1".into()),
            ("b".into(), "0:1 of 2".into()),
            ("a".into(), "0:2,1:1 of 3".into()),
        ]
    );
    // The windows survive a crash: restored from the changelog.
    d.crash().unwrap();
    pipe(&mut d, "a", MIN + 6);
    let out: Vec<(String, String)> = d.read_typed("out", &StringCodec, &StringCodec).unwrap();
    assert_eq!(out.last().unwrap().1, "0:2,1:2 of 3");
}

/// Dead-letters values over 100 (after the repartition).
struct RejectLarge;

impl Processor<String, u32> for RejectLarge {
    type OutKey = String;
    type OutValue = u32;
    type Output = ();

    fn process(
        &mut self,
        r: Record<String, u32>,
        ctx: &mut ProcessorContext<'_, String, u32, ()>,
    ) -> Result<(), ProcessError> {
        if r.value > 100 {
            return ctx.dead_letter("too_large", "bad_request", 2);
        }
        ctx.forward(r)
    }
}

#[test]
fn a_record_dead_lettered_past_a_repartition_goes_to_its_sources_dead_letter_topic() {
    let b = StreamBuilder::new();
    b.stream_with(
        &["in"],
        StringCodec,
        JsonCodec::<u32>::default(),
        SourceOptions {
            dead_letter_topic: Some("in.dlq".into()),
        },
    )
    .map(|r| {
        let (key, value) = (format!("{}", r.value % 2), r.value);
        r.with(key, value)
    })
    .repartition_with("parity", StringCodec, JsonCodec::<u32>::default(), Some(3))
    .process("reject", &[], || RejectLarge)
    .to("out", StringCodec, JsonCodec::<u32>::default());
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    d.pipe_raw_with_headers(
        "in",
        Some(b"a"),
        Some(b"41"),
        1,
        vec![("trace".into(), b"t0".to_vec())],
    )
    .unwrap();
    d.pipe_raw_with_headers(
        "in",
        Some(b"b"),
        Some(b"500"),
        2,
        vec![("trace".into(), b"t1".to_vec())],
    )
    .unwrap();
    d.pipe_raw("in", Some(b"c"), Some(b"{oops"), 3).unwrap();
    let out = d
        .read_typed("out", &StringCodec, &JsonCodec::<u32>::default())
        .unwrap();
    assert_eq!(out, vec![("1".to_string(), 41)]);
    let dlq = d.read_output("in.dlq");
    assert_eq!(dlq.len(), 2, "{dlq:?}");
    let rejected = &dlq[0];
    assert_eq!(rejected.value.as_deref(), Some(&b"500"[..]));
    for (h, want) in [
        (dlq_headers::ORIGINAL_TOPIC, &b"in"[..]),
        (dlq_headers::ORIGINAL_OFFSET, b"1"),
        (dlq_headers::ORIGINAL_PARTITION, b"0"),
        (dlq_headers::CATEGORY, b"bad_request"),
        (dlq_headers::ATTEMPTS, b"2"),
        ("trace", b"t1"),
    ] {
        assert_eq!(header(&rejected.headers, h), Some(want), "{h}");
    }
    assert!(
        rejected
            .headers
            .iter()
            .all(|(k, _)| !k.starts_with("sluice.origin")),
        "{:?}",
        rejected.headers
    );
    assert_eq!(
        header(&dlq[1].headers, dlq_headers::ORIGINAL_OFFSET),
        Some(&b"2"[..])
    );
}

/// An output the producers could never send (over `message.max.bytes`) is
/// not sent: its record is dead-lettered `too_large` with a reason, and the
/// task goes on (a poison output must not stop it, or, under exactly-once,
/// abort its transaction after every restart).
#[test]
fn an_output_over_the_producers_message_size_dead_letters_its_record() {
    let b = StreamBuilder::new();
    b.stream_with(
        &["in"],
        StringCodec,
        StringCodec,
        SourceOptions {
            dead_letter_topic: Some("in.dlq".into()),
        },
    )
    .map_values(|_, v: String| {
        // "big" answers with 2 MB.
        if v == "big" {
            "x".repeat(2_000_000)
        } else {
            v.to_uppercase()
        }
    })
    .to("out", StringCodec, StringCodec);
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    for (i, v) in ["a", "big", "c"].iter().enumerate() {
        d.pipe(
            "in",
            &format!("k{i}"),
            &v.to_string(),
            &StringCodec,
            &StringCodec,
            1,
        )
        .unwrap();
    }
    d.commit().unwrap();
    let out: Vec<(String, String)> = d.read_typed("out", &StringCodec, &StringCodec).unwrap();
    assert_eq!(
        out,
        vec![("k0".into(), "A".into()), ("k2".into(), "C".into())]
    );
    let dlq = d.read_output("in.dlq");
    assert_eq!(dlq.len(), 1, "{dlq:?}");
    assert_eq!(
        dlq[0].value.as_deref(),
        Some(&b"big"[..]),
        "the original bytes"
    );
    assert_eq!(
        header(&dlq[0].headers, dlq_headers::CATEGORY),
        Some(&b"too_large"[..])
    );
    let reason = String::from_utf8(
        header(&dlq[0].headers, dlq_headers::REASON)
            .unwrap()
            .to_vec(),
    )
    .unwrap();
    assert!(reason.contains("message.max.bytes"), "{reason}");
}

/// A record too large to be written back (over the producers'
/// `message.max.bytes`, under the broker's) that must be dead-lettered: its
/// dead letter is cut to fit, says so, and the task goes on. Written whole,
/// it could never be sent, and would stop the task at every restart.
#[test]
fn a_dead_letter_over_the_producers_message_size_is_cut_to_fit_and_says_so() {
    let b = StreamBuilder::new();
    b.stream_with(
        &["in"],
        StringCodec,
        JsonCodec::<u64>::default(),
        SourceOptions {
            dead_letter_topic: Some("in.dlq".into()),
        },
    )
    .to("out", StringCodec, JsonCodec::<u64>::default());
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    let big = vec![b'x'; 1_000_100]; // not JSON: undecodable, so dead-lettered
    d.pipe_raw("in", Some(b"k0"), Some(&big), 1).unwrap();
    d.pipe_raw("in", Some(b"k1"), Some(b"7"), 1).unwrap();
    d.commit().unwrap();
    assert_eq!(d.read_output("out").len(), 1, "the next record goes on");
    let dlq = d.read_output("in.dlq");
    assert_eq!(dlq.len(), 1, "{} dead letters", dlq.len());
    let size = dlq[0].key.as_ref().map_or(0, Vec::len)
        + dlq[0].value.as_ref().map_or(0, Vec::len)
        + dlq[0]
            .headers
            .iter()
            .map(|(k, v)| k.len() + v.len() + 8)
            .sum::<usize>();
    assert!(size <= 1_000_000, "the dead letter fits: {size} bytes");
    let value = dlq[0].value.as_deref().unwrap();
    assert!(
        value.len() > 990_000 && big.starts_with(value),
        "the original bytes, cut at the end ({} bytes)",
        value.len()
    );
    assert_eq!(dlq[0].key.as_deref(), Some(&b"k0"[..]));
    assert_eq!(
        header(&dlq[0].headers, dlq_headers::TRUNCATED),
        Some(&b"value=1000100"[..]),
        "the original size"
    );
    assert_eq!(
        header(&dlq[0].headers, dlq_headers::CATEGORY),
        Some(&b"poison"[..])
    );
}

/// Emits one record per punctuation (no input record is current then).
struct Ticker;

impl Processor<String, String> for Ticker {
    type OutKey = String;
    type OutValue = String;
    type Output = ();

    fn process(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, ()>,
    ) -> Result<(), ProcessError> {
        ctx.forward(r)
    }

    fn punctuate(
        &mut self,
        time: sluice_topology::Punctuation,
        ctx: &mut ProcessorContext<'_, String, String, ()>,
    ) -> Result<(), ProcessError> {
        ctx.forward(Record::new(
            "tick".to_string(),
            format!("bad-{}", time.wall_clock_ms),
            time.wall_clock_ms,
        ))
    }
}

/// Dead-letters every value starting with `bad`.
struct RejectBad;

impl Processor<String, String> for RejectBad {
    type OutKey = String;
    type OutValue = String;
    type Output = ();

    fn process(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, ()>,
    ) -> Result<(), ProcessError> {
        if r.value.starts_with("bad") {
            return Err(ProcessError::dead_letter("bad value", "bad_request"));
        }
        ctx.forward(r)
    }
}

/// A record forwarded from a punctuation is a record of its own: one an
/// operator downstream dead-letters goes to the task's dead-letter topic
/// (marked as derived, with no original bytes), and the task goes on.
#[test]
fn a_record_from_a_punctuation_can_be_dead_lettered() {
    let b = StreamBuilder::new();
    b.stream_with(
        &["in"],
        StringCodec,
        StringCodec,
        SourceOptions {
            dead_letter_topic: Some("in.dlq".into()),
        },
    )
    .process("ticker", &[], || Ticker)
    .process("reject", &[], || RejectBad)
    .to("out", StringCodec, StringCodec);
    let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
    d.pipe(
        "in",
        &"k".to_string(),
        &"good".to_string(),
        &StringCodec,
        &StringCodec,
        1,
    )
    .unwrap();
    d.punctuate(5_000).unwrap();
    d.pipe(
        "in",
        &"k".to_string(),
        &"fine".to_string(),
        &StringCodec,
        &StringCodec,
        2,
    )
    .unwrap();
    d.commit().unwrap();
    let out: Vec<(String, String)> = d.read_typed("out", &StringCodec, &StringCodec).unwrap();
    assert_eq!(
        out,
        vec![("k".into(), "good".into()), ("k".into(), "fine".into())]
    );
    let dlq = d.read_output("in.dlq");
    assert_eq!(dlq.len(), 1, "{dlq:?}");
    assert_eq!(dlq[0].value, None);
    assert!(header(&dlq[0].headers, dlq_headers::DERIVED).is_some());
    assert_eq!(
        header(&dlq[0].headers, dlq_headers::ORIGINAL_TOPIC),
        Some(&b"in"[..])
    );
    assert_eq!(
        header(&dlq[0].headers, dlq_headers::ORIGINAL_OFFSET),
        Some(&b"-1"[..])
    );
}

/// Forwards each value after an async call that panics on `boom`: carried
/// with the call (`spawn`), or held by the call's future (`spawn_detached`).
struct PanicsOnBoom {
    detached: bool,
}

impl Processor<String, String> for PanicsOnBoom {
    type OutKey = String;
    type OutValue = String;
    type Output = (String, Option<sluice_topology::InFlight>);

    fn process(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, String, Self::Output>,
    ) -> Result<(), ProcessError> {
        let held = if self.detached { ctx.hold() } else { None };
        let call = async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            if r.value == "boom" {
                panic!("a provider answered something unexpected");
            }
            (r.value, held)
        };
        if self.detached {
            ctx.spawn_detached(call);
        } else {
            ctx.spawn(call);
        }
        Ok(())
    }

    fn complete(
        &mut self,
        (v, _held): Self::Output,
        ctx: &mut ProcessorContext<'_, String, String, Self::Output>,
    ) -> Result<(), ProcessError> {
        ctx.forward(Record::new(v.clone(), v, 0))
    }
}

/// A call whose future panics still completes: its record is dead-lettered
/// (never left in flight, which would stop commits, nor counted as handled),
/// and the records around it go on.
#[test]
fn a_call_that_panics_dead_letters_its_record_and_commits_go_on() {
    for detached in [false, true] {
        let b = StreamBuilder::new();
        b.stream_with(
            &["in"],
            StringCodec,
            StringCodec,
            SourceOptions {
                dead_letter_topic: Some("in.dlq".into()),
            },
        )
        .process("call", &[], move || PanicsOnBoom { detached })
        .to("out", StringCodec, StringCodec);
        let mut d = TopologyTestDriver::new(b.build().unwrap()).unwrap();
        for v in ["a", "boom", "b"] {
            d.pipe_raw("in", Some(b"k"), Some(v.as_bytes()), 1).unwrap();
        }
        assert_eq!(
            d.wait_for_async(Duration::from_secs(5)).unwrap(),
            0,
            "detached: {detached}"
        );
        let out: Vec<(String, String)> = d.read_typed("out", &StringCodec, &StringCodec).unwrap();
        let mut values: Vec<&str> = out.iter().map(|(_, v)| v.as_str()).collect();
        values.sort_unstable();
        assert_eq!(values, ["a", "b"], "detached: {detached}");
        let dlq = d.read_output("in.dlq");
        assert_eq!(dlq.len(), 1, "detached: {detached}");
        assert_eq!(dlq[0].value.as_deref(), Some(&b"boom"[..]));
        assert_eq!(
            header(&dlq[0].headers, dlq_headers::CATEGORY),
            Some(&b"panic"[..])
        );
        assert_eq!(d.committable_offset("in"), Some(3), "detached: {detached}");
    }
}
