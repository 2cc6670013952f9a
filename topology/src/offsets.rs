//! Tracking which input records are finished, so that only the contiguous
//! prefix of finished records is ever committed, however out of order async
//! operators complete; the progress record that tells a restarted task which
//! records above its committed offset a commit already covered; and the one
//! decision, per input record, whether to process it or skip it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crossbeam_channel::Sender;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sluice_state::Position;

use crate::codec::from_bincode;

/// What a record token stands for.
pub(crate) enum Origin {
    /// An input record: its slot (source partition within the task), its
    /// position, and its original bytes when its source has a dead-letter
    /// topic.
    Input {
        slot: usize,
        position: Position,
        raw: Option<Arc<crate::RawRecord>>,
    },
    /// A record an operator derived (an aggregation's result, what a flush
    /// or a punctuation forwarded): its id among the task's derived records.
    Derived { id: u64 },
    /// A record a processor holds resumably (see `crate::derived`): its id
    /// among the task's derived records, the record it holds (its root,
    /// kept in flight through this link until a commit converts the hold
    /// into a resume point of its own), and the root's position and
    /// original bytes, for dead letters.
    Held {
        id: u64,
        root: Mutex<Option<Arc<RecordToken>>>,
        position: Option<Position>,
        raw: Option<Arc<crate::RawRecord>>,
        /// Its end counts as an effect of its root: a hold a processor
        /// keeps ([`InFlight`]) may have been forwarded without being
        /// current (from a flush or a batch's completion). A call's hold is
        /// current in `complete`, so its effects are seen as they happen.
        end_is_effect: bool,
    },
}

/// What the task learns when the last clone of a token is dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finished {
    /// An input record of a slot, by offset.
    Input(usize, i64),
    /// A derived record, by id.
    Derived(u64),
}

/// What a dropped token tells its task.
pub(crate) enum Done {
    /// The record is finished.
    Finished(Finished),
    /// An async call's future panicked while it held the record: the task
    /// dead-letters it (the token keeps it in flight until then), never
    /// counts it as handled.
    Panicked(Arc<RecordToken>),
}

/// Keeps one record "in flight" while alive. Clones travel with the record
/// through operators (and async calls); when the last one is dropped the
/// record is finished and reported to its task.
pub struct RecordToken {
    pub(crate) origin: Origin,
    /// The task's stream time once this record arrived (input order): the
    /// time its lateness is judged by, however late its async call ends.
    pub(crate) stream_time: i64,
    done: Sender<Done>,
    silent: bool,
    /// Set once the record had an effect (an output, a dead letter, a store
    /// write), here or in a record held for it: from then on a replay of it
    /// would make that effect again, so a commit that leaves it unfinished
    /// converts its holds into resume points (see `crate::derived`).
    effects: AtomicBool,
    /// Set when the task abandoned its in-flight work: such records must
    /// stay unfinished so their offsets are never committed.
    abandoned: Arc<AtomicBool>,
}

impl RecordToken {
    /// Finishes the record without reporting it over the channel (the caller
    /// updates the tracker itself).
    pub(crate) fn finish_silently(mut self) {
        self.silent = true;
    }

    pub(crate) fn new(
        origin: Origin,
        stream_time: i64,
        done: Sender<Done>,
        abandoned: Arc<AtomicBool>,
    ) -> Arc<Self> {
        Arc::new(RecordToken {
            origin,
            stream_time,
            done,
            silent: false,
            effects: AtomicBool::new(false),
            abandoned,
        })
    }

    /// The record a replay of this one starts from: the record it holds
    /// while linked, else itself.
    pub(crate) fn root(self: &Arc<Self>) -> Arc<RecordToken> {
        match &self.origin {
            Origin::Held { root, .. } => root.lock().clone().unwrap_or_else(|| self.clone()),
            _ => self.clone(),
        }
    }

    /// Notes an effect of this record (on its root, which a replay would
    /// run again).
    pub(crate) fn mark_effect(&self) {
        if let Origin::Held { root, .. } = &self.origin {
            if let Some(r) = root.lock().as_ref() {
                r.effects.store(true, Ordering::Relaxed);
                return;
            }
        }
        self.effects.store(true, Ordering::Relaxed);
    }

    /// Whether the record had an effect (see [`RecordToken::mark_effect`]).
    pub(crate) fn had_effects(&self) -> bool {
        self.effects.load(Ordering::Relaxed)
    }

    /// The input position, for an input record.
    pub(crate) fn position(&self) -> Option<Position> {
        match &self.origin {
            Origin::Input { position, .. } => Some(*position),
            Origin::Held { position, .. } => *position,
            Origin::Derived { .. } => None,
        }
    }

    /// The original record, for an input record whose source keeps it.
    pub(crate) fn raw(&self) -> Option<&Arc<crate::RawRecord>> {
        match &self.origin {
            Origin::Input { raw, .. } | Origin::Held { raw, .. } => raw.as_ref(),
            Origin::Derived { .. } => None,
        }
    }

    fn finished(&self) -> Finished {
        match &self.origin {
            Origin::Input { slot, position, .. } => Finished::Input(*slot, position.offset),
            Origin::Derived { id } | Origin::Held { id, .. } => Finished::Derived(*id),
        }
    }
}

