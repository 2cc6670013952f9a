//! Commits: when they run (the interval, rounds on the commit thread,
//! early rounds), and how a commit's parts reach the broker along the
//! protocol of [`crate::commit`]: at-least-once through the shared producer
//! and one group commit ([`AlosCommit`]), exactly-once in a transaction per
//! task ([`EosCommits`]).

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Instant;

use rdkafka::consumer::{CommitMode, Consumer, ConsumerGroupMetadata};
use rdkafka::producer::Producer;
use rdkafka::{Message, Offset, TopicPartitionList};

use super::{
    in_parallel, retrying, ActiveTask, DriverConsumer, Engine, InFlightCommit, TaskOutcome,
    FLUSH_TIMEOUT, TXN_REQUEST_TIMEOUT, TXN_TIMEOUT,
};
use crate::commit::{conduct, CommitPath, CommitPoint};
use crate::record::OutputRecord;
use crate::runtime::error::{is_fencing_code, RuntimeError};
use crate::runtime::failpoint::{failpoint, failpoint_at, switched_on};
use crate::runtime::kafka::{
    flush, send, send_offsets_to_transaction, DeliveryState, DeliveryTag, TrackedProducer,
};
use crate::runtime::metrics::EngineMetrics;
use crate::task::{CommitParts, TaskCore};
use crate::{Guarantee, TaskId, Topology};

impl Engine {
    /// True when a task's producer was fenced by a newer one with its
    /// transactional id: whatever error its commit reported (a purged
    /// delivery, a failed flush), another instance owns the task now.
    fn producer_fenced(&self, id: TaskId) -> bool {
        self.tasks.active.get(&id).is_some_and(|t| {
            t.producer
                .client()
                .fatal_error()
                .is_some_and(|(code, _)| is_fencing_code(code))
        })
    }

    /// Commits every task.
    pub(super) fn commit_all(&mut self, consumer: &DriverConsumer) -> Result<(), RuntimeError> {
        let started = Instant::now();
        let ids: Vec<TaskId> = self.tasks.active.keys().copied().collect();
        self.commit_tasks(consumer, &ids)?;
        self.metrics
            .commit_seconds
            .observe(started.elapsed().as_secs_f64());
        // The interval runs from the end of a commit, so slow commits still
        // leave a full interval of processing between them.
        self.round.last_commit = Instant::now();
        Ok(())
    }

    /// Commits some tasks (under exactly-once, a transaction per task; see
    /// [`commit_eos`]).
    pub(super) fn commit_tasks(
        &mut self,
        consumer: &DriverConsumer,
        ids: &[TaskId],
    ) -> Result<(), RuntimeError> {
        self.flush_tasks(ids)?;
        if !self.eos() {
            return self.commit_alos(consumer, ids);
        }
        let meta = group_metadata(consumer)?;
        let app = self.cfg.application_id.clone();
        let metrics = self.metrics.clone();
        let threads = self.cfg.processing_threads;
        let tasks: Vec<&mut ActiveTask> = self
            .tasks
            .active
            .values_mut()
            .filter(|t| ids.contains(&t.core.id))
            .collect();
        let results = commit_eos(tasks, &meta, &app, &metrics, threads)?;
        self.settle(consumer, results)
    }

