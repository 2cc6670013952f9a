//! Per-tenant accounting in `sluice run` against the broker and the
//! simulated provider: usage windows equal the sum of the results across
//! crashes and instances, each alert once, hard quotas never passed.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::pipeline::*;
use common::{bootstrap, eventually};
use rdkafka::message::OwnedMessage;
use rdkafka::Message;
use sluice::accounting::{AlertRecord, TenantUsage, UsageRecord, WindowSpec};
use sluice::envelope::TaskResult;
use sluice::kafka::read_topics;
use sluice::sim::SimConfig;

type WindowKey = (String, String, i64);

fn read_all(topic: &str) -> Vec<OwnedMessage> {
    read_topics(&bootstrap(), &[topic], true, Duration::from_secs(5), |_| {
        false
    })
    .unwrap()
}

/// Usage records read committed: how many, and the last per window.
fn usage_records(p: &Pipeline) -> (usize, BTreeMap<WindowKey, UsageRecord>) {
    let mut last = BTreeMap::new();
    let mut n = 0;
    for m in read_all(&format!("{}.usage", p.prefix)) {
        let u: UsageRecord = serde_json::from_slice(m.payload().unwrap()).unwrap();
        assert_eq!(m.key(), Some(u.tenant_id.as_bytes()));
        n += 1;
        // A tenant's updates are in one partition, in order: the last holds
        // its window's totals.
        last.insert((u.tenant_id.clone(), u.window.clone(), u.window_start), u);
    }
    (n, last)
}

/// For every tenant and window, the last usage record equals the sum over
/// the tenant's completed results (tokens, cost, per model), and there is
/// one update per completed result and window.
fn assert_usage_equals_results(
    p: &Pipeline,
    results: &[(TaskResult, OwnedMessage)],
    windows: &[WindowSpec],
    crashed: bool,
) {
    let mut want: BTreeMap<WindowKey, TenantUsage> = BTreeMap::new();
    for (r, _) in results.iter().filter(|(r, _)| r.success) {
        let at = r.completed_at.timestamp_millis();
        for w in windows {
            let start = at - at.rem_euclid(w.size_ms);
            want.entry((r.tenant_id.clone(), w.name.clone(), start))
                .or_default()
                .add(r);
        }
    }
    let (updates, got) = usage_records(p);
    let completed = results.iter().filter(|(r, _)| r.success).count();
    assert_eq!(got.len(), want.len(), "windows with usage");
    for (key, w) in &want {
        let u = &got[key];
        assert_eq!(
            (
                u.requests,
                u.input_tokens,
                u.output_tokens,
                u.cached_tokens,
                u.cost_micros
            ),
            (
                w.total.requests,
                w.total.input_tokens,
                w.total.output_tokens,
                w.total.cached_tokens,
                w.total.cost_micros
            ),
            "{key:?}"
        );
        assert_eq!(u.by_model, w.by_model, "{key:?}");
    }
    // A crash may leave some updates of an interrupted transaction visible
    // (the test broker exposes them); without one, exactly one per result.
    if !crashed {
        assert_eq!(
            updates,
            completed * windows.len(),
            "one update per result and window"
        );
    }
}

#[test]
fn each_tenants_usage_windows_equal_the_sum_of_its_results() {
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 30 },
        "content_policy_rate": 0.02,
    }))
    .unwrap();
    let p = Pipeline::new(sim, "");
    let mut app = p.start("usage");
    let tasks = mixed_tasks(1_200);
    p.produce(&tasks);
    let results = p.results(tasks.len(), Duration::from_secs(180));
    assert_each_answered_once(&tasks, &results);
    assert_usage_equals_results(&p, &results, &sluice::accounting::default_windows(), false);
    app.proc.stop();
}

/// `n` classify tasks over `tenants` tenants.
fn tenant_tasks(n: usize, tenants: usize, from: usize) -> Vec<Task> {
    (from..from + n)
        .map(|i| Task::new(i, "classify", &format!("tenant-{}", i % tenants), "normal"))
        .collect()
}

/// Waits until at least `n` results are out (read uncommitted).
fn wait_results(p: &Pipeline, n: usize) {
    eventually(Duration::from_secs(240), "results", || {
        let got = read_topics(
            &bootstrap(),
            &[&p.completed(), &p.failed()],
            false,
            Duration::from_secs(1),
            |_| false,
        )
        .unwrap()
        .len();
        (got >= n).then_some(())
    });
}

