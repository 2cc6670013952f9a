//! Tracking which input records are finished, so that only the contiguous
//! prefix of finished records is ever committed, however out of order async
//! operators complete; and the progress record that tells a restarted task
//! which records above its committed offset a commit already covered.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crossbeam_channel::Sender;
use serde::{Deserialize, Serialize};
use sluice_state::Position;

/// Keeps one input record "in flight" while alive. Clones travel with the
/// record through operators (and async calls); when the last one is dropped the
/// record is finished and its offset is reported to its task.
pub struct RecordToken {
    /// Index of the source partition within the task.
    pub(crate) slot: usize,
    /// The record's input position.
    pub(crate) position: Position,
    /// The original bytes, kept when the source has a dead-letter topic.
    pub(crate) raw: Option<Arc<crate::RawRecord>>,
    /// True when the record is in the replay zone (its effect may already be
    /// reflected in restored state).
    pub(crate) replay: bool,
    /// The task's stream time once this record arrived (input order): the
    /// time its lateness is judged by, however late its async call ends.
    pub(crate) stream_time: i64,
    done: Sender<(usize, i64)>,
    silent: bool,
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
        slot: usize,
        position: Position,
        raw: Option<Arc<crate::RawRecord>>,
        replay: bool,
        stream_time: i64,
        done: Sender<(usize, i64)>,
        abandoned: Arc<AtomicBool>,
    ) -> Arc<Self> {
        Arc::new(RecordToken {
            slot,
            position,
            raw,
            replay,
            stream_time,
            done,
            silent: false,
            abandoned,
        })
    }
}

impl Drop for RecordToken {
    fn drop(&mut self) {
        if self.silent || self.abandoned.load(Ordering::Acquire) {
            return;
        }
        // The receiver lives as long as the task; a closed task ignores this.
        let _ = self.done.send((self.slot, self.position.offset));
    }
}

/// An input record kept in flight by an operator that holds it for later
/// (a micro-batcher, an async call). Dropping it finishes the record.
#[derive(Clone)]
pub struct InFlight(pub(crate) Arc<RecordToken>);

impl InFlight {
    /// The input position of the record.
    pub fn position(&self) -> Position {
        self.0.position
    }
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "InFlight({:?})", self.0.position)
    }
}

/// Offsets of one input partition: received, finished, committable.
#[derive(Debug, Default)]
pub struct OffsetTracker {
    /// Unfinished offsets, each with the task's stream time before it arrived.
    in_flight: BTreeMap<i64, i64>,
    /// Next offset after the highest received.
    next_received: Option<i64>,
    /// The offset last committed (next to read).
    committed: Option<i64>,
}

impl OffsetTracker {
    /// A record was received (and stays in flight); `stream_time` is the
    /// task's stream time before it arrived.
    pub fn received(&mut self, offset: i64, stream_time: i64) {
        self.in_flight.insert(offset, stream_time);
        self.next_received = Some(self.next_received.map_or(offset + 1, |n| n.max(offset + 1)));
    }

    /// A record is finished.
    pub fn finished(&mut self, offset: i64) {
        self.in_flight.remove(&offset);
    }

    /// A record was received and finished at once (synchronous processing).
    pub fn received_finished(&mut self, offset: i64) {
        self.next_received = Some(self.next_received.map_or(offset + 1, |n| n.max(offset + 1)));
    }

    /// The stream time before the oldest unfinished record arrived: no record
    /// still in flight was judged against an earlier one.
    pub(crate) fn oldest_in_flight_stream_time(&self) -> Option<i64> {
        self.in_flight.first_key_value().map(|(_, st)| *st)
    }

    /// Records received and not finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The offset to commit: the lowest unfinished offset, or past the highest
    /// received when all are finished. `None` when nothing was received.
    pub fn committable(&self) -> Option<i64> {
        match self.in_flight.first_key_value() {
            Some((first, _)) => Some(*first),
            None => self.next_received,
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
    /// and which records above it are finished (`None` before any record).
    pub(crate) fn progress(&self, source: u32) -> Option<SlotProgress> {
        Some(SlotProgress {
            source,
            committed: self.committable()?,
            end: self.next_received?,
            unfinished: self.in_flight.keys().copied().collect(),
        })
    }
}

/// Where one input partition of a task stood at a commit. Records between
/// the committed offset and `end` that are not `unfinished` had finished:
/// their effects (state and outputs) are in that commit, so a task restarted
/// from it must neither apply nor emit them again, and must process every
/// other record. Kept in the task's changelogged progress store, written in
/// the same commit as the effects it describes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SlotProgress {
    /// Stable id of the source topic (the partition is the task's).
    pub(crate) source: u32,
    /// The offset committed: every record below it had finished.
    pub(crate) committed: i64,
    /// Past the highest offset received before the commit.
    pub(crate) end: i64,
    /// Offsets in `[committed, end)` still in flight at the commit, ascending.
    pub(crate) unfinished: Vec<i64>,
}

impl SlotProgress {
    /// True when the record at `offset` had finished before the commit.
    pub(crate) fn finished(&self, offset: i64) -> bool {
        offset < self.committed
            || (offset < self.end && self.unfinished.binary_search(&offset).is_err())
    }

    /// True when no record above the committed offset had finished (the
    /// committed offset alone says everything).
    pub(crate) fn is_prefix(&self) -> bool {
        self.end - self.committed <= self.unfinished.len() as i64
    }
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
        assert!(!p.is_prefix());
        let finished: Vec<i64> = (0..12).filter(|o| p.finished(*o)).collect();
        assert_eq!(finished, vec![0, 1, 2, 3, 4, 6, 8]);
        // In order: nothing above the committed offset is finished.
        t.finished(5);
        t.finished(7);
        t.finished(9);
        let p = t.progress(9).unwrap();
        assert!(p.is_prefix());
        assert_eq!((p.committed, p.end), (10, 10));
    }

    #[test]
    fn token_drop_reports_finish_once_all_clones_are_gone() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let tok = RecordToken::new(
            2,
            Position {
                source: 1,
                offset: 7,
            },
            None,
            false,
            0,
            tx,
            Default::default(),
        );
        let held = InFlight(tok.clone());
        drop(tok);
        assert!(rx.try_recv().is_err());
        drop(held);
        assert_eq!(rx.try_recv().unwrap(), (2, 7));
    }

    #[test]
    fn abandoned_records_are_never_reported_finished() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let abandoned = Arc::new(AtomicBool::new(false));
        let tok = RecordToken::new(
            0,
            Position {
                source: 1,
                offset: 3,
            },
            None,
            false,
            0,
            tx,
            abandoned.clone(),
        );
        abandoned.store(true, Ordering::Release);
        drop(tok);
        assert!(rx.try_recv().is_err());
    }
}
