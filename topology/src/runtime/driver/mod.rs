//! The driver thread: consumer, tasks, commits, rebalances (see the module
//! documentation of [`crate::runtime`]). This module holds the driver's types
//! (the [`Engine`] and its parts: [`Tasks`], [`CommitRound`], [`Intake`]),
//! its main loop and the per-tick work; the phases live beside it: `intake`
//! (feeding tasks, pauses), `commit`, `rebalance` (revoke, lose, assign) and
//! `startup` (restore on helper threads, activation).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use rdkafka::consumer::{
    base_consumer::PartitionQueue, BaseConsumer, Consumer, ConsumerContext, Rebalance,
    RebalanceProtocol,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, OwnedMessage};
use rdkafka::producer::Producer;
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};
use sluice_state::{RocksEnv, TaskState};

use super::admin::{self, DeadLetterPartitions};
use super::clock::now_ms;
use super::config::{GroupProtocol, StreamsConfig};
use super::error::RuntimeError;
use super::failpoint;
use super::fetched::{FetchQueue, Fetched};
use super::kafka::{
    client_config, create_producer, owned_headers, DeliveryState, TrackedProducer,
    FETCH_QUEUE_BACKOFF_MS,
};
use super::local_tasks::LocalTasks;
use super::metrics::EngineMetrics;
use super::status::{AppState, AppStatus, IntakeControl};
use crate::context::CompletionMsg;
use crate::offsets::StartAt;
use crate::task::TaskCore;
use crate::{Guarantee, TaskId, Topology, TopologyError};

mod commit;
mod intake;
mod rebalance;
mod startup;

/// How long a transaction's steps are retried when they fail in a way Kafka
/// calls retriable.
const TXN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one transactional request (offsets, commit) waits before it is
/// retried.
const TXN_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// librdkafka's prefetch per input partition (overridable by client properties).
const PREFETCH_KBYTES_PER_PARTITION: &str = "16384";
/// How long the broker may hold a fetch of the group consumer that finds no
/// new record (`consumer_overrides` win). librdkafka keeps one fetch
/// in flight per broker, and leaves out of it a partition whose prefetch is
/// full; when the partitions it does ask for are all at their end, the broker
/// holds the fetch for this long, and a backlogged partition that emptied
/// its prefetch meanwhile waits for it to come back. At librdkafka's default
/// (500 ms) an exactly-once task whose prefetch filled while it committed
/// stood idle for up to half a second behind the other, caught-up
/// partitions. Held 50 ms, an idle instance costs the broker a little more
/// (a fetch every 50 ms instead of every 500).
const FETCH_WAIT_MAX_MS: &str = "50";
const FLUSH_TIMEOUT: Duration = Duration::from_secs(60);
/// Completions handed over at once from which tasks take theirs side by side
/// (below it, starting threads costs more than it saves).
const PARALLEL_COMPLETIONS: usize = 256;

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

    /// Abandons the task's in-flight calls (see [`TaskCore::abandon`]),
    /// counting them in `sluice_calls_abandoned_total`.
    fn abandon(&mut self, metrics: &EngineMetrics) {
        let n = self.core.abandon();
        metrics.calls_abandoned.inc_by(n as u64);
    }

    /// Whether a new record of `slot` may be processed now: nothing older waits
    /// in its backlog and its in-flight records are under `max`.
    fn has_room(&self, slot: usize, max: usize) -> bool {
        self.backlog[slot].is_empty() && self.core.has_room(slot, max)
    }

    /// True when the task's write cache holds `max` dirty entries or more
    /// (a commit is due), or it asked for a commit.
    fn cache_full(&self, max: usize) -> bool {
        self.core.ctx.commit_requested
            || self
                .core
                .ctx
                .state
                .as_ref()
                .is_some_and(|s| s.dirty_len() >= max)
    }

    /// Hands async completions to the task, in order, then sends (or, under
    /// exactly-once, holds) what they produced.
    fn complete(
        &mut self,
        msgs: impl IntoIterator<Item = CompletionMsg>,
        metrics: &EngineMetrics,
        eos: bool,
    ) -> Result<(), RuntimeError> {
        for msg in msgs {
            self.core
                .complete(msg)
                .map_err(|error| RuntimeError::Process {
                    task: self.core.id,
                    error,
                })?;
        }
        self.send_outputs(metrics, eos)
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
            self.process_record(msg, metrics, eos)
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
            while self.core.has_room(slot, max) {
                let Some(msg) = self.backlog[slot].pop_front() else {
                    break;
                };
                self.process_record(&msg, metrics, eos)?;
                self.core.drain_done();
            }
        }
        Ok(())
    }
}

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
                    Err(RuntimeError::Panicked("task thread".into())),
                )),
            }
        }
        results
    });
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// A partition's own fetch queue: rdkafka's handle, which took it out of
/// the consumer's queue and wakes the driver when records arrive, and a
/// second one its records are taken from in batches.
struct SplitQueue {
    /// Held for what it does while it lives: the queue stays out of the
    /// consumer's, and its callback wakes the driver.
    _split: PartitionQueue<DriverContext>,
    fetch: FetchQueue<DriverContext>,
    /// The engine's `drains` when the queue was split: it is read only once the
    /// consumer's queue ran empty after that, when no record of the partition
    /// can be left there.
    split_at: u64,
}

