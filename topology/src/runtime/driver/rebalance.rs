//! Rebalances: revocation (drain, commit, suspend), lost partitions (close
//! dirty), assignment (resume or restore) and the start positions handed to
//! librdkafka.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::Producer;
use rdkafka::{Message, Offset, TopicPartitionList};

use super::{DriverConsumer, DriverContext, Engine, Tasks, Tp};
use crate::offsets::StartAt;
use crate::runtime::error::RuntimeError;
use crate::runtime::status::AppState;
use crate::TaskId;

impl Engine {
    /// Revocation: stop intake of the revoked tasks, drain their in-flight work,
    /// commit, and suspend them until the assignment that follows.
    /// Under an incremental protocol the revoked partitions leave this
    /// instance (the others stay, their tasks running): their tasks close
    /// after the commit. Under the eager protocol every partition is revoked
    /// and tasks are suspended, to resume if they come back.
    pub(super) fn on_revoke(
        &mut self,
        consumer: &DriverConsumer,
        tpl: &TopicPartitionList,
        incremental: bool,
        reset: Option<Offset>,
    ) -> Result<(), RuntimeError> {
        // An eager rebalance starts with every partition revoked; under an
        // incremental protocol an instance sees a rebalance as a change of its
        // assignment: partitions revoked here, or added in `on_assign`.
        if !incremental || tpl.count() > 0 {
            self.metrics.rebalances.inc();
        }
        if !incremental {
            self.status.set(AppState::Rebalancing);
        }
        // A commit on the commit thread ends first: its tasks come back.
        self.collect_commit(consumer, true)?;
        self.round.tasks.clear();
        let revoked: HashSet<Tp> = tpl
            .elements()
            .iter()
            .map(|e| (e.topic().to_string(), e.partition()))
            .collect();
        let hit = |parts: &[Tp]| parts.iter().any(|p| revoked.contains(p));
        // librdkafka keeps a partition's pause across its revocation and a
        // later assignment: a revoked partition left paused here would never
        // be fetched again when it comes back. Every pause ends here.
        let mut resume = TopicPartitionList::new();
        self.intake.paused.retain(|tp| {
            let keep = !revoked.contains(tp);
            if !keep {
                resume.add_partition(&tp.0, tp.1);
            }
            keep
        });
        if resume.count() > 0 {
            if let Err(e) = consumer.resume(&resume) {
                tracing::warn!(error = %e, "resuming revoked partitions failed");
            }
        }
        let pending: Vec<TaskId> = self
            .tasks
            .pending
            .iter()
            .filter(|(_, p)| hit(&p.partitions))
            .map(|(id, _)| *id)
            .collect();
        for id in pending {
            let Some(mut p) = self.tasks.pending.remove(&id) else {
                continue;
            };
            p.cancel.store(true, Ordering::SeqCst);
            if let Some(h) = p.handle.take() {
                let _ = h.join();
            }
            // Partitions of it that stay here wait for the others to come
            // back (their records were not read yet: none is lost).
            p.partitions.retain(|tp| !revoked.contains(tp));
            if p.partitions.is_empty() || self.fatal.is_some() {
                continue;
            }
            tracing::warn!(task = %id, staying = ?p.partitions, "some of a pending task's partitions were revoked: it waits for them");
            p.buffered
                .retain(|m| !revoked.contains(&(m.topic().to_string(), m.partition())));
            p.cancel = Arc::new(AtomicBool::new(false));
            p.waiting = true;
            self.tasks.pending.insert(id, p);
        }
        let ids: Vec<TaskId> = self
            .tasks
            .active
            .iter()
            .filter(|(_, t)| hit(&t.partitions))
            .map(|(id, _)| *id)
            .collect();
        self.intake.queues.retain(|tp, _| !revoked.contains(tp));
        if self.fatal.is_some() {
            for id in ids {
                self.tasks.active.remove(&id);
            }
            return Ok(());
        }
        if consumer.assignment_lost() {
            // Another instance may own these partitions already (this one
            // missed its session timeout, or was fenced): nothing of theirs
            // since the last commit may reach the changelogs or local state.
            tracing::warn!(tasks = ?ids, "partitions lost: closing their tasks dirty");
            self.close_dirty(&ids);
            return Ok(());
        }
        self.drain(&ids)?;
        self.commit_tasks(consumer, &ids)?;
        let mut staying: Vec<(TaskId, Vec<Tp>)> = Vec::new();
        for id in ids {
            if let Some(mut task) = self.tasks.active.remove(&id) {
                if incremental {
                    task.count_in(&self.metrics);
                    let stay: Vec<Tp> = task
                        .partitions
                        .iter()
                        .filter(|tp| !revoked.contains(*tp))
                        .cloned()
                        .collect();
                    if stay.is_empty() {
                        tracing::info!(task = %id, "task moved to another instance");
                    } else {
                        staying.push((id, stay));
                    }
                    continue;
                }
                // Queued records are read again from the committed position.
                for q in &mut task.backlog {
                    q.clear();
                }
                self.tasks.suspended.insert(id, task);
            }
        }
        self.wait_again(consumer, staying, reset);
        self.publish_tasks();
        Ok(())
    }

