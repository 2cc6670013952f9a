//! Per-tenant accounting in `sluice run` against the broker and the
//! simulated provider: usage windows equal the sum of the results across
//! crashes and instances, each alert once, hard quotas never passed.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::pipeline::*;
use common::{bootstrap, eventually, OwnBroker};
use rdkafka::message::OwnedMessage;
use rdkafka::Message;
use sluice::envelope::TaskResult;
use sluice::http::usage::TenantUsageReport;
use sluice::kafka::{produce, read_topics, OutRecord};
use sluice::sim::SimConfig;
use sluice::steps::account::{
    default_windows, AlertRecord, ModelUsage, TenantUsage, UsageRecord, UsageUpdates, WindowSpec,
    WindowUsage,
};

type WindowKey = (String, String, i64);

/// Every record of `topic` of `p`'s cluster, read committed.
fn read_all(p: &Pipeline, topic: &str) -> Vec<OwnedMessage> {
    read_topics(&p.cluster, &[topic], true, Duration::from_secs(5), |_| {
        false
    })
    .unwrap()
}

/// The usage records of a window, read committed, in order.
type WindowRecords = Vec<WindowUsage>;

/// Usage records read committed, per window. A tenant's updates are in one
/// partition, in order: the last holds its window's totals.
fn usage_records(p: &Pipeline) -> BTreeMap<WindowKey, WindowRecords> {
    let mut windows: BTreeMap<WindowKey, WindowRecords> = BTreeMap::new();
    for m in read_all(p, &format!("{}.usage", p.prefix)) {
        let u: UsageRecord = serde_json::from_slice(m.payload().unwrap()).unwrap();
        assert_eq!(m.key(), Some(u.tenant_id.as_bytes()));
        let key = (u.tenant_id, u.usage.window.clone(), u.usage.window_start);
        windows.entry(key).or_default().push(u.usage);
    }
    windows
}

/// The sums of the accounted results (answered or billed) per tenant window.
fn sums(
    results: &[(TaskResult, OwnedMessage)],
    windows: &[WindowSpec],
) -> BTreeMap<WindowKey, TenantUsage> {
    let mut want: BTreeMap<WindowKey, TenantUsage> = BTreeMap::new();
    for (r, _) in results.iter().filter(|(r, _)| r.accounted()) {
        let at = r.completed_at.timestamp_millis();
        for w in windows {
            let start = w.start_of(at);
            want.entry((r.tenant_id.clone(), w.name.clone(), start))
                .or_default()
                .add(r);
        }
    }
    want
}

/// Judged by every usage record read committed, crashes or not: for every
/// tenant and window, the last record equals the sum over the tenant's
/// completed results (tokens, cost, per model), each record is a new state
/// of its window (more requests than the one before: no result counted
/// twice, no update repeated), and with `on_update` there is one record per
/// completed result and window.
fn assert_usage_equals_results(
    p: &Pipeline,
    results: &[(TaskResult, OwnedMessage)],
    windows: &[WindowSpec],
    updates: UsageUpdates,
) {
    let want = sums(results, windows);
    let records = usage_records(p);
    let mut differ: BTreeMap<WindowKey, String> = BTreeMap::new();
    for key in want.keys().chain(records.keys()) {
        let sums = want.get(key).cloned().unwrap_or_default();
        let by_model: BTreeMap<String, ModelUsage> = sums.by_model.into();
        let expected = (
            sums.total.requests,
            sums.total.input_tokens,
            sums.total.output_tokens,
            sums.total.cached_tokens,
            sums.total.cost_micros,
        );
        let last = records.get(key).and_then(|rs| rs.last()).map(|u| {
            (
                (
                    u.requests,
                    u.input_tokens,
                    u.output_tokens,
                    u.cached_tokens,
                    u.cost_micros,
                ),
                &u.by_model,
            )
        });
        if last != Some((expected, &by_model)) {
            let last = last.map(|(t, _)| t);
            differ.insert(key.clone(), format!("{last:?} against {expected:?}"));
        }
    }
    assert!(
        differ.is_empty(),
        "{} windows differ from the sums of their results: {differ:?}",
        differ.len()
    );
    for (key, rs) in &records {
        let requests: Vec<u64> = rs.iter().map(|u| u.requests).collect();
        assert!(
            requests.windows(2).all(|w| w[0] < w[1]),
            "{key:?}: each update a new state, got requests {requests:?}"
        );
    }
    let completed = results.iter().filter(|(r, _)| r.accounted()).count();
    let n: usize = records.values().map(Vec::len).sum();
    match updates {
        UsageUpdates::OnUpdate => assert_eq!(
            n,
            completed * windows.len(),
            "one update per result and window"
        ),
        UsageUpdates::OnCommit => eprintln!(
            "{n} usage records for {} window updates",
            completed * windows.len()
        ),
    }
}

