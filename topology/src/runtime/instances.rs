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
//! instance was killed). While a rebalance moves a partition, the old and
//! the new owner may both claim it for a moment; the claim whose assignment
//! is newer wins.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};

use super::config::StreamsConfig;
use super::kafka::client_config;
use super::queries::LocalTasks;
use crate::{TaskId, Topology, TopologyError};

/// The internal topic instances publish their claims on.
pub(crate) fn instances_topic(app_id: &str) -> String {
    format!("{app_id}-instances")
}

/// What one instance holds, as published on the instances topic.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceClaim {
    /// The instance's `application_server`.
    pub server: String,
    /// Source partitions of the tasks assigned to it (restoring or
    /// running), by topic.
    pub partitions: BTreeMap<String, Vec<i32>>,
    /// When it was assigned these partitions (ms since the epoch, its clock).
    pub assigned_ms: i64,
    /// When it wrote this claim (ms since the epoch, its clock).
    pub updated_ms: i64,
}

impl InstanceClaim {
    fn holds(&self, topics: &[String], partition: i32) -> bool {
        topics.iter().any(|t| {
            self.partitions
                .get(t)
                .is_some_and(|ps| ps.contains(&partition))
        })
    }
}

/// The claim that holds `partition` of any of `topics` at `now_ms`: among
/// claims renewed within `timeout_ms` and not by `except`, the newest
/// assignment (then the newest renewal, then the server name, so every
/// instance picks the same one).
pub(crate) fn resolve_owner<'a>(
    claims: impl IntoIterator<Item = &'a InstanceClaim>,
    topics: &[String],
    partition: i32,
    now_ms: i64,
    timeout_ms: i64,
    except: Option<&str>,
) -> Option<&'a InstanceClaim> {
    claims
        .into_iter()
        .filter(|c| now_ms - c.updated_ms <= timeout_ms)
        .filter(|c| except != Some(c.server.as_str()))
        .filter(|c| c.holds(topics, partition))
        .max_by(|a, b| {
            (a.assigned_ms, a.updated_ms, &a.server).cmp(&(b.assigned_ms, b.updated_ms, &b.server))
        })
}

/// Every instance's newest claim, as read from the instances topic.
#[derive(Debug, Default)]
pub(crate) struct Directory {
    claims: RwLock<HashMap<String, InstanceClaim>>,
}

impl Directory {
    /// Applies one record of the instances topic: a claim replaces the
    /// server's previous one, a tombstone removes it. Records that do not
    /// parse are ignored (logged).
    pub(crate) fn apply(&self, key: Option<&[u8]>, value: Option<&[u8]>) {
        let Some(server) = key.and_then(|k| std::str::from_utf8(k).ok()) else {
            return;
        };
        let Some(value) = value else {
            self.claims.write().remove(server);
            return;
        };
        match serde_json::from_slice::<InstanceClaim>(value) {
            Ok(claim) if claim.server == server => {
                self.claims.write().insert(server.to_string(), claim);
            }
            Ok(_) => tracing::warn!(server, "instance claim names another server; ignored"),
            Err(e) => tracing::warn!(server, error = %e, "unreadable instance claim; ignored"),
        }
    }

    /// The server of the instance holding `partition` of `topics` (see
    /// [`resolve_owner`]).
    pub(crate) fn owner(
        &self,
        topics: &[String],
        partition: i32,
        now_ms: i64,
        timeout_ms: i64,
        except: Option<&str>,
    ) -> Option<String> {
        let claims = self.claims.read();
        resolve_owner(
            claims.values(),
            topics,
            partition,
            now_ms,
            timeout_ms,
            except,
        )
        .map(|c| c.server.clone())
    }

