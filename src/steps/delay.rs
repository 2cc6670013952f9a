//! `await_retries`: a re-published attempt waits for its `notBefore` (its
//! backoff) before it goes on, without holding up the tasks behind it. The
//! wait is an async call of its own: the record stays in flight (its offset
//! uncommitted, so a restart waits out the rest) while later records pass.
//! A wait is never longer than the configured longest backoff, whatever
//! time a task carries.

use std::time::Duration;

use sluice_topology::{Data, ProcessError, Processor, ProcessorContext, Record};

use super::Routed;

/// The `await_retries` operator.
pub struct RetryWait {
    /// The longest wait.
    pub max: Duration,
}

impl<K: Data> Processor<K, Routed> for RetryWait {
    type OutKey = K;
    type OutValue = Routed;
    type Output = Record<K, Routed>;

    fn process(
        &mut self,
        record: Record<K, Routed>,
        ctx: &mut ProcessorContext<'_, K, Routed, Self::Output>,
    ) -> Result<(), ProcessError> {
        let wait = record
            .value
            .task
            .envelope
            .not_before
            .and_then(|t| (t - chrono::Utc::now()).to_std().ok())
            .map(|w| w.min(self.max));
        match wait {
            Some(wait) if !wait.is_zero() => {
                ctx.spawn(async move {
                    tokio::time::sleep(wait).await;
                    record
                });
                Ok(())
            }
            _ => ctx.forward(record),
        }
    }

    fn complete(
        &mut self,
        record: Record<K, Routed>,
        ctx: &mut ProcessorContext<'_, K, Routed, Self::Output>,
    ) -> Result<(), ProcessError> {
        ctx.forward(record)
    }
}