    /// Acts on the outcomes of exactly-once commits: a fenced task, or one
    /// whose transaction must abort, is closed dirty and the instance
    /// rejoins; any other error is the instance's.
    fn settle(
        &mut self,
        consumer: &DriverConsumer,
        results: Vec<TaskOutcome>,
    ) -> Result<(), RuntimeError> {
        let mut migrated = Vec::new();
        for (id, result) in results {
            let Err(e) = result else { continue };
            let fenced = e.fenced() || self.producer_fenced(id);
            // A call that never returned, or one that still failed
            // retriably when the transaction's time was up (the broker did
            // not answer it): the transaction's outcome is not known, and
            // the producer is not asked again.
            let unanswered = e.unanswered();
            let given_up = unanswered || e.retriable();
            match e {
                // A delivery that failed inside the transaction (the broker
                // refused a record, or it timed out) leaves the transaction
                // to abort: as a migrated task, the task starts over. So
                // does a producer given up on. Either way what the task
                // commits next starts from what its changelogs and the
                // group hold, whatever became of this transaction.
                e if fenced || given_up || e.task_migrated() || e.delivery_failed() => {
                    tracing::warn!(task = %id, error = %e, "task fenced or its transaction must abort: closing it dirty and rejoining");
                    if unanswered {
                        self.metrics.clients_given_up.inc();
                    }
                    if fenced || given_up {
                        // Nothing to abort: a fenced producer cannot end its
                        // transaction (an abort would wait for its timeout),
                        // and one given up on still has a call in progress;
                        // the next owner's producer fences either.
                        if let Some(t) = self.tasks.active.get_mut(&id) {
                            t.txn_open = false;
                        }
                    }
                    migrated.push(id);
                }
                e => return Err(e),
            }
        }
        if !migrated.is_empty() {
            let mut paused = TopicPartitionList::new();
            for id in &migrated {
                if let Some(t) = self.tasks.active.get(id) {
                    for tp in &t.partitions {
                        if self.intake.paused.insert(tp.clone()) {
                            paused.add_partition(&tp.0, tp.1);
                        }
                    }
                }
            }
            self.close_dirty(&migrated);
            // Nothing is read for them until the group says who owns them
            // (the revocation of the rejoin resumes them).
            if paused.count() > 0 {
                if let Err(e) = consumer.pause(&paused) {
                    tracing::debug!(error = %e, "pausing a closed task's partitions failed");
                }
            }
            self.rejoin = true;
        }
        Ok(())
    }

    /// The periodic commit, called every tick (`due`: the interval elapsed or
    /// a task asked). At-least-once commits every task at once on the driver
    /// thread. Exactly-once commits a round: one task at a time moves to a
    /// commit thread, which runs its whole commit, while the driver goes on
    /// processing the others (a task's records and completions wait while it
    /// commits); the interval runs from the end of a round. Between them an
    /// early round (see [`Engine::outputs_wait_while_idle`]) commits only the
    /// tasks holding outputs, together.
    pub(super) fn commit_periodically(
        &mut self,
        consumer: &DriverConsumer,
        due: bool,
    ) -> Result<(), RuntimeError> {
        self.collect_commit(consumer, false)?;
        if self.round.committing.is_some() {
            return Ok(());
        }
        if self.round.tasks.is_empty() {
            if let Some(started) = self.round.started.take() {
                self.round.last_end = Instant::now();
                if !std::mem::take(&mut self.round.early) {
                    self.metrics
                        .commit_seconds
                        .observe(started.elapsed().as_secs_f64());
                    self.round.last_commit = self.round.last_end;
                }
                return Ok(());
            }
            if !due && !self.outputs_wait_while_idle() {
                return Ok(());
            }
            if !self.eos() {
                return self.commit_all(consumer);
            }
            // Popped from the end: tasks holding outputs commit first (their
            // readers wait for them), each group in task order.
            let mut round: Vec<(bool, TaskId)> = self
                .tasks
                .active
                .iter()
                .map(|(id, t)| (!t.core.ctx.out.is_empty(), *id))
                .filter(|(holds, _)| due || *holds)
                .collect();
            round.sort_by_key(|&(holds, id)| (holds, std::cmp::Reverse(id)));
            self.round.tasks = round.into_iter().map(|(_, id)| id).collect();
            self.round.early = !due;
            self.round.started = Some(Instant::now());
        }
        self.start_commit(consumer)
    }