impl Drop for RecordToken {
    fn drop(&mut self) {
        // A kept hold that ends counts as an effect of its root: what its
        // processor did with the record may have left the task without the
        // record being current (forwarded from a flush or a batch's
        // completion), and a replay of the root would do it again.
        if let Origin::Held {
            root,
            end_is_effect: true,
            ..
        } = &mut self.origin
        {
            if let Some(r) = root.get_mut().as_ref() {
                r.effects.store(true, Ordering::Relaxed);
            }
        }
        if self.silent || self.abandoned.load(Ordering::Acquire) {
            return;
        }
        // The receiver lives as long as the task; a closed task ignores this.
        if std::thread::panicking() {
            // Dropped while a call's future unwinds: the record was not
            // handled. A token of its own carries it to the task.
            let token = RecordToken {
                origin: std::mem::replace(&mut self.origin, Origin::Derived { id: u64::MAX }),
                stream_time: self.stream_time,
                done: self.done.clone(),
                silent: false,
                effects: AtomicBool::new(self.had_effects()),
                abandoned: self.abandoned.clone(),
            };
            if let Err(crossbeam_channel::SendError(Done::Panicked(token))) =
                self.done.send(Done::Panicked(Arc::new(token)))
            {
                // No task to tell (it is gone): the token must not try again.
                if let Ok(mut token) = Arc::try_unwrap(token) {
                    token.silent = true;
                }
            }
            return;
        }
        let _ = self.done.send(Done::Finished(self.finished()));
    }
}

/// A record kept in flight by an operator that holds it for later (a
/// micro-batcher, an async call). Dropping it finishes the record.
#[derive(Clone)]
pub struct InFlight(pub(crate) Arc<RecordToken>);

impl InFlight {
    /// The input position of the record (`None` for a record an operator
    /// derived, such as an aggregation's result).
    pub fn position(&self) -> Option<Position> {
        self.0.position()
    }
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0.origin {
            Origin::Input { position, .. } => write!(f, "InFlight({position:?})"),
            Origin::Derived { id } | Origin::Held { id, .. } => {
                write!(f, "InFlight(derived {id})")
            }
        }
    }
}

/// Where reading a partition starts when its task starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StartAt {
    /// At the group's committed offset.
    Committed(i64),
    /// The group has no committed offset: at the reset policy's end.
    Reset,
    /// Not known (the committed offsets could not be looked up).
    Unknown,
}

/// What to do with an input record (see [`OffsetTracker::admit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Process it.
    Process,
    /// Its effects are in the commit this task restarted from: skip it.
    Skip,
    /// It lies below what this task already read: the consumer was moved
    /// back (an offset reset, a recreated or truncated topic). Its progress
    /// is forgotten and the record is processed.
    MovedBack {
        /// The first offset this task had not read.
        expected: i64,
    },
}

/// Offsets of one input partition: received, finished, committable, and the
/// progress of the commit the task restarted from, until it has passed it.
#[derive(Debug, Default)]
pub struct OffsetTracker {
    /// Unfinished offsets, each with the task's stream time before it arrived.
    in_flight: BTreeMap<i64, i64>,
    /// Next offset after the highest received.
    next_received: Option<i64>,
    /// The offset last committed (next to read), or where reading started.
    committed: Option<i64>,
    /// The progress record this task restarted from, while the task has not
    /// read past its end: the records it names finished are skipped, and the
    /// task's own progress records keep everything it says until then.
    resume: Option<SlotProgress>,
}

impl OffsetTracker {
    /// A tracker for a partition whose reading starts at `start`, restarting
    /// from `restored` (the progress of the task's last commit). The
    /// restored progress counts only when the group's offset is where that
    /// commit left it (or, under at-least-once, where it was before: the
    /// progress record is written before the offsets). Anywhere else, or
    /// with no committed offset at all, the offsets were moved on purpose (a
    /// reset, a recreated topic): the progress is dropped, every record from
    /// the start is processed again, and the warning returned says so.
    pub(crate) fn restarting(
        start: StartAt,
        restored: Option<SlotProgress>,
    ) -> (OffsetTracker, Option<String>) {
        let mut warning = None;
        let resume = match (restored, start) {
            // Where the restored commit left it, or past all it says.
            (Some(p), StartAt::Committed(s)) if s == p.committed || s == p.previous => Some(p),
            (Some(p), StartAt::Committed(s)) if s >= p.end => None,
            // At-least-once, its first commit: the offsets never landed.
            (Some(p), StartAt::Reset) if p.previous < 0 => Some(p),
            (Some(p), StartAt::Committed(s)) => {
                warning = Some(format!(
                    "reading starts at offset {s}, but the task's last commit left it at {} \
                     (records up to {} processed): the offsets were moved (a reset); every \
                     record from {s} on is processed again",
                    p.committed, p.end
                ));
                None
            }
            (Some(p), StartAt::Reset) => {
                warning = Some(format!(
                    "the group has no committed offset here, but the task's last commit left \
                     it at {}: the offsets were deleted or the topic recreated; every record \
                     is processed again from the reset position",
                    p.committed
                ));
                None
            }
            (p, _) => p,
        };
        let tracker = OffsetTracker {
            committed: match start {
                StartAt::Committed(s) => Some(s),
                _ => None,
            },
            resume,
            ..OffsetTracker::default()
        };
        (tracker, warning)
    }

