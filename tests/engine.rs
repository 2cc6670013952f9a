//! The engine against the real broker: failover and fencing between
//! instances, slow async operators, restore, bad input, and where keyed
//! outputs land. Each test runs `sluice example …` processes. The crash
//! tests (SIGKILL, or a crash point inside a commit) are in
//! `engine_crashes.rs`.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use rdkafka::message::Headers;
use rdkafka::{ClientConfig, Message};
use sluice::cli::demo::latest_counts;
use sluice::kafka::{create_topics, produce, read_topics, OutRecord};

use common::engine::*;
use common::{bootstrap, eventually, temp_dir, unique};

#[test]
fn a_frozen_instance_is_fenced_drops_its_tasks_dirty_and_rejoins() {
    // B is frozen (SIGSTOP) past its session timeout while it owns tasks; A
    // takes them over and fences B's transactional ids. B then wakes up: its
    // partitions are lost and its producers fenced, so it must drop those
    // tasks without committing anything of theirs, rejoin, and keep running.
    let ex = Example::windowed_count("zombie", "exactly-once", 4);
    let (records, expected) = keyed_records(60_000, 300, 5, base_time());
    let (dir_a, dir_b) = (temp_dir(), temp_dir());
    let (mut a, mut b) = two_instances(&ex, &dir_a, &dir_b);
    let chunks: Vec<Vec<OutRecord>> = records.chunks(6_000).map(<[OutRecord]>::to_vec).collect();
    let (first, rest) = chunks.split_at(4);
    for c in first {
        produce(&bootstrap(), &ex.input, c.clone()).unwrap();
    }
    let pid = b.child.id().to_string();
    let signal = |sig: &str| {
        assert!(std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    };
    signal("-STOP");
    for c in &rest[..3] {
        produce(&bootstrap(), &ex.input, c.clone()).unwrap();
    }
    takes_over_every_task(&a);
    signal("-CONT");
    for c in &rest[3..] {
        produce(&bootstrap(), &ex.input, c.clone()).unwrap();
    }
    let msgs = wait_outputs(&ex.output, &expected, Duration::from_secs(150));
    let got = latest_counts(&msgs).unwrap();
    assert_each_window_count_once(&msgs, &expected);
    assert!(
        b.child.try_wait().unwrap().is_none(),
        "the woken instance keeps running"
    );
    let lines = b.lines().join("\n");
    let stats_b = b.stop();
    let stats_a = a.stop();
    assert_counts_equal(&got, &expected);
    assert_eq!(stats_b["ok"], true, "B: {stats_b}\n{lines}");
    assert_eq!(stats_a["ok"], true, "A: {stats_a}");
}

#[test]
fn a_task_fenced_at_its_commit_reads_its_partition_again_when_it_comes_back() {
    // A newer producer takes task 0_1's transactional id while the only
    // instance runs: that task's next commit is fenced. The instance closes
    // it dirty, pauses its partition until the group decides, rejoins, gets
    // it back and must fetch it again (librdkafka keeps a partition's pause
    // across a reassignment, so the revocation has to end it).
    let ex = Example::windowed_count("fenced", "exactly-once", 4);
    let (records, expected) = keyed_records(20_000, 100, 5, base_time());
    let (first, second) = records.split_at(10_000);
    let dir = temp_dir();
    let mut a = ex.spawn("A", dir.path());
    eventually(Duration::from_secs(90), "A owns every task", || {
        (a.ready() && a.tasks().len() == 4).then_some(())
    });
    produce(&bootstrap(), &ex.input, first.to_vec()).unwrap();
    let half = first.len();
    read_topics(
        &bootstrap(),
        &[&ex.output],
        true,
        Duration::from_secs(90),
        |m| latest_counts(m).is_ok_and(|got| got.values().sum::<u64>() as usize == half),
    )
    .unwrap();
    use rdkafka::producer::Producer as _;
    let usurper: rdkafka::producer::BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("transactional.id", format!("{}-0_1", ex.app))
        .create()
        .unwrap();
    usurper
        .init_transactions(Duration::from_secs(30))
        .expect("the usurper takes task 0_1's transactional id");
    produce(&bootstrap(), &ex.input, second.to_vec()).unwrap();
    let msgs = wait_outputs(&ex.output, &expected, Duration::from_secs(90));
    assert_each_window_count_once(&msgs, &expected);
    let stats = a.stop();
    assert_eq!(stats["ok"], true, "{stats}");
    assert!(
        stats["rebalances"].as_u64().unwrap_or(0) >= 1,
        "the fenced task made the instance rejoin: {stats}"
    );
}

#[test]
fn a_15_second_operator_call_causes_no_rebalance_and_no_duplicate() {
    let ex = Example {
        kind: "async-echo",
        app: unique("slow"),
        input: unique("in"),
        output: unique("out"),
        extra: [
            "--guarantee",
            "exactly-once",
            "--min-delay-ms",
            "15000",
            "--max-delay-ms",
            "15000",
            "--max-poll-interval-ms",
            "10000",
        ]
        .map(String::from)
        .to_vec(),
    };
    create_topics(&bootstrap(), &[(&ex.input, 2, &[]), (&ex.output, 2, &[])]).unwrap();
    let dir = temp_dir();
    let mut p = ex.spawn("slow", dir.path());
    eventually(Duration::from_secs(90), "instance ready", || {
        p.ready().then_some(())
    });
    let values: Vec<String> = (0..6).map(|i| format!("slow{i}")).collect();
    produce(
        &bootstrap(),
        &ex.input,
        values.iter().map(|v| OutRecord {
            key: Some(v.clone().into_bytes()),
            value: Some(v.clone().into_bytes()),
            ..Default::default()
        }),
    )
    .unwrap();
    let out = echoed(&ex.output, true, values.len(), Duration::from_secs(90));
    std::thread::sleep(Duration::from_secs(2));
    let stats = p.stop();
    let out_after = echoed(&ex.output, true, values.len(), Duration::from_secs(5));
    assert_eq!(out.len(), values.len(), "{out:?}");
    assert_eq!(
        out_after.len(),
        values.len(),
        "no duplicate after shutdown: {out_after:?}"
    );
    assert_eq!(stats["rebalances"], 0, "{stats}");
    assert_eq!(stats["ok"], true, "{stats}");
}

/// Records of the windowed count's changelogs (its store and the engine's
/// progress store).
fn changelog_records(app: &str) -> usize {
    let counts = format!("{app}-counts-changelog");
    let progress = sluice_topology::Topology::changelog_topic(
        app,
        &sluice_topology::Topology::progress_store(0),
    );
    read_topics(
        &bootstrap(),
        &[&counts, &progress],
        true,
        Duration::from_secs(4),
        |_| false,
    )
    .unwrap()
    .len()
}

#[test]
fn restart_with_local_state_restores_only_the_changelog_tail() {
    let ex = Example::windowed_count("restore", "exactly-once", 2);
    let base = base_time();
    let (first, mut expected) = keyed_records(5_000, 500, 1, base);
    produce(&bootstrap(), &ex.input, first).unwrap();
    let (dir_a, dir_b) = (temp_dir(), temp_dir());

    let mut a = ex.spawn("A1", dir_a.path());
    assert_counts_equal(
        &wait_counts(&ex.output, &expected, Duration::from_secs(120)),
        &expected,
    );
    let a1 = a.stop();
    assert_eq!(a1["restored_records"], 0, "{a1}");

    // An instance without local state restores everything.
    let written_by_a = changelog_records(&ex.app);
    assert!(
        written_by_a >= 500,
        "one record per key at least: {written_by_a}"
    );
    let mut b = ex.spawn("B", dir_b.path());
    eventually(Duration::from_secs(90), "B ready", || {
        b.ready().then_some(())
    });
    let (more, more_expected) = keyed_records(500, 50, 1, base + 2 * MINUTE);
    produce(&bootstrap(), &ex.input, more).unwrap();
    expected.extend(more_expected);
    assert_counts_equal(
        &wait_counts(&ex.output, &expected, Duration::from_secs(120)),
        &expected,
    );
    let b1 = b.stop();
    assert_eq!(
        b1["restored_records"].as_u64(),
        Some(written_by_a as u64),
        "{b1}"
    );

    // A restarts on its local state: only what B appended is restored.
    let tail = changelog_records(&ex.app) - written_by_a;
    assert!(tail > 0 && tail < written_by_a);
    let mut a = ex.spawn("A2", dir_a.path());
    eventually(Duration::from_secs(90), "A ready again", || {
        a.ready().then_some(())
    });
    let a2 = a.stop();
    assert_eq!(a2["restored_records"].as_u64(), Some(tail as u64), "{a2}");
}

#[test]
fn a_transaction_open_on_a_changelog_leaves_the_store_past_it_as_it_is() {
    // Read committed, a changelog's end is its last stable offset: the first
    // offset of a transaction on it not yet complete (after a broker restart
    // or stall the markers of one can come late). An instance restarting on
    // its local state, whose checkpoint is past that end while the log holds
    // what the checkpoint says, keeps its store. Here another producer holds
    // a transaction open on the changelog while the instance counts on;
    // taken for a recreated changelog, the end would wipe the store and
    // restore only what precedes the open transaction.
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _};
    let ex = Example::windowed_count("open-txn", "exactly-once", 1);
    let base = base_time();
    let add = |expected: &mut BTreeMap<(i64, String), u64>, more: BTreeMap<(i64, String), u64>| {
        for (k, n) in more {
            *expected.entry(k).or_insert(0) += n;
        }
    };
    let (first, mut expected) = keyed_records(1_000, 50, 1, base);
    produce(&bootstrap(), &ex.input, first).unwrap();
    let dir = temp_dir();
    let mut a = ex.spawn("A1", dir.path());
    wait_counts(&ex.output, &expected, Duration::from_secs(90));

    let holder: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("transactional.id", unique("holder"))
        .create()
        .unwrap();
    holder.init_transactions(Duration::from_secs(30)).unwrap();
    holder.begin_transaction().unwrap();
    let changelog = format!("{}-counts-changelog", ex.app);
    holder
        .send(
            BaseRecord::to(&changelog)
                .partition(0)
                .key("held")
                .payload("held"),
        )
        .map_err(|(e, _)| e)
        .unwrap();
    holder.flush(Duration::from_secs(10)).unwrap();

    let (second, more) = keyed_records(1_000, 50, 1, base);
    produce(&bootstrap(), &ex.input, second).unwrap();
    add(&mut expected, more);
    wait_counts(&ex.output, &expected, Duration::from_secs(90));
    let a1 = a.stop();
    assert_eq!(a1["ok"], true, "{a1}");

    // Within the open transaction's timeout: its end still holds.
    let mut a = ex.spawn("A2", dir.path());
    eventually(Duration::from_secs(30), "A ready again", || {
        a.ready().then_some(())
    });
    let (third, more) = keyed_records(1_000, 50, 1, base);
    produce(&bootstrap(), &ex.input, third).unwrap();
    add(&mut expected, more);
    let msgs = wait_outputs(&ex.output, &expected, Duration::from_secs(60));
    assert_counts_equal(&latest_counts(&msgs).unwrap(), &expected);
    let a2 = a.stop();
    assert_eq!(a2["ok"], true, "{a2}");
    drop(holder);
}

