//! `sluice dlq inspect` and `sluice dlq replay` against the broker and the
//! simulated provider over real sockets: tasks a failing model dead-letters
//! as `exhausted` are counted without their payloads, a dry run and filters
//! that match nothing publish nothing, a replay against a healthy provider
//! completes every task once with its trace context, and a second replay
//! adds no result.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::process::{Command, Output};
use std::time::Duration;

use common::pipeline::*;
use common::{eventually, temp_dir};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, TopicPartitionList};
use sluice::kafka::read_topics;
use sluice::sim::SimConfig;
use sluice::trace::TraceParent;

/// Tasks dead-lettered per test run: 12 summarize, 8 classify.
const N: usize = 20;
/// Deliveries of a task before it is dead-lettered.
const MAX_ATTEMPTS: u64 = 3;
const TYPES: [&str; 2] = ["summarize", "classify"];

/// Runs `sluice dlq <args>`.
fn sluice_dlq(args: &[&str]) -> Output {
    let out = Command::new(common::sluice_bin())
        .arg("dlq")
        .args(args)
        .env("SLUICE_LOG", "warn")
        .output()
        .expect("run sluice dlq");
    eprintln!(
        "sluice dlq {args:?} -> {:?}\n{}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `sluice dlq <command> --config <the pipeline's> <args>`, which must
/// succeed; returns its standard output.
fn dlq(p: &Pipeline, command: &str, args: &[&str]) -> String {
    let config = p.config.display().to_string();
    let mut all = vec![command, "--config", &config];
    all.extend_from_slice(args);
    let out = sluice_dlq(&all);
    assert!(out.status.success(), "sluice dlq {all:?} failed");
    String::from_utf8(out.stdout).unwrap()
}

/// `dlq` with `--json`, parsed.
fn dlq_json(p: &Pipeline, command: &str, args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.push("--json");
    serde_json::from_str(&dlq(p, command, &all)).expect("JSON report")
}

/// The task topics' ends: per partition, the offset after its last record,
/// from every record read.
fn task_topic_ends(p: &Pipeline) -> BTreeMap<(String, i32), i64> {
    let topics: Vec<String> = TYPES.iter().map(|t| p.topic(t)).collect();
    let t: Vec<&str> = topics.iter().map(String::as_str).collect();
    let mut ends = BTreeMap::new();
    for m in read_topics(&p.cluster, &t, false, Duration::from_secs(3), |_| false).unwrap() {
        let end = ends
            .entry((m.topic().to_string(), m.partition()))
            .or_insert(0);
        *end = (*end).max(m.offset() + 1);
    }
    ends
}

/// The pipeline's group's committed offsets on the task topics.
fn committed(p: &Pipeline) -> BTreeMap<(String, i32), i64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &p.cluster.bootstrap)
        .set("group.id", format!("{}-app", p.prefix))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for t in TYPES {
        for partition in 0..2 {
            tpl.add_partition(&p.topic(t), partition);
        }
    }
    consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .unwrap()
        .elements()
        .iter()
        .filter_map(|e| Some(((e.topic().to_string(), e.partition()), e.offset().to_raw()?)))
        .collect()
}

/// Every completed result, read committed.
fn completed(p: &Pipeline) -> Vec<(sluice::envelope::TaskResult, rdkafka::message::OwnedMessage)> {
    read_topics(
        &p.cluster,
        &[&p.completed()],
        true,
        Duration::from_secs(3),
        |_| false,
    )
    .unwrap()
    .into_iter()
    .map(|m| (serde_json::from_slice(m.payload().unwrap()).unwrap(), m))
    .collect()
}

