//! The engine's crash tests against the real broker: `sluice example …`
//! processes killed with SIGKILL, or aborted at a crash point inside a
//! commit (`SLUICE_FAILPOINT`), or with a commit step that never returns,
//! then restarted; every output record read `read_committed` is checked
//! (each count once, none lost). The same shapes run in process, crashed at
//! any point, in `topology/tests/crash.rs`.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use rand::Rng;
use rdkafka::message::OwnedMessage;
use rdkafka::Message;
use sluice::cli::demo::latest_counts;
use sluice::cli::example::Echo;
use sluice::kafka::{create_topics, produce, read_topics, OutRecord};

use common::engine::*;
use common::{bootstrap, eventually, temp_dir, unique, Proc};

/// Runs an example with a crash point armed (`SLUICE_FAILPOINT=point`) and
/// waits until the process aborts there.
fn abort_at(ex: &Example, dir: &tempfile::TempDir, name: &str, point: &str) {
    let mut p = Proc::spawn_env(name, &ex.args(dir.path()), &[("SLUICE_FAILPOINT", point)]);
    let status = eventually(
        Duration::from_secs(120),
        "the failpoint aborts the process",
        || p.child.try_wait().unwrap(),
    );
    assert!(!status.success(), "the failpoint aborted the process");
}

#[test]
fn exactly_once_windowed_count_survives_three_sigkills() {
    let ex = Example::windowed_count("eos-kill", "exactly-once", 4);
    let (records, expected) = keyed_records(100_000, 500, 10, base_time());
    produce(&bootstrap(), &ex.input, records).unwrap();
    let dir = temp_dir();
    let mut rng = rand::rng();
    for round in 0..3 {
        let mut p = ex.spawn(&format!("eos-kill-{round}"), dir.path());
        eventually(Duration::from_secs(90), "instance ready", || {
            p.ready().then_some(())
        });
        std::thread::sleep(Duration::from_millis(rng.random_range(300..2_500)));
        p.kill9();
    }
    let mut p = ex.spawn("eos-kill-final", dir.path());
    let msgs = wait_outputs(&ex.output, &expected, Duration::from_secs(240));
    let stats = p.stop();
    assert_counts_equal(&latest_counts(&msgs).unwrap(), &expected);
    assert_each_window_count_once(&msgs, &expected);
    assert_eq!(stats["ok"], true, "{stats}");
}

#[test]
fn a_crash_after_changelog_writes_leaks_nothing_into_state() {
    // The process aborts inside its 2nd transaction, after its changelog and
    // output records were acknowledged but before the commit. The restarted
    // task fences its transactional id, so the broker aborts that
    // transaction: neither its outputs nor its changelog records are read,
    // and every count is read once.
    let ex = Example::windowed_count("eos-leak", "exactly-once", 2);
    let (records, expected) = keyed_records(40_000, 200, 4, base_time());
    produce(&bootstrap(), &ex.input, records).unwrap();
    let dir = temp_dir();
    abort_at(&ex, &dir, "leak-1", "eos_after_changelog_flush:2");
    let mut p = ex.spawn("leak-2", dir.path());
    let msgs = wait_outputs(&ex.output, &expected, Duration::from_secs(180));
    let stats = p.stop();
    assert_counts_equal(&latest_counts(&msgs).unwrap(), &expected);
    assert_each_window_count_once(&msgs, &expected);
    assert_eq!(stats["ok"], true, "{stats}");
}

#[test]
fn a_transaction_call_that_never_returns_closes_its_task_dirty_and_counts_stay_exact() {
    // The instance's 2nd adding of offsets to a transaction never returns
    // (a point that blocks its thread for good, as librdkafka's call can once
    // its cached group coordinator's broker went away and came back). Past
    // the call's bound the task's producer is given up: the task is closed
    // dirty and comes back with a new producer, which fences the stuck
    // transaction; every count is read once, from the same instance.
    let (log, stats) = count_through_a_commit_fault("eos-stuck", "eos_offsets_unanswered:2");
    assert!(
        log.contains("failpoint eos_offsets_unanswered reached"),
        "the call was stuck:\n{log}"
    );
    assert!(
        log.contains("did not return within"),
        "the stuck call was given up:\n{log}"
    );
    assert_eq!(
        stats["clients_given_up"], 1,
        "one producer given up on: {stats}"
    );
}

