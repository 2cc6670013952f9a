//! RocksDB state stores for stream tasks: key-value and window stores behind a
//! write cache, the records their changelogs need, restore from those changelogs,
//! and per-task checkpoint files.
//!
//! The crate knows nothing about Kafka: the runtime in `sluice-topology` sends the
//! records [`TaskState::flush_changelog`] hands it, commits, then calls
//! [`TaskState::commit_local`]. Local state therefore never holds anything its
//! changelog lacks, so an unclean shutdown never forces a wipe: restore replays
//! the changelog tail from the checkpoint, and replaying is idempotent.
//!
//! Which input the state reflects is the topology crate's to say: each commit
//! writes a progress record into the task's own store.

mod checkpoint;
mod error;
mod reader;
mod rocks;
mod task_state;
mod value;
mod window;

pub use checkpoint::{Checkpoint, LoadedCheckpoint};
pub use error::StateError;
pub use reader::{StoreReader, WindowRange};
pub use rocks::{RocksEnv, RocksSettings};
pub use task_state::{
    CachedValue, ChangelogRecord, RestoreStats, StoreId, StoreKind, StoreSpec, TaskState,
};
pub use value::{Position, StoredValue};
pub use window::{decode_window_key, encode_window_key, window_key_prefix_len, WindowEntry};
