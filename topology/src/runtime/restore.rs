//! Restores a task's stores from their changelogs.
//!
//! The end of a changelog partition is found without trusting the broker's high
//! watermark: before reading, the restorer writes a barrier record to every
//! partition it restores (inside a committed transaction under exactly-once,
//! after the task's producer fenced any transaction its previous owner left
//! open) and reads until it meets that record. Whatever the broker reports, the
//! barrier is the last record that matters.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers as _;
use rdkafka::{Message, Offset, TopicPartitionList};
use sluice_state::{RestoreStats, StoreId, TaskState};

/// A changelog record as restored: key and value (or tombstone).
type RestoredRecord = (Vec<u8>, Option<Vec<u8>>);

use super::config::{Guarantee, StreamsConfig};
use super::kafka::{
    client_config, close_in_background, commit_transaction, send, DeliveryState, DeliveryTag,
    TrackedProducer,
};
use super::RuntimeError;
use crate::{TaskId, Topology};

/// Header marking restore barrier records; restores skip them.
pub const BARRIER_HEADER: &str = "sluice.barrier";
const BARRIER_KEY: &[u8] = b"\0sluice.barrier";
/// How long a restore waits without reading anything before it writes a new barrier.
const BARRIER_STALL: Duration = Duration::from_secs(10);

/// Restores the changelogged stores of one task. Returns what was applied.
#[allow(clippy::too_many_arguments)]
pub(crate) fn restore_task(
    cfg: &StreamsConfig,
    task: TaskId,
    state: &mut TaskState,
    producer: &TrackedProducer,
    delivery: &DeliveryState,
    cancel: &AtomicBool,
) -> Result<RestoreStats, RuntimeError> {
    let stores: Vec<(StoreId, String)> = state
        .specs()
        .enumerate()
        .filter(|(_, s)| s.changelogged)
        .map(|(i, s)| {
            (
                StoreId(i),
                Topology::changelog_topic(&cfg.application_id, &s.name),
            )
        })
        .collect();
    let mut stats = RestoreStats::default();
    if stores.is_empty() {
        return Ok(stats);
    }
    let barriers = write_barriers(cfg, task, &stores, producer, delivery)?;

    let mut tpl = TopicPartitionList::new();
    let mut remaining: HashMap<String, (StoreId, i64)> = HashMap::new();
    for ((id, topic), barrier) in stores.iter().zip(&barriers) {
        let mut from = state.restore_offset(*id);
        if from > *barrier {
            tracing::warn!(%task, topic, from, barrier, "checkpoint is past the changelog end; restoring in full");
            state.wipe_store(*id)?;
            from = 0;
        }
        if from >= *barrier {
            state.finish_restore(*id, *barrier + 1)?;
            continue;
        }
        tpl.add_partition_offset(topic, task.partition, Offset::Offset(from))?;
        remaining.insert(topic.clone(), (*id, *barrier));
    }
    if remaining.is_empty() {
        // Nothing past the checkpoint: no consumer needed (creating and
        // destroying one costs a tenth of a second).
        return Ok(stats);
    }
    let mut c = client_config(cfg);
    c.set("group.id", format!("{}-restore", cfg.application_id))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("fetch.max.bytes", "52428800")
        .set("max.partition.fetch.bytes", "10485760");
    if cfg.guarantee == Guarantee::ExactlyOnce {
        c.set("isolation.level", "read_committed");
    }
    let consumer: BaseConsumer = c.create()?;
    consumer.assign(&tpl)?;
    let deadline = Instant::now() + cfg.restore_timeout;
    let mut batches: HashMap<StoreId, Vec<RestoredRecord>> = HashMap::new();
    let mut last_progress = Instant::now();
    while !remaining.is_empty() {
        if cancel.load(Ordering::Relaxed) {
            return Err(RuntimeError::Cancelled);
        }
        if last_progress.elapsed() > BARRIER_STALL {
            // Nothing readable for a while although the barrier was committed:
            // a broker may hold a committed transaction back (the local test
            // broker does when transaction ends race). A new barrier transaction
            // gives it another chance to apply, and a later end to read to.
            let stalled: Vec<(StoreId, String)> = remaining
                .iter()
                .map(|(topic, (id, _))| (*id, topic.clone()))
                .collect();
            tracing::warn!(%task, topics = ?stalled.iter().map(|s| &s.1).collect::<Vec<_>>(), "restore stalled; writing a new barrier");
            let fresh = write_barriers(cfg, task, &stalled, producer, delivery)?;
            for ((_, topic), b) in stalled.iter().zip(fresh) {
                if let Some(entry) = remaining.get_mut(topic) {
                    entry.1 = b;
                }
            }
            last_progress = Instant::now();
        }
        if Instant::now() > deadline {
            return Err(RuntimeError::Other(format!(
                "task {task}: restore did not reach the end of {:?} within {:?}",
                remaining.keys().collect::<Vec<_>>(),
                cfg.restore_timeout
            )));
        }
        let Some(msg) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let msg = msg?;
        last_progress = Instant::now();
        let Some(&(id, barrier)) = remaining.get(msg.topic()) else {
            continue;
        };
        let is_barrier = msg
            .headers()
            .is_some_and(|h| h.iter().any(|h| h.key == BARRIER_HEADER));
        if msg.offset() < barrier && !is_barrier {
            if let Some(key) = msg.key() {
                batches
                    .entry(id)
                    .or_default()
                    .push((key.to_vec(), msg.payload().map(<[u8]>::to_vec)));
            }
            if batches.get(&id).is_some_and(|b| b.len() >= 10_000) {
                let batch = batches.remove(&id).unwrap_or_default();
                state.apply_restored(id, &batch, &mut stats)?;
            }
        }
        if msg.offset() >= barrier {
            let batch = batches.remove(&id).unwrap_or_default();
            state.apply_restored(id, &batch, &mut stats)?;
            state.finish_restore(id, barrier + 1)?;
            remaining.remove(msg.topic());
        }
    }
    // The task need not wait for the consumer to close to start processing.
    close_in_background(consumer);
    Ok(stats)
}

