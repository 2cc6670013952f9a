//! The driver thread: consumer, tasks, commits, rebalances (see the module
//! documentation of [`crate::runtime`]).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use rdkafka::consumer::{
    base_consumer::PartitionQueue, BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance,
    RebalanceProtocol,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, OwnedMessage};
use rdkafka::producer::Producer;
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};
use sluice_state::{RocksEnv, TaskState};

use super::config::{Guarantee, StreamsConfig};
use super::kafka::{
    client_config, create_producer, flush, init_transactions, send, DeliveryState, DeliveryTag,
    TrackedProducer,
};
use super::metrics::EngineMetrics;
use super::restore::restore_task;
use super::{AppState, AppStatus, IntakeControl, RuntimeError};
use crate::context::CompletionMsg;
use crate::record::OutputRecord;
use crate::task::{Input, PreparedCommit, TaskCore};
use crate::{TaskId, Topology, TopologyError};

const TXN_TIMEOUT: Duration = Duration::from_secs(60);
/// librdkafka's prefetch per input partition (overridable by client properties).
const PREFETCH_KBYTES_PER_PARTITION: &str = "16384";
const FLUSH_TIMEOUT: Duration = Duration::from_secs(60);

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

type Tp = (String, i32);

/// A task that is processing (or suspended between revoke and assign).
struct ActiveTask {
    core: TaskCore,
    producer: Arc<TrackedProducer>,
    delivery: Arc<DeliveryState>,
    txn_open: bool,
    partitions: Vec<Tp>,
    /// Fetched records of each input slot waiting for room under the in-flight
    /// bound. Keeping them (rather than letting a pause drop the consumer's
    /// prefetch) keeps the operators fed while the partition is paused.
    backlog: Vec<VecDeque<OwnedMessage>>,
    /// Records processed and not yet added to the shared `records_in` counter
    /// (one atomic add per round, not per record, when tasks run side by side).
    uncounted: u64,
}

impl ActiveTask {
    fn new(
        core: TaskCore,
        producer: Arc<TrackedProducer>,
        delivery: Arc<DeliveryState>,
        partitions: Vec<Tp>,
    ) -> Self {
        let backlog = core.slots.iter().map(|_| VecDeque::new()).collect();
        ActiveTask {
            core,
            producer,
            delivery,
            txn_open: false,
            partitions,
            backlog,
            uncounted: 0,
        }
    }

    /// Adds the records processed since the last call to the metrics.
    fn count_in(&mut self, metrics: &EngineMetrics) {
        if self.uncounted > 0 {
            metrics
                .records_in
                .inc_by(std::mem::take(&mut self.uncounted));
        }
    }

    /// Whether a new record of `slot` may be processed now: nothing older waits
    /// in its backlog and its in-flight records are under `max`.
    fn has_room(&self, slot: usize, max: usize) -> bool {
        self.backlog[slot].is_empty() && self.core.trackers[slot].in_flight() < max
    }

    /// Processes a record now if the in-flight bound allows, else queues it.
    fn offer(
        &mut self,
        msg: &(impl Message + DetachOwned),
        metrics: &EngineMetrics,
        eos: bool,
        max: usize,
    ) -> Result<(), RuntimeError> {
        let Some(slot) = self.core.slot_of(msg.topic()) else {
            return Ok(());
        };
        if self.has_room(slot, max) {
            process_record(self, msg, metrics, eos)
        } else {
            self.backlog[slot].push_back(msg.detach_owned());
            Ok(())
        }
    }

    /// Processes queued records while the in-flight bound allows.
    fn drain_backlog(
        &mut self,
        metrics: &EngineMetrics,
        eos: bool,
        max: usize,
    ) -> Result<(), RuntimeError> {
        self.core.drain_done();
        for slot in 0..self.backlog.len() {
            while self.core.trackers[slot].in_flight() < max {
                let Some(msg) = self.backlog[slot].pop_front() else {
                    break;
                };
                process_record(self, &msg, metrics, eos)?;
                self.core.drain_done();
            }
        }
        Ok(())
    }
}

/// Records taken from one partition queue per feeding round, so commits,
/// punctuation and completions keep their pace under a steady stream.
const FEED_BATCH: usize = 10_000;

/// Runs `f` on every item, spreading the items over up to `threads` threads
/// (the calling thread is one of them); the results come back in item order.
/// The driver's per-task work — processing, forwarding cached results,
/// changelog writes, local state commits — touches only the task itself, so
/// tasks run side by side.
fn in_parallel<I: Send, T: Send>(
    items: Vec<I>,
    threads: usize,
    f: impl Fn(I) -> Result<T, RuntimeError> + Sync,
) -> Result<Vec<T>, RuntimeError> {
    let threads = threads.clamp(1, items.len().max(1));
    if threads == 1 {
        return items.into_iter().map(f).collect();
    }
    let mut groups: Vec<Vec<(usize, I)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, item) in items.into_iter().enumerate() {
        groups[i % threads].push((i, item));
    }
    let run = |group: Vec<(usize, I)>| -> Vec<(usize, Result<T, RuntimeError>)> {
        group.into_iter().map(|(i, item)| (i, f(item))).collect()
    };
    let mut results = std::thread::scope(|s| {
        let mut groups = groups.into_iter();
        let own = groups.next().unwrap_or_default();
        let helpers: Vec<_> = groups.map(|g| s.spawn(|| run(g))).collect();
        let mut results = run(own);
        for h in helpers {
            match h.join() {
                Ok(r) => results.extend(r),
                Err(_) => results.push((
                    usize::MAX,
                    Err(RuntimeError::Other("task thread panicked".into())),
                )),
            }
        }
        results
    });
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// A partition's own fetch queue.
struct SplitQueue {
    queue: PartitionQueue<DriverContext>,
    /// The engine's `drains` when the queue was split: it is read only once the
    /// consumer's queue ran empty after that, when no record of the partition
    /// can be left there.
    split_at: u64,
}

/// The split queues of one task, by input slot.
type TaskQueues<'a> = Vec<(usize, &'a PartitionQueue<DriverContext>)>;

/// Takes up to `limit` records from each of a task's queues while the task has
/// room. Returns whether any record was taken.
fn feed_task(
    task: &mut ActiveTask,
    queues: &TaskQueues<'_>,
    metrics: &EngineMetrics,
    eos: bool,
    max: usize,
    limit: usize,
) -> Result<bool, RuntimeError> {
    let mut fed = false;
    for &(slot, queue) in queues {
        let mut taken = 0;
        while taken < limit && task.has_room(slot, max) {
            match queue.poll(Duration::ZERO) {
                None => break,
                Some(Ok(msg)) => {
                    // Room was checked just above: no backlog to join.
                    process_record(task, &msg, metrics, eos)?;
                    taken += 1;
                    fed = true;
                }
                Some(Err(e)) => tracing::warn!(
                    topic = %task.core.slots[slot].topic,
                    partition = task.core.slots[slot].partition,
                    error = %e,
                    "consumer error"
                ),
            }
        }
    }
    task.count_in(metrics);
    Ok(fed)
}

/// A message that can be kept past the poll that returned it.
trait DetachOwned {
    fn detach_owned(&self) -> OwnedMessage;
}

