//! `to_results`: each result to the completed or the failed results topic.
//!
//! A result goes to the partition number of the task's own input partition
//! (not the key's hash), carrying the headers it was forwarded with (the
//! task's trace context and input position). So a task owns its results
//! partitions: a task taking over a partition can read what its previous
//! owner wrote there (see `invoke_llm`'s recovery), and no two tasks'
//! transactions share a results partition.

use sluice_topology::{OutputRecord, ProcessError, Processor, ProcessorContext, Record};

use crate::envelope::TaskResult;

/// The results topics.
#[derive(Clone, Debug)]
pub struct ResultsSink {
    /// Successful results.
    pub completed: String,
    /// Failed results.
    pub failed: String,
}

impl ResultsSink {
    /// Both topics.
    pub fn topics(&self) -> Vec<String> {
        vec![self.completed.clone(), self.failed.clone()]
    }

    /// The operator's name.
    pub fn name(&self) -> String {
        format!("results:{}:{}", self.completed, self.failed)
    }
}

/// Writes results (one instance per task).
pub struct ResultsWriter {
    sink: ResultsSink,
}

impl ResultsWriter {
    /// A writer to `sink`.
    pub fn new(sink: ResultsSink) -> Self {
        ResultsWriter { sink }
    }
}

impl Processor<String, TaskResult> for ResultsWriter {
    type OutKey = ();
    type OutValue = ();
    type Output = ();

    fn process(
        &mut self,
        record: Record<String, TaskResult>,
        ctx: &mut ProcessorContext<'_, (), (), ()>,
    ) -> Result<(), ProcessError> {
        let json = serde_json::to_vec(&record.value)
            .map_err(|e| ProcessError::Fatal(format!("result encoding: {e}")))?;
        let topic = if record.value.success {
            &self.sink.completed
        } else {
            &self.sink.failed
        };
        ctx.emit(OutputRecord {
            topic: topic.clone(),
            partition: Some(ctx.task_id().partition),
            key: Some(record.key.into_bytes()),
            value: Some(json),
            timestamp: record.timestamp,
            headers: record.headers,
        })?;
        Ok(())
    }
}
