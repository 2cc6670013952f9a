//! Interactive queries of tenant usage against the broker: two instances of
//! `sluice run`, each holding one partition of the task topics, asked with
//! `sluice usage` (the binary) on either instance.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

use common::pipeline::*;
use common::{eventually, sluice_bin};
use rdkafka::message::OwnedMessage;
use sluice::envelope::TaskResult;
use sluice::http::usage::{TenantUsageReport, WindowUsage};
use sluice::sim::SimConfig;
use sluice::steps::account::{default_windows, ModelUsage};
use sluice_topology::runtime::KeyPartitioner;

/// Nothing beyond the fixture's config: its producer partitions tasks with
/// murmur2 (`sluice::kafka::produce`), which is `[tasks] partitioner`'s
/// default (the fixture's config has a `[tasks]` table already).
const CONFIG: &str = "";

/// The URL an instance advertises (the default: its listener).
fn url(app: &App) -> String {
    format!("http://{}", app.addr)
}

/// `sluice usage TENANT --url <app> [extra]`: stdout, or the exit status
/// and stderr.
fn usage_cli(app: &App, tenant: &str, extra: &[&str]) -> Result<String, (i32, String)> {
    let out = Command::new(sluice_bin())
        .args(["usage", tenant, "--url", &url(app)])
        .env("SLUICE_TOKEN", ADMIN_TOKEN)
        .args(extra)
        .output()
        .expect("run sluice usage");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err((
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    }
}

/// The report `sluice usage --json` prints, if the instance answered.
fn report(app: &App, tenant: &str) -> Option<TenantUsageReport> {
    let json = usage_cli(app, tenant, &["--json"]).ok()?;
    Some(serde_json::from_str(&json).expect("a usage report"))
}

/// Waits until both instances run one task each.
fn wait_for_one_task_each(p: &Pipeline, apps: [&App; 2]) {
    eventually(
        Duration::from_secs(120),
        "one task on each instance",
        || {
            apps.iter()
                .all(|a| {
                    let (status, body) = p.http(a, "/readyz");
                    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                    status == 200 && v["tasks"].as_array().is_some_and(|t| t.len() == 1)
                })
                .then_some(())
        },
    );
}

/// Tenants spread over both partitions (as the producers' partitioner puts
/// them).
fn tenants() -> Vec<String> {
    let tenants: Vec<String> = (0..8).map(|i| format!("tenant-{i}")).collect();
    let partitions: BTreeSet<i32> = tenants
        .iter()
        .map(|t| KeyPartitioner::Murmur2.partition(t.as_bytes(), 2))
        .collect();
    assert_eq!(partitions.len(), 2, "the tenants cover both partitions");
    tenants
}

/// What a window should hold: the sums over the tenant's completed results
/// whose `completedAt` falls in it (window starts aligned as the accountant
/// aligns them).
fn expected(results: &[(TaskResult, OwnedMessage)], tenant: &str, w: &WindowUsage) -> WindowUsage {
    let mut want = WindowUsage {
        window: w.window.clone(),
        window_start: w.window_start,
        window_end: w.window_end,
        requests: 0,
        input_tokens: 0,
        output_tokens: 0,
        cached_tokens: 0,
        cost_micros: 0,
        by_model: BTreeMap::new(),
    };
    for (r, _) in results {
        let at = r.completed_at.timestamp_millis();
        if r.tenant_id != tenant || !r.accounted() || at < w.window_start || at >= w.window_end {
            continue;
        }
        want.requests += 1;
        want.input_tokens += r.input_tokens;
        want.output_tokens += r.output_tokens;
        want.cached_tokens += r.cached_tokens;
        want.cost_micros += r.cost_micros;
        let m: &mut ModelUsage = want.by_model.entry(r.model.clone()).or_default();
        m.requests += 1;
        m.input_tokens += r.input_tokens;
        m.output_tokens += r.output_tokens;
        m.cached_tokens += r.cached_tokens;
        m.cost_micros += r.cost_micros;
    }
    want
}

/// The report's windows are the configured ones, each the window that
/// contained the time of the query.
fn check_windows(report: &TenantUsageReport) {
    let specs = default_windows();
    assert_eq!(report.windows.len(), specs.len(), "{report:?}");
    let now = chrono::Utc::now().timestamp_millis();
    for (w, spec) in report.windows.iter().zip(&specs) {
        assert_eq!(w.window, spec.name);
        assert_eq!(w.window_start, spec.start_of(now), "{w:?}");
        assert_eq!(w.window_end, spec.end_of(w.window_start), "{w:?}");
        assert!(w.window_start <= now && now < w.window_end, "{w:?}");
    }
}

fn same_windows(a: &TenantUsageReport, b: &TenantUsageReport) -> bool {
    a.windows
        .iter()
        .zip(&b.windows)
        .all(|(x, y)| x.window_start == y.window_start)
}

/// Both instances' answers for `tenant`, asked within one set of windows.
fn both(a: &App, b: &App, tenant: &str) -> Option<(TenantUsageReport, TenantUsageReport)> {
    let (ra, rb) = (report(a, tenant)?, report(b, tenant)?);
    same_windows(&ra, &rb).then_some((ra, rb))
}

fn completed_tasks(tenants: &[String], n: usize) -> Vec<Task> {
    (0..n)
        .map(|i| Task::new(i, "classify", &tenants[i % tenants.len()], "normal"))
        .collect()
}

#[test]
fn usage_on_an_instance_that_does_not_own_the_tenant_returns_the_same_figures_as_the_owner() {
    let p = Pipeline::new(SimConfig::default(), CONFIG);
    let a = p.start("query-a");
    let (b, _b_state) = p.start_other("query-b", "");
    wait_for_one_task_each(&p, [&a, &b]);
    let tenants = tenants();
    let tasks = completed_tasks(&tenants, 48);
    p.produce(&tasks);
    let results = p.results(tasks.len(), Duration::from_secs(120));
    assert_each_answered_once(&tasks, &results);
    assert!(
        results.iter().all(|(r, _)| r.success),
        "every task completed"
    );

    let mut served_by = BTreeSet::new();
    for tenant in &tenants {
        let (ra, rb) = eventually(
            Duration::from_secs(60),
            &format!("both instances answer for {tenant} with its results' figures"),
            || {
                let (ra, rb) = both(&a, &b, tenant)?;
                let exact = ra
                    .windows
                    .iter()
                    .all(|w| *w == expected(&results, tenant, w));
                exact.then_some((ra, rb))
            },
        );
        check_windows(&ra);
        assert_eq!(ra, rb, "{tenant}: the same figures on either instance");
        assert!(
            ra.windows.iter().any(|w| w.requests > 0),
            "{tenant}: its tasks were counted"
        );
        // One instance holds the tenant: asked of the other, it was
        // forwarded there.
        assert!(
            ra.served_by == url(&a) || ra.served_by == url(&b),
            "{}",
            ra.served_by
        );
        served_by.insert(ra.served_by.clone());
        // The table is the same on either instance too.
        let table = eventually(Duration::from_secs(10), "the same table twice", || {
            let (ta, tb) = (
                usage_cli(&a, tenant, &[]).ok()?,
                usage_cli(&b, tenant, &[]).ok()?,
            );
            (ta == tb).then_some(ta)
        });
        assert_eq!(
            table.lines().count(),
            2 + default_windows().len(),
            "{table}"
        );
        assert!(table.contains(&ra.served_by), "{table}");
    }
    assert_eq!(
        served_by.len(),
        2,
        "each instance held some tenants, so each forwarded some queries"
    );
    // Behind tokens, on the instance that holds a tenant and on the one that
    // forwards: none or an unknown one 401, a tenant's own token reads only
    // its tenant (403 for another, forwarded or not).
    for app in [&a, &b] {
        for tenant in ["tenant-0", "tenant-1"] {
            let path = format!("/v1/tenants/{tenant}/usage");
            assert_eq!(
                p.http_as(app, &path, None).0,
                401,
                "{tenant} without a token"
            );
            let guess = Some("not-a-token-0123456789");
            assert_eq!(
                p.http_as(app, &path, guess).0,
                401,
                "{tenant}, unknown token"
            );
            let own = if tenant == "tenant-0" { 200 } else { 403 };
            assert_eq!(
                p.http_as(app, &path, Some(TENANT0_TOKEN)).0,
                own,
                "{tenant}"
            );
        }
    }
    // A tenant no partition has seen is unknown, not $0, whoever holds its
    // partition.
    for app in [&a, &b] {
        let (status, body) = p.http(app, "/v1/tenants/never-seen/usage");
        assert_eq!(status, 404, "{body}");
        assert!(body.contains("unknown_tenant"), "{body}");
    }
    let out = Command::new(sluice_bin())
        .args(["usage", "tenant-0", "--url", &url(&a)])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));

    // A tenant without tasks: unknown (404), never zeros, with `sluice usage`
    // on either instance too.
    for app in [&a, &b] {
        let (code, stderr) = usage_cli(app, "nobody-at-all", &[]).unwrap_err();
        assert_ne!(code, 0);
        assert!(
            stderr.contains("404") && stderr.contains("unknown_tenant"),
            "{stderr}"
        );
    }

    // One window only; an unknown window is refused with the server's reason.
    let one = usage_cli(&a, &tenants[0], &["--json", "--window", "1h"]).unwrap();
    let one: TenantUsageReport = serde_json::from_str(&one).unwrap();
    assert_eq!(one.windows.len(), 1);
    assert_eq!(one.windows[0].window, "1h");
    let (code, stderr) = usage_cli(&b, &tenants[0], &["--window", "2w"]).unwrap_err();
    assert_ne!(code, 0);
    assert!(
        stderr.contains("404") && stderr.contains("unknown window 2w"),
        "{stderr}"
    );
    // A claim written by anyone but an instance of the group (unsigned, or
    // signed with another key), naming a listener of its own as the holder
    // of every partition with the newest assignment: it receives no query.
    let canary = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    canary.set_nonblocking(true).unwrap();
    let canary_url = format!("http://{}", canary.local_addr().unwrap());
    let now = chrono::Utc::now().timestamp_millis();
    let forged = |server: &str| sluice_topology::runtime::InstanceClaim {
        server: server.to_string(),
        partitions: ["summarize", "classify", "extract"]
            .iter()
            .map(|t| (p.topic(t), vec![0, 1]))
            .collect(),
        assigned_ms: now + 1_000,
        updated_ms: now,
        signature: None,
    };
    let other_key =
        sluice_topology::runtime::ClaimKey::new(b"not the group's key, but long enough").unwrap();
    let claims = [
        forged(&canary_url),
        other_key.sign(forged(&format!("{canary_url}/"))),
    ];
    let records: Vec<sluice::kafka::OutRecord> = claims
        .iter()
        .map(|c| sluice::kafka::OutRecord {
            key: Some(c.server.clone().into_bytes()),
            value: Some(serde_json::to_vec(c).unwrap()),
            ..Default::default()
        })
        .collect();
    sluice::kafka::produce(
        &common::bootstrap(),
        &format!("{}-app-instances", p.prefix),
        records,
    )
    .unwrap();
    // Both instances read the topic within a poll or two.
    std::thread::sleep(Duration::from_secs(3));
    for tenant in &tenants {
        for app in [&a, &b] {
            let r = report(app, tenant).expect("answered");
            assert!(
                r.served_by == url(&a) || r.served_by == url(&b),
                "{tenant}: served by {}",
                r.served_by
            );
        }
    }
    assert!(
        canary.accept().is_err(),
        "a forged claim received a forwarded query"
    );
}