    /// Some partitions of running tasks were revoked and others stay here
    /// (never from an assignor given the same topics by every member: it
    /// moves a task's partitions together). Those tasks closed after their
    /// commit; the partitions that stay go back to their committed offsets
    /// (what the task had read past them is read again) and wait, as a
    /// task's partitions assigned without the others do, for the revoked
    /// ones to come back.
    fn wait_again(
        &mut self,
        consumer: &DriverConsumer,
        staying: Vec<(TaskId, Vec<Tp>)>,
        reset: Option<Offset>,
    ) {
        if staying.is_empty() {
            return;
        }
        let mut tpl = TopicPartitionList::new();
        for tp in staying.iter().flat_map(|(_, parts)| parts) {
            tpl.add_partition(&tp.0, tp.1);
        }
        let orphaned = |reason: &str| {
            tracing::warn!(
                tasks = ?staying,
                reason,
                "partitions of tasks closed by a revocation stay here unread until they are revoked"
            )
        };
        let committed = match consumer.committed_offsets(tpl, COMMITTED_LOOKUP_TIMEOUT) {
            Ok(c) => c,
            Err(e) => return orphaned(&format!("committed offsets not known: {e}")),
        };
        let mut seek = TopicPartitionList::new();
        let mut starts: HashMap<Tp, StartAt> = HashMap::new();
        for e in committed.elements() {
            let Some(at) = committed_start(&e, reset) else {
                let answer = (e.error(), e.offset());
                return orphaned(&format!("committed offset of {}: {answer:?}", e.topic()));
            };
            if seek
                .add_partition_offset(e.topic(), e.partition(), at)
                .is_err()
            {
                return orphaned("cannot list a position");
            }
            starts.insert((e.topic().to_string(), e.partition()), start_at(at));
        }
        match consumer.seek_partitions(seek, SEEK_TIMEOUT) {
            Ok(done) => {
                if let Some(e) = done.elements().iter().find(|e| e.error().is_err()) {
                    return orphaned(&format!("seek of {}: {:?}", e.topic(), e.error()));
                }
            }
            Err(e) => return orphaned(&format!("seek: {e}")),
        }
        for (id, parts) in staying {
            tracing::warn!(task = %id, staying = ?parts, "some of a running task's partitions were revoked: it closed, and waits for them with the others");
            let starts = parts
                .iter()
                .map(|tp| {
                    let start = starts.get(tp).copied().unwrap_or(StartAt::Unknown);
                    (tp.0.clone(), start)
                })
                .collect();
            self.start_restore(id, parts, starts);
        }
    }

