//! Runs a topology in process, without a broker: every topic has one partition,
//! records piped in are processed at once, output is collected per topic, and
//! internal topics are fed back to the sub-topologies that read them. State is
//! real RocksDB in a temporary directory.
//!
//! It follows the runtime's rules: what operators hold back until a commit
//! (cached aggregation results) is forwarded by [`TopologyTestDriver::commit`],
//! async completions are handled when the test asks (so they may come at any
//! point between records and commits), and a commit and a crash do what the
//! runtime's do under the driver's processing guarantee.

use std::collections::{HashMap, VecDeque};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use sluice_state::{ChangelogRecord, RocksEnv, RocksSettings, TaskState};

use crate::commit::{conduct, CommitPath, CommitPoint};
use crate::context::CompletionMsg;
use crate::guarantee::Guarantee;
use crate::offsets::StartAt;
use crate::task::{CommitParts, Input, TaskCore};
use crate::{Codec, Headers, OutputRecord, ProcessError, TaskCounters, Topology, TopologyError};

/// A record kept in a topic's log (so a crashed driver can replay it).
#[derive(Clone)]
struct Logged {
    /// Order of arrival across all topics.
    seq: u64,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    timestamp: i64,
    headers: crate::record::Headers,
}

/// Drives a topology in process (the counterpart of Kafka Streams'
/// `TopologyTestDriver`).
///
/// It can also crash ([`TopologyTestDriver::crash`]): everything since the
/// last [`TopologyTestDriver::commit`] is dropped — in-flight async calls,
/// uncommitted state, and under exactly-once outputs and internal-topic
/// records — the stores are restored from the changelogs the commits
/// recorded, and the input is replayed from the committed offsets, as a
/// restarted instance would.
pub struct TopologyTestDriver {
    topology: Topology,
    guarantee: Guarantee,
    env: RocksEnv,
    tasks: Vec<TaskCore>,
    runtime: tokio::runtime::Runtime,
    completions_tx: crossbeam_channel::Sender<CompletionMsg>,
    completions: Receiver<CompletionMsg>,
    outputs: HashMap<String, VecDeque<OutputRecord>>,
    /// Every record of every topic the topology reads, by offset.
    logs: HashMap<String, Vec<Logged>>,
    seq: u64,
    /// Committed offsets (next to read) of the topics tasks read.
    committed_offsets: HashMap<String, i64>,
    /// Length of each internal topic at the last commit.
    committed_len: HashMap<String, usize>,
    /// Topics tasks write and read (repartition topics).
    internal: std::collections::HashSet<String>,
    /// Outputs of external topics as `read_committed` readers see them.
    committed_outputs: HashMap<String, Vec<OutputRecord>>,
    uncommitted_outputs: Vec<OutputRecord>,
    changelog: Vec<(String, ChangelogRecord)>,
    /// Records a restart has yet to read again, in the order they were
    /// first written (see [`TopologyTestDriver::replay`]).
    pending: VecDeque<(String, i64)>,
    dir: PathBuf,
    generation: u32,
}

impl Drop for TopologyTestDriver {
    fn drop(&mut self) {
        self.tasks.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Where in an at-least-once commit [`TopologyTestDriver::crash_during_commit`]
/// crashes (outputs first, then the changelog records, then the progress
/// record, then the offsets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitStep {
    /// Outputs and changelog records were written; nothing else.
    AfterChangelog,
    /// Outputs, changelog and progress records were written; not the offsets.
    AfterProgress,
}

impl TopologyTestDriver {
    /// Instantiates every sub-topology as one task (partition 0), under
    /// exactly-once.
    pub fn new(topology: Topology) -> Result<Self, TopologyError> {
        Self::with_guarantee(topology, Guarantee::ExactlyOnce)
    }

