//! Records operators derive — an aggregation's results, what a processor
//! forwards from a flush, a punctuation or a batch's completion — and records
//! processors hold, tracked like input records.
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
//! cannot encode them.
//!
//! **Holds.** When a processor keeps a record past the call that handed it
//! over resumably (`ProcessorContext::spawn_resumable`, `hold_resumable`),
//! the hold gets a token of its own linked to the record it holds, its
//! *root* (an input record, a derived record, or an earlier hold that
//! became a root): the link keeps the root in flight. A replay of the root
//! after a crash runs everything it did again, which is right as long as
//! none of it has left the task yet. Once the root had an effect (an
//! output, a dead letter, a store write: beside the hold, before it, or in
//! an earlier stage's completion) a commit that would leave it unfinished
//! *converts* its holds instead: each hold's content (what its processor
//! said it needs to take the record up again) is written to the progress
//! store in that commit, the link is cut, and the root finishes in the same
//! commit. A restart hands each stored hold back to its processor
//! (`Processor::resume`) and replays nothing else of the root. A plain
//! `spawn` or `hold` carries the root itself (no token: the linear shapes
//! pay nothing), so a root it holds is replayed whole; a root with
//! resumable holds and a plain one is left so and logged, as is a derived
//! record without content held past a commit.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::offsets::{Origin, RecordToken};
use crate::record::RawRecord;

/// How a derived record is kept in the progress store: the operator that
/// forwards it again (by its store's name) and its encoding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Resumable {
    /// The name of the store of the operator that derived it.
    pub(crate) node: String,
    /// The record as that operator encodes it.
    pub(crate) bytes: Vec<u8>,
}

/// How a converted hold is kept in the progress store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HeldRecord {
    /// The name of the processor that holds it.
    pub(crate) processor: String,
    /// What the processor needs to take it up again (its own encoding).
    pub(crate) content: Vec<u8>,
    /// The task's stream time when its root arrived.
    pub(crate) stream_time: i64,
    /// Its root's input position: (source id, offset).
    pub(crate) position: Option<(u32, i64)>,
    /// Its root's original record, for dead letters.
    pub(crate) raw: Option<RawRecord>,
}

/// Encodes what a processor needs to take a held record up again; called
/// only when a commit converts the hold.
pub(crate) type Encoder = Box<dyn FnOnce() -> Vec<u8> + Send>;

/// The key prefix of derived records in the progress store (below it, the
/// big-endian id, so a scan returns them in the order they were derived).
pub(crate) const KEY_PREFIX: &[u8] = b"derived/";

/// The key prefix of converted holds in the progress store.
pub(crate) const HELD_PREFIX: &[u8] = b"held/";

/// The progress-store key of derived record `id`.
pub(crate) fn key(id: u64) -> Vec<u8> {
    prefixed(KEY_PREFIX, id)
}

/// The progress-store key of converted hold `id`.
pub(crate) fn held_key(id: u64) -> Vec<u8> {
    prefixed(HELD_PREFIX, id)
}

fn prefixed(prefix: &[u8], id: u64) -> Vec<u8> {
    let mut k = prefix.to_vec();
    k.extend_from_slice(&id.to_be_bytes());
    k
}

/// The id in a progress-store key below `prefix`.
pub(crate) fn id_below(prefix: &[u8], key: &[u8]) -> Option<u64> {
    let rest = key.strip_prefix(prefix)?;
    Some(u64::from_be_bytes(rest.try_into().ok()?))
}

/// The id in a progress-store key, if it is a derived record's.
pub(crate) fn id_of(key: &[u8]) -> Option<u64> {
    id_below(KEY_PREFIX, key)
}

/// A hold's side of the tracker.
struct Hold {
    /// Its content's encoder; `None` once a plain `spawn` or `hold`
    /// carried it on (see [`DerivedTracker::carried_on`]), or once encoded.
    encode: Option<Encoder>,
    /// The processor that holds it.
    processor: String,
    /// Its token (the processor owns it).
    token: Weak<RecordToken>,
    /// Its content, once a commit converted it: it is a root of its own.
    converted: Option<HeldRecord>,
}

enum Kind {
    /// An aggregation's or a processor's result: stored by any commit while
    /// in flight when it has content.
    Derived(Option<Resumable>),
    /// A processor's hold: stored once converted.
    Held(Hold),
}

struct Entry {
    kind: Kind,
    /// The task's stream time when it (or its root) arrived: its lateness
    /// is judged by it.
    stream_time: i64,
    /// Written to the progress store by a commit (so its removal must be
    /// too, once it finishes).
    persisted: bool,
}

