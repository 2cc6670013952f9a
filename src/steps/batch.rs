//! `micro_batch`: small tasks of one (tenant, model, task type, prompt) share
//! a provider call.
//!
//! A batch holds one tenant's tasks: one tenant's text never reaches the
//! model while it answers another tenant's task (an instruction in one item
//! could otherwise change a neighbour's answer). `across_tenants = true`
//! lets tenants share batches, for deployments whose tenants are one
//! company's services; tenants with a hard quota still batch alone (a
//! batch's usage then stays within their own reservations).
//!
//! A window opens with its first task and is flushed `window_ms` after it
//! (a timer: an async call of its own, so the flush wakes the engine at
//! once), at `max_items`, or before a task would take its estimated prompt
//! tokens past `max_tokens` or its summed completion caps past the model's
//! output limit. `invoke_llm` then makes one call with the batch
//! prompt and splits the answer back per task. Tasks that are not batched
//! pass on at once as a batch of one: batching off, a task type excluded, a
//! `high` priority task (interactive work never waits for a window), a task
//! larger than `max_item_tokens`.
//!
//! Each task stays in flight while its window holds it: commits stop below
//! it, so a crash loses nothing and the task is read again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry};
use serde::{Deserialize, Serialize};
use sluice_topology::{Headers, InFlight, ProcessError, Processor, ProcessorContext, Record};

use crate::envelope::Priority;
use crate::error::ConfigError;
use crate::steps::invoke_llm::prompt::PromptBuilder;
use crate::steps::route::Routed;

/// Tasks that share one provider call (or a task alone).
#[derive(Clone)]
pub struct Batch {
    /// The batch's id, recorded in its results (`None` for a task alone).
    pub id: Option<String>,
    /// Its tasks, in arrival order.
    pub items: Vec<BatchItem>,
}

/// A task in a batch, holding its input record in flight.
#[derive(Clone)]
pub struct BatchItem {
    /// The task.
    pub task: Routed,
    /// Its record's headers (trace context).
    pub headers: Headers,
    /// Its input record, finished when the last clone is dropped.
    pub held: InFlight,
}

/// `[batching]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BatchingConfig {
    /// Whether tasks are batched at all.
    pub enabled: bool,
    /// How long a window stays open after its first task, ms.
    pub window_ms: u64,
    /// Tasks per batch at most.
    pub max_items: usize,
    /// Estimated prompt tokens per batch at most.
    pub max_tokens: u64,
    /// Tasks estimated larger than this are never batched.
    pub max_item_tokens: u64,
    /// Task types never batched.
    pub exclude_task_types: Vec<String>,
    /// Whether tasks of different tenants may share a batch (and so a
    /// prompt). Only for deployments whose tenants may see each other's
    /// text (one company's services).
    pub across_tenants: bool,
}

impl Default for BatchingConfig {
    fn default() -> Self {
        BatchingConfig {
            enabled: true,
            window_ms: 100,
            max_items: 32,
            max_tokens: 8_192,
            max_item_tokens: 512,
            exclude_task_types: Vec::new(),
            across_tenants: false,
        }
    }
}

impl BatchingConfig {
    /// Checks of the section's own keys; `task_types` are those configured.
    pub fn validate(&self, task_types: &[String]) -> Result<(), ConfigError> {
        let b = self;
        if !(1..=60_000).contains(&b.window_ms) {
            return Err(ConfigError::new(
                "batching.window_ms",
                "must be between 1 and 60000",
            ));
        }
        if b.max_items == 0 {
            return Err(ConfigError::new("batching.max_items", "must be at least 1"));
        }
        if b.max_item_tokens == 0 || b.max_tokens < b.max_item_tokens {
            return Err(ConfigError::new(
                "batching.max_tokens",
                "must be at least batching.max_item_tokens, which must be at least 1",
            ));
        }
        for (i, t) in b.exclude_task_types.iter().enumerate() {
            if !task_types.contains(t) {
                return Err(ConfigError::new(
                    format!("batching.exclude_task_types[{i}]"),
                    format!("{t} is not in topics.task_types"),
                ));
            }
        }
        Ok(())
    }
}

/// Estimated prompt tokens of a task's content, one for its item line: what
/// it adds to a window's `max_tokens`.
pub fn estimated_tokens(task: &Routed) -> u64 {
    crate::llm::wire::estimate_tokens(task.task.envelope.payload.content.len()) + 1
}

