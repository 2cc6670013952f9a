//! The LLM pipeline as DSL operators on the engine's streams.
//!
//! A pipeline reads like Kafka Streams code; any engine operator (`filter`,
//! `map_values`, `branch`, `group_by`, windowed `aggregate`, `process`) can go
//! between the steps:
//!
//! ```ignore
//! use sluice::pipeline::prelude::*;
//!
//! let b = StreamBuilder::new();
//! tasks(&b, &source)?                // decoded tasks; poison → the topic's dead-letter topic
//!     .route(&router)                // each task with its model, tier and reason
//!     .micro_batch(&batching)        // small tasks of one (tenant, model, task type) share a call
//!     .invoke_llm(&llm)              // results keyed by task id
//!     .account(&accounting)          // per-tenant windows → ai.usage.tenant
//!     .to_results(&results);         // ai.results.completed / ai.results.failed
//! let topology = b.build()?;
//! ```
//!
//! Each step is a plain operator on the processor API and takes only its own
//! settings. Records stay in flight (uncommitted) while a window or a call
//! holds them, so a crash loses nothing and, under exactly-once, counts
//! nothing twice.

pub mod batch;
mod delay;
mod results;
mod source;

use sluice_topology::{Data, KStream, StreamBuilder, Topology, TopologyError};

use crate::accounting::{AccountStreamExt, Accounting};
use crate::envelope::{Route, TaskEnvelope, TaskResult};
use crate::operator::{LlmProcessor, LlmStep};
use crate::route::RouteStep;
pub use batch::{Batch, BatchItem, BatchMetrics, Batching, BatchingConfig, MicroBatcher};
pub use delay::RetryWait;
pub use results::{ResultsSink, ResultsWriter};
pub use source::{tasks, TaskSource, TaskTopic};

/// What a pipeline needs in scope: the builder and the extension traits.
pub mod prelude {
    pub use super::{
        tasks, BatchStreamExt, ResultStreamExt, RoutedStreamExt, TaskSource, TaskStreamExt,
    };
    pub use crate::accounting::AccountStreamExt;
    pub use sluice_topology::{KStream, Record, StreamBuilder};
}

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

/// A task with the model that answers it.
#[derive(Clone, Debug)]
pub struct Routed {
    /// The task.
    pub task: Task,
    /// The model to call.
    pub model: String,
    /// Tier and reason, recorded in the result.
    pub route: Route,
}

/// `route` on a stream of tasks.
pub trait TaskStreamExt<K> {
    /// Picks each task's model (see [`crate::route`]).
    fn route(&self, step: &RouteStep) -> KStream<K, Routed>;
}

impl<K: Data> TaskStreamExt<K> for KStream<K, Task> {
    fn route(&self, step: &RouteStep) -> KStream<K, Routed> {
        let step = step.clone();
        self.map_values(move |_, task| step.route(task))
    }
}

/// `micro_batch` and `invoke_llm` on a stream of routed tasks.
pub trait RoutedStreamExt<K> {
    /// Holds each re-published attempt until its `notBefore` (at most `max`)
    /// without holding up the tasks behind it (see [`delay`]).
    fn await_retries(&self, max: std::time::Duration) -> KStream<K, Routed>;
    /// Groups small tasks per (model, task type, prompt) into batches (see
    /// [`batch`]); every other task passes on alone.
    fn micro_batch(&self, batching: &Batching) -> KStream<String, Batch>;
    /// Calls the provider for each task: results keyed by task id.
    fn invoke_llm(&self, llm: &LlmStep) -> KStream<String, TaskResult>;
}

impl<K: Data> RoutedStreamExt<K> for KStream<K, Routed> {
    fn await_retries(&self, max: std::time::Duration) -> KStream<K, Routed> {
        self.process("await-retries", &[], move || RetryWait { max })
    }