/// What a commit writes for derived records and holds.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct DerivedChanges {
    /// Derived records in flight, not yet in the store: (id, what to
    /// store, the stream time it was derived at).
    pub(crate) put: Vec<(u64, Resumable, i64)>,
    /// Holds converted since the last commit.
    pub(crate) put_held: Vec<(u64, HeldRecord)>,
    /// Progress-store keys of records stored by an earlier commit that
    /// finished since.
    pub(crate) delete: Vec<Vec<u8>>,
}

/// What converting holds found (see [`DerivedTracker::convert_holds`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Conversion {
    /// Holds converted into resume points.
    pub(crate) converted: usize,
    /// Records with effects left unfinished because a processor holds them
    /// without content to resume from: a crash replays them whole.
    pub(crate) unresumable: usize,
}

/// The derived records and holds of a task.
#[derive(Default)]
pub(crate) struct DerivedTracker {
    next_id: u64,
    /// Derived records and converted holds in flight: they count in flight
    /// of their own.
    live: BTreeMap<u64, Entry>,
    /// Holds not converted (they count through their roots), by id: kept
    /// apart so that counting and the oldest stream time, asked at every
    /// record, do not walk them.
    holds: FxHashMap<u64, Entry>,
    /// Keys of stored records that finished since the last commit.
    finished_stored: Vec<Vec<u8>>,
}