/// Every tenant's current windows as `GET /v1/tenants/{id}/usage` on `app`
/// reads them from the window stores (locally or on the owner) equal the
/// sums over the tenant's completed results in those windows.
fn assert_stores_equal_results(
    p: &Pipeline,
    app: &App,
    results: &[(TaskResult, OwnedMessage)],
    tenants: &[String],
) {
    let mut differ = BTreeMap::new();
    for tenant in tenants {
        let path = format!("/v1/tenants/{tenant}/usage");
        let report: TenantUsageReport = eventually(Duration::from_secs(60), &path, || {
            let (code, body) = p.http(app, &path);
            (code == 200).then(|| serde_json::from_str(&body).unwrap())
        });
        assert!(!report.windows.is_empty());
        for got in &report.windows {
            let mut sum = TenantUsage::default();
            for (r, _) in results {
                let at = r.completed_at.timestamp_millis();
                if r.accounted()
                    && &r.tenant_id == tenant
                    && (got.window_start..got.window_end).contains(&at)
                {
                    sum.add(r);
                }
            }
            let spec = default_windows()
                .into_iter()
                .find(|w| w.name == got.window)
                .unwrap_or_else(|| {
                    WindowSpec::fixed(&got.window, got.window_end - got.window_start, 0)
                });
            let want = WindowUsage::new(&spec, got.window_start, sum);
            if got != &want {
                let key = (tenant.clone(), got.window.clone(), got.window_start);
                differ.insert(key, format!("store {got:?} against results {want:?}"));
            }
        }
    }
    assert!(
        differ.is_empty(),
        "{} windows differ from the sums of their results: {differ:?}",
        differ.len()
    );
}

/// 1,200 mixed tasks; the usage records written `updates`.
fn usage_windows_equal_the_sum_of_their_results(updates: UsageUpdates) {
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 30 },
        "content_policy_rate": 0.02,
    }))
    .unwrap();
    let mode = serde_json::to_value(updates).unwrap();
    let p = Pipeline::new(sim, &format!("[accounting]\nusage_updates = {mode}\n"));
    let mut app = p.start("usage");
    let tasks = mixed_tasks(1_200);
    p.produce(&tasks);
    let results = p.results(tasks.len(), Duration::from_secs(180));
    assert_each_answered_once(&tasks, &results);
    let windows = sluice::steps::account::default_windows();
    assert_usage_equals_results(&p, &results, &windows, updates);
    app.proc.stop();
}

#[test]
fn each_tenants_usage_windows_equal_the_sum_of_its_results_updated_on_commit() {
    usage_windows_equal_the_sum_of_their_results(UsageUpdates::OnCommit);
}

#[test]
fn each_tenants_usage_windows_equal_the_sum_of_its_results_updated_on_every_result() {
    usage_windows_equal_the_sum_of_their_results(UsageUpdates::OnUpdate);
}

/// The broker itself fails under a stream of tasks (exactly-once, results
/// read committed): SIGKILL and a restart on the same log directory, then
/// SIGSTOP for 30 s and SIGCONT, each while tasks are in flight. The
/// instance reports itself not ready while the broker does not answer, is
/// ready again by itself (no restart), and every task ends with exactly one
/// result; each tenant's usage windows equal the sums of its results.
#[test]
fn a_broker_killed_then_stalled_under_load_loses_no_task_and_bills_none_twice() {
    let broker = OwnBroker::start();
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 30 },
    }))
    .unwrap();
    let p = Pipeline::over(broker.bootstrap.as_str().into(), sim, "");
    // A few seconds of work per batch at the limiter's 400 calls a second.
    let mut app = p.start("broker-faults");
    let batch = |from: usize| tenant_tasks(1_200, 8, from);
    let readyz = |p: &Pipeline, app: &App| p.http(app, "/readyz");
    // Unready counts only when the readiness names the broker as the reason:
    // a rebalance the fault provokes (partitions lost, tasks restoring) also
    // makes the instance unready, a moment before its probe notices.
    let becomes = |p: &Pipeline, app: &App, ready: bool, what: &str, within: u64| {
        let started = std::time::Instant::now();
        let body = eventually(Duration::from_secs(within), what, || {
            let (code, body) = readyz(p, app);
            let reached = if ready {
                code == 200
            } else {
                code != 200 && body.contains("did not answer")
            };
            reached.then_some(body)
        });
        eprintln!("{what} after {:?}: {body}", started.elapsed());
    };
    let mut tasks = batch(0);
    p.produce(&tasks);
    std::thread::sleep(Duration::from_secs(1));
    broker.kill();
    becomes(&p, &app, false, "unready with the broker down", 30);
    std::thread::sleep(Duration::from_secs(5));
    broker.restart();
    becomes(&p, &app, true, "ready after the restart", 120);

    let more = batch(1_200);
    p.produce(&more);
    tasks.extend(more);
    std::thread::sleep(Duration::from_secs(1));
    broker.stall();
    let stalled = std::time::Instant::now();
    becomes(&p, &app, false, "unready with the broker stalled", 30);
    std::thread::sleep(Duration::from_secs(30).saturating_sub(stalled.elapsed()));
    broker.resume();
    becomes(&p, &app, true, "ready after the stall", 120);
    let last = batch(2_400);
    p.produce(&last);
    tasks.extend(last);

    let results = p.results(tasks.len(), Duration::from_secs(300));
    report_missing(&p, &app, &tasks, &results);
    assert_each_answered_once(&tasks, &results);
    assert!(
        app.proc.child.try_wait().unwrap().is_none(),
        "the instance kept running through both faults"
    );
    assert_usage_equals_results(&p, &results, &default_windows(), UsageUpdates::OnCommit);
    app.proc.stop();
}