impl DetachOwned for BorrowedMessage<'_> {
    fn detach_owned(&self) -> OwnedMessage {
        self.detach()
    }
}

impl DetachOwned for OwnedMessage {
    fn detach_owned(&self) -> OwnedMessage {
        self.clone()
    }
}

/// What a restore thread hands back.
struct Restored {
    state: Option<TaskState>,
    producer: Arc<TrackedProducer>,
    delivery: Arc<DeliveryState>,
}

/// A task being restored on a helper thread. Its records wait in its split
/// queues; those that reached the consumer's queue before the split (or all of
/// them, for a partition whose queue could not be split) are buffered here, and
/// such a partition is paused once the buffer holds the in-flight bound.
struct PendingTask {
    handle: Option<JoinHandle<Result<Restored, RuntimeError>>>,
    cancel: Arc<AtomicBool>,
    buffered: Vec<OwnedMessage>,
    partitions: Vec<Tp>,
}

/// Everything the driver and the rebalance callbacks share.
struct Engine {
    /// A task was fenced: leave and rejoin the group after this tick.
    rejoin: bool,
    topology: Arc<Topology>,
    cfg: Arc<StreamsConfig>,
    metrics: EngineMetrics,
    dlq_partitions: super::admin::DeadLetterPartitions,
    env: RocksEnv,
    runtime: tokio::runtime::Handle,
    completions_tx: Sender<CompletionMsg>,
    completions_rx: Receiver<CompletionMsg>,
    /// Signalled when the consumer's queue or a partition queue becomes non-empty.
    wake_tx: Sender<()>,
    topic_sub: HashMap<String, usize>,
    tasks: BTreeMap<TaskId, ActiveTask>,
    suspended: BTreeMap<TaskId, ActiveTask>,
    pending: BTreeMap<TaskId, PendingTask>,
    shared_producer: Option<(Arc<TrackedProducer>, Arc<DeliveryState>)>,
    paused: HashSet<Tp>,
    /// The fetch queue of each assigned input partition, split from the
    /// consumer's queue (see [`Engine::attach_queues`]).
    queues: HashMap<Tp, SplitQueue>,
    /// How many times a poll found the consumer's queue empty.
    drains: u64,
    /// Partitions whose queue could not be split; they are fed by the consumer's
    /// queue and paused for backpressure.
    unsplit: HashSet<Tp>,
    last_commit: Instant,
    last_punctuate: Instant,
    status: Arc<AppStatus>,
    intake: IntakeControl,
    joined: bool,
    fatal: Option<RuntimeError>,
}

/// The consumer context: rebalance callbacks run the engine's revoke/assign.
pub(crate) struct DriverContext {
    engine: Arc<Mutex<Engine>>,
    metrics: EngineMetrics,
    /// Where a partition without a committed offset starts (`auto.offset.reset`);
    /// `None` leaves it to librdkafka.
    reset: Option<Offset>,
}

/// How long the assignment waits for the committed offsets it looks up.
const COMMITTED_LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// The start of a partition without a committed offset under the
/// `auto.offset.reset` policy `policy`; `None` for a policy librdkafka must
/// apply itself (`error`).
fn reset_offset(policy: Option<&str>) -> Option<Offset> {
    match policy? {
        "earliest" | "smallest" | "beginning" => Some(Offset::Beginning),
        "latest" | "largest" | "end" => Some(Offset::End),
        _ => None,
    }
}

/// Sets where each newly assigned partition starts: at its committed offset,
/// or at `reset` when it has none. librdkafka looks the same up when positions
/// are left unset, but it starts a partition without a committed offset only
/// after a 100 ms back-off, which every new group and new partition would
/// pay. If the lookup fails, the positions stay unset and librdkafka decides.
fn set_start_positions(
    consumer: &BaseConsumer<DriverContext>,
    tpl: &mut TopicPartitionList,
    reset: Option<Offset>,
) {
    let Some(reset) = reset else { return };
    let committed = match consumer.committed_offsets(tpl.clone(), COMMITTED_LOOKUP_TIMEOUT) {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(error = %e, "committed offsets lookup failed; librdkafka looks them up");
            return;
        }
    };
    let mut starts = Vec::new();
    for e in committed.elements() {
        let start = match (e.error(), e.offset()) {
            (Ok(()), Offset::Offset(o)) if o >= 0 => Offset::Offset(o),
            (Ok(()), Offset::Invalid) => reset,
            // An error or an unexpected answer: leave every position to librdkafka.
            _ => return,
        };
        starts.push((e.topic().to_string(), e.partition(), start));
    }
    for (topic, partition, start) in starts {
        if tpl.set_partition_offset(&topic, partition, start).is_err() {
            tracing::debug!(topic, partition, "cannot set a start position");
        }
    }
}

impl ClientContext for DriverContext {
    fn stats(&self, stats: Statistics) {
        for (name, topic) in &stats.topics {
            let lag: i64 = topic
                .partitions
                .values()
                .filter(|p| p.partition >= 0)
                .map(|p| p.consumer_lag.max(0))
                .sum();
            self.metrics.lag.with_label_values(&[name]).set(lag);
        }
    }
}

impl ConsumerContext for DriverContext {
    /// As rdkafka's own, with start positions set on assignment
    /// ([`set_start_positions`]).
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                set_start_positions(consumer, tpl, self.reset);
                let assigned = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if let Err(e) = assigned {
                    tracing::warn!(error = %e, "assignment failed");
                }
                self.post_rebalance(consumer, &Rebalance::Assign(tpl));
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.pre_rebalance(consumer, &Rebalance::Revoke(tpl));
                let revoked = if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                };
                if let Err(e) = revoked {
                    tracing::warn!(error = %e, "unassignment failed");
                }
                self.post_rebalance(consumer, &Rebalance::Revoke(tpl));
            }
            other => {
                let e = KafkaError::Rebalance(other.into());
                self.post_rebalance(consumer, &Rebalance::Error(e));
            }
        }
    }

    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let mut engine = self.engine.lock();
            if let Err(e) = engine.on_revoke(consumer, tpl) {
                engine.fail(e);
            }
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let mut engine = self.engine.lock();
                if let Err(e) = engine.on_assign(consumer, tpl) {
                    engine.fail(e);
                }
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
        }
    }
}

type DriverConsumer = BaseConsumer<DriverContext>;

/// The driver: owns the consumer; runs on its own thread.
pub(crate) struct Driver {
    engine: Arc<Mutex<Engine>>,
    consumer: Arc<DriverConsumer>,
    topics: Vec<String>,
    /// Wake-ups from the consumer's and the partition queues (see `main_loop`).
    wake_rx: Receiver<()>,
    /// Completions of async calls (also a reason to wake).
    completions: Receiver<CompletionMsg>,
}

/// A callback for librdkafka's "queue became non-empty" event that wakes the
/// driver (from a librdkafka thread).
fn waker(tx: &Sender<()>) -> impl Fn() + Send + Sync + 'static {
    let tx = tx.clone();
    move || {
        let _ = tx.try_send(());
    }
}

