//! A task: the operators of one sub-topology for one partition number, its
//! state, and the offset tracking of its input partitions. The Kafka runtime and
//! the in-process test driver both drive tasks through this type.

use std::collections::HashMap;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use sluice_state::{ChangelogRecord, Position, StoreId, StoredValue, TaskState};

use crate::codec::{from_bincode, to_bincode};
use crate::context::{handle, CallPanicked, CompletionMsg, Spawner, TaskCtx, TaskId};
use crate::derived::{HeldRecord, Resumable};
use crate::guarantee::Guarantee;
use crate::node::{CompletionTarget, Punctuation};
use crate::offsets::{
    Admission, Done, Finished, OffsetTracker, Origin, RecordToken, StartAt, TaskProgress,
};
use crate::record::{Headers, OutputRecord, RawRecord};
use crate::topology::{source_id, RawView, SourceNode, SubTopology};
use crate::{ProcessError, TopologyError};

/// Dead-letter header names.
pub mod dlq_headers {
    /// Why the record was dead-lettered (short, machine-readable).
    pub const REASON: &str = "dlq.reason";
    /// The category (`poison`, `bad_request`, …).
    pub const CATEGORY: &str = "dlq.category";
    /// Processing attempts made.
    pub const ATTEMPTS: &str = "dlq.attempts";
    /// Source topic of the original record.
    pub const ORIGINAL_TOPIC: &str = "dlq.original.topic";
    /// Source partition of the original record.
    pub const ORIGINAL_PARTITION: &str = "dlq.original.partition";
    /// Source offset of the original record.
    pub const ORIGINAL_OFFSET: &str = "dlq.original.offset";
    /// When it was dead-lettered (RFC 3339).
    pub const SENT_AT: &str = "dlq.sent.at";
    /// Set on the dead letter of a record an operator derived (it has no
    /// original bytes): which task and record.
    pub const DERIVED: &str = "dlq.derived";
    /// Set when the original bytes were cut for the dead letter to fit the
    /// producers' `message.max.bytes`: the original sizes, `value=<bytes>`
    /// (and `,key=<bytes>` when the key was cut too).
    pub const TRUNCATED: &str = "dlq.truncated";
}

/// Headers a record written to a repartition topic carries about the source
/// record it came from, so that a dead letter downstream of the repartition
/// still goes to the original source's dead-letter topic and names the
/// original topic, partition and offset. The engine sets them; a chain of
/// repartitions keeps the first origin.
pub mod origin_headers {
    /// Topic of the source record.
    pub const TOPIC: &str = "sluice.origin.topic";
    /// Its partition.
    pub const PARTITION: &str = "sluice.origin.partition";
    /// Its offset.
    pub const OFFSET: &str = "sluice.origin.offset";
    /// Its source's dead-letter topic.
    pub const DEAD_LETTER_TOPIC: &str = "sluice.origin.dlq";

    pub(crate) const ALL: [&str; 4] = [TOPIC, PARTITION, OFFSET, DEAD_LETTER_TOPIC];
}

/// Where a record came from: its source and that source's dead-letter topic.
struct SourceOrigin {
    topic: String,
    partition: i32,
    offset: i64,
    dead_letter_topic: String,
}

impl SourceOrigin {
    fn from_headers(headers: &Headers) -> Option<SourceOrigin> {
        let get = |k: &str| {
            headers
                .iter()
                .rev()
                .find(|(h, _)| h == k)
                .and_then(|(_, v)| String::from_utf8(v.clone()).ok())
        };
        Some(SourceOrigin {
            topic: get(origin_headers::TOPIC)?,
            partition: get(origin_headers::PARTITION)?.parse().ok()?,
            offset: get(origin_headers::OFFSET)?.parse().ok()?,
            dead_letter_topic: get(origin_headers::DEAD_LETTER_TOPIC)?,
        })
    }

    fn push_to(&self, headers: &mut Headers) {
        let mut add = |k: &str, v: String| headers.push((k.to_string(), v.into_bytes()));
        add(origin_headers::TOPIC, self.topic.clone());
        add(origin_headers::PARTITION, self.partition.to_string());
        add(origin_headers::OFFSET, self.offset.to_string());
        add(
            origin_headers::DEAD_LETTER_TOPIC,
            self.dead_letter_topic.clone(),
        );
    }
}

fn without_origin(headers: &Headers) -> Headers {
    headers
        .iter()
        .filter(|(k, _)| !origin_headers::ALL.contains(&k.as_str()))
        .cloned()
        .collect()
}

