//! `tasks`: task topics decoded into [`Task`]s; poison goes to the dead-letter
//! topic of the topic it came from, with a reason that never quotes it.

use chrono::Utc;
use sluice_topology::{
    BytesCodec, KStream, ProcessError, Processor, ProcessorContext, Record, SourceOptions,
    StreamBuilder, TopologyError,
};

use super::{RawKey, Task};
use crate::config::{TasksSection, TopicsSection};
use crate::envelope::{decode_task, DlqCategory, EnvelopeLimits};

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
}

impl TaskSource {
    /// The task topics of the `[topics]` section, with `[tasks]`' limits.
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
                ..EnvelopeLimits::default()
            },
        }
    }
}

/// The stream of decoded tasks of every topic of `source`, merged.
pub fn tasks(
    b: &StreamBuilder,
    source: &TaskSource,
) -> Result<KStream<RawKey, Task>, TopologyError> {
    let mut streams = source.topics.iter().map(|t| {
        let decode = Decode {
            topic: t.topic.clone(),
            task_types: source.task_types.clone(),
            limits: source.limits.clone(),
        };
        b.stream_with(
            &[&t.topic],
            BytesCodec,
            BytesCodec,
            SourceOptions {
                dead_letter_topic: Some(t.dead_letter_topic.clone()),
            },
        )
        .process(&format!("decode:{}", t.topic), &[], move || decode.clone())
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

impl Processor<RawKey, Option<Vec<u8>>> for Decode {
    type OutKey = RawKey;
    type OutValue = Task;
    type Output = ();

    fn process(
        &mut self,
        record: Record<RawKey, Option<Vec<u8>>>,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), ProcessError> {
        let poison = DlqCategory::Poison.as_str();
        let Some(bytes) = record.value.as_deref() else {
            return ctx.dead_letter("missing_value", poison, 1);
        };
        let envelope = match decode_task(bytes, &self.limits, &self.task_types) {
            Ok(t) => t,
            Err(e) => return ctx.dead_letter(&e.reason(), poison, 1),
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