    /// Where reading starts, learnt after the task started (its partition
    /// was assigned after the others): judged as [`OffsetTracker::restarting`]
    /// judges it, while nothing was read here. Returns its warning.
    pub(crate) fn starting_at(&mut self, start: StartAt) -> Option<String> {
        if self.next_received.is_some() || self.committed.is_some() || !self.in_flight.is_empty() {
            return None;
        }
        let (tracker, warning) = Self::restarting(start, self.resume.take());
        *self = tracker;
        warning
    }

    /// Decides what to do with the record at `offset`: the one place that
    /// decides whether a record is applied or skipped.
    pub(crate) fn admit(&mut self, offset: i64) -> Admission {
        if let Some(n) = self.next_received.filter(|n| offset < *n) {
            // Every record below `n` was received by this very task. The
            // consumer delivers one again only when its position was moved
            // back (a reset while running, an out-of-range reset after the
            // topic was recreated or truncated): what was read before says
            // nothing about these records any more.
            self.resume = None;
            self.next_received = None;
            return Admission::MovedBack { expected: n };
        }
        match &self.resume {
            Some(p) if p.finished(offset) => Admission::Skip,
            _ => Admission::Process,
        }
    }

    /// A record was received (and stays in flight); `stream_time` is the
    /// task's stream time before it arrived.
    pub fn received(&mut self, offset: i64, stream_time: i64) {
        self.in_flight.insert(offset, stream_time);
        self.advance(offset);
    }

    /// A record is finished.
    pub fn finished(&mut self, offset: i64) {
        self.in_flight.remove(&offset);
    }

    /// A record was received and finished at once (synchronous processing,
    /// or skipped).
    pub fn received_finished(&mut self, offset: i64) {
        self.advance(offset);
    }

    fn advance(&mut self, offset: i64) {
        let next = self.next_received.map_or(offset + 1, |n| n.max(offset + 1));
        self.next_received = Some(next);
        // Past the restored progress's end, it has nothing more to say.
        if self.resume.as_ref().is_some_and(|p| next >= p.end) {
            self.resume = None;
        }
    }

    /// The stream time before the oldest unfinished record arrived: no record
    /// still in flight was judged against an earlier one. Records of the
    /// restored progress not read again yet count as in flight: a window
    /// they may still update stays open until they are read again.
    pub(crate) fn oldest_in_flight_stream_time(&self) -> Option<i64> {
        let own = self.in_flight.first_key_value().map(|(_, st)| *st);
        let restored = self.restored_unfinished().map(|(_, arrived)| arrived).min();
        own.into_iter().chain(restored).min()
    }

    /// The stream time before the record at `offset` arrived the first time,
    /// when the restored progress names it unfinished: read again, it is
    /// judged as it was then, not by the stream time the task restarted
    /// with (so a crash never changes which records are late).
    pub(crate) fn restored_arrival(&self, offset: i64) -> Option<i64> {
        let p = self.resume.as_ref()?;
        let i = p.unfinished.binary_search(&offset).ok()?;
        p.arrived.get(i).copied()
    }

    /// Records received and not finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The offset to commit: the lowest unfinished offset (records of the
    /// restored progress not read again yet count as they were), or past the
    /// highest received. `None` when nothing was received or restored.
    pub fn committable(&self) -> Option<i64> {
        let own = self.in_flight.first_key_value().map(|(o, _)| *o);
        let restored = self.restored_unfinished().next().map(|(o, _)| o);
        match (own, restored) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (Some(a), None) | (None, Some(a)) => Some(a),
            (None, None) => self.end(),
        }
    }

    /// Unfinished offsets of the restored progress this task has not read
    /// again yet, ascending, each with the stream time before it arrived.
    fn restored_unfinished(&self) -> impl Iterator<Item = (i64, i64)> + '_ {
        let from = self.next_received.unwrap_or(i64::MIN);
        self.resume.iter().flat_map(move |p| {
            p.unfinished
                .iter()
                .copied()
                .zip(p.arrived.iter().copied())
                .filter(move |(o, _)| *o >= from)
        })
    }

    /// Past the highest offset received, or named by the restored progress.
    fn end(&self) -> Option<i64> {
        match (self.next_received, self.resume.as_ref().map(|p| p.end)) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// The committable offset if it moved since the last commit.
    pub fn to_commit(&self) -> Option<i64> {
        let c = self.committable()?;
        (self.committed != Some(c)).then_some(c)
    }

    /// The first offset this task has not read: past the highest received,
    /// and never below its commit. Every record below it was received by
    /// this very task (finished, or still in flight here).
    pub fn next_to_read(&self) -> Option<i64> {
        match (self.next_received, self.committed) {
            (Some(n), Some(c)) => Some(n.max(c)),
            (n, c) => n.or(c),
        }
    }

    /// The offset this task last committed, if any.
    pub fn last_committed(&self) -> Option<i64> {
        self.committed
    }

    /// Records that `offset` was committed.
    pub fn mark_committed(&mut self, offset: i64) {
        self.committed = Some(offset);
    }

    /// Where this partition stands for a commit now: the offset to commit,
    /// and which records above it are finished, keeping what the restored
    /// progress says about records not read again yet (`None` before any
    /// record and without restored progress).
    pub(crate) fn progress(&self, source: u32) -> Option<SlotProgress> {
        let end = self.end()?;
        // Offsets this task read (in flight here) lie below those of the
        // restored progress it has not read again: the two never overlap.
        let (unfinished, arrived): (Vec<i64>, Vec<i64>) = self
            .in_flight
            .iter()
            .map(|(o, st)| (*o, *st))
            .chain(self.restored_unfinished())
            .unzip();
        Some(SlotProgress {
            source,
            committed: unfinished.first().copied().unwrap_or(end),
            previous: self.committed.unwrap_or(-1),
            end,
            unfinished,
            arrived,
        })
    }
}

