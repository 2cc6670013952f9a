//! The Java clients around Sluice: seed-shaped tasks published by the Java
//! `kafka-clients` producer (its default partitioner, murmur2) with Jackson
//! envelopes (`submittedAt` as an ISO instant and as epoch milliseconds),
//! processed by two `sluice run` instances, every result read by a Java
//! `read_committed` consumer; `sluice usage` then finds every tenant on its
//! owner with the default `[tasks] partitioner = "murmur2"`. The Java side is
//! `tests/java` (built by `scripts/build-java-tests.sh`, which `make test`
//! runs).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::time::Duration;

use common::pipeline::*;
use common::{bootstrap, eventually, sluice_bin, unique};
use sluice::http::usage::TenantUsageReport;
use sluice::sim::SimConfig;
use sluice_topology::runtime::KeyPartitioner;

const TASKS: usize = 120;
const TENANTS: usize = 12;

/// `java -cp <tests/java> sluice.interop.Interop <args>`: its stdout lines as
/// JSON.
fn java(args: &[&str]) -> Vec<serde_json::Value> {
    let cp = std::env::var("SLUICE_TEST_JAVA_CP").unwrap_or_else(|_| {
        panic!("SLUICE_TEST_JAVA_CP is not set: run the tests with `make test`, which builds tests/java")
    });
    let out = Command::new("java")
        .args(["-cp", &cp, "sluice.interop.Interop"])
        .args(args)
        .output()
        .expect("run java");
    assert!(
        out.status.success(),
        "java {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn java_producers_and_consumers_round_trip_through_sluice() {
    let p = Pipeline::new(SimConfig::default(), "");
    let mut a = p.start("java-a");
    let (mut b, _state) = p.start_other("java-b", "");
    let boot = bootstrap();

    // The Java producer: key = tenant, partition by its default partitioner.
    let sent = java(&[
        "produce",
        &boot,
        &p.topic("classify"),
        &TASKS.to_string(),
        &TENANTS.to_string(),
    ]);
    assert_eq!(sent.len(), TASKS);
    let mut forms = (0, 0);
    for t in &sent {
        let tenant = t["tenantId"].as_str().unwrap();
        assert_eq!(
            t["partition"].as_i64().unwrap() as i32,
            KeyPartitioner::Murmur2.partition(tenant.as_bytes(), 2),
            "the Java producer put {tenant} where murmur2 says"
        );
        // submittedAt as Jackson wrote it: "\"2026-...Z\"" or "1764...".
        match t["submittedAt"].as_str().unwrap().starts_with('"') {
            true => forms.0 += 1,
            false => forms.1 += 1,
        }
    }
    assert_eq!(forms, (TASKS / 2, TASKS / 2), "both submittedAt forms");

    // The Java consumer, read_committed: every record it reads.
    let read = java(&[
        "consume",
        &boot,
        &unique("java-reader"),
        &TASKS.to_string(),
        "180",
        &p.completed(),
        &p.failed(),
    ]);
    let tenant_of: HashMap<&str, &str> = sent
        .iter()
        .map(|t| {
            (
                t["taskId"].as_str().unwrap(),
                t["tenantId"].as_str().unwrap(),
            )
        })
        .collect();
    let mut per_task: HashMap<&str, usize> = HashMap::new();
    // Per tenant: requests, input, output and cached tokens, cost.
    let mut billed: BTreeMap<&str, [i64; 5]> = BTreeMap::new();
    for r in &read {
        let v = &r["value"];
        let id = v["taskId"].as_str().unwrap();
        assert_eq!(r["key"].as_str(), Some(id), "results are keyed by task id");
        assert_eq!(r["topic"].as_str(), Some(p.completed().as_str()), "{v}");
        assert_eq!(v["success"], true, "{v}");
        let tenant = tenant_of
            .get(id)
            .unwrap_or_else(|| panic!("a result of no task sent: {v}"));
        assert_eq!(v["tenantId"].as_str(), Some(*tenant));
        assert_eq!(
            v["metadata"]["correlationId"].as_str(),
            Some(format!("corr-{id}").as_str())
        );
        *per_task.entry(id).or_default() += 1;
        let b = billed.entry(tenant).or_default();
        b[0] += 1;
        for (i, f) in ["inputTokens", "outputTokens", "cachedTokens", "costMicros"]
            .iter()
            .enumerate()
        {
            b[i + 1] += v[f].as_i64().unwrap_or_else(|| panic!("{f} in {v}"));
        }
    }
    let missing = tenant_of
        .keys()
        .filter(|id| !per_task.contains_key(*id))
        .count();
    let twice: Vec<_> = per_task.iter().filter(|(_, n)| **n > 1).collect();
    assert_eq!(missing, 0, "every task has a result");
    assert!(twice.is_empty(), "tasks answered twice: {twice:?}");
    assert!(
        p.dead_letters("classify").is_empty(),
        "nothing dead-lettered"
    );

    // `sluice usage` on one instance finds every tenant on its owner (half of
    // them on the other instance) with the totals the consumer read.
    assert_eq!(billed.len(), TENANTS);
    let mut served_by = std::collections::BTreeSet::new();
    for (tenant, want) in &billed {
        let report: TenantUsageReport =
            eventually(Duration::from_secs(30), "usage of the tenant", || {
                let out = Command::new(sluice_bin())
                    .args([
                        "usage",
                        tenant,
                        "--url",
                        &format!("http://{}", a.addr),
                        "--json",
                    ])
                    .env("SLUICE_TOKEN", ADMIN_TOKEN)
                    .output()
                    .unwrap();
                let r: TenantUsageReport = serde_json::from_slice(&out.stdout).ok()?;
                let w = r.windows.last()?;
                let got = [
                    w.requests as i64,
                    w.input_tokens as i64,
                    w.output_tokens as i64,
                    w.cached_tokens as i64,
                    w.cost_micros,
                ];
                (got == *want).then_some(r)
            });
        assert_eq!(report.tenant_id, *tenant);
        served_by.insert(report.served_by);
    }
    assert_eq!(
        served_by,
        [a.addr, b.addr]
            .iter()
            .map(|x| format!("http://{x}"))
            .collect(),
        "each instance served its own tenants"
    );
    a.proc.stop();
    b.proc.stop();
}
