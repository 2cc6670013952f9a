//! The per-task context every operator runs in: the task's stores, its pending
//! outputs, the record being processed, stream time, and the spawner for async
//! operator calls.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use std::sync::atomic::AtomicBool;

use crossbeam_channel::Sender;
use futures::FutureExt;
use rustc_hash::FxHashMap;
use sluice_state::{Position, StoreId, TaskState};

use crate::derived::{DerivedTracker, Encoder, Resumable};
use crate::node::{Data, Forward};
use crate::offsets::{Done, Origin, RecordToken};
use crate::record::{OutputRecord, Record};
use crate::ProcessError;

/// An async operator call finished; sent from the tokio runtime back to the
/// thread that owns the task.
pub(crate) struct CompletionMsg {
    pub(crate) task: TaskId,
    pub(crate) node: usize,
    /// The spawner that started the call (see [`Spawner::finish`]).
    pub(crate) spawner: u64,
    pub(crate) call: u64,
    pub(crate) output: Box<dyn Any + Send>,
}

/// The output of an async call whose future panicked, with the panic's message.
pub(crate) struct CallPanicked(pub(crate) String);

fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// One async call: the operator's future, its panic caught, ending in the
/// message that reports its completion.
type Call = std::pin::Pin<Box<dyn Future<Output = CompletionMsg> + Send>>;

/// The tokio task that runs a task's async calls: the calls come in over a
/// channel and are polled side by side (a `FuturesUnordered`), each
/// completion going straight to the task's thread. One tokio task per stream
/// task, not per call: starting a call costs the driver a channel send, not a
/// spawn onto the runtime's shared queues, and cancelling them all is one
/// abort.
struct CallPool {
    calls: tokio::sync::mpsc::UnboundedSender<Call>,
    abort: tokio::task::AbortHandle,
}

impl CallPool {
    fn start(handle: &tokio::runtime::Handle, done: Sender<CompletionMsg>) -> Self {
        let (calls, mut incoming) = tokio::sync::mpsc::unbounded_channel::<Call>();
        let join = handle.spawn(async move {
            let mut running = futures::stream::FuturesUnordered::new();
            std::future::poll_fn(|cx| {
                use futures::StreamExt;
                use std::task::Poll;
                // Every call that came in joins the running ones; the channel
                // closes when the task's spawner is dropped.
                let closed = loop {
                    match incoming.poll_recv(cx) {
                        Poll::Ready(Some(call)) => running.push(call),
                        Poll::Ready(None) => break true,
                        Poll::Pending => break false,
                    }
                };
                loop {
                    match running.poll_next_unpin(cx) {
                        Poll::Ready(Some(msg)) => {
                            let _ = done.send(msg);
                        }
                        // Nothing running: done once no call can come,
                        // otherwise the channel wakes the pool.
                        Poll::Ready(None) if closed => return Poll::Ready(()),
                        Poll::Ready(None) | Poll::Pending => return Poll::Pending,
                    }
                }
            })
            .await
        });
        CallPool {
            calls,
            abort: join.abort_handle(),
        }
    }
}

/// The next spawner's [`Spawner::id`].
static NEXT_SPAWNER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Spawns async operator calls on the tokio runtime and keeps the records they
/// carry in flight until their completion has been handled.
pub(crate) struct Spawner {
    handle: tokio::runtime::Handle,
    tx: Sender<CompletionMsg>,
    task: TaskId,
    /// Unique in the process: a completion of an abandoned incarnation of
    /// the task (sent before its abort took effect) is never taken for a
    /// call of the next one, whose calls are numbered from 0 again.
    id: u64,
    next_call: u64,
    /// The records each call not yet handled carries, by call.
    pending: FxHashMap<u64, Vec<Arc<RecordToken>>>,
    /// Started with the task's first call.
    pool: Option<CallPool>,
}

impl Spawner {
    pub(crate) fn new(
        handle: tokio::runtime::Handle,
        tx: Sender<CompletionMsg>,
        task: TaskId,
    ) -> Self {
        Spawner {
            handle,
            tx,
            task,
            id: NEXT_SPAWNER.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            next_call: 0,
            pending: FxHashMap::default(),
            pool: None,
        }
    }