/// Where one input partition of a task stood at a commit. Records between
/// the committed offset and `end` that are not `unfinished` had finished:
/// their effects (state and outputs) are in that commit, so a task restarted
/// from it must neither apply nor emit them again, and must process every
/// other record. Kept in the task's changelogged progress store, written in
/// the same commit as the effects it describes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SlotProgress {
    /// Stable id of the source topic (the partition is the task's).
    pub(crate) source: u32,
    /// The offset committed: every record below it had finished.
    pub(crate) committed: i64,
    /// The offset committed before this commit (-1: none).
    pub(crate) previous: i64,
    /// Past the highest offset received before the commit.
    pub(crate) end: i64,
    /// Offsets in `[committed, end)` still in flight at the commit, ascending.
    pub(crate) unfinished: Vec<i64>,
    /// For each of `unfinished`, the task's stream time before it arrived
    /// (what its lateness is judged by when it is read again).
    pub(crate) arrived: Vec<i64>,
}

impl SlotProgress {
    /// True when the record at `offset` had finished before the commit.
    pub(crate) fn finished(&self, offset: i64) -> bool {
        offset < self.committed
            || (offset < self.end && self.unfinished.binary_search(&offset).is_err())
    }
}

/// A task's progress record: where each input partition stood at a commit,
/// and the task's stream time then.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TaskProgress {
    /// The highest record timestamp the task had seen.
    pub(crate) stream_time: i64,
    /// Per input partition (those that had received something).
    pub(crate) slots: Vec<SlotProgress>,
}

/// The first byte of an encoded progress record (format version): since
/// 2026-12-07 with each unfinished record's arrival stream time.
const PROGRESS_FORMAT: u8 = 0xF3;

/// The format before: no arrival stream times (records read again arrive at
/// the stream time the task restarted with, as they did then).
const PROGRESS_FORMAT_V2: u8 = 0xF2;

/// The largest `max_in_flight_per_partition`: a commit's progress record
/// names a partition's unfinished records (and those its restored record
/// still names), so this bounds it (a few bytes per run of unfinished
/// offsets, far below a broker's message size).
pub const MAX_IN_FLIGHT_PER_PARTITION: usize = 10_000;

/// The most unfinished offsets a progress record may name, over all its
/// slots: each slot names at most a partition's records in flight (and those
/// its restored record still named), so more is corruption.
const MAX_UNFINISHED: u64 = 100 * MAX_IN_FLIGHT_PER_PARTITION as u64;

/// The progress record as stored: unfinished offsets as runs relative to the
/// committed offset, so a record stays a few bytes per run of unfinished
/// records however far apart they lie (bincode's variable-length integers).
#[derive(Serialize, Deserialize)]
struct TaskProgressWire {
    stream_time: i64,
    slots: Vec<SlotProgressWire>,
}

#[derive(Serialize, Deserialize)]
struct SlotProgressWire {
    source: u32,
    committed: i64,
    previous: i64,
    /// `end - committed`.
    span: u64,
    /// Runs of unfinished offsets: (gap after the previous run's end, or
    /// after `committed` for the first; length).
    runs: Vec<(u64, u64)>,
    /// The unfinished records' arrival stream times, one per offset in
    /// order: the first as `stream_time - arrived`, each next as its
    /// difference from the one before (nearly always small: they arrived in
    /// offset order), wrapping, so every value reads back exactly.
    arrived: Vec<i64>,
}

/// A slot of the second format (no arrival times).
#[derive(Serialize, Deserialize)]
struct SlotProgressWireV2 {
    source: u32,
    committed: i64,
    previous: i64,
    span: u64,
    runs: Vec<(u64, u64)>,
}

#[derive(Deserialize)]
struct TaskProgressWireV2 {
    stream_time: i64,
    slots: Vec<SlotProgressWireV2>,
}

/// The first progress record format: a list of slots with every unfinished
/// offset (no stream time, no previous offset).
#[derive(Deserialize)]
struct SlotProgressV1 {
    source: u32,
    committed: i64,
    end: i64,
    unfinished: Vec<i64>,
}

