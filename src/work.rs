//! What flows between the LLM pipeline's steps: decoded tasks, tasks with
//! their model, micro-batches of them, and what `invoke_llm` takes in. Both
//! the pipeline's steps (`crate::pipeline`) and the provider call
//! (`crate::operator`) use these; neither depends on the other for them.

use sluice_topology::{Data, Headers, InFlight};

use crate::envelope::{Route, TaskEnvelope};

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

/// Tasks that share one provider call (or a task alone).
#[derive(Clone)]
pub struct Batch {
    /// The batch's id, recorded in its results (`None` for a task alone).
    pub id: Option<String>,
    /// Its tasks, in arrival order.
    pub items: Vec<BatchItem>,
}

/// A task in a batch, holding its input record in flight.
#[derive(Clone)]
pub struct BatchItem {
    /// The task.
    pub task: Routed,
    /// Its record's headers (trace context).
    pub headers: Headers,
    /// Its input record, finished when the last clone is dropped.
    pub held: InFlight,
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
