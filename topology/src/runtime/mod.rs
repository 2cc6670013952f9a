//! The Kafka runtime: runs a [`Topology`] as one member of a consumer group.
//!
//! One driver thread per instance owns the consumer and the tasks (a task per
//! sub-topology and input partition). It polls the consumer continuously (events
//! and rebalances arrive there) and gives each assigned partition its own fetch
//! queue, read only while the partition's task is active and has room under the
//! in-flight bound, so librdkafka's bounded prefetch is the backpressure. Between
//! rounds it sleeps until a queue becomes non-empty, an async call completes or
//! 10 ms pass. It hands records to tasks (tasks with records waiting are
//! processed side by side on `processing_threads` threads), routes the
//! completions of async operator calls back to their tasks, punctuates, and
//! commits every `commit_interval`:
//!
//! - at-least-once: outputs flushed, changelog records sent and flushed, local
//!   state written, then the offsets of the contiguous finished prefix committed;
//! - exactly-once: per task, in the task's transaction (transactional id
//!   `<app-id>-<task-id>`): outputs flushed, changelog records sent and flushed,
//!   offsets sent to the transaction, commit; then local state written.
//!
//! Local state only ever receives committed writes, so it never has to be wiped.
//! On revocation the driver stops intake for the task, drains its in-flight work
//! (up to `drain_timeout`, then abandons it uncommitted), commits and suspends it;
//! on assignment a suspended task resumes at once and a new one is restored on a
//! helper thread (after fencing its previous owner) while polling goes on and
//! librdkafka fetches its records into its partition queues.
//!
//! [`RunningApp::queries`] answers interactive queries: which instance holds
//! a key's state (instances publish their partitions on an internal topic,
//! see `instances`) and read-only reads of this instance's committed state.

pub mod config;
pub mod metrics;

mod admin;
mod driver;
mod failpoint;
mod fetched;
mod instances;
mod kafka;
mod polled;
pub mod probe;
mod queries;
mod restore;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

pub use config::{GroupProtocol, StreamsConfig};
pub use instances::{ClaimKey, InstanceClaim};
pub use kafka::{client_base, close_in_background};
pub use metrics::EngineMetrics;
pub use polled::PolledProducer;
pub use queries::{Assignment, KeyMetadata, Queries, QueryError};
pub use sluice_state::WindowRange;

pub use crate::guarantee::Guarantee;
pub use crate::offsets::MAX_IN_FLIGHT_PER_PARTITION;
pub use crate::partitions::{crc32, key_partition, murmur2, KeyPartitioner};

use crate::{ProcessError, TaskId, Topology, TopologyError};

/// Why the runtime stopped.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A Kafka client failed.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// A state store failed.
    #[error("state: {0}")]
    State(#[from] sluice_state::StateError),
    /// The topology or config is invalid.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// A record's processing failed in a way that stops the task.
    #[error("task {task}: {error}")]
    Process {
        /// The task.
        task: TaskId,
        /// What failed.
        error: ProcessError,
    },
    /// A restore was cancelled by a rebalance.
    #[error("cancelled")]
    Cancelled,
    /// A client call did not return within its bound (see
    /// `kafka::bounded`): the client is given up on.
    #[error("{0}; its client is given up")]
    Unanswered(String),
    /// Anything else.
    #[error("{0}")]
    Other(String),
}

impl RuntimeError {
    /// The Kafka error code, if the error is a Kafka one with a code.
    fn kafka_code(&self) -> Option<rdkafka::error::RDKafkaErrorCode> {
        use rdkafka::error::KafkaError;
        match self {
            RuntimeError::Kafka(KafkaError::Transaction(e)) => Some(e.code()),
            RuntimeError::Kafka(e) => e.rdkafka_error_code(),
            _ => None,
        }
    }

    /// True when the error means another instance owns the task now (its
    /// producer was fenced) or its transaction must be aborted: the task is
    /// closed dirty and the instance carries on, as Kafka Streams does with a
    /// migrated task.
    pub(crate) fn task_migrated(&self) -> bool {
        use rdkafka::error::{KafkaError, RDKafkaErrorCode as C};
        if let RuntimeError::Kafka(KafkaError::Transaction(e)) = self {
            if e.txn_requires_abort() {
                return true;
            }
        }
        self.fenced()
            || matches!(
                self.kafka_code(),
                Some(
                    C::InvalidProducerIdMapping
                        | C::UnknownProducerId
                        | C::OutOfOrderSequenceNumber
                        | C::IllegalGeneration
                        | C::UnknownMemberId
                        | C::RebalanceInProgress
                )
            )
    }