impl TaskProgress {
    /// Encodes the record (see [`TaskProgressWire`]).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let slots = self
            .slots
            .iter()
            .map(|s| {
                let mut runs: Vec<(u64, u64)> = Vec::new();
                let mut cursor = s.committed;
                let mut run: Option<(i64, u64)> = None;
                for &o in &s.unfinished {
                    match &mut run {
                        Some((start, len)) if *start + *len as i64 == o => *len += 1,
                        _ => {
                            if let Some((start, len)) = run.take() {
                                runs.push(((start - cursor) as u64, len));
                                cursor = start + len as i64;
                            }
                            run = Some((o, 1));
                        }
                    }
                }
                if let Some((start, len)) = run {
                    runs.push(((start - cursor) as u64, len));
                }
                let mut before = self.stream_time;
                let arrived = s
                    .arrived
                    .iter()
                    .enumerate()
                    .map(|(i, a)| {
                        let delta = match i {
                            0 => self.stream_time.wrapping_sub(*a),
                            _ => a.wrapping_sub(before),
                        };
                        before = *a;
                        delta
                    })
                    .collect();
                SlotProgressWire {
                    source: s.source,
                    committed: s.committed,
                    previous: s.previous,
                    span: (s.end - s.committed) as u64,
                    runs,
                    arrived,
                }
            })
            .collect();
        let mut out = vec![PROGRESS_FORMAT];
        out.extend(crate::codec::to_bincode(&TaskProgressWire {
            stream_time: self.stream_time,
            slots,
        }));
        out
    }

    /// Decodes a record written by [`TaskProgress::encode`] (or by an
    /// earlier format).
    pub(crate) fn decode(bytes: &[u8]) -> Result<TaskProgress, String> {
        match bytes.split_first() {
            Some((&PROGRESS_FORMAT, rest)) => {
                let wire: TaskProgressWire = from_bincode(rest).map_err(|e| corrupt(&e))?;
                let slots = wire.slots.into_iter().map(|s| {
                    let arrived = Some(s.arrived);
                    (s.source, s.committed, s.previous, s.span, s.runs, arrived)
                });
                Self::from_wire(wire.stream_time, slots)
            }
            Some((&PROGRESS_FORMAT_V2, rest)) => {
                let wire: TaskProgressWireV2 = from_bincode(rest).map_err(|e| corrupt(&e))?;
                let slots = wire
                    .slots
                    .into_iter()
                    .map(|s| (s.source, s.committed, s.previous, s.span, s.runs, None));
                Self::from_wire(wire.stream_time, slots)
            }
            _ => {
                let old: Vec<SlotProgressV1> = from_bincode(bytes).map_err(|e| corrupt(&e))?;
                Ok(TaskProgress {
                    stream_time: i64::MIN,
                    slots: old
                        .into_iter()
                        .map(|s| SlotProgress {
                            source: s.source,
                            committed: s.committed,
                            previous: s.committed,
                            end: s.end,
                            arrived: vec![i64::MIN; s.unfinished.len()],
                            unfinished: s.unfinished,
                        })
                        .collect(),
                })
            }
        }
    }

    /// The record from its wire slots (source, committed, previous, span,
    /// runs, and the arrival times when the format has them: without, every
    /// unfinished record arrives at the record's stream time).
    fn from_wire(
        stream_time: i64,
        wire: impl ExactSizeIterator<Item = WireSlot>,
    ) -> Result<TaskProgress, String> {
        let mut slots = Vec::with_capacity(wire.len());
        let mut total = 0;
        for (source, committed, previous, span, runs, arrived) in wire {
            let end = committed
                .checked_add(i64::try_from(span).map_err(|e| corrupt(&e))?)
                .ok_or_else(|| corrupt(&"span out of range"))?;
            let mut unfinished = Vec::new();
            let mut cursor = committed;
            for (gap, len) in runs {
                let outside = || corrupt(&"unfinished offsets outside the record");
                let start = i64::try_from(gap)
                    .ok()
                    .and_then(|gap| cursor.checked_add(gap))
                    .ok_or_else(outside)?;
                let stop = i64::try_from(len)
                    .ok()
                    .and_then(|len| start.checked_add(len))
                    .ok_or_else(outside)?;
                if stop > end || len == 0 {
                    return Err(outside());
                }
                // Checked before allocating: a corrupt run would otherwise
                // ask for up to 2^63 offsets (tests/fuzz/regressions/progress).
                if total + len > MAX_UNFINISHED {
                    return Err(corrupt(
                        &"more unfinished offsets than a task holds in flight",
                    ));
                }
                total += len;
                unfinished.extend(start..stop);
                cursor = stop;
            }
            let arrived = match arrived {
                None => vec![stream_time; unfinished.len()],
                Some(deltas) if deltas.len() != unfinished.len() => {
                    return Err(corrupt(
                        &"arrival times do not match the unfinished offsets",
                    ))
                }
                Some(deltas) => {
                    let mut before = stream_time;
                    deltas
                        .iter()
                        .enumerate()
                        .map(|(i, d)| {
                            before = match i {
                                0 => stream_time.wrapping_sub(*d),
                                _ => before.wrapping_add(*d),
                            };
                            before
                        })
                        .collect()
                }
            };
            slots.push(SlotProgress {
                source,
                committed,
                previous,
                end,
                unfinished,
                arrived,
            });
        }
        Ok(TaskProgress { stream_time, slots })
    }
}

