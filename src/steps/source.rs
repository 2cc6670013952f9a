//! `tasks`: task topics decoded into [`Task`]s; poison goes to the dead-letter
//! topic of the topic it came from, with a reason that never quotes it.
//!
//! Each tenant has one owner, whatever the producers do: the task (stream
//! task) of the partition its tenant id names under the configured
//! partitioner holds all its accounts and quotas. A task record keyed by
//! something else (a task id, nothing) or placed by another partitioner
//! goes through an internal topic keyed by tenant to that partition first,
//! or is dead-lettered `wrong_key` (see [`Owners`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::Utc;
use parking_lot::Mutex;
use prometheus::{IntCounterVec, Opts, Registry};
use serde::{Deserialize, Serialize};
use sluice_topology::runtime::KeyPartitioner;
use sluice_topology::{
    BytesCodec, KStream, ProcessError, Processor, ProcessorContext, Record, SourceOptions,
    StreamBuilder, Topology, TopologyError,
};

use crate::envelope::{
    decode_task, DlqCategory, EnvelopeLimits, TaskEnvelope, TenantRules, DEFAULT_TENANT_PATTERN,
};
use crate::error::ConfigError;
use crate::steps::health::Health;

/// Kafka key of a task record (its tenant id), as read.
pub type RawKey = Option<Vec<u8>>;

/// A decoded, validated task, with what re-publishing it needs.
#[derive(Clone, Debug)]
pub struct Task {
    /// The envelope (`tenantId` filled in).
    pub envelope: TaskEnvelope,
    /// The topic it was read from (re-published there with the next attempt).
    pub topic: String,
    /// Its Kafka key as read (a re-published task keeps it).
    pub key: RawKey,
    /// When it was read, ms since the epoch (results report processing time
    /// from here).
    pub received_ms: i64,
}

impl Task {
    /// The tenant the task is accounted to.
    pub fn tenant(&self) -> &str {
        self.envelope.tenant().unwrap_or_default()
    }
}

/// `[tasks]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TasksSection {
    /// Largest task record accepted, bytes; larger ones are dead-lettered.
    pub max_bytes: usize,
    /// Deliveries of a task (re-published with `attemptNumber + 1` after a
    /// transient failure) before it is dead-lettered as `exhausted`.
    pub max_attempts: u32,
    /// Backoff of a re-published attempt: attempt `n` is not called before a
    /// time drawn uniformly (full jitter) from zero to
    /// `retry_backoff_ms × 2^(n − 2)`, at most `retry_backoff_max_ms`.
    pub retry_backoff_ms: u64,
    /// The longest backoff of a re-published attempt, ms; also the longest a
    /// task waits for any `notBefore` it carries.
    pub retry_backoff_max_ms: u64,
    /// How long completed task ids are remembered for idempotency, hours.
    pub idempotency_ttl_hours: u64,
    /// While intake is held (bad credentials, open breaker without fallback),
    /// how often one held task probes the provider, ms.
    pub probe_interval_ms: u64,
    /// Consecutive calls of one model refused with the same `400` that make
    /// it a configuration fault (a parameter or template the model rejects):
    /// its tasks are held instead of dead-lettered. 0 dead-letters every
    /// `400` at once.
    pub bad_request_trap_after: u32,
    /// How long a task refused with a `400` waits for its model's run to
    /// decide (another answer: dead-lettered; the run reaching
    /// `bad_request_trap_after`: held), ms.
    pub bad_request_wait_ms: u64,
    /// How the services publishing tasks partition them by tenant:
    /// `murmur2` (Java clients, Kafka Streams, librdkafka's `murmur2_random`)
    /// or `crc32` (librdkafka's default `consistent_random`: Python, Go, .NET,
    /// Node clients left at their default). Usage queries find the instance
    /// holding a tenant's accounts with it.
    pub partitioner: KeyPartitioner,
    /// How each tenant keeps one owner (the task holding its accounts and
    /// quotas) whatever the producers do: `auto` checks every task's key
    /// and partition against its tenant under `partitioner` and sends a
    /// task that does not match through an internal topic keyed by tenant
    /// (every task when the task topics' partition counts differ);
    /// `always` sends every task through it; `never` dead-letters a task
    /// whose key or partition does not match (`wrong_key`).
    pub repartition: Repartition,
    /// What a tenant id must match once normalised (trimmed, ASCII letters
    /// lower-cased); a task whose tenant does not is dead-lettered
    /// `invalid_tenant`.
    pub tenant_pattern: String,
    /// The tenants accepted (empty: any matching `tenant_pattern`); a task of
    /// another tenant is dead-lettered `unknown_tenant`.
    pub tenants: Vec<String>,
}