    pub(crate) fn spawn<O: Send + 'static>(
        &mut self,
        node: usize,
        tokens: Vec<Arc<RecordToken>>,
        fut: impl Future<Output = O> + Send + 'static,
    ) {
        let call = self.next_call;
        self.next_call += 1;
        let (task, spawner) = (self.task, self.id);
        let run: Call = Box::pin(async move {
            // A future that panics still completes its call: its records are
            // dead-lettered, never left in flight (commits would stop) nor
            // counted as handled.
            let output: Box<dyn Any + Send> =
                match std::panic::AssertUnwindSafe(fut).catch_unwind().await {
                    Ok(output) => Box::new(output),
                    Err(panic) => Box::new(CallPanicked(panic_message(panic.as_ref()))),
                };
            CompletionMsg {
                task,
                node,
                spawner,
                call,
                output,
            }
        });
        let (handle, tx) = (&self.handle, &self.tx);
        let pool = self
            .pool
            .get_or_insert_with(|| CallPool::start(handle, tx.clone()));
        // An aborted pool is taken out of the spawner (`abort_all`), so this
        // one has ended only if the runtime shut down, when no call runs
        // anyway: the call's records stay in flight, as they would for a
        // call spawned then.
        let _ = pool.calls.send(run);
        self.pending.insert(call, tokens);
    }

    /// Takes the records a finished call carried; `None` for a call this
    /// spawner did not start or no longer waits for (aborted).
    pub(crate) fn finish(&mut self, msg: &CompletionMsg) -> Option<Vec<Arc<RecordToken>>> {
        if msg.spawner != self.id {
            return None;
        }
        self.pending.remove(&msg.call)
    }

    /// Calls not yet completed.
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Cancels every pending call; their records stay unfinished (their
    /// tokens are dropped without being reported by the closed task).
    pub(crate) fn abort_all(&mut self) -> usize {
        let n = self.pending.len();
        self.pending.clear();
        if let Some(pool) = self.pool.take() {
            pool.abort.abort();
        }
        n
    }

    pub(crate) fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

/// librdkafka's default `message.max.bytes`.
pub(crate) const DEFAULT_MAX_RECORD_BYTES: usize = 1_000_000;

/// A record's size as the producer counts it against `message.max.bytes`:
/// key, value and headers (with a few bytes of framing per header).
pub(crate) fn record_size(rec: &OutputRecord) -> usize {
    rec.key.as_ref().map_or(0, Vec::len)
        + rec.value.as_ref().map_or(0, Vec::len)
        + rec
            .headers
            .iter()
            .map(|(k, v)| k.len() + v.len() + 8)
            .sum::<usize>()
}

/// Identifies a task: sub-topology and partition number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId {
    /// The sub-topology.
    pub subtopology: u32,
    /// The partition number of its input topics.
    pub partition: i32,
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}_{}", self.subtopology, self.partition)
    }
}

/// Queues a dead letter an operator asked for; an error of its own when
/// that cannot be done (it names the record).
pub(crate) fn handle(
    ctx: &mut TaskCtx,
    result: Result<(), ProcessError>,
) -> Result<(), ProcessError> {
    match result {
        Err(ProcessError::DeadLetter { reason, category }) => {
            ctx.dead_letter(&reason, &category, 1).map_err(|e| {
                ProcessError::Fatal(format!(
                    "{} must be dead-lettered ({reason}) but: {e}",
                    ctx.describe_current()
                ))
            })
        }
        other => other,
    }
}

/// Engine counters a task accumulates; the runtime moves them into metrics.
#[derive(Debug, Default, Clone)]
pub struct TaskCounters {
    /// Records dropped because they arrived after their window's grace period.
    pub late_dropped: u64,
    /// Records skipped because the commit the task restarted from covers them.
    pub replay_skipped: u64,
    /// Records sent to a dead-letter topic, by category.
    pub dead_lettered: HashMap<String, u64>,
}

