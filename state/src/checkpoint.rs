//! Per-task checkpoint file: for each store, the changelog offset up to which the
//! local RocksDB state is known to be complete. Restore starts there.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::StateError;

const FILE: &str = "checkpoint.json";

/// Changelog offsets (next offset to read) per store name, and the highest
/// input offset per source reflected in the local state they cover.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Store name → next changelog offset to restore from.
    pub offsets: BTreeMap<String, i64>,
    /// Source id → highest input offset reflected in local state.
    #[serde(default)]
    pub positions: BTreeMap<u32, i64>,
}

impl Checkpoint {
    fn path(dir: &Path) -> PathBuf {
        dir.join(FILE)
    }

    /// Reads the checkpoint of a task directory; an absent or unreadable file
    /// means "restore everything".
    pub fn load(dir: &Path) -> Checkpoint {
        match std::fs::read(Self::path(dir)) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!(dir = %dir.display(), error = %e, "ignoring unreadable checkpoint");
                Checkpoint::default()
            }),
            Err(_) => Checkpoint::default(),
        }
    }

    /// Writes the checkpoint atomically (temp file, then rename).
    pub fn store(&self, dir: &Path) -> Result<(), StateError> {
        let path = Self::path(dir);
        let tmp = dir.join(format!("{FILE}.tmp"));
        let io = |source| StateError::Io {
            path: path.clone(),
            source,
        };
        let bytes = serde_json::to_vec(self).expect("checkpoint serializes");
        std::fs::write(&tmp, bytes).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)
    }

    /// Removes the checkpoint file (the state must be restored in full).
    pub fn remove(dir: &Path) {
        let _ = std::fs::remove_file(Self::path(dir));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_and_load() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Checkpoint::load(dir.path()), Checkpoint::default());
        let mut cp = Checkpoint::default();
        cp.offsets.insert("counts".into(), 41);
        cp.store(dir.path()).unwrap();
        assert_eq!(Checkpoint::load(dir.path()), cp);
        std::fs::write(dir.path().join(FILE), b"{not json").unwrap();
        assert_eq!(Checkpoint::load(dir.path()), Checkpoint::default());
    }
}
