//! The per-task context every operator runs in: the task's stores, its pending
//! outputs, the record being processed, stream time, and the spawner for async
//! operator calls.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use std::sync::atomic::AtomicBool;

use crossbeam_channel::Sender;
use futures::FutureExt;
use rustc_hash::FxHashMap;
use sluice_state::{Position, StoreId, TaskState};

use crate::derived::{DerivedTracker, Resumable};
use crate::node::{Data, Forward};
use crate::offsets::{Done, Origin, RecordToken};
use crate::record::{OutputRecord, Record};
use crate::{ProcessError, TaskId};

/// An async operator call finished; sent from the tokio runtime back to the
/// thread that owns the task.
pub(crate) struct CompletionMsg {
    pub(crate) task: TaskId,
    pub(crate) node: usize,
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

struct Pending {
    tokens: Vec<Arc<RecordToken>>,
    abort: tokio::task::AbortHandle,
}

/// Spawns async operator calls on the tokio runtime and keeps the records they
/// carry in flight until their completion has been handled.
pub(crate) struct Spawner {
    handle: tokio::runtime::Handle,
    tx: Sender<CompletionMsg>,
    task: TaskId,
    next_call: u64,
    pending: HashMap<u64, Pending>,
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
            next_call: 0,
            pending: HashMap::new(),
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
        let tx = self.tx.clone();
        let task = self.task;
        let join = self.handle.spawn(async move {
            // A future that panics still completes its call: its records are
            // dead-lettered, never left in flight (commits would stop) nor
            // counted as handled.
            let output: Box<dyn Any + Send> =
                match std::panic::AssertUnwindSafe(fut).catch_unwind().await {
                    Ok(output) => Box::new(output),
                    Err(panic) => Box::new(CallPanicked(panic_message(panic.as_ref()))),
                };
            let _ = tx.send(CompletionMsg {
                task,
                node,
                call,
                output,
            });
        });
        self.pending.insert(
            call,
            Pending {
                tokens,
                abort: join.abort_handle(),
            },
        );
    }

    /// Takes the records a finished call carried.
    pub(crate) fn finish(&mut self, call: u64) -> Option<Vec<Arc<RecordToken>>> {
        self.pending.remove(&call).map(|p| p.tokens)
    }

    /// Calls not yet completed.
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Cancels every pending call; their records stay unfinished (their
    /// tokens are dropped without being reported by the closed task).
    pub(crate) fn abort_all(&mut self) -> usize {
        let n = self.pending.len();
        for (_, p) in self.pending.drain() {
            p.abort.abort();
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
fn record_size(rec: &OutputRecord) -> usize {
    rec.key.as_ref().map_or(0, Vec::len)
        + rec.value.as_ref().map_or(0, Vec::len)
        + rec
            .headers
            .iter()
            .map(|(k, v)| k.len() + v.len() + 8)
            .sum::<usize>()
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
        self.out.push(rec);
        Ok(())
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
        let result = crate::task::handle(self, forwarded);
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
        let token = self.token(id, self.stream_time);
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

    pub(crate) fn state_mut(&mut self) -> &mut TaskState {
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
