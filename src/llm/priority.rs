//! [`Priority`]: the class a call waits in at its model's limiter.

use serde::{Deserialize, Serialize};

/// The priority a call waits at in its model's limiter: `high` is served
/// first, `batch` last but never starved (weighted fair queueing). A task's
/// `priority` on the wire is this value.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Interactive work.
    High,
    /// The default.
    #[default]
    Normal,
    /// Bulk work that may wait.
    Batch,
}

impl Priority {
    /// Every priority, highest first.
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Batch];

    /// The wire name (`high`, `normal`, `batch`), also used as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Batch => "batch",
        }
    }

    /// Dense index (0 = high) for per-priority arrays.
    pub fn index(self) -> usize {
        match self {
            Priority::High => 0,
            Priority::Normal => 1,
            Priority::Batch => 2,
        }
    }
}