/// Rolling restart and scaling under load (exactly-once, tasks streaming in
/// all along): three instances of one group, each restarted in turn
/// (SIGTERM, then started again on its own state and ready), a fourth
/// added, then one killed with SIGKILL. Every task has exactly one result
/// and each tenant's usage windows equal the sums of its results.
#[test]
fn rolling_restarts_a_new_instance_and_a_sigkill_keep_every_task_once_and_accounts_exact() {
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 20, "max_ms": 300 },
    }))
    .unwrap();
    let p = Pipeline::with_partitions(sim, "exactly_once", "", 6, &[]);
    let ready = |app: &App| {
        eventually(Duration::from_secs(120), "ready", || {
            (p.http(app, "/readyz").0 == 200).then_some(())
        })
    };
    // Three members, each with a state directory (and config) of its own.
    let mut members: Vec<(App, tempfile::TempDir)> = ["roll-a", "roll-b", "roll-c"]
        .iter()
        .map(|name| p.start_other(name, ""))
        .collect();
    members.iter().for_each(|(app, _)| ready(app));

    let publisher = Publisher::start(&p, "classify", Duration::from_millis(500), |i| {
        tenant_tasks(20, 12, i)
    });
    std::thread::sleep(Duration::from_secs(5));
    for (i, (app, state)) in members.iter_mut().enumerate() {
        app.proc.stop();
        let config = state.path().join("sluice.toml");
        *app = p.start_with(&format!("roll-{i}-again"), &config, &[], true);
        std::thread::sleep(Duration::from_secs(5));
    }
    let fourth = p.start_other("roll-d", "");
    ready(&fourth.0);
    std::thread::sleep(Duration::from_secs(5));
    members[1].0.proc.kill9();
    std::thread::sleep(Duration::from_secs(10));
    let tasks = publisher.stop();
    let results = p.results(tasks.len(), Duration::from_secs(180));
    assert_each_answered_once(&tasks, &results);
    assert_usage_equals_results(&p, &results, &default_windows(), UsageUpdates::OnCommit);
    for (mut app, _) in members.into_iter().chain([fourth]) {
        app.proc.stop();
    }
}

