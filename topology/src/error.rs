//! Errors: those that stop a topology from starting, and those a record's
//! processing can end with (each with the class the runtime acts on).

use sluice_state::StateError;

/// The topology or its configuration cannot run. Reported at start.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// The topology is malformed (e.g. a store used by two sub-topologies).
    #[error("invalid topology: {0}")]
    Invalid(String),
    /// Inputs that must be co-partitioned are not.
    #[error("sources {topics:?} of sub-topology {subtopology} must be co-partitioned, but have partition counts {counts:?}")]
    NotCoPartitioned {
        /// The sub-topology.
        subtopology: usize,
        /// Its source topics.
        topics: Vec<String>,
        /// Their partition counts, in the same order.
        counts: Vec<i32>,
    },
    /// A source topic does not exist.
    #[error("source topic {0} does not exist")]
    MissingTopic(String),
    /// A configuration value is invalid.
    #[error("invalid config {key}: {reason}")]
    Config {
        /// The config key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// Kafka refused an operation needed to start.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// State could not be opened.
    #[error("state: {0}")]
    State(#[from] StateError),
}

/// How the processing of one record ended badly.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The record cannot be processed: send its original bytes to the source's
    /// dead-letter topic with this reason and category, and go on.
    #[error("dead letter ({category}): {reason}")]
    DeadLetter {
        /// Short machine-readable reason; never payload text.
        reason: String,
        /// Category, e.g. `poison`.
        category: String,
    },
    /// A store failed; the task stops.
    #[error("state: {0}")]
    State(#[from] StateError),
    /// Anything else that must stop the task.
    #[error("fatal: {0}")]
    Fatal(String),
}

impl ProcessError {
    /// A dead-letter outcome.
    pub fn dead_letter(reason: impl Into<String>, category: impl Into<String>) -> Self {
        ProcessError::DeadLetter {
            reason: reason.into(),
            category: category.into(),
        }
    }
}
