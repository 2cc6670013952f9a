//! Runtime configuration of a stream application.

use std::path::PathBuf;
use std::time::Duration;

use sluice_state::RocksSettings;

use super::claim::ClaimKey;
use crate::guarantee::Guarantee;
use crate::offsets::MAX_IN_FLIGHT_PER_PARTITION;
use crate::partitions::KeyPartitioner;
use crate::TopologyError;

/// The consumer group protocol, and with it how rebalances move partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupProtocol {
    /// Kafka's consumer protocol (KIP-848, brokers 4.0 and later): the
    /// broker assigns partitions with its `range` assignor (sticky, and
    /// co-partitioning: partition `p` of every input topic goes to the same
    /// instance, as a task needs) and a rebalance revokes only the partitions
    /// that move, so every other task keeps running, its calls in flight.
    /// The session timeout is the group's (the broker's
    /// `group.consumer.session.timeout.ms`, or the group config
    /// `consumer.session.timeout.ms`), not `session_timeout`.
    Consumer,
    /// The classic protocol with the eager `range` assignor: every rebalance
    /// revokes every partition of every instance (tasks that stay are
    /// suspended and resumed). For brokers older than 4.0. The
    /// cooperative-sticky assignor is not offered: it does not keep a task's
    /// partitions of different topics together.
    Classic,
}

/// Everything the runtime needs besides the topology.
#[derive(Clone, Debug)]
pub struct StreamsConfig {
    /// Application id: the consumer group, the prefix of internal topics and
    /// transactional ids.
    pub application_id: String,
    /// Kafka bootstrap servers.
    pub bootstrap_servers: String,
    /// Processing guarantee.
    pub guarantee: Guarantee,
    /// How often to commit; `None` for the guarantee's default.
    pub commit_interval: Option<Duration>,
    /// Directory for task state (one subdirectory per task).
    pub state_dir: PathBuf,
    /// A partition is paused when this many of its records are in flight
    /// (at most [`MAX_IN_FLIGHT_PER_PARTITION`]: a commit's progress
    /// record names the unfinished ones).
    pub max_in_flight_per_partition: usize,
    /// Threads that process tasks in parallel when several have records
    /// waiting (the driver thread is one of them). Defaults to the number of
    /// cores; 1 processes every task on the driver thread.
    pub processing_threads: usize,
    /// How long revocation waits for in-flight work before abandoning it.
    pub drain_timeout: Duration,
    /// Interval of punctuation ticks.
    pub punctuate_interval: Duration,
    /// Dirty entries a task's write cache holds before forcing a commit.
    pub cache_max_entries: usize,
    /// Replication factor of internal topics; -1 for the cluster's default
    /// (`default.replication.factor`).
    pub replication_factor: i32,
    /// Partitions of repartition topics; `None` for the writer's partition count.
    pub repartition_partitions: Option<i32>,
    /// How often the records of repartition topics below their reading
    /// tasks' committed offsets are deleted (Kafka Streams'
    /// `repartition.purge.interval.ms`).
    pub repartition_purge_interval: Duration,
    /// Extra retention of windowed changelogs beyond the store retention.
    pub windowed_changelog_extra_retention: Duration,
    /// The consumer group protocol.
    pub group_protocol: GroupProtocol,
    /// Static membership (`group.instance.id`): an instance that leaves and
    /// comes back under the same id within the session timeout gets its
    /// partitions back without a rebalance (a pod's name in a StatefulSet).
    /// At most one running instance may use an id.
    pub group_instance_id: Option<String>,
    /// Consumer group session timeout (the classic protocol's; under the
    /// consumer protocol the broker's group config decides).
    pub session_timeout: Duration,
    /// Maximum interval between polls before the member is evicted.
    pub max_poll_interval: Duration,
    /// Transaction timeout (exactly-once).
    pub transaction_timeout: Duration,
    /// Where other instances reach this one for interactive queries (Kafka
    /// Streams' `application.server`), e.g. `http://pod-0.sluice:8080`. Set,
    /// the instance publishes which source partitions it holds on the
    /// internal topic `<application_id>-instances` and follows what the
    /// others publish there, so [`crate::runtime::Queries::metadata_for_key`]
    /// can name the instance that holds any key. `None`: only this
    /// instance's own keys are known.
    pub application_server: Option<String>,
    /// How the producers of the source topics partition keys (to find the
    /// partition, and so the task, of a key in interactive queries).
    /// Repartition topics are written by the engine with murmur2 whatever
    /// this says, except those written with
    /// [`crate::KStream::repartition_partitioned`].
    pub key_partitioner: KeyPartitioner,
    /// How often an instance with an `application_server` publishes its
    /// partitions even when they did not change. A claim not renewed for
    /// three times this or three session timeouts, whichever is longer,
    /// counts as gone.
    pub instance_claim_interval: Duration,
    /// The secret the instances sign their claims with; set, claims it did
    /// not sign are ignored (see [`crate::runtime::ClaimKey`]). `None`: any
    /// claim on the instances topic is believed (protect it with ACLs).
    pub instance_claim_key: Option<ClaimKey>,
    /// Extra librdkafka properties for every client.
    pub client_overrides: crate::redact::Properties,
    /// Extra librdkafka properties for the main consumer.
    pub consumer_overrides: crate::redact::Properties,
    /// Extra librdkafka properties for producers.
    pub producer_overrides: crate::redact::Properties,
    /// RocksDB memory bounds.
    pub rocksdb: RocksSettings,
}

