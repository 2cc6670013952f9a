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
pub mod probe;

mod admin;
mod claim;
mod clock;
mod driver;
mod error;
mod failpoint;
mod fetched;
mod instances;
mod kafka;
mod local_tasks;
mod polled;
mod queries;
mod restore;
mod status;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

pub use claim::{ClaimKey, InstanceClaim};
pub use config::{GroupProtocol, StreamsConfig};
pub use error::RuntimeError;
pub use kafka::{client_base, close_in_background};
pub use metrics::EngineMetrics;
pub use polled::PolledProducer;
pub use queries::{Assignment, KeyMetadata, Queries, QueryError};
pub use sluice_state::WindowRange;
pub use status::{AppState, AppStatus, IntakeControl};

pub use crate::guarantee::Guarantee;
pub use crate::offsets::MAX_IN_FLIGHT_PER_PARTITION;
pub use crate::partitions::{crc32, key_partition, murmur2, KeyPartitioner};

use crate::{Topology, TopologyError};
use claim::Directory;
use local_tasks::LocalTasks;

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
        for sub in self.topology.subtopologies() {
            sub.check_source_ids(Some(&self.cfg.application_id))?;
        }
        let prepared = admin::prepare_topics(&self.cfg, &self.topology)?;
        let local = Arc::new(LocalTasks::default());
        let directory = self
            .cfg
            .application_server
            .as_ref()
            .map(|_| Arc::new(Directory::new(self.cfg.instance_claim_key.clone())));
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
                .unwrap_or_else(|_| Err(RuntimeError::Panicked("driver thread".into()))),
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