    /// Closes tasks without committing: in-flight calls abandoned, an open
    /// transaction aborted, uncommitted state and held outputs dropped (the
    /// local store keeps what the last commit wrote). A task that comes back
    /// restores from its changelogs like any new one.
    pub(super) fn close_dirty(&mut self, ids: &[TaskId]) {
        for id in ids {
            let Some(mut task) = self
                .tasks
                .active
                .remove(id)
                .or_else(|| self.tasks.suspended.remove(id))
            else {
                continue;
            };
            task.count_in(&self.metrics);
            task.abandon(&self.metrics);
            if task.txn_open {
                if let Err(e) = task.producer.abort_transaction(ABORT_TIMEOUT) {
                    tracing::debug!(task = %id, error = %e, "abort of a closed task's transaction failed");
                }
                self.metrics.aborted.inc();
            }
            // A paused partition stays paused (and listed) until the
            // revocation that follows every dirty close resumes it.
            for tp in &task.partitions {
                self.intake.queues.remove(tp);
            }
            tracing::info!(task = %id, "task closed dirty");
        }
        self.publish_tasks();
    }

    /// Waits for the in-flight async calls of `ids` (handling completions of all
    /// tasks meanwhile) up to the drain timeout, then abandons what is left.
    pub(super) fn drain(&mut self, ids: &[TaskId]) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + self.cfg.drain_timeout;
        loop {
            let pending: usize = ids
                .iter()
                .filter_map(|id| self.tasks.active.get(id))
                .map(|t| t.core.ctx.spawner.pending())
                .sum();
            if pending == 0 {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    pending,
                    "drain timeout: abandoning in-flight calls; their records stay uncommitted"
                );
                for id in ids {
                    if let Some(t) = self.tasks.active.get_mut(id) {
                        t.abandon(&self.metrics);
                    }
                }
                return Ok(());
            }
            if let Ok(msg) = self
                .completions_rx
                .recv_timeout(left.min(Duration::from_millis(50)))
            {
                self.complete(msg)?;
            }
        }
    }

    /// Where the suspended tasks among the newly assigned partitions go on
    /// reading: past every record each read (those still in flight there,
    /// e.g. held by an operator, stay its own), not at the group's committed
    /// offset. A suspended task given back without all its input partitions does not
    /// resume (see `on_assign`): its partitions start at their commit.
    pub(super) fn resume_positions(&self, tpl: &TopicPartitionList) -> HashMap<Tp, i64> {
        let mut at = HashMap::new();
        let given = partitions_by_task(&self.tasks, tpl);
        for e in tpl.elements() {
            let Some(id) = self.tasks.task_of(e.topic(), e.partition()) else {
                continue;
            };
            let Some(task) = self
                .tasks
                .suspended
                .get(&id)
                .filter(|t| !t.core.is_abandoned())
            else {
                continue;
            };
            if !self.missing_partitions(id, &given[&id]).is_empty() {
                continue;
            }
            let Some(slot) = task.core.slot_of(e.topic()) else {
                continue;
            };
            if let Some(next) = task.core.trackers[slot].next_to_read() {
                at.insert((e.topic().to_string(), e.partition()), next);
            }
        }
        at
    }

    /// Assignment: resume suspended tasks that stayed here, close the others,
    /// and restore new ones (buffering their records meanwhile). Under an
    /// incremental protocol `tpl` holds only the partitions added; the tasks
    /// already here go on.
    pub(super) fn on_assign(
        &mut self,
        consumer: &DriverConsumer,
        tpl: &TopicPartitionList,
        incremental: bool,
    ) -> Result<(), RuntimeError> {
        self.collect_commit(consumer, true)?;
        // An assignment forwards its partitions to the consumer's queue again.
        for e in tpl.elements() {
            let tp = (e.topic().to_string(), e.partition());
            self.intake.queues.remove(&tp);
            self.intake.unsplit.remove(&tp);
        }
        let by_task = partitions_by_task(&self.tasks, tpl);
        // Where `set_start_positions` put each partition.
        let starts: HashMap<Tp, StartAt> = tpl
            .elements()
            .iter()
            .map(|e| ((e.topic().to_string(), e.partition()), start_at(e.offset())))
            .collect();
        // Tasks added to an instance that had joined already (an eager
        // rebalance was counted at its revocation; the first assignment is
        // the join, not a rebalance; partitions joining a task here move no
        // work between instances).
        let adds_tasks = by_task
            .keys()
            .any(|id| !self.tasks.active.contains_key(id) && !self.tasks.pending.contains_key(id));
        if incremental && self.joined && adds_tasks {
            self.metrics.rebalances.inc();
        }
        self.joined = true;
        let gone: Vec<TaskId> = self
            .tasks
            .suspended
            .keys()
            .filter(|id| !incremental && !by_task.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            if let Some(mut task) = self.tasks.suspended.remove(&id) {
                tracing::info!(task = %id, "task moved to another instance");
                task.count_in(&self.metrics);
                drop(task);
            }
        }
        for (id, parts) in by_task {
            if self.join_task(id, &parts, &starts) {
                continue;
            }
            if let Some(mut task) = self.tasks.suspended.remove(&id) {
                if !task.core.is_abandoned() && self.missing_partitions(id, &parts).is_empty() {
                    // Given back whole, it goes on where it left off:
                    // `resume_positions` set its partitions to start past
                    // every record it read, as it does for a task given back whole.
                    self.tasks.active.insert(id, task);
                    continue;
                }
                // Its abandoned records must be read again, or it waits for
                // partitions another instance holds: start afresh.
                task.count_in(&self.metrics);
                drop(task);
            }
            // Not paused: librdkafka looks up the positions and fetches while
            // the task restores (a pause would hold the lookup back until the
            // resume); records wait in the split queues (`attach_queues`).
            let starts = parts
                .iter()
                .map(|tp| {
                    (
                        tp.0.clone(),
                        starts.get(tp).copied().unwrap_or(StartAt::Unknown),
                    )
                })
                .collect();
            self.start_restore(id, parts, starts);
        }
        self.publish_tasks();
        Ok(())
    }
}

