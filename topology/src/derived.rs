//! Records operators derive — an aggregation's results, what a processor
//! forwards from a flush, a punctuation or a batch's completion — tracked like
//! input records.
//!
//! An input record's work may end inside an aggregation while what the
//! aggregation forwarded goes on into an async call that outlives the commit.
//! The commit then holds the aggregation's new state, and the input record
//! counts as finished: re-running it after a crash would apply it twice. So
//! the forwarded record gets a token of its own, a *derived* record: it stays
//! in flight while an operator holds it, and a commit taken meanwhile writes
//! it (its operator's encoding) into the task's progress store, in the same
//! commit as the state that produced it. A task restarted from that commit
//! forwards it again from the same operator before it reads any input, so
//! its effects land exactly once. A derived record that finished is removed
//! from the store at the next commit.
//!
//! Records a processor forwards outside of an input record (from `flush`,
//! `punctuate`, or a call that carried several records) get a derived token
//! too, so they can be held, dead-lettered and counted in flight; the engine
//! cannot encode them, so a processor whose such records feed an async step
//! must derive them again from its own state after a restart.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How a derived record is kept in the progress store: the operator that
/// forwards it again (by its store's name) and its encoding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Resumable {
    /// The name of the store of the operator that derived it.
    pub(crate) node: String,
    /// The record as that operator encodes it.
    pub(crate) bytes: Vec<u8>,
}

/// The key prefix of derived records in the progress store (below it, the
/// big-endian id, so a scan returns them in the order they were derived).
pub(crate) const KEY_PREFIX: &[u8] = b"derived/";

/// The progress-store key of derived record `id`.
pub(crate) fn key(id: u64) -> Vec<u8> {
    let mut k = KEY_PREFIX.to_vec();
    k.extend_from_slice(&id.to_be_bytes());
    k
}

/// The id in a progress-store key, if it is a derived record's.
pub(crate) fn id_of(key: &[u8]) -> Option<u64> {
    let rest = key.strip_prefix(KEY_PREFIX)?;
    Some(u64::from_be_bytes(rest.try_into().ok()?))
}

struct Entry {
    content: Option<Resumable>,
    /// The task's stream time when it was derived (its lateness is judged
    /// by it).
    stream_time: i64,
    /// Written to the progress store by a commit (so its removal must be
    /// too, once it finishes).
    persisted: bool,
}

/// What a commit writes for derived records.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct DerivedChanges {
    /// Records in flight, not yet in the store: (id, what to store).
    pub(crate) put: Vec<(u64, Resumable)>,
    /// Records stored by an earlier commit that finished since.
    pub(crate) delete: Vec<u64>,
}

/// The derived records of a task.
#[derive(Default)]
pub(crate) struct DerivedTracker {
    next_id: u64,
    live: BTreeMap<u64, Entry>,
    /// Stored records that finished since the last commit.
    finished_stored: Vec<u64>,
}

impl DerivedTracker {
    /// Registers a new derived record; returns its id.
    pub(crate) fn derive(&mut self, content: Option<Resumable>, stream_time: i64) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.live.insert(
            id,
            Entry {
                content,
                stream_time,
                persisted: false,
            },
        );
        id
    }

    /// Registers a record restored from the progress store, under its id.
    pub(crate) fn restore(&mut self, id: u64, content: Resumable, stream_time: i64) {
        self.next_id = self.next_id.max(id + 1);
        self.live.insert(
            id,
            Entry {
                content: Some(content),
                stream_time,
                persisted: true,
            },
        );
    }

    /// The stream time the oldest derived record in flight was derived at.
    pub(crate) fn oldest_stream_time(&self) -> Option<i64> {
        self.live.values().map(|e| e.stream_time).min()
    }

    /// A derived record finished.
    pub(crate) fn finished(&mut self, id: u64) {
        if let Some(e) = self.live.remove(&id) {
            if e.persisted {
                self.finished_stored.push(id);
            }
        }
    }

    /// Derived records in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.live.len()
    }

    /// What the next commit writes: records in flight that can be resumed and
    /// are not stored yet, and stored records that finished. Marks the former
    /// stored.
    pub(crate) fn take_changes(&mut self) -> DerivedChanges {
        let mut changes = DerivedChanges {
            delete: std::mem::take(&mut self.finished_stored),
            ..Default::default()
        };
        for (id, e) in &mut self.live {
            if e.persisted {
                continue;
            }
            if let Some(c) = &e.content {
                changes.put.push((*id, c.clone()));
                e.persisted = true;
            }
        }
        changes
    }

    /// Ids of the records in flight that a commit stored.
    #[cfg(test)]
    fn stored(&self) -> Vec<u64> {
        self.live
            .iter()
            .filter(|(_, e)| e.persisted)
            .map(|(id, _)| *id)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(b: u8) -> Option<Resumable> {
        Some(Resumable {
            node: "counts".into(),
            bytes: vec![b],
        })
    }

    #[test]
    fn a_commit_stores_what_is_in_flight_and_removes_what_finished_since() {
        let mut t = DerivedTracker::default();
        let a = t.derive(r(1), 0);
        let b = t.derive(r(2), 0);
        let c = t.derive(None, 0);
        t.finished(a);
        // a finished before any commit: nothing to store or remove.
        let ch = t.take_changes();
        assert_eq!(ch.put, vec![(b, r(2).unwrap())]);
        assert!(ch.delete.is_empty());
        assert_eq!(t.stored(), vec![b]);
        assert_eq!(t.in_flight(), 2, "b, and c that cannot be stored");
        // Nothing new: no change.
        assert_eq!(t.take_changes(), DerivedChanges::default());
        t.finished(b);
        t.finished(c);
        assert_eq!(t.take_changes().delete, vec![b]);
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn restored_records_keep_their_ids_and_new_ones_follow() {
        let mut t = DerivedTracker::default();
        t.restore(7, r(7).unwrap(), 0);
        assert_eq!(t.derive(r(8), 0), 8);
        assert_eq!(t.take_changes().put.len(), 1, "7 is stored already");
        t.finished(7);
        assert_eq!(t.take_changes().delete, vec![7]);
    }

    #[test]
    fn keys_sort_by_id_and_read_back() {
        assert!(key(2) < key(10) && key(255) < key(256));
        assert_eq!(id_of(&key(300)), Some(300));
        assert_eq!(id_of(b"progress"), None);
        assert_eq!(id_of(b"derived/x"), None);
    }
}
