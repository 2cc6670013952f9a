//! Slow LLM calls across rolling restarts and scaling: several `sluice run`
//! instances of one group under exactly-once, 40 s simulated calls in flight
//! on every instance while instances stop, start, join and leave. Every task
//! gets exactly one result and the provider sees exactly one call per task
//! (none abandoned and made again); with the classic protocol's eager
//! rebalances and a drain shorter than the calls, the same run pays for
//! calls twice.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::pipeline::*;
use common::{eventually, temp_dir};
use sluice::sim::SimConfig;

/// Simulated call latency: the seeds' document extraction (20–40 s).
const CALL_MS: u64 = 40_000;
/// Tasks published while instances come and go.
const TASKS: usize = 300;
/// How long publishing them takes, so calls are in flight at every step.
const PUBLISH_OVER: Duration = Duration::from_secs(60);
/// Pause between one instance being ready again and the next stopping.
const STEP_GAP: Duration = Duration::from_secs(15);

/// A pipeline of 6-partition topics whose calls take [`CALL_MS`] under a
/// 60 s model timeout, with `edits` applied to its config.
fn slow_pipeline(edits: &[(&str, &str)]) -> Pipeline {
    let sim = SimConfig::from_json_value(
        serde_json::json!({ "latency": { "kind": "fixed", "ms": CALL_MS } }),
    )
    .unwrap();
    let p = Pipeline::with_partitions(sim, "exactly_once", UNBATCHED, 6, &[]);
    // Both models' timeouts above the calls' latency.
    p.edit_config(&[
        ("timeout_ms = 30000", "timeout_ms = 60000"),
        ("timeout_ms = 30000", "timeout_ms = 60000"),
    ]);
    // A cloud provider's answer to load is a 429, not a queue: no latency
    // learned concurrency cap (its slow start would keep most of the tasks
    // queued in the client rather than in flight at the provider).
    p.edit_config(&[
        (
            "limiter = { initial_rps = 400 }",
            "limiter = { initial_rps = 400, concurrency = { enabled = false } }",
        ),
        (
            "limiter = { initial_rps = 400 }",
            "limiter = { initial_rps = 400, concurrency = { enabled = false } }",
        ),
    ]);
    p.edit_config(edits);
    p
}

/// The tasks an instance runs, from its `/readyz`.
fn tasks_of(p: &Pipeline, app: &App) -> usize {
    let (_, body) = p.http(app, "/readyz");
    serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["tasks"].as_array().map(Vec::len))
        .unwrap_or(0)
}

/// One instance of the group: its own state directory and config, and, when
/// `static_id`, its own `group.instance.id` (as the Helm chart gives each pod
/// its name).
struct Member {
    name: String,
    config: PathBuf,
    _state: tempfile::TempDir,
    static_id: bool,
    app: Option<App>,
    /// Calls this member's earlier processes abandoned (their `STOPPED`
    /// lines).
    abandoned_before: f64,
}

impl Member {
    fn new(p: &Pipeline, name: &str, static_id: bool) -> Member {
        let state = temp_dir();
        let text = std::fs::read_to_string(&p.config).unwrap().replace(
            &format!("state_dir = \"{}\"", p.state.path().display()),
            &format!("state_dir = \"{}\"", state.path().display()),
        );
        let config = state.path().join("sluice.toml");
        std::fs::write(&config, text).unwrap();
        Member {
            name: name.into(),
            config,
            _state: state,
            static_id,
            app: None,
            abandoned_before: 0.0,
        }
    }

    /// Starts the instance and waits until it is ready (`Running`, every
    /// assigned task processing), as a rolling update waits for a pod.
    fn start(&mut self, p: &Pipeline) {
        let id = format!("{}-{}", p.prefix, self.name);
        let env: Vec<(&str, &str)> = match self.static_id {
            true => vec![("SLUICE_KAFKA__GROUP_INSTANCE_ID", id.as_str())],
            false => vec![],
        };
        let app = p.start_with(&self.name, Path::new(&self.config), &env, false);
        let started = Instant::now();
        eventually(Duration::from_secs(120), "the instance is ready", || {
            (p.http(&app, "/readyz").0 == 200).then_some(())
        });
        eprintln!("{} ready after {:?}", self.name, started.elapsed());
        self.app = Some(app);
    }

    /// SIGTERM, and the wait for the drain and the final commit.
    fn stop(&mut self, p: &Pipeline) {
        if let Some(mut app) = self.app.take() {
            let started = Instant::now();
            let served = p.sim.stats().served_ok;
            app.proc.stop();
            let abandoned: f64 = app
                .proc
                .lines()
                .iter()
                .find_map(|l| l.strip_prefix("STOPPED calls_abandoned="))
                .unwrap_or_else(|| panic!("{} stopped cleanly (a STOPPED line)", self.name))
                .parse()
                .unwrap();
            self.abandoned_before += abandoned;
            eprintln!(
                "{} stopped after {:?}: {} calls answered meanwhile, {abandoned} abandoned",
                self.name,
                started.elapsed(),
                p.sim.stats().served_ok - served
            );
        }
    }

    /// Calls abandoned by this member's processes so far (a running
    /// process's read from its metrics).
    fn abandoned(&self, p: &Pipeline) -> f64 {
        self.abandoned_before
            + self
                .app
                .as_ref()
                .map_or(0.0, |a| p.metric(a, "sluice_calls_abandoned_total"))
    }
}