/// One input partition of a task.
#[derive(Clone, Debug)]
pub(crate) struct InputSlot {
    pub(crate) topic: String,
    pub(crate) partition: i32,
    pub(crate) source: usize,
    pub(crate) source_id: u32,
    pub(crate) dead_letter: Option<String>,
    /// An internal (repartition) topic: its records' origin headers name
    /// their dead-letter topic, so the raw record is kept for them too.
    pub(crate) internal: bool,
}

/// An input record handed to a task.
pub(crate) struct Input<'a> {
    pub(crate) offset: i64,
    pub(crate) key: Option<&'a [u8]>,
    pub(crate) value: Option<&'a [u8]>,
    pub(crate) timestamp: i64,
    pub(crate) headers: Headers,
}

/// The operators, state and offsets of one task.
pub(crate) struct TaskCore {
    pub(crate) id: TaskId,
    pub(crate) ctx: TaskCtx,
    sources: Vec<Box<dyn SourceNode>>,
    targets: Vec<Arc<Mutex<dyn CompletionTarget>>>,
    pub(crate) slots: Vec<InputSlot>,
    pub(crate) trackers: Vec<OffsetTracker>,
    done_rx: Receiver<Done>,
    /// Records whose async call panicked, in flight until dead-lettered.
    panicked: Vec<Arc<RecordToken>>,
    /// The store the task's progress record lives in.
    progress_store: Option<StoreId>,
    /// The progress record last written (an unchanged one is not written
    /// again: a long call holding the offset back costs no transaction).
    last_progress: Option<TaskProgress>,
    /// When records held by a processor that cannot resume them were last
    /// logged.
    unresumable_logged: Option<std::time::Instant>,
}

/// What one commit of a task covers, taken at one instant, in the order its
/// parts reach the broker (see [`crate::commit`]).
#[derive(Default)]
pub(crate) struct CommitParts {
    /// The changelog records of the state changed since the last commit;
    /// under exactly-once the progress record is among them (they commit
    /// together in the transaction).
    pub(crate) changelog: Vec<ChangelogRecord>,
    /// At-least-once: the progress record, sent once the changelog records
    /// are acknowledged and before the offsets; `None` when it did not
    /// change, and under exactly-once.
    pub(crate) progress: Option<ChangelogRecord>,
    /// The offsets to commit: (input slot, offset).
    pub(crate) offsets: Vec<(usize, i64)>,
}

/// A record a task's last commit stored to take up again after a restart.
enum Stored {
    /// A derived record, forwarded again by the operator that derived it,
    /// and the stream time it was derived at (unknown for those earlier
    /// versions stored).
    Derived(Resumable, Option<i64>),
    /// A converted hold, handed back to its processor.
    Held(HeldRecord),
}

/// What a task restarts from: its last commit's progress record, and the
/// derived records and holds it had in flight (by id).
type Restored = (Option<TaskProgress>, Vec<(u64, Stored)>);

/// The key of a task's progress record in its progress store.
const PROGRESS_KEY: &[u8] = b"progress";