/// `[tasks] repartition`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Repartition {
    /// The tasks whose key or partition does not match their tenant (all
    /// of them when the task topics' partition counts differ).
    #[default]
    Auto,
    /// Every task.
    Always,
    /// None: a task whose key or partition does not match its tenant is
    /// dead-lettered `wrong_key`.
    Never,
}

impl Default for TasksSection {
    fn default() -> Self {
        TasksSection {
            max_bytes: 1024 * 1024,
            max_attempts: 5,
            retry_backoff_ms: 30_000,
            retry_backoff_max_ms: 300_000,
            idempotency_ttl_hours: 7 * 24,
            probe_interval_ms: 2_000,
            bad_request_trap_after: 5,
            bad_request_wait_ms: 10_000,
            partitioner: KeyPartitioner::Murmur2,
            repartition: Repartition::Auto,
            tenant_pattern: DEFAULT_TENANT_PATTERN.into(),
            tenants: Vec::new(),
        }
    }
}

impl TasksSection {
    /// Checks of the section's own keys.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_attempts == 0 {
            return Err(ConfigError::new("tasks.max_attempts", "must be at least 1"));
        }
        let rules = TenantRules::new(&self.tenant_pattern, &[])
            .map_err(|e| ConfigError::new("tasks.tenant_pattern", e.to_string()))?;
        for (i, t) in self.tenants.iter().enumerate() {
            rules.check(t).map_err(|_| {
                ConfigError::new(
                    format!("tasks.tenants[{i}]"),
                    "does not match tasks.tenant_pattern",
                )
            })?;
        }
        if self.retry_backoff_max_ms < self.retry_backoff_ms
            || self.retry_backoff_max_ms > 86_400_000
        {
            return Err(ConfigError::new(
                "tasks.retry_backoff_max_ms",
                "must be at least tasks.retry_backoff_ms and at most a day (86400000)",
            ));
        }
        Ok(())
    }
}

/// A task topic and its dead-letter topic.
#[derive(Clone, Debug)]
pub struct TaskTopic {
    /// The topic tasks are read from.
    pub topic: String,
    /// Where its poison records go.
    pub dead_letter_topic: String,
}

/// The task topics of a pipeline (co-partitioned: they share tasks) and the
/// task types accepted.
#[derive(Clone, Debug)]
pub struct TaskSource {
    /// Topics read.
    pub topics: Vec<TaskTopic>,
    /// Task types accepted; any other `taskType` is poison.
    pub task_types: Vec<String>,
    /// Size limits.
    pub limits: EnvelopeLimits,
    /// How tasks reach the owner of their tenant.
    pub owners: Owners,
}

/// How each task reaches the task (stream task) that owns its tenant.
#[derive(Clone, Debug, Default)]
pub enum Owners {
    /// Taken in the partition it arrives in, whatever its key: for
    /// pipelines whose producers are trusted to key tasks by tenant.
    #[default]
    AsArrived,
    /// Each record's key and partition are checked against its tenant;
    /// one that does not match is repartitioned or dead-lettered.
    Checked(KeyCheck),
    /// Every task goes through an internal topic keyed by tenant (task
    /// topics of different partition counts, or `repartition = "always"`).
    ByTenant(ByTenant),
}

/// The check of each task record's key and partition against its tenant.
#[derive(Clone, Debug)]
pub struct KeyCheck {
    /// Partitions of the task topics (equal for all of them).
    pub partitions: i32,
    /// The partitioner that names a tenant's partition.
    pub partitioner: KeyPartitioner,
    /// Where a record that does not match goes: through this repartition
    /// (to the partition `partitioner` names), or, when none, to its
    /// dead-letter topic (`wrong_key`).
    pub rekey: Option<ByTenant>,
    /// Counts, logs and reports the records that did not match.
    pub misplaced: Misplaced,
}

impl KeyCheck {
    /// What happens to a record that does not match (the `action` label).
    fn action(&self) -> &'static str {
        match self.rekey {
            Some(_) => "repartitioned",
            None => "dead_lettered",
        }
    }
}

/// Why a task record is not where its tenant's owner reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Mismatch {
    /// The record has no key.
    NullKey,
    /// Its key is not its tenant id (e.g. its task id).
    KeyNotTenant,
    /// Keyed by its tenant, but in a partition the configured partitioner
    /// does not name for it (a producer with another partitioner).
    Partition,
}