    fn micro_batch(&self, batching: &Batching) -> KStream<String, Batch> {
        let b = batching.clone();
        self.process(&batching.name, &[], move || MicroBatcher::new(b.clone()))
    }

    fn invoke_llm(&self, llm: &LlmStep) -> KStream<String, TaskResult> {
        invoke(self, llm)
    }
}

/// `invoke_llm` on a stream of micro-batches.
pub trait BatchStreamExt<K> {
    /// Calls the provider once per batch (per task for a batch of one):
    /// results keyed by task id.
    fn invoke_llm(&self, llm: &LlmStep) -> KStream<String, TaskResult>;
}

impl<K: Data> BatchStreamExt<K> for KStream<K, Batch> {
    fn invoke_llm(&self, llm: &LlmStep) -> KStream<String, TaskResult> {
        invoke(self, llm)
    }
}

fn invoke<K: Data, V: LlmInput>(
    stream: &KStream<K, V>,
    llm: &LlmStep,
) -> KStream<String, TaskResult> {
    let mut stores = llm.store_names().to_vec();
    for s in &stores {
        stream.builder().add_kv_store(s, true);
    }
    // Hard quotas read the tenant windows the accountant keeps; recovered
    // results are added to them.
    if let Some(accounting) = llm.accounting() {
        stores.extend_from_slice(accounting.declare_stores(stream.builder()));
    }
    let refs: Vec<&str> = stores.iter().map(String::as_str).collect();
    let step = llm.clone();
    stream.process(llm.name(), &refs, move || LlmProcessor::new(step.clone()))
}

/// What `invoke_llm` accepts: a routed task, or a micro-batch of them.
pub trait LlmInput: Data {
    /// The tasks, one or several.
    fn into_work(self) -> Work;
}

/// The tasks of one `invoke_llm` input record (taken apart at once, never
/// stored, so the variants' sizes do not matter).
#[allow(clippy::large_enum_variant)]
pub enum Work {
    /// One task: the current record.
    One(Routed),
    /// A batch: each item holds its own input record.
    Batch(Batch),
}

impl LlmInput for Routed {
    fn into_work(self) -> Work {
        Work::One(self)
    }
}

impl LlmInput for Batch {
    fn into_work(self) -> Work {
        Work::Batch(self)
    }
}

/// `to_results` on a stream of results.
pub trait ResultStreamExt {
    /// Writes each result to the completed or the failed results topic.
    fn to_results(&self, sink: &ResultsSink);
}

impl ResultStreamExt for KStream<String, TaskResult> {
    fn to_results(&self, sink: &ResultsSink) {
        let s = sink.clone();
        self.process(&sink.name(), &[], move || ResultsWriter::new(s.clone()));
    }
}

/// The steps of `sluice run`'s pipeline.
pub struct Steps {
    /// Task topics.
    pub source: TaskSource,
    /// Routing.
    pub route: RouteStep,
    /// The longest a re-published attempt waits for its backoff.
    pub retry_wait_max: std::time::Duration,
    /// Micro-batching.
    pub batching: Batching,
    /// The provider call.
    pub llm: LlmStep,
    /// Per-tenant accounts (none when accounting is off).
    pub accounting: Option<Accounting>,
    /// Results topics.
    pub results: ResultsSink,
}

/// `sluice run`'s default pipeline: tasks → route → re-published attempts
/// wait for their backoff → micro-batch → LLM → per-tenant accounts →
/// results.
pub fn default_topology(steps: &Steps) -> Result<Topology, TopologyError> {
    let b = StreamBuilder::new();
    let results = tasks(&b, &steps.source)?
        .route(&steps.route)
        .await_retries(steps.retry_wait_max)
        .micro_batch(&steps.batching)
        .invoke_llm(&steps.llm);
    match &steps.accounting {
        Some(a) => results.account(a).to_results(&steps.results),
        None => results.to_results(&steps.results),
    }
    b.build()
}

#[cfg(test)]
mod tests;