impl Engine {
    /// Partitions of a task already here (restoring or running) join it. The
    /// broker's assignor hands a task's partitions over together, but its
    /// view of the topics can lag their creation: a topic created just
    /// before the group's first assignment (an internal topic at start-up)
    /// comes in an assignment of its own a moment later. Returns whether the
    /// task was here.
    fn join_task(&mut self, id: TaskId, parts: &[Tp], starts: &HashMap<Tp, StartAt>) -> bool {
        let start = |tp: &Tp| starts.get(tp).copied().unwrap_or(StartAt::Unknown);
        if let Some(mut p) = self.tasks.pending.remove(&id) {
            let what = if p.waiting { "waiting" } else { "restoring" };
            for tp in parts {
                if p.partitions.contains(tp) {
                    continue;
                }
                tracing::info!(task = %id, topic = %tp.0, partition = tp.1, "partition joins its {what} task");
                p.starts.insert(tp.0.clone(), start(tp));
                p.partitions.push(tp.clone());
            }
            if p.waiting && self.missing_partitions(id, &p.partitions).is_empty() {
                tracing::info!(task = %id, "task has all its input partitions: restoring");
                self.begin_restore(id, &mut p);
            }
            self.tasks.pending.insert(id, p);
            return true;
        }
        let Some(task) = self.tasks.active.get_mut(&id) else {
            return false;
        };
        for tp in parts {
            if task.partitions.contains(tp) {
                continue;
            }
            tracing::info!(task = %id, topic = %tp.0, partition = tp.1, "partition joins its running task");
            if let Some(slot) = task.core.slot_of(&tp.0) {
                if let Some(w) = task.core.trackers[slot].starting_at(start(tp)) {
                    tracing::warn!(task = %id, topic = %tp.0, partition = tp.1, "{w}");
                }
            }
            task.partitions.push(tp.clone());
        }
        true
    }
}

