//! Metrics of the LLM client: names and labels as constants, registered into a registry the
//! caller passes in. Label values are bounded: configured model names, fixed status codes,
//! `rps|tpm`, and the three priorities.

use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

use super::breaker::BreakerState;
use super::limiter::AimdLimiter;
use crate::llm::priority::Priority;

/// Metric names.
pub mod names {
    /// Provider calls by model and status (`ok` or [`crate::llm::LlmError::code`]).
    pub const LLM_REQUESTS_TOTAL: &str = "sluice_llm_requests_total";
    /// Latency of one provider call attempt, by model.
    pub const LLM_LATENCY_SECONDS: &str = "sluice_llm_latency_seconds";
    /// Current limiter rate by model and kind (`rps`, `tpm`).
    pub const LIMITER_RATE: &str = "sluice_limiter_rate";
    /// This instance's share of its model's group limits (`group_rps`, `group_tpm`), by model.
    pub const LIMITER_GROUP_SHARE: &str = "sluice_limiter_group_share";
    /// Current bound on calls in flight by model (adaptive limit, capped by `max_concurrency`).
    pub const CONCURRENCY_LIMIT: &str = "sluice_llm_concurrency_limit";
    /// Breaker state by model: 0 closed, 1 half-open, 2 open.
    pub const BREAKER_STATE: &str = "sluice_breaker_state";
    /// In-operator retries by model.
    pub const RETRIES_TOTAL: &str = "sluice_retries_total";
    /// Limiter admissions by priority.
    pub const PRIORITY_SERVED_TOTAL: &str = "sluice_priority_served_total";
}

/// Label names.
pub mod labels {
    /// Configured model name.
    pub const MODEL: &str = "model";
    /// `ok` or an error code.
    pub const STATUS: &str = "status";
    /// `rps` or `tpm`.
    pub const KIND: &str = "kind";
    /// `high`, `normal`, `batch`.
    pub const PRIORITY: &str = "priority";
}

/// `status` label of a successful call.
pub const STATUS_OK: &str = "ok";
/// `kind` label of the request rate.
pub const KIND_RPS: &str = "rps";
/// `kind` label of the token rate.
pub const KIND_TPM: &str = "tpm";

/// Latency buckets, seconds: LLM calls range from tens of milliseconds to minutes.
const LATENCY_BUCKETS: [f64; 14] = [
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0,
];

/// The client's metric handles.
#[derive(Debug, Clone)]
pub struct LlmMetrics {
    requests: IntCounterVec,
    latency: HistogramVec,
    limiter_rate: GaugeVec,
    group_share: GaugeVec,
    concurrency_limit: IntGaugeVec,
    breaker_state: IntGaugeVec,
    retries: IntCounterVec,
    priority_served: IntCounterVec,
}

