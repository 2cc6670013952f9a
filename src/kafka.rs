//! Small Kafka helpers for the command-line tools, the start-up checks and
//! the tests: creating topics, partition counts, producing with delivery
//! reports counted, reading topics from the beginning, and reading what
//! topics hold when a read starts (from the beginning or a time). Each takes a [`Cluster`]: the bootstrap
//! servers and the client properties (`[kafka.client]`: security protocol,
//! SASL, TLS) every client gets; a bare bootstrap address converts to one.
//! Also the `[kafka]` configuration section ([`KafkaSection`]).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{BorrowedMessage, DeliveryResult, Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{BaseRecord, Producer, ProducerContext};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use sluice_topology::runtime::{GroupProtocol, PolledProducer};

use crate::error::ConfigError;

/// `[kafka]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSection {
    /// Bootstrap servers, comma-separated.
    pub bootstrap_servers: String,
    /// The consumer group protocol: `consumer` (KIP-848, brokers 4.0 and
    /// later; incremental rebalances) or `classic` (eager rebalances).
    #[serde(default = "default_group_protocol")]
    pub group_protocol: GroupProtocol,
    /// Static membership: this instance's `group.instance.id` (the Helm chart
    /// sets the pod's name). An instance restarting under the same id within
    /// the session timeout gets its partitions back without a rebalance.
    #[serde(default)]
    pub group_instance_id: Option<String>,
    /// Consumer group session timeout, ms (the classic protocol's; under the
    /// consumer protocol the broker's `group.consumer.session.timeout.ms`
    /// decides).
    #[serde(default = "default_session_timeout_ms")]
    pub session_timeout_ms: u64,
    /// Maximum time between polls, ms.
    #[serde(default = "default_max_poll_interval_ms")]
    pub max_poll_interval_ms: u64,
    /// Transaction timeout, ms (exactly-once).
    #[serde(default = "default_transaction_timeout_ms")]
    pub transaction_timeout_ms: u64,
    /// Extra librdkafka properties for every client Sluice creates (the
    /// engine's, the start-up checks', `sluice topics create`'s), e.g.
    /// `security.protocol`, `sasl.mechanism`, `ssl.ca.location`. A key
    /// ending in `_file` names a file whose contents (trimmed) become the
    /// property without the suffix, e.g. `"sasl.password_file" =
    /// "/run/secrets/kafka-password"` sets `sasl.password`; the file is read
    /// at start-up.
    #[serde(default)]
    pub client: sluice_topology::redact::Properties,
}

/// Suffix of a `[kafka.client]` key whose value is read from a file.
const FILE_SUFFIX: &str = "_file";

impl KafkaSection {
    /// The bootstrap servers and client properties every client gets.
    pub fn cluster(&self) -> Cluster {
        Cluster {
            bootstrap: self.bootstrap_servers.clone(),
            client: self.client.clone(),
        }
    }