    /// Moves the next task of the round to a commit thread (the others go on
    /// processing meanwhile: every task committing at once stops them all),
    /// or every task of an early round at once (their transactions' round
    /// trips overlap).
    fn start_commit(&mut self, consumer: &DriverConsumer) -> Result<(), RuntimeError> {
        let mut tasks = Vec::with_capacity(1);
        if self.round.early {
            for id in std::mem::take(&mut self.round.tasks) {
                tasks.extend(self.tasks.active.remove(&id));
            }
        }
        while tasks.is_empty() {
            let Some(id) = self.round.tasks.pop() else {
                return Ok(());
            };
            tasks.extend(self.tasks.active.remove(&id));
        }
        let meta = group_metadata(consumer)?;
        let ids: Vec<TaskId> = tasks.iter().map(|t| t.core.id).collect();
        let app = self.cfg.application_id.clone();
        let metrics = self.metrics.clone();
        let threads = self.cfg.processing_threads;
        let wake = self.intake.wake_tx.clone();
        let handle = std::thread::Builder::new()
            .name("sluice-commit".into())
            .spawn(move || {
                let mut tasks = tasks;
                let result = (|| {
                    for task in &mut tasks {
                        task.flush(&metrics, true)?;
                    }
                    let refs: Vec<&mut ActiveTask> = tasks.iter_mut().collect();
                    commit_eos(refs, &meta, &app, &metrics, threads)
                })();
                let _ = wake.try_send(());
                (tasks, result)
            })
            .map_err(|e| RuntimeError::NoThread(format!("a commit thread: {e}")))?;
        self.round.committing = Some(InFlightCommit {
            ids,
            handle,
            completions: Vec::new(),
            records: Vec::new(),
        });
        Ok(())
    }

    /// Takes back the tasks of the commit thread once it ended (with
    /// `wait`, waits for it), acts on the outcomes, then hands the tasks
    /// what waited for them.
    pub(super) fn collect_commit(
        &mut self,
        consumer: &DriverConsumer,
        wait: bool,
    ) -> Result<(), RuntimeError> {
        match &self.round.committing {
            Some(c) if wait || c.handle.is_finished() => {}
            _ => return Ok(()),
        }
        let c = self.round.committing.take().expect("checked above");
        let (tasks, result) = c
            .handle
            .join()
            .map_err(|_| RuntimeError::Panicked("the commit thread".into()))?;
        for t in tasks {
            self.tasks.active.insert(t.core.id, t);
        }
        self.settle(consumer, result?)?;
        let (eos, max) = (self.eos(), self.cfg.max_in_flight_per_partition);
        for msg in c.records {
            let Some(id) = self.tasks.task_of(msg.topic(), msg.partition()) else {
                continue;
            };
            if let Some(task) = self.tasks.active.get_mut(&id) {
                task.offer(&msg, &self.metrics, eos, max)?;
            }
        }
        for msg in c.completions {
            self.complete(msg)?;
        }
        Ok(())
    }

    /// Commits some tasks under at-least-once (see [`AlosCommit`]).
    pub(super) fn commit_alos(
        &mut self,
        consumer: &DriverConsumer,
        ids: &[TaskId],
    ) -> Result<(), RuntimeError> {
        let Some((producer, delivery)) = self.shared_producer.clone() else {
            return Ok(());
        };
        let mut alos = AlosCommit {
            tasks: self.tasks.listed_mut(ids),
            parts: Vec::new(),
            producer: &producer,
            delivery: &delivery,
            consumer,
            metrics: &self.metrics,
            app: &self.cfg.application_id,
            threads: self.cfg.processing_threads,
            deadline: Instant::now() + self.cfg.max_poll_interval / 2,
            working: false,
            refused: false,
        };
        conduct(&mut alos, Guarantee::AtLeastOnce)?;
        if alos.refused {
            // The group moved on without this member: its tasks' state is
            // in the changelogs already; their offsets are another owner's
            // to commit.
            let ids: Vec<TaskId> = alos.tasks.iter().map(|t| t.core.id).collect();
            self.close_dirty(&ids);
            self.rejoin = true;
        }
        Ok(())
    }
}

/// The at-least-once commit of some tasks: their records go through the
/// shared producer, their offsets in one group commit. Each task's own
/// work (preparing its commit, sending its changelog and progress records,
/// writing its local state) runs side by side.
struct AlosCommit<'a> {
    tasks: Vec<&'a mut ActiveTask>,
    /// Each task's parts, in the order of `tasks` (a part sent is taken).
    parts: Vec<CommitParts>,
    producer: &'a TrackedProducer,
    delivery: &'a DeliveryState,
    consumer: &'a DriverConsumer,
    metrics: &'a EngineMetrics,
    app: &'a str,
    threads: usize,
    /// Until when retriable failures are retried.
    deadline: Instant,
    /// Some task commits something: the tests' crash points are reached
    /// only by commits with work.
    working: bool,
    /// The group refused the offsets as from a member it no longer has.
    refused: bool,
}