impl Mismatch {
    fn as_str(self) -> &'static str {
        match self {
            Mismatch::NullKey => "null_key",
            Mismatch::KeyNotTenant => "key_not_tenant",
            Mismatch::Partition => "partition",
        }
    }
}

/// The misplaced task records: `sluice_tasks_misplaced_total{topic, reason,
/// action}`, one log line per (topic, reason) and a `/readyz` warning.
#[derive(Clone)]
pub struct Misplaced {
    counter: IntCounterVec,
    health: Health,
    /// Counts by (topic, reason), for the warning; a pattern is logged the
    /// first time it is seen.
    seen: Arc<Mutex<BTreeMap<(String, Mismatch), u64>>>,
}

impl std::fmt::Debug for Misplaced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Misplaced").finish_non_exhaustive()
    }
}

/// The metric's name.
pub const MISPLACED_METRIC: &str = "sluice_tasks_misplaced_total";

impl Misplaced {
    /// Registers the counter in `registry`; warnings go to `health`.
    pub fn registered(registry: &Registry, health: Health) -> prometheus::Result<Self> {
        let counter = IntCounterVec::new(
            Opts::new(
                MISPLACED_METRIC,
                "Task records whose key or partition did not match their tenant, by topic, \
                 reason (null_key, key_not_tenant, partition) and action (repartitioned, \
                 dead_lettered)",
            ),
            &["topic", "reason", "action"],
        )?;
        registry.register(Box::new(counter.clone()))?;
        Ok(Misplaced {
            counter,
            health,
            seen: Default::default(),
        })
    }

    fn record(&self, topic: &str, why: Mismatch, check: &KeyCheck, tenant: &str) {
        let action = check.action();
        self.counter
            .with_label_values(&[topic, why.as_str(), action])
            .inc();
        let mut seen = self.seen.lock();
        let count = seen.entry((topic.to_string(), why)).or_default();
        *count += 1;
        let hint = partitioner_hint(why, check, tenant);
        if *count == 1 {
            tracing::warn!(
                topic,
                reason = why.as_str(),
                action,
                "task records do not arrive where their tenant's owner reads{hint}"
            );
        }
        if why == Mismatch::Partition {
            let total: u64 = seen
                .iter()
                .filter(|((_, w), _)| *w == Mismatch::Partition)
                .map(|(_, n)| n)
                .sum();
            self.health.warn(
                "tenant_partitions",
                format!(
                    "{total} task records keyed by their tenant arrived on partitions [tasks] \
                     partitioner = \"{}\" does not name for it ({action}){hint}",
                    partitioner_name(check.partitioner),
                ),
            );
        }
    }
}

fn partitioner_name(p: KeyPartitioner) -> &'static str {
    match p {
        KeyPartitioner::Murmur2 => "murmur2",
        KeyPartitioner::Crc32 => "crc32",
    }
}

/// For a record keyed by its tenant in another partition: which
/// partitioner would have put it there, when one of the others does.
fn partitioner_hint(why: Mismatch, check: &KeyCheck, tenant: &str) -> String {
    if why != Mismatch::Partition {
        return String::new();
    }
    let other = match check.partitioner {
        KeyPartitioner::Murmur2 => KeyPartitioner::Crc32,
        KeyPartitioner::Crc32 => KeyPartitioner::Murmur2,
    };
    format!(
        "; tenant {tenant:?} is in partition {} under {}: do its producers use that \
         partitioner?",
        other.partition(tenant.as_bytes(), check.partitions),
        partitioner_name(other)
    )
}

/// Tasks repartitioned by tenant: each task topic goes through an internal
/// topic `<app id>-by-tenant-<topic>-repartition` keyed by the task's tenant
/// (murmur2), all of them with one partition count, so a tenant's tasks of
/// every type meet in one task whatever the task topics' partition counts
/// (or the producers' keys). Poison is dead-lettered before the repartition;
/// anything dead-lettered after it goes to the original topic's dead-letter
/// topic, naming the original record. Re-published tasks go straight to
/// their repartition topic, in their task's own partition.
#[derive(Clone, Debug)]
pub struct ByTenant {
    /// The application id (internal topics are named after it).
    pub app_id: String,
    /// Partitions of the repartition topics (and tasks reading them).
    pub partitions: i32,
}

impl ByTenant {
    fn name(topic: &str) -> String {
        format!("by-tenant-{topic}")
    }