/// 20,000 tasks of 50 tenants under exactly-once, with micro-batching off
/// (a call per task) or on, on one instance or two: the instances are
/// killed with SIGKILL twice mid-run and restarted.
fn usage_survives_two_sigkills(extra: &str, two_instances: bool) {
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 60 },
        "error_rate": 0.01,
    }))
    .unwrap();
    let p = Pipeline::new(sim, &format!("[llm.retry]\nmax_attempts = 1\n{extra}"));
    let mut a = p.start("acct-a");
    let mut b = two_instances.then(|| p.start_other("acct-b", ""));
    let tasks = tenant_tasks(20_000, 50, 0);
    p.produce(&tasks);
    wait_results(&p, tasks.len() / 4);
    a.proc.kill9();
    let mut a = p.start("acct-a2");
    wait_results(&p, tasks.len() * 3 / 5);
    match b.as_mut() {
        Some((b, _)) => b.proc.kill9(),
        None => a.proc.kill9(),
    }
    let restarted = if two_instances {
        b = Some(p.start_other("acct-b2", ""));
        a
    } else {
        p.start("acct-a3")
    };
    let results = p.results(tasks.len(), Duration::from_secs(300));
    assert_each_answered_once(&tasks, &results);
    assert_results_bill_what_the_provider_billed_at_least(&p, &results);
    assert_usage_equals_results(&p, &results, &sluice::accounting::default_windows(), true);
    let mut restarted = restarted;
    restarted.proc.stop();
    if let Some((mut b, _)) = b {
        b.proc.stop();
    }
}

/// Calls abandoned by a kill were billed by the provider but answered again
/// after the restart: results bill at most what the provider billed.
fn assert_results_bill_what_the_provider_billed_at_least(
    p: &Pipeline,
    results: &[(TaskResult, OwnedMessage)],
) {
    let stats = p.sim.stats();
    let input: u64 = results.iter().map(|(r, _)| r.input_tokens).sum();
    assert!(
        input <= stats.prompt_tokens,
        "{input} > {}",
        stats.prompt_tokens
    );
    assert!(input > 0);
}

#[test]
fn usage_is_exact_across_two_sigkills_with_a_call_per_task() {
    usage_survives_two_sigkills(UNBATCHED, false);
}

#[test]
fn usage_is_exact_across_two_sigkills_with_micro_batching_and_two_instances() {
    usage_survives_two_sigkills("", true);
}

/// A crash inside a commit, after the outputs (or also the changelogs)
/// reached the broker: the test broker exposes that interrupted transaction
/// to `read_committed` readers, so its results and usage updates count, and
/// the windows must count them exactly once.
fn usage_exact_after_a_crash_inside_a_commit(failpoint: &str) {
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 50 },
        "error_rate": 0.1,
    }))
    .unwrap();
    let p = Pipeline::new(sim, "[llm.retry]\nmax_attempts = 1\n");
    let mut first = p.start_env("acct-crash-1", &[("SLUICE_FAILPOINT", failpoint)]);
    let tasks = mixed_tasks(1_000);
    p.produce(&tasks);
    let status = eventually(
        Duration::from_secs(120),
        "the failpoint aborts the process",
        || first.proc.child.try_wait().unwrap(),
    );
    assert!(!status.success());
    let mut app = p.start("acct-crash-2");
    let results = p.results(tasks.len(), Duration::from_secs(180));
    assert_each_answered_once(&tasks, &results);
    assert_usage_equals_results(&p, &results, &sluice::accounting::default_windows(), true);
    eprintln!(
        "recovered: {}",
        p.metric(&app, "sluice_results_recovered_total")
    );
    app.proc.stop();
}

#[test]
fn usage_is_exact_after_a_crash_once_changelogs_were_written() {
    usage_exact_after_a_crash_inside_a_commit("eos_after_changelog_flush:3");
}

/// A quota window of this size (ms), aligned to the epoch.
const QUOTA_WINDOW_MS: i64 = 40_000;

/// Waits for the start of the next quota window (plus a little).
fn next_quota_window() {
    let now = chrono::Utc::now().timestamp_millis();
    let wait = QUOTA_WINDOW_MS - now.rem_euclid(QUOTA_WINDOW_MS) + 100;
    std::thread::sleep(Duration::from_millis(wait as u64));
}