impl Driver {
    pub(crate) fn new(
        topology: Arc<Topology>,
        cfg: Arc<StreamsConfig>,
        metrics: EngineMetrics,
        dlq_partitions: super::admin::DeadLetterPartitions,
        runtime: tokio::runtime::Handle,
        status: Arc<AppStatus>,
        intake: IntakeControl,
    ) -> Result<Self, TopologyError> {
        let app = cfg.application_id.clone();
        let mut topic_sub = HashMap::new();
        let mut topics = Vec::new();
        for st in topology.subtopologies() {
            for t in st.source_topics(&app) {
                topic_sub.insert(t.clone(), st.id);
                topics.push(t);
            }
        }
        let shared_producer = match cfg.guarantee {
            Guarantee::AtLeastOnce => Some(create_producer(&cfg, None)?),
            Guarantee::ExactlyOnce => None,
        };
        let (completions_tx, completions_rx) = crossbeam_channel::unbounded();
        let (wake_tx, wake_rx) = crossbeam_channel::bounded(1);
        let env = RocksEnv::new(cfg.rocksdb.clone());
        let engine = Arc::new(Mutex::new(Engine {
            topology,
            cfg: cfg.clone(),
            metrics: metrics.clone(),
            dlq_partitions,
            env,
            runtime,
            completions_tx,
            completions_rx: completions_rx.clone(),
            wake_tx: wake_tx.clone(),
            topic_sub,
            tasks: BTreeMap::new(),
            suspended: BTreeMap::new(),
            pending: BTreeMap::new(),
            shared_producer,
            paused: HashSet::new(),
            queues: HashMap::new(),
            drains: 0,
            rejoin: false,
            unsplit: HashSet::new(),
            last_commit: Instant::now(),
            last_punctuate: Instant::now(),
            status,
            intake,
            joined: false,
            fatal: None,
        }));

        let mut c = client_config(&cfg);
        let session_ms = cfg.session_timeout.as_millis();
        c.set("group.id", &app)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("partition.assignment.strategy", "range")
            .set("session.timeout.ms", session_ms.to_string())
            .set(
                "heartbeat.interval.ms",
                (session_ms / 3).max(100).to_string(),
            )
            .set(
                "max.poll.interval.ms",
                cfg.max_poll_interval.as_millis().to_string(),
            )
            .set("statistics.interval.ms", "5000")
            // Split partition queues apply the prefetch bound per partition.
            .set("queued.max.messages.kbytes", PREFETCH_KBYTES_PER_PARTITION)
            .set(
                "isolation.level",
                match cfg.guarantee {
                    Guarantee::ExactlyOnce => "read_committed",
                    Guarantee::AtLeastOnce => "read_uncommitted",
                },
            );
        for (k, v) in &cfg.consumer_overrides {
            c.set(k, v);
        }
        let reset = reset_offset(c.get("auto.offset.reset"));
        let mut consumer: DriverConsumer = c.create_with_context(DriverContext {
            engine: engine.clone(),
            metrics,
            reset,
        })?;
        consumer.set_nonempty_callback(waker(&wake_tx));
        Ok(Driver {
            engine,
            consumer: Arc::new(consumer),
            topics,
            wake_rx,
            completions: completions_rx,
        })
    }

    /// Runs until `stop` is set or an error stops the instance.
    pub(crate) fn run(self, stop: &AtomicBool) -> Result<(), RuntimeError> {
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        self.consumer.subscribe(&topics)?;
        let result = self.main_loop(stop);
        let mut engine = self.engine.lock();
        let result = match (result, engine.fatal.take()) {
            (Err(e), _) | (Ok(()), Some(e)) => Err(e),
            (Ok(()), None) => Ok(()),
        };
        match &result {
            // Clean stop: drain, commit and close every task.
            Ok(()) => engine.close_all(&self.consumer, true)?,
            // Crash semantics: commit nothing more.
            Err(_) => engine.close_all(&self.consumer, false)?,
        }
        drop(engine);
        self.consumer.unsubscribe();
        result
    }

    /// Waits for work — a record or event in the consumer's queue, a record in a
    /// partition queue, a completed async call — or the next tick, then takes
    /// what is there without blocking: records reaching a partition queue
    /// could not end a blocking poll of the consumer's queue.
    fn main_loop(&self, stop: &AtomicBool) -> Result<(), RuntimeError> {
        let batch = 2_000;
        let tick = Duration::from_millis(10);
        let mut more = false;
        while !stop.load(Ordering::SeqCst) {
            if !more {
                let mut sel = crossbeam_channel::Select::new();
                sel.recv(&self.wake_rx);
                sel.recv(&self.completions);
                let _ = sel.ready_timeout(tick);
                while self.wake_rx.try_recv().is_ok() {}
            }
            let mut n = 0;
            let mut drained = false;
            while n < batch {
                let Some(msg) = self.consumer.poll(Duration::ZERO) else {
                    drained = true;
                    break;
                };
                match msg {
                    Ok(m) => {
                        let mut engine = self.engine.lock();
                        engine.on_message(&m)?;
                    }
                    Err(e) => tracing::warn!(error = %e, "consumer error"),
                }
                n += 1;
            }
            let mut engine = self.engine.lock();
            if let Some(e) = engine.fatal.take() {
                return Err(e);
            }
            if drained {
                engine.drains += 1;
            }
            engine.tick(&self.consumer)?;
            if std::mem::take(&mut engine.rejoin) {
                // As Kafka Streams does for a migrated task: leave and join
                // the group again, so the coordinator's assignment decides.
                drop(engine);
                let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
                self.consumer.unsubscribe();
                self.consumer.subscribe(&topics)?;
                more = true;
                continue;
            }
            // Records may be left where the wake-up already fired.
            more = engine.feed()? || n == batch;
        }
        Ok(())
    }
}

fn timestamp_of(msg: &impl Message) -> i64 {
    msg.timestamp()
        .to_millis()
        .filter(|t| *t >= 0)
        .unwrap_or_else(now_ms)
}

impl Engine {
    fn fail(&mut self, e: RuntimeError) {
        tracing::error!(error = %e, "stream task failed");
        if self.fatal.is_none() {
            self.fatal = Some(e);
        }
    }

    fn eos(&self) -> bool {
        self.cfg.guarantee == Guarantee::ExactlyOnce
    }

    /// The task that reads `partition` of `topic`, if the topology reads it.
    fn task_of(&self, topic: &str, partition: i32) -> Option<TaskId> {
        self.topic_sub.get(topic).map(|&sub| TaskId {
            subtopology: sub as u32,
            partition,
        })
    }

    fn on_message(&mut self, msg: &BorrowedMessage<'_>) -> Result<(), RuntimeError> {
        let Some(id) = self.task_of(msg.topic(), msg.partition()) else {
            return Ok(());
        };
        if let Some(p) = self.pending.get_mut(&id) {
            p.buffered.push(msg.detach());
            return Ok(());
        }
        let eos = self.eos();
        let max = self.cfg.max_in_flight_per_partition;
        let Some(task) = self.tasks.get_mut(&id) else {
            tracing::debug!(
                topic = msg.topic(),
                partition = msg.partition(),
                "record for a task not assigned here"
            );
            return Ok(());
        };
        task.offer(msg, &self.metrics, eos, max)
    }

