//! Instance metadata for interactive queries: which instance holds which
//! source partitions.
//!
//! Every instance with an `application_server` publishes a claim on the
//! compacted internal topic `<application_id>-instances` (one partition; key:
//! its server, value: a JSON [`InstanceClaim`]) whenever the partitions it
//! holds change and every `instance_claim_interval` besides, and deletes it
//! (a tombstone) when it stops cleanly. Each such instance also reads the
//! topic from the beginning on a thread of its own, keeping every instance's
//! newest claim. This does not depend on the group protocol (Kafka Streams
//! carries `application.server` in its assignor's user data): the engine
//! uses librdkafka's built-in assignors, and brokers differ in what they
//! report about group members.
//!
//! A claim not renewed within `instance_claim_timeout` counts as gone (its
//! instance was killed), and so does one written more than that ahead of
//! the reader's clock (it would otherwise stay fresh for ever). While a
//! rebalance moves a partition, the old and the new owner may both claim it
//! for a moment; the claim whose assignment is newer wins.
//!
//! Queries are forwarded, with their caller's credentials, to whoever a
//! claim names: a claim written by anyone but an instance of the group would
//! divert them. With a [`ClaimKey`] (`instance_claim_key`), a secret the
//! instances share, each claim carries an HMAC-SHA256 of its content and a
//! claim without a valid one is ignored; without it, only the topic's ACLs
//! (write access for the application's principal alone) keep others out.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer};
use rdkafka::{Message, Offset, TopicPartitionList};

use super::claim::{ClaimKey, Directory, InstanceClaim};
use super::clock::now_ms;
use super::config::StreamsConfig;
use super::kafka::{client_config, close_in_background};
use super::local_tasks::LocalTasks;
use super::polled::PolledProducer;
use crate::{TaskId, Topology, TopologyError};

/// The internal topic instances publish their claims on.
pub(crate) fn instances_topic(app_id: &str) -> String {
    format!("{app_id}-instances")
}

/// The thread that publishes this instance's claim and reads everyone's.
pub(crate) struct ClaimsThread {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ClaimsThread {
    /// Creates the clients (errors here stop the start) and starts the thread.
    pub(crate) fn start(
        cfg: &StreamsConfig,
        topology: &Topology,
        server: String,
        local: Arc<LocalTasks>,
        directory: Arc<Directory>,
    ) -> Result<ClaimsThread, TopologyError> {
        let app = &cfg.application_id;
        let topic = instances_topic(app);
        let producer = PolledProducer::new(
            client_config(cfg).set("acks", "all").set("linger.ms", "0"),
            DefaultProducerContext,
        )?;
        let consumer: BaseConsumer = client_config(cfg)
            // Never joins the group (the partition is assigned, not
            // subscribed) and never commits.
            .set("group.id", format!("{app}-instances-reader"))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .create()?;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, 0, Offset::Beginning)?;
        consumer.assign(&tpl)?;
        let sub_topics: Vec<Vec<String>> = topology
            .subtopologies()
            .iter()
            .map(|st| st.source_topics(app))
            .collect();
        let publisher = Publisher {
            topic,
            server,
            sub_topics,
            interval: cfg.instance_claim_interval,
            producer,
            key: cfg.instance_claim_key.clone(),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-instances".into())
            .spawn(move || run(publisher, consumer, &local, &directory, &flag))
            .map_err(|e| TopologyError::Invalid(format!("cannot start instances thread: {e}")))?;
        Ok(ClaimsThread {
            stop,
            thread: Some(thread),
        })
    }

    /// Deletes this instance's claim and stops the thread.
    pub(crate) fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ClaimsThread {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Writes this instance's claims.
struct Publisher {
    topic: String,
    server: String,
    /// Source topics of each sub-topology, by id.
    sub_topics: Vec<Vec<String>>,
    interval: Duration,
    producer: PolledProducer<DefaultProducerContext>,
    /// Signs the claims, when the instances share one.
    key: Option<ClaimKey>,
}

impl Publisher {
    /// The source partitions of `tasks`, by topic.
    fn partitions(&self, tasks: &BTreeSet<TaskId>) -> BTreeMap<String, Vec<i32>> {
        let mut out: BTreeMap<String, Vec<i32>> = BTreeMap::new();
        for id in tasks {
            for t in self
                .sub_topics
                .get(id.subtopology as usize)
                .into_iter()
                .flatten()
            {
                out.entry(t.clone()).or_default().push(id.partition);
            }
        }
        out
    }

    fn send(&self, value: Option<&[u8]>) {
        let mut record: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(&self.topic)
            .key(self.server.as_bytes())
            .partition(0);
        if let Some(v) = value {
            record = record.payload(v);
        }
        if let Err((e, _)) = self.producer.send(record) {
            tracing::warn!(error = %e, "cannot publish this instance's claim");
        }
    }

    fn publish(&self, tasks: &BTreeSet<TaskId>, assigned_ms: i64) {
        let claim = InstanceClaim {
            server: self.server.clone(),
            partitions: self.partitions(tasks),
            assigned_ms,
            updated_ms: now_ms(),
            signature: None,
        };
        let claim = match &self.key {
            Some(k) => k.sign(claim),
            None => claim,
        };
        match serde_json::to_vec(&claim) {
            Ok(json) => self.send(Some(&json)),
            Err(e) => tracing::warn!(error = %e, "cannot encode this instance's claim"),
        }
    }

    /// The end of a clean stop, flushed: a claim of nothing (signed readers
    /// ignore tombstones, which anyone could write), then the tombstone
    /// that lets compaction drop the server.
    fn withdraw(&self) {
        self.publish(&BTreeSet::new(), now_ms());
        self.send(None);
        if let Err(e) = self.producer.flush(Duration::from_secs(5)) {
            tracing::debug!(error = %e, "withdrawing this instance's claim");
        }
    }
}

fn run(
    publisher: Publisher,
    consumer: BaseConsumer,
    local: &LocalTasks,
    directory: &Directory,
    stop: &AtomicBool,
) {
    let mut written: Option<BTreeSet<TaskId>> = None;
    let mut assigned_ms = now_ms();
    let mut last_write: Option<Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        let mut timeout = Duration::from_millis(100);
        while let Some(msg) = consumer.poll(timeout) {
            timeout = Duration::ZERO;
            match msg {
                Ok(m) => directory.apply(m.key(), m.payload()),
                Err(e) => tracing::debug!(error = %e, "instances topic"),
            }
        }
        let assigned = local.assigned();
        let changed = written.as_ref() != Some(&assigned);
        if changed {
            assigned_ms = now_ms();
        }
        if changed || last_write.is_none_or(|t| t.elapsed() >= publisher.interval) {
            publisher.publish(&assigned, assigned_ms);
            written = Some(assigned);
            last_write = Some(Instant::now());
        }
    }
    publisher.withdraw();
    close_in_background(consumer);
}
