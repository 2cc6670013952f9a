//! Restores a task's stores from their changelogs.
//!
//! Each changelog partition is read from the store's checkpoint to its end:
//! the last stable offset under exactly-once (`read_committed`; the task's
//! producer fenced its previous owner first, which aborted any transaction
//! that owner left open), the high watermark under at-least-once. librdkafka
//! reports reaching it (`enable.partition.eof`). A restore has no deadline:
//! it goes on as long as it takes (a revocation cancels it), and advances the
//! store's checkpoint as it goes, so a restore that is interrupted starts
//! again near where it stopped rather than from the beginning.
//!
//! A checkpoint past the changelog's end wipes the store (restored in full)
//! only when the log itself ends before it: the changelog was recreated or
//! truncated. Read committed, the end can also be held below the checkpoint
//! by a transaction on the changelog not yet complete (its markers written
//! late after a broker restart or stall): the store is kept.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{Message, Offset, TopicPartitionList};
use sluice_state::{RestoreStats, StoreId, StoreSpec, TaskState};

/// A changelog record as restored: key and value (or tombstone).
type RestoredRecord = (Vec<u8>, Option<Vec<u8>>);

use super::config::StreamsConfig;
use super::error::RuntimeError;
use super::fetched::FetchQueue;
use super::kafka::{client_config, close_in_background, until_done, FETCH_QUEUE_BACKOFF_MS};
use crate::{Guarantee, TaskId, Topology};

/// Restored records applied to RocksDB at once, by their size (key, value
/// and 64 bytes for the pair's bookkeeping): a batch this large is written
/// as one table file and ingested.
const BATCH_BYTES: usize = 4 << 20;
/// The bookkeeping counted per record of a batch.
const RECORD_OVERHEAD: usize = 64;

/// Changelog records taken from a queue in one call.
const TAKE: usize = 1_024;
/// How long a watermark look-up waits before it is tried again.
const WATERMARK_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting a restore consumer ahead of its restore may wait for
/// a changelog's leader (the restore itself waits as long as it takes).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A task's restore consumer.
pub(crate) type RestoreConsumer = Arc<BaseConsumer<RestoreContext>>;

/// The changelogged stores of a task's sub-topology and their changelogs.
pub(crate) fn changelogs<'a>(
    cfg: &StreamsConfig,
    specs: impl IntoIterator<Item = &'a StoreSpec>,
) -> Vec<(StoreId, String)> {
    specs
        .into_iter()
        .enumerate()
        .filter(|(_, s)| s.changelogged)
        .map(|(i, s)| {
            (
                StoreId(i),
                Topology::changelog_topic(&cfg.application_id, &s.name),
            )
        })
        .collect()
}

/// Creates a restore consumer and connects it to the leaders of a task's
/// changelog partitions (a watermark look-up each), so the restore itself
/// starts connected. Called while the task fences its previous owner: what
/// it learns is not used (the restore looks the ends up again once the
/// previous owner can no longer commit). `None` when the consumer cannot
/// be created; the restore then reports why.
pub(crate) fn connect_restore_consumer(
    cfg: &StreamsConfig,
    changelogs: &[(StoreId, String)],
    partition: i32,
) -> Option<RestoreConsumer> {
    let consumer = create_restore_consumer(cfg).ok()?;
    for (_, topic) in changelogs {
        let _ = consumer.fetch_watermarks(topic, partition, CONNECT_TIMEOUT);
    }
    Some(consumer)
}

fn create_restore_consumer(cfg: &StreamsConfig) -> Result<RestoreConsumer, RuntimeError> {
    let mut c = client_config(cfg);
    c.set("group.id", format!("{}-restore", cfg.application_id))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest")
        .set("fetch.max.bytes", "52428800")
        .set("max.partition.fetch.bytes", "10485760")
        // A fetch at the end comes back at once (the end is what the restore
        // waits for), not after the broker's default half-second wait.
        .set("fetch.wait.max.ms", "10")
        // Fetching again soon after the queue was full (see the driver's
        // consumer): the restore applies in batches and must not wait a
        // second for the next fetch.
        .set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS);
    if cfg.guarantee == Guarantee::ExactlyOnce {
        c.set("isolation.level", "read_committed");
    }
    Ok(Arc::new(c.create_with_context(RestoreContext)?))
}

