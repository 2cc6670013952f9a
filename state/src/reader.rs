//! Read-only access to a task's committed state from other threads, for
//! interactive queries.
//!
//! RocksDB only ever receives committed writes (the write cache holds the
//! rest until [`crate::TaskState::commit_local`]), so a read here sees the
//! state as of the task's last commit, and a read of several stores sees one
//! commit (they share a RocksDB snapshot). The task's own thread keeps
//! writing meanwhile: RocksDB serves both. When the task's state closes, the
//! reader closes with it (waiting for reads in progress, which take
//! milliseconds), so a reader never keeps a database open that a later owner
//! of the same directory must open.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::RwLock;
use rocksdb::DB;

use crate::window::{decode_window_key, encode_window_key};
use crate::{StateError, StoreKind, StoreSpec, StoredValue};

/// A shared, read-only handle on the committed state of one task. Cheap to
/// clone; every clone closes when the task's state does.
#[derive(Clone)]
pub struct StoreReader {
    shared: Arc<Shared>,
}

struct Shared {
    db: RwLock<Option<Arc<DB>>>,
    dir: PathBuf,
    stores: Vec<StoreSpec>,
}

impl std::fmt::Debug for StoreReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreReader")
            .field("dir", &self.shared.dir)
            .field("open", &self.is_open())
            .finish()
    }
}

/// The windows of one store to read in [`StoreReader::fetch_windows`]: those
/// starting in `[from_ms, to_ms)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowRange<'a> {
    /// The window store.
    pub store: &'a str,
    /// First window start included, ms.
    pub from_ms: i64,
    /// First window start excluded, ms.
    pub to_ms: i64,
}

impl StoreReader {
    pub(crate) fn new(db: Arc<DB>, dir: PathBuf, stores: Vec<StoreSpec>) -> Self {
        StoreReader {
            shared: Arc::new(Shared {
                db: RwLock::new(Some(db)),
                dir,
                stores,
            }),
        }
    }

    /// Closes every clone: reads after this fail with
    /// [`StateError::Closed`]. Waits for reads in progress.
    pub(crate) fn close(&self) {
        self.shared.db.write().take();
    }

    /// False once the task's state closed.
    pub fn is_open(&self) -> bool {
        self.shared.db.read().is_some()
    }

    fn spec(&self, store: &str) -> Result<&StoreSpec, StateError> {
        self.shared
            .stores
            .iter()
            .find(|s| s.name == store)
            .ok_or_else(|| StateError::UnknownStore(store.to_string()))
    }

    fn rocks_err(&self, source: rocksdb::Error) -> StateError {
        StateError::Rocks {
            path: self.shared.dir.clone(),
            source,
        }
    }

    /// The committed value of `key` in a key-value store.
    pub fn get(&self, store: &str, key: &[u8]) -> Result<Option<StoredValue>, StateError> {
        self.spec(store)?;
        let guard = self.shared.db.read();
        let db = guard.as_ref().ok_or(StateError::Closed)?;
        let cf = db
            .cf_handle(store)
            .ok_or_else(|| StateError::UnknownStore(store.to_string()))?;
        let pinned = db.get_pinned_cf(cf, key).map_err(|e| self.rocks_err(e))?;
        let Some(bytes) = pinned else {
            return Ok(None);
        };
        StoredValue::decode(store, &bytes).map(Some)
    }

    /// The committed windows of `key` in each range (one result per range,
    /// oldest window first), all read from one snapshot: several stores
    /// updated by one commit are seen all before or all after it. A window
    /// expired since the last commit may still be listed.
    pub fn fetch_windows(
        &self,
        key: &[u8],
        ranges: &[WindowRange<'_>],
    ) -> Result<Vec<Vec<(i64, StoredValue)>>, StateError> {
        for r in ranges {
            if !matches!(self.spec(r.store)?.kind, StoreKind::Window { .. }) {
                return Err(StateError::UnknownStore(format!(
                    "{} (not a window store)",
                    r.store
                )));
            }
        }
        let guard = self.shared.db.read();
        let db = guard.as_ref().ok_or(StateError::Closed)?;
        let snapshot = db.snapshot();
        let mut out = Vec::with_capacity(ranges.len());
        for r in ranges {
            let cf = db
                .cf_handle(r.store)
                .ok_or_else(|| StateError::UnknownStore(r.store.to_string()))?;
            let mut it = snapshot.raw_iterator_cf(cf);
            let mut found = Vec::new();
            // Window keys sort by start, then key: one seek per window start
            // finds the key's entry in it, a second skips to the next start.
            let mut start = r.from_ms;
            while start < r.to_ms {
                it.seek(encode_window_key(start, key));
                let Some((at, k)) = it.key().and_then(decode_window_key) else {
                    break;
                };
                if at >= r.to_ms {
                    break;
                }
                if at > start {
                    // No entry of the key at `start`; the next window with
                    // any entry starts at `at`.
                    start = at;
                    continue;
                }
                if k == key {
                    let bytes = it.value().unwrap_or_default();
                    found.push((at, StoredValue::decode(r.store, bytes)?));
                }
                match at.checked_add(1) {
                    Some(next) => start = next,
                    None => break,
                }
            }
            it.status().map_err(|e| self.rocks_err(e))?;
            out.push(found);
        }
        Ok(out)
    }
}
