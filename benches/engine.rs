//! `make bench-engine`: one dataset on the local broker, measured in one run:
//! (a) the raw rate a plain rdkafka consumer reads it at (the faster of reading
//! through the consumer queue and through one queue per partition); (b) a windowed per-key
//! count of it (10,000 keys, 1-minute tumbling windows) under at-least-once and
//! under exactly-once; (c) the restore rate of the resulting changelog; (d) the
//! same count behind an async pass-through whose completions arrive out of
//! order (delays drawn from 0–2 ms), under exactly-once. Prints the ratios
//! against the raw rate on the last line.

/// The same allocator as the `sluice` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::{Duration, Instant};

use sluice::cli::example::{async_windowed_count, windowed_count};
use sluice::kafka::{create_topics, produce, OutRecord};
use sluice_topology::runtime::{
    AppState, EngineMetrics, Guarantee, RunningApp, StreamsApp, StreamsConfig,
};

mod common;

use common::{broker_pid, cpu_secs, env_usize, own_cpu_secs, raw_read, PARTITIONS};

const KEYS: usize = 10_000;

/// The topologies measured.
#[derive(Clone, Copy, Debug)]
enum Counting {
    /// The windowed count.
    Direct,
    /// The windowed count behind an out-of-order async pass-through.
    BehindAsync,
}