/// The context of one task, passed to every operator of the task.
pub struct TaskCtx {
    pub(crate) task: TaskId,
    pub(crate) state: Option<TaskState>,
    pub(crate) stores: FxHashMap<String, StoreId>,
    pub(crate) out: Vec<OutputRecord>,
    pub(crate) current: Option<Arc<RecordToken>>,
    pub(crate) stream_time: i64,
    /// The stream time windows close and expire by (see
    /// `TaskCore::update_closing_time`): at most `stream_time`.
    pub(crate) closing_time: i64,
    pub(crate) wall_clock_ms: i64,
    pub(crate) spawner: Spawner,
    pub(crate) counters: TaskCounters,
    pub(crate) commit_requested: bool,
    /// Input topic → its dead-letter topic.
    pub(crate) dead_letter_topics: HashMap<String, Option<String>>,
    /// Partition counts of every dead-letter topic of the topology (a record
    /// past a repartition goes to its origin's).
    pub(crate) dead_letter_partitions: HashMap<String, i32>,
    /// Where dead letters of derived records go: the first input topic of
    /// the task with a dead-letter topic, and that topic.
    pub(crate) derived_dead_letter: Option<(String, String)>,
    /// Next offset after this task's committed outputs, per topic partition.
    pub(crate) output_ends: HashMap<(String, i32), i64>,
    /// Records operators derived, in flight or to store (see `crate::derived`).
    pub(crate) derived: DerivedTracker,
    /// Where finished records are reported (to the task).
    pub(crate) done: Sender<Done>,
    /// The largest record the producers send (their `message.max.bytes`).
    pub(crate) max_record_bytes: usize,
    /// Set when the task abandons its work (see `TaskCore::abandon`).
    pub(crate) abandoned: Arc<AtomicBool>,
}

impl TaskCtx {
    pub(crate) fn new(
        task: TaskId,
        state: Option<TaskState>,
        spawner: Spawner,
        done: Sender<Done>,
    ) -> Self {
        let stores = state
            .as_ref()
            .map(|s| {
                s.specs()
                    .enumerate()
                    .map(|(i, spec)| (spec.name.clone(), StoreId(i)))
                    .collect()
            })
            .unwrap_or_default();
        TaskCtx {
            task,
            state,
            stores,
            out: Vec::new(),
            current: None,
            stream_time: i64::MIN,
            closing_time: i64::MIN,
            wall_clock_ms: 0,
            spawner,
            counters: TaskCounters::default(),
            commit_requested: false,
            dead_letter_topics: HashMap::new(),
            dead_letter_partitions: HashMap::new(),
            derived_dead_letter: None,
            output_ends: HashMap::new(),
            derived: DerivedTracker::default(),
            done,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            abandoned: Default::default(),
        }
    }

    /// Queues an output record. One the producers could never send (over
    /// their `message.max.bytes`: they refuse it before it leaves, and under
    /// exactly-once the transaction could only abort, again after every
    /// restart) is not queued: the error returned dead-letters the current
    /// record instead (`too_large`).
    pub(crate) fn queue_output(&mut self, rec: OutputRecord) -> Result<(), ProcessError> {
        let size = record_size(&rec);
        if size > self.max_record_bytes {
            return Err(ProcessError::dead_letter(
                format!(
                    "an output of {size} bytes to {} is over the producers' message.max.bytes ({})",
                    rec.topic, self.max_record_bytes
                ),
                "too_large",
            ));
        }
        self.mark_effect();
        self.out.push(rec);
        Ok(())
    }

    /// Notes an effect of the current record (see `crate::derived`).
    pub(crate) fn mark_effect(&self) {
        if let Some(t) = &self.current {
            t.mark_effect();
        }
    }

    /// The current record, for a plain `spawn` or `hold` to carry (no hold
    /// token of its own: the record is replayed whole after a crash, see
    /// `crate::derived`). A resumable hold carried on this way can no
    /// longer be converted: its record is taken up by a processor that
    /// cannot resume it.
    pub(crate) fn carry_current(&mut self) -> Option<Arc<RecordToken>> {
        let current = self.current.clone()?;
        if let Origin::Held { id, .. } = &current.origin {
            self.derived.carried_on(*id);
        }
        Some(current)
    }

