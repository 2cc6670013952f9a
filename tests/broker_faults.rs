//! The engine when the broker itself fails: a broker of the test's own
//! (started with `scripts/broker.sh`, so the other tests' broker is left
//! alone) is killed with SIGKILL under load and restarted on the same log
//! directory. Requests time out, coordinators move and come back, an open
//! transaction may be aborted by the restarted broker: the instance retries
//! what Kafka calls retriable, closes dirty what cannot commit, keeps
//! running, and every window's counts come out exactly once.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{temp_dir, unique, OwnBroker, Proc};
use sluice::kafka::{create_topics, produce, read_topics, OutRecord};

/// Every count per key of an `async-count` output, in the order written.
fn count_sequences(msgs: &[rdkafka::message::OwnedMessage]) -> BTreeMap<String, Vec<u64>> {
    use rdkafka::Message;
    let mut seqs: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for m in msgs {
        let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
        let n: u64 = serde_json::from_slice(m.payload().unwrap_or_default()).unwrap();
        seqs.entry(key).or_default().push(n);
    }
    seqs
}

#[test]
fn a_broker_killed_and_restarted_under_load_costs_no_count_and_no_instance() {
    let broker = OwnBroker::start();
    let (input, output, app) = (unique("in"), unique("out"), unique("faults"));
    create_topics(&broker.bootstrap, &[(&input, 2, &[]), (&output, 2, &[])]).unwrap();
    let mut expected: BTreeMap<String, u64> = BTreeMap::new();
    let records: Vec<OutRecord> = (0..8_000)
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
    produce(&broker.bootstrap, &input, records).unwrap();
    // An async step (calls of 0-100 ms, 20 in flight per partition) into a
    // count: the run lasts about ten seconds, commits all along.
    let dir = temp_dir();
    let args: Vec<String> = [
        "example",
        "async-count",
        "--bootstrap",
        &broker.bootstrap,
        "--app-id",
        &app,
        "--input",
        &input,
        "--output",
        &output,
        "--state-dir",
        &dir.path().display().to_string(),
        "--guarantee",
        "exactly-once",
        "--min-delay-ms",
        "0",
        "--max-delay-ms",
        "100",
        "--max-in-flight",
        "20",
    ]
    .map(String::from)
    .to_vec();
    let mut p = Proc::spawn("faults", &args);
    // Some counts committed: the run is under way.
    read_topics(
        &broker.bootstrap,
        &[&output],
        true,
        Duration::from_secs(90),
        |m| m.len() >= 200,
    )
    .unwrap();
    eprintln!("killing the broker at {}", chrono::Utc::now());
    broker.kill();
    std::thread::sleep(Duration::from_secs(5));
    broker.restart();
    eprintln!("broker restarted at {}", chrono::Utc::now());
    let msgs = read_topics(
        &broker.bootstrap,
        &[&output],
        true,
        Duration::from_secs(240),
        |m| {
            let seqs = count_sequences(m);
            expected
                .iter()
                .all(|(k, n)| seqs.get(k).and_then(|c| c.last()) == Some(n))
        },
    )
    .unwrap();
    assert!(
        p.child.try_wait().unwrap().is_none(),
        "the instance kept running through the broker's restart"
    );
    let stats = p.stop();
    assert_eq!(stats["ok"], true, "{stats}");
    // Every count read once, strictly increasing, the last the input's.
    let seqs = count_sequences(&msgs);
    assert_eq!(seqs.len(), expected.len());
    for (key, want) in &expected {
        let counts = &seqs[key];
        assert!(
            counts.windows(2).all(|w| w[0] < w[1]),
            "{key}: counts not strictly increasing: {counts:?}"
        );
        assert_eq!(counts.last(), Some(want), "{key}: {counts:?}");
    }
}
