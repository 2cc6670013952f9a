//! Taking over a partition under exactly-once: find the results the previous
//! owner wrote that the restored state does not know about.
//!
//! A correct broker aborts the transaction an owner was killed in; the test
//! broker instead exposes its records when the new owner fences it (design §8).
//! Either way the results topics are the truth about what was emitted. Each
//! task writes its results to its own partition of the results topics with the
//! input position in headers, and remembers (in its meta store, one commit
//! behind) where its committed results end. On takeover it reads its results
//! partitions from there to the end and records every result it finds in the
//! idempotency store, stamped with that input position — so replayed input
//! whose result is already visible is neither called nor emitted again.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sluice_topology::ProcessError;

use super::{idempotency_key, result_position, Ctx, LlmProcessor, Recovery, StoredOutcome};
use crate::envelope::TaskResult;

const SCAN_TIMEOUT: Duration = Duration::from_secs(60);

pub(super) fn recover_results(
    p: &mut LlmProcessor,
    ctx: &mut Ctx<'_>,
    recovery: &Recovery,
) -> Result<(), ProcessError> {
    let partition = ctx.task_id().partition;
    let fatal = |e: &dyn std::fmt::Display| {
        ProcessError::Fatal(format!("recovering results of partition {partition}: {e}"))
    };
    let mut c = ClientConfig::new();
    for (k, v) in &recovery.client {
        c.set(k, v);
    }
    c.set("group.id", &recovery.group_id)
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed");
    let consumer: BaseConsumer = c.create().map_err(|e| fatal(&e))?;
    let mut recovered = 0u64;
    for topic in &recovery.topics {
        let from = p.meta.results_end.get(topic).copied().unwrap_or(0);
        let (_, high) = consumer
            .fetch_watermarks(topic, partition, Duration::from_secs(10))
            .map_err(|e| fatal(&e))?;
        if from >= high {
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, partition, Offset::Offset(from))
            .map_err(|e| fatal(&e))?;
        consumer.assign(&tpl).map_err(|e| fatal(&e))?;
        let deadline = Instant::now() + SCAN_TIMEOUT;
        // Read to the high watermark. Transaction markers take the last offsets
        // and are never delivered, so the end is also reached when the
        // consumer's position passes the watermark, or when nothing more comes:
        // after fencing, nobody else writes this task's results partition.
        let mut idle_since = Instant::now();
        loop {
            if Instant::now() > deadline {
                return Err(fatal(&format!(
                    "reading {topic} did not reach offset {high}"
                )));
            }
            let Some(msg) = consumer.poll(Duration::from_millis(100)) else {
                let position = consumer.position().ok().and_then(|tpl| {
                    tpl.find_partition(topic, partition)
                        .and_then(|e| e.offset().to_raw())
                });
                if position.is_some_and(|p| p >= high)
                    || idle_since.elapsed() > Duration::from_secs(1)
                {
                    break;
                }
                continue;
            };
            idle_since = Instant::now();
            let msg = msg.map_err(|e| fatal(&e))?;
            let headers = sluice_topology::message_headers(&msg);
            let Some(position) = result_position(&headers) else {
                continue;
            };
            let Some(bytes) = msg.payload() else { continue };
            let Ok(result) = serde_json::from_slice::<TaskResult>(bytes) else {
                continue;
            };
            let mut completed = ctx.kv::<String, StoredOutcome>(&p.completed_store)?;
            let key = idempotency_key(&result.task_type, &result.task_id);
            if completed.get(&key)?.is_some() {
                continue;
            }
            let bucket = p.step.expiry_bucket();
            completed.put_at(
                &key,
                &StoredOutcome {
                    result_json: bytes.to_vec(),
                    success: result.success,
                    bucket,
                },
                Some(position),
            );
            recovered += 1;
        }
    }
    // Recovery runs on the engine's thread, which need not wait for the
    // consumer to close (about a tenth of a second).
    sluice_topology::runtime::close_in_background(consumer);
    if recovered > 0 {
        tracing::info!(
            partition,
            recovered,
            "recovered results an interrupted transaction left visible"
        );
        p.metrics().recovered.inc_by(recovered);
    }
    Ok(())
}
