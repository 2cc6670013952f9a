//! The accounts in the in-process test driver: sums per tenant, window and
//! model, and no double count across a crash.

use std::collections::BTreeMap;

use chrono::TimeZone;
use sluice_topology::{JsonCodec, StreamBuilder, StringCodec, TopologyTestDriver};

use super::*;
use crate::envelope::Route;

fn result(id: &str, tenant: &str, model: &str, at_ms: i64, tokens: u64) -> TaskResult {
    TaskResult {
        task_id: id.into(),
        task_type: "classify".into(),
        tenant_id: tenant.into(),
        success: true,
        completed_at: chrono::Utc.timestamp_millis_opt(at_ms).unwrap(),
        processing_ms: 5,
        model: model.into(),
        route: Route::default(),
        input_tokens: tokens,
        output_tokens: tokens / 2,
        cached_tokens: tokens / 4,
        cost_micros: tokens as i64 * 3,
        attempts: 1,
        batch_id: None,
        output: serde_json::Value::Null,
        error_code: None,
        error_message: None,
        metadata: BTreeMap::new(),
    }
}

fn accounting() -> (Accounting, StreamBuilder) {
    let b = StreamBuilder::new();
    let accounting = Accounting::new(AccountingSettings {
        name: "usage".into(),
        windows: default_windows(),
        usage_topic: "usage".into(),
        usage_updates: UsageUpdates::OnUpdate,
        budgets: Budgets {
            default: BTreeMap::from([("1h".to_string(), 1_000)]),
            tenants: BTreeMap::from([(
                "globex".to_string(),
                BTreeMap::from([("1d".to_string(), 100)]),
            )]),
        },
        thresholds: vec![0.5, 0.8, 1.0],
        alerts_topic: "alerts".into(),
        quotas: Quotas {
            default: None,
            tenants: BTreeMap::from([
                (
                    "soft".to_string(),
                    Quota {
                        window: "1h".into(),
                        tokens: Some(1_000),
                        cost_micros: None,
                        mode: QuotaMode::Soft,
                    },
                ),
                (
                    "hard".to_string(),
                    Quota {
                        window: "1h".into(),
                        tokens: Some(1_000),
                        cost_micros: None,
                        mode: QuotaMode::Hard,
                    },
                ),
            ]),
        },
        downgrade_at: None,
    });
    (accounting, b)
}

fn driver() -> TopologyTestDriver {
    driver_with().1
}

fn driver_with() -> (Accounting, TopologyTestDriver) {
    let (accounting, b) = accounting();
    b.stream(
        &["results"],
        StringCodec,
        JsonCodec::<TaskResult>::default(),
    )
    .account(&accounting)
    .to("out", StringCodec, JsonCodec::<TaskResult>::default());
    (
        accounting,
        TopologyTestDriver::new(b.build().unwrap()).unwrap(),
    )
}

fn pipe(d: &mut TopologyTestDriver, r: &TaskResult) {
    d.pipe(
        "results",
        &r.task_id,
        r,
        &StringCodec,
        &JsonCodec::default(),
        0,
    )
    .unwrap();
}

/// A result given again to a redelivered task (marked as such by invoke_llm).
fn redelivered(d: &mut TopologyTestDriver, r: &TaskResult) {
    let json = serde_json::to_vec(r).unwrap();
    let headers = vec![(HEADER_DUPLICATE.to_string(), b"1".to_vec())];
    d.pipe_raw_with_headers(
        "results",
        Some(r.task_id.as_bytes()),
        Some(&json),
        0,
        headers,
    )
    .unwrap();
}

/// The latest usage record per (tenant, window name, window start).
fn latest(records: &[OutputRecord]) -> BTreeMap<(String, String, i64), WindowUsage> {
    records
        .iter()
        .map(|r| serde_json::from_slice::<UsageRecord>(r.value.as_deref().unwrap()).unwrap())
        .map(|u| {
            (
                (u.tenant_id, u.usage.window.clone(), u.usage.window_start),
                u.usage,
            )
        })
        .collect()
}

