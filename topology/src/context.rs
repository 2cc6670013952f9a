//! The per-task context every operator runs in: the task's stores, its pending
//! outputs, the record being processed, stream time, and the spawner for async
//! operator calls.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use crossbeam_channel::Sender;
use rustc_hash::FxHashMap;
use sluice_state::{Position, StoreId, TaskState};

use crate::offsets::RecordToken;
use crate::record::OutputRecord;
use crate::TaskId;

/// An async operator call finished; sent from the tokio runtime back to the
/// thread that owns the task.
pub(crate) struct CompletionMsg {
    pub(crate) task: TaskId,
    pub(crate) node: usize,
    pub(crate) call: u64,
    pub(crate) output: Box<dyn Any + Send>,
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
            let output = fut.await;
            let _ = tx.send(CompletionMsg {
                task,
                node,
                call,
                output: Box::new(output),
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
    pub(crate) fn abort_all(&mut self) {
        for (_, p) in self.pending.drain() {
            p.abort.abort();
        }
    }

    pub(crate) fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

/// Engine counters a task accumulates; the runtime moves them into metrics.
#[derive(Debug, Default, Clone)]
pub struct TaskCounters {
    /// Records dropped because they arrived after their window's grace period.
    pub late_dropped: u64,
    /// Replayed records whose effect was already reflected in restored state.
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
    /// Next offset after this task's committed outputs, per topic partition.
    pub(crate) output_ends: HashMap<(String, i32), i64>,
}

impl TaskCtx {
    pub(crate) fn new(task: TaskId, state: Option<TaskState>, spawner: Spawner) -> Self {
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
            output_ends: HashMap::new(),
        }
    }

    /// The position of the record being processed.
    pub(crate) fn position(&self) -> Option<Position> {
        self.current.as_ref().map(|t| t.position)
    }

    /// The stream time the current record is judged by: the task's stream
    /// time when it arrived (input order), not when its async call ended.
    pub(crate) fn record_stream_time(&self) -> i64 {
        self.current
            .as_ref()
            .map_or(self.stream_time, |t| t.stream_time)
    }

    /// True when the current record may already be reflected in state.
    pub(crate) fn replaying(&self) -> bool {
        self.current.as_ref().is_some_and(|t| t.replay)
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
