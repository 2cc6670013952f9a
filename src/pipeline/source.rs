//! `tasks`: task topics decoded into [`Task`]s; poison goes to the dead-letter
//! topic of the topic it came from, with a reason that never quotes it.

use chrono::Utc;
use sluice_topology::{
    BytesCodec, KStream, ProcessError, Processor, ProcessorContext, Record, SourceOptions,
    StreamBuilder, Topology, TopologyError,
};

use super::{RawKey, Task};
use crate::config::{TasksSection, TopicsSection};
use crate::envelope::{decode_task, DlqCategory, EnvelopeLimits, TaskEnvelope, TenantRules};

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
    /// Set when tasks first go through internal topics keyed by tenant.
    pub by_tenant: Option<ByTenant>,
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
    /// The task topics of the `[topics]` section, with `[tasks]`' limits
    /// (its tenant rules were checked with the configuration).
    pub fn from_config(topics: &TopicsSection, tasks: &TasksSection) -> Self {
        TaskSource {
            topics: topics
                .task_types
                .iter()
                .map(|t| TaskTopic {
                    topic: topics.task_topic(t),
                    dead_letter_topic: topics.dlq_topic(t),
                })
                .collect(),
            task_types: topics.task_types.clone(),
            limits: EnvelopeLimits {
                max_bytes: tasks.max_bytes,
                // The pattern was checked with the configuration.
                tenants: TenantRules::new(&tasks.tenant_pattern, &tasks.tenants)
                    .unwrap_or_default(),
                ..EnvelopeLimits::default()
            },
            by_tenant: None,
        }
    }

    /// The same source, repartitioned by tenant.
    pub fn by_tenant(self, app_id: &str, partitions: i32) -> Self {
        TaskSource {
            by_tenant: Some(ByTenant {
                app_id: app_id.to_string(),
                partitions,
            }),
            ..self
        }
    }

    /// The topics the decoded tasks come from (and re-published ones go
    /// to): the task topics, or their repartition topics.
    pub fn task_stream_topics(&self) -> Vec<String> {
        self.topics
            .iter()
            .map(|t| match &self.by_tenant {
                Some(b) => b.topic(&t.topic),
                None => t.topic.clone(),
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
        match &source.by_tenant {
            None => {
                let d = decode(&t.topic);
                raw.process(&format!("decode:{}", t.topic), &[], move || d.clone())
            }
            Some(by) => {
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
        let task = Task {
            envelope,
            topic: self.topic.clone(),
            key: record.key.clone(),
            received_ms: Utc::now().timestamp_millis(),
        };
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