#[test]
fn undecodable_records_are_dead_lettered_and_processing_continues() {
    let dlq = unique("dlq");
    let mut ex = Example::windowed_count("poison", "at-least-once", 1);
    ex.extra.extend(["--dlq".into(), dlq.clone()]);
    create_topics(&bootstrap(), &[(&dlq, 1, &[])]).unwrap();
    let base = base_time();
    let mut recs = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..300 {
        let (key, good) = match i % 50 {
            7 => (None, false),                          // null key
            13 => (Some(vec![0xff, 0xfe, b'x']), false), // invalid UTF-8
            _ => (Some(format!("k{}", i % 10).into_bytes()), true),
        };
        if good {
            let k = String::from_utf8(key.clone().unwrap()).unwrap();
            *expected.entry((base - base % MINUTE, k)).or_insert(0u64) += 1;
        }
        recs.push(OutRecord {
            key,
            value: Some(format!("payload-{i}").into_bytes()),
            timestamp: Some(base),
            ..Default::default()
        });
    }
    produce(&bootstrap(), &ex.input, recs).unwrap();
    // And one the broker takes (under its message.max.bytes) that the
    // instance's producers could not send back whole (over theirs): its
    // dead letter is cut to fit, and the instance goes on.
    let mut big = sluice::kafka::Cluster::from(bootstrap().as_str());
    big.client
        .insert("message.max.bytes".into(), "1100000".into());
    let oversized = OutRecord {
        key: Some(vec![0xff, b'b', b'i', b'g']),
        value: Some(vec![b'x'; 1_000_100]),
        timestamp: Some(base),
        ..Default::default()
    };
    produce(big, &ex.input, [oversized]).unwrap();
    let dir = temp_dir();
    let mut p = ex.spawn("poison", dir.path());
    assert_counts_equal(
        &wait_counts(&ex.output, &expected, Duration::from_secs(120)),
        &expected,
    );
    let dead = read_topics(&bootstrap(), &[&dlq], false, Duration::from_secs(30), |m| {
        m.len() >= 13
    })
    .unwrap();
    let stats = p.stop();
    assert_eq!(stats["ok"], true, "{stats}");
    assert_eq!(dead.len(), 13);
    for m in &dead {
        let header = |name: &str| {
            m.headers()
                .and_then(|h| {
                    h.iter()
                        .find(|h| h.key == name)
                        .and_then(|h| h.value.map(<[u8]>::to_vec))
                })
                .map(|v| String::from_utf8(v).unwrap())
        };
        assert_eq!(header("dlq.category").as_deref(), Some("poison"));
        assert!(header("dlq.reason").unwrap().contains("undecodable key"));
        assert_eq!(
            header("dlq.original.topic").as_deref(),
            Some(ex.input.as_str())
        );
        assert!(header("dlq.original.offset").is_some());
        let payload = m.payload().unwrap();
        if m.key() == Some(&[0xff, b'b', b'i', b'g'][..]) {
            assert_eq!(header("dlq.truncated").as_deref(), Some("value=1000100"));
            assert!(
                payload.len() < 1_000_000 && payload.iter().all(|b| *b == b'x'),
                "the original bytes, cut to fit: {}",
                payload.len()
            );
            continue;
        }
        assert!(
            String::from_utf8_lossy(payload).starts_with("payload-"),
            "original bytes kept"
        );
        assert_eq!(header("dlq.truncated"), None);
    }
}