    /// Everything between polls: completions, restores, punctuation, commits,
    /// pause/resume, status.
    fn tick(&mut self, consumer: &Arc<DriverConsumer>) -> Result<(), RuntimeError> {
        self.handle_completions()?;
        self.check_restores()?;
        self.attach_queues(consumer)?;
        if self.last_punctuate.elapsed() >= self.cfg.punctuate_interval {
            self.last_punctuate = Instant::now();
            let now = now_ms();
            let (metrics, eos) = (self.metrics.clone(), self.eos());
            for task in self.tasks.values_mut() {
                task.core
                    .punctuate(now)
                    .map_err(|error| RuntimeError::Process {
                        task: task.core.id,
                        error,
                    })?;
                send_outputs(task, &metrics, eos)?;
            }
        }
        let cache_full = self.tasks.values().any(|t| {
            t.core.ctx.commit_requested
                || t.core
                    .ctx
                    .state
                    .as_ref()
                    .is_some_and(|s| s.dirty_len() >= self.cfg.cache_max_entries)
        });
        if cache_full || self.last_commit.elapsed() >= self.cfg.commit_interval() {
            self.commit_all(consumer)?;
        }
        self.update_pauses(consumer)?;
        for task in self.tasks.values_mut().chain(self.suspended.values_mut()) {
            task.count_in(&self.metrics);
        }
        self.update_metrics();
        Ok(())
    }

    fn handle_completions(&mut self) -> Result<(), RuntimeError> {
        while let Ok(msg) = self.completions_rx.try_recv() {
            self.complete(msg)?;
        }
        Ok(())
    }

    /// Hands an async completion to its task (if the task is still here).
    fn complete(&mut self, msg: CompletionMsg) -> Result<(), RuntimeError> {
        let eos = self.eos();
        if let Some(task) = self.tasks.get_mut(&msg.task) {
            task.core
                .complete(msg)
                .map_err(|error| RuntimeError::Process {
                    task: task.core.id,
                    error,
                })?;
            send_outputs(task, &self.metrics, eos)?;
        }
        Ok(())
    }

    /// Forwards cached results of tasks (before a commit).
    fn flush_tasks(&mut self, ids: &[TaskId]) -> Result<(), RuntimeError> {
        let (metrics, eos) = (self.metrics.clone(), self.eos());
        let threads = self.cfg.processing_threads;
        let tasks: Vec<&mut ActiveTask> = self
            .tasks
            .iter_mut()
            .filter(|(id, _)| ids.contains(id))
            .map(|(_, t)| t)
            .collect();
        in_parallel(tasks, threads, |task| {
            task.core.flush().map_err(|error| RuntimeError::Process {
                task: task.core.id,
                error,
            })?;
            send_outputs(task, &metrics, eos)
        })?;
        Ok(())
    }

    /// The listed tasks, active or suspended.
    fn tasks_mut(&mut self, ids: &[TaskId]) -> Vec<&mut ActiveTask> {
        self.tasks
            .iter_mut()
            .chain(self.suspended.iter_mut())
            .filter(|(id, _)| ids.contains(id))
            .map(|(_, t)| t)
            .collect()
    }

    /// Commits every task.
    fn commit_all(&mut self, consumer: &DriverConsumer) -> Result<(), RuntimeError> {
        let started = Instant::now();
        let ids: Vec<TaskId> = self.tasks.keys().copied().collect();
        self.commit_tasks(consumer, &ids)?;
        self.metrics
            .commit_seconds
            .observe(started.elapsed().as_secs_f64());
        // The interval runs from the end of a commit, so slow commits still
        // leave a full interval of processing between them.
        self.last_commit = Instant::now();
        Ok(())
    }