impl AlosCommit<'_> {
    /// Each task beside its parts, for work side by side.
    fn with_parts(&mut self) -> Vec<(&mut ActiveTask, &mut CommitParts)> {
        self.tasks
            .iter_mut()
            .map(|t| &mut **t)
            .zip(self.parts.iter_mut())
            .collect()
    }
}

impl CommitPath for AlosCommit<'_> {
    type Error = RuntimeError;

    /// Each task's parts are taken in the pass that sends its changelog
    /// records (`send_changelog`, the next step): its records leave as soon
    /// as they are prepared.
    fn prepare(&mut self, _: Guarantee) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn send_changelog(&mut self) -> Result<(), RuntimeError> {
        let app = self.app;
        let tasks: Vec<&mut ActiveTask> = self.tasks.iter_mut().map(|t| &mut **t).collect();
        let prepared: Vec<(CommitParts, bool)> = in_parallel(tasks, self.threads, |task| {
            let mut parts = task.core.prepare_commit(Guarantee::AtLeastOnce);
            let changed = !parts.changelog.is_empty();
            send_changelog(task, app, std::mem::take(&mut parts.changelog))?;
            Ok((parts, changed))
        })?;
        self.working = prepared
            .iter()
            .any(|(parts, changed)| *changed || !parts.offsets.is_empty());
        self.parts = prepared.into_iter().map(|(parts, _)| parts).collect();
        Ok(())
    }

    fn flush(&mut self) -> Result<(), RuntimeError> {
        let (producer, delivery) = (self.producer, self.delivery);
        retrying("flushing the producer", self.deadline, || {
            flush(producer, delivery, FLUSH_TIMEOUT)
        })
    }

    fn send_progress(&mut self) -> Result<bool, RuntimeError> {
        let (app, threads) = (self.app, self.threads);
        let sent: Vec<bool> = in_parallel(self.with_parts(), threads, |(task, parts)| {
            let progress = parts.progress.take();
            let some = progress.is_some();
            send_changelog(task, app, progress.into_iter().collect())?;
            Ok(some)
        })?;
        Ok(sent.contains(&true))
    }

    fn post_commit(&mut self) -> Result<(), RuntimeError> {
        let (delivery, threads) = (self.delivery, self.threads);
        in_parallel(self.with_parts(), threads, |(task, parts)| {
            let next = delivery.take_changelog_next(task.core.id);
            task.core.post_commit(&parts.offsets, &next)?;
            let ends = delivery.take_output_next(task.core.id);
            task.core.ctx.output_ends.extend(ends);
            Ok(())
        })?;
        Ok(())
    }

    fn commit_offsets(&mut self) -> Result<(), RuntimeError> {
        let mut tpl = TopicPartitionList::new();
        for (task, parts) in self.tasks.iter().zip(&self.parts) {
            add_offsets(&mut tpl, &task.core, &parts.offsets)?;
        }
        if tpl.count() > 0 {
            // A coordinator moving or a request timing out is retried.
            let consumer = self.consumer;
            let committed = retrying("committing offsets", self.deadline, || {
                consumer
                    .commit(&tpl, CommitMode::Sync)
                    .map_err(RuntimeError::from)
            });
            if let Err(e) = committed {
                if !e.task_migrated() {
                    return Err(e);
                }
                tracing::warn!(error = %e, "offset commit refused: closing the tasks and rejoining");
                self.refused = true;
                return Ok(());
            }
        }
        self.metrics.commits.inc();
        Ok(())
    }

    fn reached(&mut self, point: CommitPoint) -> ControlFlow<()> {
        if self.working {
            match point {
                CommitPoint::ChangelogFlushed => failpoint("alos_after_changelog_flush"),
                CommitPoint::ProgressFlushed => failpoint("alos_before_offset_commit"),
                _ => {}
            }
        }
        ControlFlow::Continue(())
    }
}

/// The group's metadata for the transactions' offsets (shared with the
/// threads that add them: see [`send_offsets_to_transaction`]).
fn group_metadata(
    consumer: &DriverConsumer,
) -> Result<Arc<rdkafka::consumer::ConsumerGroupMetadata>, RuntimeError> {
    consumer
        .group_metadata()
        .map(Arc::new)
        .ok_or(RuntimeError::NoGroupMetadata)
}