/// Before a failing check of `results`: which tasks have none (per tenant,
/// their first and last ids) and what the instance's metrics say of its
/// tasks, partitions and operators.
fn report_missing(p: &Pipeline, app: &App, tasks: &[Task], results: &[(TaskResult, OwnedMessage)]) {
    let answered = count_by_task(results);
    let mut missing: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for t in tasks.iter().filter(|t| !answered.contains_key(&t.id)) {
        missing.entry(t.tenant.clone()).or_default().push(&t.id);
    }
    if missing.is_empty() {
        return;
    }
    for (tenant, ids) in &missing {
        eprintln!(
            "{tenant}: {} tasks without a result, {} .. {}",
            ids.len(),
            ids[0],
            ids[ids.len() - 1]
        );
    }
    let (_, metrics) = p.http(app, "/metrics");
    for line in metrics.lines().filter(|l| {
        !l.starts_with('#')
            && [
                "sluice_tasks",
                "paused",
                "in_flight",
                "parked",
                "quota_waiting",
                "records_in",
                "consumer_lag",
                "batches_flushed",
                "results_total",
                "rebalances",
                "abandoned",
            ]
            .iter()
            .any(|k| l.contains(k))
    }) {
        eprintln!("metric {line}");
    }
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

/// Budgets (µ$ a day) of the tenants `usage_survives_two_sigkills` alerts
/// for, and the hard quota (tokens an hour) of `tenant-0`.
const SIGKILL_BUDGETS: [(&str, i64); 2] = [("tenant-1", 2_000), ("tenant-2", 3_000)];
const SIGKILL_QUOTA: u64 = 4_000;

/// 20,000 tasks of 50 tenants under exactly-once, with micro-batching off
/// (a call per task) or on, on one instance or two: the instances are
/// killed with SIGKILL twice mid-run and restarted. On two instances the
/// producer keys tasks by task id (not tenant), two tenants have budgets
/// and one a hard quota.
fn usage_survives_two_sigkills(extra: &str, two_instances: bool) {
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 60 },
        "error_rate": 0.01,
    }))
    .unwrap();
    let mut toml = format!("[llm.retry]\nmax_attempts = 1\n{extra}");
    if two_instances {
        for (tenant, budget) in SIGKILL_BUDGETS {
            toml += &format!("\n[accounting.budgets.tenants.{tenant}]\n1d = {budget}\n");
        }
        toml += &format!(
            "\n[accounting.quotas.tenants.tenant-0]\nwindow = \"1h\"\ntokens = {SIGKILL_QUOTA}\n"
        );
    }
    let p = Pipeline::new(sim, &toml);
    let mut a = p.start("acct-a");
    let mut b = two_instances.then(|| p.start_other("acct-b", ""));
    let mut tasks = tenant_tasks(20_000, 50, 0);
    if two_instances {
        for t in &mut tasks {
            t.key = Some(t.id.clone());
        }
    }
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
    let windows = sluice::steps::account::default_windows();
    assert_usage_equals_results(&p, &results, &windows, UsageUpdates::OnCommit);
    let tenants: Vec<String> = (0..50).map(|i| format!("tenant-{i}")).collect();
    assert_stores_equal_results(&p, &restarted, &results, &tenants);
    if two_instances {
        assert_each_alert_once(&p, &results, &windows);
        assert_quota_held_per_window(&results, "tenant-0", "1h", SIGKILL_QUOTA, &windows);
    }
    let mut restarted = restarted;
    restarted.proc.stop();
    if let Some((mut b, _)) = b {
        b.proc.stop();
    }
}

/// Every budget alert `SIGKILL_BUDGETS` call for, once: for each budget
/// tenant's window, a threshold alerts exactly when the window's final cost
/// (the sum of its results) reached it, with one alert id each.
fn assert_each_alert_once(
    p: &Pipeline,
    results: &[(TaskResult, OwnedMessage)],
    windows: &[WindowSpec],
) {
    let got = alerts(p);
    let ids: std::collections::BTreeSet<&str> = got.iter().map(|a| a.alert_id.as_str()).collect();
    assert_eq!(ids.len(), got.len(), "an alert went out twice: {got:?}");
    let want = sums(results, windows);
    let mut expected = std::collections::BTreeSet::new();
    for (tenant, budget) in SIGKILL_BUDGETS {
        for ((t, w, start), usage) in &want {
            if t != tenant || w != "1d" {
                continue;
            }
            for th in [0.5, 0.8, 1.0] {
                if usage.total.cost_micros as f64 >= th * budget as f64 {
                    expected.insert((tenant.to_string(), *start, (th * 100.0) as i64));
                }
            }
        }
    }
    let budget_alerts: std::collections::BTreeSet<(String, i64, i64)> = got
        .iter()
        .filter(|a| a.kind == "budget")
        .map(|a| {
            (
                a.tenant_id.clone(),
                a.window_start,
                (a.threshold * 100.0).round() as i64,
            )
        })
        .collect();
    assert!(!expected.is_empty(), "the budgets were crossed");
    assert_eq!(budget_alerts, expected, "{got:?}");
}

/// `tenant`'s completed results in each of its `window` windows billed at
/// most `quota` tokens, and some were refused `quota_exceeded`.
fn assert_quota_held_per_window(
    results: &[(TaskResult, OwnedMessage)],
    tenant: &str,
    window: &str,
    quota: u64,
    windows: &[WindowSpec],
) {
    let spec = windows.iter().find(|w| w.name == window).unwrap();
    let mut used: BTreeMap<i64, u64> = BTreeMap::new();
    for (r, _) in results
        .iter()
        .filter(|(r, _)| r.tenant_id == tenant && r.success)
    {
        *used
            .entry(spec.start_of(r.completed_at.timestamp_millis()))
            .or_default() += r.input_tokens + r.output_tokens;
    }
    for (start, tokens) in &used {
        assert!(
            *tokens <= quota,
            "{tenant} used {tokens} tokens of {quota} in the window from {start}"
        );
    }
    let refused = results
        .iter()
        .filter(|(r, _)| r.tenant_id == tenant && r.error_code.as_deref() == Some("quota_exceeded"))
        .count();
    println!(
        "{tenant}: {used:?} tokens used per {window} window (quota {quota}), {refused} refused"
    );
    assert!(refused > 0, "the quota was reached");
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

/// The Show run of one owner per tenant: tasks keyed by task id.
#[test]
fn usage_is_exact_across_two_sigkills_with_micro_batching_and_two_instances() {
    usage_survives_two_sigkills("", true);
}

/// A crash inside a commit, after the outputs and the changelogs reached
/// the broker: the transaction is aborted when the task is taken over, and
/// the windows count every result exactly once.
#[test]
fn usage_is_exact_after_a_crash_once_changelogs_were_written() {
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 50 },
        "error_rate": 0.1,
    }))
    .unwrap();
    let p = Pipeline::new(sim, "[llm.retry]\nmax_attempts = 1\n");
    let tasks = mixed_tasks(1_000);
    p.crash_at(
        "acct-crash-1",
        "eos_after_changelog_flush+outputs:3",
        &tasks,
    );
    let mut app = p.start("acct-crash-2");
    let results = p.results(tasks.len(), Duration::from_secs(180));
    assert_each_answered_once(&tasks, &results);
    assert_usage_equals_results(
        &p,
        &results,
        &sluice::steps::account::default_windows(),
        UsageUpdates::OnCommit,
    );
    app.proc.stop();
}