const T0: i64 = 1_796_000_000_000 - 1_796_000_000_000 % 3_600_000;

#[test]
fn each_window_sums_its_tenants_completed_results_per_model() {
    let mut d = driver();
    pipe(&mut d, &result("a1", "acme", "small", T0 + 1_000, 100));
    pipe(&mut d, &result("a2", "acme", "large", T0 + 2_000, 40));
    pipe(&mut d, &result("a3", "acme", "small", T0 + 61_000, 8));
    pipe(&mut d, &result("g1", "globex", "small", T0 + 3_000, 20));
    let mut failed = result("a4", "acme", "small", T0 + 4_000, 0);
    failed.success = false;
    pipe(&mut d, &failed);
    assert_eq!(d.read_output("out").len(), 5, "every result passes on");
    let usage = latest(&d.read_output("usage"));
    let minute = &usage[&("acme".into(), "1m".into(), T0)];
    assert_eq!((minute.requests, minute.input_tokens), (2, 140));
    assert_eq!(minute.by_model["small"].input_tokens, 100);
    assert_eq!(minute.by_model["large"].cost_micros, 120);
    let next = &usage[&("acme".into(), "1m".into(), T0 + 60_000)];
    assert_eq!((next.requests, next.input_tokens), (1, 8));
    let hour = &usage[&("acme".into(), "1h".into(), T0)];
    assert_eq!(
        (
            hour.requests,
            hour.input_tokens,
            hour.output_tokens,
            hour.cached_tokens,
            hour.cost_micros
        ),
        (3, 148, 50 + 20 + 4, 25 + 10 + 2, 444)
    );
    assert_eq!(hour.window_end, T0 + 3_600_000);
    assert_eq!(
        usage[&("globex".into(), "1d".into(), T0 - T0 % 86_400_000)].requests,
        1
    );
}

#[test]
fn a_crash_counts_nothing_twice() {
    let mut d = driver();
    pipe(&mut d, &result("a1", "acme", "small", T0 + 1_000, 100));
    d.commit().unwrap();
    pipe(&mut d, &result("a2", "acme", "small", T0 + 2_000, 10));
    // Everything since the commit is dropped; the input is replayed.
    d.crash().unwrap();
    pipe(&mut d, &result("a3", "acme", "small", T0 + 3_000, 1));
    d.commit().unwrap();
    let usage = latest(&d.committed_output("usage"));
    let hour = &usage[&("acme".into(), "1h".into(), T0)];
    assert_eq!((hour.requests, hour.input_tokens), (3, 111));
}

fn alerts(records: &[OutputRecord]) -> Vec<AlertRecord> {
    records
        .iter()
        .map(|r| serde_json::from_slice(r.value.as_deref().unwrap()).unwrap())
        .collect()
}

