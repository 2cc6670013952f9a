//! Engine metrics (prefix `sluice_`), registered into a caller's registry.
//! Labels are bounded: topics, the partitions assigned to this instance, task
//! states and dead-letter categories only.

use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// Metric names of the engine.
pub mod names {
    /// Records consumed from input topics.
    pub const RECORDS_IN: &str = "sluice_records_in_total";
    /// Records produced (outputs, not changelogs).
    pub const RECORDS_OUT: &str = "sluice_records_out_total";
    /// Time to process one input record synchronously (async calls excluded).
    pub const PROCESS_SECONDS: &str = "sluice_process_seconds";
    /// Records in flight (received, not finished).
    pub const IN_FLIGHT: &str = "sluice_in_flight_records";
    /// Paused input partitions.
    pub const PAUSED: &str = "sluice_paused_partitions";
    /// Rebalances seen by this instance.
    pub const REBALANCES: &str = "sluice_rebalances_total";
    /// Async calls abandoned (cancelled unfinished: a drain timeout, a task
    /// closed dirty or at a stop); their records are processed again.
    pub const CALLS_ABANDONED: &str = "sluice_calls_abandoned_total";
    /// Kafka clients given up on: a call of theirs did not return within its
    /// bound (the client stays in the process until librdkafka lets go).
    pub const CLIENTS_GIVEN_UP: &str = "sluice_clients_given_up_total";
    /// Time to restore a task.
    pub const RESTORE_SECONDS: &str = "sluice_restore_seconds";
    /// Changelog records restored.
    pub const RESTORE_RECORDS: &str = "sluice_restore_records_total";
    /// Commits (transactions committed under exactly-once).
    pub const COMMITS: &str = "sluice_commits_total";
    /// Time a commit (of all tasks) blocks processing.
    pub const COMMIT_SECONDS: &str = "sluice_commit_seconds";
    /// Transactions aborted.
    pub const ABORTED: &str = "sluice_aborted_transactions_total";
    /// Consumer lag per assigned input partition, from client statistics.
    pub const LAG: &str = "sluice_consumer_lag";
    /// Records sent to dead-letter topics by the engine, by category.
    pub const DLQ: &str = "sluice_dlq_records_total";
    /// Records dropped after their window's grace period.
    pub const LATE: &str = "sluice_late_records_dropped_total";
    /// Replayed records already reflected in restored state.
    pub const REPLAY_SKIPPED: &str = "sluice_replay_skipped_total";
    /// Tasks by state.
    pub const TASKS: &str = "sluice_tasks";
}