/// The micro-batching metrics.
#[derive(Clone)]
pub struct BatchMetrics {
    size: Histogram,
    flushed: [IntCounter; 3],
    unbatched: IntCounter,
}

/// Why a window was flushed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushCause {
    /// `window_ms` after its first task.
    Time = 0,
    /// At `max_items`.
    Size = 1,
    /// The next task would pass `max_tokens`.
    Tokens = 2,
}

impl BatchMetrics {
    /// Creates and registers `sluice_batch_size`, `sluice_batches_flushed_total{cause}`
    /// and `sluice_tasks_unbatched_total`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let size = Histogram::with_opts(
            HistogramOpts::new("sluice_batch_size", "Tasks per flushed micro-batch")
                .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]),
        )?;
        let flushed = IntCounterVec::new(
            Opts::new(
                "sluice_batches_flushed_total",
                "Micro-batches flushed, by cause (time, size, tokens)",
            ),
            &["cause"],
        )?;
        let unbatched = IntCounter::new(
            "sluice_tasks_unbatched_total",
            "Tasks passed on without a window (batching off, excluded, high priority, large)",
        )?;
        registry.register(Box::new(size.clone()))?;
        registry.register(Box::new(flushed.clone()))?;
        registry.register(Box::new(unbatched.clone()))?;
        Ok(BatchMetrics {
            size,
            flushed: ["time", "size", "tokens"].map(|c| flushed.with_label_values(&[c])),
            unbatched,
        })
    }
}

/// The `micro_batch` operator's settings.
#[derive(Clone)]
pub struct Batching {
    /// The operator's name.
    pub name: String,
    config: Arc<BatchingConfig>,
    prompts: Arc<PromptBuilder>,
    metrics: BatchMetrics,
    isolated: Option<TenantFilter>,
    /// Per model, the most completion tokens one answer may have.
    output_limits: Arc<HashMap<String, u32>>,
}

/// Which tenants' tasks are batched only with their own.
pub type TenantFilter = Arc<dyn Fn(&str) -> bool + Send + Sync>;

impl Batching {
    /// Batching by `config`; `prompts` tells which tasks can share a prompt.
    pub fn new(config: BatchingConfig, prompts: PromptBuilder, metrics: BatchMetrics) -> Self {
        Batching {
            name: "micro-batch".into(),
            config: Arc::new(config),
            prompts: Arc::new(prompts),
            metrics,
            isolated: None,
            output_limits: Arc::default(),
        }
    }

    /// Keeps each batch's summed completion caps (its items' caps and JSON
    /// wrappers) within its model's output limit: a window is flushed
    /// before a task would take it past, and a task whose cap alone passes
    /// it goes alone.
    pub fn with_output_limits(mut self, limits: HashMap<String, u32>) -> Self {
        self.output_limits = Arc::new(limits);
        self
    }

    /// Batches the tasks of tenants `isolated` picks only with their own
    /// (tenants with a hard quota: a batch's usage is then apportioned
    /// within their reservations).
    pub fn with_isolated_tenants(mut self, isolated: TenantFilter) -> Self {
        self.isolated = Some(isolated);
        self
    }
}

/// One open window.
struct Window {
    items: Vec<BatchItem>,
    tokens: u64,
    /// The items' completion caps with their JSON wrappers.
    output: u64,
    /// Tells this window's timer from an earlier window's under the same key.
    generation: u64,
}

/// The operator (one instance per task).
pub struct MicroBatcher {
    step: Batching,
    windows: HashMap<String, Window>,
    generation: u64,
}

type Ctx<'a> = ProcessorContext<'a, String, Batch, (String, u64)>;

impl MicroBatcher {
    /// An operator with no open window.
    pub fn new(step: Batching) -> Self {
        MicroBatcher {
            step,
            windows: HashMap::new(),
            generation: 0,
        }
    }

