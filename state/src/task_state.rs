//! The state of one stream task: one RocksDB database with a column family per
//! store, a write cache of dirty entries per store, the checkpoint, and restore.
//!
//! Invariant: the local database holds only writes whose changelog records were
//! committed (or, without changelogs, flushed): writes sit in the cache until
//! [`TaskState::commit_local`], which the runtime calls after its commit.
//!
//! Committed entries of cached stores ([`StoreSpec::cached`]) stay in memory in
//! a record cache (bounded for the whole instance by
//! [`crate::RocksSettings::record_cache_bytes`]), and a window store
//! knows the newest window start it holds in RocksDB: a read of a newer window
//! (the first record of a window) or of a cached key skips RocksDB.

use std::any::Any;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::ops::{Bound, RangeBounds};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use hashbrown::hash_map::EntryRef;
use rocksdb::{
    ColumnFamilyDescriptor, Direction, IngestExternalFileOptions, IteratorMode, Options,
    SstFileWriter, WriteBatch, DB,
};
use rustc_hash::{FxBuildHasher, FxHashMap};

use crate::value::encode_value;
use crate::window::{
    decode_window_key, encode_window_key, window_key_prefix_len, window_start_bytes,
};
use crate::{
    Checkpoint, LoadedCheckpoint, RocksEnv, StateError, StoreReader, StoredValue, WindowEntry,
};

/// What kind of store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// Plain key-value store.
    KeyValue,
    /// Window store; windows older than `retention_ms` behind stream time expire.
    Window {
        /// How long a window is kept after its start, ms.
        retention_ms: i64,
    },
}

/// Declaration of a store of a task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreSpec {
    /// Store name, unique within the topology.
    pub name: String,
    /// Key-value or window.
    pub kind: StoreKind,
    /// Whether the store is backed by a changelog topic.
    pub changelogged: bool,
    /// Whether committed entries stay in the record cache: for stores whose
    /// keys are read again (aggregations), not for write-once keys.
    pub cached: bool,
}

/// Index of a store within its task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StoreId(pub usize);

/// A record for a store's changelog: the store key and the encoded value, or
/// `None` for a deletion (tombstone).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChangelogRecord {
    /// Which store.
    pub store: StoreId,
    /// Store key bytes.
    pub key: Vec<u8>,
    /// Encoded [`StoredValue`], or `None` to delete.
    pub value: Option<Vec<u8>>,
}

/// What a restore applied.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreStats {
    /// Changelog records applied.
    pub records: u64,
}

/// A value a processor keeps decoded in the write cache between commits, so
/// that a key updated by many records is decoded once and encoded once per
/// commit instead of once per record (see [`TaskState::window_update`]).
pub trait CachedValue: Any + Send {
    /// The value's bytes as the store keeps them (without the header).
    fn encode(&self) -> Vec<u8>;
    /// For downcasting to the concrete type.
    fn as_any(&self) -> &dyn Any;
    /// For downcasting to the concrete type.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A dirty entry of the write cache.
enum Dirty {
    /// Encoded (header and value), or `None` for a deletion.
    Encoded(Option<Vec<u8>>),
    /// Decoded; encoded at the commit.
    Decoded(Box<dyn CachedValue>),
}

impl Dirty {
    /// Header and value bytes, or `None` for a deletion.
    fn encoded(&self) -> Option<Cow<'_, [u8]>> {
        match self {
            Dirty::Encoded(v) => v.as_deref().map(Cow::Borrowed),
            Dirty::Decoded(value) => Some(Cow::Owned(encode_value(&value.encode()))),
        }
    }

    /// The entry as a stored value, or `None` for a deletion.
    fn stored(&self, store: &str) -> Result<Option<StoredValue>, StateError> {
        match self {
            Dirty::Encoded(v) => v
                .as_deref()
                .map(|bytes| StoredValue::decode(store, bytes))
                .transpose(),
            Dirty::Decoded(value) => Ok(Some(StoredValue::new(value.encode()))),
        }
    }

    /// Encodes a decoded entry in place.
    fn settle(&mut self) {
        if let Dirty::Decoded(_) = self {
            let bytes = self.encoded().map(Cow::into_owned);
            *self = Dirty::Encoded(bytes);
        }
    }

    fn into_encoded(mut self) -> Option<Vec<u8>> {
        self.settle();
        match self {
            Dirty::Encoded(v) => v,
            Dirty::Decoded(_) => unreachable!("settled"),
        }
    }
}

struct Store {
    spec: StoreSpec,
    /// Dirty entries since the last local commit: encoded value or deletion,
    /// or a value kept decoded until the commit. Hashed: every record reads
    /// and writes it; the few range reads filter it. (hashbrown's map for
    /// `entry_ref`: an update finds or makes its entry in one lookup.)
    dirty: hashbrown::HashMap<Vec<u8>, Dirty, FxBuildHasher>,
    /// Committed entries kept in memory, equal to what RocksDB holds for them.
    clean: FxHashMap<Vec<u8>, Vec<u8>>,
    /// Bytes charged for `clean`.
    clean_bytes: usize,
    /// Window stores: every window in RocksDB starts at or before this
    /// (`i64::MIN`: none does).
    newest_window: i64,
    /// Window stores: windows starting before this are expired. Reads ignore
    /// them at once; RocksDB drops them at the next local commit, like every
    /// other write (`i64::MIN`: nothing to expire).
    expire_before: i64,
    /// What RocksDB has already dropped (the last expiry committed).
    expired_in_db: i64,
}

/// Calls `f` with the store key of a window, built on the stack when short.
fn with_window_key<R>(start_ms: i64, key: &[u8], f: impl FnOnce(&[u8]) -> R) -> R {
    const MAX: usize = 120;
    if key.len() > MAX {
        return f(&encode_window_key(start_ms, key));
    }
    let mut buf = [0u8; 8 + MAX];
    buf[..8].copy_from_slice(&window_start_bytes(start_ms));
    buf[8..8 + key.len()].copy_from_slice(key);
    f(&buf[..8 + key.len()])
}

/// What a store holds for `key` besides its write cache: the record cache
/// (`clean`), else RocksDB when `in_db` says it may hold it.
fn read_committed(
    db: &DB,
    dir: &Path,
    store: &str,
    clean: &FxHashMap<Vec<u8>, Vec<u8>>,
    key: &[u8],
    in_db: bool,
) -> Result<Option<StoredValue>, StateError> {
    if let Some(bytes) = clean.get(key) {
        return StoredValue::decode(store, bytes).map(Some);
    }
    if !in_db {
        return Ok(None);
    }
    let pinned = db
        .get_pinned_cf(column_family(db, store), key)
        .map_err(|source| rocks_error(dir, source))?;
    pinned
        .as_deref()
        .map(|bytes| StoredValue::decode(store, bytes))
        .transpose()
}

/// A store's column family.
fn column_family<'a>(db: &'a DB, store: &str) -> &'a rocksdb::ColumnFamily {
    db.cf_handle(store)
        .expect("column family opened with the database")
}

/// A RocksDB error of the state in `dir`.
fn rocks_error(dir: &Path, source: rocksdb::Error) -> StateError {
    StateError::Rocks {
        path: dir.to_path_buf(),
        source,
    }
}

/// What one cached entry is charged: its bytes and the map's overhead.
fn cache_charge(key: &[u8], value: &[u8]) -> usize {
    key.len() + value.len() + 64
}