    /// The repartition topic of a task topic.
    pub fn topic(&self, task_topic: &str) -> String {
        Topology::repartition_topic(&self.app_id, &Self::name(task_topic))
    }
}

impl TaskSource {
    /// The same source, with tasks reaching their tenant's owner as `owners`
    /// says.
    pub fn with_owners(self, owners: Owners) -> Self {
        TaskSource { owners, ..self }
    }

    /// The topics the decoded tasks come from (and re-published ones go
    /// to): the task topics and/or their repartition topics.
    pub fn task_stream_topics(&self) -> Vec<String> {
        self.topics
            .iter()
            .flat_map(|t| match &self.owners {
                Owners::AsArrived | Owners::Checked(KeyCheck { rekey: None, .. }) => {
                    vec![t.topic.clone()]
                }
                Owners::Checked(KeyCheck { rekey: Some(b), .. }) => {
                    vec![t.topic.clone(), b.topic(&t.topic)]
                }
                Owners::ByTenant(b) => vec![b.topic(&t.topic)],
            })
            .collect()
    }
}

/// The stream of decoded tasks of every topic of `source`, merged.
pub fn tasks(
    b: &StreamBuilder,
    source: &TaskSource,
) -> Result<KStream<RawKey, Task>, TopologyError> {
    let mut streams = source.topics.iter().map(|t| {
        let decode = |topic: &str| Decode {
            topic: topic.to_string(),
            task_types: source.task_types.clone(),
            limits: source.limits.clone(),
        };
        let raw = b.stream_with(
            &[&t.topic],
            BytesCodec,
            BytesCodec,
            SourceOptions {
                dead_letter_topic: Some(t.dead_letter_topic.clone()),
            },
        );
        match &source.owners {
            Owners::AsArrived => {
                let d = decode(&t.topic);
                raw.process(&format!("decode:{}", t.topic), &[], move || d.clone())
            }
            Owners::ByTenant(by) => {
                let (key, d) = (KeyByTenant(decode(&t.topic)), decode(&by.topic(&t.topic)));
                raw.process(&format!("key-by-tenant:{}", t.topic), &[], move || {
                    key.clone()
                })
                .repartition_with(
                    &ByTenant::name(&t.topic),
                    BytesCodec,
                    BytesCodec,
                    Some(by.partitions),
                )
                .process(&format!("decode:{}", d.topic), &[], move || d.clone())
            }
            Owners::Checked(check) => {
                let owner = CheckOwner {
                    decode: decode(&t.topic),
                    check: check.clone(),
                };
                let checked = raw.process(&format!("check-owner:{}", t.topic), &[], move || {
                    owner.clone()
                });
                let owned = checked.flat_map(|r| match r.value {
                    Checked::Owned(task) => Some(Record {
                        key: r.key,
                        value: *task,
                        timestamp: r.timestamp,
                        headers: r.headers,
                    }),
                    Checked::Elsewhere(_) => None,
                });
                let Some(by) = &check.rekey else {
                    return owned;
                };
                // Into the partition the tenant's owner reads, then merged
                // with the records already there: one sub-topology, so the
                // same task (and its stores) gets a tenant's records from
                // both topics.
                let d = decode(&by.topic(&t.topic));
                let rekeyed = checked
                    .flat_map(|r| match r.value {
                        Checked::Elsewhere(bytes) => Some(Record {
                            key: r.key,
                            value: bytes,
                            timestamp: r.timestamp,
                            headers: r.headers,
                        }),
                        Checked::Owned(_) => None,
                    })
                    .repartition_partitioned(
                        &ByTenant::name(&t.topic),
                        BytesCodec,
                        BytesCodec,
                        check.partitions,
                        check.partitioner,
                    )
                    .process(&format!("decode:{}", d.topic), &[], move || d.clone());
                owned.merge(&rekeyed)
            }
        }
    });
    let first = streams
        .next()
        .ok_or_else(|| TopologyError::Invalid("no task topics configured".into()))?;
    Ok(streams.fold(first, |acc, s| acc.merge(&s)))
}

/// Decodes one topic's records.
#[derive(Clone)]
struct Decode {
    topic: String,
    task_types: Vec<String>,
    limits: EnvelopeLimits,
}

type Ctx<'a> = ProcessorContext<'a, RawKey, Task, ()>;

impl Decode {
    /// The record's task, or why it is poison.
    fn envelope(&self, value: Option<&[u8]>) -> Result<TaskEnvelope, String> {
        let bytes = value.ok_or_else(|| "missing_value".to_string())?;
        decode_task(bytes, &self.limits, &self.task_types).map_err(|e| e.reason())
    }