impl TaskCore {
    /// Instantiates the operators of `sub` for `partition` over restored
    /// `state`. `start` gives where reading each input topic starts: the
    /// progress record the task restarts from counts only where the offsets
    /// are as its commit left them. Records the task's operators derived and had in flight at
    /// that commit are forwarded again before any input.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        sub: &SubTopology,
        partition: i32,
        app_id: &str,
        state: Option<TaskState>,
        runtime: tokio::runtime::Handle,
        completions: Sender<CompletionMsg>,
        dlq_partitions: &HashMap<String, i32>,
        start: &dyn Fn(&str) -> StartAt,
    ) -> Result<TaskCore, TopologyError> {
        let id = TaskId {
            subtopology: sub.id as u32,
            partition,
        };
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let mut ctx = TaskCtx::new(id, state, Spawner::new(runtime, completions, id), done_tx);
        sub.check_source_ids(Some(app_id))?;
        let instance = sub.instantiate(app_id, &ctx.stores)?;
        let mut slots = Vec::new();
        for (i, src) in sub.sources.iter().enumerate() {
            for t in &src.topics {
                let topic = t.resolve(app_id);
                slots.push(InputSlot {
                    source_id: source_id(&topic),
                    topic,
                    partition,
                    source: i,
                    dead_letter: src.dead_letter.clone(),
                    internal: matches!(t, crate::topology::SourceTopic::Internal { .. }),
                });
            }
        }
        ctx.dead_letter_topics = slots
            .iter()
            .map(|s| (s.topic.clone(), s.dead_letter.clone()))
            .collect();
        ctx.derived_dead_letter = slots
            .iter()
            .find_map(|s| s.dead_letter.clone().map(|d| (s.topic.clone(), d)));
        ctx.dead_letter_partitions = dlq_partitions.clone();
        let progress_store = ctx.store(&crate::Topology::progress_store(sub.id));
        let (restored, derived) = Self::read_progress(id, progress_store, ctx.state.as_ref())?;
        let mut trackers = Vec::with_capacity(slots.len());
        for s in &slots {
            let slot_progress = restored
                .as_ref()
                .and_then(|p| p.slots.iter().find(|p| p.source == s.source_id).cloned());
            let (tracker, warning) = OffsetTracker::restarting(start(&s.topic), slot_progress);
            if let Some(w) = warning {
                tracing::warn!(task = %id, topic = %s.topic, partition, "{w}");
            }
            trackers.push(tracker);
        }
        if let Some(p) = &restored {
            // Stream time is part of the state: lateness and punctuation go on
            // from where the commit left them.
            ctx.stream_time = ctx.stream_time.max(p.stream_time);
            ctx.closing_time = ctx.closing_time.max(p.stream_time);
        }
        let mut task = TaskCore {
            id,
            ctx,
            sources: instance.sources,
            targets: instance.targets,
            trackers,
            slots,
            done_rx,
            panicked: Vec::new(),
            progress_store,
            last_progress: restored,
            unresumable_logged: None,
        };
        let invalid = |e: ProcessError| {
            TopologyError::Invalid(format!("operator init failed in task {id}: {e}"))
        };
        for t in task.targets.clone() {
            t.lock().init(&mut task.ctx).map_err(invalid)?;
        }
        task.resume_derived(derived).map_err(invalid)?;
        Ok(task)
    }

    /// The progress record and the derived records a task's last commit
    /// stored.
    fn read_progress(
        id: TaskId,
        store: Option<StoreId>,
        state: Option<&TaskState>,
    ) -> Result<Restored, TopologyError> {
        let (Some(store), Some(state)) = (store, state) else {
            return Ok((None, Vec::new()));
        };
        let corrupt = |e: &dyn std::fmt::Display| TopologyError::Invalid(format!("task {id}: {e}"));
        let progress = state
            .get(store, PROGRESS_KEY)?
            .map(|stored| TaskProgress::decode(&stored.value))
            .transpose()
            .map_err(|e| corrupt(&e))?;
        let mut derived = Vec::new();
        for (key, stored) in state.prefix_scan(store, crate::derived::KEY_PREFIX)? {
            let Some(d) = crate::derived::id_of(&key) else {
                continue;
            };
            // With the stream time it was derived at; earlier versions
            // stored the record alone.
            let (content, stream_time) = from_bincode::<(Resumable, i64)>(&stored.value)
                .map(|(c, t)| (c, Some(t)))
                .or_else(|_| from_bincode::<Resumable>(&stored.value).map(|c| (c, None)))
                .map_err(|e| corrupt(&format!("corrupt derived record {d}: {e}")))?;
            derived.push((d, Stored::Derived(content, stream_time)));
        }
        for (key, stored) in state.prefix_scan(store, crate::derived::HELD_PREFIX)? {
            let Some(d) = crate::derived::id_below(crate::derived::HELD_PREFIX, &key) else {
                continue;
            };
            let held: HeldRecord = from_bincode(&stored.value)
                .map_err(|e| corrupt(&format!("corrupt held record {d}: {e}")))?;
            derived.push((d, Stored::Held(held)));
        }
        // In the order they were made.
        derived.sort_by_key(|(d, _)| *d);
        Ok((progress, derived))
    }

    /// Forwards again, in the order they were derived, the records the
    /// restored commit had in flight (see `crate::derived`).
    fn resume_derived(&mut self, derived: Vec<(u64, Stored)>) -> Result<(), ProcessError> {
        // What the resumed records derive or hold gets ids above them all.
        if let Some((last, _)) = derived.last() {
            self.ctx.derived.ids_above(*last);
        }
        for (d, stored) in derived {
            let (content, stream_time) = match stored {
                Stored::Derived(content, stream_time) => (content, stream_time),
                Stored::Held(held) => {
                    self.resume_held(d, held)?;
                    continue;
                }
            };
            // Judged late or not by the stream time it was derived at, as
            // without the crash.
            let stream_time = stream_time.unwrap_or(self.ctx.stream_time);
            self.ctx.derived.restore(d, content.clone(), stream_time);
            let mut owned = false;
            for s in &mut self.sources {
                if s.resume(&content.node, d, &content.bytes, &mut self.ctx)? {
                    owned = true;
                    break;
                }
            }
            if !owned {
                return Err(ProcessError::Fatal(format!(
                    "a derived record of {} was stored, and no operator of this topology owns that store",
                    content.node
                )));
            }
        }
        Ok(())
    }

    /// Hands a hold the restored commit converted back to its processor,
    /// as the current record (its root's position and original bytes, the
    /// stream time its root arrived at).
    fn resume_held(&mut self, id: u64, held: HeldRecord) -> Result<(), ProcessError> {
        let Some(target) = self
            .targets
            .iter()
            .find(|t| t.lock().name() == held.processor)
            .cloned()
        else {
            return Err(ProcessError::Fatal(format!(
                "a record held by processor {} was stored, and this topology has no processor of that name",
                held.processor
            )));
        };
        let token = RecordToken::new(
            Origin::Held {
                id,
                root: Mutex::new(None),
                position: held
                    .position
                    .map(|(source, offset)| Position { source, offset }),
                raw: held.raw.clone().map(Arc::new),
                end_is_effect: false,
            },
            held.stream_time,
            self.ctx.done.clone(),
            self.ctx.abandoned.clone(),
        );
        let content = held.content.clone();
        self.ctx
            .derived
            .restore_held(id, held, Arc::downgrade(&token));
        self.ctx.current = Some(token);
        let result = target.lock().resume(&content, &mut self.ctx);
        let result = self.handle(result);
        self.ctx.current = None;
        result
    }

    /// The slot of an input topic.
    pub(crate) fn slot_of(&self, topic: &str) -> Option<usize> {
        self.slots.iter().position(|s| s.topic == topic)
    }

    /// Processes one input record. Dead letters are queued as output; other
    /// errors are returned and stop the task.
    pub(crate) fn process(&mut self, slot: usize, input: Input<'_>) -> Result<(), ProcessError> {
        // Stream time advances in input order, with every record read,
        // skipped or not, so a record is judged late or not the same way in
        // every run, whatever the completion order or crashes.
        let stream_time_before = self.ctx.stream_time;
        self.ctx.stream_time = self.ctx.stream_time.max(input.timestamp);
        match self.trackers[slot].admit(input.offset) {
            Admission::Process => {}
            Admission::Skip => {
                // Finished before the commit this task restarted from: its
                // state and outputs are in that commit.
                self.ctx.counters.replay_skipped += 1;
                self.trackers[slot].received_finished(input.offset);
                return Ok(());
            }
            Admission::MovedBack { expected } => {
                let s = &self.slots[slot];
                tracing::warn!(
                    task = %self.id, topic = %s.topic, partition = s.partition,
                    offset = input.offset, expected,
                    "the input moved back (an offset reset, or a recreated or truncated topic): processing its records again from here"
                );
            }
        }
        // A record read again after a restart arrives at the stream time it
        // arrived at the first time (so a crash changes no lateness).
        let arrival = self.trackers[slot]
            .restored_arrival(input.offset)
            .unwrap_or(stream_time_before);
        let info = &self.slots[slot];
        let position = Position {
            source: info.source_id,
            offset: input.offset,
        };
        let raw = (info.dead_letter.is_some() || info.internal).then(|| {
            Arc::new(RawRecord {
                topic: info.topic.clone(),
                partition: info.partition,
                offset: input.offset,
                key: input.key.map(<[u8]>::to_vec),
                value: input.value.map(<[u8]>::to_vec),
                timestamp: input.timestamp,
                headers: input.headers.clone(),
            })
        });
        let source = info.source;
        let token = RecordToken::new(
            Origin::Input {
                slot,
                position,
                raw,
            },
            arrival.max(input.timestamp),
            self.ctx.done.clone(),
            self.ctx.abandoned.clone(),
        );
        self.ctx.current = Some(token);
        self.update_closing_time();
        let view = RawView {
            key: input.key,
            value: input.value,
            timestamp: input.timestamp,
            headers: input.headers,
        };
        let result = self.sources[source].process(view, &mut self.ctx);
        let result = self.handle(result);
        // A record nothing holds any more finished synchronously: account for
        // it directly instead of through the channel.
        match self.ctx.current.take().map(Arc::try_unwrap) {
            Some(Ok(token)) => {
                token.finish_silently();
                self.trackers[slot].received_finished(input.offset);
            }
            Some(Err(shared)) => {
                self.trackers[slot].received(input.offset, arrival);
                drop(shared);
            }
            None => self.trackers[slot].received(input.offset, arrival),
        }
        result
    }

    /// Sets the stream time windows may close and expire by: the task's
    /// stream time, held back to just before the oldest record still in
    /// flight (input or derived) arrived, so no window closes while a record
    /// that may still update it is in an async call.
    fn update_closing_time(&mut self) {
        if self.in_flight() > 0 {
            self.drain_done();
        }
        let oldest = self
            .trackers
            .iter()
            .filter_map(OffsetTracker::oldest_in_flight_stream_time)
            .chain(self.ctx.derived.oldest_stream_time())
            .min();
        self.ctx.closing_time =
            oldest.map_or(self.ctx.stream_time, |o| o.min(self.ctx.stream_time));
    }

    /// Handles the completion of an async call.
    pub(crate) fn complete(&mut self, msg: CompletionMsg) -> Result<(), ProcessError> {
        let Some(tokens) = self.ctx.spawner.finish(&msg) else {
            return Ok(());
        };
        if let Some(CallPanicked(message)) = msg.output.downcast_ref::<CallPanicked>() {
            return self.call_panicked(message, tokens);
        }
        let Some(target) = self.targets.get(msg.node).cloned() else {
            return Err(ProcessError::Fatal(format!(
                "completion for unknown node {}",
                msg.node
            )));
        };
        self.ctx.current = (tokens.len() == 1).then(|| tokens[0].clone());
        self.update_closing_time();
        let result = target.lock().complete(msg.output, &mut self.ctx);
        let result = self.handle(result);
        self.ctx.current = None;
        drop(tokens);
        result
    }

    /// Dead-letters the records of a call whose future panicked: the record
    /// it carried, and those its future held (dropped while it unwound,
    /// which happens before its completion is sent).
    fn call_panicked(
        &mut self,
        message: &str,
        carried: Vec<Arc<RecordToken>>,
    ) -> Result<(), ProcessError> {
        self.drain_done();
        let held = std::mem::take(&mut self.panicked);
        tracing::error!(task = %self.id, records = carried.len() + held.len(), panic = message, "an async call panicked: dead-lettering its records");
        for token in carried.into_iter().chain(held) {
            self.ctx.current = Some(token);
            let result = self.ctx.dead_letter("async call panicked", "panic", 1);
            self.ctx.current = None;
            result?;
        }
        Ok(())
    }

    /// See [`handle`].
    fn handle(&mut self, result: Result<(), ProcessError>) -> Result<(), ProcessError> {
        handle(&mut self.ctx, result)
    }

    /// Calls every operator's punctuation.
    pub(crate) fn punctuate(&mut self, wall_clock_ms: i64) -> Result<(), ProcessError> {
        self.ctx.wall_clock_ms = wall_clock_ms;
        self.drain_done();
        self.update_closing_time();
        let p = Punctuation {
            wall_clock_ms,
            stream_time: self.ctx.stream_time,
        };
        for s in &mut self.sources {
            let result = s.punctuate(p, &mut self.ctx);
            handle(&mut self.ctx, result)?;
        }
        Ok(())
    }

    /// Forwards whatever operators hold back until a commit (cached results).
    pub(crate) fn flush(&mut self) -> Result<(), ProcessError> {
        for s in &mut self.sources {
            let result = s.flush(&mut self.ctx);
            handle(&mut self.ctx, result)?;
        }
        Ok(())
    }

    /// Applies finished-record reports.
    pub(crate) fn drain_done(&mut self) {
        while let Ok(done) = self.done_rx.try_recv() {
            match done {
                Done::Finished(Finished::Input(slot, offset)) => {
                    if let Some(t) = self.trackers.get_mut(slot) {
                        t.finished(offset);
                    }
                }
                Done::Finished(Finished::Derived(id)) => self.ctx.derived.finished(id),
                Done::Panicked(token) => self.panicked.push(token),
            }
        }
    }

    /// Records in flight across the task's inputs, and derived records.
    pub(crate) fn in_flight(&self) -> usize {
        self.trackers
            .iter()
            .map(OffsetTracker::in_flight)
            .sum::<usize>()
            + self.ctx.derived.in_flight()
    }

    /// Whether a record of `slot` may be taken under the in-flight bound
    /// `max` (derived records count against every slot).
    pub(crate) fn has_room(&self, slot: usize, max: usize) -> bool {
        self.room(slot, max) > 0
    }

    /// How many more records of `slot` the in-flight bound `max` lets in
    /// (derived records count against every slot).
    pub(crate) fn room(&self, slot: usize, max: usize) -> usize {
        let in_flight = self.trackers[slot].in_flight();
        max.saturating_sub(in_flight.max(self.ctx.derived.in_flight()))
    }

    /// Takes the queued output records.
    pub(crate) fn take_output(&mut self) -> Vec<OutputRecord> {
        std::mem::take(&mut self.ctx.out)
    }

    /// Writes the task's progress record (where each input partition stands:
    /// the offset to commit and which records above it have finished, and
    /// the stream time) into its progress store, and returns the changelog
    /// record for it; `None` when it did not change since the last one.
    /// Under exactly-once it commits with the state it describes; under
    /// at-least-once it is sent after the state's changelog records and
    /// before the offsets, so a crash before the offsets land still leaves a
    /// record saying exactly what the state holds.
    fn write_progress(&mut self) -> Option<ChangelogRecord> {
        let store = self.progress_store?;
        let progress = TaskProgress {
            stream_time: self.ctx.stream_time,
            slots: self
                .slots
                .iter()
                .zip(&self.trackers)
                .filter_map(|(s, t)| t.progress(s.source_id))
                .collect(),
        };
        if self.last_progress.as_ref() == Some(&progress) {
            return None;
        }
        let value = progress.encode();
        self.last_progress = Some(progress);
        let state = self.ctx.state.as_mut()?;
        state.put(store, PROGRESS_KEY.to_vec(), &value);
        Some(ChangelogRecord {
            store,
            key: PROGRESS_KEY.to_vec(),
            value: Some(StoredValue::new(value).encode()),
        })
    }

    /// Writes what changed about derived records since the last commit into
    /// the progress store: those in flight, the removal of those that
    /// finished.
    fn write_derived(&mut self) {
        let changes = self.ctx.derived.take_changes();
        let (Some(store), Some(state)) = (self.progress_store, self.ctx.state.as_mut()) else {
            return;
        };
        for (d, content, stream_time) in changes.put {
            state.put(
                store,
                crate::derived::key(d),
                &to_bincode(&(content, stream_time)),
            );
        }
        for (d, held) in changes.put_held {
            state.put(store, crate::derived::held_key(d), &to_bincode(&held));
        }
        for key in changes.delete {
            state.delete(store, key);
        }
    }

    /// Converts the holds of records whose replay would repeat an effect
    /// into resume points (see `crate::derived`), so that such records
    /// finish in this commit; logs what cannot be converted (at most once
    /// a minute per task).
    fn convert_holds(&mut self) {
        let conversion = self.ctx.derived.convert_holds();
        if conversion.converted > 0 {
            // The roots whose links were cut finish now.
            self.drain_done();
        }
        let lost = self.ctx.derived.unresumable_derived();
        let due = self
            .unresumable_logged
            .is_none_or(|at| at.elapsed() >= std::time::Duration::from_secs(60));
        if (conversion.unresumable > 0 || lost > 0) && due {
            self.unresumable_logged = Some(std::time::Instant::now());
        } else {
            return;
        }
        if conversion.unresumable > 0 {
            tracing::error!(
                task = %self.id,
                records = conversion.unresumable,
                "records with committed effects are held by a processor that cannot resume them (spawn or hold without content): a crash now would make those effects again"
            );
        }
        if lost > 0 {
            tracing::error!(
                task = %self.id,
                records = lost,
                "records a processor derived (from a flush, a punctuation or a batch's completion) are held past a commit by a processor that cannot resume them: a crash now would lose them"
            );
        }
    }

    /// Prepare, the first step of every commit (both guarantees and the
    /// test driver): takes the finished records into account and returns
    /// what the commit covers. Under exactly-once (a commit atomic with its
    /// state) the progress record is among the changelog records; under
    /// at-least-once it is a part of its own, sent after them.
    pub(crate) fn prepare_commit(&mut self, guarantee: Guarantee) -> CommitParts {
        self.drain_done();
        self.ctx.commit_requested = false;
        self.convert_holds();
        self.write_derived();
        let atomic = guarantee == Guarantee::ExactlyOnce;
        if atomic {
            self.write_progress();
        }
        let changelog = self
            .ctx
            .state
            .as_mut()
            .map(TaskState::flush_changelog)
            .unwrap_or_default();
        let offsets = self.offsets_to_commit();
        let progress = if atomic { None } else { self.write_progress() };
        CommitParts {
            changelog,
            progress,
            offsets,
        }
    }

    /// Post-commit, the last step of every commit, once its changelog
    /// records (and, under exactly-once, its transaction) are committed:
    /// writes the state to RocksDB with the changelogs' next offsets
    /// (`changelog_next`) as its checkpoint, and notes the offsets committed.
    pub(crate) fn post_commit(
        &mut self,
        offsets: &[(usize, i64)],
        changelog_next: &HashMap<StoreId, i64>,
    ) -> Result<(), sluice_state::StateError> {
        if let Some(state) = self.ctx.state.as_mut() {
            state.commit_local(changelog_next)?;
        }
        self.mark_committed(offsets);
        Ok(())
    }

    /// Offsets that moved since the last commit: (slot, offset to commit).
    fn offsets_to_commit(&self) -> Vec<(usize, i64)> {
        self.trackers
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.to_commit().map(|o| (i, o)))
            .collect()
    }

    fn mark_committed(&mut self, offsets: &[(usize, i64)]) {
        for (slot, o) in offsets {
            self.trackers[*slot].mark_committed(*o);
        }
    }

    /// Abandons in-flight work: pending async calls are cancelled, and no
    /// record still in flight will ever count as finished, so nothing past the
    /// first of them is committed. The task must be restored afresh to run again.
    /// Returns how many calls it cancelled.
    pub(crate) fn abandon(&mut self) -> usize {
        self.ctx
            .abandoned
            .store(true, std::sync::atomic::Ordering::Release);
        self.ctx.spawner.abort_all()
    }

    /// True once [`TaskCore::abandon`] was called.
    pub(crate) fn is_abandoned(&self) -> bool {
        self.ctx
            .abandoned
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Cuts a dead letter's original bytes (the value's end first, then the
/// key's) so that it fits `max` bytes, the producers' `message.max.bytes`:
/// a record the broker took can be over what the producers may send, and a
/// dead letter that can never be sent would stop its task at every
/// restart. The cut is said in [`dlq_headers::TRUNCATED`].
fn cut_to_fit(letter: &mut OutputRecord, max: usize) {
    let size = crate::context::record_size(letter);
    if size <= max {
        return;
    }
    let len = |b: &Option<Vec<u8>>| b.as_ref().map_or(0, Vec::len);
    let (value_len, key_len) = (len(&letter.value), len(&letter.key));
    // The header's own size, at its longest.
    let header =
        dlq_headers::TRUNCATED.len() + 8 + format!("value={value_len},key={key_len}").len();
    let mut over = size + header - max;
    let mut said = format!("value={value_len}");
    if let Some(v) = letter.value.as_mut() {
        let cut = over.min(v.len());
        v.truncate(v.len() - cut);
        over -= cut;
    }
    if over > 0 {
        if let Some(k) = letter.key.as_mut() {
            let cut = over.min(k.len());
            k.truncate(k.len() - cut);
            over -= cut;
            said.push_str(&format!(",key={key_len}"));
        }
    }
    if over > 0 {
        // What is left are the original record's headers: only the dead
        // letter's own stay.
        letter.headers.retain(|(k, _)| k.starts_with("dlq."));
    }
    letter
        .headers
        .push((dlq_headers::TRUNCATED.to_string(), said.into_bytes()));
}

impl TaskCtx {
    /// Queues the current record's original key, bytes and headers for its
    /// source's dead-letter topic, with the reason headers, stamped with the
    /// time it was dead-lettered.
    pub(crate) fn dead_letter(
        &mut self,
        reason: &str,
        category: &str,
        attempts: u32,
    ) -> Result<(), ProcessError> {
        let Some(token) = self.current.clone() else {
            return Err(ProcessError::Fatal(
                "no current record to dead-letter".into(),
            ));
        };
        let (origin, key, value, mut headers) = match (&token.origin, token.raw()) {
            (_, Some(raw)) => {
                let origin = self.origin_of(raw).ok_or_else(|| {
                    ProcessError::Fatal("its source has no dead-letter topic".into())
                })?;
                (
                    origin,
                    raw.key.clone(),
                    raw.value.clone(),
                    without_origin(&raw.headers),
                )
            }
            // A record an operator derived has no original bytes: its dead
            // letter names the task's input it came from (offset -1) and says
            // what it was.
            (Origin::Derived { id } | Origin::Held { id, .. }, None) => {
                let Some((topic, dead_letter_topic)) = self.derived_dead_letter.clone() else {
                    return Err(ProcessError::Fatal(
                        "no source of its task has a dead-letter topic".into(),
                    ));
                };
                let origin = SourceOrigin {
                    topic,
                    partition: self.task.partition,
                    offset: -1,
                    dead_letter_topic,
                };
                let headers = vec![(
                    dlq_headers::DERIVED.to_string(),
                    format!("task {} record {id}", self.task).into_bytes(),
                )];
                (origin, None, None, headers)
            }
            (Origin::Input { .. }, None) => {
                return Err(ProcessError::Fatal(
                    "its source has no dead-letter topic".into(),
                ))
            }
        };
        let topic = origin.dead_letter_topic.clone();
        let partitions = self.dead_letter_partitions.get(&topic).copied();
        let mut add = |k: &str, v: String| headers.push((k.to_string(), v.into_bytes()));
        add(dlq_headers::REASON, reason.to_string());
        add(dlq_headers::CATEGORY, category.to_string());
        add(dlq_headers::ATTEMPTS, attempts.to_string());
        add(dlq_headers::ORIGINAL_TOPIC, origin.topic.clone());
        add(
            dlq_headers::ORIGINAL_PARTITION,
            origin.partition.to_string(),
        );
        add(dlq_headers::ORIGINAL_OFFSET, origin.offset.to_string());
        let now = chrono::Utc::now();
        add(
            dlq_headers::SENT_AT,
            now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        );
        *self
            .counters
            .dead_lettered
            .entry(category.to_string())
            .or_default() += 1;
        // The same partition number as the original (modulo the dead-letter
        // topic's partitions): a task's writes stay in its own partitions.
        let partition = partitions.filter(|n| *n > 0).map(|n| origin.partition % n);
        let mut letter = OutputRecord {
            topic,
            partition,
            key,
            value,
            // When it was dead-lettered, as `dlq.sent.at`: the topic's
            // retention and look-ups by time (offsets for times) follow
            // that, not the age of the original record.
            timestamp: now.timestamp_millis(),
            headers,
        };
        cut_to_fit(&mut letter, self.max_record_bytes);
        self.mark_effect();
        self.out.push(letter);
        Ok(())
    }

    /// What the current record is, for an error message.
    pub(crate) fn describe_current(&self) -> String {
        match self.current.as_ref().map(|t| &t.origin) {
            Some(Origin::Input { raw: Some(raw), .. } | Origin::Held { raw: Some(raw), .. }) => {
                format!("record {}/{}/{}", raw.topic, raw.partition, raw.offset)
            }
            Some(Origin::Input { position, .. }) => {
                format!("record at offset {} of task {}", position.offset, self.task)
            }
            Some(Origin::Derived { id } | Origin::Held { id, .. }) => {
                format!("derived record {id} of task {}", self.task)
            }
            None => format!("a record of task {}", self.task),
        }
    }

    /// The origin headers a record written to a repartition topic now
    /// carries: those of the current record when it came through a
    /// repartition itself, else the current record's own source when that
    /// has a dead-letter topic (none for records a punctuation emits).
    pub(crate) fn origin_headers(&self, headers: &Headers) -> Headers {
        let mut out = without_origin(headers);
        let current = self.current.as_ref().and_then(|t| t.raw());
        if let Some(o) = current.and_then(|raw| self.origin_of(raw)) {
            o.push_to(&mut out);
        }
        out
    }

    /// Where a record first came from: its own source when that has a
    /// dead-letter topic, else (past a repartition) the origin its headers
    /// carry.
    fn origin_of(&self, raw: &RawRecord) -> Option<SourceOrigin> {
        match self.dead_letter_topics.get(&raw.topic).cloned().flatten() {
            Some(dead_letter_topic) => Some(SourceOrigin {
                topic: raw.topic.clone(),
                partition: raw.partition,
                offset: raw.offset,
                dead_letter_topic,
            }),
            None => SourceOrigin::from_headers(&raw.headers),
        }
    }
}
