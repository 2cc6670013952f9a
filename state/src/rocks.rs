//! RocksDB settings shared by every task of an instance: one block cache and one
//! write-buffer manager bound the memory of all task databases together.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rocksdb::{BlockBasedOptions, Cache, DBCompressionType, Options, WriteBufferManager};

/// Memory and tuning settings for the task databases of one instance.
#[derive(Clone, Debug)]
pub struct RocksSettings {
    /// Bytes of the block cache shared by all task databases.
    pub block_cache_bytes: usize,
    /// Bytes all memtables of all task databases may use together; charged to
    /// the block cache so the two share one bound.
    pub write_buffer_manager_bytes: usize,
    /// Memtable size per column family.
    pub write_buffer_bytes: usize,
    /// Background jobs per database.
    pub max_background_jobs: i32,
    /// Bytes of committed entries all tasks of the instance keep in memory
    /// over their stores (the record cache): repeated reads of recently
    /// written keys are answered without a RocksDB lookup. 0 turns it off.
    pub record_cache_bytes: usize,
    /// Least time between two checkpoints of a task (each syncs RocksDB's
    /// WAL and the checkpoint file to disk). Commits in between write RocksDB
    /// without syncing; after a crash the changelog tail since the last
    /// checkpoint is restored again. Zero checkpoints at every commit.
    pub checkpoint_interval: std::time::Duration,
}

impl Default for RocksSettings {
    fn default() -> Self {
        RocksSettings {
            block_cache_bytes: 64 << 20,
            write_buffer_manager_bytes: 32 << 20,
            write_buffer_bytes: 8 << 20,
            max_background_jobs: 2,
            record_cache_bytes: 16 << 20,
            checkpoint_interval: std::time::Duration::from_secs(5),
        }
    }
}

/// The shared RocksDB resources of one instance. Cheap to clone.
#[derive(Clone)]
pub struct RocksEnv {
    settings: RocksSettings,
    cache: Cache,
    write_buffers: WriteBufferManager,
    record_cache: Arc<AtomicUsize>,
}

impl std::fmt::Debug for RocksEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksEnv")
            .field("settings", &self.settings)
            .finish()
    }
}

impl RocksEnv {
    /// Creates the shared cache and write-buffer manager.
    pub fn new(settings: RocksSettings) -> Self {
        let cache = Cache::new_lru_cache(settings.block_cache_bytes);
        let write_buffers = WriteBufferManager::new_write_buffer_manager_with_cache(
            settings.write_buffer_manager_bytes,
            false,
            cache.clone(),
        );
        RocksEnv {
            settings,
            cache,
            write_buffers,
            record_cache: Arc::default(),
        }
    }

    /// Options for a task database.
    pub(crate) fn db_options(&self) -> Options {
        let mut opts = self.cf_options();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_max_background_jobs(self.settings.max_background_jobs);
        opts.set_write_buffer_manager(&self.write_buffers);
        // The WAL is written and synced at each checkpoint (see
        // `TaskState::commit_local`), not at each write: writes between
        // checkpoints are re-applied from the changelog after a crash anyway.
        opts.set_manual_wal_flush(true);
        opts.set_keep_log_file_num(2);
        opts.set_max_log_file_size(1 << 20);
        opts
    }

    /// Options for one store's column family.
    pub(crate) fn cf_options(&self) -> Options {
        let mut opts = Options::default();
        let mut table = BlockBasedOptions::default();
        table.set_block_cache(&self.cache);
        table.set_cache_index_and_filter_blocks(true);
        table.set_bloom_filter(10.0, false);
        opts.set_block_based_table_factory(&table);
        opts.set_write_buffer_size(self.settings.write_buffer_bytes);
        // A bloom filter over whole keys in the memtable: most lookups of an
        // aggregation are of keys not written yet (a new window), and the
        // filter answers those without a skiplist search. It is allocated
        // (and zeroed) whole with each memtable, whatever the store holds:
        // 2 % of the write buffer (164 KiB for 8 MiB, about 16 bits per key
        // of a full memtable of small entries) instead of 10 %, which cost
        // 0.8 MiB resident per store and task before a single write.
        opts.set_memtable_prefix_bloom_ratio(0.02);
        opts.set_memtable_whole_key_filtering(true);
        opts.set_max_write_buffer_number(3);
        opts.set_compression_type(DBCompressionType::Lz4);
        opts
    }

    /// Least time between two checkpoints of a task.
    pub(crate) fn checkpoint_interval(&self) -> std::time::Duration {
        self.settings.checkpoint_interval
    }

    /// The instance-wide budget of the record cache and its current fill.
    pub(crate) fn record_cache(&self) -> (usize, Arc<AtomicUsize>) {
        (self.settings.record_cache_bytes, self.record_cache.clone())
    }

    /// Bytes currently held by the record caches of all tasks.
    pub fn record_cache_usage(&self) -> usize {
        self.record_cache.load(Ordering::Relaxed)
    }

    /// Bytes currently held by the shared block cache.
    pub fn block_cache_usage(&self) -> usize {
        self.cache.get_usage()
    }
}
