//! `sluice run`: the LLM task pipeline as a stream application, with its HTTP
//! listener; and `sluice topics create`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use sluice_topology::runtime::{EngineMetrics, Queries, RunningApp, StreamsApp};

use crate::config::{Config, ConfigError};
use crate::envelope::{EnvelopeLimits, TenantRules};
use crate::http::usage::UsageQueries;
use crate::http::{bind, serve, HttpState};
use crate::llm::LlmClient;
use crate::steps::account::{Accounting, AccountingSettings};
use crate::steps::invoke_llm::prompt::PromptBuilder;
use crate::steps::invoke_llm::{Health, LlmSettings, LlmStep, OperatorMetrics};
use crate::steps::route::RouteStep;
use crate::steps::source::Repartition;
use crate::steps::{
    default_topology, BatchMetrics, Batching, ByTenant, KeyCheck, Misplaced, Owners, ResultsSink,
    Steps, TaskSource, TaskTopic,
};
use crate::trace::Tracer;
use sluice_topology::{Topology, TopologyError};

/// How `sluice run` ended badly.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The configuration is invalid (exit code 2).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Kafka could not be reached or refused a request.
    #[error(transparent)]
    Kafka(#[from] crate::kafka::KafkaError),
    /// Metrics could not be registered.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The topology is invalid.
    #[error("topology: {0}")]
    Topology(#[from] TopologyError),
    /// The stream application could not start (topics, state, Kafka clients).
    #[error("cannot start: {0}")]
    Start(TopologyError),
    /// The HTTP listener could not start.
    #[error("http listener: {0}")]
    Http(#[from] std::io::Error),
    /// The stream application failed.
    #[error("stream application failed: {0}")]
    Runtime(#[from] sluice_topology::runtime::RuntimeError),
    /// The stream application's thread panicked.
    #[error("stream application thread: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// Loads the config and runs until SIGTERM/SIGINT or a fatal error.
pub async fn run(config_path: &Path) -> Result<(), RunError> {
    let config = Config::load(config_path)?;
    run_with(config).await
}

/// Runs a loaded config until SIGTERM/SIGINT.
pub async fn run_with(config: Config) -> Result<(), RunError> {
    run_until(config, signals()).await
}

/// Runs a loaded config until `shutdown` resolves (or a fatal error).
pub async fn run_until(
    config: Config,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), RunError> {
    check_results_partitions(&config)?;
    run_pipeline(config, default_topology, shutdown).await
}

/// Runs the topology `build` makes from the configured steps (a pipeline of
/// one's own: see `examples/custom_pipeline.rs`) until `shutdown` resolves,
/// with the HTTP listener.
pub async fn run_pipeline(
    config: Config,
    build: impl FnOnce(&Steps) -> Result<Topology, TopologyError>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), RunError> {
    let registry = Registry::new();
    let tokens = config.http.tokens()?;
    let engine_metrics = EngineMetrics::register(&registry)?;
    let client = LlmClient::from_config(&config.llm, &registry).map_err(|e| ConfigError {
        key: "llm".into(),
        message: e.to_string(),
    })?;
    let health = Health::new(config.llm.models.iter().map(|m| m.name.clone()));
    let partitions = task_partitions(&config)?;
    let shared_limits = client.has_group_limits().then(|| client.clone());
    let steps = steps(&config, partitions, client, &registry, health.clone())?;
    let topology = build(&steps)?;
    tracing::info!(topology = %topology.describe(&config.app.id), "starting");
    let addr = config.http.listen.parse().map_err(|_| ConfigError {
        key: "http.listen".into(),
        message: "not an address".into(),
    })?;
    // Bound first: the engine publishes the address queries reach us at.
    let listener = bind(addr).await?;
    let bound = listener.local_addr()?;
    let mut streams = config.streams();
    streams.application_server = config.http.advertised(bound);
    streams.instance_claim_key = config.http.claims_key()?;
    if streams.instance_claim_key.is_none() && streams.application_server.is_some() {
        tracing::warn!(
            "instance claims are not signed ([http] claims_key_file unset): anyone who can \
             write the {}-instances topic can divert usage queries and their tokens; set a \
             claims key or restrict that topic with ACLs",
            config.app.id
        );
    }
    let served_by = streams
        .application_server
        .clone()
        .unwrap_or_else(|| format!("http://{bound}"));
    let app = StreamsApp::new(topology, streams, engine_metrics.clone())
        .with_runtime(tokio::runtime::Handle::current())
        .start()
        .map_err(RunError::Start)?;
    let group_share = shared_limits.map(|client| {
        tokio::spawn(follow_group_share(
            app.queries(),
            steps.llm.completed_store(),
            client,
        ))
    });
    let usage = steps
        .accounting
        .clone()
        .map(|a| UsageQueries::new(app.queries(), a, served_by));
    let (local, http) = serve(
        listener,
        HttpState {
            registry,
            status: app.status(),
            health,
            usage,
            tokens: std::sync::Arc::new(tokens),
        },
    )
    .await?;
    tracing::info!(%local, "http listening");
    println!("LISTENING {local}");
    let result = wait(&app, shutdown).await;
    app.shutdown();
    let joined = tokio::task::spawn_blocking(move || app.join()).await?;
    http.abort();
    if let Some(task) = group_share {
        task.abort();
    }
    result?;
    joined?;
    // The calls the drains gave up on (made again by their next owner), for
    // the log and for whoever supervises the process.
    let abandoned = engine_metrics.calls_abandoned();
    tracing::info!(calls_abandoned = abandoned, "stopped");
    println!("STOPPED calls_abandoned={abandoned}");
    Ok(())
}

/// Keeps the models' share of their group limits (`group_rps`, `group_tpm`)
/// at this instance's share of the LLM step's partitions (the sub-topology
/// of `store`, its idempotency store), following every assignment change.
/// Without partitions the share is the limiter's floor: no calls.
async fn follow_group_share(queries: Queries, store: String, client: LlmClient) {
    let mut changes = queries.assignment_changes();
    loop {
        match queries.assignment(&store) {
            Ok(held) => {
                tracing::debug!(
                    assigned = held.assigned,
                    partitions = held.partitions,
                    "share of the group limits"
                );
                client.set_group_share(held.share());
            }
            Err(e) => {
                // A pipeline without the LLM step's stores: nothing to follow.
                tracing::warn!(error = %e, "group limits are not shared: no LLM step found");
                return;
            }
        }
        if changes.changed().await.is_err() {
            return;
        }
    }
}

/// The task topics' partitions as found at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskPartitions {
    /// Not looked up (tests, the metrics catalogue): tasks are taken where
    /// they arrive.
    Unknown,
    /// Every task topic has this many.
    Equal(i32),
    /// The counts differ; the largest.
    Differ(i32),
}

/// The task topics' partition counts. Topics that do not exist yet are left
/// to the engine's start-up checks. With `[tasks] repartition = "never"`
/// the counts must be equal: a tenant's tasks of topics with different
/// counts cannot meet in one task without a repartition.
fn task_partitions(config: &Config) -> Result<TaskPartitions, RunError> {
    let t = &config.topics;
    let names: Vec<String> = t.task_types.iter().map(|x| t.task_topic(x)).collect();
    let counts = crate::kafka::partition_counts(config.kafka.cluster(), &names)?;
    let mut distinct: Vec<i32> = counts.values().copied().collect();
    distinct.sort_unstable();
    distinct.dedup();
    Ok(match distinct[..] {
        [] => TaskPartitions::Unknown,
        [n] => TaskPartitions::Equal(n),
        [.., largest] if config.tasks.repartition == Repartition::Never => {
            return Err(ConfigError {
                key: "tasks.repartition".into(),
                message: format!(
                    "\"never\" needs task topics of one partition count, found {counts:?}: \
                     a tenant's tasks of different topics could not meet in one task (use \
                     \"auto\", which repartitions them, up to {largest} partitions)"
                ),
            }
            .into())
        }
        [.., largest] => TaskPartitions::Differ(largest),
    })
}

/// The task topics of `[topics]`, with `[tasks]`' limits (its tenant rules
/// were checked with the configuration).
fn task_source(config: &Config) -> TaskSource {
    let (topics, tasks) = (&config.topics, &config.tasks);
    TaskSource {
        topics: topics
            .task_types
            .iter()
            .map(|t| TaskTopic {
                topic: topics.task_topic(t),
                dead_letter_topic: topics.dlq_topic(t),
            })
            .collect(),
        task_types: topics.task_types.clone(),
        limits: EnvelopeLimits {
            max_bytes: tasks.max_bytes,
            tenants: TenantRules::new(&tasks.tenant_pattern, &tasks.tenants).unwrap_or_default(),
            ..EnvelopeLimits::default()
        },
        owners: Owners::AsArrived,
    }
}

/// How tasks reach their tenant's owner, given the task topics' partitions.
fn owners(config: &Config, partitions: TaskPartitions, misplaced: Misplaced) -> Owners {
    let by_tenant = |partitions| ByTenant {
        app_id: config.app.id.clone(),
        partitions,
    };
    let owners = match (config.tasks.repartition, partitions) {
        (_, TaskPartitions::Unknown) => Owners::AsArrived,
        (Repartition::Always, TaskPartitions::Equal(n) | TaskPartitions::Differ(n))
        | (_, TaskPartitions::Differ(n)) => Owners::ByTenant(by_tenant(n)),
        (r, TaskPartitions::Equal(n)) => Owners::Checked(KeyCheck {
            partitions: n,
            partitioner: config.tasks.partitioner,
            rekey: (r != Repartition::Never).then(|| by_tenant(n)),
            misplaced,
        }),
    };
    match &owners {
        Owners::ByTenant(b) => {
            tracing::info!(
                ?partitions,
                to = b.partitions,
                "tasks are repartitioned by tenant"
            )
        }
        Owners::Checked(c) if c.rekey.is_none() => tracing::info!(
            "task records not keyed by their tenant (or not in its partition) are dead-lettered"
        ),
        _ => {}
    }
    owners
}

/// The steps of the default pipeline, each with its own part of `config`;
/// `partitions` (the task topics') decides how tasks reach their tenant's
/// owner.
pub fn steps(
    config: &Config,
    partitions: TaskPartitions,
    client: LlmClient,
    registry: &Registry,
    health: Health,
) -> prometheus::Result<Steps> {
    let results = ResultsSink {
        completed: config.topics.results_completed.clone(),
        failed: config.topics.results_failed.clone(),
    };
    let misplaced = Misplaced::registered(registry, health.clone())?;
    let source = task_source(config).with_owners(owners(config, partitions, misplaced));
    let mut settings = LlmSettings {
        name: "llm".into(),
        max_attempts: config.tasks.max_attempts,
        retry_backoff: (
            Duration::from_millis(config.tasks.retry_backoff_ms),
            Duration::from_millis(config.tasks.retry_backoff_max_ms),
        ),
        idempotency_ttl_hours: config.tasks.idempotency_ttl_hours,
        probe_interval_ms: config.tasks.probe_interval_ms,
        bad_request_trap_after: config.tasks.bad_request_trap_after,
        bad_request_wait_ms: config.tasks.bad_request_wait_ms,
        fallbacks: config.routing.fallbacks.clone(),
        prices: config.prices.clone(),
        max_output_tokens: config
            .llm
            .models
            .iter()
            .map(|m| (m.name.clone(), m.max_output_tokens))
            .collect(),
        accounting: None,
    };
    let models: Vec<String> = client.models().map(str::to_string).collect();
    let prompts = PromptBuilder::new(config.prompts.clone());
    let accounting = if config.accounting.enabled {
        let a = &config.accounting;
        if config.app.guarantee != sluice_topology::runtime::Guarantee::ExactlyOnce {
            tracing::warn!(
                "tenant accounts under at_least_once are approximate: a crash can count a result \
                 twice (run exactly_once to bill from them)"
            );
        }
        Some(Accounting::registered(
            AccountingSettings {
                name: "usage".into(),
                windows: a.windows.clone(),
                usage_topic: config.topics.usage.clone(),
                usage_updates: a.usage_updates,
                budgets: a.budgets.clone(),
                thresholds: a.thresholds.clone(),
                alerts_topic: config.topics.alerts.clone(),
                quotas: a.quotas.clone(),
                downgrade_at: a.downgrade_at,
            },
            registry,
        )?)
    } else {
        None
    };
    settings.accounting = accounting.clone();
    let gate = accounting.as_ref().and_then(Accounting::quota_gate);
    let mut route = RouteStep::new(config.router(), models, registry)?;
    let mut batching = Batching::new(
        config.batching.clone(),
        prompts.clone(),
        BatchMetrics::register(registry)?,
    );
    if let Some(a) = accounting.as_ref().filter(|a| a.routes_down()) {
        route = route.with_downgrade(a.downgrade_hook());
    }
    if let Some(gate) = gate {
        batching = batching.with_isolated_tenants(Arc::new(move |t| gate.is_hard(t)));
    }
    batching = batching.with_output_limits(
        config
            .llm
            .models
            .iter()
            .map(|m| (m.name.clone(), m.max_output_tokens))
            .collect(),
    );
    Ok(Steps {
        source,
        route,
        retry_wait_max: Duration::from_millis(config.tasks.retry_backoff_max_ms),
        batching,
        llm: LlmStep::traced(
            settings,
            client,
            prompts,
            health,
            OperatorMetrics::register(registry)?,
            Tracer::start(&config.tracing, registry)?,
        ),
        accounting,
        results,
    })
}

/// Resolves at SIGTERM or SIGINT.
pub async fn signals() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Resolves when `shutdown` does or the application stopped.
pub(crate) async fn wait(
    app: &RunningApp,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), RunError> {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                if app.is_finished() { return Ok(()); }
            }
        }
    }
}

