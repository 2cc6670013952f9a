//! Metrics of the LLM task operator (prefix `sluice_`, bounded labels: model,
//! status, token kind).

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

/// Metric names.
pub mod names {
    /// Results emitted, by status (`completed`, `failed`).
    pub const RESULTS: &str = "sluice_results_total";
    /// Time from a task's `submittedAt` to its result, by task type.
    pub const TASK_LATENCY: &str = "sluice_task_latency_seconds";
    /// Redelivered tasks answered from the idempotency store.
    pub const DUPLICATES: &str = "sluice_duplicates_skipped_total";
    /// Tasks re-published for another attempt after transient failures.
    pub const REPUBLISHED: &str = "sluice_tasks_republished_total";
    /// Tasks parked for a held model (bad credentials, open breaker
    /// without fallback, a long `Retry-After`, a trapped `400`).
    pub const PARKED: &str = "sluice_tasks_parked";
    /// Tasks asked again with their template's larger cap after an answer
    /// cut at the cap.
    pub const TRUNCATION_RETRIES: &str = "sluice_truncation_retries_total";
    /// Tokens by model and kind (`input`, `output`, `cached`).
    pub const TOKENS: &str = "sluice_tokens_total";
    /// Cost by model, micro-dollars.
    pub const COST: &str = "sluice_cost_micros_total";
    /// Tasks routed to a fallback model.
    pub const FALLBACKS: &str = "sluice_fallback_routed_total";
    /// Tasks whose id was answered before for another tenant (each is called
    /// as a task of its own).
    pub const ID_CONFLICTS: &str = "sluice_task_id_conflicts_total";
    /// Provider calls micro-batching saved (a batch of n answered in one call saves n - 1).
    pub const BATCH_CALLS_SAVED: &str = "sluice_batch_calls_saved_total";
    /// Micro-batches answered by a call per task instead (answer unusable, refused).
    pub const BATCH_FALLBACKS: &str = "sluice_batch_fallbacks_total";
    /// Tasks refused by a hard quota (`quota_exceeded`).
    pub const QUOTA_REJECTIONS: &str = "sluice_quota_rejections_total";
    /// Hard-quota reservations of calls under way.
    pub const RESERVATIONS: &str = "sluice_quota_reservations";
    /// Tasks of hard-quota tenants waiting for their tenant's reservations
    /// out to settle.
    pub const QUOTA_WAITING: &str = "sluice_quota_waiting";
}

/// The operator's metric handles.
#[derive(Clone)]
pub struct OperatorMetrics {
    /// `sluice_results_total{status="completed"}` and `{status="failed"}`.
    pub(crate) results: [IntCounter; 2],
    pub(crate) task_latency: HistogramVec,
    pub(crate) duplicates: IntCounter,
    pub(crate) republished: IntCounter,
    pub(crate) parked: IntGauge,
    pub(crate) tokens: IntCounterVec,
    pub(crate) cost: IntCounterVec,
    pub(crate) fallbacks: IntCounterVec,
    pub(crate) id_conflicts: IntCounter,
    pub(crate) batch_calls_saved: IntCounter,
    pub(crate) batch_fallbacks: IntCounter,
    pub(crate) truncation_retries: IntCounter,
    pub(crate) quota_rejections: IntCounter,
    pub(crate) reservations: IntGauge,
    pub(crate) quota_waiting: IntGauge,
}

