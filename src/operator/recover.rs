//! Taking over a partition under exactly-once: find the results and
//! re-published tasks the previous owner wrote that the restored state does
//! not know about.
//!
//! A correct broker aborts the transaction an owner was killed in; the test
//! broker instead exposes its records when the new owner fences it (ARCHITECTURE.md, broker quirks).
//! Either way the results topics are the truth about what was emitted. Each
//! task writes its results to its own partition of the results topics with the
//! input position in headers, and remembers (in its meta store, one commit
//! behind) where its committed results end. On takeover it reads its results
//! partitions from there to the end and records every result it finds in the
//! idempotency store, stamped with that input position — so replayed input
//! whose result is already visible is neither called nor emitted again.
//!
//! Re-published tasks go to the task's own partition of its task topic,
//! carrying the position of the record that re-published them. The task topic
//! is read from the group's committed offset (nothing below it is replayed)
//! to the end; each re-published attempt found is recorded for its task
//! (`republished:<attempt>`), so a replayed record of an earlier attempt
//! emits nothing: its re-publish is already out.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::BorrowedMessage;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sluice_topology::{Position, ProcessError};

use super::{idempotency_key, result_position, Ctx, LlmProcessor, Recovery, StoredOutcome};
use crate::accounting::{Seq, HEADER_SEQ};
use crate::envelope::{TaskEnvelope, TaskResult};

const SCAN_TIMEOUT: Duration = Duration::from_secs(60);

pub(super) fn recover_results(
    p: &mut LlmProcessor,
    ctx: &mut Ctx<'_>,
    recovery: &Recovery,
) -> Result<(), ProcessError> {
    let partition = ctx.task_id().partition;
    let fatal = |e: &dyn std::fmt::Display| fatal(partition, e);
    let mut c = ClientConfig::new();
    for (k, v) in &recovery.client {
        c.set(k, v);
    }
    // The application's group, for its committed offsets; this consumer never
    // joins it and commits nothing.
    c.set("group.id", &recovery.group_id)
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed");
    let consumer: BaseConsumer = c.create().map_err(|e| fatal(&e))?;
    let mut recovered = 0u64;
    for topic in &recovery.topics {
        let from = p.meta.results_end.get(topic).copied().unwrap_or(0);
        scan(&consumer, topic, partition, from, |msg, position| {
            let Some(bytes) = msg.payload() else {
                return Ok(());
            };
            let Ok(result) = serde_json::from_slice::<TaskResult>(bytes) else {
                return Ok(());
            };
            // Added to exactly the windows that do not hold it yet: a broker
            // that exposes an interrupted transaction may have shown any part
            // of its changelogs.
            let headers = sluice_topology::message_headers(msg);
            let seq = headers
                .iter()
                .find(|(k, _)| k == HEADER_SEQ)
                .and_then(|(_, v)| Seq::decode(v));
            if let (Some(seq), Some(accounting)) = (seq, p.step.accounting()) {
                accounting.add_result(ctx, &result, seq, true)?;
            }
            let mut completed = ctx.kv::<String, StoredOutcome>(&p.completed_store)?;
            let key = idempotency_key(&result.task_type, &result.task_id);
            if completed.get(&key)?.is_some_and(|s| s.success) {
                return Ok(());
            }
            let outcome = StoredOutcome {
                result_json: bytes.to_vec(),
                success: result.success,
                bucket: p.step.expiry_bucket(),
            };
            completed.put_at(&key, &outcome, Some(position));
            recovered += 1;
            Ok(())
        })?;
    }
    let mut tpl = TopicPartitionList::new();
    for topic in &recovery.task_topics {
        tpl.add_partition(topic, partition);
    }
    let committed = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .map_err(|e| fatal(&e))?;
    for topic in &recovery.task_topics {
        let from = committed
            .find_partition(topic, partition)
            .and_then(|e| e.offset().to_raw())
            .unwrap_or(0)
            .max(0);
        scan(&consumer, topic, partition, from, |msg, position| {
            let Some(Ok(task)) = msg.payload().map(serde_json::from_slice::<TaskEnvelope>) else {
                return Ok(());
            };
            let mut completed = ctx.kv::<String, StoredOutcome>(&p.completed_store)?;
            let key = idempotency_key(&task.task_type, &task.task_id);
            match completed.get(&key)? {
                Some(s) if s.success => return Ok(()),
                Some(s) if republished_attempt(&s).is_some_and(|a| a >= task.attempt_number) => {
                    return Ok(())
                }
                _ => {}
            }
            let outcome = StoredOutcome {
                result_json: format!("{REPUBLISHED}{}", task.attempt_number).into_bytes(),
                success: false,
                bucket: p.step.expiry_bucket(),
            };
            completed.put_at(&key, &outcome, Some(position));
            recovered += 1;
            Ok(())
        })?;
    }
    // Recovery runs on the engine's thread, which need not wait for the
    // consumer to close (about a tenth of a second).
    sluice_topology::runtime::close_in_background(consumer);
    if recovered > 0 {
        tracing::info!(
            partition,
            recovered,
            "recovered results and re-published tasks an interrupted transaction left visible"
        );
        p.metrics().recovered.inc_by(recovered);
    }
    Ok(())
}