/// Fails unless `tenant`'s completed results billed (prompt plus completion
/// tokens) at most `quota`, at least `min_done` completed, and every other
/// result of it was refused as `quota_exceeded`; returns how many completed
/// and how many were refused.
fn assert_quota_held(
    results: &[(TaskResult, OwnedMessage)],
    tenant: &str,
    quota: u64,
    min_done: usize,
) -> (usize, usize) {
    let (done, refused): (Vec<&TaskResult>, Vec<&TaskResult>) = results
        .iter()
        .map(|(r, _)| r)
        .filter(|r| r.tenant_id == tenant)
        .partition(|r| r.success);
    let billed: u64 = done.iter().map(|r| r.input_tokens + r.output_tokens).sum();
    assert!(
        billed <= quota,
        "billed {billed} tokens over a quota of {quota}"
    );
    assert!(
        done.len() >= min_done,
        "only {} completed under the quota",
        done.len()
    );
    assert!(refused
        .iter()
        .all(|r| r.error_code.as_deref() == Some("quota_exceeded")));
    (done.len(), refused.len())
}

/// The windows of a hard quota test: `q` (QUOTA_WINDOW_MS) and an hour,
/// with `capped`'s quota of `quota` tokens on `q`; their specs and TOML.
fn capped_quota_windows(quota: u64) -> (Vec<WindowSpec>, String) {
    let windows = vec![
        WindowSpec::fixed("q", QUOTA_WINDOW_MS, 600_000),
        WindowSpec::fixed("1h", 3_600_000, 3_600_000),
    ];
    let toml = format!(
        r#"
[[accounting.windows]]
name = "q"
size_ms = {QUOTA_WINDOW_MS}
retention_ms = 600000

[[accounting.windows]]
name = "1h"
size_ms = 3600000
retention_ms = 3600000

[accounting.quotas.tenants.capped]
window = "q"
tokens = {quota}
"#
    );
    (windows, toml)
}

