//! Example topologies on the engine alone (no LLM): the windowed count the
//! `demo` runs, and the fixtures the engine's integration tests run as separate
//! processes (so they can be killed).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use rand::Rng;
use serde::{Deserialize, Serialize};
use sluice_topology::runtime::{EngineMetrics, Guarantee, RunningApp, StreamsApp, StreamsConfig};
use sluice_topology::{
    JsonCodec, KStream, ProcessError, Processor, ProcessorContext, Record, SourceOptions,
    StreamBuilder, StringCodec, TimeWindows, Topology, Windowed,
};

/// Which example topology to run.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ExampleKind {
    /// Per-key counts in 1-minute tumbling windows (emitted on every update).
    WindowedCount,
    /// Each record is echoed after an async delay drawn uniformly from
    /// [min-delay-ms, max-delay-ms]; completions arrive out of order.
    AsyncEcho,
    /// Two co-partitioned inputs merged and counted per key.
    MergedCount,
    /// Each record passed on after an async delay drawn uniformly from
    /// [min-delay-ms, max-delay-ms] (completions out of order), then counted
    /// per key in the same sub-topology.
    AsyncCount,
    /// Counted per key, every update passed on after an async delay (the
    /// count's results are derived records in flight across commits).
    CountAsync,
    /// Counted per key with cached results (the latest per key at each
    /// commit), each passed on after an async delay.
    CachedCountAsync,
}

/// Arguments of `sluice example`.
#[derive(Args, Debug, Clone)]
pub struct ExampleArgs {
    /// The topology.
    #[arg(value_enum)]
    pub kind: ExampleKind,
    /// Kafka bootstrap servers.
    #[arg(long)]
    pub bootstrap: String,
    /// Application id (consumer group, internal topic prefix).
    #[arg(long)]
    pub app_id: String,
    /// Input topic(s), comma-separated.
    #[arg(long)]
    pub input: String,
    /// Output topic.
    #[arg(long)]
    pub output: String,
    /// Dead-letter topic for undecodable input.
    #[arg(long)]
    pub dlq: Option<String>,
    /// State directory.
    #[arg(long)]
    pub state_dir: PathBuf,
    /// Processing guarantee.
    #[arg(long, value_enum, default_value = "exactly-once")]
    pub guarantee: GuaranteeArg,
    /// Commit interval, ms (default: the guarantee's).
    #[arg(long)]
    pub commit_interval_ms: Option<u64>,
    /// Consumer session timeout, ms.
    #[arg(long, default_value_t = 6000)]
    pub session_timeout_ms: u64,
    /// Consumer max poll interval, ms.
    #[arg(long, default_value_t = 300_000)]
    pub max_poll_interval_ms: u64,
    /// Window grace, ms (windowed-count).
    #[arg(long, default_value_t = 0)]
    pub grace_ms: u64,
    /// Minimum async delay, ms (async-echo).
    #[arg(long, default_value_t = 0)]
    pub min_delay_ms: u64,
    /// Maximum async delay, ms (async-echo).
    #[arg(long, default_value_t = 0)]
    pub max_delay_ms: u64,
    /// In-flight records per partition before it is paused.
    #[arg(long, default_value_t = 1000)]
    pub max_in_flight: usize,
}

/// Processing guarantee on the command line.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum GuaranteeArg {
    /// At least once.
    AtLeastOnce,
    /// Exactly once.
    ExactlyOnce,
}

impl From<GuaranteeArg> for Guarantee {
    fn from(g: GuaranteeArg) -> Self {
        match g {
            GuaranteeArg::AtLeastOnce => Guarantee::AtLeastOnce,
            GuaranteeArg::ExactlyOnce => Guarantee::ExactlyOnce,
        }
    }
}

/// The windowed-count topology: string keys, any value; JSON output keyed by
/// the windowed key with the running count as value.
pub fn windowed_count(
    input: &[&str],
    output: &str,
    dlq: Option<String>,
    grace: Duration,
) -> Topology {
    let b = StreamBuilder::new();
    let records = b.stream_with(
        input,
        StringCodec,
        sluice_topology::UnitCodec,
        SourceOptions {
            dead_letter_topic: dlq,
        },
    );
    count_per_minute(&records, output, grace);
    b.build().expect("the windowed-count topology is valid")
}

/// Per-key counts in 1-minute tumbling windows (store `counts`), written to
/// `output` as JSON on every commit.
fn count_per_minute(records: &KStream<String, ()>, output: &str, grace: Duration) {
    records
        .group_by_key()
        .windowed_by(TimeWindows::tumbling(Duration::from_secs(60)).grace(grace))
        .count("counts")
        .to_stream()
        .to(
            output,
            JsonCodec::<Windowed<String>>::default(),
            JsonCodec::<u64>::default(),
        );
}

