//! Errors of the state layer.

use std::path::PathBuf;

/// A failure of a state store. All are fatal for the task that owns the store:
/// the runtime closes the task and lets the group reassign it.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// RocksDB refused an operation.
    #[error("rocksdb error in {path}: {source}")]
    Rocks {
        /// The task's state directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: rocksdb::Error,
    },
    /// Reading or writing a file in the state directory failed.
    #[error("state directory i/o error at {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A stored value or changelog record could not be decoded.
    #[error("corrupt state record in store {store}: {reason}")]
    Corrupt {
        /// The store name.
        store: String,
        /// What was wrong.
        reason: String,
    },
    /// A store name that the task does not have.
    #[error("unknown store {0}")]
    UnknownStore(String),
    /// The task's state was closed (a [`crate::StoreReader`] outlived it).
    #[error("the task's state is closed")]
    Closed,
}