/// The partitions of the usage topic each tenant's records are in (one
/// per tenant when its accounts have one owner).
fn usage_partitions(p: &Pipeline) -> BTreeMap<String, std::collections::BTreeSet<i32>> {
    let mut partitions: BTreeMap<String, std::collections::BTreeSet<i32>> = BTreeMap::new();
    for m in read_all(p, &format!("{}.usage", p.prefix)) {
        let u: UsageRecord = serde_json::from_slice(m.payload().unwrap()).unwrap();
        partitions
            .entry(u.tenant_id)
            .or_default()
            .insert(m.partition());
    }
    partitions
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
    let (done, refused) = assert_quota_held(&results, "capped", quota, 50);
    assert_eq!(done + refused, 500);
    // Tight: refused only once the settled usage plus the task's own worst
    // case passes the quota (never for other tasks' reservations), so the
    // tenant used at least the quota minus one task's worst case.
    let used: u64 = of("capped")
        .iter()
        .map(|r| r.input_tokens + r.output_tokens)
        .sum();
    let worst = of("capped")
        .iter()
        .filter_map(|r| {
            r.error_message
                .as_deref()?
                .rsplit("this task up to ")
                .next()
        })
        .filter_map(|n| n.trim().parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    println!("capped: used {used} of {quota} tokens, a task's worst case {worst}, {done} answered, {refused} refused");
    assert!(refused == 0 || worst > 0, "refusals name their worst case");
    assert!(
        used + worst >= quota,
        "used {used} of {quota} with a worst case of {worst} before refusing"
    );
    assert!(
        p.dead_letters("classify").is_empty(),
        "refusals are not dead letters"
    );
    for tenant in (0..4).map(|i| format!("tenant-{i}")) {
        assert!(of(&tenant).iter().all(|r| r.success), "{tenant} unaffected");
    }
    let rejections = p.metric(&a, "sluice_quota_rejections_total")
        + p.metric(&b, "sluice_quota_rejections_total");
    assert_eq!(rejections as usize, refused);
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

#[test]
fn a_tenants_tasks_meet_in_one_task_when_task_topics_differ_in_partitions() {
    // summarize has 3 partitions, classify 2, and the producers key tasks by
    // task id: tasks are repartitioned by tenant first, so each tenant's
    // accounts and quota live in one task, across both instances.
    let quota: u64 = 3_000;
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 40 },
        "content_policy_marker": "FORBIDDEN",
    }))
    .unwrap();
    let (windows, toml) = capped_quota_windows(quota);
    let p = Pipeline::with_partitions(
        sim,
        "exactly_once",
        &toml,
        3,
        &[("classify", 2), ("extract", 2)],
    );
    let mut a = p.start("by-tenant-a");
    let (mut b, _state) = p.start_other("by-tenant-b", "");
    eventually(Duration::from_secs(90), "both ready", || {
        (p.http(&a, "/readyz").0 == 200 && p.http(&b, "/readyz").0 == 200).then_some(())
    });
    next_quota_window();
    let keyed_by_id = |mut t: Task| {
        t.key = Some(t.id.clone());
        t
    };
    let mut all: Vec<Task> = (0..300)
        .map(|i| {
            let ty = if i % 2 == 0 { "summarize" } else { "classify" };
            keyed_by_id(Task::new(i, ty, "capped", "normal"))
        })
        .collect();
    all.extend((1_000..1_200).map(|i| {
        let ty = if i % 3 == 0 { "summarize" } else { "classify" };
        keyed_by_id(Task::new(i, ty, &format!("tenant-{}", i % 4), "normal"))
    }));
    // Refused by the provider (400): dead-lettered past the repartition.
    let forbidden: Vec<Task> = (2_000..2_004)
        .map(|i| {
            let mut t = keyed_by_id(Task::new(i, "summarize", "tenant-0", "normal"));
            t.content = format!("FORBIDDEN document {i}");
            t
        })
        .collect();
    all.extend(forbidden.iter().cloned());
    p.produce(&all);
    // Poison, dead-lettered before it.
    for ty in ["summarize", "classify"] {
        let poison = OutRecord {
            key: Some(b"capped".to_vec()),
            value: Some(b"{not json".to_vec()),
            ..Default::default()
        };
        produce(&bootstrap(), &p.topic(ty), vec![poison]).unwrap();
    }
    let results = p.results(all.len(), Duration::from_secs(240));
    assert_each_answered_once(&all, &results);

    // Each tenant's usage came from one task: one partition of the usage topic.
    let partitions = usage_partitions(&p);
    assert_eq!(partitions.len(), 5, "{partitions:?}");
    for (tenant, parts) in &partitions {
        assert_eq!(parts.len(), 1, "{tenant}'s usage came from tasks {parts:?}");
    }
    assert_usage_equals_results(&p, &results, &windows, UsageUpdates::OnCommit);
    let tenants: Vec<String> = partitions.keys().cloned().collect();
    assert_stores_equal_results(&p, &a, &results, &tenants);
    assert_stores_equal_results(&p, &b, &results, &tenants);

    // The quota held over both task types.
    assert_quota_held(&results, "capped", quota, 10);

    // Dead letters name the original records, in the original topic's
    // dead-letter topic: the poison ones and the provider's refusals.
    let summarize_dlq = p.dead_letters("summarize");
    let classify_dlq = p.dead_letters("classify");
    assert_eq!(classify_dlq.len(), 1);
    assert_eq!(summarize_dlq.len(), 1 + forbidden.len());
    let originals = read_all(&p, &p.topic("summarize"));
    for m in summarize_dlq.iter().chain(&classify_dlq) {
        let topic = header(m, "dlq.original.topic").unwrap();
        assert!(
            topic == p.topic("summarize") || topic == p.topic("classify"),
            "{topic}"
        );
        assert!(header(m, "sluice.origin.topic").is_none());
        let reason = header(m, "dlq.reason").unwrap();
        if m.payload() == Some(b"{not json".as_slice()) {
            assert_eq!(
                header(m, "dlq.category").as_deref(),
                Some("poison"),
                "{reason}"
            );
            continue;
        }
        assert_eq!(topic, p.topic("summarize"));
        let (partition, offset): (i32, i64) = (
            header(m, "dlq.original.partition")
                .unwrap()
                .parse()
                .unwrap(),
            header(m, "dlq.original.offset").unwrap().parse().unwrap(),
        );
        let original = originals
            .iter()
            .find(|o| o.partition() == partition && o.offset() == offset)
            .expect("the original record");
        assert_eq!(m.payload(), original.payload(), "the original bytes");
        let task: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
        assert!(forbidden.iter().any(|t| t.id == task["taskId"]), "{task}");
    }
    a.proc.stop();
    b.proc.stop();
}