#[test]
fn a_hard_token_quota_holds_for_500_concurrent_tasks_on_two_instances() {
    let quota: u64 = 6_000;
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 20, "max_ms": 200 },
    }))
    .unwrap();
    let p = Pipeline::new(
        sim,
        &format!(
            r#"
[[accounting.windows]]
name = "q"
size_ms = {QUOTA_WINDOW_MS}
retention_ms = 600000

[accounting.quotas.tenants.capped]
window = "q"
tokens = {quota}
"#
        ),
    );
    let mut a = p.start("quota-a");
    let (mut b, _state) = p.start_other("quota-b", "");
    eventually(Duration::from_secs(90), "both ready", || {
        (p.http(&b, "/readyz").0 == 200).then_some(())
    });
    next_quota_window();
    // 500 tasks of the capped tenant and 200 of others, all at once.
    let capped: Vec<Task> = (0..500)
        .map(|i| Task::new(i, "classify", "capped", "normal"))
        .collect();
    let others = tenant_tasks(200, 4, 1_000);
    let mut all = capped.clone();
    all.extend(others.iter().cloned());
    p.produce(&all);
    let results = p.results(all.len(), Duration::from_secs(180));
    assert_each_answered_once(&all, &results);
    let of = |tenant: &str| -> Vec<&TaskResult> {
        results
            .iter()
            .map(|(r, _)| r)
            .filter(|r| r.tenant_id == tenant)
            .collect()
    };
    let capped_results = of("capped");
    let billed: u64 = capped_results
        .iter()
        .filter(|r| r.success)
        .map(|r| r.input_tokens + r.output_tokens)
        .sum();
    let done = capped_results.iter().filter(|r| r.success).count();
    let refused: Vec<&&TaskResult> = capped_results.iter().filter(|r| !r.success).collect();
    assert!(
        billed <= quota,
        "billed {billed} tokens over a quota of {quota}"
    );
    assert!(done >= 50, "only {done} completed under the quota");
    assert_eq!(done + refused.len(), 500);
    assert!(refused
        .iter()
        .all(|r| r.error_code.as_deref() == Some("quota_exceeded")));
    assert!(
        p.dead_letters("classify").is_empty(),
        "refusals are not dead letters"
    );
    for tenant in (0..4).map(|i| format!("tenant-{i}")) {
        assert!(of(&tenant).iter().all(|r| r.success), "{tenant} unaffected");
    }
    let rejections = p.metric(&a, "sluice_quota_rejections_total")
        + p.metric(&b, "sluice_quota_rejections_total");
    assert_eq!(rejections as usize, refused.len());
    // The next window starts with a fresh quota.
    next_quota_window();
    let again: Vec<Task> = (500..520)
        .map(|i| Task::new(i, "classify", "capped", "normal"))
        .collect();
    p.produce(&again);
    let later = p.results(all.len() + again.len(), Duration::from_secs(120));
    let fresh: Vec<&TaskResult> = later
        .iter()
        .map(|(r, _)| r)
        .filter(|r| again.iter().any(|t| t.id == r.task_id))
        .collect();
    assert_eq!(fresh.len(), 20);
    assert!(fresh.iter().all(|r| r.success), "a fresh quota");
    a.proc.stop();
    b.proc.stop();
}

/// Alerts on the alerts topic, read committed.
fn alerts(p: &Pipeline) -> Vec<AlertRecord> {
    read_all(&format!("{}.alerts", p.prefix))
        .iter()
        .map(|m| serde_json::from_slice(m.payload().unwrap()).unwrap())
        .collect()
}

/// The last usage record's cost of a tenant's window.
fn spent(p: &Pipeline, tenant: &str, window: &str) -> i64 {
    usage_records(p)
        .1
        .into_iter()
        .filter(|((t, w, _), _)| t == tenant && w == window)
        .map(|(_, u)| u.cost_micros)
        .max()
        .unwrap_or(0)
}

#[test]
fn crossing_a_budget_alerts_three_times_across_a_restart_and_a_redelivery() {
    let budget: i64 = 2_000;
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 30 },
    }))
    .unwrap();
    // One window that never ends during the test.
    let p = Pipeline::new(
        sim,
        &format!(
            r#"
[[accounting.windows]]
name = "year"
size_ms = 31536000000
retention_ms = 31536000000

[accounting.budgets.tenants.spender]
year = {budget}
"#
        ),
    );
    let mut app = p.start("alerts-1");
    let mut sent: Vec<Task> = Vec::new();
    // Spend in small steps until `fraction` of the budget is passed.
    let spend_past = |p: &Pipeline, fraction: f64, sent: &mut Vec<Task>| {
        while (spent(p, "spender", "year") as f64) < fraction * budget as f64 {
            // About an eighth of the budget a step.
            let next: Vec<Task> = (sent.len()..sent.len() + 25)
                .map(|i| Task::new(i, "classify", "spender", "normal"))
                .collect();
            p.produce(&next);
            sent.extend(next);
            p.results(sent.len(), Duration::from_secs(60));
        }
    };
    spend_past(&p, 0.5, &mut sent);
    assert_eq!(alerts(&p).len(), 1, "50 %");
    app.proc.stop();
    let mut app = p.start("alerts-2");
    // Every task so far delivered again: answered, not counted again.
    p.produce(&sent);
    spend_past(&p, 1.2, &mut sent);
    let got = alerts(&p);
    let thresholds: Vec<f64> = got.iter().map(|a| a.threshold).collect();
    assert_eq!(thresholds, vec![0.5, 0.8, 1.0], "{got:?}");
    assert!(got.iter().all(|a| a.tenant_id == "spender"
        && a.window == "year"
        && a.budget_micros == budget
        && a.kind == "budget"));
    for a in &got {
        assert!(a.spent_micros as f64 >= a.threshold * budget as f64);
    }
    app.proc.stop();
}