    /// Instantiates every sub-topology as one task under `guarantee`. Under
    /// at-least-once, outputs (and records of internal topics) are visible
    /// as soon as they are written, as the runtime sends them at once, and
    /// stay after a crash.
    pub fn with_guarantee(topology: Topology, guarantee: Guarantee) -> Result<Self, TopologyError> {
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
            checkpoint_interval: Duration::from_secs(5),
        });
        let mut driver = TopologyTestDriver {
            topology,
            guarantee,
            env,
            tasks: Vec::new(),
            runtime,
            completions_tx: tx,
            completions: rx,
            outputs: HashMap::new(),
            logs: HashMap::new(),
            seq: 0,
            committed_offsets: HashMap::new(),
            committed_len: HashMap::new(),
            internal: Default::default(),
            committed_outputs: HashMap::new(),
            uncommitted_outputs: Vec::new(),
            changelog: Vec::new(),
            pending: VecDeque::new(),
            dir,
            generation: 0,
        };
        driver.start_tasks()?;
        Ok(driver)
    }

    /// Opens every task's state (restored from the recorded changelogs) and
    /// instantiates its operators.
    fn start_tasks(&mut self) -> Result<(), TopologyError> {
        let app_id = "test";
        let committed = self.committed_offsets.clone();
        let start = move |topic: &str| {
            committed
                .get(topic)
                .map_or(StartAt::Reset, |o| StartAt::Committed(*o))
        };
        let mut tasks = Vec::new();
        for sub in &self.topology.subtopologies {
            let state = if sub.stores.is_empty() {
                None
            } else {
                let dir = self.dir.join(format!("{}_0.{}", sub.id, self.generation));
                let mut state = TaskState::open(&dir, &sub.stores, &self.env)?;
                for spec in &sub.stores {
                    let id = state.store_id(&spec.name)?;
                    let records: Vec<(Vec<u8>, Option<Vec<u8>>)> = self
                        .changelog
                        .iter()
                        .filter(|(name, _)| *name == spec.name)
                        .map(|(_, r)| (r.key.clone(), r.value.clone()))
                        .collect();
                    let mut stats = sluice_state::RestoreStats::default();
                    state.apply_restored(id, &records, &mut stats)?;
                    state.restored_to(id, records.len() as i64)?;
                }
                Some(state)
            };
            tasks.push(TaskCore::new(
                sub,
                0,
                app_id,
                state,
                self.runtime.handle().clone(),
                self.completions_tx.clone(),
                &HashMap::new(),
                &start,
            )?);
        }
        self.tasks = tasks;
        Ok(())
    }

    /// Pipes an encoded record into a topic.
    pub fn pipe_raw(
        &mut self,
        topic: &str,
        key: Option<&[u8]>,
        value: Option<&[u8]>,
        timestamp: i64,
    ) -> Result<(), ProcessError> {
        self.pipe_raw_with_headers(topic, key, value, timestamp, Vec::new())
    }

    /// Pipes an encoded record with headers into a topic.
    pub fn pipe_raw_with_headers(
        &mut self,
        topic: &str,
        key: Option<&[u8]>,
        value: Option<&[u8]>,
        timestamp: i64,
        headers: Headers,
    ) -> Result<(), ProcessError> {
        // A restarted instance reads what it replays before anything newer.
        self.replay(usize::MAX)?;
        self.route(
            vec![OutputRecord {
                topic: topic.to_string(),
                partition: None,
                key: key.map(<[u8]>::to_vec),
                value: value.map(<[u8]>::to_vec),
                timestamp,
                headers,
            }],
            true,
        )
    }

    /// Delivers records: those of topics a task reads are logged and
    /// processed at once (with whatever they produce); the rest are output.
    /// Records piped in from outside are `external`; the rest (and whatever
    /// they lead to) were written by tasks, so a crash drops those written
    /// since the last commit.
    fn route(&mut self, records: Vec<OutputRecord>, external: bool) -> Result<(), ProcessError> {
        let mut queue: VecDeque<(OutputRecord, bool)> =
            records.into_iter().map(|r| (r, external)).collect();
        while let Some((rec, external)) = queue.pop_front() {
            if self.tasks.iter().any(|t| t.slot_of(&rec.topic).is_some()) {
                if !external {
                    self.internal.insert(rec.topic.clone());
                }
                let log = self.logs.entry(rec.topic.clone()).or_default();
                log.push(Logged {
                    seq: self.seq,
                    key: rec.key,
                    value: rec.value,
                    timestamp: rec.timestamp,
                    headers: rec.headers,
                });
                self.seq += 1;
                let offset = log.len() as i64 - 1;
                if self.pending.iter().any(|(t, _)| *t == rec.topic) {
                    // Behind records of its topic still to be read again.
                    self.pending.push_back((rec.topic, offset));
                    continue;
                }
                let out = self.deliver(&rec.topic, offset)?;
                queue.extend(out.into_iter().map(|r| (r, false)));
            } else {
                self.outputs
                    .entry(rec.topic.clone())
                    .or_default()
                    .push_back(rec.clone());
                match self.guarantee {
                    Guarantee::ExactlyOnce => self.uncommitted_outputs.push(rec),
                    Guarantee::AtLeastOnce => self
                        .committed_outputs
                        .entry(rec.topic.clone())
                        .or_default()
                        .push(rec),
                }
            }
        }
        Ok(())
    }

    /// Processes one logged record on the task that reads its topic; returns
    /// what the task produced.
    fn deliver(&mut self, topic: &str, offset: i64) -> Result<Vec<OutputRecord>, ProcessError> {
        let rec = &self.logs[topic][offset as usize];
        let Some(task) = self.tasks.iter_mut().find(|t| t.slot_of(topic).is_some()) else {
            return Ok(Vec::new());
        };
        let slot = task.slot_of(topic).expect("checked");
        task.process(
            slot,
            Input {
                offset,
                key: rec.key.as_deref(),
                value: rec.value.as_deref(),
                timestamp: rec.timestamp,
                headers: rec.headers.clone(),
            },
        )?;
        Ok(task.take_output())
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
        self.route(pending, false)
    }

    /// Runs a punctuation tick at `wall_clock_ms` on every task.
    pub fn punctuate(&mut self, wall_clock_ms: i64) -> Result<(), ProcessError> {
        for t in &mut self.tasks {
            t.punctuate(wall_clock_ms)?;
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
            if self.handle_completion(deadline)? {
                continue;
            }
            return Ok(pending);
        }
    }

    /// Handles up to `n` async completions, waiting for each until `timeout`
    /// passed. Returns how many were handled.
    pub fn handle_completions(
        &mut self,
        n: usize,
        timeout: Duration,
    ) -> Result<usize, ProcessError> {
        let deadline = Instant::now() + timeout;
        for done in 0..n {
            if !self.handle_completion(deadline)? {
                return Ok(done);
            }
        }
        Ok(n)
    }

    /// Waits for one completion until `deadline` and hands it to its task.
    fn handle_completion(&mut self, deadline: Instant) -> Result<bool, ProcessError> {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(msg) = self.completions.recv_timeout(left) else {
            return Ok(false);
        };
        if let Some(t) = self.tasks.iter_mut().find(|t| t.id == msg.task) {
            t.complete(msg)?;
        }
        self.route_outputs()?;
        Ok(true)
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

    /// Commits as the runtime does: forwards what operators hold back, then
    /// records every task's changelog records (with its progress record),
    /// offsets and outputs — atomically under exactly-once; under
    /// at-least-once the progress record follows the changelog records when
    /// one is needed — and writes the local stores. Returns the number of
    /// changelog records.
    pub fn commit(&mut self) -> Result<usize, ProcessError> {
        self.flush_all()?;
        let mut n = 0;
        for task in 0..self.tasks.len() {
            n += self.commit_task(task, None)?;
        }
        self.commit_outputs();
        Ok(n)
    }

    /// Crashes in the middle of an at-least-once commit, after `step`, and
    /// restarts (see [`TopologyTestDriver::crash_deferring_replay`]). Under
    /// at-least-once outputs go first, so the crash keeps them.
    pub fn crash_during_commit(&mut self, step: CommitStep) -> Result<(), ProcessError> {
        if self.guarantee == Guarantee::ExactlyOnce {
            return Err(ProcessError::Fatal(
                "an exactly-once commit is atomic: crash before or after it".into(),
            ));
        }
        self.flush_all()?;
        let stop = match step {
            CommitStep::AfterChangelog => CommitPoint::ChangelogFlushed,
            CommitStep::AfterProgress => CommitPoint::ProgressFlushed,
        };
        for task in 0..self.tasks.len() {
            self.commit_task(task, Some(stop))?;
        }
        self.commit_outputs();
        self.crash_deferring_replay()
    }

    /// Commits one task (see [`crate::commit`]), up to `stop` when given.
    /// Returns the number of changelog records.
    fn commit_task(
        &mut self,
        task: usize,
        stop: Option<CommitPoint>,
    ) -> Result<usize, ProcessError> {
        let guarantee = self.guarantee;
        let mut commit = DriverCommit {
            driver: self,
            task,
            parts: CommitParts::default(),
            records: 0,
            stop,
        };
        conduct(&mut commit, guarantee)?;
        Ok(commit.records)
    }

    /// Forwards what every task holds back until a commit.
    fn flush_all(&mut self) -> Result<(), ProcessError> {
        for t in &mut self.tasks {
            t.flush()?;
        }
        self.route_outputs()
    }

    fn record_changelog(&mut self, task: usize, records: Vec<ChangelogRecord>) -> usize {
        let n = records.len();
        if let Some(state) = self.tasks[task].ctx.state.as_ref() {
            let names: Vec<String> = state.specs().map(|s| s.name.clone()).collect();
            self.changelog
                .extend(records.into_iter().map(|r| (names[r.store.0].clone(), r)));
        }
        n
    }

    fn commit_outputs(&mut self) {
        for rec in self.uncommitted_outputs.drain(..) {
            self.committed_outputs
                .entry(rec.topic.clone())
                .or_default()
                .push(rec);
        }
        for (topic, log) in &self.logs {
            self.committed_len.insert(topic.clone(), log.len());
        }
    }

    /// Reads again up to `n` of the records a restart has to read again (as
    /// a restarted instance's consumer delivers them, a few at a time; a
    /// commit may come in between). Piping a new record reads them all
    /// first. Returns how many were read.
    pub fn replay(&mut self, n: usize) -> Result<usize, ProcessError> {
        let mut done = 0;
        while done < n {
            let Some((topic, offset)) = self.pending.pop_front() else {
                break;
            };
            let out = self.deliver(&topic, offset)?;
            self.route(out, false)?;
            done += 1;
        }
        Ok(done)
    }

    /// Records a restart has yet to read again.
    pub fn pending_replay(&self) -> usize {
        self.pending.len()
    }

    /// Crashes and restarts (see [`TopologyTestDriver::crash_deferring_replay`]),
    /// then reads again at once everything from the committed offsets on.
    pub fn crash(&mut self) -> Result<(), ProcessError> {
        self.crash_deferring_replay()?;
        self.replay(usize::MAX).map(|_| ())
    }

    /// Crashes and restarts: in-flight async calls are abandoned; state,
    /// outputs and internal-topic records written since the last commit are
    /// dropped (under exactly-once); the stores are restored from the
    /// recorded changelogs into a fresh directory; the input from the
    /// committed offsets on is to be read again, a few records at a time as
    /// the test asks ([`TopologyTestDriver::replay`]) — commits may come in
    /// between, as they do while a restarted instance catches up.
    pub fn crash_deferring_replay(&mut self) -> Result<(), ProcessError> {
        self.pending.clear();
        for t in &mut self.tasks {
            let _ = t.abandon();
        }
        self.tasks.clear();
        // Completions of abandoned calls must not reach the new tasks.
        let (tx, rx) = crossbeam_channel::unbounded();
        self.completions_tx = tx;
        self.completions = rx;
        self.uncommitted_outputs.clear();
        let transactional = self.guarantee == Guarantee::ExactlyOnce;
        for (topic, log) in &mut self.logs {
            if transactional && self.internal.contains(topic) {
                log.truncate(self.committed_len.get(topic).copied().unwrap_or(0));
            }
        }
        self.generation += 1;
        self.start_tasks()
            .map_err(|e| ProcessError::Fatal(format!("restart failed: {e}")))?;
        // What the restarted tasks forwarded again (records their operators
        // had derived and not finished at the last commit) comes first.
        self.route_outputs()?;
        let mut replay: Vec<(u64, String, i64)> = Vec::new();
        for (topic, log) in &self.logs {
            let from = self.committed_offsets.get(topic).copied().unwrap_or(0);
            for (offset, rec) in log.iter().enumerate().skip(from as usize) {
                replay.push((rec.seq, topic.clone(), offset as i64));
            }
        }
        replay.sort_unstable();
        self.pending = replay.into_iter().map(|(_, t, o)| (t, o)).collect();
        Ok(())
    }

    /// Every record written to an external topic by committed work, in order
    /// (what a `read_committed` reader sees).
    pub fn committed_output(&self, topic: &str) -> Vec<OutputRecord> {
        self.committed_outputs
            .get(topic)
            .cloned()
            .unwrap_or_default()
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

/// One task's commit in the test driver: what it records (changelog
/// records, committed offsets) stands for the broker, and a staged crash
/// stops it at a point.
struct DriverCommit<'d> {
    driver: &'d mut TopologyTestDriver,
    task: usize,
    parts: CommitParts,
    /// Changelog records recorded.
    records: usize,
    /// Where the commit stops (a crash during it).
    stop: Option<CommitPoint>,
}

impl DriverCommit<'_> {
    fn record_changelog(&mut self, records: Vec<ChangelogRecord>) {
        self.records += self.driver.record_changelog(self.task, records);
    }

    fn record_offsets(&mut self) {
        for (slot, offset) in &self.parts.offsets {
            let topic = self.driver.tasks[self.task].slots[*slot].topic.clone();
            self.driver.committed_offsets.insert(topic, *offset);
        }
    }
}

