//! Intake: feeding records from the partition queues to their tasks under
//! the in-flight bound, and pausing or resuming partitions.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use rdkafka::consumer::Consumer;
use rdkafka::{Message, TopicPartitionList};

use super::{
    in_parallel, millis_of, timestamp_of, waker, ActiveTask, DetachOwned, DriverConsumer, Engine,
    SplitQueue, TaskQueues, Tp,
};
use crate::runtime::error::RuntimeError;
use crate::runtime::fetched::{FetchQueue, Fetched};
use crate::runtime::metrics::EngineMetrics;
use crate::task::Input;
use crate::TaskId;

impl Engine {
    /// Gives each assigned input partition its own fetch queue, right after the
    /// assignment, so librdkafka fetches into it while the task restores.
    /// Records of the partition that reached the consumer's queue before the
    /// split go to the task from there; the split queue is read only after the
    /// consumer's queue ran empty once more (`split_at`), so they come first.
    pub(super) fn attach_queues(
        &mut self,
        consumer: &Arc<DriverConsumer>,
    ) -> Result<(), RuntimeError> {
        let new: Vec<Tp> = self
            .tasks
            .active
            .values()
            .map(|t| &t.partitions)
            .chain(self.tasks.pending.values().map(|p| &p.partitions))
            .flatten()
            .filter(|tp| {
                !self.intake.queues.contains_key(*tp) && !self.intake.unsplit.contains(*tp)
            })
            .cloned()
            .collect();
        for tp in new {
            let split = consumer
                .split_partition_queue(&tp.0, tp.1)
                .zip(FetchQueue::of(consumer, &tp.0, tp.1));
            match split {
                Some((mut split, fetch)) => {
                    split.set_nonempty_callback(waker(&self.intake.wake_tx));
                    let split_at = self.intake.drains;
                    self.intake.queues.insert(
                        tp,
                        SplitQueue {
                            _split: split,
                            fetch,
                            split_at,
                        },
                    );
                }
                None => {
                    tracing::warn!(
                        topic = tp.0,
                        partition = tp.1,
                        "cannot split the partition's queue"
                    );
                    self.intake.unsplit.insert(tp);
                }
            }
        }
        Ok(())
    }

    /// Takes records from the split queues while their tasks have room under the
    /// in-flight bound (and no backlog, which holds older records). What is left
    /// stays in librdkafka's bounded prefetch: backpressure without a pause.
    /// Returns whether any record was taken.
    pub(super) fn feed(&mut self) -> Result<bool, RuntimeError> {
        if self.intake.control.is_held() || self.intake.queues.is_empty() {
            return Ok(false);
        }
        let queues = std::mem::take(&mut self.intake.queues);
        let result = self.feed_from(&queues);
        self.intake.queues = queues;
        result
    }