/// How a producer keys and places a task record.
#[derive(Clone, Copy, Debug)]
enum Placement {
    /// Keyed by its tenant, murmur2 (as `[tasks] partitioner` says).
    Tenant,
    /// Keyed by its task id.
    TaskId,
    /// No key.
    Null,
    /// Keyed by its tenant, in the partition crc32 names (a Python
    /// producer at its default), when that is another one.
    Crc32,
}

/// The task's record as a producer placing it so would write it, to a
/// topic of `partitions` partitions.
fn placed(t: &Task, how: Placement, partitions: i32) -> OutRecord {
    use sluice_topology::runtime::KeyPartitioner;
    let mut r = t.record();
    match how {
        Placement::Tenant => {}
        Placement::TaskId => r.key = Some(t.id.clone().into_bytes()),
        Placement::Null => r.key = None,
        Placement::Crc32 => {
            r.partition = Some(KeyPartitioner::Crc32.partition(t.tenant.as_bytes(), partitions))
        }
    }
    r
}

fn produce_placed(p: &Pipeline, tasks: &[(Task, Placement)], partitions: i32) {
    let mut by_topic: BTreeMap<String, Vec<OutRecord>> = BTreeMap::new();
    for (t, how) in tasks {
        by_topic
            .entry(p.topic(&t.task_type))
            .or_default()
            .push(placed(t, *how, partitions));
    }
    for (topic, recs) in by_topic {
        produce(&bootstrap(), &topic, recs).unwrap();
    }
}

#[test]
fn a_tenant_keeps_one_owner_whatever_its_producers_key() {
    // Three partitions per task topic, two instances, and producers keying
    // tasks by tenant, by task id, not at all, or placing them with crc32:
    // every tenant's tasks still meet in one task, so its quota, alerts,
    // usage and redeliveries are those of one owner.
    use sluice_topology::runtime::KeyPartitioner;
    let (quota, budget): (u64, i64) = (3_000, 200);
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 60 },
    }))
    .unwrap();
    let (windows, toml) = capped_quota_windows(quota);
    let p = Pipeline::with_partitions(
        sim,
        "exactly_once",
        &format!("{toml}\n[accounting.budgets.tenants.capped]\n1h = {budget}\n"),
        3,
        &[],
    );
    let mut a = p.start("owner-a");
    let (mut b, _state) = p.start_other("owner-b", "");
    eventually(Duration::from_secs(90), "both ready", || {
        (p.http(&a, "/readyz").0 == 200 && p.http(&b, "/readyz").0 == 200).then_some(())
    });
    // Tenants whose crc32 partition is not their murmur2 one, so that
    // placement really differs.
    let tenants: Vec<String> = ["capped", "tenant-0", "tenant-1", "tenant-2", "tenant-3"]
        .iter()
        .map(|t| t.to_string())
        .collect();
    let differs = |t: &str| {
        KeyPartitioner::Crc32.partition(t.as_bytes(), 3)
            != KeyPartitioner::Murmur2.partition(t.as_bytes(), 3)
    };
    assert!(tenants.iter().filter(|t| differs(t)).count() >= 2);
    let shapes = [
        Placement::Tenant,
        Placement::TaskId,
        Placement::Null,
        Placement::Crc32,
    ];
    next_quota_window();
    let mut all: Vec<(Task, Placement)> = Vec::new();
    for i in 0..400 {
        let tenant = if i % 2 == 0 {
            "capped".to_string()
        } else {
            tenants[1 + (i / 2) % 4].clone()
        };
        let ty = ["summarize", "classify"][(i / 4) % 2];
        all.push((Task::new(i, ty, &tenant, "normal"), shapes[i % 4]));
    }
    produce_placed(&p, &all, 3);
    // Each of 40 tasks delivered again, keyed another way: answered again
    // as a duplicate, never called (nor billed) again, wherever the
    // redelivery lands.
    let again: Vec<(Task, Placement)> = all[..40]
        .iter()
        .map(|(t, how)| (t.clone(), shapes[(*how as usize + 1) % 4]))
        .collect();
    produce_placed(&p, &again, 3);
    let tasks: Vec<Task> = all.iter().map(|(t, _)| t.clone()).collect();
    let results = p.results_at_least(tasks.len() + again.len(), Duration::from_secs(240));
    let first: Vec<(TaskResult, OwnedMessage)> = results
        .iter()
        .filter(|(_, m)| header(m, "sluice.duplicate").is_none())
        .cloned()
        .collect();
    // A refused task delivered again is a new attempt (refused again in
    // the same quota window); any other task has one result of its own.
    let (refusals, answers): (Vec<_>, Vec<_>) = first
        .iter()
        .cloned()
        .partition(|(r, _)| r.error_code.as_deref() == Some("quota_exceeded"));
    let mut once = answers;
    for r in refusals {
        if !once.iter().any(|(o, _)| o.task_id == r.0.task_id) {
            once.push(r);
        }
    }
    // No task lost, none both answered and refused, none answered twice.
    assert_each_answered_once(&tasks, &once);
    // Every token the provider billed is on one result: none called twice.
    assert_results_bill_what_the_provider_billed(&p, &first);
    // Each tenant's usage came from one task: one partition of the usage
    // topic, the one its tenant id names.
    let partitions = usage_partitions(&p);
    assert_eq!(partitions.len(), tenants.len(), "{partitions:?}");
    for (tenant, parts) in &partitions {
        assert_eq!(parts.len(), 1, "{tenant}'s usage came from tasks {parts:?}");
    }
    assert_usage_equals_results(&p, &first, &windows, UsageUpdates::OnCommit);
    assert_stores_equal_results(&p, &a, &first, &tenants);
    assert_quota_held(&first, "capped", quota, 10);

    // Each alert once: one owner, one alert per threshold of the budget,
    // and one refusal alert for the quota window.
    let got: Vec<AlertRecord> = alerts(&p)
        .into_iter()
        .filter(|a| a.tenant_id == "capped")
        .collect();
    let budget_alerts: Vec<f64> = got
        .iter()
        .filter(|a| a.kind == "budget")
        .map(|a| a.threshold)
        .collect();
    assert_eq!(budget_alerts, vec![0.5, 0.8, 1.0], "{got:?}");
    assert_eq!(
        got.iter().filter(|a| a.kind == "quota_exceeded").count(),
        1,
        "{got:?}"
    );

    // Counted, and the partitioner mismatch reported.
    let misplaced =
        p.metric(&a, "sluice_tasks_misplaced_total") + p.metric(&b, "sluice_tasks_misplaced_total");
    assert!(misplaced >= 200.0, "{misplaced} misplaced records counted");
    let warned = [&a, &b]
        .iter()
        .any(|app| p.http(app, "/readyz").1.contains("tenant_partitions"));
    assert!(warned, "a partitioner mismatch is reported by /readyz");
    a.proc.stop();
    b.proc.stop();
}

