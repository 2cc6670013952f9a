//! Why the runtime stopped, and the class of each error the runtime acts
//! on: a task migrated (closed dirty), a retriable request, a failed
//! delivery, a client given up on.

use crate::{ProcessError, TaskId, TopologyError};

/// Why the runtime stopped.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A Kafka client failed.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// A state store failed.
    #[error("state: {0}")]
    State(#[from] sluice_state::StateError),
    /// The topology or config is invalid.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// A record's processing failed in a way that stops the task.
    #[error("task {task}: {error}")]
    Process {
        /// The task.
        task: TaskId,
        /// What failed.
        error: ProcessError,
    },
    /// A restore was cancelled by a rebalance.
    #[error("cancelled")]
    Cancelled,
    /// A client call did not return within its bound (see
    /// `kafka::bounded`): the client is given up on.
    #[error("{0}; its client is given up")]
    Unanswered(String),
    /// A producer's flush ran out of time with records still unacknowledged
    /// (see `kafka::flush`): they are still on their way, so the flush may
    /// be retried.
    #[error("producer flush timed out with {unacknowledged} records unacknowledged")]
    FlushTimedOut {
        /// Records sent and not yet acknowledged.
        unacknowledged: i32,
    },
    /// Records sent were not delivered (the broker refused one, or its
    /// delivery timed out; see `kafka::flush`): a transaction holding them
    /// can only be aborted.
    #[error("delivery failed{}", .first.as_ref().map(|f| format!(" to {f}")).unwrap_or_default())]
    DeliveryFailed {
        /// The first failed delivery since the last flush (`topic/partition:
        /// error`), when it was seen.
        first: Option<String>,
    },
    /// The consumer has no group metadata to add offsets to a transaction
    /// with.
    #[error("no consumer group metadata")]
    NoGroupMetadata,
    /// A changelog partition could not be read on a queue of its own
    /// during a restore.
    #[error("cannot read {topic} on its own queue")]
    RestoreQueue {
        /// The changelog topic.
        topic: String,
    },
    /// A restore's record reached its consumer's own queue instead of the
    /// changelog partition's.
    #[error("restore of {topic}: a record reached the consumer's own queue")]
    RestoreStray {
        /// The changelog topic.
        topic: String,
    },
    /// A thread of the runtime could not be started.
    #[error("cannot start {0}")]
    NoThread(String),
    /// A thread of the runtime (or a client call on one) panicked.
    #[error("{0} panicked")]
    Panicked(String),
}

impl RuntimeError {
    /// The Kafka error code, if the error is a Kafka one with a code.
    fn kafka_code(&self) -> Option<rdkafka::error::RDKafkaErrorCode> {
        use rdkafka::error::KafkaError;
        match self {
            RuntimeError::Kafka(KafkaError::Transaction(e)) => Some(e.code()),
            RuntimeError::Kafka(e) => e.rdkafka_error_code(),
            _ => None,
        }
    }

    /// True when the error means another instance owns the task now (its
    /// producer was fenced) or its transaction must be aborted: the task is
    /// closed dirty and the instance carries on, as Kafka Streams does with a
    /// migrated task.
    pub(crate) fn task_migrated(&self) -> bool {
        use rdkafka::error::{KafkaError, RDKafkaErrorCode as C};
        if let RuntimeError::Kafka(KafkaError::Transaction(e)) = self {
            if e.txn_requires_abort() {
                return true;
            }
        }
        self.fenced()
            || matches!(
                self.kafka_code(),
                Some(
                    C::InvalidProducerIdMapping
                        | C::UnknownProducerId
                        | C::OutOfOrderSequenceNumber
                        | C::IllegalGeneration
                        | C::UnknownMemberId
                        | C::RebalanceInProgress
                )
            )
    }

    /// True when Kafka calls the error retriable (a request timed out, the
    /// coordinator moved or is loading, a broker connection dropped): the
    /// same request may succeed when made again.
    pub(crate) fn retriable(&self) -> bool {
        use rdkafka::error::{KafkaError, RDKafkaErrorCode as C};
        if let RuntimeError::Kafka(KafkaError::Transaction(e)) = self {
            if e.is_retriable() {
                return true;
            }
        }
        if let RuntimeError::FlushTimedOut { .. } = self {
            // The records are still on their way.
            return true;
        }
        matches!(
            self.kafka_code(),
            Some(
                C::RequestTimedOut
                    | C::OperationTimedOut
                    | C::NotCoordinator
                    | C::CoordinatorNotAvailable
                    | C::CoordinatorLoadInProgress
                    | C::NetworkException
                    | C::BrokerTransportFailure
                    | C::AllBrokersDown
                    | C::NotEnoughReplicas
                    | C::NotEnoughReplicasAfterAppend
                    | C::ConcurrentTransactions
                    | C::LeaderNotAvailable
                    | C::NotLeaderForPartition
            )
        )
    }

    /// True when records of a transaction were not delivered (see
    /// `kafka::flush`): the transaction can only be aborted.
    pub(crate) fn delivery_failed(&self) -> bool {
        matches!(self, RuntimeError::DeliveryFailed { .. })
    }

    /// True when a client call did not return within its bound: the client
    /// takes no further call.
    pub(crate) fn unanswered(&self) -> bool {
        matches!(self, RuntimeError::Unanswered(_))
    }

    /// True when a newer producer with the task's transactional id fenced
    /// this one: its transaction cannot be ended any more (the new owner's
    /// `init_transactions` did that).
    pub(crate) fn fenced(&self) -> bool {
        self.kafka_code().is_some_and(is_fencing_code)
    }
}

/// Whether a Kafka error code says the producer was fenced.
pub(crate) fn is_fencing_code(code: rdkafka::error::RDKafkaErrorCode) -> bool {
    use rdkafka::error::RDKafkaErrorCode as C;
    matches!(
        code,
        C::ProducerFenced | C::Fenced | C::InvalidProducerEpoch
    )
}
