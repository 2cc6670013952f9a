//! `sluice demo`: runs Sluice end to end on a local broker with sample data and
//! prints what it computed.

use std::collections::BTreeMap;
use std::time::Duration;

use clap::Args;
use rdkafka::Message;
use sluice_topology::runtime::{EngineMetrics, Guarantee, StreamsApp, StreamsConfig};
use sluice_topology::Windowed;

use crate::examples::windowed_count;
use crate::kafka::{create_topics, produce, read_topics, OutRecord};

/// Arguments of `sluice demo`.
#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Kafka bootstrap servers of the (local) broker.
    #[arg(long, env = "SLUICE_BOOTSTRAP", default_value = "127.0.0.1:9092")]
    pub bootstrap: String,
    /// Number of sample events.
    #[arg(long, default_value_t = 20_000)]
    pub events: usize,
}

const TENANTS: [&str; 5] = ["acme", "globex", "initech", "umbrella", "hooli"];
const MINUTE: i64 = 60_000;

/// Runs the demo: produces events, counts them per tenant and minute with
/// exactly-once processing, and checks every window against the input.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let input = format!("demo.events.{run_id}");
    let output = format!("demo.counts.{run_id}");
    create_topics(&args.bootstrap, &[(&input, 4, &[]), (&output, 4, &[])])?;

    // Sample data: events of five tenants over five minutes.
    let base = (chrono::Utc::now().timestamp_millis() / MINUTE - 10) * MINUTE;
    let mut expected: BTreeMap<(i64, String), u64> = BTreeMap::new();
    let events: Vec<OutRecord> = (0..args.events)
        .map(|i| {
            let tenant = TENANTS[(i * 7 + i / 3) % TENANTS.len()];
            let ts = base + (i as i64 * 5 * MINUTE) / args.events as i64;
            *expected
                .entry((ts - ts % MINUTE, tenant.to_string()))
                .or_default() += 1;
            OutRecord {
                key: Some(tenant.as_bytes().to_vec()),
                value: Some(format!("{{\"event\":{i}}}").into_bytes()),
                timestamp: Some(ts),
                ..Default::default()
            }
        })
        .collect();
    let n = tokio::task::spawn_blocking({
        let (b, t) = (args.bootstrap.clone(), input.clone());
        move || produce(&b, &t, events)
    })
    .await??;
    println!(
        "demo: produced {n} events for {} tenants to {input}",
        TENANTS.len()
    );

    let state_dir = std::env::temp_dir().join(format!("sluice-demo-{run_id}"));
    let mut cfg = StreamsConfig::new(
        &format!("sluice-demo-{run_id}"),
        &args.bootstrap,
        &state_dir,
    );
    cfg.guarantee = Guarantee::ExactlyOnce;
    cfg.session_timeout = Duration::from_secs(6);
    let metrics = EngineMetrics::unregistered();
    let topology = windowed_count(&[&input], &output, None, Duration::ZERO);
    println!("demo: topology\n{}", topology.describe(&cfg.application_id));
    let app = StreamsApp::new(topology, cfg, metrics.clone())
        .with_runtime(tokio::runtime::Handle::current())
        .start()?;

    let want = expected.clone();
    let messages = tokio::task::spawn_blocking({
        let (b, t) = (args.bootstrap.clone(), output.clone());
        move || {
            read_topics(&b, &[&t], true, Duration::from_secs(180), |msgs| {
                latest_counts(msgs).is_ok_and(|got| got == want)
            })
        }
    })
    .await??;
    let got = latest_counts(&messages)?;
    app.shutdown();
    tokio::task::spawn_blocking(move || app.join()).await??;
    let _ = std::fs::remove_dir_all(&state_dir);

    println!("demo: per-tenant counts in 1-minute windows (exactly-once)");
    println!(
        "{:<22} {:<10} {:>8} {:>8}",
        "window start (UTC)", "tenant", "count", "input"
    );
    for ((start, tenant), count) in &got {
        let when = chrono::DateTime::from_timestamp_millis(*start)
            .map(|d| d.format("%Y-%m-%d %H:%M").to_string())
            .unwrap_or_default();
        let input_count = expected
            .get(&(*start, tenant.clone()))
            .copied()
            .unwrap_or(0);
        println!("{when:<22} {tenant:<10} {count:>8} {input_count:>8}");
    }
    if got == expected {
        println!(
            "demo: OK — {} windows, every count equals the input ({} records in, {} commits)",
            got.len(),
            metrics.records_in(),
            metrics.commit_count()
        );
        Ok(())
    } else {
        anyhow::bail!("demo: counts differ from the input")
    }
}

/// The last count per (window start, key) in windowed-count output.
pub fn latest_counts(
    msgs: &[rdkafka::message::OwnedMessage],
) -> anyhow::Result<BTreeMap<(i64, String), u64>> {
    let mut out = BTreeMap::new();
    for m in msgs {
        let key: Windowed<String> = serde_json::from_slice(m.key().unwrap_or_default())?;
        let count: u64 = serde_json::from_slice(m.payload().unwrap_or_default())?;
        out.insert((key.window.start, key.key), count);
    }
    Ok(out)
}