    /// A resumable hold of the current record by `processor` (see
    /// `crate::derived`): a token linked to the current record's root,
    /// which stays in flight while the hold lasts, or until a commit
    /// converts the hold (`encode` says how to take it up again). `kept`:
    /// the processor keeps it (an [`crate::InFlight`]) rather than a call
    /// carrying it. `None` without a current record.
    pub(crate) fn hold(
        &mut self,
        processor: &str,
        encode: Encoder,
        kept: bool,
    ) -> Option<Arc<RecordToken>> {
        let current = self.current.as_ref()?;
        let stream_time = current.stream_time;
        let id = self.derived.next_id();
        let token = RecordToken::new(
            Origin::Held {
                id,
                root: parking_lot::Mutex::new(Some(current.root())),
                position: current.position(),
                raw: current.raw().cloned(),
                end_is_effect: kept,
            },
            stream_time,
            self.done.clone(),
            self.abandoned.clone(),
        );
        self.derived
            .hold(id, processor, encode, Arc::downgrade(&token), stream_time);
        Some(token)
    }

    /// The input position of the record being processed (`None` for a
    /// derived record).
    pub(crate) fn position(&self) -> Option<Position> {
        self.current.as_ref().and_then(|t| t.position())
    }

    /// A token for a new derived record (see `crate::derived`), stored by a
    /// commit while in flight when `content` says how to forward it again.
    pub(crate) fn derive(&mut self, content: Option<Resumable>) -> Arc<RecordToken> {
        let stream_time = self.record_stream_time();
        let id = self.derived.derive(content, stream_time);
        self.token(id, stream_time)
    }

    fn token(&self, id: u64, stream_time: i64) -> Arc<RecordToken> {
        RecordToken::new(
            Origin::Derived { id },
            stream_time,
            self.done.clone(),
            self.abandoned.clone(),
        )
    }

    /// Forwards `rec` to `kids` as the derived record `token`. A dead letter
    /// asked for on the way is the derived record's own (see
    /// `TaskCtx::dead_letter`), as an input record's is at the top of its
    /// processing.
    fn forward_as<K: Data, V: Data>(
        &mut self,
        token: Arc<RecordToken>,
        kids: &mut Forward<K, V>,
        rec: Record<K, V>,
    ) -> Result<(), ProcessError> {
        let saved = self.current.replace(token);
        let forwarded = kids.forward(rec, self);
        let result = handle(self, forwarded);
        self.current = saved;
        result
    }

    /// Forwards `rec` to `kids` as a new derived record.
    pub(crate) fn forward_derived<K: Data, V: Data>(
        &mut self,
        kids: &mut Forward<K, V>,
        rec: Record<K, V>,
        content: Option<Resumable>,
    ) -> Result<(), ProcessError> {
        let token = self.derive(content);
        self.forward_as(token, kids, rec)
    }

    /// Forwards again the derived record `id` restored from the progress
    /// store (already registered under its id).
    pub(crate) fn forward_resumed<K: Data, V: Data>(
        &mut self,
        kids: &mut Forward<K, V>,
        rec: Record<K, V>,
        id: u64,
    ) -> Result<(), ProcessError> {
        let stream_time = self.derived.stream_time_of(id).unwrap_or(self.stream_time);
        let token = self.token(id, stream_time);
        self.forward_as(token, kids, rec)
    }

    /// The stream time the current record is judged by: the task's stream
    /// time when it arrived (input order), not when its async call ended.
    pub(crate) fn record_stream_time(&self) -> i64 {
        self.current
            .as_ref()
            .map_or(self.stream_time, |t| t.stream_time)
    }

    pub(crate) fn store(&self, name: &str) -> Option<StoreId> {
        self.stores.get(name).copied()
    }

    /// The task's stores, to write (an effect of the current record).
    pub(crate) fn state_mut(&mut self) -> &mut TaskState {
        self.mark_effect();
        self.state
            .as_mut()
            .expect("operators with stores run in tasks that have state")
    }