impl Store {
    fn new(spec: StoreSpec) -> Store {
        Store {
            spec,
            dirty: hashbrown::HashMap::default(),
            clean: FxHashMap::default(),
            clean_bytes: 0,
            newest_window: i64::MAX,
            expire_before: i64::MIN,
            expired_in_db: i64::MIN,
        }
    }

    /// True for a window key that expiry has removed (committed or not).
    fn is_expired(&self, key: &[u8]) -> bool {
        self.expire_before > i64::MIN
            && decode_window_key(key).is_some_and(|(start, _)| start < self.expire_before)
    }

    fn is_window(&self) -> bool {
        matches!(self.spec.kind, StoreKind::Window { .. })
    }

    /// Notes a key written to RocksDB (for a window store, its window start).
    fn wrote(&mut self, key: &[u8]) {
        if !self.is_window() {
            return;
        }
        if let Some((start, _)) = decode_window_key(key) {
            self.newest_window = self.newest_window.max(start);
        }
    }

    /// Puts a committed entry in the record cache; returns the bytes charged
    /// and the bytes of the entry it replaced.
    fn cache(&mut self, key: Vec<u8>, value: Vec<u8>) -> (usize, usize) {
        let added = cache_charge(&key, &value);
        let freed = self.uncache(&key);
        self.clean.insert(key, value);
        self.clean_bytes += added;
        (added, freed)
    }

    /// Removes a key from the record cache; returns the bytes freed.
    fn uncache(&mut self, key: &[u8]) -> usize {
        let freed = self
            .clean
            .remove(key)
            .map_or(0, |old| cache_charge(key, &old));
        self.clean_bytes -= freed;
        freed
    }

    /// The dirty entries in key order (RocksDB inserts runs of ascending keys
    /// faster: the memtable's skiplist reuses its last insert position).
    fn sorted_dirty(&self) -> impl Iterator<Item = (&Vec<u8>, &Dirty)> {
        let mut entries: Vec<_> = self.dirty.iter().collect();
        entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
        entries.into_iter()
    }

    /// Sets a dirty entry, allocating its key only when it is new.
    fn set_dirty(&mut self, key: Cow<'_, [u8]>, value: Dirty) {
        match self.dirty.get_mut(key.as_ref()) {
            Some(slot) => *slot = value,
            None => {
                self.dirty.insert(key.into_owned(), value);
            }
        }
    }

    /// Empties the record cache; returns the bytes freed.
    fn drop_clean(&mut self) -> usize {
        self.clean = FxHashMap::default();
        std::mem::take(&mut self.clean_bytes)
    }
}

/// The state of one task.
pub struct TaskState {
    dir: PathBuf,
    db: Arc<DB>,
    /// Read-only handle for other threads; closed when the state drops.
    reader: StoreReader,
    stores: Vec<Store>,
    checkpoint: Checkpoint,
    /// The instance's record-cache budget and fill, shared by its tasks.
    cache_budget: usize,
    cache_fill: Arc<AtomicUsize>,
    /// Least time between checkpoints, and when the last one was written.
    checkpoint_interval: std::time::Duration,
    /// The stores' column family options (for files written to ingest).
    cf_options: Options,
    last_checkpoint: std::time::Instant,
    /// Commits since the last checkpoint moved its offsets.
    checkpoint_behind: bool,
}

