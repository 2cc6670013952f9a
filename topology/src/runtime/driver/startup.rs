//! Task start-up: fencing, opening and restoring state on a helper thread,
//! then activating the task with the records buffered meanwhile.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use sluice_state::{RocksEnv, TaskState};

use super::{ActiveTask, Engine, PendingTask, Restored, Tp, TXN_TIMEOUT};
use crate::offsets::StartAt;
use crate::runtime::config::StreamsConfig;
use crate::runtime::error::RuntimeError;
use crate::runtime::kafka::{
    create_producer, init_transactions, until_done, DeliveryState, TrackedProducer,
};
use crate::runtime::metrics::EngineMetrics;
use crate::runtime::restore::{self, restore_task};
use crate::task::TaskCore;
use crate::{TaskId, Topology};

impl Engine {
    /// Starts a task assigned here: its restore begins at once when all its
    /// input partitions are here. A task with only some of them waits for
    /// the others (they join it, see `join_task`): the group's assignor
    /// hands a task's partitions over together only when every member
    /// reads the same topics, and a member of a group whose instances run
    /// different topologies (a rolling update adding an input topic, such
    /// as a task type) can be given a task whose other partitions another
    /// instance runs as that task. Two instances would then run one task
    /// (exactly-once: each fencing the other; at-least-once: two writers of
    /// one changelog).
    pub(super) fn start_restore(
        &mut self,
        id: TaskId,
        partitions: Vec<Tp>,
        starts: HashMap<String, StartAt>,
    ) {
        let mut p = PendingTask {
            handle: None,
            cancel: Arc::new(AtomicBool::new(false)),
            buffered: Vec::new(),
            partitions,
            starts,
            waiting: true,
        };
        let missing = self.missing_partitions(id, &p.partitions);
        if missing.is_empty() {
            self.begin_restore(id, &mut p);
        } else {
            tracing::warn!(
                task = %id,
                missing = ?missing,
                "task assigned without all its input partitions: it waits for them \
                 (instances running different topologies share the group?)"
            );
        }
        self.tasks.pending.insert(id, p);
    }

    /// The input topics of task `id` whose partition is not in `have`.
    pub(super) fn missing_partitions(&self, id: TaskId, have: &[Tp]) -> Vec<String> {
        self.topology.subtopologies()[id.subtopology as usize]
            .source_topics(&self.cfg.application_id)
            .into_iter()
            .filter(|t| {
                !have
                    .iter()
                    .any(|(topic, p)| topic == t && *p == id.partition)
            })
            .collect()
    }

    /// Starts the restore thread of a pending task.
    pub(super) fn begin_restore(&self, id: TaskId, p: &mut PendingTask) {
        let cfg = self.cfg.clone();
        let topology = self.topology.clone();
        let env = self.env.clone();
        let metrics = self.metrics.clone();
        let shared = self.shared_producer.clone();
        let stop = p.cancel.clone();
        p.handle = std::thread::Builder::new()
            .name(format!("sluice-restore-{id}"))
            .spawn(move || init_task(&cfg, &topology, &env, &metrics, shared, id, &stop))
            .ok();
        // A thread that could not start is reported by `check_restores`.
        p.waiting = false;
    }