    /// The task of a decoded record of this topic, received now.
    fn task(&self, envelope: TaskEnvelope, key: RawKey) -> Task {
        Task {
            envelope,
            topic: self.topic.clone(),
            key,
            received_ms: Utc::now().timestamp_millis(),
        }
    }
}

impl Processor<RawKey, Option<Vec<u8>>> for Decode {
    type OutKey = RawKey;
    type OutValue = Task;
    type Output = ();

    fn process(
        &mut self,
        record: Record<RawKey, Option<Vec<u8>>>,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), ProcessError> {
        let envelope = match self.envelope(record.value.as_deref()) {
            Ok(t) => t,
            Err(reason) => return ctx.dead_letter(&reason, DlqCategory::Poison.as_str(), 1),
        };
        let task = self.task(envelope, record.key.clone());
        let key = record.key.clone();
        ctx.forward(record.with(key, task))
    }
}

/// Keys a task topic's records by their tenant for the repartition, as the
/// bytes they were read as; poison is dead-lettered here, where the original
/// record is at hand.
#[derive(Clone)]
struct KeyByTenant(Decode);

impl Processor<RawKey, Option<Vec<u8>>> for KeyByTenant {
    type OutKey = RawKey;
    type OutValue = Option<Vec<u8>>;
    type Output = ();

    fn process(
        &mut self,
        record: Record<RawKey, Option<Vec<u8>>>,
        ctx: &mut ProcessorContext<'_, RawKey, Option<Vec<u8>>, ()>,
    ) -> Result<(), ProcessError> {
        match self.0.envelope(record.value.as_deref()) {
            Ok(task) => {
                let tenant = task.tenant().unwrap_or_default().as_bytes().to_vec();
                let value = record.value.clone();
                ctx.forward(record.with(Some(tenant), value))
            }
            Err(reason) => ctx.dead_letter(&reason, DlqCategory::Poison.as_str(), 1),
        }
    }
}

/// A task record checked against its tenant: decoded, in its owner's
/// partition, or the bytes to send there.
#[derive(Clone)]
enum Checked {
    Owned(Box<Task>),
    Elsewhere(Option<Vec<u8>>),
}

/// Decodes a task topic's records and checks each one's key and partition
/// against its tenant (see [`KeyCheck`]); poison is dead-lettered here.
#[derive(Clone)]
struct CheckOwner {
    decode: Decode,
    check: KeyCheck,
}

impl CheckOwner {
    /// Why a record of `tenant` keyed `key` in `partition` is not where its
    /// owner reads, if it is not.
    fn mismatch(&self, key: Option<&[u8]>, tenant: &str, partition: i32) -> Option<Mismatch> {
        let c = &self.check;
        match key {
            None => Some(Mismatch::NullKey),
            Some(k) if k != tenant.as_bytes() => Some(Mismatch::KeyNotTenant),
            Some(k) if c.partitioner.partition(k, c.partitions) != partition => {
                Some(Mismatch::Partition)
            }
            Some(_) => None,
        }
    }
}

impl Processor<RawKey, Option<Vec<u8>>> for CheckOwner {
    type OutKey = RawKey;
    type OutValue = Checked;
    type Output = ();

    fn process(
        &mut self,
        record: Record<RawKey, Option<Vec<u8>>>,
        ctx: &mut ProcessorContext<'_, RawKey, Checked, ()>,
    ) -> Result<(), ProcessError> {
        let envelope = match self.decode.envelope(record.value.as_deref()) {
            Ok(t) => t,
            Err(reason) => return ctx.dead_letter(&reason, DlqCategory::Poison.as_str(), 1),
        };
        let tenant = envelope.tenant().unwrap_or_default().to_string();
        let partition = ctx.task_id().partition;
        let Some(why) = self.mismatch(record.key.as_deref(), &tenant, partition) else {
            let task = self.decode.task(envelope, record.key.clone());
            let key = record.key.clone();
            return ctx.forward(record.with(key, Checked::Owned(Box::new(task))));
        };
        self.check
            .misplaced
            .record(&self.decode.topic, why, &self.check, &tenant);
        match self.check.rekey {
            Some(_) => {
                let value = record.value.clone();
                ctx.forward(record.with(Some(tenant.into_bytes()), Checked::Elsewhere(value)))
            }
            None => ctx.dead_letter(
                &format!("wrong_key:{}", why.as_str()),
                DlqCategory::Poison.as_str(),
                1,
            ),
        }
    }
}
