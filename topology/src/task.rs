//! A task: the operators of one sub-topology for one partition number, its
//! state, and the offset tracking of its input partitions. The Kafka runtime and
//! the in-process test driver both drive tasks through this type.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use sluice_state::{ChangelogRecord, Position, StoreId, StoredValue, TaskState};

use crate::codec::{from_bincode, to_bincode};
use crate::context::{CompletionMsg, Spawner, TaskCtx};
use crate::node::{CompletionTarget, Punctuation};
use crate::offsets::{OffsetTracker, RecordToken, SlotProgress};
use crate::record::{Headers, OutputRecord, RawRecord};
use crate::topology::{RawView, SourceNode, SubTopology};
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
struct Origin {
    topic: String,
    partition: i32,
    offset: i64,
    dead_letter_topic: String,
}

impl Origin {
    fn from_headers(headers: &Headers) -> Option<Origin> {
        let get = |k: &str| {
            headers
                .iter()
                .rev()
                .find(|(h, _)| h == k)
                .and_then(|(_, v)| String::from_utf8(v.clone()).ok())
        };
        Some(Origin {
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

/// Identifies a task: sub-topology and partition number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId {
    /// The sub-topology.
    pub subtopology: u32,
    /// The partition number of its input topics.
    pub partition: i32,
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}_{}", self.subtopology, self.partition)
    }
}

/// Stable id of a source topic, stamped into state positions (FNV-1a).
pub fn source_id(topic: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in topic.as_bytes() {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h & 0x7fff_ffff
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
    done_tx: Sender<(usize, i64)>,
    done_rx: Receiver<(usize, i64)>,
    replay_until: rustc_hash::FxHashMap<u32, i64>,
    /// Per slot, the progress of the commit this task restarted from: records
    /// it names finished are skipped.
    resume: Vec<Option<SlotProgress>>,
    /// The store the task's progress record lives in.
    progress_store: Option<StoreId>,
    /// The progress record last written (an unchanged one is not written
    /// again: a long call holding the offset back costs no transaction).
    last_progress: Vec<u8>,
    /// An async call completed in this task: records may finish out of
    /// order, and replayed records may be in flight while others write, so
    /// per-value positions alone cannot say what state reflects; every commit
    /// that moves the offsets writes a progress record.
    asynchronous: bool,
    abandoned: Arc<std::sync::atomic::AtomicBool>,
}

/// What one commit of a task covers, taken at one instant: the changelog
/// records of the state changed since the last commit (with the progress
/// record when asked for) and the offsets to commit.
pub(crate) struct PreparedCommit {
    pub(crate) changelog: Vec<ChangelogRecord>,
    pub(crate) offsets: Vec<(usize, i64)>,
}

/// The key of a task's progress record in its progress store.
const PROGRESS_KEY: &[u8] = b"progress";

impl TaskCore {
    /// Instantiates the operators of `sub` for `partition` over restored `state`.
    pub(crate) fn new(
        sub: &SubTopology,
        partition: i32,
        app_id: &str,
        state: Option<TaskState>,
        runtime: tokio::runtime::Handle,
        completions: Sender<CompletionMsg>,
        dlq_partitions: &HashMap<String, i32>,
    ) -> Result<TaskCore, TopologyError> {
        let id = TaskId {
            subtopology: sub.id as u32,
            partition,
        };
        let replay_until = state
            .as_ref()
            .map(|s| s.reflected_positions().clone())
            .unwrap_or_default();
        let ctx = TaskCtx::new(id, state, Spawner::new(runtime, completions, id));
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
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let mut ctx = ctx;
        ctx.dead_letter_topics = slots
            .iter()
            .map(|s| (s.topic.clone(), s.dead_letter.clone()))
            .collect();
        ctx.dead_letter_partitions = dlq_partitions.clone();
        let progress_store = ctx.store(&crate::Topology::progress_store(sub.id));
        let restored: Vec<SlotProgress> = match (progress_store, ctx.state.as_ref()) {
            (Some(store), Some(state)) => match state.get(store, PROGRESS_KEY)? {
                Some(stored) => from_bincode(&stored.value).map_err(|e| {
                    TopologyError::Invalid(format!("task {id}: corrupt progress record: {e}"))
                })?,
                None => Vec::new(),
            },
            _ => Vec::new(),
        };
        let resume = slots
            .iter()
            .map(|s| restored.iter().find(|p| p.source == s.source_id).cloned())
            .collect();
        let mut task = TaskCore {
            id,
            ctx,
            sources: instance.sources,
            targets: instance.targets,
            trackers: slots.iter().map(|_| OffsetTracker::default()).collect(),
            slots,
            done_tx,
            done_rx,
            replay_until,
            resume,
            progress_store,
            last_progress: Vec::new(),
            asynchronous: false,
            abandoned: Default::default(),
        };
        for t in task.targets.clone() {
            t.lock().init(&mut task.ctx).map_err(|e| {
                TopologyError::Invalid(format!("processor init failed in task {id}: {e}"))
            })?;
        }
        Ok(task)
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
        // Below the offset this task committed, and below the next it has
        // not read, every record was received by this very task (finished,
        // or still in flight here): one delivered again (a committed offset
        // lagging an applied-late commit, a fetch before a resumed task's
        // seek) must not run twice.
        if self.trackers[slot]
            .next_to_read()
            .is_some_and(|n| input.offset < n)
        {
            self.ctx.counters.replay_skipped += 1;
            return Ok(());
        }
        let info = &self.slots[slot];
        let position = Position {
            source: info.source_id,
            offset: input.offset,
        };
        let replay = match &self.resume[slot] {
            // Finished before the commit this task restarted from: its state
            // and outputs are in that commit.
            Some(p) if p.finished(input.offset) => {
                self.ctx.counters.replay_skipped += 1;
                self.trackers[slot].received_finished(input.offset);
                return Ok(());
            }
            // Anything else may be reflected in restored state only when it
            // ran ahead of the progress record: an at-least-once instance
            // died between a commit's changelog writes and its offsets, or a
            // broker exposed a transaction that never committed. The
            // per-value positions then say which records a value reflects
            // (never one that had not finished when it was written).
            _ => self
                .replay_until
                .get(&info.source_id)
                .is_some_and(|until| input.offset <= *until),
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
            slot,
            position,
            raw,
            replay,
            self.ctx.stream_time,
            self.done_tx.clone(),
            self.abandoned.clone(),
        );
        self.ctx.current = Some(token);
        self.set_write_floor(slot, input.offset);
        self.update_closing_time();
        let view = RawView {
            key: input.key,
            value: input.value,
            timestamp: input.timestamp,
            headers: input.headers,
        };
        let result = self.sources[source].process(view, &mut self.ctx);
        let result = self.handle(result, slot, input.offset);
        // A record nothing holds any more finished synchronously: account for
        // it directly instead of through the channel.
        match self.ctx.current.take().map(Arc::try_unwrap) {
            Some(Ok(token)) => {
                token.finish_silently();
                self.trackers[slot].received_finished(input.offset);
            }
            Some(Err(shared)) => {
                self.trackers[slot].received(input.offset, stream_time_before);
                drop(shared);
            }
            None => self.trackers[slot].received(input.offset, stream_time_before),
        }
        result
    }

    /// Sets the stream time windows may close and expire by: the task's
    /// stream time, held back to just before the oldest record still in
    /// flight arrived, so no window closes while a record that may still
    /// update it is in an async call.
    fn update_closing_time(&mut self) {
        if self.trackers.iter().any(|t| t.in_flight() > 0) {
            self.drain_done();
        }
        let oldest = self
            .trackers
            .iter()
            .filter_map(OffsetTracker::oldest_in_flight_stream_time)
            .min();
        self.ctx.closing_time =
            oldest.map_or(self.ctx.stream_time, |o| o.min(self.ctx.stream_time));
    }

    /// Handles the completion of an async call.
    pub(crate) fn complete(&mut self, msg: CompletionMsg) -> Result<(), ProcessError> {
        let Some(tokens) = self.ctx.spawner.finish(msg.call) else {
            return Ok(());
        };
        self.asynchronous = true;
        let Some(target) = self.targets.get(msg.node).cloned() else {
            return Err(ProcessError::Fatal(format!(
                "completion for unknown node {}",
                msg.node
            )));
        };
        let (slot, offset) = tokens
            .first()
            .map(|t| (t.slot, t.position.offset))
            .unwrap_or((usize::MAX, -1));
        self.ctx.current = (tokens.len() == 1).then(|| tokens[0].clone());
        if slot != usize::MAX {
            self.set_write_floor(slot, offset);
        }
        self.update_closing_time();
        let result = target.lock().complete(msg.output, &mut self.ctx);
        let result = self.handle(result, slot, offset);
        self.ctx.current = None;
        drop(tokens);
        result
    }

    /// Tells the state what the writes of the record at `offset` of `slot`
    /// may claim: every record of the slot below the lowest unfinished one
    /// (or below this one) has finished. Finished reports not drained yet
    /// only make the floor lower, never wrong.
    fn set_write_floor(&mut self, slot: usize, offset: i64) {
        if let Some(state) = self.ctx.state.as_mut() {
            let lowest = self.trackers[slot].committable().unwrap_or(offset);
            state.set_write_floor(lowest.min(offset) - 1);
        }
    }

    fn handle(
        &mut self,
        result: Result<(), ProcessError>,
        slot: usize,
        offset: i64,
    ) -> Result<(), ProcessError> {
        match result {
            Err(ProcessError::DeadLetter { reason, category }) => self
                .ctx
                .dead_letter(&reason, &category, 1)
                .map_err(|e| match self.slots.get(slot) {
                    Some(s) => ProcessError::Fatal(format!(
                        "record {}/{}/{offset} must be dead-lettered ({reason}) but: {e}",
                        s.topic, s.partition
                    )),
                    None => e,
                }),
            other => other,
        }
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
            s.punctuate(p, &mut self.ctx)?;
        }
        Ok(())
    }

    /// Forwards whatever operators hold back until a commit (cached results).
    pub(crate) fn flush(&mut self) -> Result<(), ProcessError> {
        for s in &mut self.sources {
            s.flush(&mut self.ctx)?;
        }
        Ok(())
    }

    /// Applies finished-record reports to the offset trackers.
    pub(crate) fn drain_done(&mut self) {
        while let Ok((slot, offset)) = self.done_rx.try_recv() {
            if let Some(t) = self.trackers.get_mut(slot) {
                t.finished(offset);
            }
        }
    }

    /// Records in flight across the task's inputs.
    pub(crate) fn in_flight(&self) -> usize {
        self.trackers.iter().map(OffsetTracker::in_flight).sum()
    }

    /// Takes the queued output records.
    pub(crate) fn take_output(&mut self) -> Vec<OutputRecord> {
        std::mem::take(&mut self.ctx.out)
    }

    /// Writes the task's progress record (the offsets to commit and which
    /// records above them have finished) into its progress store, and returns
    /// the changelog record for it. Written when some record above the
    /// offsets finished (the offsets alone would understate the commit), and
    /// whenever the offsets move in a task with async calls or merged inputs
    /// (one position per value cannot speak for several partitions) or, with
    /// `with_offsets`, in any task (a commit that is atomic with its state:
    /// the record then supersedes the per-value positions for everything
    /// below its end, whatever the group's offsets say). Call right before
    /// taking the offsets to commit.
    pub(crate) fn write_progress(&mut self, with_offsets: bool) -> Option<ChangelogRecord> {
        let store = self.progress_store?;
        let progress: Vec<SlotProgress> = self
            .slots
            .iter()
            .zip(&self.trackers)
            .filter_map(|(s, t)| t.progress(s.source_id))
            .collect();
        let needed = progress.iter().any(|p| !p.is_prefix())
            || ((with_offsets || self.asynchronous || self.slots.len() > 1)
                && !self.offsets_to_commit().is_empty());
        if !needed {
            return None;
        }
        let value = to_bincode(&progress);
        if value == self.last_progress {
            return None;
        }
        self.last_progress.clone_from(&value);
        let state = self.ctx.state.as_mut()?;
        state.put(store, PROGRESS_KEY.to_vec(), &value, None);
        Some(ChangelogRecord {
            store,
            key: PROGRESS_KEY.to_vec(),
            value: Some(StoredValue::in_order(None, value).encode()),
        })
    }

    /// First step of every commit (both guarantees and the test driver):
    /// takes the finished records into account and returns what the commit
    /// covers. With `with_progress` (a commit atomic with its state) the
    /// progress record is among the changelog records.
    pub(crate) fn prepare_commit(&mut self, with_progress: bool) -> PreparedCommit {
        self.drain_done();
        self.ctx.commit_requested = false;
        if with_progress {
            self.write_progress(true);
        }
        PreparedCommit {
            changelog: self
                .ctx
                .state
                .as_mut()
                .map(TaskState::flush_changelog)
                .unwrap_or_default(),
            offsets: self.offsets_to_commit(),
        }
    }

    /// Last step of every commit, once its changelog records (and, under
    /// exactly-once, its transaction) are committed: writes the state to
    /// RocksDB with the changelogs' next offsets (`changelog_next`) as its
    /// checkpoint, and notes the offsets committed.
    pub(crate) fn finish_commit(
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
    pub(crate) fn offsets_to_commit(&self) -> Vec<(usize, i64)> {
        self.trackers
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.to_commit().map(|o| (i, o)))
            .collect()
    }

    pub(crate) fn mark_committed(&mut self, offsets: &[(usize, i64)]) {
        for (slot, o) in offsets {
            self.trackers[*slot].mark_committed(*o);
        }
    }

    /// Abandons in-flight work: pending async calls are cancelled, and no
    /// record still in flight will ever count as finished, so nothing past the
    /// first of them is committed. The task must be restored afresh to run again.
    pub(crate) fn abandon(&mut self) {
        self.abandoned
            .store(true, std::sync::atomic::Ordering::Release);
        self.ctx.spawner.abort_all();
    }

    /// True once [`TaskCore::abandon`] was called.
    pub(crate) fn is_abandoned(&self) -> bool {
        self.abandoned.load(std::sync::atomic::Ordering::Acquire)
    }
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
        let Some(raw) = token.raw.as_ref() else {
            return Err(ProcessError::Fatal(
                "its source has no dead-letter topic".into(),
            ));
        };
        let origin = self
            .origin_of(raw)
            .ok_or_else(|| ProcessError::Fatal("its source has no dead-letter topic".into()))?;
        let topic = origin.dead_letter_topic.clone();
        let partitions = self.dead_letter_partitions.get(&topic).copied();
        let mut headers = without_origin(&raw.headers);
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
        self.out.push(OutputRecord {
            topic,
            partition,
            key: raw.key.clone(),
            value: raw.value.clone(),
            // When it was dead-lettered, as `dlq.sent.at`: the topic's
            // retention and look-ups by time (offsets for times) follow
            // that, not the age of the original record.
            timestamp: now.timestamp_millis(),
            headers,
        });
        Ok(())
    }

    /// The origin headers a record written to a repartition topic now
    /// carries: those of the current record when it came through a
    /// repartition itself, else the current record's own source when that
    /// has a dead-letter topic (none for records a punctuation emits).
    pub(crate) fn origin_headers(&self, headers: &Headers) -> Headers {
        let mut out = without_origin(headers);
        let current = self.current.as_ref().and_then(|t| t.raw.as_ref());
        if let Some(o) = current.and_then(|raw| self.origin_of(raw)) {
            o.push_to(&mut out);
        }
        out
    }

    /// Where a record first came from: its own source when that has a
    /// dead-letter topic, else (past a repartition) the origin its headers
    /// carry.
    fn origin_of(&self, raw: &RawRecord) -> Option<Origin> {
        match self.dead_letter_topics.get(&raw.topic).cloned().flatten() {
            Some(dead_letter_topic) => Some(Origin {
                topic: raw.topic.clone(),
                partition: raw.partition,
                offset: raw.offset,
                dead_letter_topic,
            }),
            None => Origin::from_headers(&raw.headers),
        }
    }
}