#[test]
fn a_killed_owners_tenants_are_answered_by_the_survivor_after_restore() {
    let p = Pipeline::new(SimConfig::default(), CONFIG);
    let mut a = p.start("kill-a");
    let (mut b, _b_state) = p.start_other("kill-b", "");
    wait_for_one_task_each(&p, [&a, &b]);
    let tenants = tenants();
    let tasks = completed_tasks(&tenants, 32);
    p.produce(&tasks);
    let results = p.results(tasks.len(), Duration::from_secs(120));
    assert_each_answered_once(&tasks, &results);

    // A tenant of each instance, with its figures as its owner reports them.
    let mut before = BTreeMap::new();
    for tenant in &tenants {
        let (ra, _) = eventually(Duration::from_secs(60), "both answer", || {
            let (ra, rb) = both(&a, &b, tenant)?;
            (ra == rb
                && ra
                    .windows
                    .iter()
                    .all(|w| *w == expected(&results, tenant, w)))
            .then_some((ra, rb))
        });
        before
            .entry(ra.served_by.clone())
            .or_insert((tenant.clone(), ra));
    }
    assert_eq!(before.len(), 2, "each instance holds a tenant");
    let (victim, survivor) = if before.contains_key(&url(&b)) {
        (&mut b, &a)
    } else {
        (&mut a, &b)
    };
    let (tenant, owned) = before[&url(victim)].clone();
    victim.proc.kill9();

    // The survivor takes the partition over, restores its accounts from the
    // changelogs, and answers for the tenant itself.
    let after = eventually(
        Duration::from_secs(180),
        "the survivor answers for the killed owner's tenant",
        || report(survivor, &tenant).filter(|r| r.served_by == url(survivor)),
    );
    for (w, old) in after.windows.iter().zip(&owned.windows) {
        assert_eq!(
            *w,
            expected(&results, &tenant, w),
            "{tenant} after the kill"
        );
        if w.window_start == old.window_start {
            assert_eq!(w, old, "{tenant}: the same figures as its first owner's");
        }
    }
}
