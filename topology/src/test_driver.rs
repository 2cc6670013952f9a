//! Runs a topology in process, without a broker: every topic has one partition,
//! records piped in are processed at once, output is collected per topic, and
//! internal topics are fed back to the sub-topologies that read them. State is
//! real RocksDB in a temporary directory.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use sluice_state::{ChangelogRecord, RocksEnv, RocksSettings, TaskState};

use crate::context::CompletionMsg;
use crate::task::{Input, TaskCore};
use crate::{Codec, OutputRecord, ProcessError, TaskCounters, Topology, TopologyError};

/// Drives a topology in process (the counterpart of Kafka Streams'
/// `TopologyTestDriver`).
pub struct TopologyTestDriver {
    tasks: Vec<TaskCore>,
    runtime: tokio::runtime::Runtime,
    completions: Receiver<CompletionMsg>,
    outputs: HashMap<String, VecDeque<OutputRecord>>,
    next_offset: HashMap<String, i64>,
    changelog: Vec<(String, ChangelogRecord)>,
    dir: PathBuf,
}

impl Drop for TopologyTestDriver {
    fn drop(&mut self) {
        self.tasks.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl TopologyTestDriver {
    /// Instantiates every sub-topology as one task (partition 0).
    pub fn new(topology: Topology) -> Result<Self, TopologyError> {
        let app_id = "test";
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| TopologyError::Invalid(format!("tokio runtime: {e}")))?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let dir = std::env::temp_dir().join(format!("sluice-test-driver-{}", uuid::Uuid::new_v4()));
        let env = RocksEnv::new(RocksSettings {
            block_cache_bytes: 8 << 20,
            write_buffer_manager_bytes: 8 << 20,
            write_buffer_bytes: 1 << 20,
            max_background_jobs: 1,
            record_cache_bytes: 8 << 20,
        });
        let mut tasks = Vec::new();
        for sub in &topology.subtopologies {
            let state = if sub.stores.is_empty() {
                None
            } else {
                Some(TaskState::open(
                    &dir.join(format!("{}_0", sub.id)),
                    &sub.stores,
                    &env,
                )?)
            };
            tasks.push(TaskCore::new(
                sub,
                0,
                app_id,
                state,
                runtime.handle().clone(),
                tx.clone(),
                &HashMap::new(),
            )?);
        }
        Ok(TopologyTestDriver {
            tasks,
            runtime,
            completions: rx,
            outputs: HashMap::new(),
            next_offset: HashMap::new(),
            changelog: Vec::new(),
            dir,
        })
    }

    /// Pipes an encoded record into a topic.
    pub fn pipe_raw(
        &mut self,
        topic: &str,
        key: Option<&[u8]>,
        value: Option<&[u8]>,
        timestamp: i64,
    ) -> Result<(), ProcessError> {
        let mut queue = VecDeque::from([OutputRecord {
            topic: topic.to_string(),
            partition: None,
            key: key.map(<[u8]>::to_vec),
            value: value.map(<[u8]>::to_vec),
            timestamp,
            headers: Vec::new(),
        }]);
        while let Some(rec) = queue.pop_front() {
            let target = self
                .tasks
                .iter()
                .position(|t| t.slot_of(&rec.topic).is_some());
            match target {
                Some(i) => {
                    let offset = self.next_offset.entry(rec.topic.clone()).or_insert(0);
                    let this = *offset;
                    *offset += 1;
                    let task = &mut self.tasks[i];
                    let slot = task.slot_of(&rec.topic).expect("checked");
                    task.process(
                        slot,
                        Input {
                            offset: this,
                            key: rec.key.as_deref(),
                            value: rec.value.as_deref(),
                            timestamp: rec.timestamp,
                            headers: rec.headers.clone(),
                        },
                    )?;
                    task.flush()?;
                    queue.extend(task.take_output());
                }
                None => self
                    .outputs
                    .entry(rec.topic.clone())
                    .or_default()
                    .push_back(rec),
            }
        }
        Ok(())
    }

    /// Pipes a typed record into a topic.
    pub fn pipe<K, V>(
        &mut self,
        topic: &str,
        key: &K,
        value: &V,
        key_codec: &impl Codec<K>,
        value_codec: &impl Codec<V>,
        timestamp: i64,
    ) -> Result<(), ProcessError> {
        let k = key_codec
            .encode(key)
            .map_err(|e| ProcessError::Fatal(e.to_string()))?;
        let v = value_codec
            .encode(value)
            .map_err(|e| ProcessError::Fatal(e.to_string()))?;
        self.pipe_raw(topic, k.as_deref(), v.as_deref(), timestamp)
    }

    fn route_outputs(&mut self) -> Result<(), ProcessError> {
        let mut pending: Vec<OutputRecord> = Vec::new();
        for t in &mut self.tasks {
            pending.extend(t.take_output());
        }
        for rec in pending {
            if self.tasks.iter().any(|t| t.slot_of(&rec.topic).is_some()) {
                self.pipe_raw(
                    &rec.topic,
                    rec.key.as_deref(),
                    rec.value.as_deref(),
                    rec.timestamp,
                )?;
            } else {
                self.outputs
                    .entry(rec.topic.clone())
                    .or_default()
                    .push_back(rec);
            }
        }
        Ok(())
    }

    /// Runs a punctuation tick at `wall_clock_ms` on every task.
    pub fn punctuate(&mut self, wall_clock_ms: i64) -> Result<(), ProcessError> {
        for t in &mut self.tasks {
            t.punctuate(wall_clock_ms)?;
            t.flush()?;
        }
        self.route_outputs()
    }

    /// Handles async completions until no call is pending or `timeout` passed.
    /// Returns the number of calls still pending.
    pub fn wait_for_async(&mut self, timeout: Duration) -> Result<usize, ProcessError> {
        let deadline = Instant::now() + timeout;
        loop {
            let pending: usize = self.tasks.iter().map(|t| t.ctx.spawner.pending()).sum();
            if pending == 0 {
                return Ok(0);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.completions.recv_timeout(left) {
                Ok(msg) => {
                    if let Some(t) = self.tasks.iter_mut().find(|t| t.id == msg.task) {
                        t.complete(msg)?;
                        t.flush()?;
                    }
                    self.route_outputs()?;
                }
                Err(_) => return Ok(pending),
            }
        }
    }

    /// Takes the records written to an output topic so far.
    pub fn read_output(&mut self, topic: &str) -> Vec<OutputRecord> {
        self.outputs
            .get_mut(topic)
            .map(|q| q.drain(..).collect())
            .unwrap_or_default()
    }

    /// Takes and decodes the records written to an output topic so far.
    pub fn read_typed<K, V>(
        &mut self,
        topic: &str,
        key_codec: &impl Codec<K>,
        value_codec: &impl Codec<V>,
    ) -> Result<Vec<(K, V)>, crate::CodecError> {
        self.read_output(topic)
            .into_iter()
            .map(|r| {
                Ok((
                    key_codec.decode(r.key.as_deref())?,
                    value_codec.decode(r.value.as_deref())?,
                ))
            })
            .collect()
    }

    /// Simulates a commit: flushes the write caches into the (recorded)
    /// changelogs and the local stores. Returns the number of changelog records.
    pub fn commit(&mut self) -> Result<usize, ProcessError> {
        let mut n = 0;
        for t in &mut self.tasks {
            t.drain_done();
            if let Some(state) = t.ctx.state.as_mut() {
                let records = state.flush_changelog();
                n += records.len();
                let names: Vec<String> = state.specs().map(|s| s.name.clone()).collect();
                self.changelog
                    .extend(records.into_iter().map(|r| (names[r.store.0].clone(), r)));
                state.commit_local(&HashMap::new())?;
            }
            let offsets = t.offsets_to_commit();
            t.mark_committed(&offsets);
        }
        Ok(n)
    }

    /// Changelog records written by [`TopologyTestDriver::commit`], with store names.
    pub fn changelog_records(&self) -> &[(String, ChangelogRecord)] {
        &self.changelog
    }

    /// The committable offset of an input topic (after a commit).
    pub fn committable_offset(&mut self, topic: &str) -> Option<i64> {
        for t in &mut self.tasks {
            t.drain_done();
            if let Some(slot) = t.slot_of(topic) {
                return t.trackers[slot].committable();
            }
        }
        None
    }

    /// Engine counters summed over tasks.
    pub fn counters(&self) -> TaskCounters {
        let mut c = TaskCounters::default();
        for t in &self.tasks {
            c.late_dropped += t.ctx.counters.late_dropped;
            c.replay_skipped += t.ctx.counters.replay_skipped;
            for (k, v) in &t.ctx.counters.dead_lettered {
                *c.dead_lettered.entry(k.clone()).or_default() += v;
            }
        }
        c
    }

    /// The tokio runtime async operators run on.
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.runtime
    }
}