/// Publishes [`TASKS`] classify tasks of 30 tenants evenly over
/// [`PUBLISH_OVER`] on a thread of its own; returns them and the thread.
fn publish_slowly(p: &Pipeline) -> (Vec<Task>, std::thread::JoinHandle<()>) {
    let tasks: Vec<Task> = (0..TASKS)
        .map(|i| Task::new(i, "classify", &format!("tenant-{}", i % 30), "normal"))
        .collect();
    let cluster = p.cluster.clone();
    let topic = p.topic("classify");
    let records: Vec<_> = tasks.iter().map(Task::record).collect();
    let handle = std::thread::spawn(move || {
        let chunk = 10;
        let pause = PUBLISH_OVER / (TASKS / chunk) as u32;
        for recs in records.chunks(chunk) {
            sluice::kafka::produce(&cluster, &topic, recs.to_vec()).unwrap();
            std::thread::sleep(pause);
        }
    });
    (tasks, handle)
}

/// What a run came to: every task answered once, and the provider's calls.
fn settle(p: &Pipeline, tasks: &[Task], members: &mut [Member]) -> (u64, f64) {
    let results = p.results(tasks.len(), Duration::from_secs(300));
    assert_each_answered_once(tasks, &results);
    let calls = p.sim.stats().requests_total;
    let abandoned: f64 = members.iter().map(|m| m.abandoned(p)).sum();
    eprintln!(
        "{} tasks, {} results, {calls} provider calls, {abandoned} abandoned by the instances",
        tasks.len(),
        results.len()
    );
    // All at once, as a scale to zero: their drains overlap, instead of each
    // stop moving tasks onto members that stop next (with eager rebalances
    // and 30 s drains, one stop after another took more than 90 s each).
    for m in members.iter() {
        if let Some(app) = &m.app {
            app.proc.terminate();
        }
    }
    for m in members.iter_mut() {
        m.stop(p);
    }
    (calls, abandoned)
}

/// Three instances, each restarted in turn: stopped with SIGTERM, started
/// again, ready, then the next one 15 s later.
fn rolling_restart(p: &Pipeline, static_ids: bool) -> (u64, f64) {
    let mut members: Vec<Member> = (0..3)
        .map(|i| Member::new(p, &format!("m{i}"), static_ids))
        .collect();
    for m in &mut members {
        m.start(p);
    }
    let (tasks, publisher) = publish_slowly(p);
    std::thread::sleep(Duration::from_secs(10));
    for m in &mut members {
        m.stop(p);
        m.start(p);
        std::thread::sleep(STEP_GAP);
    }
    publisher.join().unwrap();
    settle(p, &tasks, &mut members)
}

#[test]
fn a_rolling_restart_makes_each_slow_call_once() {
    let p = slow_pipeline(&[]);
    let (calls, abandoned) = rolling_restart(&p, true);
    assert_eq!(abandoned, 0.0, "no call abandoned");
    assert_eq!(calls, TASKS as u64, "provider calls = tasks");
}

#[test]
fn scaling_out_and_in_makes_each_slow_call_once() {
    let p = slow_pipeline(&[]);
    let mut members: Vec<Member> = (0..4)
        .map(|i| Member::new(&p, &format!("m{i}"), true))
        .collect();
    for m in &mut members[..3] {
        m.start(&p);
    }
    let (tasks, publisher) = publish_slowly(&p);
    std::thread::sleep(Duration::from_secs(10));
    // One instance added: partitions move to it from the others, whose
    // moving tasks drain their calls first.
    members[3].start(&p);
    let added = members[3].app.as_ref().unwrap();
    eventually(
        Duration::from_secs(60),
        "the new instance has tasks",
        || (tasks_of(&p, added) > 0).then_some(()),
    );
    std::thread::sleep(STEP_GAP);
    // One removed for good: its partitions go to the others.
    members[1].stop(&p);
    publisher.join().unwrap();
    let (calls, abandoned) = settle(&p, &tasks, &mut members);
    assert_eq!(abandoned, 0.0, "no call abandoned");
    assert_eq!(calls, TASKS as u64, "provider calls = tasks");
}

/// The same rolling restart as before incremental rebalancing: the classic
/// protocol (every rebalance revokes every task of every instance), no
/// static membership, and the drain of 30 s that was the default. Calls
/// still running when a drain ends are abandoned and made again by the next
/// owner: the provider is paid for more calls than there are tasks (while
/// each task still has exactly one result).
#[test]
fn eager_rebalances_with_a_short_drain_pay_for_calls_twice() {
    let p = slow_pipeline(&[
        (
            "session_timeout_ms = 6000",
            "session_timeout_ms = 6000\ngroup_protocol = \"classic\"",
        ),
        (
            "max_in_flight_per_partition = 2000",
            "max_in_flight_per_partition = 2000\ndrain_timeout_ms = 30000",
        ),
    ]);
    let (calls, abandoned) = rolling_restart(&p, false);
    assert!(abandoned > 0.0, "calls abandoned: {abandoned}");
    assert!(
        calls > TASKS as u64,
        "more provider calls ({calls}) than tasks ({TASKS})"
    );
}