/// The split queues of one task, by input slot.
type TaskQueues<'a> = Vec<(usize, &'a FetchQueue<DriverContext>)>;

/// A message that can be kept past the poll that returned it.
trait DetachOwned {
    fn detach_owned(&self) -> OwnedMessage;
}

impl DetachOwned for BorrowedMessage<'_> {
    fn detach_owned(&self) -> OwnedMessage {
        self.detach()
    }
}

impl DetachOwned for (&str, i32, &Fetched) {
    fn detach_owned(&self) -> OwnedMessage {
        let (topic, partition, fetched) = *self;
        OwnedMessage::new(
            fetched.payload().map(<[u8]>::to_vec),
            fetched.key().map(<[u8]>::to_vec),
            topic.to_string(),
            fetched.timestamp(),
            partition,
            fetched.offset(),
            owned_headers(&fetched.headers()),
        )
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

/// A task being restored on a helper thread, or waiting for the rest of its
/// input partitions before it restores. Its records wait in its split
/// queues; those that reached the consumer's queue before the split (or all of
/// them, for a partition whose queue could not be split) are buffered here, and
/// such a partition is paused once the buffer holds the in-flight bound.
struct PendingTask {
    /// The restore thread; `None` while the task waits.
    handle: Option<JoinHandle<Result<Restored, RuntimeError>>>,
    cancel: Arc<AtomicBool>,
    buffered: Vec<OwnedMessage>,
    partitions: Vec<Tp>,
    /// Where reading each input topic starts.
    starts: HashMap<String, StartAt>,
    /// Some of its input partitions are not here: it neither restores nor
    /// runs until they are (see `Engine::start_restore`).
    waiting: bool,
}

/// Everything the driver and the rebalance callbacks share.
struct Engine {
    topology: Arc<Topology>,
    cfg: Arc<StreamsConfig>,
    metrics: EngineMetrics,
    dlq_partitions: DeadLetterPartitions,
    env: RocksEnv,
    runtime: tokio::runtime::Handle,
    completions_tx: Sender<CompletionMsg>,
    completions_rx: Receiver<CompletionMsg>,
    /// The at-least-once producer every task shares (`None` under
    /// exactly-once: a transactional producer per task).
    shared_producer: Option<(Arc<TrackedProducer>, Arc<DeliveryState>)>,
    tasks: Tasks,
    round: CommitRound,
    intake: Intake,
    last_punctuate: Instant,
    /// When consumed repartition records were last deleted, and the admin
    /// client that does it (made on first use).
    last_purge: Instant,
    admin: Option<rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>>,
    status: Arc<AppStatus>,
    /// This instance's tasks and their state readers, for interactive queries.
    local: Arc<LocalTasks>,
    /// The first assignment arrived.
    joined: bool,
    /// A task was fenced: leave and rejoin the group after this tick.
    rejoin: bool,
    fatal: Option<RuntimeError>,
}

/// The tasks of this instance, by what they are doing.
struct Tasks {
    /// The sub-topology that reads each source topic.
    topic_sub: HashMap<String, usize>,
    /// Tasks processing.
    active: BTreeMap<TaskId, ActiveTask>,
    /// Tasks suspended between a revocation and the assignment that follows
    /// (eager protocol).
    suspended: BTreeMap<TaskId, ActiveTask>,
    /// Tasks restoring, or waiting for the rest of their input partitions.
    pending: BTreeMap<TaskId, PendingTask>,
}

impl Tasks {
    fn new(topic_sub: HashMap<String, usize>) -> Self {
        Tasks {
            topic_sub,
            active: BTreeMap::new(),
            suspended: BTreeMap::new(),
            pending: BTreeMap::new(),
        }
    }

    /// The task that reads `partition` of `topic`, if the topology reads it.
    fn task_of(&self, topic: &str, partition: i32) -> Option<TaskId> {
        self.topic_sub.get(topic).map(|&sub| TaskId {
            subtopology: sub as u32,
            partition,
        })
    }

    /// The listed tasks, active or suspended.
    fn listed_mut(&mut self, ids: &[TaskId]) -> Vec<&mut ActiveTask> {
        self.active
            .iter_mut()
            .chain(self.suspended.iter_mut())
            .filter(|(id, _)| ids.contains(id))
            .map(|(_, t)| t)
            .collect()
    }
}

/// The periodic commits: when the last one ended, and the round in
/// progress (see [`Engine::commit_periodically`]).
struct CommitRound {
    /// When the last commit of every task (or round) ended.
    last_commit: Instant,
    /// The exactly-once commit running on its own thread, if any.
    committing: Option<InFlightCommit>,
    /// Tasks still to commit in the current round.
    tasks: Vec<TaskId>,
    /// When the current round began.
    started: Option<Instant>,
    /// The current round is an early one: only the tasks holding outputs,
    /// at once (see [`Engine::outputs_wait_while_idle`]).
    early: bool,
    /// When the last round (early or not) ended.
    last_end: Instant,
}

impl CommitRound {
    fn new() -> Self {
        CommitRound {
            last_commit: Instant::now(),
            committing: None,
            tasks: Vec::new(),
            started: None,
            early: false,
            last_end: Instant::now(),
        }
    }

    /// The commit on the commit thread, if it holds task `id`.
    fn committing_for(&mut self, id: TaskId) -> Option<&mut InFlightCommit> {
        self.committing.as_mut().filter(|c| c.ids.contains(&id))
    }
}

/// An exactly-once commit running on its own thread (see
/// [`Engine::commit_periodically`]). Its tasks are the thread's until it
/// ends: their split queues are not read meanwhile, and their completions and
/// records that reached the consumer's queue wait here, in arrival order.
struct InFlightCommit {
    ids: Vec<TaskId>,
    handle: JoinHandle<CommitThreadEnd>,
    completions: Vec<CompletionMsg>,
    records: Vec<OwnedMessage>,
}

/// A task and how its commit ended.
type TaskOutcome = (TaskId, Result<(), RuntimeError>);

/// What a commit thread hands back: its tasks, and how their commits ended.
type CommitThreadEnd = (Vec<ActiveTask>, Result<Vec<TaskOutcome>, RuntimeError>);

/// How records reach the tasks: the partitions' own fetch queues, and what
/// holds records back (the application's holds, pauses).
struct Intake {
    /// The application's holds: while one is active every partition is
    /// paused.
    control: IntakeControl,
    /// Signalled when the consumer's queue or a partition queue becomes non-empty.
    wake_tx: Sender<()>,
    /// Partitions paused in the consumer. Each stays listed until resumed:
    /// by `update_pauses`, or at its revocation (librdkafka would keep the
    /// pause across a later assignment of the same partition).
    paused: HashSet<Tp>,
    /// The fetch queue of each assigned input partition, split from the
    /// consumer's queue (see [`Engine::attach_queues`]).
    queues: HashMap<Tp, SplitQueue>,
    /// How many times a poll found the consumer's queue empty.
    drains: u64,
    /// Partitions whose queue could not be split; they are fed by the consumer's
    /// queue and paused for backpressure.
    unsplit: HashSet<Tp>,
}

impl Intake {
    fn new(control: IntakeControl, wake_tx: Sender<()>) -> Self {
        Intake {
            control,
            wake_tx,
            paused: HashSet::new(),
            queues: HashMap::new(),
            drains: 0,
            unsplit: HashSet::new(),
        }
    }
}

/// The consumer context: rebalance callbacks run the engine's revoke/assign.
pub(crate) struct DriverContext {
    engine: Arc<Mutex<Engine>>,
    metrics: EngineMetrics,
    /// Where a partition without a committed offset starts (`auto.offset.reset`);
    /// `None` leaves it to librdkafka.
    reset: Option<Offset>,
    /// Whether the current rebalance is incremental (only the partitions that
    /// move are revoked or assigned), as librdkafka reports it.
    incremental: AtomicBool,
}

impl ClientContext for DriverContext {
    fn stats(&self, stats: Statistics) {
        // The partitions this consumer was assigned (librdkafka's "desired");
        // -1 is the internal unassigned partition.
        self.metrics
            .set_lag(stats.topics.iter().flat_map(|(name, topic)| {
                topic
                    .partitions
                    .values()
                    .filter(|p| p.partition >= 0 && p.desired)
                    .map(move |p| (name.as_str(), p.partition, p.consumer_lag))
            }));
    }
}

impl ConsumerContext for DriverContext {
    /// As rdkafka's own, with start positions set on assignment
    /// ([`DriverContext::set_start_positions`]).
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
        self.incremental.store(cooperative, Ordering::Relaxed);
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let resume = self.engine.lock().resume_positions(tpl);
                Self::set_start_positions(consumer, tpl, self.reset, &resume);
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
            let incremental = self.incremental.load(Ordering::Relaxed);
            let mut engine = self.engine.lock();
            if let Err(e) = engine.on_revoke(consumer, tpl, incremental, self.reset) {
                engine.fail(e);
            }
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let incremental = self.incremental.load(Ordering::Relaxed);
                let mut engine = self.engine.lock();
                if let Err(e) = engine.on_assign(consumer, tpl, incremental) {
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

/// The group settings of the main consumer for the configured protocol. The
/// consumer protocol takes neither the session timeout nor the heartbeat
/// interval (the broker's group config decides them) nor an assignment
/// strategy (the broker assigns).
fn set_group_protocol(c: &mut rdkafka::ClientConfig, cfg: &StreamsConfig) {
    match cfg.group_protocol {
        GroupProtocol::Consumer => {
            c.set("group.protocol", "consumer")
                .set("group.remote.assignor", "range");
        }
        GroupProtocol::Classic => {
            let session_ms = cfg.session_timeout.as_millis();
            c.set("group.protocol", "classic")
                .set("partition.assignment.strategy", "range")
                .set("session.timeout.ms", session_ms.to_string())
                .set(
                    "heartbeat.interval.ms",
                    (session_ms / 3).max(100).to_string(),
                );
        }
    }
    if let Some(id) = &cfg.group_instance_id {
        c.set("group.instance.id", id);
    }
}

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

impl Driver {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        topology: Arc<Topology>,
        cfg: Arc<StreamsConfig>,
        metrics: EngineMetrics,
        dlq_partitions: DeadLetterPartitions,
        runtime: tokio::runtime::Handle,
        status: Arc<AppStatus>,
        intake: IntakeControl,
        local: Arc<LocalTasks>,
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
            shared_producer,
            tasks: Tasks::new(topic_sub),
            round: CommitRound::new(),
            intake: Intake::new(intake, wake_tx.clone()),
            last_punctuate: Instant::now(),
            last_purge: Instant::now(),
            admin: None,
            status,
            local,
            joined: false,
            rejoin: false,
            fatal: None,
        }));

        let mut c = client_config(&cfg);
        c.set("group.id", &app)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set(
                "max.poll.interval.ms",
                cfg.max_poll_interval.as_millis().to_string(),
            )
            .set("statistics.interval.ms", "5000")
            // Split partition queues apply the prefetch bound per partition.
            .set("queued.max.messages.kbytes", PREFETCH_KBYTES_PER_PARTITION)
            .set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS)
            .set("fetch.wait.max.ms", FETCH_WAIT_MAX_MS)
            .set(
                "isolation.level",
                match cfg.guarantee {
                    Guarantee::ExactlyOnce => "read_committed",
                    Guarantee::AtLeastOnce => "read_uncommitted",
                },
            );
        set_group_protocol(&mut c, &cfg);
        for (k, v) in &cfg.consumer_overrides {
            c.set(k, v);
        }
        let reset = reset_offset(c.get("auto.offset.reset"));
        let mut consumer: DriverConsumer = c.create_with_context(DriverContext {
            engine: engine.clone(),
            metrics,
            reset,
            incremental: AtomicBool::new(false),
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
        // The tests' `late_internal_topics` point: the internal topics are
        // subscribed to only once the first assignment is here, so their
        // partitions come in an assignment of their own, as from a broker
        // whose assignor learnt of them late.
        let mut late = None;
        if failpoint::switched_on("late_internal_topics") {
            let internal = self.internal_topics();
            let external: Vec<&str> = topics
                .iter()
                .copied()
                .filter(|t| !internal.contains(*t))
                .collect();
            self.consumer.subscribe(&external)?;
            late = Some(topics);
        } else {
            self.consumer.subscribe(&topics)?;
        }
        let result = self.main_loop(stop, late);
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

    /// The internal topics the topology reads.
    fn internal_topics(&self) -> HashSet<String> {
        let engine = self.engine.lock();
        let app = &engine.cfg.application_id;
        let read = engine
            .topology
            .subtopologies()
            .iter()
            .flat_map(|st| &st.sources);
        read.flat_map(|s| &s.topics)
            .filter(|t| matches!(t, crate::topology::SourceTopic::Internal { .. }))
            .map(|t| t.resolve(app))
            .collect()
    }

    /// Waits for work — a record or event in the consumer's queue, a record in a
    /// partition queue, a completed async call — or the next tick, then takes
    /// what is there without blocking: records reaching a partition queue
    /// could not end a blocking poll of the consumer's queue.
    fn main_loop(
        &self,
        stop: &AtomicBool,
        mut late: Option<Vec<&str>>,
    ) -> Result<(), RuntimeError> {
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
                engine.intake.drains += 1;
            }
            engine.tick(&self.consumer)?;
            if let Some(all) = late
                .take_if(|_| !engine.tasks.active.is_empty() || !engine.tasks.pending.is_empty())
            {
                self.consumer.subscribe(&all)?;
            }
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
    millis_of(msg.timestamp())
}

/// A record's timestamp in ms, the wall clock for a record without one.
fn millis_of(timestamp: rdkafka::Timestamp) -> i64 {
    timestamp
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

    fn on_message(&mut self, msg: &BorrowedMessage<'_>) -> Result<(), RuntimeError> {
        let Some(id) = self.tasks.task_of(msg.topic(), msg.partition()) else {
            return Ok(());
        };
        if let Some(p) = self.tasks.pending.get_mut(&id) {
            p.buffered.push(msg.detach());
            return Ok(());
        }
        if let Some(c) = self.round.committing_for(id) {
            c.records.push(msg.detach());
            return Ok(());
        }
        let eos = self.eos();
        let max = self.cfg.max_in_flight_per_partition;
        let Some(task) = self.tasks.active.get_mut(&id) else {
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
            for task in self.tasks.active.values_mut() {
                task.core
                    .punctuate(now)
                    .map_err(|error| RuntimeError::Process {
                        task: task.core.id,
                        error,
                    })?;
                task.send_outputs(&metrics, eos)?;
            }
        }
        let cache_max = self.cfg.cache_max_entries;
        let cache_full = self.tasks.active.values().any(|t| t.cache_full(cache_max));
        let due = cache_full || self.round.last_commit.elapsed() >= self.cfg.commit_interval();
        self.commit_periodically(consumer, due)?;
        if self.last_purge.elapsed() >= self.cfg.repartition_purge_interval {
            self.last_purge = Instant::now();
            self.purge_repartition_topics();
        }
        self.update_pauses(consumer)?;
        for task in self
            .tasks
            .active
            .values_mut()
            .chain(self.tasks.suspended.values_mut())
        {
            task.count_in(&self.metrics);
        }
        self.update_metrics();
        Ok(())
    }

    /// Under exactly-once a task's outputs are readable only once its
    /// transaction commits. When some are held and no fetched record waits
    /// to be processed (the instance keeps up), the tasks holding them
    /// commit now, together, in an early round, rather than at the interval,
    /// a quarter of the interval after the last round at the soonest: at
    /// light load a result waits for a commit, not for up to an interval
    /// more (an LLM result's caller is waiting for it). Early rounds leave
    /// the interval's rounds as they were; under load the interval paces
    /// the commits.
    pub(super) fn outputs_wait_while_idle(&self) -> bool {
        self.eos()
            && self.round.last_end.elapsed() >= self.cfg.commit_interval() / 4
            && self
                .tasks
                .active
                .values()
                .any(|t| !t.core.ctx.out.is_empty())
            && self
                .tasks
                .active
                .values()
                .all(|t| t.backlog.iter().all(VecDeque::is_empty))
    }

    /// Hands the async completions that arrived to their tasks: in arrival
    /// order per task, tasks side by side when there are many.
    fn handle_completions(&mut self) -> Result<(), RuntimeError> {
        let msgs: Vec<CompletionMsg> = self.completions_rx.try_iter().collect();
        let threads = self.cfg.processing_threads;
        if msgs.len() < PARALLEL_COMPLETIONS || threads <= 1 {
            for msg in msgs {
                self.complete(msg)?;
            }
            return Ok(());
        }
        let mut by_task: HashMap<TaskId, Vec<CompletionMsg>> = HashMap::new();
        for msg in msgs {
            by_task.entry(msg.task).or_default().push(msg);
        }
        let (metrics, eos) = (self.metrics.clone(), self.eos());
        let work: Vec<(&mut ActiveTask, Vec<CompletionMsg>)> = self
            .tasks
            .active
            .iter_mut()
            .filter_map(|(id, t)| by_task.remove(id).map(|m| (t, m)))
            .collect();
        in_parallel(work, threads, |(task, msgs)| {
            task.complete(msgs, &metrics, eos)
        })?;
        for msgs in by_task.into_values() {
            for msg in msgs {
                self.complete(msg)?;
            }
        }
        Ok(())
    }

    /// Hands an async completion to its task (if the task is still here;
    /// held while its task commits on the commit thread).
    fn complete(&mut self, msg: CompletionMsg) -> Result<(), RuntimeError> {
        let eos = self.eos();
        if let Some(task) = self.tasks.active.get_mut(&msg.task) {
            return task.complete([msg], &self.metrics, eos);
        }
        if let Some(c) = self.round.committing_for(msg.task) {
            c.completions.push(msg);
        }
        Ok(())
    }

    /// Forwards cached results of tasks (before a commit).
    fn flush_tasks(&mut self, ids: &[TaskId]) -> Result<(), RuntimeError> {
        let (metrics, eos) = (self.metrics.clone(), self.eos());
        let threads = self.cfg.processing_threads;
        let tasks: Vec<&mut ActiveTask> = self
            .tasks
            .active
            .iter_mut()
            .filter(|(id, _)| ids.contains(id))
            .map(|(_, t)| t)
            .collect();
        in_parallel(tasks, threads, |task| task.flush(&metrics, eos))?;
        Ok(())
    }

    /// Deletes what this instance's tasks consumed and committed of their
    /// repartition topics (they keep records until then, see `admin`).
    fn purge_repartition_topics(&mut self) {
        let mut tpl = TopicPartitionList::new();
        for task in self.tasks.active.values() {
            for (slot, tracker) in task.core.slots.iter().zip(&task.core.trackers) {
                if let (true, Some(o)) = (slot.internal, tracker.last_committed()) {
                    let _ =
                        tpl.add_partition_offset(&slot.topic, slot.partition, Offset::Offset(o));
                }
            }
        }
        if tpl.count() == 0 {
            return;
        }
        if self.admin.is_none() {
            match client_config(&self.cfg).create() {
                Ok(a) => self.admin = Some(a),
                Err(e) => {
                    tracing::debug!(error = %e, "no admin client to purge repartition topics");
                    return;
                }
            }
        }
        if let Some(client) = &self.admin {
            admin::purge(client, &tpl);
        }
    }

    /// The tasks this instance runs (those on the commit thread included).
    fn running(&self) -> impl Iterator<Item = TaskId> + '_ {
        let committing = self.round.committing.iter().flat_map(|c| c.ids.iter());
        self.tasks.active.keys().chain(committing).copied()
    }

    /// Publishes the tasks this instance runs, and those assigned to it
    /// (running or restoring) with a state reader of each running one.
    fn publish_tasks(&self) {
        self.status.set_tasks(self.running());
        let running: BTreeSet<TaskId> = self.running().collect();
        let assigned = running
            .iter()
            .chain(self.tasks.pending.keys())
            .copied()
            .collect();
        self.local.publish(running, assigned, |id| {
            self.tasks
                .active
                .get(&id)
                .and_then(|t| t.core.ctx.state.as_ref())
                .map(TaskState::reader)
        });
    }

    fn update_metrics(&self) {
        let in_flight: usize = self.tasks.active.values().map(|t| t.core.in_flight()).sum();
        self.metrics.in_flight.set(in_flight as i64);
        self.metrics.paused.set(self.intake.paused.len() as i64);
        self.metrics
            .tasks
            .with_label_values(&["running"])
            .set(self.running().count() as i64);
        let waiting = self.tasks.pending.values().filter(|p| p.waiting).count();
        self.metrics
            .tasks
            .with_label_values(&["restoring"])
            .set((self.tasks.pending.len() - waiting) as i64);
        self.metrics
            .tasks
            .with_label_values(&["waiting"])
            .set(waiting as i64);
        // A task waiting for partitions another instance holds does not
        // hold this one's readiness back: that instance may be waiting for
        // this one to be ready before it stops (a rolling update).
        let state = if !self.joined {
            AppState::Starting
        } else if self.tasks.pending.len() == waiting {
            AppState::Running
        } else {
            AppState::Restoring
        };
        if self.fatal.is_none() {
            self.status.set(state);
        }
    }

    /// Closes every task: with `commit`, drains and commits first.
    fn close_all(&mut self, consumer: &DriverConsumer, commit: bool) -> Result<(), RuntimeError> {
        if let Err(e) = self.collect_commit(consumer, true) {
            if commit {
                return Err(e);
            }
            tracing::debug!(error = %e, "commit ended with an error while closing");
        }
        // The queues hold the consumer; the engine must not.
        self.intake.queues.clear();
        for (_, mut p) in std::mem::take(&mut self.tasks.pending) {
            p.cancel.store(true, Ordering::SeqCst);
            if let Some(h) = p.handle.take() {
                let _ = h.join();
            }
        }
        let ids: Vec<TaskId> = self.tasks.active.keys().copied().collect();
        if commit && !ids.is_empty() {
            self.drain(&ids)?;
            self.commit_all(consumer)?;
        }
        for (_, mut t) in std::mem::take(&mut self.tasks.active) {
            t.count_in(&self.metrics);
            t.abandon(&self.metrics);
            if t.txn_open {
                let _ = t.producer.abort_transaction(TXN_TIMEOUT);
                self.metrics.aborted.inc();
            }
        }
        self.tasks.suspended.clear();
        self.publish_tasks();
        Ok(())
    }
}

/// Runs `f` until it succeeds, fails in a way Kafka does not call
/// retriable, or `deadline` passes (then its last error is returned). What is
/// retried is logged with `what`.
fn retrying<T>(
    what: &str,
    deadline: Instant,
    mut f: impl FnMut() -> Result<T, RuntimeError>,
) -> Result<T, RuntimeError> {
    let mut backoff = Duration::from_millis(50);
    loop {
        match f() {
            Err(e) if e.retriable() && Instant::now() + backoff < deadline => {
                tracing::warn!(error = %e, "{what} failed; retrying in {backoff:?}");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            other => return other,
        }
    }
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
                Err(RuntimeError::Process {
                    task: TaskId {
                        subtopology: 0,
                        partition: 0,
                    },
                    error: crate::ProcessError::Fatal(format!("item {i} failed")),
                })
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