impl DerivedTracker {
    /// Registers a new derived record; returns its id.
    pub(crate) fn derive(&mut self, content: Option<Resumable>, stream_time: i64) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.live.insert(
            id,
            Entry {
                kind: Kind::Derived(content),
                stream_time,
                persisted: false,
            },
        );
        id
    }

    /// Numbers the records derived or held from now on above `id` (the
    /// highest a restored one has).
    pub(crate) fn ids_above(&mut self, id: u64) {
        self.next_id = self.next_id.max(id + 1);
    }

    /// The id the next derived record or hold gets.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id
    }

    /// Registers a new hold by `processor` under `id` (from
    /// [`DerivedTracker::next_id`]), its token `token`.
    pub(crate) fn hold(
        &mut self,
        id: u64,
        processor: &str,
        encode: Encoder,
        token: Weak<RecordToken>,
        stream_time: i64,
    ) {
        debug_assert_eq!(id, self.next_id);
        self.next_id += 1;
        let hold = Hold {
            encode: Some(encode),
            processor: processor.to_string(),
            token,
            converted: None,
        };
        self.holds.insert(
            id,
            Entry {
                kind: Kind::Held(hold),
                stream_time,
                persisted: false,
            },
        );
    }

    /// Registers a record restored from the progress store, under its id.
    pub(crate) fn restore(&mut self, id: u64, content: Resumable, stream_time: i64) {
        self.restore_entry(id, Kind::Derived(Some(content)), stream_time);
    }

    /// Registers what the progress store held under `id` as in flight and
    /// stored.
    fn restore_entry(&mut self, id: u64, kind: Kind, stream_time: i64) {
        self.ids_above(id);
        let entry = Entry {
            kind,
            stream_time,
            persisted: true,
        };
        self.live.insert(id, entry);
    }

    /// A hold was carried on by a plain `spawn` or `hold`: it can no longer
    /// be converted (the processor that carries it cannot resume it).
    pub(crate) fn carried_on(&mut self, id: u64) {
        if let Some(Entry {
            kind: Kind::Held(h),
            ..
        }) = self.holds.get_mut(&id)
        {
            h.encode = None;
        }
    }

    /// Registers a hold restored from the progress store, under its id.
    pub(crate) fn restore_held(&mut self, id: u64, held: HeldRecord, token: Weak<RecordToken>) {
        let stream_time = held.stream_time;
        let hold = Hold {
            encode: None,
            processor: held.processor.clone(),
            token,
            converted: Some(held),
        };
        self.restore_entry(id, Kind::Held(hold), stream_time);
    }

    /// The stream time a derived record in flight was derived at.
    pub(crate) fn stream_time_of(&self, id: u64) -> Option<i64> {
        self.live.get(&id).map(|e| e.stream_time)
    }

    /// The stream time the oldest record in flight arrived at.
    pub(crate) fn oldest_stream_time(&self) -> Option<i64> {
        self.live.values().map(|e| e.stream_time).min()
    }

    /// A derived record or hold finished.
    pub(crate) fn finished(&mut self, id: u64) {
        if self.holds.remove(&id).is_some() {
            return;
        }
        if let Some(e) = self.live.remove(&id) {
            if e.persisted {
                self.finished_stored.push(match e.kind {
                    Kind::Derived(_) => key(id),
                    Kind::Held(_) => held_key(id),
                });
            }
        }
    }

    /// Derived records and converted holds in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.live.len()
    }

    /// Whether the root of a hold needs a resume point at this commit: it
    /// had an effect (a replay would make it again), or it is a derived
    /// record nothing could forward again.
    fn needs_resume_point(&self, root: &RecordToken) -> bool {
        root.had_effects()
            || matches!(&root.origin, Origin::Derived { id }
                if matches!(self.live.get(id), Some(Entry { kind: Kind::Derived(None), .. })))
    }

    /// Converts the holds of every root that needs a resume point (see the
    /// module's documentation) when all of the root's holders can resume it:
    /// their content is encoded for the commit to store, and their links
    /// cut (the root finishes once the caller drains the reports).
    pub(crate) fn convert_holds(&mut self) -> Conversion {
        // The holds of each root that needs it: (root's strong count, ids).
        let mut roots: FxHashMap<*const RecordToken, (usize, Vec<u64>)> = FxHashMap::default();
        for (id, e) in &self.holds {
            let Kind::Held(h) = &e.kind else { continue };
            let Some(token) = h.token.upgrade() else {
                continue;
            };
            let Origin::Held { root, .. } = &token.origin else {
                continue;
            };
            let root = root.lock();
            let Some(r) = root.as_ref() else { continue };
            if !self.needs_resume_point(r) {
                continue;
            }
            roots
                .entry(Arc::as_ptr(r))
                .or_insert_with(|| (Arc::strong_count(r), Vec::new()))
                .1
                .push(*id);
        }
        let mut result = Conversion::default();
        let mut cut = Vec::new();
        for (strong, ids) in roots.into_values() {
            let resumable = ids.iter().all(|id| {
                matches!(self.holds.get(id), Some(Entry { kind: Kind::Held(h), .. }) if h.encode.is_some())
            });
            // Every reference to the root is a hold's link: nothing else
            // (a hold without content, a call carrying it) keeps it.
            if !resumable || strong != ids.len() {
                result.unresumable += 1;
                continue;
            }
            for id in ids {
                let Some(mut entry) = self.holds.remove(&id) else {
                    continue;
                };
                let Entry {
                    kind: Kind::Held(h),
                    stream_time,
                    ..
                } = &mut entry
                else {
                    continue;
                };
                let Some(token) = h.token.upgrade() else {
                    continue;
                };
                let Origin::Held {
                    root,
                    position,
                    raw,
                    ..
                } = &token.origin
                else {
                    continue;
                };
                let encode = h.encode.take().expect("checked above");
                h.converted = Some(HeldRecord {
                    processor: h.processor.clone(),
                    content: encode(),
                    stream_time: *stream_time,
                    position: position.map(|p| (p.source, p.offset)),
                    raw: raw.as_deref().cloned(),
                });
                cut.extend(root.lock().take());
                drop(token);
                self.live.insert(id, entry);
                result.converted += 1;
            }
        }
        drop(cut);
        result
    }

    /// Derived records without content still in flight (held by a
    /// processor that cannot resume them: a crash loses them).
    pub(crate) fn unresumable_derived(&self) -> usize {
        self.live
            .values()
            .filter(|e| matches!(e.kind, Kind::Derived(None)))
            .count()
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
            match &e.kind {
                Kind::Derived(Some(c)) => changes.put.push((*id, c.clone(), e.stream_time)),
                Kind::Held(Hold {
                    converted: Some(c), ..
                }) => changes.put_held.push((*id, c.clone())),
                _ => continue,
            }
            e.persisted = true;
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
        assert_eq!(ch.put, vec![(b, r(2).unwrap(), 0)]);
        assert!(ch.delete.is_empty());
        assert_eq!(t.stored(), vec![b]);
        assert_eq!(t.in_flight(), 2, "b, and c that cannot be stored");
        // Nothing new: no change.
        assert_eq!(t.take_changes(), DerivedChanges::default());
        t.finished(b);
        t.finished(c);
        assert_eq!(t.take_changes().delete, vec![key(b)]);
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn restored_records_keep_their_ids_and_new_ones_follow() {
        let mut t = DerivedTracker::default();
        t.restore(7, r(7).unwrap(), 0);
        assert_eq!(t.derive(r(8), 0), 8);
        assert_eq!(t.take_changes().put.len(), 1, "7 is stored already");
        t.finished(7);
        assert_eq!(t.take_changes().delete, vec![key(7)]);
    }

    #[test]
    fn keys_sort_by_id_and_read_back() {
        assert!(key(2) < key(10) && key(255) < key(256));
        assert_eq!(id_of(&key(300)), Some(300));
        assert_eq!(id_of(b"progress"), None);
        assert_eq!(id_of(b"derived/x"), None);
    }
}