    /// The window a task joins, or `None` when it is not batched.
    fn window_key(&self, task: &Routed, tokens: u64) -> Option<String> {
        let cfg = &self.step.config;
        let ty = &task.task.envelope.task_type;
        if !cfg.enabled
            || cfg.max_items < 2
            || task.task.envelope.priority == Priority::High
            || tokens > cfg.max_item_tokens
            || cfg.exclude_task_types.contains(ty)
        {
            return None;
        }
        // Tasks share a batch prompt only when their task lines (labels,
        // word limit, schema) are the same.
        let lines = self.step.prompts.task_lines(&task.task.envelope).ok()?;
        let mut key = format!("{}\n{ty}\n{}", task.model, lines.join("\n"));
        // A tenant's tasks share calls only with their own, unless tenants
        // may share prompts; a tenant with a hard quota always does, so each
        // batch's usage stays within its own reservations.
        if !cfg.across_tenants
            || self
                .step
                .isolated
                .as_ref()
                .is_some_and(|f| f(task.task.tenant()))
        {
            key.push_str("\ntenant:");
            key.push_str(task.task.tenant());
        }
        Some(key)
    }

    fn flush(
        &mut self,
        key: &str,
        cause: FlushCause,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), ProcessError> {
        let Some(w) = self.windows.remove(key) else {
            return Ok(());
        };
        let m = &self.step.metrics;
        m.size.observe(w.items.len() as f64);
        m.flushed[cause as usize].inc();
        let id = match w.items.as_slice() {
            [] => return Ok(()),
            [_] => None,
            [first, ..] => Some(batch_id(ctx, first)),
        };
        let now = chrono::Utc::now().timestamp_millis();
        let key = key.split('\n').take(2).collect::<Vec<_>>().join("/");
        ctx.forward(Record::new(key, Batch { id, items: w.items }, now))
    }
}

/// A batch is named after its first task's input position, unique per task.
fn batch_id(ctx: &mut Ctx<'_>, first: &BatchItem) -> String {
    let task = ctx.task_id();
    let (source, offset) = first
        .held
        .position()
        .map_or((0, -1), |p| (p.source, p.offset));
    format!(
        "b-{}-{}-{source}-{offset}",
        task.subtopology, task.partition
    )
}

impl<K> Processor<K, Routed> for MicroBatcher {
    type OutKey = String;
    type OutValue = Batch;
    type Output = (String, u64);

    fn process(
        &mut self,
        record: Record<K, Routed>,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), ProcessError> {
        let Some(held) = ctx.hold() else {
            return Err(ProcessError::Fatal("no current record".into()));
        };
        let tokens = estimated_tokens(&record.value);
        let output = u64::from(
            self.step
                .prompts
                .batch_item_cap(&record.value.task.envelope.task_type),
        );
        let output_limit = self
            .step
            .output_limits
            .get(&record.value.model)
            .map_or(u64::MAX, |l| u64::from(*l));
        let item = BatchItem {
            task: record.value,
            headers: record.headers,
            held,
        };
        let key = match self.window_key(&item.task, tokens) {
            Some(key) if output <= output_limit => Some(key),
            _ => None,
        };
        let Some(key) = key else {
            self.step.metrics.unbatched.inc();
            let batch = Batch {
                id: None,
                items: vec![item],
            };
            return ctx.forward(Record::new(String::new(), batch, record.timestamp));
        };
        let cfg = self.step.config.clone();
        if self
            .windows
            .get(&key)
            .is_some_and(|w| w.tokens + tokens > cfg.max_tokens || w.output + output > output_limit)
        {
            self.flush(&key, FlushCause::Tokens, ctx)?;
        }
        let window = match self.windows.get_mut(&key) {
            Some(w) => w,
            None => {
                self.generation += 1;
                let generation = self.generation;
                let (timer_key, wait) = (key.clone(), Duration::from_millis(cfg.window_ms));
                ctx.spawn_detached(async move {
                    tokio::time::sleep(wait).await;
                    (timer_key, generation)
                });
                self.windows.entry(key.clone()).or_insert(Window {
                    items: Vec::new(),
                    tokens: 0,
                    output: 0,
                    generation,
                })
            }
        };
        window.items.push(item);
        window.tokens += tokens;
        window.output += output;
        if window.items.len() >= cfg.max_items {
            self.flush(&key, FlushCause::Size, ctx)?;
        }
        Ok(())
    }

    fn complete(
        &mut self,
        (key, generation): (String, u64),
        ctx: &mut Ctx<'_>,
    ) -> Result<(), ProcessError> {
        if self
            .windows
            .get(&key)
            .is_some_and(|w| w.generation == generation)
        {
            self.flush(&key, FlushCause::Time, ctx)?;
        }
        Ok(())
    }
}
