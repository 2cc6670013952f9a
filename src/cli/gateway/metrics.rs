//! The gateway's metrics (`sluice_gateway_*`).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Metric names.
pub mod names {
    /// Requests by endpoint and status code.
    pub const REQUESTS: &str = "sluice_gateway_requests_total";
    /// Tasks accepted (published and acknowledged).
    pub const ACCEPTED: &str = "sluice_gateway_tasks_accepted_total";
    /// Tasks refused, by reason.
    pub const REJECTED: &str = "sluice_gateway_tasks_rejected_total";
    /// Time from a task's acceptance to its result being read.
    pub const ACCEPT_TO_RESULT: &str = "sluice_gateway_accept_to_result_seconds";
    /// Time to answer a submission.
    pub const ACCEPT_SECONDS: &str = "sluice_gateway_accept_seconds";
    /// Event streams open.
    pub const EVENT_STREAMS: &str = "sluice_gateway_event_streams_open";
    /// Tasks pending of the tenants this instance holds.
    pub const PENDING: &str = "sluice_gateway_pending_tasks";
    /// Task and result records the status table had nothing to show for.
    pub const SKIPPED: &str = "sluice_gateway_records_skipped_total";
}

/// Reasons a task is refused (the `reason` label).
pub const REJECT_REASONS: [&str; 7] = [
    "bad_request",
    "too_large",
    "unauthorized",
    "forbidden",
    "backlog",
    "quota",
    "unavailable",
];

/// The gateway's metrics (cheap to clone).
#[derive(Clone)]
pub struct GatewayMetrics {
    requests: IntCounterVec,
    /// Tasks accepted.
    pub accepted: IntCounter,
    rejected: IntCounterVec,
    accept_to_result: Histogram,
    /// Time to the 202.
    pub accept_seconds: Histogram,
    /// Event streams open.
    pub event_streams: IntGauge,
    pending: IntGauge,
    skipped: IntCounterVec,
    by_partition: Arc<Mutex<HashMap<i32, i64>>>,
}

impl GatewayMetrics {
    /// Registers the metrics.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let latency_buckets = vec![
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
        ];
        let m = GatewayMetrics {
            requests: IntCounterVec::new(
                Opts::new(
                    names::REQUESTS,
                    "Gateway requests by endpoint and status code",
                ),
                &["endpoint", "status"],
            )?,
            accepted: IntCounter::new(
                names::ACCEPTED,
                "Tasks accepted: published and acknowledged by the broker",
            )?,
            rejected: IntCounterVec::new(
                Opts::new(names::REJECTED, "Tasks refused, by reason"),
                &["reason"],
            )?,
            accept_to_result: Histogram::with_opts(
                HistogramOpts::new(
                    names::ACCEPT_TO_RESULT,
                    "Time from a task's submission to its committed result being read, seconds",
                )
                .buckets(latency_buckets),
            )?,
            accept_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    names::ACCEPT_SECONDS,
                    "Time to answer a submission (202 once the broker acknowledged), seconds",
                )
                .buckets(vec![
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
                ]),
            )?,
            event_streams: IntGauge::new(names::EVENT_STREAMS, "Event streams open")?,
            pending: IntGauge::new(
                names::PENDING,
                "Tasks accepted and not answered, of the tenants this instance holds",
            )?,
            skipped: IntCounterVec::new(
                Opts::new(
                    names::SKIPPED,
                    "Task and result records the status table could not read, by reason",
                ),
                &["reason"],
            )?,
            by_partition: Arc::default(),
        };
        registry.register(Box::new(m.requests.clone()))?;
        registry.register(Box::new(m.accepted.clone()))?;
        registry.register(Box::new(m.rejected.clone()))?;
        registry.register(Box::new(m.accept_to_result.clone()))?;
        registry.register(Box::new(m.accept_seconds.clone()))?;
        registry.register(Box::new(m.event_streams.clone()))?;
        registry.register(Box::new(m.pending.clone()))?;
        registry.register(Box::new(m.skipped.clone()))?;
        for r in REJECT_REASONS {
            m.rejected.with_label_values(&[r]);
        }
        Ok(m)
    }

    /// A request answered.
    pub fn request(&self, endpoint: &str, status: u16) {
        self.requests
            .with_label_values(&[endpoint, &status.to_string()])
            .inc();
    }

    /// `n` tasks refused for `reason` (one of [`REJECT_REASONS`]).
    pub fn rejected(&self, reason: &str, n: u64) {
        self.rejected.with_label_values(&[reason]).inc_by(n);
    }

    /// A task's result read `ms` after its submission.
    pub fn accept_to_result(&self, ms: i64) {
        self.accept_to_result.observe(ms.max(0) as f64 / 1000.0);
    }

    /// A record the status table skipped.
    pub fn skipped(&self, reason: &str) {
        self.skipped.with_label_values(&[reason]).inc();
    }

    /// The pending tasks of one partition held here.
    pub fn set_partition_pending(&self, partition: i32, pending: i64) {
        let mut by = self.by_partition.lock();
        by.insert(partition, pending);
        self.pending.set(by.values().sum());
    }

    /// A partition left this instance.
    pub fn forget_partition(&self, partition: i32) {
        let mut by = self.by_partition.lock();
        by.remove(&partition);
        self.pending.set(by.values().sum());
    }
}