impl OperatorMetrics {
    /// Creates and registers the metrics.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let results = IntCounterVec::new(
            Opts::new(names::RESULTS, "Results emitted by status"),
            &["status"],
        )?;
        registry.register(Box::new(results.clone()))?;
        let m = OperatorMetrics {
            results: ["completed", "failed"].map(|s| results.with_label_values(&[s])),
            task_latency: HistogramVec::new(
                HistogramOpts::new(
                    names::TASK_LATENCY,
                    "Time from a task's submittedAt to its result, by task type",
                )
                .buckets(vec![
                    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                    1800.0, 3600.0,
                ]),
                &["task_type"],
            )?,
            duplicates: IntCounter::new(
                names::DUPLICATES,
                "Redelivered tasks answered from the idempotency store (replayed dead letters of tasks done: nothing emitted)",
            )?,
            republished: IntCounter::new(
                names::REPUBLISHED,
                "Tasks re-published after transient failures",
            )?,
            parked: IntGauge::new(names::PARKED, "Tasks parked for a held model")?,
            tokens: IntCounterVec::new(
                Opts::new(names::TOKENS, "Tokens by model and kind"),
                &["model", "kind"],
            )?,
            cost: IntCounterVec::new(
                Opts::new(names::COST, "Cost by model, micro-dollars"),
                &["model"],
            )?,
            fallbacks: IntCounterVec::new(
                Opts::new(names::FALLBACKS, "Tasks routed to a fallback model"),
                &["model"],
            )?,
            id_conflicts: IntCounter::new(
                names::ID_CONFLICTS,
                "Tasks whose id was answered before for another tenant",
            )?,
            batch_calls_saved: IntCounter::new(
                names::BATCH_CALLS_SAVED,
                "Provider calls saved by micro-batching",
            )?,
            batch_fallbacks: IntCounter::new(
                names::BATCH_FALLBACKS,
                "Micro-batches answered by a call per task instead, or halved after their call failed",
            )?,
            truncation_retries: IntCounter::new(
                names::TRUNCATION_RETRIES,
                "Tasks asked again with a larger cap after an answer cut at the cap",
            )?,
            quota_rejections: IntCounter::new(
                names::QUOTA_REJECTIONS,
                "Tasks refused by a hard quota (quota_exceeded)",
            )?,
            reservations: IntGauge::new(
                names::RESERVATIONS,
                "Hard-quota reservations of calls under way",
            )?,
            quota_waiting: IntGauge::new(
                names::QUOTA_WAITING,
                "Tasks waiting for their tenant's hard-quota reservations to settle",
            )?,
        };
        registry.register(Box::new(m.task_latency.clone()))?;
        registry.register(Box::new(m.duplicates.clone()))?;
        registry.register(Box::new(m.republished.clone()))?;
        registry.register(Box::new(m.parked.clone()))?;
        registry.register(Box::new(m.tokens.clone()))?;
        registry.register(Box::new(m.cost.clone()))?;
        registry.register(Box::new(m.fallbacks.clone()))?;
        registry.register(Box::new(m.id_conflicts.clone()))?;
        registry.register(Box::new(m.batch_calls_saved.clone()))?;
        registry.register(Box::new(m.batch_fallbacks.clone()))?;
        registry.register(Box::new(m.truncation_retries.clone()))?;
        registry.register(Box::new(m.quota_rejections.clone()))?;
        registry.register(Box::new(m.reservations.clone()))?;
        registry.register(Box::new(m.quota_waiting.clone()))?;
        Ok(m)
    }

    /// The results counter of a status.
    pub(crate) fn result(&self, success: bool) -> &IntCounter {
        &self.results[usize::from(!success)]
    }

    /// One model's token and cost series (resolved once per model by the caller).
    pub(crate) fn model_counters(&self, model: &str) -> ModelCounters {
        ModelCounters {
            input: self.tokens.with_label_values(&[model, "input"]),
            output: self.tokens.with_label_values(&[model, "output"]),
            cached: self.tokens.with_label_values(&[model, "cached"]),
            cost: self.cost.with_label_values(&[model]),
        }
    }
}

/// One model's token and cost series, resolved once per model.
#[derive(Clone)]
pub(crate) struct ModelCounters {
    pub(crate) input: IntCounter,
    pub(crate) output: IntCounter,
    pub(crate) cached: IntCounter,
    pub(crate) cost: IntCounter,
}