#[test]
fn crossing_each_threshold_alerts_once_per_window_across_a_crash_and_a_redelivery() {
    let mut d = driver();
    // acme's 1-hour budget is 1,000 µ$ (cost = 3 µ$ per input token here).
    pipe(&mut d, &result("a1", "acme", "small", T0 + 1_000, 100)); // 300: nothing
    pipe(&mut d, &result("a2", "acme", "small", T0 + 2_000, 70)); // 510: 50 %
    d.commit().unwrap();
    pipe(&mut d, &result("a3", "acme", "small", T0 + 3_000, 100)); // 810: 80 %
    d.crash().unwrap(); // a3's update and alert are gone, then a3 is replayed
    redelivered(&mut d, &result("a2", "acme", "small", T0 + 2_000, 70)); // not counted again
    pipe(&mut d, &result("a4", "acme", "small", T0 + 4_000, 70)); // 1,020: 100 %
    pipe(&mut d, &result("a6", "acme", "small", T0 + 5_000, 100)); // 1,320: nothing more
    pipe(&mut d, &result("a5", "acme", "small", T0 + 3_600_000, 200)); // next hour: 600: 50 %
    d.commit().unwrap();
    let got: Vec<(String, i64, f64, i64)> = alerts(&d.committed_output("alerts"))
        .into_iter()
        .map(|a| (a.window, a.window_start, a.threshold, a.spent_micros))
        .collect();
    assert_eq!(
        got,
        vec![
            ("1h".to_string(), T0, 0.5, 510),
            ("1h".to_string(), T0, 0.8, 810),
            ("1h".to_string(), T0, 1.0, 1_020),
            ("1h".to_string(), T0 + 3_600_000, 0.5, 600),
        ]
    );
    let usage = latest(&d.committed_output("usage"));
    let hour = &usage[&("acme".into(), "1h".into(), T0)];
    assert_eq!(
        hour.cost_micros, 1_320,
        "the redelivery is not counted again"
    );
    // globex's own 1-day budget of 100 µ$: one result crosses all three at once.
    pipe(&mut d, &result("g1", "globex", "small", T0, 40));
    let g: Vec<AlertRecord> = alerts(&d.read_output("alerts"))
        .into_iter()
        .filter(|a| a.tenant_id == "globex")
        .collect();
    assert_eq!(g.len(), 3);
    assert!(g.iter().all(|a| a.window == "1d" && a.budget_micros == 100));
    assert_eq!(
        g[2].alert_id,
        format!("globex/1d/{}/1/100", T0 - T0 % 86_400_000)
    );
}

#[test]
fn a_soft_quota_alerts_once_and_routes_its_tenant_down_until_the_window_ends() {
    let (accounting, mut d) = driver_with();
    let now = chrono::Utc::now().timestamp_millis();
    let hour = now - now.rem_euclid(3_600_000);
    let hook = accounting.downgrade_hook();
    let task = |tenant: &str| {
        serde_json::from_value::<TaskEnvelope>(serde_json::json!({
            "taskId": "x", "taskType": "classify", "tenantId": tenant, "requesterId": "r",
            "priority": "normal", "submittedAt": "2026-12-01T10:00:00Z", "attemptNumber": 1,
            "payload": { "content": "c" }
        }))
        .unwrap()
    };
    // 1,000 tokens an hour, soft: 600 (400 in, 200 out) are under it.
    pipe(&mut d, &result("s1", "soft", "small", hour + 1, 400));
    assert!(!hook(&task("soft")));
    pipe(&mut d, &result("s2", "soft", "small", hour + 2, 400)); // 1,200: over
    d.commit().unwrap();
    pipe(&mut d, &result("s3", "soft", "small", hour + 3, 40));
    d.crash().unwrap(); // s3 is replayed
    d.commit().unwrap();
    let quota: Vec<AlertRecord> = alerts(&d.committed_output("alerts"))
        .into_iter()
        .filter(|a| a.kind == "quota")
        .collect();
    assert_eq!(quota.len(), 1, "{quota:?}");
    assert_eq!(
        (quota[0].spent_tokens, quota[0].quota_tokens),
        (Some(1_200), Some(1_000))
    );
    assert!(hook(&task("soft")), "routed down while the window lasts");
    assert!(!hook(&task("acme")), "other tenants are not");
    // Every result still passes (a soft quota refuses nothing).
    assert_eq!(d.committed_output("out").len(), 3);
}

/// A failed result carries what its calls were billed: its tokens and cost
/// count (a failed result without any does not).
#[test]
fn a_failed_result_counts_what_its_calls_were_billed() {
    let mut d = driver();
    pipe(&mut d, &result("a1", "acme", "small", T0 + 1_000, 100));
    let mut billed = result("a2", "acme", "small", T0 + 2_000, 10);
    billed.success = false;
    billed.error_code = Some("truncated".into());
    pipe(&mut d, &billed);
    let mut unbilled = result("a3", "acme", "small", T0 + 3_000, 0);
    unbilled.success = false;
    unbilled.cost_micros = 0;
    pipe(&mut d, &unbilled);
    let usage = latest(&d.read_output("usage"));
    let hour = &usage[&("acme".into(), "1h".into(), T0)];
    assert_eq!(
        (
            hour.requests,
            hour.input_tokens,
            hour.output_tokens,
            hour.cost_micros
        ),
        (2, 110, 55, 330)
    );
}