    /// The claims renewed within `timeout_ms`, by server.
    pub(crate) fn fresh(&self, now_ms: i64, timeout_ms: i64) -> Vec<InstanceClaim> {
        let mut out: Vec<InstanceClaim> = self
            .claims
            .read()
            .values()
            .filter(|c| now_ms - c.updated_ms <= timeout_ms)
            .cloned()
            .collect();
        out.sort_by(|a, b| a.server.cmp(&b.server));
        out
    }
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
        let producer: ThreadedProducer<DefaultProducerContext> = client_config(cfg)
            .set("acks", "all")
            .set("linger.ms", "0")
            .create()?;
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
    producer: ThreadedProducer<DefaultProducerContext>,
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
            updated_ms: super::now_ms(),
        };
        match serde_json::to_vec(&claim) {
            Ok(json) => self.send(Some(&json)),
            Err(e) => tracing::warn!(error = %e, "cannot encode this instance's claim"),
        }
    }

    /// The tombstone of a clean stop, flushed.
    fn withdraw(&self) {
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
    let mut assigned_ms = super::now_ms();
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
            assigned_ms = super::now_ms();
        }
        if changed || last_write.is_none_or(|t| t.elapsed() >= publisher.interval) {
            publisher.publish(&assigned, assigned_ms);
            written = Some(assigned);
            last_write = Some(Instant::now());
        }
    }
    publisher.withdraw();
    super::close_in_background(consumer);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(
        server: &str,
        parts: &[(&str, &[i32])],
        assigned_ms: i64,
        updated_ms: i64,
    ) -> InstanceClaim {
        InstanceClaim {
            server: server.into(),
            partitions: parts
                .iter()
                .map(|(t, ps)| (t.to_string(), ps.to_vec()))
                .collect(),
            assigned_ms,
            updated_ms,
        }
    }

    fn topics(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_newest_fresh_assignment_holds_a_partition() {
        let a = claim("http://a", &[("in", &[0, 1])], 1_000, 20_000);
        let b = claim("http://b", &[("in", &[1])], 5_000, 19_000);
        let all = [a.clone(), b.clone()];
        let owner = |p, now, except| {
            resolve_owner(&all, &topics(&["in"]), p, now, 10_000, except).map(|c| c.server.clone())
        };
        assert_eq!(owner(0, 21_000, None).as_deref(), Some("http://a"));
        // Both claim 1 (a rebalance moved it to b): the newer assignment wins.
        assert_eq!(owner(1, 21_000, None).as_deref(), Some("http://b"));
        // Another topic of the sub-topology names the partition as well.
        assert_eq!(
            resolve_owner(&all, &topics(&["other", "in"]), 0, 21_000, 10_000, None)
                .map(|c| c.server.as_str()),
            Some("http://a")
        );
        assert_eq!(owner(2, 21_000, None), None, "nobody claims partition 2");
        // The asking instance knows its own partitions better than its claim.
        assert_eq!(
            owner(1, 21_000, Some("http://b")).as_deref(),
            Some("http://a")
        );
    }

    #[test]
    fn a_claim_not_renewed_in_time_is_gone() {
        let a = claim("http://a", &[("in", &[0])], 1_000, 20_000);
        let b = claim("http://b", &[("in", &[0])], 5_000, 9_000);
        let all = [a, b];
        let owner = |now| {
            resolve_owner(&all, &topics(&["in"]), 0, now, 10_000, None).map(|c| c.server.clone())
        };
        // b's newer assignment wins while its claim is fresh ...
        assert_eq!(owner(19_000).as_deref(), Some("http://b"));
        // ... and counts as gone once it is older than the timeout.
        assert_eq!(owner(19_001).as_deref(), Some("http://a"));
        assert_eq!(owner(30_001), None);
    }

    #[test]
    fn the_directory_keeps_each_servers_newest_claim_until_its_tombstone() {
        let d = Directory::default();
        let json = |c: &InstanceClaim| serde_json::to_vec(c).unwrap();
        let t = topics(&["in"]);
        d.apply(
            Some(b"http://a"),
            Some(&json(&claim("http://a", &[("in", &[0, 1])], 1, 10))),
        );
        d.apply(
            Some(b"http://b"),
            Some(&json(&claim("http://b", &[], 2, 10))),
        );
        assert_eq!(d.owner(&t, 1, 10, 100, None).as_deref(), Some("http://a"));
        // a newer claim replaces the older one of the same server
        d.apply(
            Some(b"http://a"),
            Some(&json(&claim("http://a", &[("in", &[0])], 3, 20))),
        );
        d.apply(
            Some(b"http://b"),
            Some(&json(&claim("http://b", &[("in", &[1])], 3, 20))),
        );
        assert_eq!(d.owner(&t, 1, 20, 100, None).as_deref(), Some("http://b"));
        assert_eq!(d.fresh(20, 100).len(), 2);
        // Garbage and claims in another server's name change nothing.
        d.apply(Some(b"http://b"), Some(b"{not json"));
        d.apply(
            Some(b"http://c"),
            Some(&json(&claim("http://b", &[("in", &[0])], 9, 20))),
        );
        d.apply(None, Some(b"{}"));
        assert_eq!(d.owner(&t, 0, 20, 100, None).as_deref(), Some("http://a"));
        // A clean stop deletes the claim.
        d.apply(Some(b"http://b"), None);
        assert_eq!(d.owner(&t, 1, 20, 100, None), None);
        assert_eq!(d.fresh(20, 100).len(), 1);
        // The wire form is camelCase JSON.
        let text = String::from_utf8(json(&claim("http://a", &[("in", &[0])], 1, 2))).unwrap();
        assert_eq!(
            text,
            r#"{"server":"http://a","partitions":{"in":[0]},"assignedMs":1,"updatedMs":2}"#
        );
    }
}