    /// Activates tasks whose restore finished.
    pub(super) fn check_restores(&mut self) -> Result<(), RuntimeError> {
        let done: Vec<TaskId> = self
            .tasks
            .pending
            .iter()
            .filter(|(_, p)| !p.waiting && p.handle.as_ref().is_none_or(|h| h.is_finished()))
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            let mut p = self.tasks.pending.remove(&id).expect("listed above");
            let restored = match p.handle.take() {
                Some(h) => h.join().unwrap_or_else(|_| {
                    Err(RuntimeError::Panicked(format!("restore of task {id}")))
                })?,
                None => {
                    return Err(RuntimeError::NoThread(format!(
                        "restore thread for task {id}"
                    )))
                }
            };
            let sub = &self.topology.subtopologies()[id.subtopology as usize];
            let start = |topic: &str| p.starts.get(topic).copied().unwrap_or(StartAt::Unknown);
            let mut core = TaskCore::new(
                sub,
                id.partition,
                &self.cfg.application_id,
                restored.state,
                self.runtime.clone(),
                self.completions_tx.clone(),
                &self.dlq_partitions,
                &start,
            )?;
            core.ctx.max_record_bytes = self.cfg.max_record_bytes();
            let mut task = ActiveTask::new(
                core,
                restored.producer,
                restored.delivery,
                p.partitions.clone(),
            );
            let (metrics, eos) = (self.metrics.clone(), self.eos());
            let max = self.cfg.max_in_flight_per_partition;
            for msg in p.buffered.drain(..) {
                task.offer(&msg, &metrics, eos, max)?;
            }
            tracing::info!(task = %id, "task restored; processing");
            // Its buffered records (those that reached the consumer's queue
            // before the split) went first; its split queues follow.
            self.tasks.active.insert(id, task);
        }
        self.publish_tasks();
        Ok(())
    }
}

/// Runs on a restore thread: fence (exactly-once), open state, restore.
fn init_task(
    cfg: &StreamsConfig,
    topology: &Topology,
    env: &RocksEnv,
    metrics: &EngineMetrics,
    shared: Option<(Arc<TrackedProducer>, Arc<DeliveryState>)>,
    id: TaskId,
    cancel: &AtomicBool,
) -> Result<Restored, RuntimeError> {
    let started = Instant::now();
    let sub = &topology.subtopologies()[id.subtopology as usize];
    let changelogs = restore::changelogs(cfg, sub.stores());
    let dir = cfg.state_dir.join(&cfg.application_id).join(id.to_string());
    // The restore consumer (of a task with changelogs) connects while the
    // task fences its previous owner and opens its state, so the restore
    // starts connected.
    let (fenced, opened, consumer) = std::thread::scope(|s| {
        let connecting = (!changelogs.is_empty())
            .then(|| s.spawn(|| restore::connect_restore_consumer(cfg, &changelogs, id.partition)));
        let fenced = match shared {
            Some(p) => Ok(p),
            None => fence(cfg, sub, id, cancel),
        };
        let opened = match &fenced {
            Ok(_) if !sub.stores().is_empty() => TaskState::open(&dir, sub.stores(), env).map(Some),
            _ => Ok(None),
        };
        let consumer = connecting.and_then(|c| c.join().ok().flatten());
        (fenced, opened, consumer)
    });
    let (producer, delivery) = fenced?;
    let state = match opened? {
        None => None,
        Some(mut state) => {
            let restore_started = Instant::now();
            let stats = restore_task(cfg, id, &mut state, &changelogs, consumer, cancel)?;
            metrics.observe_restore(restore_started.elapsed());
            metrics.restore_records.inc_by(stats.records);
            tracing::info!(task = %id, records = stats.records, "restored");
            Some(state)
        }
    };
    tracing::debug!(task = %id, elapsed = ?started.elapsed(), "task initialised");
    Ok(Restored {
        state,
        producer,
        delivery,
    })
}

/// Creates a task's transactional producer and fences whatever transaction
/// a previous owner of the task left open (the broker aborts it).
fn fence(
    cfg: &StreamsConfig,
    sub: &crate::topology::SubTopology,
    id: TaskId,
    cancel: &AtomicBool,
) -> Result<(Arc<TrackedProducer>, Arc<DeliveryState>), RuntimeError> {
    let txn_id = format!("{}-{}", cfg.application_id, id);
    let (p, d) = create_producer(cfg, Some(&txn_id))?;
    // Fences whatever transaction a previous owner of this task left
    // open (the broker aborts it). Asked again while it fails
    // retriably: the coordinator may be moving, or the previous
    // owner's transaction still aborting.
    let topic = sub
        .source_topics(&cfg.application_id)
        .pop()
        .unwrap_or_default();
    until_done(
        cancel,
        || init_transactions(&p, &topic, TXN_TIMEOUT),
        |e| tracing::warn!(task = %id, error = %e, "fencing the previous owner failed; trying again"),
    )?;
    Ok((p, d))
}