/// Results go to the results partition that matches the task's input
/// partition, so results topics need at least as many partitions as the task
/// topics.
fn check_results_partitions(config: &Config) -> Result<(), RunError> {
    let t = &config.topics;
    let mut names: Vec<String> = t.task_types.iter().map(|x| t.task_topic(x)).collect();
    names.push(t.results_completed.clone());
    names.push(t.results_failed.clone());
    names.push(t.usage.clone());
    names.push(t.alerts.clone());
    let counts = crate::kafka::partition_counts(config.kafka.cluster(), &names)?;
    let tasks_max = t
        .task_types
        .iter()
        .filter_map(|x| counts.get(&t.task_topic(x)))
        .max()
        .copied()
        .unwrap_or(0);
    let mut outputs = vec![&t.results_completed, &t.results_failed];
    if config.accounting.enabled {
        outputs.push(&t.usage);
        outputs.push(&t.alerts);
    }
    for results in outputs {
        match counts.get(results) {
            None => {
                return Err(ConfigError {
                    key: "topics.results_completed".into(),
                    message: format!("topic {results} does not exist (run `sluice topics create`)"),
                }
                .into())
            }
            Some(c) if *c < tasks_max => {
                return Err(ConfigError {
                    key: "topics.partitions".into(),
                    message: format!(
                        "{results} has {c} partitions, fewer than the task topics' {tasks_max}"
                    ),
                }
                .into())
            }
            _ => {}
        }
    }
    Ok(())
}