    /// True when Kafka calls the error retriable (a request timed out, the
    /// coordinator moved or is loading, a broker connection dropped): the
    /// same request may succeed when made again.
    pub(crate) fn retriable(&self) -> bool {
        use rdkafka::error::{KafkaError, RDKafkaErrorCode as C};
        if let RuntimeError::Kafka(KafkaError::Transaction(e)) = self {
            if e.is_retriable() {
                return true;
            }
        }
        if let RuntimeError::Other(m) = self {
            // A flush that timed out: the records are still on their way.
            return m.starts_with(kafka::FLUSH_TIMED_OUT);
        }
        matches!(
            self.kafka_code(),
            Some(
                C::RequestTimedOut
                    | C::OperationTimedOut
                    | C::NotCoordinator
                    | C::CoordinatorNotAvailable
                    | C::CoordinatorLoadInProgress
                    | C::NetworkException
                    | C::BrokerTransportFailure
                    | C::AllBrokersDown
                    | C::NotEnoughReplicas
                    | C::NotEnoughReplicasAfterAppend
                    | C::ConcurrentTransactions
                    | C::LeaderNotAvailable
                    | C::NotLeaderForPartition
            )
        )
    }

    /// True when records of a transaction were not delivered (see
    /// `kafka::flush`): the transaction can only be aborted.
    pub(crate) fn delivery_failed(&self) -> bool {
        matches!(self, RuntimeError::Other(m) if m.starts_with(kafka::DELIVERY_FAILED))
    }

    /// True when a client call did not return within its bound: the client
    /// takes no further call.
    pub(crate) fn unanswered(&self) -> bool {
        matches!(self, RuntimeError::Unanswered(_))
    }

    /// True when a newer producer with the task's transactional id fenced
    /// this one: its transaction cannot be ended any more (the new owner's
    /// `init_transactions` did that).
    pub(crate) fn fenced(&self) -> bool {
        self.kafka_code().is_some_and(is_fencing_code)
    }
}

/// Wall-clock time, ms since the epoch.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Whether a Kafka error code says the producer was fenced.
pub(crate) fn is_fencing_code(code: rdkafka::error::RDKafkaErrorCode) -> bool {
    use rdkafka::error::RDKafkaErrorCode as C;
    matches!(
        code,
        C::ProducerFenced | C::Fenced | C::InvalidProducerEpoch
    )
}

/// Life-cycle state of an instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AppState {
    /// Created, not yet part of the group.
    Starting,
    /// Partitions are being (re)assigned.
    Rebalancing,
    /// Some assigned tasks are restoring their state.
    Restoring,
    /// Every assigned task is processing.
    Running,
    /// Stopped cleanly.
    Stopped,
    /// Stopped by an error.
    Failed(String),
}

/// Shared view of an instance's state, for health endpoints.
#[derive(Debug)]
pub struct AppStatus {
    state: Mutex<AppState>,
    tasks: Mutex<BTreeSet<TaskId>>,
    /// Why the cluster counts as unreachable (see [`probe`]); `None` while
    /// it answers.
    broker_fault: Mutex<Option<String>>,
}

impl AppStatus {
    fn new() -> Self {
        AppStatus {
            state: Mutex::new(AppState::Starting),
            tasks: Mutex::new(BTreeSet::new()),
            broker_fault: Mutex::new(None),
        }
    }

    /// The current state.
    pub fn state(&self) -> AppState {
        self.state.lock().clone()
    }

    /// True once every assigned task has restored and is processing, while
    /// the cluster answers.
    pub fn is_ready(&self) -> bool {
        *self.state.lock() == AppState::Running && self.broker_fault.lock().is_none()
    }

    /// Why the cluster counts as unreachable now (its last probe failed).
    pub fn broker_fault(&self) -> Option<String> {
        self.broker_fault.lock().clone()
    }

    pub(crate) fn set_broker_fault(&self, fault: Option<String>) {
        *self.broker_fault.lock() = fault;
    }

    /// Tasks this instance runs.
    pub fn tasks(&self) -> Vec<TaskId> {
        self.tasks.lock().iter().copied().collect()
    }

    pub(crate) fn set(&self, s: AppState) {
        *self.state.lock() = s;
    }

    pub(crate) fn set_tasks(&self, tasks: impl IntoIterator<Item = TaskId>) {
        *self.tasks.lock() = tasks.into_iter().collect();
    }
}

/// Holds intake: while any hold is active, every assigned partition is paused
/// (polling continues). For an application that must stop consuming without
/// losing its place, e.g. while its provider rejects its credentials.
#[derive(Clone, Debug, Default)]
pub struct IntakeControl {
    holds: Arc<Mutex<BTreeSet<String>>>,
}

impl IntakeControl {
    /// Adds a named hold.
    pub fn hold(&self, reason: &str) {
        self.holds.lock().insert(reason.to_string());
    }

    /// Removes a named hold.
    pub fn release(&self, reason: &str) {
        self.holds.lock().remove(reason);
    }

    /// True while any hold is active.
    pub fn is_held(&self) -> bool {
        !self.holds.lock().is_empty()
    }

    /// The active holds.
    pub fn holds(&self) -> Vec<String> {
        self.holds.lock().iter().cloned().collect()
    }
}

/// A stream application, ready to start.
pub struct StreamsApp {
    topology: Arc<Topology>,
    cfg: Arc<StreamsConfig>,
    metrics: EngineMetrics,
    runtime: Option<tokio::runtime::Handle>,
    intake: IntakeControl,
}

