//! The catalogue of the metric families Sluice exports: [`register_all`]
//! registers them the way [`crate::cli::run::run_pipeline`] does (engine metrics,
//! the LLM client's, then every step of the default pipeline with every
//! optional part on) and returns their names, read back from the registry.
//!
//! Used by `tests/metrics_catalog.rs` to hold the Grafana dashboard and
//! `docs/metrics.md` to what the code really exports.
//!
//! A `prometheus::Registry` lists its collectors' descriptors nowhere, and
//! [`Registry::gather`] leaves out a vector family until it has a labelled
//! child. So the names come from two places, each checked against the
//! registry:
//! - `gather()`: every family that has a series right after registration;
//! - the name constants of the metric modules, each kept only if the
//!   registry refuses a probe collector of that name as already registered.
//!
//! and the number found must equal the number of collectors the registry
//! holds (read from its `Debug` output): a new family that is neither
//! gathered nor named by a constant fails [`register_all`] instead of
//! slipping out of the catalogue.

use prometheus::{IntGauge, Registry};
use sluice_topology::runtime::metrics::{names as engine, EngineMetrics};

use crate::cli::gateway::metrics::names as gateway;
use crate::config::Config;
use crate::llm::metrics::names as llm;
use crate::llm::LlmClient;
use crate::steps::health::Health;
use crate::steps::invoke_llm::metrics::names as operator;

/// The parts of a configuration that register metrics, all switched on
/// (accounting, batching; routing is always on), added to
/// [`crate::config::MINIMAL`]; nothing in it is contacted.
const CATALOG_PARTS: &str = r#"
[accounting]
enabled = true

[batching]
enabled = true
"#;

/// Names of metric families that may have no series until something happens
/// (vector families), as the metric modules define them. Each is checked
/// against the registry; none is taken on trust.
fn named_families() -> Vec<&'static str> {
    vec![
        // Engine (sluice-topology).
        engine::RECORDS_IN,
        engine::RECORDS_OUT,
        engine::PROCESS_SECONDS,
        engine::IN_FLIGHT,
        engine::PAUSED,
        engine::REBALANCES,
        engine::RESTORE_SECONDS,
        engine::RESTORE_RECORDS,
        engine::COMMITS,
        engine::COMMIT_SECONDS,
        engine::ABORTED,
        engine::LAG,
        engine::DLQ,
        engine::LATE,
        engine::REPLAY_SKIPPED,
        engine::TASKS,
        // LLM client.
        llm::LLM_REQUESTS_TOTAL,
        llm::LLM_LATENCY_SECONDS,
        llm::LIMITER_RATE,
        llm::LIMITER_GROUP_SHARE,
        llm::CONCURRENCY_LIMIT,
        llm::BREAKER_STATE,
        llm::RETRIES_TOTAL,
        llm::PRIORITY_SERVED_TOTAL,
        // invoke_llm.
        operator::RESULTS,
        operator::TASK_LATENCY,
        operator::DUPLICATES,
        operator::REPUBLISHED,
        operator::PARKED,
        operator::TOKENS,
        operator::COST,
        operator::FALLBACKS,
        operator::ID_CONFLICTS,
        operator::BATCH_CALLS_SAVED,
        operator::BATCH_FALLBACKS,
        operator::QUOTA_REJECTIONS,
        operator::RESERVATIONS,
        operator::QUOTA_WAITING,
        // route.
        crate::steps::route::ROUTE_DECISIONS,
        // tasks.
        crate::steps::MISPLACED_METRIC,
        // account (the name is a literal in `Accounting::registered`).
        "sluice_alerts_emitted_total",
        // gateway.
        gateway::REQUESTS,
        gateway::SKIPPED,
    ]
}

fn err(message: impl Into<String>) -> prometheus::Error {
    prometheus::Error::Msg(message.into())
}

/// Registers every metric family of the app into `registry`, as
/// [`crate::cli::run::run_pipeline`] does, and returns their names, sorted.
///
/// Fails if registering fails (e.g. `registry` already holds one of them),
/// or if a registered family's name cannot be read back (see the module
/// documentation).
pub fn register_all(registry: &Registry) -> prometheus::Result<Vec<String>> {
    let text = format!("{}{CATALOG_PARTS}", crate::config::MINIMAL);
    let config = Config::from_toml_with_env(&text, [])
        .map_err(|e| err(format!("catalog config: {}: {}", e.key, e.message)))?;
    // The same calls, in the same order, as `run_pipeline`.
    let engine_metrics = EngineMetrics::register(registry)?;
    let client = LlmClient::from_config(&config.llm, registry)
        .map_err(|e| err(format!("llm client: {e}")))?;
    let steps = crate::cli::run::steps(
        &config,
        crate::cli::run::TaskPartitions::Unknown,
        client,
        registry,
        Health::default(),
    )?;
    // `sluice gateway`'s own (on its own listener).
    let gateway_metrics = crate::cli::gateway::metrics::GatewayMetrics::register(registry)?;
    drop((engine_metrics, steps, gateway_metrics));

    let collectors = collector_count(registry)?;
    let mut found: Vec<String> = registry
        .gather()
        .iter()
        .map(|mf| mf.name().to_string())
        .collect();
    for name in named_families() {
        if !found.iter().any(|f| f == name) && is_registered(registry, name)? {
            found.push(name.to_string());
        }
    }
    found.sort();
    found.dedup();
    if found.len() != collectors {
        return Err(err(format!(
            "the registry holds {collectors} metric families but only {} could be named ({}): \
             a new family without series at start-up needs its name constant in \
             metrics_catalog::named_families",
            found.len(),
            found.join(", ")
        )));
    }
    Ok(found)
}

/// The names of every metric family Sluice exports (a fresh registry).
pub fn exported_names() -> prometheus::Result<Vec<String>> {
    register_all(&Registry::new())
}

/// Whether a family of this name (without constant labels) is registered:
/// the registry refuses a second collector with the same descriptor id.
fn is_registered(registry: &Registry, name: &str) -> prometheus::Result<bool> {
    let probe = IntGauge::new(name, "metrics catalog probe")?;
    match registry.register(Box::new(probe.clone())) {
        Err(prometheus::Error::AlreadyReg) => Ok(true),
        // Same name, other labels or help: registered too.
        Err(prometheus::Error::Msg(m)) if m.contains("same fully-qualified name") => Ok(true),
        Err(e) => Err(e),
        Ok(()) => {
            registry.unregister(Box::new(probe))?;
            Ok(false)
        }
    }
}

/// How many collectors the registry holds. `Registry` tells only in its
/// `Debug` output (`RegistryCore (N collectors)`); each Sluice metric is a
/// collector of one family.
fn collector_count(registry: &Registry) -> prometheus::Result<usize> {
    let debug = format!("{registry:?}");
    let start = debug
        .find("RegistryCore (")
        .map(|i| i + "RegistryCore (".len())
        .ok_or_else(|| err(format!("unexpected Registry debug output: {debug}")))?;
    debug[start..]
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| err(format!("unexpected Registry debug output: {debug}")))
}