/// A slot as read from the wire, whatever the format: source, committed,
/// previous, span, runs, arrival-time deltas (when the format has them).
type WireSlot = (u32, i64, i64, u64, Vec<(u64, u64)>, Option<Vec<i64>>);

/// What a progress record that cannot be read says.
fn corrupt(e: &dyn std::fmt::Display) -> String {
    format!("corrupt progress record: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_to_read_is_past_every_received_record_and_never_below_the_commit() {
        let mut t = OffsetTracker::default();
        assert_eq!(t.next_to_read(), None);
        t.mark_committed(10);
        assert_eq!(t.next_to_read(), Some(10));
        t.received(10, 0);
        t.received(11, 0);
        t.finished(11);
        // 10 is still in flight here: the commit stays at 10, reading goes on at 12.
        assert_eq!(t.committable(), Some(10));
        assert_eq!(t.next_to_read(), Some(12));
    }

    #[test]
    fn commits_only_the_contiguous_finished_prefix() {
        let mut t = OffsetTracker::default();
        assert_eq!(t.committable(), None);
        for o in 10..15 {
            t.received(o, 0);
        }
        t.finished(10);
        t.finished(12);
        t.finished(13);
        assert_eq!(t.committable(), Some(11));
        t.finished(11);
        assert_eq!(t.committable(), Some(14));
        t.finished(14);
        assert_eq!(t.committable(), Some(15));
        t.mark_committed(15);
        assert_eq!(t.to_commit(), None);
        // gaps (e.g. transaction markers) are skipped
        t.received(17, 0);
        assert_eq!(t.to_commit(), Some(17));
        t.finished(17);
        assert_eq!(t.to_commit(), Some(18));
    }

    #[test]
    fn progress_names_exactly_the_finished_records_above_the_committed_offset() {
        let mut t = OffsetTracker::default();
        assert_eq!(t.progress(9), None);
        for o in 5..10 {
            t.received(o, 0);
        }
        t.finished(8);
        t.finished(6);
        let p = t.progress(9).unwrap();
        assert_eq!(
            (p.committed, p.end, &p.unfinished[..]),
            (5, 10, &[5, 7, 9][..])
        );
        let finished: Vec<i64> = (0..12).filter(|o| p.finished(*o)).collect();
        assert_eq!(finished, vec![0, 1, 2, 3, 4, 6, 8]);
        // In order: nothing above the committed offset is finished.
        t.finished(5);
        t.finished(7);
        t.finished(9);
        let p = t.progress(9).unwrap();
        assert_eq!((p.committed, p.end, p.unfinished.len()), (10, 10, 0));
    }

    fn restored(committed: i64, end: i64, unfinished: &[i64]) -> SlotProgress {
        SlotProgress {
            source: 1,
            committed,
            previous: committed - 7,
            end,
            unfinished: unfinished.to_vec(),
            // Each arrived at a stream time of its own (its offset, in s).
            arrived: unfinished.iter().map(|o| o * 1000).collect(),
        }
    }

    /// Feeds `offsets` to a tracker as the runtime does: admitted records
    /// stay in flight, skipped ones finish at once.
    fn feed(t: &mut OffsetTracker, offsets: impl IntoIterator<Item = i64>) -> Vec<i64> {
        let mut processed = Vec::new();
        for o in offsets {
            match t.admit(o) {
                Admission::Skip => t.received_finished(o),
                _ => {
                    t.received(o, 0);
                    processed.push(o);
                }
            }
        }
        processed
    }

    #[test]
    fn a_restarted_task_keeps_what_its_restored_progress_says_until_it_passed_its_end() {
        // Restored: committed 100, received up to 199, 100 and 150 unfinished.
        let (mut t, warning) = OffsetTracker::restarting(
            StartAt::Committed(100),
            Some(restored(100, 200, &[100, 150])),
        );
        assert_eq!(warning, None);
        // Before reading anything the task's own record says the same.
        let p = t.progress(1).unwrap();
        assert_eq!(
            (p.committed, p.end, &p.unfinished[..]),
            (100, 200, &[100, 150][..])
        );
        // It reads 100..130: only 100 runs again (and stays in flight).
        assert_eq!(feed(&mut t, 100..131), vec![100]);
        let p = t.progress(1).unwrap();
        assert_eq!(
            (p.committed, p.end, &p.unfinished[..]),
            (100, 200, &[100, 150][..]),
            "131..199 (but 150) stay finished in the record until the task passed them"
        );
        assert_eq!(p.previous, 100);
        assert_eq!(t.committable(), Some(100));
        t.finished(100);
        assert_eq!(
            t.committable(),
            Some(150),
            "everything below 150 is finished"
        );
        assert_eq!(feed(&mut t, 131..205), vec![150, 200, 201, 202, 203, 204]);
        t.finished(150);
        let p = t.progress(1).unwrap();
        assert_eq!((p.committed, p.end), (200, 205));
        assert_eq!(p.unfinished, vec![200, 201, 202, 203, 204]);
    }

    #[test]
    fn a_slot_that_received_nothing_since_the_restart_keeps_its_restored_progress() {
        let r = restored(45, 60, &[45, 50]);
        let (t, _) = OffsetTracker::restarting(StartAt::Committed(45), Some(r.clone()));
        assert_eq!(t.progress(1), Some(SlotProgress { previous: 45, ..r }));
        assert_eq!(t.to_commit(), None, "nothing moved");
    }

    #[test]
    fn offsets_moved_on_purpose_drop_the_restored_progress() {
        // The group's offset is neither where the last commit left it nor
        // where it was before it (at-least-once writes the record first), or
        // there is none.
        for start in [
            StartAt::Committed(0),
            StartAt::Committed(55),
            StartAt::Reset,
        ] {
            let (mut t, warning) = OffsetTracker::restarting(start, Some(restored(40, 60, &[45])));
            assert!(warning.unwrap().contains("processed again"), "{start:?}");
            assert_eq!(t.admit(41), Admission::Process);
        }
        for start in [
            StartAt::Committed(40),
            StartAt::Committed(33),
            StartAt::Unknown,
        ] {
            let (mut t, warning) = OffsetTracker::restarting(start, Some(restored(40, 60, &[45])));
            assert_eq!(warning, None, "{start:?}");
            assert_eq!(t.admit(41), Admission::Skip);
            assert_eq!(t.admit(45), Admission::Process);
        }
        // The first commit of an at-least-once task, its offsets lost.
        let first = SlotProgress {
            previous: -1,
            ..restored(40, 60, &[45])
        };
        let (mut t, warning) = OffsetTracker::restarting(StartAt::Reset, Some(first));
        assert_eq!(warning, None);
        assert_eq!(t.admit(41), Admission::Skip);
        assert_eq!(t.admit(45), Admission::Process);
        // At or past the end, the progress has nothing to say anyway.
        let (mut t, warning) =
            OffsetTracker::restarting(StartAt::Committed(70), Some(restored(40, 60, &[45])));
        assert_eq!(warning, None);
        assert_eq!(t.committable(), None, "nothing below the start");
        assert_eq!(t.admit(70), Admission::Process);
    }

    #[test]
    fn a_start_learnt_after_the_task_started_is_judged_as_at_the_start() {
        // Its partition was assigned after the task's others: the tracker
        // began not knowing where reading starts.
        let (mut t, _) = OffsetTracker::restarting(StartAt::Unknown, Some(restored(40, 60, &[45])));
        let warning = t.starting_at(StartAt::Committed(55));
        assert!(warning.unwrap().contains("processed again"));
        assert_eq!(t.admit(41), Admission::Process, "the progress was dropped");
        let (mut t, _) = OffsetTracker::restarting(StartAt::Unknown, Some(restored(40, 60, &[45])));
        assert_eq!(t.starting_at(StartAt::Committed(40)), None);
        assert_eq!(t.admit(41), Admission::Skip, "where the commit left it");
        // Once records were read, what was read decides.
        assert_eq!(t.starting_at(StartAt::Committed(55)), None);
        assert_eq!(t.admit(42), Admission::Skip);
    }

    #[test]
    fn a_record_below_what_was_read_is_processed_again() {
        let (mut t, _) =
            OffsetTracker::restarting(StartAt::Committed(10), Some(restored(10, 20, &[12])));
        feed(&mut t, 10..25);
        assert_eq!(t.admit(3), Admission::MovedBack { expected: 25 });
        t.received(3, 0);
        assert_eq!(t.admit(4), Admission::Process);
        assert_eq!(
            t.admit(11),
            Admission::Process,
            "the restored progress is gone"
        );
    }

    #[test]
    fn progress_records_round_trip_compactly() {
        let p = TaskProgress {
            stream_time: 1_700_000_000_000,
            slots: vec![
                SlotProgress {
                    source: 7,
                    committed: 1_000_000,
                    previous: 999_000,
                    end: 1_500_000,
                    unfinished: vec![1_000_000, 1_000_001, 1_000_002, 1_200_000, 1_499_999],
                    arrived: [-9_000, -9_000, -8_990, -120, 0]
                        .map(|d| 1_700_000_000_000 + d)
                        .to_vec(),
                },
                SlotProgress {
                    source: 9,
                    committed: 5,
                    previous: -1,
                    end: 5,
                    unfinished: vec![],
                    arrived: vec![],
                },
            ],
        };
        let bytes = p.encode();
        assert_eq!(TaskProgress::decode(&bytes).unwrap(), p);
        // A few bytes per run of unfinished offsets, and one to three per
        // arrival time (a difference from the one before).
        assert!(bytes.len() < 70, "{} bytes", bytes.len());
        assert!(TaskProgress::decode(&bytes[..bytes.len() - 2]).is_err());
        assert!(TaskProgress::decode(&[PROGRESS_FORMAT, 0xff, 0xff]).is_err());
    }

    #[test]
    fn the_largest_progress_record_stays_far_below_a_broker_message() {
        // The bound: a slot's unfinished offsets are its own in-flight records
        // (at most `MAX_IN_FLIGHT_PER_PARTITION`) and those of the restored
        // record not read again yet (as many), at worst every other offset.
        let n = MAX_IN_FLIGHT_PER_PARTITION as i64 * 2;
        let slot = SlotProgress {
            source: 1,
            committed: 1 << 40,
            previous: 1 << 39,
            end: (1 << 40) + 2 * n,
            unfinished: (0..n).map(|i| (1 << 40) + 2 * i).collect(),
            // A millisecond apart: what arrives at full speed looks like.
            arrived: (0..n).map(|i| (1 << 41) + i).collect(),
        };
        let p = TaskProgress {
            stream_time: (1 << 41) + n,
            slots: vec![slot],
        };
        let bytes = p.encode();
        assert_eq!(TaskProgress::decode(&bytes).unwrap(), p);
        // Two bytes a run of one offset, one an arrival time: 60 KB at
        // most, where a broker takes a megabyte.
        assert!(bytes.len() <= 3 * n as usize + 64, "{} bytes", bytes.len());
    }

    #[test]
    fn arrival_times_read_back_exactly_whatever_their_values() {
        let p = TaskProgress {
            stream_time: 5,
            slots: vec![SlotProgress {
                source: 1,
                committed: 0,
                previous: -1,
                end: 5,
                unfinished: vec![0, 1, 2, 3, 4],
                // Out of order and at the extremes (the stream time before
                // the first record of a task is i64::MIN).
                arrived: vec![i64::MIN, i64::MAX, -3, 7, i64::MIN],
            }],
        };
        assert_eq!(TaskProgress::decode(&p.encode()).unwrap(), p);
        // A count of arrival times other than the unfinished offsets' is
        // corruption, not a shorter list.
        let mut wire = p.encode();
        let last = wire.len() - 1;
        wire.truncate(last);
        assert!(TaskProgress::decode(&wire).is_err());
    }

    #[test]
    fn the_second_format_reads_every_arrival_as_the_records_stream_time() {
        let wire = TaskProgressWireV2Out {
            stream_time: 90_000,
            slots: vec![SlotProgressWireV2 {
                source: 3,
                committed: 10,
                previous: 4,
                span: 10,
                runs: vec![(2, 2)],
            }],
        };
        let mut bytes = vec![PROGRESS_FORMAT_V2];
        bytes.extend(crate::codec::to_bincode(&wire));
        let p = TaskProgress::decode(&bytes).unwrap();
        assert_eq!(p.slots[0].unfinished, vec![12, 13]);
        assert_eq!(p.slots[0].arrived, vec![90_000, 90_000]);
    }

    /// The second format as it was written.
    #[derive(Serialize)]
    struct TaskProgressWireV2Out {
        stream_time: i64,
        slots: Vec<SlotProgressWireV2>,
    }

    #[test]
    fn records_of_the_restored_progress_arrive_again_at_their_first_arrival() {
        let (mut t, _) =
            OffsetTracker::restarting(StartAt::Committed(10), Some(restored(10, 20, &[12, 15])));
        // Not read again yet, they hold windows open as records in flight do.
        assert_eq!(t.oldest_in_flight_stream_time(), Some(12_000));
        assert_eq!(t.restored_arrival(12), Some(12_000));
        assert_eq!(t.restored_arrival(13), None, "finished before the crash");
        assert_eq!(feed(&mut t, 10..14), vec![12]);
        // 12 is in flight again (arrived at 0 in this test's feed), 15 not
        // read again yet.
        assert_eq!(t.oldest_in_flight_stream_time(), Some(0));
        t.finished(12);
        assert_eq!(t.oldest_in_flight_stream_time(), Some(15_000));
        assert_eq!(t.progress(1).unwrap().arrived, vec![15_000]);
    }

    #[test]
    fn the_first_progress_format_is_read() {
        #[derive(Serialize)]
        struct Old {
            source: u32,
            committed: i64,
            end: i64,
            unfinished: Vec<i64>,
        }
        let bytes = crate::codec::to_bincode(&vec![Old {
            source: 3,
            committed: 10,
            end: 20,
            unfinished: vec![12],
        }]);
        let p = TaskProgress::decode(&bytes).unwrap();
        assert_eq!(p.slots[0].unfinished, vec![12]);
        assert!(p.slots[0].finished(13) && !p.slots[0].finished(12));
    }

    #[test]
    fn token_drop_reports_finish_once_all_clones_are_gone() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let tok = RecordToken::new(
            Origin::Input {
                slot: 2,
                position: Position {
                    source: 1,
                    offset: 7,
                },
                raw: None,
            },
            0,
            tx,
            Default::default(),
        );
        let held = InFlight(tok.clone());
        drop(tok);
        assert!(rx.try_recv().is_err());
        drop(held);
        assert!(matches!(
            rx.try_recv().unwrap(),
            Done::Finished(Finished::Input(2, 7))
        ));
    }

    #[test]
    fn abandoned_records_are_never_reported_finished() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let abandoned = Arc::new(AtomicBool::new(false));
        let tok = RecordToken::new(Origin::Derived { id: 3 }, 0, tx, abandoned.clone());
        abandoned.store(true, Ordering::Release);
        drop(tok);
        assert!(rx.try_recv().is_err());
    }
}