/// A hard quota's refusals raise one `quota_exceeded` alert per tenant and
/// quota window, across a crash.
#[test]
fn a_hard_quotas_refusals_alert_once_per_window() {
    let mut d = driver();
    let refused = |id: &str, at: i64| {
        let mut r = result(id, "hard", "small", at, 0);
        r.success = false;
        r.cost_micros = 0;
        r.error_code = Some(QUOTA_EXCEEDED.into());
        r
    };
    pipe(&mut d, &result("h1", "hard", "small", T0 + 1_000, 600));
    pipe(&mut d, &refused("h2", T0 + 2_000));
    d.commit().unwrap();
    pipe(&mut d, &refused("h3", T0 + 3_000));
    d.crash().unwrap();
    pipe(&mut d, &refused("h4", T0 + 4_000));
    pipe(&mut d, &refused("h5", T0 + 3_600_000)); // the next hour
    d.commit().unwrap();
    let got: Vec<(String, i64, Option<u64>)> = alerts(&d.committed_output("alerts"))
        .into_iter()
        .filter(|a| a.kind == QUOTA_EXCEEDED)
        .map(|a| (a.alert_id, a.window_start, a.spent_tokens))
        .collect();
    assert_eq!(
        got,
        vec![
            (format!("hard/1h/{T0}/quota_exceeded"), T0, Some(900)),
            (
                format!("hard/1h/{}/quota_exceeded", T0 + 3_600_000),
                T0 + 3_600_000,
                Some(0)
            ),
        ]
    );
}

/// Accounting with acme's 1-hour budget and the thresholds given.
fn budgeted(budget: i64, thresholds: &[f64]) -> Accounting {
    let (a, _) = accounting();
    let mut settings = a.settings().clone();
    settings.budgets.default = BTreeMap::from([("1h".to_string(), budget)]);
    settings.thresholds = thresholds.to_vec();
    Accounting::new(settings)
}

/// A window spending `cost`, stored and read back between alerts (as a
/// restarted instance reads it with its new configuration).
fn spend(usage: TenantUsage, cost: i64) -> TenantUsage {
    let mut u: TenantUsage =
        sluice_topology::from_bincode(&sluice_topology::to_bincode(&usage)).unwrap();
    u.total.cost_micros = cost;
    u
}

fn crossed(a: &Accounting, usage: &mut TenantUsage) -> Vec<(f64, i64)> {
    let hour = &a.windows()[1];
    a.crossed("acme", hour, T0, usage)
        .into_iter()
        .map(|x| (x.threshold, x.budget_micros))
        .collect()
}

/// Alerts follow the configuration: a raised budget's thresholds alert
/// again, thresholds replaced or added alert once, and none twice.
#[test]
fn alerts_follow_budget_and_threshold_changes() {
    let three = [0.5, 0.8, 1.0];
    let mut u = spend(TenantUsage::default(), 1_000);
    assert_eq!(crossed(&budgeted(1_000, &three), &mut u).len(), 3);
    // The budget raised to 2,000 after its 100 % alert.
    let raised = budgeted(2_000, &three);
    let mut u = spend(u, 1_000);
    assert_eq!(crossed(&raised, &mut u), vec![(0.5, 2_000)]);
    let mut u = spend(u, 1_700);
    assert_eq!(crossed(&raised, &mut u), vec![(0.8, 2_000)]);
    let mut u = spend(u, 2_000);
    assert_eq!(crossed(&raised, &mut u), vec![(1.0, 2_000)]);
    let mut u = spend(u, 2_100);
    assert!(crossed(&raised, &mut u).is_empty());

    // [0.5, 0.8, 1.0] → [0.9, 1.0] after two fired: 0.9 and 1.0 still alert.
    let mut u = spend(TenantUsage::default(), 850);
    assert_eq!(crossed(&budgeted(1_000, &three), &mut u).len(), 2);
    let mut u = spend(u, 1_000);
    assert_eq!(
        crossed(&budgeted(1_000, &[0.9, 1.0]), &mut u),
        vec![(0.9, 1_000), (1.0, 1_000)]
    );

    // 0.25 prepended after 0.5 fired: 0.25 alerts once, 0.5 not again.
    let mut u = spend(TenantUsage::default(), 600);
    assert_eq!(
        crossed(&budgeted(1_000, &three), &mut u),
        vec![(0.5, 1_000)]
    );
    let four = budgeted(1_000, &[0.25, 0.5, 0.8, 1.0]);
    let mut u = spend(u, 610);
    assert_eq!(crossed(&four, &mut u), vec![(0.25, 1_000)]);
    let mut u = spend(u, 620);
    assert!(crossed(&four, &mut u).is_empty());
}