/// One task's exactly-once commit in progress: what it commits, and the
/// first error it met (it takes no further step then).
struct EosCommit<'a> {
    task: &'a mut ActiveTask,
    parts: CommitParts,
    outputs: Vec<OutputRecord>,
    /// Nothing to commit to Kafka: the task takes no broker step (its local
    /// state is still written: a store without changelog fills its write
    /// cache with no offset moving).
    idle: bool,
    result: Result<(), RuntimeError>,
}

impl EosCommit<'_> {
    /// Runs one broker step of the commit unless the task is idle or an
    /// earlier step failed.
    fn step(&mut self, f: impl FnOnce(&mut Self) -> Result<(), RuntimeError>) {
        if !self.idle && self.result.is_ok() {
            self.result = f(self);
        }
    }
}

/// Commits tasks' transactions (see [`EosCommits`]). Returns each task's
/// outcome (a task that failed took no step after its failure); an error of
/// its own when a processing thread panicked.
pub(super) fn commit_eos(
    tasks: Vec<&mut ActiveTask>,
    meta: &Arc<ConsumerGroupMetadata>,
    app: &str,
    metrics: &EngineMetrics,
    threads: usize,
) -> Result<Vec<TaskOutcome>, RuntimeError> {
    let started = Instant::now();
    let mut eos = EosCommits {
        tasks,
        commits: Vec::new(),
        meta,
        app,
        metrics,
        threads,
        working: false,
        outputs: false,
        started,
        deadline: started,
        steps: [started; 4],
    };
    conduct(&mut eos, Guarantee::ExactlyOnce)?;
    Ok(eos
        .commits
        .into_iter()
        .map(|c| (c.task.core.id, c.result))
        .collect())
}

/// Exactly-once commits of some tasks, a transaction per task. Each task's
/// own work — preparing its commit (write cache to changelog records,
/// progress record), sending its outputs and changelog records, and after
/// the commit its local state — runs side by side. The broker steps
/// (offsets added to the transaction, one flush, commit) run for every
/// task before the next step, so their round trips overlap. Retriable
/// failures (a request timing out, the coordinator moving) are retried
/// within the transaction's timeout.
struct EosCommits<'a, 'c> {
    /// The tasks, until `prepare` takes them into `commits`.
    tasks: Vec<&'a mut ActiveTask>,
    commits: Vec<EosCommit<'a>>,
    meta: &'c Arc<ConsumerGroupMetadata>,
    app: &'c str,
    metrics: &'c EngineMetrics,
    threads: usize,
    /// Some task takes broker steps: the tests' crash points are reached
    /// only inside a transaction.
    working: bool,
    /// Some task commits outputs (some crash points count only those: see
    /// `failpoint_at`).
    outputs: bool,
    started: Instant,
    /// Until when retriable failures are retried.
    deadline: Instant,
    /// When the broker steps began, and when the records were sent, the
    /// offsets added and the transactions flushed.
    steps: [Instant; 4],
}

impl CommitPath for EosCommits<'_, '_> {
    type Error = RuntimeError;

    fn prepare(&mut self, guarantee: Guarantee) -> Result<(), RuntimeError> {
        let tasks = std::mem::take(&mut self.tasks);
        self.commits = in_parallel(tasks, self.threads, |task| {
            let parts = task.core.prepare_commit(guarantee);
            let outputs = task.core.take_output();
            let idle = parts.offsets.is_empty()
                && parts.changelog.is_empty()
                && outputs.is_empty()
                && !task.txn_open;
            Ok(EosCommit {
                task,
                parts,
                outputs,
                idle,
                result: Ok(()),
            })
        })?;
        self.working = self.commits.iter().any(|c| !c.idle);
        self.outputs = self.commits.iter().any(|c| !c.outputs.is_empty());
        Ok(())
    }

