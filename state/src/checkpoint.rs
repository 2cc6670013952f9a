//! Per-task checkpoint file: for each store, the changelog offset up to which the
//! local RocksDB state is known to be complete. Restore starts there.
//!
//! The file is replaced atomically and durably (temp file fsynced, renamed, the
//! directory fsynced), and is written only after the writes it covers are synced
//! in RocksDB's WAL, so after a power loss it never claims more than the store
//! holds.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::StateError;

const FILE: &str = "checkpoint.json";

/// Changelog offsets (next offset to read) per store name. (Files of
/// earlier versions also hold input positions; they are ignored.)
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Store name → next changelog offset to restore from.
    pub offsets: BTreeMap<String, i64>,
}

/// What reading a task directory's checkpoint found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadedCheckpoint {
    /// No checkpoint file: nothing local is known to be complete.
    Missing,
    /// A readable checkpoint.
    Found(Checkpoint),
    /// A file that cannot be read or parsed: the local state cannot be trusted.
    Unreadable(String),
}

impl Checkpoint {
    fn path(dir: &Path) -> PathBuf {
        dir.join(FILE)
    }

    /// Reads the checkpoint of a task directory.
    pub fn load(dir: &Path) -> LoadedCheckpoint {
        match std::fs::read(Self::path(dir)) {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(cp) => LoadedCheckpoint::Found(cp),
                Err(e) => LoadedCheckpoint::Unreadable(e.to_string()),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => LoadedCheckpoint::Missing,
            Err(e) => LoadedCheckpoint::Unreadable(e.to_string()),
        }
    }

    /// Writes the checkpoint atomically and durably: a temp file written and
    /// fsynced, renamed over the old one, then the directory fsynced so the
    /// rename itself survives a power loss.
    pub fn store(&self, dir: &Path) -> Result<(), StateError> {
        let path = Self::path(dir);
        let tmp = dir.join(format!("{FILE}.tmp"));
        let io = |source| StateError::Io {
            path: path.clone(),
            source,
        };
        let bytes = serde_json::to_vec(self).expect("checkpoint serializes");
        let mut file = std::fs::File::create(&tmp).map_err(io)?;
        file.write_all(&bytes).map_err(io)?;
        file.sync_all().map_err(io)?;
        drop(file);
        std::fs::rename(&tmp, &path).map_err(io)?;
        sync_dir(dir).map_err(io)
    }

    /// Removes the checkpoint file (the state must be restored in full).
    pub fn remove(dir: &Path) -> Result<(), StateError> {
        let path = Self::path(dir);
        match std::fs::remove_file(&path) {
            Ok(()) => sync_dir(dir).map_err(|source| StateError::Io { path, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(StateError::Io { path, source }),
        }
    }
}

/// Fsyncs a directory, making renames and removals in it durable.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_and_load() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Checkpoint::load(dir.path()), LoadedCheckpoint::Missing);
        let mut cp = Checkpoint::default();
        cp.offsets.insert("counts".into(), 41);
        cp.store(dir.path()).unwrap();
        assert_eq!(
            Checkpoint::load(dir.path()),
            LoadedCheckpoint::Found(cp.clone())
        );
        assert!(!dir.path().join(format!("{FILE}.tmp")).exists());
        std::fs::write(dir.path().join(FILE), b"{not json").unwrap();
        assert!(matches!(
            Checkpoint::load(dir.path()),
            LoadedCheckpoint::Unreadable(_)
        ));
        Checkpoint::remove(dir.path()).unwrap();
        assert_eq!(Checkpoint::load(dir.path()), LoadedCheckpoint::Missing);
        Checkpoint::remove(dir.path()).unwrap();
    }
}