/// The partitions of `tpl` by the task that reads them, in task order.
fn partitions_by_task(tasks: &Tasks, tpl: &TopicPartitionList) -> BTreeMap<TaskId, Vec<Tp>> {
    let mut by: BTreeMap<TaskId, Vec<Tp>> = BTreeMap::new();
    for e in tpl.elements() {
        if let Some(id) = tasks.task_of(e.topic(), e.partition()) {
            by.entry(id)
                .or_default()
                .push((e.topic().to_string(), e.partition()));
        }
    }
    by
}

impl DriverContext {
    /// Sets where each newly assigned partition starts: where a resumed task
    /// left off (`resume`), else at its committed offset, or at `reset` when it
    /// has none. librdkafka looks the same up when positions are left unset, but
    /// it starts a partition without a committed offset only after a 100 ms
    /// back-off, which every new group and new partition would pay. If the lookup
    /// fails, the positions stay unset (but the resumed ones) and librdkafka
    /// decides.
    pub(super) fn set_start_positions(
        consumer: &BaseConsumer<DriverContext>,
        tpl: &mut TopicPartitionList,
        reset: Option<Offset>,
        resume: &HashMap<Tp, i64>,
    ) {
        for ((topic, partition), at) in resume {
            if tpl
                .set_partition_offset(topic, *partition, Offset::Offset(*at))
                .is_err()
            {
                tracing::debug!(topic, partition, "cannot set a resumed task's position");
            }
        }
        let Some(reset) = reset else { return };
        let committed = match consumer.committed_offsets(tpl.clone(), COMMITTED_LOOKUP_TIMEOUT) {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "committed offsets lookup failed; librdkafka looks them up");
                return;
            }
        };
        let mut starts = Vec::new();
        for e in committed.elements() {
            if resume.contains_key(&(e.topic().to_string(), e.partition())) {
                continue;
            }
            // An error or an unexpected answer: leave every position to librdkafka.
            let Some(start) = committed_start(&e, Some(reset)) else {
                return;
            };
            starts.push((e.topic().to_string(), e.partition(), start));
        }
        for (topic, partition, start) in starts {
            if tpl.set_partition_offset(&topic, partition, start).is_err() {
                tracing::debug!(topic, partition, "cannot set a start position");
            }
        }
    }
}

/// Where a partition starts given the group's answer `e` for its committed
/// offset: there, or at `reset` when the group has none; `None` for an error,
/// an unexpected answer, or no offset and no `reset`.
fn committed_start(
    e: &rdkafka::topic_partition_list::TopicPartitionListElem<'_>,
    reset: Option<Offset>,
) -> Option<Offset> {
    match (e.error(), e.offset()) {
        (Ok(()), Offset::Offset(o)) if o >= 0 => Some(Offset::Offset(o)),
        (Ok(()), Offset::Invalid) => reset,
        _ => None,
    }
}

/// What a start position set in an assignment means for a task's offset
/// tracker: the committed offset, the reset policy's end (the group had
/// none), or not known.
fn start_at(offset: Offset) -> StartAt {
    match offset {
        Offset::Offset(o) => StartAt::Committed(o),
        Offset::Beginning | Offset::End => StartAt::Reset,
        _ => StartAt::Unknown,
    }
}

/// How long the assignment waits for the committed offsets it looks up.
pub(super) const COMMITTED_LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// How long moving partitions back to their committed offsets may wait.
const SEEK_TIMEOUT: Duration = Duration::from_secs(10);

/// How long closing a task dirty waits for its transaction's abort: the
/// abort only saves readers the wait for the transaction's timeout, and the
/// driver does nothing else meanwhile.
const ABORT_TIMEOUT: Duration = Duration::from_secs(5);