impl StreamsApp {
    /// Combines a topology, its configuration and metric handles.
    pub fn new(topology: Topology, cfg: StreamsConfig, metrics: EngineMetrics) -> Self {
        StreamsApp {
            topology: Arc::new(topology),
            cfg: Arc::new(cfg),
            metrics,
            runtime: None,
            intake: IntakeControl::default(),
        }
    }

    /// Runs async operator calls on this tokio runtime (else the app creates one).
    pub fn with_runtime(mut self, handle: tokio::runtime::Handle) -> Self {
        self.runtime = Some(handle);
        self
    }

    /// Uses an intake control created beforehand (e.g. handed to operators
    /// while building the topology).
    pub fn with_intake(mut self, intake: IntakeControl) -> Self {
        self.intake = intake;
        self
    }

    /// The intake control of this application.
    pub fn intake(&self) -> IntakeControl {
        self.intake.clone()
    }

    /// Validates the configuration, checks source topics (existence,
    /// co-partitioning), creates internal topics, then starts the driver thread
    /// (and, with an `application_server`, the thread that publishes and
    /// reads instance metadata). Any problem found before processing starts
    /// is returned here.
    pub fn start(self) -> Result<RunningApp, TopologyError> {
        self.cfg.validate()?;
        let prepared = admin::prepare_topics(&self.cfg, &self.topology)?;
        let local = Arc::new(queries::LocalTasks::default());
        let directory = self.cfg.application_server.as_ref().map(|_| {
            Arc::new(instances::Directory::new(
                self.cfg.instance_claim_key.clone(),
            ))
        });
        let queries = Queries::new(
            &self.cfg,
            &self.topology,
            &prepared.subtopology_partitions,
            local.clone(),
            directory.clone(),
        );
        let shutdown = Arc::new(AtomicBool::new(false));
        let status = Arc::new(AppStatus::new());
        let (own_runtime, handle) = match self.runtime {
            Some(h) => (None, h),
            None => {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .thread_name("sluice-async")
                    .build()
                    .map_err(|e| {
                        TopologyError::Invalid(format!("cannot start tokio runtime: {e}"))
                    })?;
                let h = rt.handle().clone();
                (Some(rt), h)
            }
        };
        let claims = match (&self.cfg.application_server, &directory) {
            (Some(server), Some(directory)) => Some(instances::ClaimsThread::start(
                &self.cfg,
                &self.topology,
                server.clone(),
                local.clone(),
                directory.clone(),
            )?),
            _ => None,
        };
        let first_source = self
            .topology
            .subtopologies()
            .iter()
            .flat_map(|s| s.source_topics(&self.cfg.application_id))
            .next();
        let probe = match first_source {
            Some(topic) => Some(probe::ProbeThread::start(&self.cfg, topic, status.clone())?),
            None => None,
        };
        let driver = driver::Driver::new(
            self.topology,
            self.cfg,
            self.metrics,
            prepared.dead_letters,
            handle,
            status.clone(),
            self.intake.clone(),
            local,
        )?;
        let stop = shutdown.clone();
        let st = status.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-driver".into())
            .spawn(move || {
                let result = driver.run(&stop);
                // The tasks are closed: this instance's claim goes.
                if let Some(c) = claims {
                    c.stop();
                }
                drop(probe);
                match &result {
                    Ok(()) => st.set(AppState::Stopped),
                    Err(e) => {
                        tracing::error!(error = %e, "stream driver stopped");
                        st.set(AppState::Failed(e.to_string()))
                    }
                }
                drop(own_runtime);
                result
            })
            .map_err(|e| TopologyError::Invalid(format!("cannot start driver thread: {e}")))?;
        Ok(RunningApp {
            shutdown,
            status,
            intake: self.intake,
            queries,
            thread: Some(thread),
        })
    }
}

/// A started application.
pub struct RunningApp {
    shutdown: Arc<AtomicBool>,
    status: Arc<AppStatus>,
    intake: IntakeControl,
    queries: Queries,
    thread: Option<JoinHandle<Result<(), RuntimeError>>>,
}

impl RunningApp {
    /// Asks the driver to stop: drain, commit, leave the group.
    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
    }

    /// The instance's status.
    pub fn status(&self) -> Arc<AppStatus> {
        self.status.clone()
    }

    /// The intake control.
    pub fn intake(&self) -> IntakeControl {
        self.intake.clone()
    }

    /// Interactive queries: where a key's state lives, and reads of the
    /// state this instance holds (from any thread).
    pub fn queries(&self) -> Queries {
        self.queries.clone()
    }

    /// True once the driver thread ended.
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Waits for the driver to end and returns how it ended.
    pub fn join(mut self) -> Result<(), RuntimeError> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(RuntimeError::Other("driver thread panicked".into()))),
            None => Ok(()),
        }
    }
}

impl Drop for RunningApp {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.shutdown.store(true, Ordering::SeqCst);
            let _ = t.join();
        }
    }
}