/// Creates the task, dead-letter and results topics of a config.
pub fn create_topics(config: &Config) -> Result<Vec<String>, crate::kafka::KafkaError> {
    let t = &config.topics;
    let results_retention = t.results_retention_ms.to_string();
    let dlq_retention = t.dlq_retention_ms.to_string();
    let mut defs: Vec<(String, Vec<(&str, &str)>)> = Vec::new();
    for ty in &t.task_types {
        defs.push((t.task_topic(ty), vec![]));
        defs.push((
            t.dlq_topic(ty),
            vec![("retention.ms", dlq_retention.as_str())],
        ));
    }
    defs.push((
        t.results_completed.clone(),
        vec![("retention.ms", results_retention.as_str())],
    ));
    defs.push((
        t.results_failed.clone(),
        vec![("retention.ms", results_retention.as_str())],
    ));
    defs.push((
        t.usage.clone(),
        vec![("retention.ms", results_retention.as_str())],
    ));
    defs.push((
        t.alerts.clone(),
        vec![("retention.ms", results_retention.as_str())],
    ));
    let specs: Vec<crate::kafka::TopicDef<'_>> = defs
        .iter()
        .map(|(name, cfg)| (name.as_str(), t.partitions, cfg.as_slice()))
        .collect();
    crate::kafka::create_topics_rf(config.kafka.cluster(), &specs, t.replication_factor)?;
    Ok(defs.into_iter().map(|(n, _)| n).collect())
}

#[cfg(test)]
mod tests;