    /// Commits some tasks. Under exactly-once their transactions commit in
    /// parallel (each task has its own producer).
    fn commit_tasks(
        &mut self,
        consumer: &DriverConsumer,
        ids: &[TaskId],
    ) -> Result<(), RuntimeError> {
        self.flush_tasks(ids)?;
        if !self.eos() {
            return self.commit_alos(consumer, ids);
        }
        let meta = consumer
            .group_metadata()
            .ok_or_else(|| RuntimeError::Other("no consumer group metadata".into()))?;
        let app = self.cfg.application_id.clone();
        let metrics = self.metrics.clone();
        let tasks: Vec<&mut ActiveTask> = self
            .tasks
            .values_mut()
            .filter(|t| ids.contains(&t.core.id))
            .collect();
        let order: Vec<TaskId> = tasks.iter().map(|t| t.core.id).collect();
        let results: Vec<Result<(), RuntimeError>> =
            if tasks.len() <= 1 || !self.cfg.parallel_commits {
                tasks
                    .into_iter()
                    .map(|t| commit_eos(t, &meta, &app, &metrics))
                    .collect()
            } else {
                std::thread::scope(|s| {
                    let handles: Vec<_> = tasks
                        .into_iter()
                        .map(|t| {
                            let (meta, app, metrics) = (&meta, &app, &metrics);
                            s.spawn(move || commit_eos(t, meta, app, metrics))
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| {
                            h.join().unwrap_or_else(|_| {
                                Err(RuntimeError::Other("commit thread panicked".into()))
                            })
                        })
                        .collect()
                })
            };
        let mut migrated = Vec::new();
        for (id, result) in order.into_iter().zip(results) {
            match result {
                Ok(()) => {}
                Err(e) if e.task_migrated() => {
                    tracing::warn!(task = %id, error = %e, "task fenced or its transaction must abort: closing it dirty and rejoining");
                    migrated.push(id);
                }
                Err(e) => return Err(e),
            }
        }
        if !migrated.is_empty() {
            let mut paused = TopicPartitionList::new();
            for id in &migrated {
                if let Some(t) = self.tasks.get(id) {
                    for (topic, partition) in &t.partitions {
                        paused.add_partition(topic, *partition);
                    }
                }
            }
            self.close_dirty(&migrated);
            // Nothing is read for them until the group says who owns them.
            if let Err(e) = consumer.pause(&paused) {
                tracing::debug!(error = %e, "pausing a closed task's partitions failed");
            }
            self.rejoin = true;
        }
        Ok(())
    }

    fn commit_alos(
        &mut self,
        consumer: &DriverConsumer,
        ids: &[TaskId],
    ) -> Result<(), RuntimeError> {
        let Some((producer, delivery)) = self.shared_producer.clone() else {
            return Ok(());
        };
        let app = self.cfg.application_id.clone();
        let threads = self.cfg.processing_threads;
        flush(&producer, &delivery, FLUSH_TIMEOUT).map_err(RuntimeError::Other)?;
        let work: Vec<(TaskId, Vec<(usize, i64)>)> =
            in_parallel(self.tasks_mut(ids), threads, |task| {
                let prepared = task.core.prepare_commit(false);
                send_changelog(task, &app, prepared.changelog)?;
                Ok((task.core.id, prepared.offsets))
            })?;
        flush(&producer, &delivery, FLUSH_TIMEOUT).map_err(RuntimeError::Other)?;
        failpoint("alos_after_changelog_flush");
        // Progress records go last, once the state they describe is in the
        // changelogs: a progress record read back implies its state was
        // written (without transactions nothing else orders them).
        let progress: Vec<bool> = in_parallel(self.tasks_mut(ids), threads, |task| {
            let rec = task.core.write_progress(false);
            let some = rec.is_some();
            send_changelog(task, &app, rec.into_iter().collect())?;
            Ok(some)
        })?;
        if progress.contains(&true) {
            flush(&producer, &delivery, FLUSH_TIMEOUT).map_err(RuntimeError::Other)?;
        }
        failpoint("alos_before_offset_commit");
        let offsets_of: HashMap<TaskId, &[(usize, i64)]> =
            work.iter().map(|(id, o)| (*id, o.as_slice())).collect();
        in_parallel(self.tasks_mut(ids), threads, |task| {
            let next = delivery.take_changelog_next(task.core.id);
            let offsets = offsets_of.get(&task.core.id).copied().unwrap_or_default();
            task.core.finish_commit(offsets, &next)?;
            let ends = delivery.take_output_next(task.core.id);
            task.core.ctx.output_ends.extend(ends);
            Ok(())
        })?;
        let mut tpl = TopicPartitionList::new();
        for (id, offsets) in &work {
            let task = self
                .tasks
                .get(id)
                .or_else(|| self.suspended.get(id))
                .expect("task listed above");
            for (slot, offset) in offsets {
                let s = &task.core.slots[*slot];
                tpl.add_partition_offset(&s.topic, s.partition, Offset::Offset(*offset))?;
            }
        }
        if tpl.count() > 0 {
            if let Err(e) = consumer.commit(&tpl, CommitMode::Sync) {
                let e = RuntimeError::from(e);
                if !e.task_migrated() {
                    return Err(e);
                }
                // The group moved on without this member: its tasks' state is
                // in the changelogs already; their offsets are another
                // owner's to commit.
                tracing::warn!(error = %e, "offset commit refused: closing the tasks and rejoining");
                let ids: Vec<TaskId> = work.iter().map(|(id, _)| *id).collect();
                self.close_dirty(&ids);
                self.rejoin = true;
                return Ok(());
            }
        }
        self.metrics.commits.inc();
        Ok(())
    }

    /// Gives each assigned input partition its own fetch queue, right after the
    /// assignment, so librdkafka fetches into it while the task restores.
    /// Records of the partition that reached the consumer's queue before the
    /// split go to the task from there; the split queue is read only after the
    /// consumer's queue ran empty once more (`split_at`), so they come first.
    fn attach_queues(&mut self, consumer: &Arc<DriverConsumer>) -> Result<(), RuntimeError> {
        let new: Vec<Tp> = self
            .tasks
            .values()
            .map(|t| &t.partitions)
            .chain(self.pending.values().map(|p| &p.partitions))
            .flatten()
            .filter(|tp| !self.queues.contains_key(*tp) && !self.unsplit.contains(*tp))
            .cloned()
            .collect();
        for tp in new {
            match consumer.split_partition_queue(&tp.0, tp.1) {
                Some(mut q) => {
                    q.set_nonempty_callback(waker(&self.wake_tx));
                    let split_at = self.drains;
                    self.queues.insert(tp, SplitQueue { queue: q, split_at });
                }
                None => {
                    tracing::warn!(
                        topic = tp.0,
                        partition = tp.1,
                        "cannot split the partition's queue"
                    );
                    self.unsplit.insert(tp);
                }
            }
        }
        Ok(())
    }

    /// Takes records from the split queues while their tasks have room under the
    /// in-flight bound (and no backlog, which holds older records). What is left
    /// stays in librdkafka's bounded prefetch: backpressure without a pause.
    /// Returns whether any record was taken.
    fn feed(&mut self) -> Result<bool, RuntimeError> {
        if self.intake.is_held() || self.queues.is_empty() {
            return Ok(false);
        }
        let queues = std::mem::take(&mut self.queues);
        let result = self.feed_from(&queues);
        self.queues = queues;
        result
    }

    fn feed_from(&mut self, queues: &HashMap<Tp, SplitQueue>) -> Result<bool, RuntimeError> {
        let (eos, max) = (self.eos(), self.cfg.max_in_flight_per_partition);
        let mut by_task: HashMap<TaskId, TaskQueues<'_>> = HashMap::new();
        for ((topic, partition), SplitQueue { queue, split_at }) in queues {
            if *split_at >= self.drains {
                continue;
            }
            let Some(id) = self.task_of(topic, *partition) else {
                continue;
            };
            let Some(slot) = self.tasks.get(&id).and_then(|t| t.core.slot_of(topic)) else {
                continue;
            };
            by_task.entry(id).or_default().push((slot, queue));
        }
        // A first record of each task is taken here; the tasks that had one
        // go on in parallel when there are several.
        let metrics = &self.metrics;
        let mut busy: Vec<(&mut ActiveTask, TaskQueues<'_>)> = Vec::new();
        for (id, task) in self.tasks.iter_mut() {
            let Some(qs) = by_task.remove(id) else {
                continue;
            };
            task.core.drain_done();
            if feed_task(task, &qs, metrics, eos, max, 1)? {
                busy.push((task, qs));
            }
        }
        let fed = !busy.is_empty();
        in_parallel(busy, self.cfg.processing_threads, |(task, qs)| {
            feed_task(task, &qs, metrics, eos, max, FEED_BATCH)
        })?;
        Ok(fed)
    }

    /// Feeds queued records to the tasks, then pauses every partition while
    /// intake is held, and a partition without a split queue whose backlog holds
    /// a full in-flight bound until the backlog ran down; polling never stops.
    fn update_pauses(&mut self, consumer: &DriverConsumer) -> Result<(), RuntimeError> {
        let held = self.intake.is_held();
        let max = self.cfg.max_in_flight_per_partition;
        let eos = self.eos();
        let mut to_pause = TopicPartitionList::new();
        let mut to_resume = TopicPartitionList::new();
        // A restoring task buffers up to the in-flight bound per partition.
        for p in self.pending.values() {
            if p.buffered.len() >= max * p.partitions.len() {
                for tp in &p.partitions {
                    if self.paused.insert(tp.clone()) {
                        to_pause.add_partition(&tp.0, tp.1);
                    }
                }
            }
        }
        for task in self.tasks.values_mut() {
            if held {
                task.core.drain_done();
            } else {
                task.drain_backlog(&self.metrics, eos, max)?;
            }
            for (i, slot) in task.core.slots.iter().enumerate() {
                let tp = (slot.topic.clone(), slot.partition);
                let queued = task.backlog[i].len();
                let paused = self.paused.contains(&tp);
                // A split queue is read only while its task has room.
                let split = self.queues.contains_key(&tp);
                if !paused && (held || (!split && queued >= max)) {
                    to_pause.add_partition(&tp.0, tp.1);
                    self.paused.insert(tp);
                } else if paused && !held && (split || queued <= max / 2) {
                    to_resume.add_partition(&tp.0, tp.1);
                    self.paused.remove(&tp);
                }
            }
        }
        if to_pause.count() > 0 {
            consumer.pause(&to_pause)?;
        }
        if to_resume.count() > 0 {
            consumer.resume(&to_resume)?;
        }
        Ok(())
    }

    fn update_metrics(&self) {
        let in_flight: usize = self.tasks.values().map(|t| t.core.in_flight()).sum();
        self.metrics.in_flight.set(in_flight as i64);
        self.metrics.paused.set(self.paused.len() as i64);
        self.metrics
            .tasks
            .with_label_values(&["running"])
            .set(self.tasks.len() as i64);
        self.metrics
            .tasks
            .with_label_values(&["restoring"])
            .set(self.pending.len() as i64);
        let state = if !self.joined {
            AppState::Starting
        } else if self.pending.is_empty() {
            AppState::Running
        } else {
            AppState::Restoring
        };
        if self.fatal.is_none() {
            self.status.set(state);
        }
    }

    /// Revocation: stop intake of the revoked tasks, drain their in-flight work,
    /// commit, and suspend them until the assignment that follows.
    fn on_revoke(
        &mut self,
        consumer: &DriverConsumer,
        tpl: &TopicPartitionList,
    ) -> Result<(), RuntimeError> {
        self.metrics.rebalances.inc();
        self.status.set(AppState::Rebalancing);
        let revoked: HashSet<Tp> = tpl
            .elements()
            .iter()
            .map(|e| (e.topic().to_string(), e.partition()))
            .collect();
        let hit = |parts: &[Tp]| parts.iter().any(|p| revoked.contains(p));
        let pending: Vec<TaskId> = self
            .pending
            .iter()
            .filter(|(_, p)| hit(&p.partitions))
            .map(|(id, _)| *id)
            .collect();
        for id in pending {
            if let Some(mut p) = self.pending.remove(&id) {
                for tp in &p.partitions {
                    self.paused.remove(tp);
                }
                p.cancel.store(true, Ordering::SeqCst);
                if let Some(h) = p.handle.take() {
                    let _ = h.join();
                }
            }
        }
        let ids: Vec<TaskId> = self
            .tasks
            .iter()
            .filter(|(_, t)| hit(&t.partitions))
            .map(|(id, _)| *id)
            .collect();
        self.queues.retain(|tp, _| !revoked.contains(tp));
        if self.fatal.is_some() {
            for id in ids {
                self.tasks.remove(&id);
            }
            return Ok(());
        }
        if consumer.assignment_lost() {
            // Another instance may own these partitions already (this one
            // missed its session timeout, or was fenced): nothing of theirs
            // since the last commit may reach the changelogs or local state.
            tracing::warn!(tasks = ?ids, "partitions lost: closing their tasks dirty");
            self.close_dirty(&ids);
            return Ok(());
        }
        self.drain(&ids)?;
        self.commit_tasks(consumer, &ids)?;
        for id in ids {
            if let Some(mut task) = self.tasks.remove(&id) {
                for tp in &task.partitions {
                    self.paused.remove(tp);
                }
                // Queued records are read again from the committed position.
                for q in &mut task.backlog {
                    q.clear();
                }
                self.suspended.insert(id, task);
            }
        }
        self.status.set_tasks(self.tasks.keys().copied());
        Ok(())
    }

    /// Closes tasks without committing: in-flight calls abandoned, an open
    /// transaction aborted, uncommitted state and held outputs dropped (the
    /// local store keeps what the last commit wrote). A task that comes back
    /// restores from its changelogs like any new one.
    fn close_dirty(&mut self, ids: &[TaskId]) {
        for id in ids {
            let Some(mut task) = self.tasks.remove(id).or_else(|| self.suspended.remove(id)) else {
                continue;
            };
            task.count_in(&self.metrics);
            task.core.abandon();
            if task.txn_open {
                if let Err(e) = task.producer.abort_transaction(TXN_TIMEOUT) {
                    tracing::debug!(task = %id, error = %e, "abort of a closed task's transaction failed");
                }
                self.metrics.aborted.inc();
            }
            for tp in &task.partitions {
                self.paused.remove(tp);
                self.queues.remove(tp);
            }
            tracing::info!(task = %id, "task closed dirty");
        }
        self.status.set_tasks(self.tasks.keys().copied());
    }

    /// Waits for the in-flight async calls of `ids` (handling completions of all
    /// tasks meanwhile) up to the drain timeout, then abandons what is left.
    fn drain(&mut self, ids: &[TaskId]) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + self.cfg.drain_timeout;
        loop {
            let pending: usize = ids
                .iter()
                .filter_map(|id| self.tasks.get(id))
                .map(|t| t.core.ctx.spawner.pending())
                .sum();
            if pending == 0 {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    pending,
                    "drain timeout: abandoning in-flight calls; their records stay uncommitted"
                );
                for id in ids {
                    if let Some(t) = self.tasks.get_mut(id) {
                        t.core.abandon();
                    }
                }
                return Ok(());
            }
            if let Ok(msg) = self
                .completions_rx
                .recv_timeout(left.min(Duration::from_millis(50)))
            {
                self.complete(msg)?;
            }
        }
    }