/// Output of the async echo: the input value and where it came from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Echo {
    /// The input value.
    pub value: String,
    /// The async delay applied, ms.
    pub delay_ms: u64,
}

struct AsyncEcho {
    min: u64,
    max: u64,
}

/// A delay drawn uniformly from `[min, max]` ms.
fn random_delay(min: u64, max: u64) -> u64 {
    if max > min {
        rand::rng().random_range(min..=max)
    } else {
        min
    }
}

impl Processor<String, String> for AsyncEcho {
    type OutKey = String;
    type OutValue = Echo;
    type Output = (Record<String, String>, u64);

    fn process(
        &mut self,
        r: Record<String, String>,
        ctx: &mut ProcessorContext<'_, String, Echo, Self::Output>,
    ) -> Result<(), ProcessError> {
        let delay = random_delay(self.min, self.max);
        ctx.spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            (r, delay)
        });
        Ok(())
    }

    fn complete(
        &mut self,
        (r, delay_ms): Self::Output,
        ctx: &mut ProcessorContext<'_, String, Echo, Self::Output>,
    ) -> Result<(), ProcessError> {
        ctx.forward(Record {
            key: r.value.clone(),
            value: Echo {
                value: r.value,
                delay_ms,
            },
            timestamp: r.timestamp,
            headers: r.headers,
        })
    }
}

/// Passes each record on unchanged after an async delay drawn uniformly from
/// `[min, max]` ms, so completions arrive out of order.
struct AsyncDelay {
    min: u64,
    max: u64,
}

impl<V: sluice_topology::Data> Processor<String, V> for AsyncDelay {
    type OutKey = String;
    type OutValue = V;
    type Output = Record<String, V>;

    fn process(
        &mut self,
        r: Record<String, V>,
        ctx: &mut ProcessorContext<'_, String, V, Self::Output>,
    ) -> Result<(), ProcessError> {
        let delay = random_delay(self.min, self.max);
        ctx.spawn(async move {
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            r
        });
        Ok(())
    }

    fn complete(
        &mut self,
        r: Self::Output,
        ctx: &mut ProcessorContext<'_, String, V, Self::Output>,
    ) -> Result<(), ProcessError> {
        ctx.forward(r)
    }
}

/// The windowed count of [`windowed_count`] behind an async pass-through
/// whose completions arrive out of order (delays drawn from `[min, max]` ms).
pub fn async_windowed_count(
    input: &[&str],
    output: &str,
    grace: Duration,
    min: u64,
    max: u64,
) -> Topology {
    let b = StreamBuilder::new();
    let delayed = b
        .stream(input, StringCodec, sluice_topology::UnitCodec)
        .process("delay", &[], move || AsyncDelay { min, max });
    count_per_minute(&delayed, output, grace);
    b.build()
        .expect("the async windowed-count topology is valid")
}

/// An async pass-through completing out of order into a per-key count (no
/// window) in the same sub-topology; counts go out keyed by the record key.
fn async_count(input: &[&str], output: &str, min: u64, max: u64) -> Topology {
    let b = StreamBuilder::new();
    b.stream(input, StringCodec, sluice_topology::BytesCodec)
        .process("delay", &[], move || AsyncDelay { min, max })
        .group_by_key()
        .count("async-counts")
        .to_stream()
        .to(output, StringCodec, JsonCodec::<u64>::default());
    b.build().expect("the async-count topology is valid")
}

/// A per-key count (every update, or cached: the latest per key at each
/// commit) whose results go on through an async pass-through completing out
/// of order; counts go out keyed by the record key.
fn count_async(input: &[&str], output: &str, cached: bool, min: u64, max: u64) -> Topology {
    let b = StreamBuilder::new();
    let grouped = b
        .stream(input, StringCodec, sluice_topology::BytesCodec)
        .group_by_key();
    let grouped = if cached {
        grouped
    } else {
        grouped.emit_on_update()
    };
    grouped
        .count("counts")
        .to_stream()
        .process("delay", &[], move || AsyncDelay { min, max })
        .to(output, StringCodec, JsonCodec::<u64>::default());
    b.build().expect("the count-async topology is valid")
}