fn aggregate(
    bootstrap: &str,
    topic: &str,
    n: usize,
    guarantee: Guarantee,
    counting: Counting,
    state: &std::path::Path,
) -> (f64, String) {
    let app_id = format!(
        "bench-{:?}-{:?}-{}",
        guarantee,
        counting,
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
    .to_lowercase();
    create_topics(bootstrap, &[(&format!("{app_id}-out"), PARTITIONS, &[])]).unwrap();
    let (app, metrics) = start_count(bootstrap, &app_id, topic, guarantee, counting, state);
    // The clock starts at the assignment, as the plain read's starts at its
    // assign: restore, position lookup and first fetch count.
    while app.status().state() == AppState::Starting {
        std::thread::sleep(Duration::from_millis(1));
    }
    let start = Instant::now();
    let mut first = None;
    while (metrics.records_in() as usize) < n {
        if metrics.records_in() > 0 {
            first.get_or_insert_with(|| start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
        if app.is_finished() {
            panic!("app stopped: {:?}", app.status().state());
        }
    }
    let secs = start.elapsed().as_secs_f64();
    app.shutdown();
    app.join().expect("clean stop");
    eprintln!(
        "{guarantee:?} {counting:?}: {n} records in {secs:.2}s (first after {:.2}s; {} task commits in rounds taking {:.2}s)",
        first.unwrap_or_default().as_secs_f64(),
        metrics.commit_count(),
        metrics.commit_seconds_sum()
    );
    (n as f64 / secs, app_id)
}

/// Runs `round`; returns its result and the CPU time this process and the
/// broker spent on it (seconds; the broker's is 0 unless `make bench-engine`
/// passes its pid).
fn with_cpu<T>(round: impl FnOnce() -> T) -> (T, [f64; 2]) {
    let cpu = || {
        [
            own_cpu_secs(),
            broker_pid().and_then(cpu_secs).unwrap_or(0.0),
        ]
    };
    let before = cpu();
    let out = round();
    let after = cpu();
    (out, [after[0] - before[0], after[1] - before[1]])
}

/// Starts the windowed count of `topic` into `<app_id>-out`.
fn start_count(
    bootstrap: &str,
    app_id: &str,
    topic: &str,
    guarantee: Guarantee,
    counting: Counting,
    state: &std::path::Path,
) -> (RunningApp, EngineMetrics) {
    let mut cfg = StreamsConfig::new(app_id, bootstrap, state);
    cfg.guarantee = guarantee;
    cfg.session_timeout = Duration::from_secs(6);
    // SLUICE_BENCH_DEBUG=<librdkafka debug contexts> for the engine's clients.
    if let Ok(d) = std::env::var("SLUICE_BENCH_DEBUG") {
        cfg.client_overrides.insert("debug".into(), d);
    }
    let metrics = EngineMetrics::unregistered();
    let output = format!("{app_id}-out");
    let grace = Duration::from_secs(3600);
    let topology = match counting {
        Counting::Direct => windowed_count(&[topic], &output, None, grace),
        Counting::BehindAsync => async_windowed_count(&[topic], &output, grace, 0, 2),
    };
    let app = StreamsApp::new(topology, cfg, metrics.clone())
        .start()
        .expect("start");
    (app, metrics)
}

fn restore(bootstrap: &str, app_id: &str, topic: &str, state: &std::path::Path) -> (f64, u64) {
    let (app, metrics) = start_count(
        bootstrap,
        app_id,
        topic,
        Guarantee::ExactlyOnce,
        Counting::Direct,
        state,
    );
    while !app.status().is_ready() {
        std::thread::sleep(Duration::from_millis(5));
    }
    app.shutdown();
    app.join().expect("clean stop");
    let records = metrics.restored_records();
    let secs = metrics.restore_seconds_sum();
    eprintln!("restore: {records} records in {secs:.2}s (summed over tasks restored in parallel)");
    // Tasks restore in parallel; the wall-clock rate is records over the
    // longest task's time, bounded below by the sum divided by tasks.
    let wall = metrics.restore_seconds_max().max(secs / PARTITIONS as f64);
    (records as f64 / wall, records)
}

fn main() {
    let bootstrap =
        std::env::var("SLUICE_BENCH_BOOTSTRAP").expect("run through `make bench-engine`");
    let n = env_usize("SLUICE_BENCH_RECORDS", 2_000_000);
    // SLUICE_BENCH_LOG=<filter> shows the engine's log (stderr).
    if let Ok(filter) = std::env::var("SLUICE_BENCH_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let topic = format!(
        "bench-in-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    create_topics(&bootstrap, &[(&topic, PARTITIONS, &[])]).unwrap();
    let base = (chrono::Utc::now().timestamp_millis() / 60_000 - 30) * 60_000;
    let minutes = 10i64;
    let records = (0..n).map(|i| OutRecord {
        key: Some(format!("key-{}", (i * 7919) % KEYS).into_bytes()),
        value: Some(format!("{{\"n\":{i},\"pad\":\"0123456789abcdef\"}}").into_bytes()),
        timestamp: Some(base + (i as i64 * minutes * 60_000) / n as i64),
        ..Default::default()
    });
    let t = Instant::now();
    produce(&bootstrap, &topic, records).unwrap();
    eprintln!("produced {n} records in {:.2}s", t.elapsed().as_secs_f64());

    let dir = tempfile::tempdir().unwrap();
    // SLUICE_BENCH_ONLY=alos|eos|async|restore runs only those rounds (for
    // profiling; restore: one exactly-once count, then three restores of it).
    if let Ok(only) = std::env::var("SLUICE_BENCH_ONLY") {
        if only == "restore" {
            let (_, app) = aggregate(
                &bootstrap,
                &topic,
                n,
                Guarantee::ExactlyOnce,
                Counting::Direct,
                &dir.path().join("eos"),
            );
            for round in 0..3 {
                let (rps, _) = restore(
                    &bootstrap,
                    &app,
                    &topic,
                    &dir.path().join(format!("restore-{round}")),
                );
                println!("restore_rps={rps:.0}");
            }
            return;
        }
        let (guarantee, counting) = match only.as_str() {
            "alos" => (Guarantee::AtLeastOnce, Counting::Direct),
            "eos" => (Guarantee::ExactlyOnce, Counting::Direct),
            "async" => (Guarantee::ExactlyOnce, Counting::BehindAsync),
            other => panic!("SLUICE_BENCH_ONLY={other}: alos, eos, async or restore"),
        };
        for round in 0..3 {
            let (rps, _) = aggregate(
                &bootstrap,
                &topic,
                n,
                guarantee,
                counting,
                &dir.path().join(format!("{only}-{round}")),
            );
            println!("{only}_rps={rps:.0}");
        }
        return;
    }
    // Three rounds of raw / at-least-once / exactly-once, interleaved; the
    // medians are compared, so a noisy moment does not favour either side.
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mut raws, mut splits, mut aloss, mut eoss, mut asyncs) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // CPU-µs per record of this process and of the broker, per round and
    // kind: on two cores shared with the broker, a round that keeps them busy
    // runs at the rate its CPU per record allows.
    let mut cpu: [[Vec<f64>; 2]; 5] = Default::default();
    let per_record = |into: &mut [Vec<f64>; 2], secs: [f64; 2], records: usize| {
        for (v, s) in into.iter_mut().zip(secs) {
            v.push(s * 1e6 / records as f64);
        }
    };
    let mut eos_app = String::new();
    for round in 0..3 {
        let (rps, secs) = with_cpu(|| raw_read(&bootstrap, &topic, n, false));
        raws.push(rps);
        per_record(&mut cpu[0], secs, n);
        let (rps, secs) = with_cpu(|| raw_read(&bootstrap, &topic, n, true));
        splits.push(rps);
        per_record(&mut cpu[0], secs, n);
        let dir_round = dir.path().join(format!("round-{round}"));
        let ((alos, _), secs) = with_cpu(|| {
            aggregate(
                &bootstrap,
                &topic,
                n,
                Guarantee::AtLeastOnce,
                Counting::Direct,
                &dir_round.join("alos"),
            )
        });
        aloss.push(alos);
        per_record(&mut cpu[1], secs, n);
        let ((eos, app), secs) = with_cpu(|| {
            aggregate(
                &bootstrap,
                &topic,
                n,
                Guarantee::ExactlyOnce,
                Counting::Direct,
                &dir_round.join("eos"),
            )
        });
        eoss.push(eos);
        per_record(&mut cpu[2], secs, n);
        eos_app = app;
        let ((async_eos, _), secs) = with_cpu(|| {
            aggregate(
                &bootstrap,
                &topic,
                n,
                Guarantee::ExactlyOnce,
                Counting::BehindAsync,
                &dir_round.join("async-eos"),
            )
        });
        asyncs.push(async_eos);
        per_record(&mut cpu[3], secs, n);
    }
    // The faster of the two plain reads is the baseline.
    let raw = median(raws).max(median(splits));
    let (alos, eos, async_eos) = (median(aloss), median(eoss), median(asyncs));
    let ((restore_rps, restored), secs) =
        with_cpu(|| restore(&bootstrap, &eos_app, &topic, &dir.path().join("restore")));
    per_record(&mut cpu[4], secs, restored as usize);
    // Medians (the two plain reads' six rounds together), this process's
    // and the broker's, and their sum.
    let [raw_cpu, alos_cpu, eos_cpu, async_cpu, restore_cpu] = cpu.map(|[own, broker]| {
        let (own, broker) = (median(own), median(broker));
        eprint!("{own:.2} + {broker:.2}; ");
        own + broker
    });
    eprintln!(
        "<- CPU-µs per record, this process + the broker: raw, alos, eos, async_eos, restore"
    );
    println!(
        "RESULT raw_rps={raw:.0} alos_rps={alos:.0} eos_rps={eos:.0} restore_rps={restore_rps:.0} async_eos_rps={async_eos:.0} alos_ratio={:.2} eos_ratio={:.2} restore_ratio={:.2} async_eos_ratio={:.2} raw_cpu_us={raw_cpu:.2} alos_cpu_us={alos_cpu:.2} eos_cpu_us={eos_cpu:.2} restore_cpu_us={restore_cpu:.2} async_eos_cpu_us={async_cpu:.2}",
        alos / raw,
        eos / raw,
        restore_rps / raw,
        async_eos / raw
    );
}