    /// Assignment: resume suspended tasks that stayed here, close the others,
    /// and restore new ones (buffering their records meanwhile).
    fn on_assign(
        &mut self,
        consumer: &DriverConsumer,
        tpl: &TopicPartitionList,
    ) -> Result<(), RuntimeError> {
        self.joined = true;
        // An assignment forwards every partition to the consumer's queue again.
        self.queues.clear();
        self.unsplit.clear();
        let mut by_task: BTreeMap<TaskId, Vec<Tp>> = BTreeMap::new();
        for e in tpl.elements() {
            if let Some(id) = self.task_of(e.topic(), e.partition()) {
                by_task
                    .entry(id)
                    .or_default()
                    .push((e.topic().to_string(), e.partition()));
            }
        }
        let gone: Vec<TaskId> = self
            .suspended
            .keys()
            .filter(|id| !by_task.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            if let Some(mut task) = self.suspended.remove(&id) {
                tracing::info!(task = %id, "task moved to another instance");
                task.count_in(&self.metrics);
                drop(task);
            }
        }
        let mut resume_at = TopicPartitionList::new();
        for (id, parts) in by_task {
            if self.tasks.contains_key(&id) || self.pending.contains_key(&id) {
                continue;
            }
            if let Some(mut task) = self.suspended.remove(&id) {
                if !task.core.is_abandoned() {
                    // Continue exactly where this task left off: the group's
                    // committed offset can lag a transaction whose commit the
                    // broker has not applied yet.
                    for (slot, tracker) in task.core.slots.iter().zip(&task.core.trackers) {
                        if let Some(next) = tracker.last_committed() {
                            resume_at.add_partition_offset(
                                &slot.topic,
                                slot.partition,
                                Offset::Offset(next),
                            )?;
                        }
                    }
                    self.tasks.insert(id, task);
                    continue;
                }
                // Its abandoned records must be read again: start afresh.
                task.count_in(&self.metrics);
                drop(task);
            }
            // Not paused: librdkafka looks up the positions and fetches while
            // the task restores (a pause would hold the lookup back until the
            // resume); records wait in the split queues (`attach_queues`).
            self.start_restore(id, parts);
        }
        if resume_at.count() > 0 {
            // Positions, not commits: librdkafka starts fetching there.
            // (Records below are skipped by the task in any case.)
            match consumer.seek_partitions(resume_at, Duration::from_secs(10)) {
                Ok(result) => {
                    for e in result.elements() {
                        if let Err(err) = e.error() {
                            tracing::debug!(topic = e.topic(), partition = e.partition(), error = %err, "seek on resume failed");
                        }
                    }
                }
                Err(err) => tracing::debug!(error = %err, "seek on resume failed"),
            }
        }
        self.status.set_tasks(self.tasks.keys().copied());
        Ok(())
    }