impl CommitPath for DriverCommit<'_> {
    type Error = ProcessError;

    fn prepare(&mut self, guarantee: Guarantee) -> Result<(), ProcessError> {
        self.parts = self.driver.tasks[self.task].prepare_commit(guarantee);
        Ok(())
    }

    fn send_changelog(&mut self) -> Result<(), ProcessError> {
        let records = std::mem::take(&mut self.parts.changelog);
        self.record_changelog(records);
        Ok(())
    }

    /// Records are recorded as they are sent.
    fn flush(&mut self) -> Result<(), ProcessError> {
        Ok(())
    }

    fn send_progress(&mut self) -> Result<bool, ProcessError> {
        let progress = self.parts.progress.take();
        let sent = progress.is_some();
        self.record_changelog(progress.into_iter().collect());
        Ok(sent)
    }

    fn commit_offsets(&mut self) -> Result<(), ProcessError> {
        self.record_offsets();
        Ok(())
    }

    fn send_offsets(&mut self) -> Result<(), ProcessError> {
        self.record_offsets();
        Ok(())
    }

    /// The outputs of every task commit together once each task committed
    /// (see [`TopologyTestDriver::commit`]).
    fn commit_transaction(&mut self) -> Result<(), ProcessError> {
        Ok(())
    }

    fn post_commit(&mut self) -> Result<(), ProcessError> {
        let offsets = &self.parts.offsets;
        self.driver.tasks[self.task].post_commit(offsets, &HashMap::new())?;
        Ok(())
    }

    fn reached(&mut self, point: CommitPoint) -> ControlFlow<()> {
        if self.stop == Some(point) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }
}