    /// A transaction's records (outputs, changelog, progress) are sent on
    /// the processing threads.
    fn send_changelog(&mut self) -> Result<(), RuntimeError> {
        let t0 = Instant::now();
        self.steps[0] = t0;
        self.deadline = t0 + TXN_TIMEOUT;
        let (app, metrics) = (self.app, self.metrics);
        in_parallel(self.commits.iter_mut().collect(), self.threads, |c| {
            c.step(|c| {
                if !c.task.txn_open {
                    c.task.producer.begin_transaction()?;
                    c.task.txn_open = true;
                }
                produce_outputs(c.task, metrics, std::mem::take(&mut c.outputs))?;
                send_changelog(c.task, app, std::mem::take(&mut c.parts.changelog))
            });
            Ok(())
        })?;
        self.steps[1] = Instant::now();
        Ok(())
    }

    fn send_offsets(&mut self) -> Result<(), RuntimeError> {
        let (meta, deadline) = (self.meta, self.deadline);
        for c in self.commits.iter_mut() {
            c.step(|c| {
                if c.parts.offsets.is_empty() {
                    return Ok(());
                }
                let tpl = offsets_tpl(&c.task.core, &c.parts.offsets)?;
                retrying("adding offsets to a transaction", deadline, || {
                    send_offsets_to_transaction(&c.task.producer, &tpl, meta, TXN_REQUEST_TIMEOUT)
                })
            });
        }
        self.steps[2] = Instant::now();
        Ok(())
    }

    /// The commit's own flush (see `kafka::commit_transaction`), with the
    /// tests' crash point between it and the commit.
    fn flush(&mut self) -> Result<(), RuntimeError> {
        let deadline = self.deadline;
        for c in self.commits.iter_mut() {
            c.step(|c| {
                retrying("flushing a transaction", deadline, || {
                    flush(&c.task.producer, &c.task.delivery, FLUSH_TIMEOUT)
                })
            });
        }
        self.steps[3] = Instant::now();
        Ok(())
    }

    fn commit_transaction(&mut self) -> Result<(), RuntimeError> {
        let deadline = self.deadline;
        for c in self.commits.iter_mut() {
            c.step(|c| {
                if switched_on("eos_commit_timed_out") {
                    // For the tests: a commit still timing out when the
                    // transaction's time is up (a broker that does not answer).
                    return Err(RuntimeError::Kafka(rdkafka::error::KafkaError::Flush(
                        rdkafka::error::RDKafkaErrorCode::OperationTimedOut,
                    )));
                }
                retrying("committing a transaction", deadline, || {
                    c.task
                        .producer
                        .commit_transaction(TXN_REQUEST_TIMEOUT)
                        .map_err(RuntimeError::from)
                })?;
                c.task.txn_open = false;
                Ok(())
            });
        }
        let [t0, t_sent, t_offsets, t_flush] = self.steps;
        tracing::trace!(
            sent_ms = (t_sent - t0).as_millis() as u64,
            offsets_ms = (t_offsets - t_sent).as_millis() as u64,
            flush_ms = (t_flush - t_offsets).as_millis() as u64,
            commit_ms = t_flush.elapsed().as_millis() as u64,
            "transaction steps"
        );
        Ok(())
    }

    fn post_commit(&mut self) -> Result<(), RuntimeError> {
        let brokered = self.started.elapsed();
        let tasks = self.commits.len();
        let metrics = self.metrics;
        in_parallel(self.commits.iter_mut().collect(), self.threads, |c| {
            if c.result.is_ok() {
                let id = c.task.core.id;
                let next = c.task.delivery.take_changelog_next(id);
                c.result = c
                    .task
                    .core
                    .post_commit(&c.parts.offsets, &next)
                    .map_err(RuntimeError::from);
                c.task
                    .core
                    .ctx
                    .output_ends
                    .extend(c.task.delivery.take_output_next(id));
                if !c.idle {
                    metrics.commits.inc();
                }
            }
            Ok(())
        })?;
        tracing::trace!(
            tasks,
            broker_ms = brokered.as_millis() as u64,
            total_ms = self.started.elapsed().as_millis() as u64,
            "transactions committed"
        );
        Ok(())
    }

    fn reached(&mut self, point: CommitPoint) -> ControlFlow<()> {
        if self.working {
            let name = match point {
                CommitPoint::OffsetsSent => "eos_before_flush",
                CommitPoint::TransactionFlushed => "eos_after_changelog_flush",
                CommitPoint::TransactionCommitted => "eos_after_commit_before_local",
                _ => return ControlFlow::Continue(()),
            };
            failpoint_at(name, self.outputs);
        }
        ControlFlow::Continue(())
    }
}