impl Drop for TaskState {
    fn drop(&mut self) {
        // Readers first: the database closes with this value.
        self.reader.close();
        // The offsets of the last commits, made durable on the way out, so a
        // restart restores only what came after them.
        if self.checkpoint_behind {
            if let Err(e) = self.write_checkpoint() {
                tracing::warn!(dir = %self.dir.display(), error = %e, "checkpoint on close failed");
            }
        }
        let freed: usize = self.stores.iter_mut().map(Store::drop_clean).sum();
        self.cache_fill.fetch_sub(freed, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for TaskState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskState").field("dir", &self.dir).finish()
    }
}

/// Restored records applied by ingesting a table file rather than through
/// the memtable, from this many at once (below, the file's fixed cost —
/// its sync and the manifest's — outweighs what it saves).
const INGEST_MIN_RECORDS: usize = 4_096;

/// The table file a restore writes for store `id` before ingesting it.
fn ingest_path(dir: &Path, id: StoreId) -> PathBuf {
    dir.join(format!("restore-{}.sst", id.0))
}

/// Removes table files a restore wrote but did not ingest (the process
/// stopped in between): RocksDB does not know them.
fn remove_unfinished_ingests(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("restore-") && name.ends_with(".sst") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

impl TaskState {
    /// Opens (creating if needed) the database of a task in `dir` with one
    /// column family per store.
    pub fn open(dir: &Path, specs: &[StoreSpec], env: &RocksEnv) -> Result<TaskState, StateError> {
        std::fs::create_dir_all(dir).map_err(|source| StateError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let cfs = specs
            .iter()
            .map(|s| ColumnFamilyDescriptor::new(&s.name, env.cf_options()));
        let db = DB::open_cf_descriptors(&env.db_options(), dir, cfs)
            .map_err(|source| rocks_error(dir, source))?;
        remove_unfinished_ingests(dir);
        let loaded = Checkpoint::load(dir);
        let checkpoint = match &loaded {
            LoadedCheckpoint::Found(cp) => cp.clone(),
            _ => Checkpoint::default(),
        };
        let (cache_budget, cache_fill) = env.record_cache();
        let db = Arc::new(db);
        let reader = StoreReader::new(db.clone(), dir.to_path_buf(), specs.to_vec());
        let mut state = TaskState {
            dir: dir.to_path_buf(),
            db,
            reader,
            stores: specs.iter().cloned().map(Store::new).collect(),
            checkpoint,
            cache_budget,
            cache_fill,
            checkpoint_interval: env.checkpoint_interval(),
            cf_options: env.cf_options(),
            // The checkpoint just read is the state's durable point: the
            // next one follows an interval later (a restore or the first
            // commits do not wait for a WAL sync; closing writes one).
            last_checkpoint: std::time::Instant::now(),
            checkpoint_behind: false,
        };
        for (i, spec) in specs.iter().enumerate() {
            let id = StoreId(i);
            // Without a checkpoint that names it, a changelogged store's local
            // data is not known to match its changelog: it is restored in
            // full, and never on top of what is there.
            let trusted = match &loaded {
                LoadedCheckpoint::Found(cp) => cp.offsets.contains_key(&spec.name),
                LoadedCheckpoint::Missing => false,
                LoadedCheckpoint::Unreadable(reason) => {
                    tracing::warn!(dir = %dir.display(), %reason, "unreadable checkpoint: restoring the task's stores in full");
                    false
                }
            };
            if spec.changelogged && !trusted && !state.is_empty(id)? {
                state.wipe_store(id)?;
            }
            state.find_newest_window(id)?;
        }
        Ok(state)
    }

    /// True when RocksDB holds nothing for the store.
    fn is_empty(&self, id: StoreId) -> Result<bool, StateError> {
        let first = self
            .db
            .iterator_cf(self.cf(id), IteratorMode::Start)
            .next()
            .transpose()
            .map_err(|e| self.rocks_err(e))?;
        Ok(first.is_none())
    }

    /// Reads the newest window start a window store holds in RocksDB (its
    /// last key: window keys sort by start first).
    fn find_newest_window(&mut self, id: StoreId) -> Result<(), StateError> {
        if !self.stores[id.0].is_window() {
            return Ok(());
        }
        let last = self
            .db
            .iterator_cf(self.cf(id), IteratorMode::End)
            .next()
            .transpose()
            .map_err(|e| self.rocks_err(e))?;
        let store = &mut self.stores[id.0];
        store.newest_window = i64::MIN;
        if let Some((k, _)) = last {
            store.wrote(&k);
        }
        Ok(())
    }

    /// A read-only handle on the committed state, for other threads (see
    /// [`StoreReader`]).
    pub fn reader(&self) -> StoreReader {
        self.reader.clone()
    }

    /// The task's state directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Looks a store up by name.
    pub fn store_id(&self, name: &str) -> Result<StoreId, StateError> {
        self.stores
            .iter()
            .position(|s| s.spec.name == name)
            .map(StoreId)
            .ok_or_else(|| StateError::UnknownStore(name.to_string()))
    }

    /// The declarations of the task's stores, in [`StoreId`] order.
    pub fn specs(&self) -> impl Iterator<Item = &StoreSpec> {
        self.stores.iter().map(|s| &s.spec)
    }

    fn rocks_err(&self, source: rocksdb::Error) -> StateError {
        rocks_error(&self.dir, source)
    }

    fn cf(&self, id: StoreId) -> &rocksdb::ColumnFamily {
        column_family(&self.db, &self.stores[id.0].spec.name)
    }

    /// Reads a value (decoded straight from the caches or RocksDB's buffer).
    pub fn get(&self, id: StoreId, key: &[u8]) -> Result<Option<StoredValue>, StateError> {
        self.read(id, key, true)
    }

    /// Reads a value; RocksDB is asked only when `in_db` says it may hold it.
    fn read(
        &self,
        id: StoreId,
        key: &[u8],
        in_db: bool,
    ) -> Result<Option<StoredValue>, StateError> {
        let store = &self.stores[id.0];
        let name = &store.spec.name;
        if store.is_expired(key) {
            return Ok(None);
        }
        if let Some(entry) = store.dirty.get(key) {
            return entry.stored(name);
        }
        read_committed(&self.db, &self.dir, name, &store.clean, key, in_db)
    }

    /// Writes a value.
    pub fn put(&mut self, id: StoreId, key: Vec<u8>, value: &[u8]) {
        self.write(id, Cow::Owned(key), value)
    }

    fn write(&mut self, id: StoreId, key: Cow<'_, [u8]>, value: &[u8]) {
        self.stores[id.0].set_dirty(key, Dirty::Encoded(Some(encode_value(value))));
    }

    /// Deletes a key.
    pub fn delete(&mut self, id: StoreId, key: Vec<u8>) {
        self.stores[id.0].set_dirty(Cow::Owned(key), Dirty::Encoded(None));
    }

    /// Reads one window of a key.
    pub fn window_get(
        &self,
        id: StoreId,
        key: &[u8],
        start_ms: i64,
    ) -> Result<Option<StoredValue>, StateError> {
        let in_db = start_ms <= self.stores[id.0].newest_window;
        with_window_key(start_ms, key, |k| self.read(id, k, in_db))
    }

    /// Writes one window of a key.
    pub fn window_put(&mut self, id: StoreId, key: &[u8], start_ms: i64, value: &[u8]) {
        with_window_key(start_ms, key, |k| self.write(id, Cow::Borrowed(k), value))
    }

    /// The value of one window of a key, kept decoded in the write cache
    /// until the next commit encodes it, for a read-modify-write: the entry
    /// is returned for the caller to change in place. When the cache holds no decoded value of
    /// type `T` for it yet, `load` makes one from the stored value (`None`
    /// when there is none), or says why it cannot. Every other read sees a
    /// decoded value as if it had been written encoded.
    pub fn window_update<T: CachedValue>(
        &mut self,
        id: StoreId,
        key: &[u8],
        start_ms: i64,
        load: impl FnOnce(Option<StoredValue>) -> Result<T, String>,
    ) -> Result<&mut T, StateError> {
        let (db, dir) = (&self.db, &self.dir);
        let store = &mut self.stores[id.0];
        let in_db = start_ms <= store.newest_window;
        // One lookup finds the entry or the place for it; the slow paths
        // (first update since the commit) read what is stored as `read` does,
        // field by field, since the entry holds the write cache borrowed.
        with_window_key(start_ms, key, move |k| {
            let expired = store.is_expired(k);
            let name = &store.spec.name;
            let corrupt = |reason| StateError::Corrupt {
                store: name.clone(),
                reason,
            };
            let entry = match store.dirty.entry_ref(k) {
                EntryRef::Occupied(o) => {
                    let entry = o.into_mut();
                    let decoded =
                        matches!(entry, Dirty::Decoded(value) if value.as_any().is::<T>());
                    if !decoded {
                        let stored = if expired { None } else { entry.stored(name)? };
                        *entry = Dirty::Decoded(Box::new(load(stored).map_err(corrupt)?));
                    }
                    entry
                }
                EntryRef::Vacant(v) => {
                    let stored = if expired {
                        None
                    } else {
                        read_committed(db, dir, name, &store.clean, k, in_db)?
                    };
                    v.insert(Dirty::Decoded(Box::new(load(stored).map_err(corrupt)?)))
                }
            };
            match entry {
                Dirty::Decoded(value) => Ok(value
                    .as_any_mut()
                    .downcast_mut::<T>()
                    .expect("decoded entry of the type checked")),
                Dirty::Encoded(_) => unreachable!("decoded above"),
            }
        })
    }

    /// The decoded value of type `T` the write cache holds for one window of
    /// a key (see [`TaskState::window_update`]), if any.
    pub fn window_decoded<T: CachedValue>(
        &self,
        id: StoreId,
        key: &[u8],
        start_ms: i64,
    ) -> Option<&T> {
        with_window_key(start_ms, key, |k| match self.stores[id.0].dirty.get(k) {
            Some(Dirty::Decoded(value)) => value.as_any().downcast_ref::<T>(),
            _ => None,
        })
    }

    /// All windows with `from_ms <= start < to_ms`, in (start, key) order,
    /// merging the write cache over RocksDB.
    pub fn window_range(
        &self,
        id: StoreId,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<Vec<WindowEntry>, StateError> {
        let lo = encode_window_key(from_ms, b"");
        let hi = encode_window_key(to_ms, b"");
        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        for item in self
            .db
            .iterator_cf(self.cf(id), IteratorMode::From(&lo, Direction::Forward))
        {
            let (k, v) = item.map_err(|e| self.rocks_err(e))?;
            if k.as_ref() >= hi.as_slice() {
                break;
            }
            merged.insert(k.to_vec(), v.to_vec());
        }
        let range = lo.as_slice()..hi.as_slice();
        for (k, v) in self.stores[id.0]
            .dirty
            .iter()
            .filter(|(k, _)| range.contains(&k.as_slice()))
        {
            match v.encoded() {
                Some(v) => merged.insert(k.clone(), v.into_owned()),
                None => merged.remove(k),
            };
        }
        let store = &self.stores[id.0];
        let name = &store.spec.name;
        merged
            .into_iter()
            .filter(|(k, _)| k.len() >= window_key_prefix_len() && !store.is_expired(k))
            .map(|(k, v)| {
                let (start_ms, key) = decode_window_key(&k).expect("length checked");
                Ok(WindowEntry {
                    start_ms,
                    key: key.to_vec(),
                    value: StoredValue::decode(name, &v)?,
                })
            })
            .collect()
    }

    /// All entries of a key-value store whose key starts with `prefix`, merging
    /// the write cache over RocksDB.
    pub fn prefix_scan(
        &self,
        id: StoreId,
        prefix: &[u8],
    ) -> Result<Vec<(Vec<u8>, StoredValue)>, StateError> {
        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        for item in self
            .db
            .iterator_cf(self.cf(id), IteratorMode::From(prefix, Direction::Forward))
        {
            let (k, v) = item.map_err(|e| self.rocks_err(e))?;
            if !k.starts_with(prefix) {
                break;
            }
            merged.insert(k.to_vec(), v.to_vec());
        }
        for (k, v) in self.stores[id.0]
            .dirty
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
        {
            match v.encoded() {
                Some(v) => merged.insert(k.clone(), v.into_owned()),
                None => merged.remove(k),
            };
        }
        let name = &self.stores[id.0].spec.name;
        merged
            .into_iter()
            .map(|(k, v)| Ok((k, StoredValue::decode(name, &v)?)))
            .collect()
    }

    /// Up to `limit` entries of a key-value store with keys after `after`
    /// (from the first key when `None`), in key order, merging the write cache
    /// over RocksDB. For incremental sweeps.
    pub fn scan_after(
        &self,
        id: StoreId,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, StoredValue)>, StateError> {
        let mode = match after {
            Some(k) => IteratorMode::From(k, Direction::Forward),
            None => IteratorMode::Start,
        };
        let mut merged: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        for item in self.db.iterator_cf(self.cf(id), mode) {
            let (k, v) = item.map_err(|e| self.rocks_err(e))?;
            if after.is_some_and(|a| k.as_ref() <= a) {
                continue;
            }
            merged.insert(k.to_vec(), Some(v.to_vec()));
            if merged.len() >= limit {
                break;
            }
        }
        let upper = merged.keys().next_back().cloned();
        let lower = match after {
            Some(a) => Bound::Excluded(a),
            None => Bound::Unbounded,
        };
        let dirty_upper = match (&upper, merged.len() >= limit) {
            (Some(u), true) => Bound::Included(u.as_slice()),
            _ => Bound::Unbounded,
        };
        let bounds = (lower, dirty_upper);
        for (k, v) in self.stores[id.0]
            .dirty
            .iter()
            .filter(|(k, _)| RangeBounds::<[u8]>::contains(&bounds, k.as_slice()))
        {
            merged.insert(k.clone(), v.encoded().map(Cow::into_owned));
        }
        let name = &self.stores[id.0].spec.name;
        merged
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| (k, v)))
            .take(limit)
            .map(|(k, v)| Ok((k, StoredValue::decode(name, &v)?)))
            .collect()
    }

    /// Expires windows that started before `before_ms`: they leave the
    /// caches and reads at once, and RocksDB at the next local commit (so
    /// local state never runs ahead of the commit). Windowed changelogs expire
    /// by topic retention, so no tombstones are written.
    pub fn expire_windows(&mut self, id: StoreId, before_ms: i64) -> Result<(), StateError> {
        let store = &mut self.stores[id.0];
        if before_ms <= store.expire_before {
            return Ok(());
        }
        store.expire_before = before_ms;
        let expired = |k: &[u8]| decode_window_key(k).is_some_and(|(start, _)| start < before_ms);
        store.dirty.retain(|k, _| !expired(k));
        let before = store.clean_bytes;
        store.clean.retain(|k, v| {
            let keep = !expired(k);
            if !keep {
                store.clean_bytes -= cache_charge(k, v);
            }
            keep
        });
        self.cache_fill
            .fetch_sub(before - store.clean_bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Number of dirty entries across stores (the write cache fill).
    pub fn dirty_len(&self) -> usize {
        self.stores.iter().map(|s| s.dirty.len()).sum()
    }

    /// The records the changelogs need for everything written since the last
    /// local commit (coalesced: one record per dirty key). The dirty entries stay
    /// readable until [`TaskState::commit_local`] or [`TaskState::discard_dirty`].
    /// Decoded entries are encoded here, once.
    pub fn flush_changelog(&mut self) -> Vec<ChangelogRecord> {
        let mut out = Vec::new();
        for (i, store) in self.stores.iter_mut().enumerate() {
            store.dirty.values_mut().for_each(Dirty::settle);
            if !store.spec.changelogged {
                continue;
            }
            out.extend(store.dirty.iter().map(|(k, v)| ChangelogRecord {
                store: StoreId(i),
                key: k.clone(),
                value: v.encoded().map(Cow::into_owned),
            }));
        }
        out
    }

    /// Writes the dirty entries to RocksDB after the changelog records for them
    /// were committed, and advances the checkpoint to `changelog_next` (next
    /// changelog offset per store, for stores that wrote this round).
    pub fn commit_local(
        &mut self,
        changelog_next: &HashMap<StoreId, i64>,
    ) -> Result<(), StateError> {
        let mut batch = WriteBatch::default();
        for store in &mut self.stores {
            let cf = column_family(&self.db, &store.spec.name);
            if store.expire_before > store.expired_in_db {
                batch.delete_range_cf(
                    cf,
                    encode_window_key(i64::MIN, b""),
                    encode_window_key(store.expire_before, b""),
                );
                store.expired_in_db = store.expire_before;
            }
            for (k, v) in store.sorted_dirty() {
                match v.encoded() {
                    Some(v) => batch.put_cf(cf, k, v),
                    None => batch.delete_cf(cf, k),
                }
            }
        }
        if !batch.is_empty() {
            self.db.write(batch).map_err(|e| self.rocks_err(e))?;
            // Into the WAL file (no sync): a crashed process loses nothing
            // the kernel has; a power loss may, and no checkpoint claims it.
            self.db.flush_wal(false).map_err(|e| self.rocks_err(e))?;
        }
        self.keep_committed();
        if !changelog_next.is_empty() {
            for (id, next) in changelog_next {
                let name = self.stores[id.0].spec.name.clone();
                self.checkpoint.offsets.insert(name, *next);
            }
            self.checkpoint_behind = true;
        }
        let due = self.last_checkpoint.elapsed() >= self.checkpoint_interval;
        if self.checkpoint_behind && due {
            self.write_checkpoint()?;
        }
        Ok(())
    }

    /// Moves the entries just written to RocksDB from the write cache into the
    /// record cache. A task whose cache takes the instance over its budget
    /// empties its own.
    fn keep_committed(&mut self) {
        let budget = self.cache_budget;
        let (mut added, mut freed) = (0usize, 0usize);
        for store in &mut self.stores {
            let cached = store.spec.cached && budget > 0;
            // Drained, not replaced: the write cache keeps its capacity.
            let mut dirty = std::mem::take(&mut store.dirty);
            for (k, v) in dirty.drain() {
                store.wrote(&k);
                match v.into_encoded() {
                    Some(v) if cached => {
                        let (a, f) = store.cache(k, v);
                        added += a;
                        freed += f;
                    }
                    _ => freed += store.uncache(&k),
                }
            }
            store.dirty = dirty;
        }
        let fill = self.cache_fill.fetch_add(added, Ordering::Relaxed) + added;
        if fill.saturating_sub(freed) > budget {
            freed += self.stores.iter_mut().map(Store::drop_clean).sum::<usize>();
        }
        self.cache_fill.fetch_sub(freed, Ordering::Relaxed);
    }

    /// Drops dirty entries (their transaction was aborted).
    pub fn discard_dirty(&mut self) {
        for store in &mut self.stores {
            store.dirty.clear();
        }
    }

    /// Writes the checkpoint, after syncing RocksDB's WAL: the checkpoint
    /// must never claim writes a power loss could still take away.
    fn write_checkpoint(&mut self) -> Result<(), StateError> {
        self.db.flush_wal(true).map_err(|e| self.rocks_err(e))?;
        self.checkpoint.store(&self.dir)?;
        self.last_checkpoint = std::time::Instant::now();
        self.checkpoint_behind = false;
        Ok(())
    }

    /// Changelog offset to restore a store from: its checkpoint, or 0.
    pub fn restore_offset(&self, id: StoreId) -> i64 {
        self.checkpoint
            .offsets
            .get(&self.stores[id.0].spec.name)
            .copied()
            .unwrap_or(0)
    }

    /// Wipes a store's local data (its checkpoint was past the changelog's end,
    /// so the changelog was recreated): it will be restored in full.
    pub fn wipe_store(&mut self, id: StoreId) -> Result<(), StateError> {
        let name = self.stores[id.0].spec.name.clone();
        let cf = self.cf(id);
        let mut batch = WriteBatch::default();
        for item in self.db.iterator_cf(cf, IteratorMode::Start) {
            let (k, _) = item.map_err(|e| self.rocks_err(e))?;
            batch.delete_cf(cf, k);
        }
        self.db.write(batch).map_err(|e| self.rocks_err(e))?;
        let store = &mut self.stores[id.0];
        store.dirty.clear();
        let freed = store.drop_clean();
        self.cache_fill.fetch_sub(freed, Ordering::Relaxed);
        store.newest_window = i64::MIN;
        store.expire_before = i64::MIN;
        store.expired_in_db = i64::MIN;
        self.checkpoint.offsets.remove(&name);
        self.checkpoint.store(&self.dir)
    }

    /// Applies restored changelog records (key, encoded value or tombstone)
    /// straight to RocksDB.
    pub fn apply_restored(
        &mut self,
        id: StoreId,
        records: &[(Vec<u8>, Option<Vec<u8>>)],
        stats: &mut RestoreStats,
    ) -> Result<(), StateError> {
        // In key order (stable: of two records of one key the later follows).
        let mut sorted: Vec<&(Vec<u8>, Option<Vec<u8>>)> = records.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        if sorted.len() >= INGEST_MIN_RECORDS {
            self.ingest_sorted(id, &sorted)?;
        } else {
            // RocksDB's memtable inserts a run of ascending keys from where
            // the last insert was, instead of searching from the top.
            let cf = self.cf(id);
            let mut batch = WriteBatch::default();
            for (k, v) in sorted {
                match v {
                    Some(v) => batch.put_cf(cf, k, v),
                    None => batch.delete_cf(cf, k),
                }
            }
            self.db.write(batch).map_err(|e| self.rocks_err(e))?;
        }
        let store = &mut self.stores[id.0];
        let mut freed = 0;
        for (k, _) in records {
            store.wrote(k);
            freed += store.uncache(k);
        }
        self.cache_fill.fetch_sub(freed, Ordering::Relaxed);
        stats.records += records.len() as u64;
        Ok(())
    }

    /// Writes sorted restored records (the last of each key kept) to a table
    /// file and ingests it: no memtable insert, no flush of it later.
    fn ingest_sorted(
        &mut self,
        id: StoreId,
        sorted: &[&(Vec<u8>, Option<Vec<u8>>)],
    ) -> Result<(), StateError> {
        let path = ingest_path(&self.dir, id);
        let mut writer = SstFileWriter::create(&self.cf_options);
        let written = (|| {
            writer.open(&path)?;
            for (i, (k, v)) in sorted.iter().enumerate() {
                if sorted.get(i + 1).is_some_and(|next| next.0 == *k) {
                    continue;
                }
                match v {
                    Some(v) => writer.put(k, v)?,
                    None => writer.delete(k)?,
                }
            }
            writer.finish()?;
            let mut opts = IngestExternalFileOptions::default();
            opts.set_move_files(true);
            self.db
                .ingest_external_file_cf_opts(self.cf(id), &opts, vec![&path])
        })();
        // Moved into the database, or left by a failure.
        let _ = std::fs::remove_file(&path);
        written.map_err(|e| self.rocks_err(e))
    }

    /// Notes a restore in progress or finished: the store holds its
    /// changelog up to `next_offset`. The checkpoint follows at most every
    /// checkpoint interval (and when the state closes), so a restore that is
    /// interrupted (a crash, a revocation) starts again near where it stopped
    /// instead of from the beginning; a finished restore does not wait for a
    /// WAL sync.
    pub fn restored_to(&mut self, id: StoreId, next_offset: i64) -> Result<(), StateError> {
        let name = &self.stores[id.0].spec.name;
        if self.checkpoint.offsets.get(name) == Some(&next_offset) {
            return Ok(());
        }
        self.checkpoint.offsets.insert(name.clone(), next_offset);
        self.checkpoint_behind = true;
        let due = self.last_checkpoint.elapsed() >= self.checkpoint_interval;
        if due {
            self.write_checkpoint()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RocksSettings;

    fn specs() -> Vec<StoreSpec> {
        vec![
            StoreSpec {
                name: "kv".into(),
                kind: StoreKind::KeyValue,
                changelogged: true,
                cached: true,
            },
            StoreSpec {
                name: "win".into(),
                kind: StoreKind::Window {
                    retention_ms: 10_000,
                },
                changelogged: true,
                cached: true,
            },
            StoreSpec {
                name: "scratch".into(),
                kind: StoreKind::KeyValue,
                changelogged: false,
                cached: false,
            },
        ]
    }

    #[test]
    fn writes_are_cached_until_local_commit_and_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let kv = st.store_id("kv").unwrap();
        let scratch = st.store_id("scratch").unwrap();
        st.put(kv, b"a".to_vec(), b"1");
        st.put(kv, b"a".to_vec(), b"2");
        st.put(kv, b"b".to_vec(), b"3");
        st.put(scratch, b"x".to_vec(), b"9");
        st.delete(kv, b"b".to_vec());
        assert_eq!(st.get(kv, b"a").unwrap().unwrap().value, b"2");
        assert_eq!(st.get(kv, b"b").unwrap(), None);
        // Coalesced: one record per dirty key, only for changelogged stores.
        let mut records = st.flush_changelog();
        records.sort_by(|a, b| a.key.cmp(&b.key));
        assert_eq!(records.len(), 2);
        assert_eq!(records[1].value, None);
        st.commit_local(&HashMap::from([(kv, 12)])).unwrap();
        assert_eq!(st.dirty_len(), 0);
        drop(st);

        let st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let got = st.get(kv, b"a").unwrap().unwrap();
        assert_eq!(got.value, b"2");
        assert_eq!(st.restore_offset(kv), 12);
        assert_eq!(st.get(scratch, b"x").unwrap().unwrap().value, b"9");
    }

    /// A counter kept decoded in the write cache: its bytes are the count,
    /// little-endian. `TAG` makes types that differ only in name.
    struct Num<const TAG: u8>(u64);

    type Counter = Num<0>;

    impl<const TAG: u8> CachedValue for Num<TAG> {
        fn encode(&self) -> Vec<u8> {
            self.0.to_le_bytes().to_vec()
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }

    /// Makes a counter from stored bytes, counting the loads.
    fn count_from(stored: Option<StoredValue>, loads: &mut u32) -> Result<Counter, String> {
        *loads += 1;
        Ok(Num::<0>(stored.map_or(0, |s| {
            u64::from_le_bytes(s.value.try_into().expect("8 bytes"))
        })))
    }

    #[test]
    fn decoded_window_values_are_loaded_once_per_commit_and_read_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let win = st.store_id("win").unwrap();
        let mut loads = 0;
        for _ in 0..5 {
            let c = st
                .window_update(win, b"k", 1_000, |s| count_from(s, &mut loads))
                .unwrap();
            c.0 += 1;
        }
        assert_eq!(loads, 1, "decoded once, then changed in place");
        assert_eq!(st.window_decoded::<Counter>(win, b"k", 1_000).unwrap().0, 5);
        // Every other read sees it as if written encoded.
        let got = st.window_get(win, b"k", 1_000).unwrap().unwrap();
        assert_eq!(got.value, 5u64.to_le_bytes().to_vec());
        let range = st.window_range(win, 0, 2_000).unwrap();
        assert_eq!(range.len(), 1);
        assert_eq!(range[0].value.value, 5u64.to_le_bytes());
        // The commit encodes it once, for the changelog and RocksDB alike.
        let records = st.flush_changelog();
        assert_eq!(records.len(), 1);
        let sent = StoredValue::decode("win", records[0].value.as_ref().unwrap()).unwrap();
        assert_eq!(sent.value, 5u64.to_le_bytes().to_vec());
        st.commit_local(&HashMap::from([(win, 1)])).unwrap();
        assert_eq!(
            st.window_decoded::<Counter>(win, b"k", 1_000).map(|c| c.0),
            None
        );
        // After the commit the next update loads the committed value again.
        st.window_update(win, b"k", 1_000, |s| count_from(s, &mut loads))
            .unwrap()
            .0 += 1;
        assert_eq!(loads, 2);
        st.discard_dirty();
        drop(st);
        let st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let got = st.window_get(win, b"k", 1_000).unwrap().unwrap();
        assert_eq!(got.value, 5u64.to_le_bytes(), "the aborted update is gone");
    }

    #[test]
    fn a_decoded_value_of_another_type_is_reloaded_from_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let win = st.store_id("win").unwrap();
        st.window_update(win, b"k", 0, |_| Ok(Num::<1>(7))).unwrap();
        let mut loads = 0;
        let c = st
            .window_update(win, b"k", 0, |s| count_from(s, &mut loads))
            .unwrap();
        assert_eq!((c.0, loads), (7, 1));
        let err = st
            .window_update(win, b"j", 0, |_| Err::<Counter, _>("bad bytes".into()))
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("win") && err.to_string().contains("bad bytes"),
            "{err}"
        );
    }

    #[test]
    fn an_update_loads_what_is_written_encoded_stored_or_expired() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let win = st.store_id("win").unwrap();
        let mut loads = 0;
        let mut bump = |st: &mut TaskState, start| {
            let c = st
                .window_update(win, b"k", start, |s| count_from(s, &mut loads))
                .unwrap();
            c.0 += 1;
            c.0
        };
        // Written encoded in this commit: the update starts from those bytes.
        st.window_put(win, b"k", 0, &40u64.to_le_bytes());
        assert_eq!(bump(&mut st, 0), 41);
        st.flush_changelog();
        st.commit_local(&HashMap::from([(win, 2)])).unwrap();
        drop(st);
        // Only in RocksDB (reopened: no cache holds it).
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        assert_eq!(bump(&mut st, 0), 42);
        assert_eq!(bump(&mut st, 60_000), 1, "a new window starts empty");
        // Expired: read as absent even though RocksDB still holds it.
        st.expire_windows(win, 60_000).unwrap();
        assert_eq!(bump(&mut st, 0), 1);
        assert_eq!(loads, 4);
    }

    #[test]
    fn discarded_writes_never_reach_rocksdb() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let kv = st.store_id("kv").unwrap();
        st.put(kv, b"a".to_vec(), b"1");
        st.discard_dirty();
        assert_eq!(st.get(kv, b"a").unwrap(), None);
    }

    #[test]
    fn window_range_merges_cache_and_expiry_removes_old_windows() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let w = st.store_id("win").unwrap();
        st.window_put(w, b"k1", 0, b"a");
        st.window_put(w, b"k2", 1000, b"b");
        st.commit_local(&HashMap::new()).unwrap();
        st.window_put(w, b"k1", 1000, b"c");
        st.window_put(w, b"k1", 2000, b"d");
        let got: Vec<(i64, Vec<u8>)> = st
            .window_range(w, 0, 2000)
            .unwrap()
            .into_iter()
            .map(|e| (e.start_ms, e.key))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, b"k1".to_vec()),
                (1000, b"k1".to_vec()),
                (1000, b"k2".to_vec())
            ]
        );
        st.expire_windows(w, 1000).unwrap();
        assert_eq!(st.window_get(w, b"k1", 0).unwrap(), None);
        assert_eq!(st.window_range(w, i64::MIN, i64::MAX).unwrap().len(), 3);
    }

    #[test]
    fn expiry_reaches_rocksdb_only_at_the_local_commit() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let w = st.store_id("win").unwrap();
        let kv = st.store_id("kv").unwrap();
        st.window_put(w, b"k", 0, b"a");
        st.window_put(w, b"k", 60_000, b"b");
        // A key just below every window key (as aggregation metadata uses).
        st.put(w, b"\0".to_vec(), b"meta");
        st.commit_local(&HashMap::from([(kv, 1), (w, 3)])).unwrap();
        st.expire_windows(w, 60_000).unwrap();
        assert_eq!(
            st.window_get(w, b"k", 0).unwrap(),
            None,
            "reads skip it at once"
        );
        assert_eq!(st.window_range(w, i64::MIN, i64::MAX).unwrap().len(), 1);
        // A crash before the commit: RocksDB still holds the window.
        drop(st);
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        assert_eq!(st.window_get(w, b"k", 0).unwrap().unwrap().value, b"a");
        st.expire_windows(w, 60_000).unwrap();
        st.commit_local(&HashMap::from([(w, 3)])).unwrap();
        drop(st);
        let st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        assert_eq!(st.window_get(w, b"k", 0).unwrap(), None);
        assert_eq!(st.window_get(w, b"k", 60_000).unwrap().unwrap().value, b"b");
        assert_eq!(
            st.get(w, b"\0").unwrap().unwrap().value,
            b"meta",
            "expiry keeps the metadata"
        );
    }

    #[test]
    fn state_without_a_checkpoint_naming_it_is_wiped_not_restored_over() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let kv = st.store_id("kv").unwrap();
        let scratch = st.store_id("scratch").unwrap();
        st.put(kv, b"a".to_vec(), b"1");
        st.put(scratch, b"s".to_vec(), b"1");
        st.commit_local(&HashMap::from([(kv, 1)])).unwrap();
        drop(st);
        // An unreadable checkpoint: the changelogged store starts empty (it is
        // restored in full); the store without a changelog keeps its data.
        std::fs::write(dir.path().join("checkpoint.json"), b"{torn").unwrap();
        let st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        assert_eq!(st.get(kv, b"a").unwrap(), None);
        assert_eq!(st.restore_offset(kv), 0);
        assert_eq!(st.get(scratch, b"s").unwrap().unwrap().value, b"1");
        drop(st);
        // No checkpoint at all, data present: the same.
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        st.put(kv, b"b".to_vec(), b"2");
        st.commit_local(&HashMap::new()).unwrap();
        drop(st);
        std::fs::remove_file(dir.path().join("checkpoint.json")).unwrap();
        let st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        assert_eq!(st.get(kv, b"b").unwrap(), None);
    }

    /// Copies a directory as the disk holds it (a power loss keeps what was
    /// written to files; what RocksDB still buffers is gone).
    fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_file() {
                std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
            }
        }
    }

    #[test]
    fn a_checkpoint_never_claims_writes_the_wal_does_not_hold() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(RocksSettings {
            checkpoint_interval: std::time::Duration::ZERO,
            ..Default::default()
        });
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let kv = st.store_id("kv").unwrap();
        st.put(kv, b"a".to_vec(), b"1");
        st.commit_local(&HashMap::from([(kv, 1)])).unwrap();
        st.put(kv, b"b".to_vec(), b"2");
        st.commit_local(&HashMap::from([(kv, 2)])).unwrap();
        // Written after the last checkpoint: may be lost, and is not claimed.
        st.put(kv, b"c".to_vec(), b"3");
        st.commit_local(&HashMap::new()).unwrap();
        // A checkpoint is due only an interval after the last one (or the
        // opening): the commits' offsets wait in memory (and are written
        // when the state closes).
        let throttled = tempfile::tempdir().unwrap();
        let mut t = TaskState::open(
            throttled.path(),
            &specs(),
            &RocksEnv::new(Default::default()),
        )
        .unwrap();
        t.put(kv, b"a".to_vec(), b"1");
        t.commit_local(&HashMap::from([(kv, 1)])).unwrap();
        t.put(kv, b"b".to_vec(), b"2");
        t.commit_local(&HashMap::from([(kv, 2)])).unwrap();
        assert!(matches!(
            Checkpoint::load(throttled.path()),
            LoadedCheckpoint::Missing
        ));
        drop(t);
        assert!(matches!(
            Checkpoint::load(throttled.path()),
            LoadedCheckpoint::Found(cp) if cp.offsets["kv"] == 2
        ));
        let copy = tempfile::tempdir().unwrap();
        copy_dir(dir.path(), copy.path());
        drop(st);
        let st = TaskState::open(copy.path(), &specs(), &env).unwrap();
        assert_eq!(st.restore_offset(kv), 2);
        assert_eq!(st.get(kv, b"a").unwrap().unwrap().value, b"1");
        assert_eq!(st.get(kv, b"b").unwrap().unwrap().value, b"2");
    }

    #[test]
    fn restore_applies_records() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let kv = st.store_id("kv").unwrap();
        let v = |o: u8| Some(encode_value(&[o]));
        let mut stats = RestoreStats::default();
        st.apply_restored(
            kv,
            &[
                (b"a".to_vec(), v(3)),
                (b"b".to_vec(), v(9)),
                (b"a".to_vec(), None),
            ],
            &mut stats,
        )
        .unwrap();
        st.restored_to(kv, 3).unwrap();
        assert_eq!(stats.records, 3);
        assert_eq!(st.get(kv, b"a").unwrap(), None);
        assert_eq!(st.get(kv, b"b").unwrap().unwrap().value, [9]);
        assert_eq!(st.restore_offset(kv), 3);
        st.wipe_store(kv).unwrap();
        assert_eq!(st.get(kv, b"b").unwrap(), None);
        assert_eq!(st.restore_offset(kv), 0);
    }

    /// Batches large enough are written to a table file and ingested: the
    /// last record of each key wins, within a batch and over what the store
    /// held (in its memtable or its files), tombstones included, and the
    /// result survives a reopen without a checkpoint's WAL sync.
    #[test]
    fn a_large_restored_batch_is_ingested_with_the_last_record_of_each_key() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let kv = st.store_id("kv").unwrap();
        let key = |i: u32| format!("k{i:05}").into_bytes();
        let mut expected: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        // Held before the restore: in the memtable, not flushed.
        for i in 0..1_000 {
            st.put(kv, key(i), &i.to_be_bytes());
            expected.insert(key(i), Some(i.to_be_bytes().to_vec()));
        }
        st.commit_local(&HashMap::new()).unwrap();
        let mut stats = RestoreStats::default();
        for round in 0..2u32 {
            let raw: Vec<(Vec<u8>, Option<Vec<u8>>)> = (0..INGEST_MIN_RECORDS as u32 * 2)
                .map(|n| {
                    let k = key((n * 7 + round) % 3_000);
                    (k, (n % 5 != 0).then(|| (n + round).to_be_bytes().to_vec()))
                })
                .collect();
            let batch: Vec<(Vec<u8>, Option<Vec<u8>>)> = raw
                .iter()
                .map(|(k, v)| (k.clone(), v.as_deref().map(encode_value)))
                .collect();
            expected.extend(raw);
            st.apply_restored(kv, &batch, &mut stats).unwrap();
        }
        st.restored_to(kv, 1).unwrap();
        let check = |st: &TaskState| {
            for i in 0..3_000 {
                let got = st.get(kv, &key(i)).unwrap().map(|e| e.value.to_vec());
                assert_eq!(got, expected.get(&key(i)).cloned().flatten(), "key {i}");
            }
        };
        check(&st);
        drop(st);
        // A file written and not ingested (the process stopped in between)
        // is removed at the next open.
        std::fs::write(ingest_path(dir.path(), kv), b"unfinished").unwrap();
        let st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        check(&st);
        let leftover = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("restore-"))
            .count();
        assert_eq!(
            leftover, 0,
            "the ingested file moved, the unfinished one removed"
        );
    }

    /// A restore interrupted (a crash, a revocation) goes on from its last
    /// checkpoint: what it applied before survives, and is not read again.
    #[test]
    fn an_interrupted_restore_goes_on_from_its_last_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let kv = st.store_id("kv").unwrap();
        let mut stats = RestoreStats::default();
        let first: Vec<(Vec<u8>, Option<Vec<u8>>)> = (0..100u8)
            .map(|i| (vec![i], Some(encode_value(&[i]))))
            .collect();
        st.apply_restored(kv, &first, &mut stats).unwrap();
        st.restored_to(kv, 100).unwrap();
        // Dies before the restore ends.
        drop(st);
        let st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        assert_eq!(st.restore_offset(kv), 100, "the next restore starts there");
        assert_eq!(st.get(kv, &[42]).unwrap().unwrap().value, [42]);
    }

    #[test]
    fn committed_entries_are_read_from_the_record_cache_within_its_budget() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(RocksSettings {
            record_cache_bytes: 4096,
            ..Default::default()
        });
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let kv = st.store_id("kv").unwrap();
        // A store without caching keeps nothing after its commit.
        let scratch = st.store_id("scratch").unwrap();
        st.put(scratch, b"s".to_vec(), b"1");
        st.commit_local(&HashMap::new()).unwrap();
        assert_eq!(env.record_cache_usage(), 0);
        assert_eq!(st.get(scratch, b"s").unwrap().unwrap().value, b"1");
        st.put(kv, b"a".to_vec(), b"1");
        st.commit_local(&HashMap::new()).unwrap();
        assert!(env.record_cache_usage() > 0);
        // Served from memory: RocksDB no longer has it.
        st.db.delete_cf(st.cf(kv), b"a").unwrap();
        assert_eq!(st.get(kv, b"a").unwrap().unwrap().value, b"1");
        // A deletion leaves the cache too.
        st.delete(kv, b"a".to_vec());
        st.commit_local(&HashMap::new()).unwrap();
        assert_eq!(st.get(kv, b"a").unwrap(), None);
        // Over the budget, the task's cache is emptied and reads go to RocksDB.
        for i in 0..100u32 {
            st.put(kv, i.to_be_bytes().to_vec(), &[7; 100]);
        }
        st.commit_local(&HashMap::new()).unwrap();
        assert!(env.record_cache_usage() <= 4096);
        for i in 0..100u32 {
            assert_eq!(
                st.get(kv, &i.to_be_bytes()).unwrap().unwrap().value,
                [7; 100]
            );
        }
        // A second task shares the budget; closing both returns it.
        let other_dir = tempfile::tempdir().unwrap();
        let mut other = TaskState::open(other_dir.path(), &specs(), &env).unwrap();
        other.put(kv, b"x".to_vec(), b"1");
        other.commit_local(&HashMap::new()).unwrap();
        assert!(env.record_cache_usage() > 0);
        drop(st);
        drop(other);
        assert_eq!(env.record_cache_usage(), 0);
    }

    #[test]
    fn window_reads_see_committed_reopened_restored_and_expired_windows() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let w = st.store_id("win").unwrap();
        st.window_put(w, b"k", 60_000, b"a");
        st.window_put(w, b"k", 120_000, b"b");
        st.commit_local(&HashMap::from([(w, 2)])).unwrap();
        assert_eq!(st.window_get(w, b"k", 60_000).unwrap().unwrap().value, b"a");
        // Expired windows leave the record cache as well as RocksDB.
        st.expire_windows(w, 120_000).unwrap();
        assert_eq!(st.window_get(w, b"k", 60_000).unwrap(), None);
        st.commit_local(&HashMap::new()).unwrap();
        drop(st);

        // Reopened: the newest window is found in RocksDB and still read.
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        assert_eq!(st.stores[w.0].newest_window, 120_000);
        assert_eq!(
            st.window_get(w, b"k", 120_000).unwrap().unwrap().value,
            b"b"
        );
        // Windows past the newest one are not looked up in RocksDB at all.
        st.db
            .put_cf(st.cf(w), encode_window_key(180_000, b"k"), b"stray")
            .unwrap();
        assert_eq!(st.window_get(w, b"k", 180_000).unwrap(), None);
        // Restored windows move the newest window forward and are read.
        let mut stats = RestoreStats::default();
        let restored = encode_value(b"r");
        st.apply_restored(
            w,
            &[(encode_window_key(240_000, b"k"), Some(restored))],
            &mut stats,
        )
        .unwrap();
        assert_eq!(
            st.window_get(w, b"k", 240_000).unwrap().unwrap().value,
            b"r"
        );
        // A wiped store holds no windows.
        st.wipe_store(w).unwrap();
        assert_eq!(st.window_get(w, b"k", 120_000).unwrap(), None);
        assert_eq!(st.stores[w.0].newest_window, i64::MIN);
    }

    #[test]
    fn scan_after_pages_through_cache_and_db() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let kv = st.store_id("kv").unwrap();
        for k in ["a", "c", "e"] {
            st.put(kv, k.as_bytes().to_vec(), b"1");
        }
        st.commit_local(&HashMap::new()).unwrap();
        st.put(kv, b"b".to_vec(), b"2");
        st.delete(kv, b"c".to_vec());
        let keys =
            |v: Vec<(Vec<u8>, StoredValue)>| v.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        assert_eq!(
            keys(st.scan_after(kv, None, 2).unwrap()),
            vec![b"a".to_vec(), b"b".to_vec()]
        );
        assert_eq!(
            keys(st.scan_after(kv, Some(b"b"), 2).unwrap()),
            vec![b"e".to_vec()]
        );
        assert!(st.scan_after(kv, Some(b"e"), 2).unwrap().is_empty());
    }

    #[test]
    fn prefix_scan_sees_cache_over_db() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), &specs(), &env).unwrap();
        let kv = st.store_id("kv").unwrap();
        st.put(kv, b"t1/a".to_vec(), b"1");
        st.put(kv, b"t1/b".to_vec(), b"2");
        st.put(kv, b"t2/a".to_vec(), b"3");
        st.commit_local(&HashMap::new()).unwrap();
        st.delete(kv, b"t1/a".to_vec());
        st.put(kv, b"t1/c".to_vec(), b"4");
        let keys: Vec<Vec<u8>> = st
            .prefix_scan(kv, b"t1/")
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(keys, vec![b"t1/b".to_vec(), b"t1/c".to_vec()]);
    }

    #[test]
    fn a_reader_sees_committed_windows_from_one_snapshot_and_closes_with_the_state() {
        let dir = tempfile::tempdir().unwrap();
        let env = RocksEnv::new(Default::default());
        let mut win_specs = specs();
        win_specs.push(StoreSpec {
            name: "win2".into(),
            kind: StoreKind::Window {
                retention_ms: 10_000,
            },
            changelogged: true,
            cached: false,
        });
        let mut st = TaskState::open(dir.path(), &win_specs, &env).unwrap();
        let (win, win2) = (st.store_id("win").unwrap(), st.store_id("win2").unwrap());
        let reader = st.reader();
        let range = |store, from_ms, to_ms| crate::WindowRange {
            store,
            from_ms,
            to_ms,
        };
        let values = |r: &StoreReader, key: &[u8]| -> Vec<Vec<(i64, Vec<u8>)>> {
            r.fetch_windows(key, &[range("win", 0, 10_000), range("win2", 1_000, 2_000)])
                .unwrap()
                .into_iter()
                .map(|w| w.into_iter().map(|(s, v)| (s, v.value)).collect())
                .collect()
        };
        // Neighbours on both sides of the key, in several windows.
        for (start, key, v) in [
            (0, &b"a"[..], &b"a0"[..]),
            (0, b"b", b"b0"),
            (1_000, b"ab", b"ab1"),
            (1_000, b"c", b"c1"),
            (3_000, b"b", b"b3"),
            (9_000, b"b", b"b9"),
            (10_000, b"b", b"b10"),
        ] {
            st.window_put(win, key, start, v);
        }
        st.window_put(win2, b"b", 1_000, b"x1");
        assert_eq!(
            values(&reader, b"b"),
            vec![vec![], vec![]],
            "uncommitted writes are not visible"
        );
        st.commit_local(&HashMap::from([(win, 7), (win2, 1)]))
            .unwrap();
        assert_eq!(
            values(&reader, b"b"),
            vec![
                vec![
                    (0, b"b0".to_vec()),
                    (3_000, b"b3".to_vec()),
                    (9_000, b"b9".to_vec())
                ],
                vec![(1_000, b"x1".to_vec())],
            ]
        );
        assert_eq!(values(&reader, b"zz"), vec![vec![], vec![]]);
        assert!(matches!(
            reader.fetch_windows(b"b", &[range("kv", 0, 1)]),
            Err(StateError::UnknownStore(_))
        ));
        // A write after the commit stays invisible until the next one.
        st.window_put(win, b"b", 3_000, b"b3'");
        assert_eq!(values(&reader, b"b")[0][1].1, b"b3".to_vec());
        drop(st);
        assert!(!reader.is_open());
        assert!(matches!(
            reader.fetch_windows(b"b", &[range("win", 0, 1)]),
            Err(StateError::Closed)
        ));
        // The reader kept nothing open: the directory opens again.
        let st = TaskState::open(dir.path(), &win_specs, &env).unwrap();
        assert_eq!(values(&st.reader(), b"b")[0].len(), 3);
    }
}