/// Restores the changelogged `stores` of one task (see [`changelogs`]), with
/// `consumer` if one was connected beforehand (see
/// [`connect_restore_consumer`]). Returns what was applied.
pub(crate) fn restore_task(
    cfg: &StreamsConfig,
    task: TaskId,
    state: &mut TaskState,
    stores: &[(StoreId, String)],
    consumer: Option<RestoreConsumer>,
    cancel: &AtomicBool,
) -> Result<RestoreStats, RuntimeError> {
    let mut stats = RestoreStats::default();
    if stores.is_empty() {
        return Ok(stats);
    }
    let consumer = match consumer {
        Some(c) => c,
        None => create_restore_consumer(cfg)?,
    };
    let mut tpl = TopicPartitionList::new();
    // Per changelog being restored: its store and the next offset to apply.
    let mut remaining: Vec<(String, StoreId, i64)> = Vec::new();
    // A client reading uncommitted, made when a checkpoint is past a
    // read-committed end (see below).
    let mut uncommitted = None;
    for (id, topic) in stores {
        let mut from = state.restore_offset(*id);
        // With nothing local the store reads from the start, and needs no
        // look-up of the changelog's ends: the end is where the consumer
        // reports reaching it, and a start deleted by retention is skipped
        // by `auto.offset.reset`.
        if from > 0 {
            let (low, high) = watermarks(&consumer, topic, task.partition, cancel)?;
            if from > high {
                // Read committed (exactly-once), the end is the last stable
                // offset: an incomplete transaction on the changelog holds it
                // back. The log's own end tells a recreated changelog apart.
                let log_end = match cfg.guarantee {
                    Guarantee::ExactlyOnce => {
                        let c = match &uncommitted {
                            Some(c) => c,
                            None => uncommitted.insert(create_uncommitted_client(cfg)?),
                        };
                        watermarks(c, topic, task.partition, cancel)?.1
                    }
                    Guarantee::AtLeastOnce => high,
                };
                if log_end < from {
                    // The changelog is shorter than what the store says it
                    // holds: it was recreated (or truncated). What is local
                    // cannot be trusted.
                    tracing::warn!(%task, topic, from, end = log_end, "checkpoint is past the changelog end; restoring in full");
                    state.wipe_store(*id)?;
                    from = 0;
                } else {
                    // The store's checkpoint only ever passes records whose
                    // transaction committed, and the log holds them: the
                    // store is kept, and nothing past the end can be read yet
                    // (as Kafka Streams' restore, which reads to the same
                    // end).
                    tracing::warn!(%task, topic, from, end = high, log_end, "the changelog's last stable offset is below the checkpoint (a transaction on it is not complete): the store stays at its checkpoint");
                }
            }
            if from >= high {
                state.restored_to(*id, from)?;
                continue;
            }
            // Below the start, records were deleted by retention (expired
            // windows): restore from what is there.
            from = from.max(low);
        }
        tpl.add_partition_offset(topic, task.partition, Offset::Offset(from))?;
        remaining.push((topic.clone(), *id, from));
    }
    if let Some(c) = uncommitted {
        close_in_background(c);
    }
    if remaining.is_empty() {
        // Nothing past the checkpoint: the consumer is not needed.
        close_in_background(consumer);
        return Ok(stats);
    }
    // A queue per changelog, so reaching its end (an EOF event names only a
    // partition number) tells which store is restored; split before the
    // assignment, so no record or event of theirs reaches the consumer's own
    // queue first.
    // Their records' arrival wakes the loop below.
    let (wake_tx, wake) = crossbeam_channel::bounded::<()>(1);
    let mut queues = Vec::with_capacity(remaining.len());
    for (topic, id, from) in remaining {
        let mut queue = consumer
            .split_partition_queue(&topic, task.partition)
            .ok_or_else(|| RuntimeError::RestoreQueue {
                topic: topic.clone(),
            })?;
        let tx = wake_tx.clone();
        queue.set_nonempty_callback(move || {
            let _ = tx.try_send(());
        });
        // Read in batches through a second handle (see fetched.rs); the
        // first keeps the split and the wake-up.
        let fetch = FetchQueue::of(&consumer, &topic, task.partition).ok_or_else(|| {
            RuntimeError::RestoreQueue {
                topic: topic.clone(),
            }
        })?;
        queues.push((
            topic,
            id,
            from,
            (queue, fetch),
            (Vec::<RestoredRecord>::new(), 0usize),
        ));
    }
    let mut taken = Vec::with_capacity(TAKE);
    consumer.assign(&tpl)?;
    let mut done = vec![false; queues.len()];
    while done.iter().any(|d| !d) {
        if cancel.load(Ordering::Relaxed) {
            drop(queues);
            close_in_background(consumer);
            return Err(RuntimeError::Cancelled);
        }
        let mut idle = true;
        for (i, (topic, id, next, (_, fetch), (batch, bytes))) in queues.iter_mut().enumerate() {
            while !done[i] {
                fetch.take(TAKE, &mut taken);
                if taken.is_empty() {
                    break;
                }
                idle = false;
                for m in taken.drain(..) {
                    if done[i] {
                        // Past the end the restore saw: left unread, as
                        // it would have been in the queue.
                        continue;
                    }
                    match m.error().map_or(Ok(&m), Err) {
                        Ok(m) => {
                            if let Some(key) = m.key() {
                                let value = m.payload();
                                *bytes +=
                                    key.len() + value.map_or(0, <[u8]>::len) + RECORD_OVERHEAD;
                                batch.push((key.to_vec(), value.map(<[u8]>::to_vec)));
                            }
                            *next = m.offset() + 1;
                            if *bytes >= BATCH_BYTES {
                                *bytes = 0;
                                state.apply_restored(*id, &std::mem::take(batch), &mut stats)?;
                                // A restore interrupted from here on starts again here.
                                state.restored_to(*id, *next)?;
                            }
                        }
                        Err(KafkaError::PartitionEOF(_)) => {
                            *bytes = 0;
                            state.apply_restored(*id, &std::mem::take(batch), &mut stats)?;
                            state.restored_to(*id, *next)?;
                            done[i] = true;
                        }
                        Err(e) if RuntimeError::from(e.clone()).retriable() => {
                            tracing::debug!(%task, topic, error = %e, "restore: retriable consumer error");
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        if idle {
            // Waits for a queue to fill, serving the consumer's own events
            // (errors, logs) meanwhile; its records all go to the queues.
            let _ = wake.recv_timeout(Duration::from_millis(50));
            match consumer.poll(Duration::ZERO) {
                Some(Err(e)) => tracing::debug!(%task, error = %e, "restore consumer"),
                Some(Ok(m)) => {
                    return Err(RuntimeError::RestoreStray {
                        topic: m.topic().to_string(),
                    })
                }
                None => {}
            }
        }
    }
    drop(queues);
    // The task need not wait for the consumer to close to start processing.
    close_in_background(consumer);
    Ok(stats)
}

/// The restore consumer's context: reaching a partition's end is what the
/// restore waits for, not an error to log (librdkafka reports it through the
/// error callback too).
pub(crate) struct RestoreContext;

impl rdkafka::ClientContext for RestoreContext {
    fn error(&self, error: KafkaError, reason: &str) {
        match error {
            KafkaError::PartitionEOF(_)
            | KafkaError::Global(rdkafka::error::RDKafkaErrorCode::PartitionEOF) => {
                tracing::trace!(reason, "changelog end reached")
            }
            e => tracing::warn!(error = %e, reason, "restore consumer"),
        }
    }
}

impl rdkafka::consumer::ConsumerContext for RestoreContext {}

/// A client to ask a changelog's log end of (its high watermark): it reads
/// uncommitted, where the restore consumer under exactly-once reads
/// committed and sees the last stable offset as the end.
fn create_uncommitted_client(
    cfg: &StreamsConfig,
) -> Result<BaseConsumer<RestoreContext>, RuntimeError> {
    let mut c = client_config(cfg);
    c.set("group.id", format!("{}-restore", cfg.application_id))
        .set("isolation.level", "read_uncommitted");
    Ok(c.create_with_context(RestoreContext)?)
}

/// The start and end of a changelog partition (the end as the consumer's
/// isolation level sees it), asked again while it fails retriably.
fn watermarks(
    consumer: &BaseConsumer<RestoreContext>,
    topic: &str,
    partition: i32,
    cancel: &AtomicBool,
) -> Result<(i64, i64), RuntimeError> {
    until_done(
        cancel,
        || consumer.fetch_watermarks(topic, partition, WATERMARK_TIMEOUT),
        |e| tracing::warn!(topic, partition, error = %e, "changelog end not known yet; asking again"),
    )
}
