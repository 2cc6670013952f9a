//! The LLM pipeline as DSL operators on the engine's streams.
//!
//! A pipeline reads like Kafka Streams code; any engine operator (`filter`,
//! `map_values`, `branch`, `group_by`, windowed `aggregate`, `process`) can go
//! between the steps:
//!
//! ```ignore
//! use sluice::steps::prelude::*;
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
//! One room per step, in the order a task takes them: [`source`], [`route`],
//! [`delay`], [`batch`], [`invoke_llm`], [`account`], [`results`]; beside
//! them [`health`], the faults the steps report to `/readyz`. Each step is a
//! plain operator on the processor API and takes only its own settings (its
//! configuration section lives in its room). Records stay in flight (uncommitted) while a window or a call
//! holds them, so a crash loses nothing and, under exactly-once, counts
//! nothing twice.

pub mod account;
pub mod batch;
pub mod delay;
pub mod health;
pub mod invoke_llm;
pub mod results;
pub mod route;
pub mod source;

use sluice_topology::{Data, KStream, StreamBuilder, Topology, TopologyError};

use crate::envelope::TaskResult;
use crate::steps::account::{AccountStreamExt, Accounting};
use crate::steps::invoke_llm::{LlmProcessor, LlmStep};
use crate::steps::route::RouteStep;
pub use batch::{Batch, BatchItem};
pub use batch::{BatchMetrics, Batching, BatchingConfig, MicroBatcher};
pub use delay::RetryWait;
pub use invoke_llm::{LlmInput, Work};
pub use results::{ResultsSink, ResultsWriter};
pub use route::Routed;
pub use source::{
    tasks, ByTenant, KeyCheck, Misplaced, Owners, TaskSource, TaskTopic, MISPLACED_METRIC,
};
pub use source::{RawKey, Task};

/// What a pipeline needs in scope: the builder and the extension traits.
pub mod prelude {
    pub use super::{
        tasks, BatchStreamExt, ResultStreamExt, RoutedStreamExt, TaskSource, TaskStreamExt,
    };
    pub use crate::steps::account::AccountStreamExt;
    pub use sluice_topology::{KStream, Record, StreamBuilder};
}

/// `route` on a stream of tasks.
pub trait TaskStreamExt<K> {
    /// Picks each task's model (see [`crate::steps::route`]).
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
    // Outcomes are read again only for redeliveries: not kept in the
    // record cache the accounts' windows use.
    let (outcomes, kept) = llm.idempotency_store();
    stream
        .builder()
        .add_window_store_with(&outcomes, kept, false);
    let mut stores = vec![outcomes];
    // Hard quotas read the tenant windows the accountant keeps; recovered
    // results are added to them.
    if let Some(accounting) = llm.accounting() {
        stores.extend_from_slice(accounting.declare_stores(stream.builder()));
    }
    let refs: Vec<&str> = stores.iter().map(String::as_str).collect();
    let step = llm.clone();
    stream.process(llm.name(), &refs, move || LlmProcessor::new(step.clone()))
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