    fn start_restore(&mut self, id: TaskId, partitions: Vec<Tp>) {
        let cancel = Arc::new(AtomicBool::new(false));
        let cfg = self.cfg.clone();
        let topology = self.topology.clone();
        let env = self.env.clone();
        let metrics = self.metrics.clone();
        let shared = self.shared_producer.clone();
        let stop = cancel.clone();
        let handle = std::thread::Builder::new()
            .name(format!("sluice-restore-{id}"))
            .spawn(move || init_task(&cfg, &topology, &env, &metrics, shared, id, &stop))
            .ok();
        self.pending.insert(
            id,
            PendingTask {
                handle,
                cancel,
                buffered: Vec::new(),
                partitions,
            },
        );
    }

    /// Activates tasks whose restore finished.
    fn check_restores(&mut self) -> Result<(), RuntimeError> {
        let done: Vec<TaskId> = self
            .pending
            .iter()
            .filter(|(_, p)| p.handle.as_ref().is_none_or(|h| h.is_finished()))
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            let mut p = self.pending.remove(&id).expect("listed above");
            let restored = match p.handle.take() {
                Some(h) => h.join().unwrap_or_else(|_| {
                    Err(RuntimeError::Other(format!(
                        "restore of task {id} panicked"
                    )))
                })?,
                None => {
                    return Err(RuntimeError::Other(format!(
                        "cannot start restore thread for task {id}"
                    )))
                }
            };
            let sub = &self.topology.subtopologies()[id.subtopology as usize];
            let core = TaskCore::new(
                sub,
                id.partition,
                &self.cfg.application_id,
                restored.state,
                self.runtime.clone(),
                self.completions_tx.clone(),
                &self.dlq_partitions,
            )?;
            let mut task = ActiveTask::new(
                core,
                restored.producer,
                restored.delivery,
                p.partitions.clone(),
            );
            let (metrics, eos) = (self.metrics.clone(), self.eos());
            let max = self.cfg.max_in_flight_per_partition;
            for msg in p.buffered.drain(..) {
                task.offer(&msg, &metrics, eos, max)?;
            }
            tracing::info!(task = %id, "task restored; processing");
            // Its buffered records (those that reached the consumer's queue
            // before the split) went first; its split queues follow.
            self.tasks.insert(id, task);
        }
        self.status.set_tasks(self.tasks.keys().copied());
        Ok(())
    }

    /// Closes every task: with `commit`, drains and commits first.
    fn close_all(&mut self, consumer: &DriverConsumer, commit: bool) -> Result<(), RuntimeError> {
        // The queues hold the consumer; the engine must not.
        self.queues.clear();
        for (_, mut p) in std::mem::take(&mut self.pending) {
            p.cancel.store(true, Ordering::SeqCst);
            if let Some(h) = p.handle.take() {
                let _ = h.join();
            }
        }
        let ids: Vec<TaskId> = self.tasks.keys().copied().collect();
        if commit && !ids.is_empty() {
            self.drain(&ids)?;
            self.commit_all(consumer)?;
        }
        for (_, mut t) in std::mem::take(&mut self.tasks) {
            t.count_in(&self.metrics);
            t.core.abandon();
            if t.txn_open {
                let _ = t.producer.abort_transaction(TXN_TIMEOUT);
                self.metrics.aborted.inc();
            }
        }
        self.suspended.clear();
        self.status.set_tasks([]);
        Ok(())
    }
}

/// A crash point for tests: with `SLUICE_FAILPOINT=<name>:<n>` in the
/// environment, the process aborts (as if killed) the n-th time it reaches the
/// point named `name`. Without the variable this is a no-op.
fn failpoint(name: &str) {
    use std::sync::atomic::AtomicI64;
    static REMAINING: AtomicI64 = AtomicI64::new(i64::MIN);
    static CONFIG: std::sync::OnceLock<Option<(String, i64)>> = std::sync::OnceLock::new();
    let Some((point, n)) = CONFIG.get_or_init(|| {
        let v = std::env::var("SLUICE_FAILPOINT").ok()?;
        let (p, n) = v.split_once(':')?;
        Some((p.to_string(), n.parse().ok()?))
    }) else {
        return;
    };
    if point != name {
        return;
    }
    let _ = REMAINING.compare_exchange(i64::MIN, *n, Ordering::SeqCst, Ordering::SeqCst);
    if REMAINING.fetch_sub(1, Ordering::SeqCst) == 1 {
        eprintln!("failpoint {name} reached: aborting");
        std::process::abort();
    }
}

/// Commits one task's transaction: outputs sent, offsets sent to the
/// transaction, outputs flushed, changelog records sent and flushed, commit;
/// then local state.
fn commit_eos(
    task: &mut ActiveTask,
    meta: &rdkafka::consumer::ConsumerGroupMetadata,
    app: &str,
    metrics: &EngineMetrics,
) -> Result<(), RuntimeError> {
    let id = task.core.id;
    let PreparedCommit {
        changelog: dirty,
        offsets,
    } = task.core.prepare_commit(true);
    let outputs = task.core.take_output();
    if offsets.is_empty() && dirty.is_empty() && outputs.is_empty() && !task.txn_open {
        return Ok(());
    }
    if !task.txn_open {
        task.producer.begin_transaction()?;
        task.txn_open = true;
    }
    let t0 = Instant::now();
    produce_outputs(task, metrics, outputs)?;
    // The offsets join the transaction while the outputs are on their way
    // (they commit with it, or not at all).
    if !offsets.is_empty() {
        let tpl = offsets_tpl(&task.core, &offsets)?;
        task.producer
            .send_offsets_to_transaction(&tpl, meta, TXN_TIMEOUT)?;
    }
    // Outputs first: a changelog record visible to a reader implies the
    // outputs that preceded it are visible too.
    flush(&task.producer, &task.delivery, FLUSH_TIMEOUT).map_err(RuntimeError::Other)?;
    let t1 = Instant::now();
    failpoint("eos_after_output_flush");
    send_changelog(task, app, dirty)?;
    // The commit's own flush (see `kafka::commit_transaction`), with the
    // tests' crash point between it and the commit.
    flush(&task.producer, &task.delivery, FLUSH_TIMEOUT).map_err(RuntimeError::Other)?;
    failpoint("eos_after_changelog_flush");
    let t2 = Instant::now();
    task.producer.commit_transaction(TXN_TIMEOUT)?;
    tracing::trace!(
        task = %id,
        outputs_ms = (t1 - t0).as_millis() as u64,
        changelog_ms = (t2 - t1).as_millis() as u64,
        end_ms = t2.elapsed().as_millis() as u64,
        "transaction committed"
    );
    task.txn_open = false;
    let next = task.delivery.take_changelog_next(id);
    task.core.finish_commit(&offsets, &next)?;
    task.core
        .ctx
        .output_ends
        .extend(task.delivery.take_output_next(id));
    metrics.commits.inc();
    Ok(())
}

fn offsets_tpl(
    core: &TaskCore,
    offsets: &[(usize, i64)],
) -> Result<TopicPartitionList, RuntimeError> {
    let mut tpl = TopicPartitionList::new();
    for (slot, offset) in offsets {
        let s = &core.slots[*slot];
        tpl.add_partition_offset(&s.topic, s.partition, Offset::Offset(*offset))?;
    }
    Ok(tpl)
}