impl LlmMetrics {
    /// Creates the metrics and registers them into `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self::unregistered()?;
        registry.register(Box::new(m.requests.clone()))?;
        registry.register(Box::new(m.latency.clone()))?;
        registry.register(Box::new(m.limiter_rate.clone()))?;
        registry.register(Box::new(m.group_share.clone()))?;
        registry.register(Box::new(m.concurrency_limit.clone()))?;
        registry.register(Box::new(m.breaker_state.clone()))?;
        registry.register(Box::new(m.retries.clone()))?;
        registry.register(Box::new(m.priority_served.clone()))?;
        Ok(m)
    }

    /// Creates the metrics without registering them (tests, tools).
    pub fn unregistered() -> prometheus::Result<Self> {
        use labels::*;
        Ok(Self {
            requests: IntCounterVec::new(
                Opts::new(
                    names::LLM_REQUESTS_TOTAL,
                    "Provider calls by model and status.",
                ),
                &[MODEL, STATUS],
            )?,
            latency: HistogramVec::new(
                HistogramOpts::new(
                    names::LLM_LATENCY_SECONDS,
                    "Latency of one provider call attempt.",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
                &[MODEL],
            )?,
            limiter_rate: GaugeVec::new(
                Opts::new(names::LIMITER_RATE, "Adaptive limiter rate (rps or tpm)."),
                &[MODEL, KIND],
            )?,
            group_share: GaugeVec::new(
                Opts::new(
                    names::LIMITER_GROUP_SHARE,
                    "Share of the model's group limits this instance uses (its share of the partitions).",
                ),
                &[MODEL],
            )?,
            concurrency_limit: IntGaugeVec::new(
                Opts::new(
                    names::CONCURRENCY_LIMIT,
                    "Bound on provider calls in flight (adaptive limit, capped by max_concurrency).",
                ),
                &[MODEL],
            )?,
            breaker_state: IntGaugeVec::new(
                Opts::new(
                    names::BREAKER_STATE,
                    "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
                ),
                &[MODEL],
            )?,
            retries: IntCounterVec::new(
                Opts::new(
                    names::RETRIES_TOTAL,
                    "In-operator retries of provider calls.",
                ),
                &[MODEL],
            )?,
            priority_served: IntCounterVec::new(
                Opts::new(
                    names::PRIORITY_SERVED_TOTAL,
                    "Limiter admissions by task priority.",
                ),
                &[PRIORITY],
            )?,
        })
    }

    /// The per-model series resolved once: the hot path (a call answered) then
    /// looks no label up.
    pub fn for_model(&self, model: &str) -> ModelMetrics {
        ModelMetrics {
            ok: self.requests.with_label_values(&[model, STATUS_OK]),
            latency: self.latency.with_label_values(&[model]),
            rps: self.limiter_rate.with_label_values(&[model, KIND_RPS]),
            limiter_rate: self.limiter_rate.clone(),
            group_share: self.group_share.clone(),
            model: model.to_string(),
            tpm: Default::default(),
            concurrency_limit: self.concurrency_limit.clone(),
            concurrency: Default::default(),
            breaker: self.breaker_state.with_label_values(&[model]),
            served: Priority::ALL.map(|p| self.priority_served.with_label_values(&[p.as_str()])),
        }
    }

    /// Counts one call attempt and its latency.
    pub fn observe_call(&self, model: &str, status: &str, seconds: f64) {
        self.requests.with_label_values(&[model, status]).inc();
        self.latency.with_label_values(&[model]).observe(seconds);
    }

    /// Counts a call refused by an open breaker (no latency: no call was made).
    pub fn observe_refused(&self, model: &str, status: &str) {
        self.requests.with_label_values(&[model, status]).inc();
    }

    /// Counts one retry.
    pub fn observe_retry(&self, model: &str) {
        self.retries.with_label_values(&[model]).inc();
    }
}

/// One model's series of [`LlmMetrics`], resolved by [`LlmMetrics::for_model`].
#[derive(Debug, Clone)]
pub struct ModelMetrics {
    ok: IntCounter,
    latency: Histogram,
    rps: Gauge,
    /// The token-rate series is made (from these two) only once the limiter
    /// paces tokens, which it may start doing at any time.
    limiter_rate: GaugeVec,
    /// A model's share series is made on its first publish (only models with a group
    /// limit have one).
    group_share: GaugeVec,
    model: String,
    tpm: std::sync::OnceLock<Gauge>,
    /// Made on the first publish with a bound (a model may have none).
    concurrency_limit: IntGaugeVec,
    concurrency: std::sync::OnceLock<IntGauge>,
    breaker: IntGauge,
    served: [IntCounter; 3],
}

impl ModelMetrics {
    /// A call answered: counted as `ok`, its latency observed.
    pub fn observe_ok(&self, seconds: f64) {
        self.ok.inc();
        self.latency.observe(seconds);
    }

    /// Counts one admission.
    pub fn observe_admission(&self, priority: Priority) {
        self.served[priority.index()].inc();
    }

    /// The share of the group limits the limiter was given.
    pub fn publish_group_share(&self, share: f64) {
        self.group_share
            .with_label_values(&[&self.model])
            .set(share);
    }

    /// The limiter's current rates and concurrency bound, and the breaker's state.
    pub fn publish_state(&self, limiter: &AimdLimiter, breaker: BreakerState) {
        self.rps.set(limiter.current_rps());
        if let Some(tpm) = limiter.current_tpm() {
            self.tpm
                .get_or_init(|| {
                    self.limiter_rate
                        .with_label_values(&[&self.model, KIND_TPM])
                })
                .set(tpm);
        }
        if let Some(limit) = limiter.concurrency_limit() {
            self.concurrency
                .get_or_init(|| self.concurrency_limit.with_label_values(&[&self.model]))
                .set(i64::try_from(limit).unwrap_or(i64::MAX));
        }
        self.breaker.set(breaker.as_gauge());
    }
}