#[test]
fn with_repartition_never_a_misplaced_task_is_dead_lettered_wrong_key() {
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 1, "max_ms": 5 },
    }))
    .unwrap();
    let p = Pipeline::with_partitions(sim, "exactly_once", "", 3, &[]);
    p.edit_config(&[("[tasks]\n", "[tasks]\nrepartition = \"never\"\n")]);
    let mut app = p.start("never");
    // Tenants whose crc32 and murmur2 partitions differ.
    let tenant = (0..)
        .map(|i| format!("tenant-{i}"))
        .find(|t| {
            use sluice_topology::runtime::KeyPartitioner;
            KeyPartitioner::Crc32.partition(t.as_bytes(), 3)
                != KeyPartitioner::Murmur2.partition(t.as_bytes(), 3)
        })
        .unwrap();
    let shapes = [
        Placement::Tenant,
        Placement::TaskId,
        Placement::Null,
        Placement::Crc32,
    ];
    let all: Vec<(Task, Placement)> = (0..40)
        .map(|i| (Task::new(i, "classify", &tenant, "normal"), shapes[i % 4]))
        .collect();
    produce_placed(&p, &all, 3);
    let good: Vec<Task> = all
        .iter()
        .filter(|(_, how)| matches!(how, Placement::Tenant))
        .map(|(t, _)| t.clone())
        .collect();
    let results = p.results(good.len(), Duration::from_secs(60));
    assert_each_answered_once(&good, &results);
    assert_eq!(results.len(), good.len(), "only well-placed tasks answered");
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    for m in p.dead_letters("classify") {
        *reasons
            .entry(header(&m, "dlq.reason").unwrap())
            .or_default() += 1;
    }
    let want: BTreeMap<String, usize> = [
        ("wrong_key:key_not_tenant".to_string(), 10),
        ("wrong_key:null_key".to_string(), 10),
        ("wrong_key:partition".to_string(), 10),
    ]
    .into_iter()
    .collect();
    assert_eq!(reasons, want);
    assert_eq!(p.metric(&app, "sluice_tasks_misplaced_total"), 30.0);
    app.proc.stop();
}

/// Alerts on the alerts topic, read committed.
fn alerts(p: &Pipeline) -> Vec<AlertRecord> {
    read_all(p, &format!("{}.alerts", p.prefix))
        .iter()
        .map(|m| serde_json::from_slice(m.payload().unwrap()).unwrap())
        .collect()
}

/// The last usage record's cost of a tenant's window.
fn spent(p: &Pipeline, tenant: &str, window: &str) -> i64 {
    usage_records(p)
        .into_iter()
        .filter(|((t, w, _), _)| t == tenant && w == window)
        .filter_map(|(_, rs)| rs.last().map(|u| u.cost_micros))
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