/// A pipeline whose model answers every call 503 (its breaker never opens,
/// one try per call, three deliveries per task), and the tasks it
/// dead-lettered as `exhausted`, once it stopped.
fn dead_lettered() -> (Pipeline, Vec<Task>) {
    let sim = SimConfig::from_json_value(serde_json::json!({
        "model_overrides": { "small": { "status_override": 503 } },
    }))
    .unwrap();
    let p = Pipeline::new(sim, &format!("{UNBATCHED}[llm.retry]\nmax_attempts = 1\n"));
    let tasks_section = "[tasks]\nmax_bytes = 4096\n";
    p.edit_config(&[
        (
            "breaker = { open_ms = 2000 }",
            "breaker = { consecutive_failures = 1000000, min_requests = 1000000 }",
        ),
        (
            tasks_section,
            &format!("{tasks_section}max_attempts = {MAX_ATTEMPTS}\n"),
        ),
    ]);

    let mut app = p.start("failing");
    let tasks: Vec<Task> = (0..N)
        .map(|i| {
            let t = if i < 12 { "summarize" } else { "classify" };
            Task::new(i, t, ["acme", "globex"][i % 2], "normal")
        })
        .collect();
    p.produce(&tasks);
    let dead = eventually(Duration::from_secs(180), "every task dead-lettered", || {
        let dead: Vec<_> = TYPES.iter().flat_map(|t| p.dead_letters(t)).collect();
        (dead.len() >= N).then_some(dead)
    });
    app.proc.stop();
    assert_eq!(dead.len(), N, "each task dead-lettered once");
    let by_id: HashMap<&str, &Task> = tasks.iter().map(|t| (t.id.as_str(), t)).collect();
    for m in &dead {
        assert_eq!(header(m, "dlq.category").as_deref(), Some("exhausted"));
        let v: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
        assert_eq!(v["attemptNumber"], MAX_ATTEMPTS, "the last delivery");
        let task = by_id[v["taskId"].as_str().unwrap()];
        assert_eq!(
            header(m, "traceparent").as_deref(),
            Some(task.traceparent.as_str()),
            "the dead letter keeps the task's trace context"
        );
    }
    (p, tasks)
}