fn async_echo(input: &[&str], output: &str, min: u64, max: u64) -> Topology {
    let b = StreamBuilder::new();
    b.stream(input, StringCodec, StringCodec)
        .process("echo", &[], move || AsyncEcho { min, max })
        .to(output, StringCodec, JsonCodec::<Echo>::default());
    b.build().expect("the async-echo topology is valid")
}

fn merged_count(input: &[&str], output: &str) -> Topology {
    let b = StreamBuilder::new();
    let mut streams = input
        .iter()
        .map(|t| b.stream(&[t], StringCodec, sluice_topology::BytesCodec));
    let first = streams.next().expect("at least one input");
    let merged = streams.fold(first, |acc, s| acc.merge(&s));
    merged.group_by_key().count("merged-counts").to_stream().to(
        output,
        StringCodec,
        JsonCodec::<u64>::default(),
    );
    b.build().expect("the merged-count topology is valid")
}

/// Builds the streams config for an example.
pub fn example_config(a: &ExampleArgs) -> StreamsConfig {
    let mut cfg = StreamsConfig::new(&a.app_id, &a.bootstrap, &a.state_dir);
    cfg.guarantee = a.guarantee.into();
    cfg.commit_interval = a.commit_interval_ms.map(Duration::from_millis);
    cfg.session_timeout = Duration::from_millis(a.session_timeout_ms);
    cfg.max_poll_interval = Duration::from_millis(a.max_poll_interval_ms);
    cfg.max_in_flight_per_partition = a.max_in_flight;
    cfg.transaction_timeout = Duration::from_secs(10);
    cfg
}

/// Builds the topology an example names.
pub fn example_topology(a: &ExampleArgs) -> Topology {
    let inputs: Vec<&str> = a.input.split(',').collect();
    match a.kind {
        ExampleKind::WindowedCount => windowed_count(
            &inputs,
            &a.output,
            a.dlq.clone(),
            Duration::from_millis(a.grace_ms),
        ),
        ExampleKind::AsyncEcho => async_echo(&inputs, &a.output, a.min_delay_ms, a.max_delay_ms),
        ExampleKind::MergedCount => merged_count(&inputs, &a.output),
        ExampleKind::AsyncCount => async_count(&inputs, &a.output, a.min_delay_ms, a.max_delay_ms),
        ExampleKind::CountAsync => {
            count_async(&inputs, &a.output, false, a.min_delay_ms, a.max_delay_ms)
        }
        ExampleKind::CachedCountAsync => {
            count_async(&inputs, &a.output, true, a.min_delay_ms, a.max_delay_ms)
        }
    }
}

/// Runs an example until SIGTERM/SIGINT, printing `TASKS …` lines when the
/// assigned tasks change and a final `STATS {json}` line (for the tests).
pub async fn run_example(a: ExampleArgs) -> anyhow::Result<()> {
    let metrics = EngineMetrics::unregistered();
    let app = StreamsApp::new(example_topology(&a), example_config(&a), metrics.clone())
        .with_runtime(tokio::runtime::Handle::current());
    let running = match app.start() {
        Ok(r) => r,
        Err(e) => {
            println!("START_ERROR {e}");
            return Err(e.into());
        }
    };
    let running = Arc::new(running);
    let watcher = {
        let running = running.clone();
        tokio::spawn(async move {
            let mut last = String::from("-");
            loop {
                let tasks: Vec<String> = running
                    .status()
                    .tasks()
                    .iter()
                    .map(|t| t.to_string())
                    .collect();
                let line = format!(
                    "TASKS {} ready={}",
                    tasks.join(","),
                    running.status().is_ready()
                );
                if line != last {
                    println!("{line}");
                    last = line;
                }
                if running.is_finished() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    wait_for_stop(&running).await;
    running.shutdown();
    let running = Arc::try_unwrap(running).ok();
    watcher.abort();
    let result =
        tokio::task::spawn_blocking(move || running.map(RunningApp::join).unwrap_or(Ok(())))
            .await?;
    println!(
        "STATS {}",
        serde_json::json!({
            "restored_records": metrics.restored_records(),
            "records_in": metrics.records_in(),
            "commits": metrics.commit_count(),
            "rebalances": metrics.rebalance_count(),
            "replay_skipped": metrics.replay_skipped(),
            "clients_given_up": metrics.clients_given_up(),
            "ok": result.is_ok(),
        })
    );
    result.map_err(Into::into)
}

async fn wait_for_stop(running: &RunningApp) {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler installs");
    loop {
        tokio::select! {
            _ = term.recv() => return,
            _ = tokio::signal::ctrl_c() => return,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                if running.is_finished() { return; }
            }
        }
    }
}