/// A window written before alerts were recorded by budget (a count of
/// thresholds alerted, and a trailing field since dropped) reads as those
/// thresholds alerted at the current budget.
#[test]
fn a_window_of_the_earlier_layout_keeps_its_alerts() {
    #[derive(Serialize)]
    struct Earlier {
        total: ModelUsage,
        by_model: ByModel,
        alerted: u8,
        quota_alerted: bool,
        last: Option<String>,
    }
    let total = ModelUsage {
        requests: 3,
        cost_micros: 900,
        ..ModelUsage::default()
    };
    let bytes = sluice_topology::to_bincode(&Earlier {
        total: total.clone(),
        by_model: ByModel::default(),
        alerted: 2,
        quota_alerted: true,
        last: Some("a3".into()),
    });
    let mut u: TenantUsage = sluice_topology::from_bincode(&bytes).unwrap();
    assert_eq!((&u.total, u.quota_alerted), (&total, true));
    u.total.cost_micros = 1_000;
    assert_eq!(
        crossed(&budgeted(1_000, &[0.5, 0.8, 1.0]), &mut u),
        vec![(1.0, 1_000)]
    );
}

/// The default monthly window is the calendar month in UTC: February has
/// 28 or 29 days, December runs into January, and the last millisecond of
/// a month is not in the next.
#[test]
fn monthly_windows_are_calendar_months() {
    let month = default_windows().pop().unwrap();
    assert_eq!(month.name, "1mo");
    let ms = |s: &str| {
        chrono::DateTime::parse_from_rfc3339(s)
            .unwrap()
            .timestamp_millis()
    };
    let start = month.start_of(ms("2028-02-29T23:59:59.999Z"));
    assert_eq!(start, ms("2028-02-01T00:00:00Z"));
    assert_eq!(month.end_of(start), ms("2028-03-01T00:00:00Z"));
    let dec = month.start_of(ms("2026-12-03T10:00:00Z"));
    assert_eq!(dec, ms("2026-12-01T00:00:00Z"));
    assert_eq!(month.end_of(dec), ms("2027-01-01T00:00:00Z"));
    assert_eq!(
        month.start_of(ms("2026-11-30T23:59:59.999Z")),
        ms("2026-11-01T00:00:00Z")
    );

    // Results on either side of midnight, 1 December, in two windows.
    let mut d = driver();
    pipe(
        &mut d,
        &result("n", "acme", "small", ms("2026-11-30T23:59:59.999Z"), 10),
    );
    pipe(
        &mut d,
        &result("d", "acme", "small", ms("2026-12-01T00:00:00Z"), 20),
    );
    let usage = latest(&d.read_output("usage"));
    let nov = &usage[&("acme".into(), "1mo".into(), ms("2026-11-01T00:00:00Z"))];
    assert_eq!(
        (nov.input_tokens, nov.window_end),
        (10, ms("2026-12-01T00:00:00Z"))
    );
    let dec = &usage[&("acme".into(), "1mo".into(), dec)];
    assert_eq!(
        (dec.input_tokens, dec.window_end),
        (20, ms("2027-01-01T00:00:00Z"))
    );
}