#[test]
fn replay_completes_dead_lettered_tasks_once_and_a_second_replay_adds_nothing() {
    let (p, tasks) = dead_lettered();

    // Inspect: every dead letter counted as exhausted, no payload printed.
    let report = dlq_json(&p, "inspect", &["--samples", "20"]);
    assert_eq!(report["matched"], N);
    assert_eq!(report["byCategory"], serde_json::json!({ "exhausted": N }));
    assert_eq!(report["byTopic"][p.dlq("summarize")], 12);
    assert_eq!(report["byTopic"][p.dlq("classify")], 8);
    assert_eq!(report["byReason"][0]["reason"], "exhausted");
    assert_eq!(report["byReason"][0]["count"], N);
    assert_eq!(report["samples"].as_array().unwrap().len(), N);
    for s in report["samples"].as_array().unwrap() {
        assert_eq!(s["attemptNumber"], MAX_ATTEMPTS);
        assert!(tasks.iter().any(|t| s["taskId"] == t.id.as_str()));
    }
    let text = dlq(&p, "inspect", &["--samples", "20"]);
    let json_text = dlq(&p, "inspect", &["--samples", "20", "--json"]);
    for out in [&text, &json_text] {
        assert!(out.contains(&tasks[0].id), "samples name the tasks: {out}");
        for t in &tasks {
            assert!(!out.contains(&t.content), "a prompt was printed: {out}");
        }
        assert!(!out.contains("quick brown fox"), "{out}");
    }
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["exhausted", &N.to_string()]),
        "{text}"
    );
    // A type alone; a look-up by time that covers them all.
    assert_eq!(
        dlq_json(&p, "inspect", &["--type", "classify"])["matched"],
        8
    );
    assert_eq!(dlq_json(&p, "inspect", &["--since", "1h"])["matched"], N);

    // A dry run, a limit and filters that match nothing publish nothing.
    let ends = task_topic_ends(&p);
    let dry = dlq_json(&p, "replay", &["--dry-run"]);
    assert_eq!(dry["matched"], N);
    assert_eq!(dry["replayed"], 0);
    let lines = dlq(&p, "replay", &["--dry-run"]);
    assert_eq!(
        lines
            .lines()
            .filter(|l| l.starts_with("would replay"))
            .count(),
        N
    );
    assert_eq!(
        dlq_json(&p, "replay", &["--dry-run", "--limit", "5"])["matched"],
        5
    );
    let now = chrono::Utc::now().to_rfc3339();
    for filter in [
        &["--category", "poison"][..],
        &["--category", "content_policy", "--category", "bad_request"],
        &["--since", &now],
        &["--until", "2000-01-01T00:00:00Z"],
        &["--reason", "no such reason"],
    ] {
        let s = dlq_json(&p, "replay", filter);
        assert_eq!(s["matched"], 0, "{filter:?}");
        assert_eq!(s["replayed"], 0, "{filter:?}");
    }
    assert_eq!(task_topic_ends(&p), ends, "nothing was published");

    // The provider fixed, the pipeline restarted: a replay completes every
    // task, once, with its own trace context and a fresh attempt count.
    p.sim.update(|c| c.model_overrides.clear()).unwrap();
    let mut app = p.start("healthy");
    let s = dlq_json(&p, "replay", &["--rate", "100"]);
    assert_eq!(
        (
            s["matched"].clone(),
            s["replayed"].clone(),
            s["failed"].clone()
        ),
        (N.into(), N.into(), 0.into())
    );
    let results = eventually(Duration::from_secs(120), "every task completed", || {
        let r = completed(&p);
        (count_by_task(&r).len() >= N).then_some(r)
    });
    let by_id: HashMap<&str, &Task> = tasks.iter().map(|t| (t.id.as_str(), t)).collect();
    let check = |results: &[(sluice::envelope::TaskResult, rdkafka::message::OwnedMessage)]| {
        let counts = count_by_task(results);
        assert_eq!(counts.len(), N, "every task completed");
        assert!(
            counts.values().all(|n| *n == 1),
            "exactly one completed result per task: {counts:?}"
        );
        for (r, m) in results {
            let task = by_id[r.task_id.as_str()];
            assert!(r.success);
            assert_eq!(r.attempts, 1, "a fresh attempt count");
            // A span of its own under the task's original trace.
            let sent = TraceParent::parse(&task.traceparent).unwrap();
            let own = TraceParent::parse(&header(m, "traceparent").unwrap_or_default());
            assert!(
                own.is_some_and(|o| o.trace_id == sent.trace_id && o.span_id != sent.span_id),
                "{}: {own:?}",
                r.task_id
            );
        }
    };
    check(&results);
    // The replayed tasks on the task topics: attempt 1, naming their dead letter.
    let topics: Vec<String> = TYPES.iter().map(|t| p.topic(t)).collect();
    let t: Vec<&str> = topics.iter().map(String::as_str).collect();
    let replayed: Vec<_> = read_topics(&p.cluster, &t, true, Duration::from_secs(3), |_| false)
        .unwrap()
        .into_iter()
        .filter(|m| header(m, "sluice.replay.of").is_some())
        .collect();
    assert_eq!(replayed.len(), N);
    for m in &replayed {
        let v: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
        assert_eq!(v["attemptNumber"], 1);
        assert!(header(m, "dlq.category").is_none());
        assert!(header(m, "sluice.replay.of")
            .unwrap()
            .starts_with(&format!("{}.tasks.", p.prefix)));
    }

    // A second replay adds no result: once the group consumed past it,
    // still exactly one completed result per task.
    let duplicates = p.metric(&app, "sluice_duplicates_skipped_total");
    let s = dlq_json(&p, "replay", &["--rate", "100"]);
    assert_eq!(s["replayed"], N);
    let ends = task_topic_ends(&p);
    eventually(
        Duration::from_secs(120),
        "the group consumed the second replay",
        || {
            let c = committed(&p);
            ends.iter()
                .all(|(k, end)| c.get(k).is_some_and(|o| o >= end))
                .then_some(())
        },
    );
    check(&completed(&p));
    assert_eq!(
        p.metric(&app, "sluice_duplicates_skipped_total") - duplicates,
        N as f64,
        "each replayed task that had succeeded counted as a duplicate skipped"
    );
    app.proc.stop();
}

#[test]
fn bad_flags_fail_naming_the_flag() {
    let dir = temp_dir();
    let config = dir.path().join("sluice.toml");
    std::fs::write(&config, sluice::config::MINIMAL).unwrap();
    let config = config.display().to_string();
    for (args, flag) in [
        (&["inspect", "--category", "exausted"][..], "--category"),
        (
            &["replay", "--category", "poison", "--category", "?"],
            "--category",
        ),
        (&["inspect", "--since", "yesterday"], "--since"),
        (&["replay", "--since", "2026-13-01T00:00:00Z"], "--since"),
        (&["replay", "--until", "5x"], "--until"),
        (&["replay", "--rate", "0"], "--rate"),
        (&["inspect", "--type", "translate"], "--type"),
        (&["replay", "--since", "1h", "--until", "2h"], "--since"),
    ] {
        let mut all = args.to_vec();
        all.extend(["--config", &config]);
        let out = sluice_dlq(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}