impl StreamsConfig {
    /// A configuration with defaults for everything but the essentials.
    pub fn new(
        application_id: &str,
        bootstrap_servers: &str,
        state_dir: impl Into<PathBuf>,
    ) -> Self {
        StreamsConfig {
            application_id: application_id.to_string(),
            bootstrap_servers: bootstrap_servers.to_string(),
            guarantee: Guarantee::AtLeastOnce,
            commit_interval: None,
            state_dir: state_dir.into(),
            max_in_flight_per_partition: 1000,
            processing_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            drain_timeout: Duration::from_secs(30),
            punctuate_interval: Duration::from_millis(50),
            cache_max_entries: 50_000,
            replication_factor: -1,
            repartition_partitions: None,
            repartition_purge_interval: Duration::from_secs(30),
            windowed_changelog_extra_retention: Duration::from_secs(24 * 3600),
            group_protocol: GroupProtocol::Consumer,
            group_instance_id: None,
            session_timeout: Duration::from_secs(45),
            max_poll_interval: Duration::from_secs(300),
            transaction_timeout: Duration::from_secs(60),
            application_server: None,
            key_partitioner: KeyPartitioner::Murmur2,
            instance_claim_interval: Duration::from_secs(5),
            instance_claim_key: None,
            client_overrides: Default::default(),
            consumer_overrides: Default::default(),
            producer_overrides: Default::default(),
            rocksdb: RocksSettings::default(),
        }
    }

    /// The effective commit interval.
    pub fn commit_interval(&self) -> Duration {
        self.commit_interval
            .unwrap_or_else(|| self.guarantee.default_commit_interval())
    }

    /// The largest record the producers send: their `message.max.bytes`
    /// (librdkafka's default unless overridden).
    pub fn max_record_bytes(&self) -> usize {
        self.producer_overrides
            .get("message.max.bytes")
            .or_else(|| self.client_overrides.get("message.max.bytes"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(crate::context::DEFAULT_MAX_RECORD_BYTES)
    }

    /// How long an instance's claim on its partitions lasts without renewal.
    pub fn instance_claim_timeout(&self) -> Duration {
        (3 * self.session_timeout).max(3 * self.instance_claim_interval)
    }

    /// Checks values the runtime depends on; the error names the key.
    pub fn validate(&self) -> Result<(), TopologyError> {
        let bad = |key: &str, reason: &str| {
            Err(TopologyError::Config {
                key: key.to_string(),
                reason: reason.to_string(),
            })
        };
        if self.application_id.is_empty()
            || !self
                .application_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        {
            return bad(
                "application_id",
                "must be non-empty and use only [A-Za-z0-9._-]",
            );
        }
        if self.bootstrap_servers.trim().is_empty() {
            return bad("bootstrap_servers", "must not be empty");
        }
        if !(1..=MAX_IN_FLIGHT_PER_PARTITION).contains(&self.max_in_flight_per_partition) {
            return bad(
                "max_in_flight_per_partition",
                &format!("must be between 1 and {}", MAX_IN_FLIGHT_PER_PARTITION),
            );
        }
        if self.processing_threads == 0 {
            return bad("processing_threads", "must be at least 1");
        }
        if self.commit_interval().is_zero() {
            return bad("commit_interval", "must be positive");
        }
        if self.replication_factor < 1 && self.replication_factor != -1 {
            return bad(
                "replication_factor",
                "must be at least 1, or -1 for the cluster's default",
            );
        }
        if self.session_timeout >= self.max_poll_interval {
            return bad("session_timeout", "must be below max_poll_interval");
        }
        if let Some(id) = &self.group_instance_id {
            if id.is_empty() || id.chars().any(char::is_whitespace) {
                return bad("group_instance_id", "must be a non-empty id without spaces");
            }
        }
        if let Some(server) = &self.application_server {
            if server.is_empty() || server.chars().any(char::is_whitespace) {
                return bad(
                    "application_server",
                    "must be a non-empty address without spaces",
                );
            }
        }
        if self.instance_claim_interval.is_zero() {
            return bad("instance_claim_interval", "must be positive");
        }
        Ok(())
    }
}