#[test]
fn a_commit_still_timing_out_when_its_time_is_up_closes_its_task_dirty_and_counts_stay_exact() {
    // The instance's first commit of a transaction fails retriably for good
    // (as one does while the broker does not answer for longer than the
    // transaction's timeout): its outcome is not known. The task is closed
    // dirty and comes back with a new producer, which fences what is left;
    // the instance carries on and every count is read once.
    let (_, stats) = count_through_a_commit_fault("eos-commit-timeout", "eos_commit_timed_out:1");
    assert!(
        stats["rebalances"].as_u64().unwrap_or(0) >= 1,
        "the closed task made the instance rejoin: {stats}"
    );
}

/// Runs an exactly-once windowed count over 40,000 records with the commit
/// fault `failpoint` armed (`SLUICE_FAILPOINT`): the fault closes a task
/// dirty, the instance keeps running, and every window's count is read once
/// and right. Returns the instance's log and final stats.
fn count_through_a_commit_fault(app: &str, failpoint: &str) -> (String, serde_json::Value) {
    let ex = Example::windowed_count(app, "exactly-once", 2);
    let (records, expected) = keyed_records(40_000, 200, 4, base_time());
    produce(&bootstrap(), &ex.input, records).unwrap();
    let dir = temp_dir();
    let mut p = Proc::spawn_logged(
        app,
        &ex.args(dir.path()),
        &[("SLUICE_FAILPOINT", failpoint)],
        true,
    );
    let msgs = wait_outputs(&ex.output, &expected, Duration::from_secs(180));
    let log = p.log().join("\n");
    assert!(
        log.contains("closing it dirty"),
        "the fault closed its task dirty:\n{log}"
    );
    assert!(
        p.child.try_wait().unwrap().is_none(),
        "the instance keeps running"
    );
    let stats = p.stop();
    assert_counts_equal(&latest_counts(&msgs).unwrap(), &expected);
    assert_each_window_count_once(&msgs, &expected);
    assert_eq!(stats["ok"], true, "{stats}\n{log}");
    (log, stats)
}

#[test]
fn a_crash_between_the_commit_and_the_local_write_keeps_expiring_windowed_counts_exact() {
    // Windows expire as stream time passes them (no grace, one-minute
    // retention). The process aborts right after its 5th transaction
    // committed, before that commit reached RocksDB: the restart restores the
    // changelog tail past its checkpoint, and every window's last count read
    // read_committed is exact.
    let ex = Example {
        kind: "windowed-count",
        app: unique("expiry"),
        input: unique("in"),
        output: unique("out"),
        extra: ["--guarantee", "exactly-once", "--grace-ms", "0"]
            .map(String::from)
            .to_vec(),
    };
    create_topics(&bootstrap(), &[(&ex.input, 2, &[]), (&ex.output, 2, &[])]).unwrap();
    let (records, expected) = keyed_records(200_000, 200, 8, base_time());
    produce(&bootstrap(), &ex.input, records).unwrap();
    let dir = temp_dir();
    abort_at(&ex, &dir, "expiry-1", "eos_after_commit_before_local:3");
    let mut p = ex.spawn("expiry-2", dir.path());
    let got = wait_counts(&ex.output, &expected, Duration::from_secs(180));
    let stats = p.stop();
    assert_counts_equal(&got, &expected);
    assert_eq!(stats["ok"], true, "{stats}");
}