    pub(crate) fn state(&self) -> &TaskState {
        self.state
            .as_ref()
            .expect("operators with stores run in tasks that have state")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    /// Sets its flag when dropped: a call's future was cancelled (or ended).
    struct DropFlag(Arc<AtomicBool>);

    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn spawner(
        rt: &tokio::runtime::Runtime,
    ) -> (Spawner, crossbeam_channel::Receiver<CompletionMsg>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        let task = TaskId {
            subtopology: 0,
            partition: 3,
        };
        (Spawner::new(rt.handle().clone(), tx, task), rx)
    }

    #[test]
    fn calls_complete_side_by_side_and_abort_cancels_every_pending_one() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (mut s, rx) = spawner(&rt);
        // 200 calls of 50 ms each, started at once: they run side by side
        // (one after another would take 10 s), each completing once.
        let started = std::time::Instant::now();
        for i in 0..200u64 {
            s.spawn(7, Vec::new(), async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                i * 2
            });
        }
        assert_eq!(s.pending(), 200);
        let mut seen = HashMap::new();
        for _ in 0..200 {
            let msg = rx
                .recv_timeout(Duration::from_secs(5))
                .expect("a completion");
            assert_eq!((msg.task.partition, msg.node), (3, 7));
            assert!(s.finish(&msg).is_some());
            let out = *msg.output.downcast::<u64>().expect("the call's output");
            assert_eq!(out, msg.call * 2, "each call's own output");
            assert!(
                seen.insert(msg.call, out).is_none(),
                "call {} once",
                msg.call
            );
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(s.pending(), 0);

        // A panicking call completes with its panic, the others still run.
        s.spawn(1, Vec::new(), async { panic!("boom") });
        let msg = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("a completion");
        assert!(s.finish(&msg).is_some());
        let panicked = msg.output.downcast::<CallPanicked>().expect("a panic");
        assert_eq!(panicked.0, "boom");

        // Aborting cancels every pending call: their futures are dropped and
        // nothing completes.
        let flags: Vec<Arc<AtomicBool>> = (0..20).map(|_| Arc::default()).collect();
        for flag in &flags {
            let guard = DropFlag(flag.clone());
            s.spawn(1, Vec::new(), async move {
                tokio::time::sleep(Duration::from_secs(60)).await;
                drop(guard);
            });
        }
        std::thread::sleep(Duration::from_millis(100));
        assert!(flags.iter().all(|f| !f.load(Ordering::SeqCst)), "running");
        assert_eq!(s.abort_all(), 20);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !flags.iter().all(|f| f.load(Ordering::SeqCst)) {
            assert!(
                std::time::Instant::now() < deadline,
                "aborted calls dropped"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());

        // Calls started after the abort run on a fresh pool.
        s.spawn(2, Vec::new(), async { 5u64 });
        let msg = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("a completion");
        assert_eq!(*msg.output.downcast::<u64>().unwrap(), 5);

        // A later spawner of the same task (the task closed and assigned
        // again) numbers its calls from 0 too: a completion of the earlier
        // one is not taken for its call of the same number.
        let (mut again, rx_again) = spawner(&rt);
        again.spawn(2, Vec::new(), async { 6u64 });
        let msg = rx_again
            .recv_timeout(Duration::from_secs(5))
            .expect("a completion");
        let stale = CompletionMsg {
            task: msg.task,
            node: msg.node,
            spawner: s.id,
            call: msg.call,
            output: Box::new(0u64),
        };
        assert!(again.finish(&stale).is_none(), "another spawner's call");
        assert!(again.finish(&msg).is_some());

        // A dropped spawner does not cancel its calls: they run to the end.
        let flag = Arc::new(AtomicBool::new(false));
        let done = flag.clone();
        s.spawn(2, Vec::new(), async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            done.store(true, Ordering::SeqCst);
        });
        drop(s);
        assert!(rx.recv_timeout(Duration::from_secs(5)).is_ok());
        assert!(flag.load(Ordering::SeqCst));
    }
}
