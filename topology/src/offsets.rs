//! Tracking which input records are finished, so that only the contiguous
//! prefix of finished records is ever committed, however out of order async
//! operators complete.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crossbeam_channel::Sender;
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
        done: Sender<(usize, i64)>,
        abandoned: Arc<AtomicBool>,
    ) -> Arc<Self> {
        Arc::new(RecordToken {
            slot,
            position,
            raw,
            replay,
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
    in_flight: BTreeSet<i64>,
    /// Next offset after the highest received.
    next_received: Option<i64>,
    /// The offset last committed (next to read).
    committed: Option<i64>,
}

impl OffsetTracker {
    /// A record was received.
    pub fn received(&mut self, offset: i64) {
        self.in_flight.insert(offset);
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

    /// Records received and not finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The offset to commit: the lowest unfinished offset, or past the highest
    /// received when all are finished. `None` when nothing was received.
    pub fn committable(&self) -> Option<i64> {
        match self.in_flight.first() {
            Some(first) => Some(*first),
            None => self.next_received,
        }
    }

    /// The committable offset if it moved since the last commit.
    pub fn to_commit(&self) -> Option<i64> {
        let c = self.committable()?;
        (self.committed != Some(c)).then_some(c)
    }

    /// The offset this task last committed, if any.
    pub fn last_committed(&self) -> Option<i64> {
        self.committed
    }

    /// Records that `offset` was committed.
    pub fn mark_committed(&mut self, offset: i64) {
        self.committed = Some(offset);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_only_the_contiguous_finished_prefix() {
        let mut t = OffsetTracker::default();
        assert_eq!(t.committable(), None);
        for o in 10..15 {
            t.received(o);
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
        t.received(17);
        assert_eq!(t.to_commit(), Some(17));
        t.finished(17);
        assert_eq!(t.to_commit(), Some(18));
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
            tx,
            abandoned.clone(),
        );
        abandoned.store(true, Ordering::Release);
        drop(tok);
        assert!(rx.try_recv().is_err());
    }
}
