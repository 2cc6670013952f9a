//! `make bench-usage`: per-tenant accounting through the windowed stores
//! under exactly-once, against the raw consume rate of the same records, in
//! one run; and the peak resident memory of an accounting instance holding
//! 100,000 tenants × 4 windows.
//!
//! One dataset of task results (10,000 tenants, two models, cached tokens,
//! completion times over the last ten minutes, keyed by tenant over 4
//! partitions) is produced once. Three rounds, interleaved: a plain rdkafka
//! consumer reads it; the engine decodes it under exactly-once and does
//! nothing else (`decode`: the ceiling of any topology over this input on
//! this machine, since every result must be decoded and its offset
//! committed); then the `account` operator (the default windows: 1 minute,
//! 1 hour, 1 day, calendar month) counts it under exactly-once with fresh state,
//! writing every window update to a usage topic. Medians are compared.
//! Then a child process (this binary again) accounts 100,000 tenants' results
//! and reports its peak resident set (`VmHWM`).

/// The same allocator as the `sluice` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::{Duration, Instant};

use sluice::envelope::TaskResult;
use sluice::kafka::{create_topics, produce, OutRecord};
use sluice::steps::account::{default_windows, AccountStreamExt, Accounting, AccountingSettings};
use sluice_topology::runtime::{AppState, EngineMetrics, Guarantee, StreamsApp, StreamsConfig};
use sluice_topology::{JsonCodec, SourceOptions, StreamBuilder, StringCodec};

#[allow(dead_code)]
mod common;
#[path = "common/results.rs"]
mod results;

use common::{env_usize, own_cpu_secs, raw_read, PARTITIONS};