#[test]
fn non_co_partitioned_merge_inputs_fail_at_start() {
    let (a, b) = (unique("left"), unique("right"));
    create_topics(&bootstrap(), &[(&a, 2, &[]), (&b, 3, &[])]).unwrap();
    let ex = Example {
        kind: "merged-count",
        app: unique("copart"),
        input: format!("{a},{b}"),
        output: unique("out"),
        extra: vec![],
    };
    let dir = temp_dir();
    let mut p = ex.spawn("copart", dir.path());
    let status = p.child.wait().unwrap();
    assert!(!status.success());
    let line = p
        .wait_line(Duration::from_secs(5), |l| l.starts_with("START_ERROR"))
        .expect("a start error is printed");
    assert!(
        line.contains("co-partitioned") && line.contains(&a) && line.contains(&b),
        "{line}"
    );
}

#[test]
fn keyed_outputs_are_placed_where_the_producers_partitioner_puts_them() {
    // Interactive queries find a key's task with `key_partition`: it must
    // place keys where the producers' own partitioner (murmur2, as the Java
    // clients and the engine's producers) puts them.
    let topic = unique("placement");
    create_topics(&bootstrap(), &[(&topic, 7, &[])]).unwrap();
    let keys: Vec<String> = (0..500).map(|i| format!("tenant-{i}")).collect();
    let records = keys.iter().map(|k| OutRecord {
        key: Some(k.clone().into_bytes()),
        value: Some(b"x".to_vec()),
        ..Default::default()
    });
    produce(&bootstrap(), &topic, records).unwrap();
    let msgs = read_topics(
        &bootstrap(),
        &[&topic],
        true,
        Duration::from_secs(60),
        |m| m.len() >= keys.len(),
    )
    .unwrap();
    assert_eq!(msgs.len(), keys.len());
    let mut used = HashSet::new();
    for m in &msgs {
        let key = m.key().unwrap();
        assert_eq!(
            m.partition(),
            sluice_topology::runtime::key_partition(key, 7),
            "{}",
            String::from_utf8_lossy(key)
        );
        used.insert(m.partition());
    }
    assert_eq!(used.len(), 7, "every partition got keys");
}