    /// Checks of the section's own keys.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.bootstrap_servers.trim().is_empty() {
            return Err(ConfigError::new(
                "kafka.bootstrap_servers",
                "must not be empty",
            ));
        }
        if let Some(id) = &self.group_instance_id {
            if id.trim().is_empty() || id.chars().any(char::is_whitespace) {
                return Err(ConfigError::new(
                    "kafka.group_instance_id",
                    "must be a non-empty id without spaces",
                ));
            }
        }
        if self.session_timeout_ms >= self.max_poll_interval_ms {
            return Err(ConfigError::new(
                "kafka.session_timeout_ms",
                "must be below kafka.max_poll_interval_ms",
            ));
        }
        Ok(())
    }

    /// Replaces each `<property>_file` of `[kafka.client]` by `<property>`
    /// holding the file's contents, trimmed.
    pub(crate) fn read_secret_files(&mut self) -> Result<(), ConfigError> {
        let files: Vec<(String, String)> = self
            .client
            .iter()
            .filter(|(k, _)| k.ends_with(FILE_SUFFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (key, path) in files {
            let name = format!("kafka.client.\"{key}\"");
            let property = key.trim_end_matches(FILE_SUFFIX).to_string();
            if property.is_empty() {
                return Err(ConfigError::new(name, "names no property"));
            }
            if self.client.contains_key(&property) {
                return Err(ConfigError::new(
                    name,
                    format!("set either {property} or {key}, not both"),
                ));
            }
            let text = std::fs::read_to_string(&path)
                .map_err(|e| ConfigError::new(name.clone(), format!("cannot read {path}: {e}")))?;
            let value = text.trim();
            if value.is_empty() {
                return Err(ConfigError::new(name, format!("{path} is empty")));
            }
            self.client.remove(&key);
            self.client.insert(property, value.to_string());
        }
        Ok(())
    }
}

fn default_group_protocol() -> GroupProtocol {
    GroupProtocol::Consumer
}

fn default_session_timeout_ms() -> u64 {
    10_000
}
fn default_max_poll_interval_ms() -> u64 {
    300_000
}
fn default_transaction_timeout_ms() -> u64 {
    60_000
}

/// A record to produce.
#[derive(Clone, Debug, Default)]
pub struct OutRecord {
    /// Key bytes.
    pub key: Option<Vec<u8>>,
    /// Value bytes.
    pub value: Option<Vec<u8>>,
    /// Timestamp, ms.
    pub timestamp: Option<i64>,
    /// Headers.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Explicit partition.
    pub partition: Option<i32>,
}

/// What a Kafka helper met.
#[derive(Debug, thiserror::Error)]
pub enum KafkaError {
    /// The client failed.
    #[error("kafka: {0}")]
    Client(#[from] rdkafka::error::KafkaError),
    /// The broker refused to create a topic.
    #[error("cannot create topic {name}: {code}")]
    CreateTopic {
        /// The topic.
        name: String,
        /// The broker's answer.
        code: RDKafkaErrorCode,
    },
    /// No broker answered; `reason` is the last error the client met (e.g.
    /// a failed TLS handshake).
    #[error("cannot reach the cluster at {bootstrap}: {reason}")]
    Unreachable {
        /// The bootstrap servers.
        bootstrap: String,
        /// What the client met.
        reason: String,
    },
    /// Records were not delivered (after the client's own retries).
    #[error("{failed} records not delivered, the first: {first}")]
    Undelivered {
        /// How many.
        failed: u64,
        /// The first failure.
        first: String,
    },
    /// Producing or flushing failed.
    #[error("{step}: {source}")]
    Produce {
        /// `produce` or `flush`.
        step: &'static str,
        /// The client's error.
        source: rdkafka::error::KafkaError,
    },
}

/// How to reach a cluster: its bootstrap servers and the librdkafka
/// properties every client gets.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    /// Bootstrap servers, comma-separated.
    pub bootstrap: String,
    /// Client properties (`security.protocol`, `sasl.*`, `ssl.*`, …).
    pub client: sluice_topology::redact::Properties,
}

impl From<&str> for Cluster {
    fn from(bootstrap: &str) -> Self {
        Cluster {
            bootstrap: bootstrap.to_string(),
            client: Default::default(),
        }
    }
}

impl From<&String> for Cluster {
    fn from(bootstrap: &String) -> Self {
        Cluster::from(bootstrap.as_str())
    }
}

impl From<&Cluster> for Cluster {
    fn from(c: &Cluster) -> Self {
        c.clone()
    }
}

/// A client configuration for `cluster`: the engine's client defaults, then
/// the cluster's client properties, which win
/// ([`sluice_topology::runtime::client_base`]).
pub fn base(cluster: impl Into<Cluster>) -> ClientConfig {
    let cluster = cluster.into();
    sluice_topology::runtime::client_base(&cluster.bootstrap, &cluster.client)
}

/// Remembers what a client reported failing (a refused connection, a failed
/// TLS handshake or authentication), to say why a request failed.
#[derive(Default)]
struct LastError(std::sync::Mutex<Vec<String>>);

impl LastError {
    /// The last error, once the client's queued events (its log, its
    /// errors) were served.
    fn take_after(&self, consumer: &BaseConsumer<LastError>) -> Option<String> {
        for _ in 0..5 {
            let _ = consumer.poll(Duration::from_millis(20));
        }
        let seen = std::mem::take(&mut *self.0.lock().ok()?);
        // "n/n brokers are down" follows the reason.
        let down = |m: &&String| m.contains("brokers are down");
        seen.iter()
            .rev()
            .find(|m| !down(m))
            .or_else(|| seen.last())
            .cloned()
    }

    fn remember(&self, reason: &str) {
        if let Ok(mut seen) = self.0.lock() {
            if seen.len() >= 16 {
                seen.remove(0);
            }
            seen.push(reason.to_string());
        }
    }
}

/// The cluster's metadata; when no broker answers, the error says why (from
/// the client's own report).
fn metadata(
    consumer: &BaseConsumer<LastError>,
    cluster: &Cluster,
) -> Result<rdkafka::metadata::Metadata, KafkaError> {
    consumer
        .fetch_metadata(None, Duration::from_secs(10))
        .map_err(|e| match consumer.context().take_after(consumer) {
            Some(reason) => KafkaError::Unreachable {
                bootstrap: cluster.bootstrap.clone(),
                reason,
            },
            None => e.into(),
        })
}

impl ClientContext for LastError {
    // librdkafka reports a failed connection (refused, TLS handshake,
    // authentication) in its log from its own threads; errors wait for a poll
    // that a metadata request does not make.
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        if (level as i32) <= (RDKafkaLogLevel::Error as i32) {
            tracing::debug!(fac, log_message, "kafka client");
            self.remember(log_message);
        }
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        tracing::debug!(%error, reason, "kafka client error");
        self.remember(reason);
    }
}