fn unique(what: &str) -> String {
    format!(
        "bench-{what}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// `n` results over `tenants` tenants, completed over the last ten minutes.
fn produce_results(bootstrap: &str, topic: &str, n: usize, tenants: usize) {
    create_topics(bootstrap, &[(topic, PARTITIONS, &[])]).unwrap();
    let now = chrono::Utc::now().timestamp_millis();
    let records = results::task_results(n, tenants, now).map(|result| OutRecord {
        key: Some(result.tenant_id.clone().into_bytes()),
        value: Some(serde_json::to_vec(&result).unwrap()),
        timestamp: Some(result.completed_at.timestamp_millis()),
        ..Default::default()
    });
    let t = Instant::now();
    produce(bootstrap, topic, records).unwrap();
    eprintln!(
        "produced {n} results of {tenants} tenants in {:.2}s",
        t.elapsed().as_secs_f64()
    );
}

/// What an engine round does with the results.
#[derive(Clone, Copy, PartialEq)]
enum Round {
    /// Counts them into the windows, writing usage records and changelogs.
    Account,
    /// Decodes them and commits their offsets, nothing more: the engine's
    /// own ceiling for this input under exactly-once, with no accounting.
    DecodeOnly,
}

/// Runs `n` results of `topic` through the engine under exactly-once with
/// fresh state: results per second, from the assignment to the last one in.
fn engine_round(
    bootstrap: &str,
    topic: &str,
    n: usize,
    state: &std::path::Path,
    round: Round,
) -> f64 {
    let app_id = unique("usage");
    let usage_topic = format!("{app_id}-usage");
    let alerts_topic = format!("{app_id}-alerts");
    create_topics(
        bootstrap,
        &[
            (&usage_topic, PARTITIONS, &[]),
            (&alerts_topic, PARTITIONS, &[]),
        ],
    )
    .unwrap();
    let accounting = Accounting::new(AccountingSettings {
        name: "usage".into(),
        windows: default_windows(),
        usage_topic,
        usage_updates: Default::default(),
        budgets: Default::default(),
        thresholds: vec![0.5, 0.8, 1.0],
        alerts_topic,
        quotas: Default::default(),
        downgrade_at: None,
    });
    let b = StreamBuilder::new();
    let results = b.stream_with(
        &[topic],
        StringCodec,
        JsonCodec::<TaskResult>::default(),
        SourceOptions::default(),
    );
    match round {
        Round::Account => {
            results.account(&accounting);
        }
        Round::DecodeOnly => {
            // Every result decoded and looked at, none counted or written.
            results.filter(|r| r.value.tenant_id.is_empty());
        }
    }
    let topology = b.build().expect("topology");
    let mut cfg = StreamsConfig::new(&app_id, bootstrap, state);
    cfg.guarantee = Guarantee::ExactlyOnce;
    cfg.session_timeout = Duration::from_secs(6);
    let metrics = EngineMetrics::unregistered();
    let app = StreamsApp::new(topology, cfg, metrics.clone())
        .start()
        .expect("start");
    while app.status().state() == AppState::Starting {
        std::thread::sleep(Duration::from_millis(1));
    }
    let start = Instant::now();
    let cpu_start = own_cpu_secs();
    let mut first = None;
    while (metrics.records_in() as usize) < n {
        std::thread::sleep(Duration::from_millis(2));
        if first.is_none() && metrics.records_in() > 0 {
            first = Some(start.elapsed().as_secs_f64());
        }
        if app.is_finished() {
            panic!("app stopped: {:?}", app.status().state());
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = own_cpu_secs() - cpu_start;
    app.shutdown();
    app.join().expect("clean stop");
    let what = match round {
        Round::Account => format!(
            "accounted {n} results ({} window updates)",
            n * default_windows().len()
        ),
        Round::DecodeOnly => format!("decoded {n} results (nothing accounted)"),
    };
    eprintln!(
        "{what} in {secs:.2}s (first after {:.2}s; {} task commits taking {:.2}s; {cpu:.2} CPU-seconds)",
        first.unwrap_or(secs),
        metrics.commit_count(),
        metrics.commit_seconds_sum()
    );
    n as f64 / secs
}

/// Peak resident set of this process, MiB (`VmHWM`).
fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kib / 1024.0
}

/// The child's part: account every result of a topic, print the peak RSS.
fn rss_child(bootstrap: &str, topic: &str, n: usize) {
    let dir = tempfile::tempdir().unwrap();
    engine_round(bootstrap, topic, n, dir.path(), Round::Account);
    println!("RSS_MIB={:.0}", peak_rss_mib());
}

fn main() {
    let bootstrap =
        std::env::var("SLUICE_BENCH_BOOTSTRAP").expect("run through `make bench-usage`");
    if let (Ok(topic), Ok(n)) = (
        std::env::var("SLUICE_BENCH_RSS_TOPIC"),
        std::env::var("SLUICE_BENCH_RSS_RECORDS"),
    ) {
        return rss_child(&bootstrap, &topic, n.parse().unwrap());
    }
    let n = env_usize("SLUICE_BENCH_RECORDS", 200_000);
    let tenants = env_usize("SLUICE_BENCH_TENANTS", 10_000);
    let topic = unique("results");
    produce_results(&bootstrap, &topic, n, tenants);
    let dir = tempfile::tempdir().unwrap();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mut raws, mut decodes, mut usages) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..3 {
        let state = |what: &str| dir.path().join(format!("{what}-{i}"));
        raws.push(raw_read(&bootstrap, &topic, n, false));
        decodes.push(engine_round(
            &bootstrap,
            &topic,
            n,
            &state("decode"),
            Round::DecodeOnly,
        ));
        usages.push(engine_round(
            &bootstrap,
            &topic,
            n,
            &state("usage"),
            Round::Account,
        ));
    }
    let (raw, decode, usage) = (median(raws), median(decodes), median(usages));

    // 100,000 tenants, one result each, in a child process of its own.
    let big = env_usize("SLUICE_BENCH_RSS_TENANTS", 100_000);
    let big_topic = unique("results-100k");
    produce_results(&bootstrap, &big_topic, big, big);
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env("SLUICE_BENCH_RSS_TOPIC", &big_topic)
        .env("SLUICE_BENCH_RSS_RECORDS", big.to_string())
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("rss child");
    assert!(out.status.success(), "rss child failed");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let rss: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RSS_MIB="))
        .and_then(|v| v.parse().ok())
        .expect("RSS_MIB from the child");
    eprintln!(
        "{big} tenants x {} windows: peak RSS {rss:.0} MiB",
        default_windows().len()
    );
    println!(
        "RESULT raw_rps={raw:.0} decode_rps={decode:.0} usage_rps={usage:.0} decode_ratio={:.2} usage_ratio={:.2} rss_mib={rss:.0}",
        decode / raw,
        usage / raw
    );
}