/// The engine's metric handles.
#[derive(Clone)]
pub struct EngineMetrics {
    pub(crate) records_in: IntCounter,
    pub(crate) records_out: IntCounter,
    pub(crate) process_seconds: Histogram,
    pub(crate) in_flight: IntGauge,
    pub(crate) paused: IntGauge,
    pub(crate) rebalances: IntCounter,
    pub(crate) calls_abandoned: IntCounter,
    pub(crate) clients_given_up: IntCounter,
    pub(crate) restore_seconds: Histogram,
    pub(crate) restore_records: IntCounter,
    pub(crate) commits: IntCounter,
    pub(crate) commit_seconds: Histogram,
    pub(crate) aborted: IntCounter,
    pub(crate) lag: IntGaugeVec,
    /// The partitions `lag` has a series of.
    lag_series: std::sync::Arc<parking_lot::Mutex<std::collections::BTreeSet<(String, i32)>>>,
    pub(crate) dlq: IntCounterVec,
    pub(crate) late: IntCounter,
    pub(crate) replay_skipped: IntCounter,
    pub(crate) tasks: IntGaugeVec,
    restore_max_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl EngineMetrics {
    /// Creates and registers the metrics.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = EngineMetrics {
            records_in: IntCounter::new(names::RECORDS_IN, "Records consumed from input topics")?,
            records_out: IntCounter::new(names::RECORDS_OUT, "Records produced to output topics")?,
            process_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    names::PROCESS_SECONDS,
                    "Synchronous processing time per input record",
                )
                .buckets(vec![
                    1e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 0.1, 1.0,
                ]),
            )?,
            in_flight: IntGauge::new(names::IN_FLIGHT, "Input records received and not finished")?,
            paused: IntGauge::new(names::PAUSED, "Input partitions paused for backpressure")?,
            rebalances: IntCounter::new(names::REBALANCES, "Rebalances seen")?,
            calls_abandoned: IntCounter::new(
                names::CALLS_ABANDONED,
                "Async calls abandoned unfinished (their records are processed again)",
            )?,
            clients_given_up: IntCounter::new(
                names::CLIENTS_GIVEN_UP,
                "Kafka clients given up on: a call did not return within its bound",
            )?,
            restore_seconds: Histogram::with_opts(
                HistogramOpts::new(names::RESTORE_SECONDS, "Time to restore a task's state")
                    .buckets(vec![0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0]),
            )?,
            restore_records: IntCounter::new(names::RESTORE_RECORDS, "Changelog records restored")?,
            commits: IntCounter::new(names::COMMITS, "Commits")?,
            commit_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    names::COMMIT_SECONDS,
                    "Time a commit of all tasks takes (exactly-once: a round of per-task commits, which process beside it)",
                )
                .buckets(vec![
                    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
                ]),
            )?,
            aborted: IntCounter::new(names::ABORTED, "Transactions aborted")?,
            lag: IntGaugeVec::new(
                Opts::new(
                    names::LAG,
                    "Records behind the end of each assigned input partition",
                ),
                &["topic", "partition"],
            )?,
            lag_series: Default::default(),
            dlq: IntCounterVec::new(
                Opts::new(names::DLQ, "Records dead-lettered by the engine"),
                &["category"],
            )?,
            late: IntCounter::new(
                names::LATE,
                "Records dropped after their window's grace period",
            )?,
            replay_skipped: IntCounter::new(
                names::REPLAY_SKIPPED,
                "Replayed records already reflected in state",
            )?,
            tasks: IntGaugeVec::new(
                Opts::new(names::TASKS, "Tasks of this instance by state"),
                &["state"],
            )?,
            restore_max_ms: Default::default(),
        };
        registry.register(Box::new(m.records_in.clone()))?;
        registry.register(Box::new(m.records_out.clone()))?;
        registry.register(Box::new(m.process_seconds.clone()))?;
        registry.register(Box::new(m.in_flight.clone()))?;
        registry.register(Box::new(m.paused.clone()))?;
        registry.register(Box::new(m.rebalances.clone()))?;
        registry.register(Box::new(m.calls_abandoned.clone()))?;
        registry.register(Box::new(m.clients_given_up.clone()))?;
        registry.register(Box::new(m.restore_seconds.clone()))?;
        registry.register(Box::new(m.restore_records.clone()))?;
        registry.register(Box::new(m.commits.clone()))?;
        registry.register(Box::new(m.commit_seconds.clone()))?;
        registry.register(Box::new(m.aborted.clone()))?;
        registry.register(Box::new(m.lag.clone()))?;
        registry.register(Box::new(m.dlq.clone()))?;
        registry.register(Box::new(m.late.clone()))?;
        registry.register(Box::new(m.replay_skipped.clone()))?;
        registry.register(Box::new(m.tasks.clone()))?;
        Ok(m)
    }

    /// Unregistered metrics (for tools that do not export them).
    pub fn unregistered() -> Self {
        Self::register(&Registry::new()).expect("metrics register into a fresh registry")
    }

    /// Restore records counted so far (for tests and benchmarks).
    pub fn restored_records(&self) -> u64 {
        self.restore_records.get()
    }

    /// Total seconds spent restoring tasks.
    pub fn restore_seconds_sum(&self) -> f64 {
        self.restore_seconds.get_sample_sum()
    }

    /// The longest single task restore, seconds.
    pub fn restore_seconds_max(&self) -> f64 {
        self.restore_max_ms
            .load(std::sync::atomic::Ordering::Relaxed) as f64
            / 1000.0
    }

    pub(crate) fn observe_restore(&self, elapsed: std::time::Duration) {
        self.restore_seconds.observe(elapsed.as_secs_f64());
        self.restore_max_ms.fetch_max(
            elapsed.as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Commits counted so far.
    pub fn commit_count(&self) -> u64 {
        self.commits.get()
    }

    /// Seconds spent in commits so far.
    pub fn commit_seconds_sum(&self) -> f64 {
        self.commit_seconds.get_sample_sum()
    }

    /// Replayed records skipped because restored state already reflected them.
    pub fn replay_skipped(&self) -> u64 {
        self.replay_skipped.get()
    }

    /// Rebalances seen so far.
    pub fn rebalance_count(&self) -> u64 {
        self.rebalances.get()
    }

    /// Async calls abandoned so far.
    pub fn calls_abandoned(&self) -> u64 {
        self.calls_abandoned.get()
    }

    /// Kafka clients given up on so far.
    pub fn clients_given_up(&self) -> u64 {
        self.clients_given_up.get()
    }

    /// Records consumed so far.
    pub fn records_in(&self) -> u64 {
        self.records_in.get()
    }

    /// Sets the lag of every partition assigned now, `(topic, partition,
    /// lag)` (a negative lag is not known yet: the series keeps its last
    /// value), and removes the series of partitions no longer assigned, so
    /// the series stay bounded by the assignment and a revoked partition's
    /// last lag does not linger.
    pub(crate) fn set_lag<'a>(&self, assigned: impl IntoIterator<Item = (&'a str, i32, i64)>) {
        let mut series = self.lag_series.lock();
        let mut now = std::collections::BTreeSet::new();
        for (topic, partition, lag) in assigned {
            let key = (topic.to_string(), partition);
            let label = partition.to_string();
            if lag >= 0 {
                self.lag.with_label_values(&[topic, &label]).set(lag);
            } else if !series.contains(&key) {
                continue;
            }
            now.insert(key);
        }
        for (topic, partition) in series.difference(&now) {
            let _ = self
                .lag
                .remove_label_values(&[topic.as_str(), &partition.to_string()]);
        }
        *series = now;
    }

    /// Records produced to output topics so far.
    pub fn records_out(&self) -> u64 {
        self.records_out.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(m: &EngineMetrics) -> Vec<(String, String, i64)> {
        use prometheus::core::Collector;
        let mut out: Vec<_> = m.lag.collect()[0]
            .get_metric()
            .iter()
            .map(|s| {
                let label = |n: &str| {
                    s.get_label()
                        .iter()
                        .find(|l| l.name() == n)
                        .map(|l| l.value().to_string())
                        .unwrap()
                };
                (
                    label("topic"),
                    label("partition"),
                    s.get_gauge().value() as i64,
                )
            })
            .collect();
        out.sort();
        out
    }

    #[test]
    fn lag_series_follow_the_assignment() {
        let m = EngineMetrics::unregistered();
        m.set_lag([("a", 0, 5), ("a", 1, 7), ("b", 0, -1)]);
        let s = |t: &str, p: &str, v| (t.to_string(), p.to_string(), v);
        assert_eq!(series(&m), vec![s("a", "0", 5), s("a", "1", 7)]);
        // Unknown lag keeps the last value; a partition gone loses its series.
        m.set_lag([("a", 1, -1), ("b", 0, 3)]);
        assert_eq!(series(&m), vec![s("a", "1", 7), s("b", "0", 3)]);
        m.set_lag([]);
        assert!(series(&m).is_empty());
    }
}