fn process_record(
    task: &mut ActiveTask,
    msg: &impl Message,
    metrics: &EngineMetrics,
    eos: bool,
) -> Result<(), RuntimeError> {
    let Some(slot) = task.core.slot_of(msg.topic()) else {
        return Ok(());
    };
    // Time one record in 32: the histogram stays representative and the clock
    // stays off the hot path.
    let offset = msg.offset();
    let started = (offset & 31 == 0).then(Instant::now);
    let input = Input {
        offset,
        key: msg.key(),
        value: msg.payload(),
        timestamp: timestamp_of(msg),
        headers: crate::record::message_headers(msg),
    };
    task.core
        .process(slot, input)
        .map_err(|error| RuntimeError::Process {
            task: task.core.id,
            error,
        })?;
    task.uncounted += 1;
    if let Some(started) = started {
        metrics
            .process_seconds
            .observe(started.elapsed().as_secs_f64());
    }
    send_outputs(task, metrics, eos)
}

/// Outputs queued by a task beyond which it asks for an early commit
/// (exactly-once holds outputs until the commit).
const MAX_HELD_OUTPUTS: usize = 50_000;

fn send_outputs(
    task: &mut ActiveTask,
    metrics: &EngineMetrics,
    eos: bool,
) -> Result<(), RuntimeError> {
    flush_counters(task, metrics);
    if eos {
        // Held until the commit: a task's transaction is open only while it
        // commits, so an instance's transactions never overlap (some brokers
        // delay a commit while an overlapping transaction is open), and a crash
        // between commits leaves no transaction behind.
        if task.core.ctx.out.len() >= MAX_HELD_OUTPUTS {
            task.core.ctx.commit_requested = true;
        }
        return Ok(());
    }
    let out = task.core.take_output();
    produce_outputs(task, metrics, out)
}

fn produce_outputs(
    task: &mut ActiveTask,
    metrics: &EngineMetrics,
    out: Vec<OutputRecord>,
) -> Result<(), RuntimeError> {
    for r in &out {
        send(
            &task.producer,
            &r.topic,
            r.partition,
            r.key.as_deref(),
            r.value.as_deref(),
            Some(r.timestamp),
            &r.headers,
            DeliveryTag::Output(task.core.id),
        )?;
    }
    metrics.records_out.inc_by(out.len() as u64);
    Ok(())
}

fn flush_counters(task: &mut ActiveTask, metrics: &EngineMetrics) {
    let c = &mut task.core.ctx.counters;
    if c.late_dropped > 0 {
        metrics.late.inc_by(std::mem::take(&mut c.late_dropped));
    }
    if c.replay_skipped > 0 {
        metrics
            .replay_skipped
            .inc_by(std::mem::take(&mut c.replay_skipped));
    }
    for (cat, n) in c.dead_lettered.drain() {
        metrics.dlq.with_label_values(&[&cat]).inc_by(n);
    }
}

fn send_changelog(
    task: &mut ActiveTask,
    app: &str,
    dirty: Vec<sluice_state::ChangelogRecord>,
) -> Result<(), RuntimeError> {
    if dirty.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = task
        .core
        .ctx
        .state
        .as_ref()
        .map(|s| {
            s.specs()
                .map(|s| Topology::changelog_topic(app, &s.name))
                .collect()
        })
        .unwrap_or_default();
    let id = task.core.id;
    let no_headers = Vec::new();
    for rec in dirty {
        send(
            &task.producer,
            &names[rec.store.0],
            Some(id.partition),
            Some(&rec.key),
            rec.value.as_deref(),
            None,
            &no_headers,
            DeliveryTag::Changelog {
                task: id,
                store: rec.store.0,
            },
        )?;
    }
    Ok(())
}

/// Runs on a restore thread: fence (exactly-once), open state, restore.
fn init_task(
    cfg: &StreamsConfig,
    topology: &Topology,
    env: &RocksEnv,
    metrics: &EngineMetrics,
    shared: Option<(Arc<TrackedProducer>, Arc<DeliveryState>)>,
    id: TaskId,
    cancel: &AtomicBool,
) -> Result<Restored, RuntimeError> {
    let started = Instant::now();
    let sub = &topology.subtopologies()[id.subtopology as usize];
    let (producer, delivery) = match shared {
        Some(p) => p,
        None => {
            let txn_id = format!("{}-{}", cfg.application_id, id);
            let (p, d) = create_producer(cfg, Some(&txn_id))?;
            // Fences whatever transaction a previous owner of this task left open.
            let topic = sub
                .source_topics(&cfg.application_id)
                .pop()
                .unwrap_or_default();
            init_transactions(&p, &topic, TXN_TIMEOUT)?;
            (p, d)
        }
    };
    let state = if sub.stores().is_empty() {
        None
    } else {
        let dir = cfg.state_dir.join(&cfg.application_id).join(id.to_string());
        let mut state = TaskState::open(&dir, sub.stores(), env)?;
        let restore_started = Instant::now();
        let stats = restore_task(cfg, id, &mut state, &producer, &delivery, cancel)?;
        metrics.observe_restore(restore_started.elapsed());
        metrics.restore_records.inc_by(stats.records);
        tracing::info!(task = %id, records = stats.records, "restored");
        Some(state)
    };
    tracing::debug!(task = %id, elapsed = ?started.elapsed(), "task initialised");
    Ok(Restored {
        state,
        producer,
        delivery,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_policies_map_to_logical_offsets() {
        for p in ["earliest", "smallest", "beginning"] {
            assert_eq!(reset_offset(Some(p)), Some(Offset::Beginning), "{p}");
        }
        for p in ["latest", "largest", "end"] {
            assert_eq!(reset_offset(Some(p)), Some(Offset::End), "{p}");
        }
        // `error` (and anything unknown) stays librdkafka's to apply.
        assert_eq!(reset_offset(Some("error")), None);
        assert_eq!(reset_offset(None), None);
    }

    #[test]
    fn in_parallel_keeps_item_order_and_uses_several_threads() {
        let items: Vec<u32> = (0..9).collect();
        let main = std::thread::current().id();
        let got = in_parallel(items, 3, |i| {
            std::thread::sleep(Duration::from_millis(5));
            Ok((i * 10, std::thread::current().id()))
        })
        .unwrap();
        let values: Vec<u32> = got.iter().map(|(v, _)| *v).collect();
        assert_eq!(values, (0..9).map(|i| i * 10).collect::<Vec<_>>());
        let threads: HashSet<_> = got.iter().map(|(_, t)| *t).collect();
        assert_eq!(threads.len(), 3, "three threads share the items");
        assert!(threads.contains(&main), "the calling thread takes a share");
    }

    #[test]
    fn in_parallel_reports_an_error_of_any_item() {
        let err = in_parallel((0..4).collect::<Vec<u32>>(), 2, |i| {
            if i == 3 {
                Err(RuntimeError::Other(format!("item {i} failed")))
            } else {
                Ok(i)
            }
        })
        .unwrap_err();
        assert!(err.to_string().contains("item 3 failed"), "{err}");
        let one = in_parallel(vec![7u32], 4, Ok).unwrap();
        assert_eq!(one, vec![7]);
    }
}