/// Writes a barrier record to each changelog partition and returns their
/// offsets, in `stores` order.
fn write_barriers(
    cfg: &StreamsConfig,
    task: TaskId,
    stores: &[(StoreId, String)],
    producer: &TrackedProducer,
    delivery: &DeliveryState,
) -> Result<Vec<i64>, RuntimeError> {
    use rdkafka::producer::Producer;
    let eos = cfg.guarantee == Guarantee::ExactlyOnce;
    let timeout = Duration::from_secs(30);
    if eos {
        producer.begin_transaction()?;
    }
    let headers = vec![(BARRIER_HEADER.to_string(), task.to_string().into_bytes())];
    let mut receivers = Vec::new();
    for (_, topic) in stores {
        let (tx, rx) = std::sync::mpsc::channel();
        send(
            producer,
            topic,
            Some(task.partition),
            Some(BARRIER_KEY),
            Some(b""),
            None,
            &headers,
            DeliveryTag::Barrier(tx),
        )?;
        receivers.push(rx);
    }
    // Under at-least-once the producer is shared by every task: flushing it
    // would wait for their traffic too. The barriers' own acknowledgements
    // are all a restore waits for.
    if eos {
        commit_transaction(producer, delivery, timeout)?;
    }
    receivers
        .into_iter()
        .map(|rx| match rx.recv_timeout(timeout) {
            Ok(Ok(offset)) => Ok(offset),
            Ok(Err(e)) => Err(RuntimeError::Other(format!(
                "task {task}: restore barrier failed: {e}"
            ))),
            Err(_) => Err(RuntimeError::Other(format!(
                "task {task}: restore barrier not acknowledged"
            ))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::ClientConfig;

    use super::*;
    use crate::runtime::kafka::create_producer;

    fn unique(p: &str) -> String {
        format!("{p}-{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
    }

    #[test]
    fn a_barrier_waits_for_its_own_acknowledgement_not_for_other_tasks_traffic() {
        // At-least-once tasks share one producer. Another task's steady
        // output keeps that producer's queue from ever running empty, so a
        // barrier that waited for a flush of the producer would run into its
        // timeout (and stop the instance); it waits for its own record only.
        let bootstrap = std::env::var("SLUICE_TEST_BOOTSTRAP").expect(
            "SLUICE_TEST_BOOTSTRAP is not set: run the tests with `make test`, which starts the broker",
        );
        let (changelog, busy) = (unique("barrier-changelog"), unique("barrier-busy"));
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .create()
            .unwrap();
        let new = [
            NewTopic::new(&changelog, 1, TopicReplication::Fixed(1)),
            NewTopic::new(&busy, 1, TopicReplication::Fixed(1)),
        ];
        futures::executor::block_on(admin.create_topics(&new, &AdminOptions::new())).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cfg = StreamsConfig::new(&unique("barrier-app"), &bootstrap, dir.path());
        assert_eq!(cfg.guarantee, Guarantee::AtLeastOnce);
        let (producer, delivery) = create_producer(&cfg, None).unwrap();
        let other = TaskId {
            subtopology: 0,
            partition: 1,
        };
        let stop = AtomicBool::new(false);
        let value = vec![b'x'; 2_000];
        let result = std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let sent = send(
                        &producer,
                        &busy,
                        Some(0),
                        None,
                        Some(&value),
                        None,
                        &Vec::new(),
                        DeliveryTag::Output(other),
                    );
                    if sent.is_err() {
                        // The queue is full: the traffic stays steady.
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            });
            std::thread::sleep(Duration::from_millis(500));
            let task = TaskId {
                subtopology: 0,
                partition: 0,
            };
            let result = write_barriers(
                &cfg,
                task,
                &[(StoreId(0), changelog.clone())],
                &producer,
                &delivery,
            );
            stop.store(true, Ordering::Relaxed);
            result
        });
        let offsets = result.expect("the barrier was acknowledged during the other traffic");
        assert_eq!(offsets.len(), 1);
        assert!(offsets[0] >= 0, "{offsets:?}");
    }
}
