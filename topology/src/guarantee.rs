//! The processing guarantees a topology runs under.

use std::time::Duration;

/// Processing guarantee.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Guarantee {
    /// Offsets are committed after outputs and changelogs were acknowledged;
    /// a crash may repeat output. Commits every 200 ms by default (cached
    /// aggregation results are forwarded at each commit).
    AtLeastOnce,
    /// Outputs, changelog writes and consumed offsets are committed atomically
    /// in Kafka transactions, one transactional id per task.
    ExactlyOnce,
}

impl Guarantee {
    /// The default commit interval for the guarantee.
    pub fn default_commit_interval(self) -> Duration {
        match self {
            Guarantee::AtLeastOnce => Duration::from_millis(200),
            Guarantee::ExactlyOnce => Duration::from_millis(100),
        }
    }
}