/// Adds a task's offsets to commit (by input slot) to `tpl`.
fn add_offsets(
    tpl: &mut TopicPartitionList,
    core: &TaskCore,
    offsets: &[(usize, i64)],
) -> Result<(), RuntimeError> {
    for (slot, offset) in offsets {
        let s = &core.slots[*slot];
        tpl.add_partition_offset(&s.topic, s.partition, Offset::Offset(*offset))?;
    }
    Ok(())
}

/// A task's offsets to commit (by input slot) as a partition list.
fn offsets_tpl(
    core: &TaskCore,
    offsets: &[(usize, i64)],
) -> Result<TopicPartitionList, RuntimeError> {
    let mut tpl = TopicPartitionList::new();
    add_offsets(&mut tpl, core, offsets)?;
    Ok(tpl)
}

pub(super) fn send_changelog(
    task: &mut ActiveTask,
    app: &str,
    dirty: Vec<sluice_state::ChangelogRecord>,
) -> Result<(), RuntimeError> {
    if dirty.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = task
        .core
        .ctx
        .state
        .as_ref()
        .map(|s| {
            s.specs()
                .map(|s| Topology::changelog_topic(app, &s.name))
                .collect()
        })
        .unwrap_or_default();
    let id = task.core.id;
    let no_headers = Vec::new();
    for rec in dirty {
        send(
            &task.producer,
            &names[rec.store.0],
            Some(id.partition),
            Some(&rec.key),
            rec.value.as_deref(),
            None,
            &no_headers,
            DeliveryTag::Changelog {
                task: id,
                store: rec.store.0,
            },
        )?;
    }
    Ok(())
}

pub(super) fn produce_outputs(
    task: &mut ActiveTask,
    metrics: &EngineMetrics,
    out: Vec<OutputRecord>,
) -> Result<(), RuntimeError> {
    for r in &out {
        send(
            &task.producer,
            &r.topic,
            r.partition,
            r.key.as_deref(),
            r.value.as_deref(),
            Some(r.timestamp),
            &r.headers,
            DeliveryTag::Output(task.core.id),
        )?;
    }
    metrics.records_out.inc_by(out.len() as u64);
    Ok(())
}

pub(super) fn flush_counters(task: &mut ActiveTask, metrics: &EngineMetrics) {
    let c = &mut task.core.ctx.counters;
    if c.late_dropped > 0 {
        metrics.late.inc_by(std::mem::take(&mut c.late_dropped));
    }
    if c.replay_skipped > 0 {
        metrics
            .replay_skipped
            .inc_by(std::mem::take(&mut c.replay_skipped));
    }
    for (cat, n) in c.dead_lettered.drain() {
        metrics.dlq.with_label_values(&[&cat]).inc_by(n);
    }
}

impl ActiveTask {
    /// Sends what the task produced, or under exactly-once holds it until
    /// the commit (asking for an early one when much is held).
    pub(super) fn send_outputs(
        &mut self,
        metrics: &EngineMetrics,
        eos: bool,
    ) -> Result<(), RuntimeError> {
        flush_counters(self, metrics);
        if eos {
            // Held until the commit: a task's transaction is open only while it
            // commits, and a crash between commits leaves no transaction behind
            // for the next owner to abort.
            if self.core.ctx.out.len() >= MAX_HELD_OUTPUTS {
                self.core.ctx.commit_requested = true;
            }
            return Ok(());
        }
        let out = self.core.take_output();
        produce_outputs(self, metrics, out)
    }

    /// Forwards the task's cached results (before its commit).
    pub(super) fn flush(&mut self, metrics: &EngineMetrics, eos: bool) -> Result<(), RuntimeError> {
        self.core.flush().map_err(|error| RuntimeError::Process {
            task: self.core.id,
            error,
        })?;
        self.send_outputs(metrics, eos)
    }
}

/// Outputs queued by a task beyond which it asks for an early commit
/// (exactly-once holds outputs until the commit).
pub(super) const MAX_HELD_OUTPUTS: usize = 50_000;