impl ConsumerContext for LastError {}

/// A topic to create: name, partition count, and topic configs.
pub type TopicDef<'a> = (&'a str, i32, &'a [(&'a str, &'a str)]);

/// Creates topics; existing ones are left alone.
pub fn create_topics(
    cluster: impl Into<Cluster>,
    topics: &[TopicDef<'_>],
) -> Result<(), KafkaError> {
    create_topics_rf(cluster, topics, 1)
}

/// Creates topics with a replication factor; existing ones are left alone.
pub fn create_topics_rf(
    cluster: impl Into<Cluster>,
    topics: &[TopicDef<'_>],
    replication: i32,
) -> Result<(), KafkaError> {
    let cluster = cluster.into();
    // Reach the cluster first, so a refused connection or TLS handshake says
    // so instead of timing the creation out.
    partition_counts(&cluster, &[])?;
    let admin: AdminClient<DefaultClientContext> = base(&cluster).create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|(name, p, configs)| {
            configs.iter().fold(
                NewTopic::new(name, *p, TopicReplication::Fixed(replication)),
                |t, (k, v)| t.set(k, v),
            )
        })
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = futures::executor::block_on(admin.create_topics(&new, &opts))?;
    for r in results {
        if let Err((name, code)) = r {
            if code != RDKafkaErrorCode::TopicAlreadyExists {
                return Err(KafkaError::CreateTopic { name, code });
            }
        }
    }
    // The controller answers before every broker's metadata has the new
    // topics: wait until they are there, so what runs next finds them.
    let names: Vec<String> = topics.iter().map(|(name, _, _)| name.to_string()).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while partition_counts(&cluster, &names)?.len() < names.len() {
        if std::time::Instant::now() > deadline {
            tracing::warn!(topics = ?names, "created topics are not in the cluster's metadata yet");
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Partition counts of the named topics that exist.
pub fn partition_counts(
    cluster: impl Into<Cluster>,
    topics: &[String],
) -> Result<std::collections::HashMap<String, i32>, KafkaError> {
    let cluster = cluster.into();
    let consumer: BaseConsumer<LastError> = base(&cluster)
        .set_log_level(RDKafkaLogLevel::Error)
        .create_with_context(LastError::default())?;
    let md = metadata(&consumer, &cluster)?;
    Ok(md
        .topics()
        .iter()
        .filter(|t| {
            t.error().is_none()
                && !t.partitions().is_empty()
                && topics.iter().any(|x| x == t.name())
        })
        .map(|t| (t.name().to_string(), t.partitions().len() as i32))
        .collect())
}

/// Produces records (idempotent producer, murmur2 partitioner) and waits
/// until all are acknowledged; a record the broker did not take is an error.
pub fn produce(
    cluster: impl Into<Cluster>,
    topic: &str,
    records: impl IntoIterator<Item = OutRecord>,
) -> Result<usize, KafkaError> {
    let publisher = Publisher::new(cluster)?;
    let mut n = 0;
    for r in records {
        publisher.send(topic, &r)?;
        n += 1;
    }
    publisher.finish(Duration::from_secs(60))?.check()?;
    Ok(n)
}

/// What a [`Publisher`]'s deliveries came to.
#[derive(Clone, Debug, Default)]
pub struct Delivered {
    /// Records the broker acknowledged.
    pub acked: u64,
    /// Records that failed for good (after the client's own retries).
    pub failed: u64,
    /// The first failure, as the client reported it.
    pub first_error: Option<String>,
    /// Per topic and partition, the offset after the last acknowledged record.
    pub ends: BTreeMap<(String, i32), i64>,
}

impl Delivered {
    /// An error when any record failed.
    pub fn check(self) -> Result<Delivered, KafkaError> {
        match self.failed {
            0 => Ok(self),
            failed => Err(KafkaError::Undelivered {
                failed,
                first: self.first_error.unwrap_or_default(),
            }),
        }
    }
}

/// Counts delivery reports.
#[derive(Default)]
struct Deliveries(std::sync::Mutex<Delivered>);

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        let Ok(mut d) = self.0.lock() else {
            return;
        };
        match result {
            Ok(m) => {
                d.acked += 1;
                let end = d
                    .ends
                    .entry((m.topic().to_string(), m.partition()))
                    .or_insert(0);
                *end = (*end).max(m.offset() + 1);
            }
            Err((e, _)) => {
                d.failed += 1;
                d.first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }
}

/// An idempotent producer (murmur2 partitioner for keyed records without a
/// partition) that counts what the broker acknowledged: records are sent one
/// by one, and [`Publisher::finish`] flushes and reports.
pub struct Publisher {
    producer: PolledProducer<Deliveries>,
}

impl Publisher {
    /// A producer on `cluster`.
    pub fn new(cluster: impl Into<Cluster>) -> Result<Publisher, KafkaError> {
        let producer = PolledProducer::new(
            base(cluster)
                .set("enable.idempotence", "true")
                .set("linger.ms", "10")
                .set("partitioner", "murmur2_random")
                .set("queue.buffering.max.messages", "1000000"),
            Deliveries::default(),
        )?;
        Ok(Publisher { producer })
    }

    /// Queues a record for `topic` (waiting while the client's queue is full).
    pub fn send(&self, topic: &str, r: &OutRecord) -> Result<(), KafkaError> {
        let headers = r.headers.iter().fold(OwnedHeaders::new(), |h, (k, v)| {
            h.insert(Header {
                key: k,
                value: Some(v.as_slice()),
            })
        });
        let mut rec: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(topic).headers(headers);
        if let Some(k) = &r.key {
            rec = rec.key(k.as_slice());
        }
        if let Some(v) = &r.value {
            rec = rec.payload(v.as_slice());
        }
        if let Some(ts) = r.timestamp {
            rec = rec.timestamp(ts);
        }
        if let Some(p) = r.partition {
            rec = rec.partition(p);
        }
        loop {
            match self.producer.send(rec) {
                Ok(()) => return Ok(()),
                Err((e, back))
                    if matches!(e.rdkafka_error_code(), Some(RDKafkaErrorCode::QueueFull)) =>
                {
                    rec = back;
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err((source, _)) => {
                    return Err(KafkaError::Produce {
                        step: "produce",
                        source,
                    })
                }
            }
        }
    }

    /// Waits until every record sent was acknowledged or failed (up to
    /// `timeout`) and reports the deliveries.
    pub fn finish(self, timeout: Duration) -> Result<Delivered, KafkaError> {
        self.producer
            .flush(timeout)
            .map_err(|source| KafkaError::Produce {
                step: "flush",
                source,
            })?;
        let delivered = self
            .producer
            .context()
            .0
            .lock()
            .map(|d| d.clone())
            .unwrap_or_default();
        Ok(delivered)
    }
}

/// Where [`read_existing`] starts in each partition.
#[derive(Clone, Copy, Debug)]
pub enum Start {
    /// The first record kept.
    Beginning,
    /// The first record whose timestamp is at or after this time (ms since
    /// the epoch), found with the broker's offsets-for-times look-up.
    Time(i64),
}

/// What a [`read_existing`] callback says about a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Taken; go on.
    Next,
    /// Stop reading.
    Stop,
}

/// How long [`read_existing`] waits for more records before it takes what
/// it got as everything there is.
const READ_IDLE: Duration = Duration::from_secs(1);
/// The same, for the first record (the first fetch looks offsets up and
/// connects to the partitions' leaders).
const READ_FIRST_IDLE: Duration = Duration::from_secs(10);

/// Reads every partition of `topics` from `start` up to its end as the
/// broker reports it when the read starts (records written after the read
/// started are not handed over), without joining a group or committing
/// anything, handing each record to `f`. Every record up to the end is
/// handed over, however long `f` takes; a partition whose end is not reached
/// is taken as read when nothing more comes for a second. `read_committed`
/// hides aborted and open transactions. Returns how many records `f` took.
pub fn read_existing(
    cluster: impl Into<Cluster>,
    topics: &[String],
    start: Start,
    read_committed: bool,
    mut f: impl FnMut(&BorrowedMessage<'_>) -> Flow,
) -> Result<u64, KafkaError> {
    let cluster = cluster.into();
    let consumer: BaseConsumer<LastError> = base(&cluster)
        .set(
            "group.id",
            format!("sluice-reader-{}", uuid::Uuid::new_v4()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        // A start that is gone by the time it is fetched (retention).
        .set("auto.offset.reset", "earliest")
        .set(
            "isolation.level",
            if read_committed {
                "read_committed"
            } else {
                "read_uncommitted"
            },
        )
        .set_log_level(RDKafkaLogLevel::Error)
        .create_with_context(LastError::default())?;
    let md = metadata(&consumer, &cluster)?;
    // Each partition's end now, and where reading starts.
    let mut ends: HashMap<(String, i32), i64> = HashMap::new();
    let mut from = TopicPartitionList::new();
    for t in md
        .topics()
        .iter()
        .filter(|t| topics.iter().any(|x| x == t.name()))
    {
        for p in t.partitions() {
            let (_, high) = consumer.fetch_watermarks(t.name(), p.id(), Duration::from_secs(10))?;
            ends.insert((t.name().to_string(), p.id()), high);
            let offset = match start {
                Start::Beginning => Offset::Beginning,
                Start::Time(ms) => Offset::Offset(ms),
            };
            from.add_partition_offset(t.name(), p.id(), offset)?;
        }
    }
    if let Start::Time(_) = start {
        from = consumer.offsets_for_times(from, Duration::from_secs(10))?;
    }
    // Partitions with nothing to read (empty, or nothing at or after the
    // time) are done at once.
    let mut open: HashMap<(String, i32), i64> = HashMap::new();
    let mut tpl = TopicPartitionList::new();
    for e in from.elements() {
        let key = (e.topic().to_string(), e.partition());
        let end = ends.get(&key).copied().unwrap_or(0);
        let offset = match (e.error(), e.offset()) {
            _ if end <= 0 => continue,
            (Ok(()), Offset::End) => continue,
            (Ok(()), Offset::Offset(o)) if o >= end => continue,
            (Ok(()), Offset::Offset(o)) => Offset::Offset(o),
            // A look-up that gave no offset: from the beginning.
            _ => Offset::Beginning,
        };
        tracing::debug!(
            topic = e.topic(),
            partition = e.partition(),
            ?offset,
            end,
            "reading"
        );
        tpl.add_partition_offset(e.topic(), e.partition(), offset)?;
        open.insert(key, end);
    }
    if open.is_empty() {
        return Ok(0);
    }
    consumer.assign(&tpl)?;
    let mut reached: std::collections::HashSet<(String, i32)> = Default::default();
    let mut idle_since = Instant::now();
    let mut received = 0u64;
    let mut handed = 0u64;
    loop {
        let Some(msg) = consumer.poll(Duration::from_millis(100)) else {
            // A partition ends in records a read_committed reader never
            // gets (transaction markers): its position passing the end says
            // it was reached.
            if let Ok(positions) = consumer.position() {
                for e in positions.elements() {
                    let key = (e.topic().to_string(), e.partition());
                    if e.offset().to_raw().is_some_and(|p| p >= open[&key]) {
                        reached.insert(key);
                    }
                }
            }
            let all_reached = open.keys().all(|k| reached.contains(k));
            // Nothing more comes: every record there is to get was handed
            // over (the first fetch may take longer).
            let idle = match received {
                0 => READ_FIRST_IDLE,
                _ => READ_IDLE,
            };
            if all_reached || idle_since.elapsed() > idle {
                return Ok(handed);
            }
            continue;
        };
        idle_since = Instant::now();
        received += 1;
        let msg = msg?;
        let key = (msg.topic().to_string(), msg.partition());
        let Some(end) = open.get(&key).copied() else {
            continue;
        };
        if msg.offset() >= end {
            // Written after the read started: the partition is done.
            if reached.insert(key.clone()) {
                let mut tp = TopicPartitionList::new();
                tp.add_partition(&key.0, key.1);
                let _ = consumer.pause(&tp);
            }
            continue;
        }
        match f(&msg) {
            Flow::Next => handed += 1,
            Flow::Stop => return Ok(handed),
        }
        if msg.offset() + 1 >= end {
            reached.insert(key);
        }
    }
}

/// Reads every partition of `topics` from the beginning until `done` returns
/// true for everything read so far, or `timeout` passes (then returns what was
/// read). `read_committed` hides aborted and open transactions.
pub fn read_topics(
    cluster: impl Into<Cluster>,
    topics: &[&str],
    read_committed: bool,
    timeout: Duration,
    mut done: impl FnMut(&[OwnedMessage]) -> bool,
) -> Result<Vec<OwnedMessage>, KafkaError> {
    let consumer: BaseConsumer = base(cluster)
        .set(
            "group.id",
            format!("sluice-reader-{}", uuid::Uuid::new_v4()),
        )
        .set("enable.auto.commit", "false")
        .set(
            "isolation.level",
            if read_committed {
                "read_committed"
            } else {
                "read_uncommitted"
            },
        )
        .create()?;
    let md = consumer.fetch_metadata(None, Duration::from_secs(10))?;
    let mut tpl = TopicPartitionList::new();
    for t in md.topics() {
        if topics.contains(&t.name()) {
            for p in t.partitions() {
                tpl.add_partition_offset(t.name(), p.id(), Offset::Beginning)?;
            }
        }
    }
    consumer.assign(&tpl)?;
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    let mut last_check = 0;
    while Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => out.push(m.detach()),
            Some(Err(e)) => tracing::warn!(error = %e, "reader error"),
            None => {
                if out.len() != last_check || out.is_empty() {
                    last_check = out.len();
                    if done(&out) {
                        return Ok(out);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The key and value of a message as UTF-8 (lossy), for display and tests.
pub fn text(m: &OwnedMessage) -> (String, String) {
    (
        String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
        String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned(),
    )
}