/// A stored outcome's prefix for a task re-published with this attempt.
const REPUBLISHED: &str = "republished:";

/// The attempt a stored outcome says its task was re-published with.
pub(super) fn republished_attempt(stored: &StoredOutcome) -> Option<u32> {
    if stored.success {
        return None;
    }
    std::str::from_utf8(stored.result_json.strip_prefix(REPUBLISHED.as_bytes())?)
        .ok()?
        .parse()
        .ok()
}

fn fatal(partition: i32, e: &dyn std::fmt::Display) -> ProcessError {
    ProcessError::Fatal(format!("recovering results of partition {partition}: {e}"))
}

/// Reads `topic`'s `partition` from `from` to its end, handing every record
/// that carries an input position (written by a task) to `f`.
fn scan(
    consumer: &BaseConsumer,
    topic: &str,
    partition: i32,
    from: i64,
    mut f: impl FnMut(&BorrowedMessage<'_>, Position) -> Result<(), ProcessError>,
) -> Result<(), ProcessError> {
    let kafka = |e: &dyn std::fmt::Display| fatal(partition, e);
    let (_, high) = consumer
        .fetch_watermarks(topic, partition, Duration::from_secs(10))
        .map_err(|e| kafka(&e))?;
    if from >= high {
        return Ok(());
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(from))
        .map_err(|e| kafka(&e))?;
    consumer.assign(&tpl).map_err(|e| kafka(&e))?;
    let deadline = Instant::now() + SCAN_TIMEOUT;
    // Read to the high watermark. Transaction markers take the last offsets
    // and are never delivered, so the end is also reached when the
    // consumer's position passes the watermark, or when nothing more comes:
    // after fencing, nobody else writes this task's results partition.
    let mut idle_since = Instant::now();
    loop {
        if Instant::now() > deadline {
            return Err(kafka(&format!(
                "reading {topic} did not reach offset {high}"
            )));
        }
        let Some(msg) = consumer.poll(Duration::from_millis(100)) else {
            let position = consumer.position().ok().and_then(|tpl| {
                tpl.find_partition(topic, partition)
                    .and_then(|e| e.offset().to_raw())
            });
            if position.is_some_and(|p| p >= high) || idle_since.elapsed() > Duration::from_secs(1)
            {
                return Ok(());
            }
            continue;
        };
        idle_since = Instant::now();
        let msg = msg.map_err(|e| kafka(&e))?;
        let headers = sluice_topology::message_headers(&msg);
        if let Some(position) = result_position(&headers) {
            f(&msg, position)?;
        }
        if msg.offset() + 1 >= high {
            return Ok(());
        }
    }
}