#[test]
fn survivor_takes_over_a_killed_instance_and_keeps_aggregates_exact() {
    let ex = Example::windowed_count("eos-failover", "exactly-once", 4);
    let (records, expected) = keyed_records(60_000, 300, 5, base_time());
    let (dir_a, dir_b) = (temp_dir(), temp_dir());
    let (mut a, mut b) = two_instances(&ex, &dir_a, &dir_b);
    // Produce in slices so that B is killed in the middle of processing.
    let chunks: Vec<Vec<OutRecord>> = records.chunks(6_000).map(<[OutRecord]>::to_vec).collect();
    let (first, rest) = chunks.split_at(4);
    for c in first {
        produce(&bootstrap(), &ex.input, c.clone()).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    b.kill9();
    for c in rest {
        produce(&bootstrap(), &ex.input, c.clone()).unwrap();
    }
    takes_over_every_task(&a);
    let msgs = wait_outputs(&ex.output, &expected, Duration::from_secs(90));
    let stats = a.stop();
    assert_counts_equal(&latest_counts(&msgs).unwrap(), &expected);
    assert_each_window_count_once(&msgs, &expected);
    assert!(stats["rebalances"].as_u64().unwrap_or(0) >= 1, "{stats}");
}

#[test]
fn async_operator_out_of_order_never_commits_past_an_unfinished_record() {
    let ex = Example {
        kind: "async-echo",
        app: unique("async"),
        input: unique("in"),
        output: unique("out"),
        extra: [
            "--guarantee",
            "exactly-once",
            "--min-delay-ms",
            "0",
            "--max-delay-ms",
            "2000",
            // A bound well under the input keeps the run several seconds
            // long, so the kill below lands mid-run.
            "--max-in-flight",
            "40",
        ]
        .map(String::from)
        .to_vec(),
    };
    create_topics(&bootstrap(), &[(&ex.input, 2, &[]), (&ex.output, 2, &[])]).unwrap();
    let values: Vec<String> = (0..400).map(|i| format!("v{i}")).collect();
    produce(
        &bootstrap(),
        &ex.input,
        values.iter().enumerate().map(|(i, v)| OutRecord {
            key: Some(v.clone().into_bytes()),
            value: Some(v.clone().into_bytes()),
            partition: Some((i % 2) as i32),
            ..Default::default()
        }),
    )
    .unwrap();
    // Where each value sits in the input.
    let input = read_topics(
        &bootstrap(),
        &[&ex.input],
        false,
        Duration::from_secs(30),
        |m| m.len() >= values.len(),
    )
    .unwrap();
    let position: HashMap<String, (i32, i64)> = input
        .iter()
        .map(|m| {
            (
                String::from_utf8_lossy(m.payload().unwrap()).into_owned(),
                (m.partition(), m.offset()),
            )
        })
        .collect();

    let dir = temp_dir();
    let mut p = ex.spawn("async-1", dir.path());
    // Kill once some input is committed (the group's committed offsets can
    // trail the first visible output by seconds on the test broker).
    eventually(Duration::from_secs(90), "an input offset committed", || {
        committed(&ex.app, &ex.input, 2)
            .values()
            .any(|c| *c > 0)
            .then_some(())
    });
    p.kill9();

    // Everything below a committed offset must have its effect visible.
    let offsets = committed(&ex.app, &ex.input, 2);
    let below: Vec<&String> = values
        .iter()
        .filter(|v| {
            let (part, off) = position[*v];
            offsets.get(&part).is_some_and(|c| off < *c)
        })
        .collect();
    assert!(
        !below.is_empty(),
        "some offsets were committed before the kill: {offsets:?}"
    );
    // A transaction's markers reach its partitions one by one after it
    // commits: the offsets can be visible a moment before the outputs they
    // committed with. Read until they all are, or 15 s.
    let echo = |m: &OwnedMessage| {
        serde_json::from_slice::<Echo>(m.payload().unwrap_or_default())
            .map(|e| e.value)
            .unwrap_or_default()
    };
    let visible: HashSet<String> = read_topics(
        &bootstrap(),
        &[&ex.output],
        true,
        Duration::from_secs(15),
        |m| {
            let seen: HashSet<String> = m.iter().map(echo).collect();
            below.iter().all(|v| seen.contains(*v))
        },
    )
    .unwrap()
    .iter()
    .map(echo)
    .collect();
    let missing: Vec<&&String> = below.iter().filter(|v| !visible.contains(**v)).collect();
    assert!(
        missing.is_empty(),
        "committed past unfinished records: {missing:?}"
    );
    assert!(
        below.len() < values.len(),
        "the kill happened mid-run ({} of {} committed)",
        below.len(),
        values.len()
    );

    let mut p = ex.spawn("async-2", dir.path());
    let all: HashSet<String> = echoed(&ex.output, true, values.len(), Duration::from_secs(120))
        .into_iter()
        .collect();
    p.stop();
    let lost: Vec<&String> = values.iter().filter(|v| !all.contains(*v)).collect();
    assert!(lost.is_empty(), "lost records: {lost:?}");
}

/// Every count record of an async-count output, read `read_committed`, per
/// key in the order written; read until every key's last count is at least
/// (or, with `exact`, equal to) its expected count.
fn count_sequences(
    output: &str,
    expected: &BTreeMap<String, u64>,
    exact: bool,
) -> BTreeMap<String, Vec<u64>> {
    let latest_matches = |m: &[rdkafka::message::OwnedMessage]| {
        let mut last: BTreeMap<String, u64> = BTreeMap::new();
        for r in m {
            let key = String::from_utf8_lossy(r.key().unwrap_or_default()).into_owned();
            let n: u64 = serde_json::from_slice(r.payload().unwrap_or_default()).unwrap_or(0);
            last.insert(key, n);
        }
        if exact {
            &last == expected
        } else {
            expected
                .iter()
                .all(|(k, n)| last.get(k).is_some_and(|got| got >= n))
        }
    };
    let msgs = read_topics(
        &bootstrap(),
        &[output],
        true,
        Duration::from_secs(180),
        |m| latest_matches(m),
    )
    .unwrap();
    let mut seqs: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for m in &msgs {
        let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
        let n: u64 = serde_json::from_slice(m.payload().unwrap_or_default()).unwrap();
        seqs.entry(key).or_default().push(n);
    }
    seqs
}

/// How an async-count run is interrupted.
enum Interrupt {
    /// SIGKILL this many times, each 1–3 s after the instance is ready.
    Kills(usize),
    /// Abort at a commit step (`SLUICE_FAILPOINT`), then restart once.
    Failpoint(&'static str),
}

/// An async pass-through completing out of order (0–199 ms) feeding a per-key
/// count in the same sub-topology, interrupted, then run to the end. Returns
/// every count record read `read_committed` per key, and the input count per
/// key.
fn async_count_run(
    guarantee: &str,
    interrupt: Interrupt,
    exact: bool,
) -> (BTreeMap<String, Vec<u64>>, BTreeMap<String, u64>) {
    let ex = Example {
        kind: "async-count",
        app: unique("acount"),
        input: unique("in"),
        output: unique("out"),
        extra: [
            "--guarantee",
            guarantee,
            "--min-delay-ms",
            "0",
            "--max-delay-ms",
            "199",
            "--max-in-flight",
            "100",
        ]
        .map(String::from)
        .to_vec(),
    };
    create_topics(&bootstrap(), &[(&ex.input, 2, &[]), (&ex.output, 2, &[])]).unwrap();
    let n = 20_000;
    let mut expected: BTreeMap<String, u64> = BTreeMap::new();
    let records: Vec<OutRecord> = (0..n)
        .map(|i| {
            let key = format!("k{}", (i * 7919) % 50);
            *expected.entry(key.clone()).or_default() += 1;
            OutRecord {
                key: Some(key.into_bytes()),
                value: Some(format!("{i}").into_bytes()),
                ..Default::default()
            }
        })
        .collect();
    produce(&bootstrap(), &ex.input, records).unwrap();
    let dir = temp_dir();
    match interrupt {
        Interrupt::Kills(kills) => {
            let mut rng = rand::rng();
            for round in 0..kills {
                let mut p = ex.spawn(&format!("acount-{round}"), dir.path());
                eventually(Duration::from_secs(90), "instance ready", || {
                    p.ready().then_some(())
                });
                std::thread::sleep(Duration::from_millis(rng.random_range(1_000..3_000)));
                p.kill9();
            }
        }
        Interrupt::Failpoint(point) => abort_at(&ex, &dir, "acount-fail", point),
    }
    let mut p = ex.spawn("acount-final", dir.path());
    let seqs = count_sequences(&ex.output, &expected, exact);
    let stats = p.stop();
    assert_eq!(stats["ok"], true, "{stats}");
    (seqs, expected)
}

/// The last count of every key equals its input count.
fn assert_final_counts(seqs: &BTreeMap<String, Vec<u64>>, expected: &BTreeMap<String, u64>) {
    let last: BTreeMap<String, u64> = seqs
        .iter()
        .map(|(k, v)| (k.clone(), *v.last().unwrap()))
        .collect();
    let wrong: Vec<String> = expected
        .iter()
        .filter(|(k, v)| last.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: want {v}, got {:?}", last.get(k)))
        .collect();
    assert!(wrong.is_empty(), "{} keys wrong: {wrong:?}", wrong.len());
}

/// No key's last count is below its input count.
fn assert_no_count_lost(seqs: &BTreeMap<String, Vec<u64>>, expected: &BTreeMap<String, u64>) {
    let low: Vec<String> = expected
        .iter()
        .filter_map(|(k, want)| {
            let got = seqs.get(k).and_then(|v| v.last()).copied().unwrap_or(0);
            (got < *want).then(|| format!("{k}: {got} < {want}"))
        })
        .collect();
    assert!(low.is_empty(), "{} keys lost counts: {low:?}", low.len());
}

/// Every count appears once per key and the counts strictly increase.
fn assert_each_count_once(seqs: &BTreeMap<String, Vec<u64>>) {
    for (k, v) in seqs {
        assert!(
            v.windows(2).all(|w| w[0] < w[1]),
            "{k}: counts not strictly increasing: {v:?}"
        );
    }
}

#[test]
fn exactly_once_async_operator_into_a_count_is_exact_across_sigkills() {
    // Records finish out of order; the commit's progress record says which
    // above the committed offset it covers, and a restarted task skips
    // exactly those: every count appears once.
    let (seqs, expected) = async_count_run("exactly-once", Interrupt::Kills(3), true);
    assert_each_count_once(&seqs);
    assert_final_counts(&seqs, &expected);
}

#[test]
fn at_least_once_async_operator_into_a_count_loses_nothing_across_sigkills() {
    let (seqs, expected) = async_count_run("at-least-once", Interrupt::Kills(3), false);
    assert_no_count_lost(&seqs, &expected);
}

#[test]
fn exactly_once_async_count_crash_after_changelog_flush_emits_each_count_once() {
    // The transaction's outputs, changelog and progress records were all
    // acknowledged when the process died; the broker aborts it when the
    // restarted task fences it. Every count appears once.
    let (seqs, expected) = async_count_run(
        "exactly-once",
        Interrupt::Failpoint("eos_after_changelog_flush:4"),
        true,
    );
    assert_each_count_once(&seqs);
    assert_final_counts(&seqs, &expected);
}

#[test]
fn at_least_once_async_count_crash_before_the_offset_commit_is_exact() {
    // State, changelog and progress record written, offsets not committed:
    // the restarted task skips exactly what the progress record covers.
    let (seqs, expected) = async_count_run(
        "at-least-once",
        Interrupt::Failpoint("alos_before_offset_commit:4"),
        true,
    );
    assert_final_counts(&seqs, &expected);
}

/// The topologies the crash-point tests run: (a) a windowed count, (b) an
/// async step into a count, (c) a count forwarding every update into an
/// async step, (d) merged inputs into a count, (e) a cached count into an
/// async step.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Shape {
    WindowedCount,
    AsyncCount,
    CountAsync,
    MergedCount,
    CachedCountAsync,
}

impl Shape {
    /// The example running the shape, with its topics created.
    fn example(self, guarantee: &str) -> Example {
        let (kind, inputs) = match self {
            Shape::WindowedCount => ("windowed-count", 1),
            Shape::AsyncCount => ("async-count", 1),
            Shape::CountAsync => ("count-async", 1),
            Shape::MergedCount => ("merged-count", 2),
            Shape::CachedCountAsync => ("cached-count-async", 1),
        };
        let inputs: Vec<String> = (0..inputs).map(|_| unique("in")).collect();
        // Short commit intervals: many commits, so the crash points are
        // reached early in a run.
        let mut extra: Vec<String> = ["--guarantee", guarantee, "--commit-interval-ms", "50"]
            .map(String::from)
            .to_vec();
        match self {
            Shape::WindowedCount => extra.extend(["--grace-ms", "3600000"].map(String::from)),
            Shape::MergedCount => {}
            _ => extra.extend(
                [
                    "--min-delay-ms",
                    "0",
                    "--max-delay-ms",
                    "80",
                    "--max-in-flight",
                    "50",
                ]
                .map(String::from),
            ),
        }
        let ex = Example {
            kind,
            app: unique("points"),
            input: inputs.join(","),
            output: unique("out"),
            extra,
        };
        let mut topics: Vec<sluice::kafka::TopicDef<'_>> =
            inputs.iter().map(|t| (t.as_str(), 2, &[][..])).collect();
        topics.push((&ex.output, 2, &[]));
        create_topics(&bootstrap(), &topics).unwrap();
        ex
    }

    /// Whether counts finish out of order behind an async step (so they are
    /// judged as a set per key, not as a sequence).
    fn behind_async(self) -> bool {
        matches!(self, Shape::CountAsync | Shape::CachedCountAsync)
    }
}

/// Produces records `from..to` of a crash-point run: keys `k0..k49` spread
/// over the example's inputs, all in one minute; adds them to the count per
/// (window, key).
fn produce_points_records(
    ex: &Example,
    (from, to): (usize, usize),
    base: i64,
    expected: &mut BTreeMap<(i64, String), u64>,
) {
    let inputs: Vec<&str> = ex.input.split(',').collect();
    let mut per_input: Vec<Vec<OutRecord>> = vec![Vec::new(); inputs.len()];
    for i in from..to {
        let key = format!("k{}", (i * 7919) % 50);
        let window = if ex.kind == "windowed-count" { base } else { 0 };
        *expected.entry((window, key.clone())).or_insert(0u64) += 1;
        per_input[i % inputs.len()].push(OutRecord {
            key: Some(key.into_bytes()),
            value: Some(format!("{i}").into_bytes()),
            timestamp: Some(base),
            ..Default::default()
        });
    }
    for (topic, records) in inputs.iter().zip(per_input) {
        produce(&bootstrap(), topic, records).unwrap();
    }
}

/// Every count of a run's output, per (window, key), in the order written
/// (window 0 for the counts without windows).
fn output_counts(msgs: &[rdkafka::message::OwnedMessage]) -> BTreeMap<(i64, String), Vec<u64>> {
    let mut seqs: BTreeMap<(i64, String), Vec<u64>> = BTreeMap::new();
    for m in msgs {
        let raw_key = m.key().unwrap_or_default();
        let key = match serde_json::from_slice::<sluice_topology::Windowed<String>>(raw_key) {
            Ok(w) => (w.window.start, w.key),
            Err(_) => (0, String::from_utf8_lossy(raw_key).into_owned()),
        };
        let n: u64 = serde_json::from_slice(m.payload().unwrap_or_default()).unwrap();
        seqs.entry(key).or_default().push(n);
    }
    seqs
}

/// What a crash point promises.
#[derive(Clone, Copy, Debug)]
enum Promise {
    /// Exactly once: every count read once (behind an async step: each
    /// update answered once), the last the input count.
    Exact,
    /// At-least-once with the progress record written: no record applied
    /// twice (no count above the input count), none lost; outputs may
    /// repeat.
    AppliedOnce,
    /// At-least-once before the progress record: nothing lost.
    NothingLost,
}

fn check_points_run(
    shape: Shape,
    promise: Promise,
    seqs: &BTreeMap<(i64, String), Vec<u64>>,
    expected: &BTreeMap<(i64, String), u64>,
    what: &str,
) {
    assert_eq!(
        seqs.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>(),
        "{what}: keys"
    );
    for (key, counts) in seqs {
        let want = expected[key];
        let mut sorted = counts.clone();
        sorted.sort_unstable();
        let max = sorted.last().copied().unwrap_or(0);
        match promise {
            Promise::Exact => {
                let mut unique = sorted.clone();
                unique.dedup();
                assert_eq!(sorted, unique, "{what}: {key:?} read twice: {counts:?}");
                if !shape.behind_async() {
                    assert_eq!(&sorted, counts, "{what}: {key:?} out of order: {counts:?}");
                }
                assert_eq!(max, want, "{what}: {key:?} {counts:?}");
            }
            Promise::AppliedOnce => {
                assert_eq!(
                    max, want,
                    "{what}: {key:?} counted twice or lost: {counts:?}"
                );
                if !shape.behind_async() {
                    assert_eq!(counts.last(), Some(&want), "{what}: {key:?} {counts:?}");
                }
            }
            Promise::NothingLost => assert!(max >= want, "{what}: {key:?} lost: {counts:?}"),
        }
        if shape == Shape::CountAsync && !matches!(promise, Promise::NothingLost) {
            for n in 1..=want {
                assert!(
                    sorted.binary_search(&n).is_ok(),
                    "{what}: {key:?} update {n} lost"
                );
            }
        }
    }
}

/// Runs `shape` under `guarantee` with a crash armed at each of `points`
/// in turn: the first run dies at the point in its first commit with work;
/// more records come, and the restarted run dies there too (a crash soon
/// after a restart, in the middle of what the first left); more records
/// come, and a third run goes to the end. Judged by every output record
/// read `read_committed`.
fn crash_points(shape: Shape, guarantee: &str, points: &[(&str, Promise)]) {
    let n = match shape {
        Shape::WindowedCount | Shape::MergedCount => 80_000,
        _ => 8_000,
    };
    for (point, promise) in points {
        let ex = shape.example(guarantee);
        let (base, mut expected) = (base_time(), BTreeMap::new());
        produce_points_records(&ex, (0, n / 3), base, &mut expected);
        let dir = temp_dir();
        abort_at(&ex, &dir, "points-1", &format!("{point}:1"));
        produce_points_records(&ex, (n / 3, 2 * n / 3), base, &mut expected);
        abort_at(&ex, &dir, "points-2", &format!("{point}:1"));
        produce_points_records(&ex, (2 * n / 3, n), base, &mut expected);
        let mut p = ex.spawn("points-3", dir.path());
        read_topics(
            &bootstrap(),
            &[&ex.output],
            true,
            Duration::from_secs(180),
            |m| {
                let seqs = output_counts(m);
                expected
                    .iter()
                    .all(|(k, n)| seqs.get(k).is_some_and(|c| c.iter().any(|got| got >= n)))
            },
        )
        .unwrap();
        let stats = p.stop();
        assert_eq!(stats["ok"], true, "{point}: {stats}");
        let msgs = read_topics(
            &bootstrap(),
            &[&ex.output],
            true,
            Duration::from_secs(3),
            |_| false,
        )
        .unwrap();
        let what = format!("{shape:?} {guarantee} {point}");
        check_points_run(shape, *promise, &output_counts(&msgs), &expected, &what);
    }
}

const EOS_POINTS: [(&str, Promise); 3] = [
    ("eos_before_flush", Promise::Exact),
    ("eos_after_changelog_flush", Promise::Exact),
    ("eos_after_commit_before_local", Promise::Exact),
];

const ALOS_POINTS: [(&str, Promise); 2] = [
    ("alos_after_changelog_flush", Promise::NothingLost),
    ("alos_before_offset_commit", Promise::AppliedOnce),
];

#[test]
fn a_windowed_count_keeps_its_promise_at_every_commit_step_killed_twice() {
    crash_points(Shape::WindowedCount, "exactly-once", &EOS_POINTS);
    crash_points(Shape::WindowedCount, "at-least-once", &ALOS_POINTS);
}

#[test]
fn an_async_step_into_a_count_keeps_its_promise_at_every_commit_step_killed_twice() {
    crash_points(Shape::AsyncCount, "exactly-once", &EOS_POINTS);
    crash_points(Shape::AsyncCount, "at-least-once", &ALOS_POINTS);
}

#[test]
fn a_count_before_an_async_step_keeps_its_promise_at_every_commit_step_killed_twice() {
    crash_points(Shape::CountAsync, "exactly-once", &EOS_POINTS);
    crash_points(Shape::CountAsync, "at-least-once", &ALOS_POINTS);
}

#[test]
fn merged_inputs_keep_their_promise_at_every_commit_step_killed_twice() {
    crash_points(Shape::MergedCount, "exactly-once", &EOS_POINTS);
    crash_points(Shape::MergedCount, "at-least-once", &ALOS_POINTS);
}

#[test]
fn a_cached_count_before_an_async_step_keeps_its_promise_at_every_commit_step_killed_twice() {
    crash_points(Shape::CachedCountAsync, "exactly-once", &EOS_POINTS);
    crash_points(Shape::CachedCountAsync, "at-least-once", &ALOS_POINTS);
}