    pub(super) fn feed_from(
        &mut self,
        queues: &HashMap<Tp, SplitQueue>,
    ) -> Result<bool, RuntimeError> {
        let (eos, max) = (self.eos(), self.cfg.max_in_flight_per_partition);
        let cache_max = self.cfg.cache_max_entries;
        let mut by_task: HashMap<TaskId, TaskQueues<'_>> = HashMap::new();
        for (
            (topic, partition),
            SplitQueue {
                fetch, split_at, ..
            },
        ) in queues
        {
            if *split_at >= self.intake.drains {
                continue;
            }
            let Some(id) = self.tasks.task_of(topic, *partition) else {
                continue;
            };
            let Some(slot) = self
                .tasks
                .active
                .get(&id)
                .and_then(|t| t.core.slot_of(topic))
            else {
                continue;
            };
            by_task.entry(id).or_default().push((slot, fetch));
        }
        // A first record of each task is taken here; the tasks that had one
        // go on in parallel when there are several.
        let metrics = &self.metrics;
        let mut busy: Vec<(&mut ActiveTask, TaskQueues<'_>)> = Vec::new();
        for (id, task) in self.tasks.active.iter_mut() {
            let Some(qs) = by_task.remove(id) else {
                continue;
            };
            task.core.drain_done();
            if feed_task(task, &qs, metrics, eos, (max, cache_max), 1)? {
                busy.push((task, qs));
            }
        }
        let fed = !busy.is_empty();
        in_parallel(busy, self.cfg.processing_threads, |(task, qs)| {
            feed_task(task, &qs, metrics, eos, (max, cache_max), FEED_BATCH)
        })?;
        Ok(fed)
    }

    /// Feeds queued records to the tasks, then pauses every partition while
    /// intake is held, and a partition without a split queue whose backlog holds
    /// a full in-flight bound until the backlog ran down; polling never stops.
    pub(super) fn update_pauses(&mut self, consumer: &DriverConsumer) -> Result<(), RuntimeError> {
        let held = self.intake.control.is_held();
        let max = self.cfg.max_in_flight_per_partition;
        let eos = self.eos();
        let mut to_pause = TopicPartitionList::new();
        let mut to_resume = TopicPartitionList::new();
        // A restoring task buffers up to the in-flight bound per partition.
        for p in self.tasks.pending.values() {
            if p.buffered.len() >= max * p.partitions.len() {
                for tp in &p.partitions {
                    if self.intake.paused.insert(tp.clone()) {
                        to_pause.add_partition(&tp.0, tp.1);
                    }
                }
            }
        }
        for task in self.tasks.active.values_mut() {
            if held {
                task.core.drain_done();
            } else {
                task.drain_backlog(&self.metrics, eos, max)?;
            }
            for (i, slot) in task.core.slots.iter().enumerate() {
                let tp = (slot.topic.clone(), slot.partition);
                let queued = task.backlog[i].len();
                let paused = self.intake.paused.contains(&tp);
                // A split queue is read only while its task has room.
                let split = self.intake.queues.contains_key(&tp);
                if !paused && (held || (!split && queued >= max)) {
                    to_pause.add_partition(&tp.0, tp.1);
                    self.intake.paused.insert(tp);
                } else if paused && !held && (split || queued <= max / 2) {
                    to_resume.add_partition(&tp.0, tp.1);
                    self.intake.paused.remove(&tp);
                }
            }
        }
        if to_pause.count() > 0 {
            consumer.pause(&to_pause)?;
        }
        if to_resume.count() > 0 {
            consumer.resume(&to_resume)?;
        }
        Ok(())
    }
}

/// Takes up to `limit` records from each of a task's queues while the task has
/// room. Returns whether any record was taken.
pub(super) fn feed_task(
    task: &mut ActiveTask,
    queues: &TaskQueues<'_>,
    metrics: &EngineMetrics,
    eos: bool,
    (max, cache_max): (usize, usize),
    limit: usize,
) -> Result<bool, RuntimeError> {
    // Records whose calls completed since the last look leave room: without
    // taking them into account a full task would wait for the next tick.
    task.core.drain_done();
    let mut fed = false;
    let mut batch = Vec::with_capacity(TAKE_BATCH);
    for &(slot, queue) in queues {
        let mut taken = 0;
        // A full write cache ends the round: the commit that empties it
        // comes before more records make it bigger.
        while taken < limit && task.has_room(slot, max) && !task.cache_full(cache_max) {
            // No more than the in-flight bound leaves room for: a record
            // that takes more than one place (derived records) leaves the
            // rest of its batch to the backlog, in order.
            let room = task.core.room(slot, max).min(limit - taken);
            queue.take(room.min(TAKE_BATCH), &mut batch);
            if batch.is_empty() {
                break;
            }
            for fetched in batch.drain(..) {
                if let Some(e) = fetched.error() {
                    tracing::warn!(
                        topic = %task.core.slots[slot].topic,
                        partition = task.core.slots[slot].partition,
                        error = %e,
                        "consumer error"
                    );
                    continue;
                }
                taken += 1;
                fed = true;
                if task.has_room(slot, max) {
                    process_input(task, slot, fetched_input(&fetched), metrics, eos)?;
                } else {
                    let input = &task.core.slots[slot];
                    let owned = (input.topic.as_str(), input.partition, &fetched).detach_owned();
                    task.backlog[slot].push_back(owned);
                }
            }
        }
    }
    task.count_in(metrics);
    Ok(fed)
}

/// The input a record taken in a batch is to its task.
fn fetched_input(fetched: &Fetched) -> Input<'_> {
    Input {
        offset: fetched.offset(),
        key: fetched.key(),
        value: fetched.payload(),
        timestamp: millis_of(fetched.timestamp()),
        headers: fetched.headers(),
    }
}

impl ActiveTask {
    /// Processes one record of the consumer's (or a backlog), then sends
    /// (or, under exactly-once, holds) what it produced.
    pub(super) fn process_record(
        &mut self,
        msg: &impl Message,
        metrics: &EngineMetrics,
        eos: bool,
    ) -> Result<(), RuntimeError> {
        let Some(slot) = self.core.slot_of(msg.topic()) else {
            return Ok(());
        };
        let input = Input {
            offset: msg.offset(),
            key: msg.key(),
            value: msg.payload(),
            timestamp: timestamp_of(msg),
            headers: crate::record::message_headers(msg),
        };
        process_input(self, slot, input, metrics, eos)
    }
}

/// Processes one record of an input slot, then sends (or, under
/// exactly-once, holds) what it produced.
fn process_input(
    task: &mut ActiveTask,
    slot: usize,
    input: Input<'_>,
    metrics: &EngineMetrics,
    eos: bool,
) -> Result<(), RuntimeError> {
    // Time one record in 32: the histogram stays representative and the clock
    // stays off the hot path.
    let started = (input.offset & 31 == 0).then(Instant::now);
    task.core
        .process(slot, input)
        .map_err(|error| RuntimeError::Process {
            task: task.core.id,
            error,
        })?;
    task.uncounted += 1;
    if let Some(started) = started {
        metrics
            .process_seconds
            .observe(started.elapsed().as_secs_f64());
    }
    task.send_outputs(metrics, eos)
}

/// Records taken from a partition queue in one call: enough to spread
/// librdkafka's per-call bookkeeping thin, few enough that a task's
/// in-flight bound and write cache limit are looked at often.
const TAKE_BATCH: usize = 64;

/// Records taken from one partition queue per feeding round, so commits,
/// punctuation and completions keep their pace under a steady stream.
pub(super) const FEED_BATCH: usize = 10_000;
