//! The processor API: custom operators, synchronous or async, with named stores
//! and punctuation.
//!
//! A [`Processor`] gets each record in `process`. It may forward records at
//! once, or start an async call with [`ProcessorContext::spawn`]: the call runs
//! on the tokio runtime, and its output comes back to [`Processor::complete`] on
//! the task's thread — in completion order, not input order. The input record
//! stays in flight (its offset uncommitted) until its completion was handled, so
//! a crash never loses it. A call whose future panics completes too: its
//! records go to their dead-letter topic (category `panic`). The runtime
//! bounds in-flight records per partition by pausing the partition, and keeps
//! polling meanwhile, so a slow call never costs a rebalance.
//!
//! A processor that spawns with [`ProcessorContext::spawn_resumable`] (or
//! holds with [`ProcessorContext::hold_resumable`]) gives the engine what it
//! needs to take the record up again; with it, what the record did before
//! or beside the call commits exactly once in any topology shape: a commit
//! taken once the record had an effect stores the content and finishes the
//! record, and a restart hands the content to [`Processor::resume`] (see
//! `crate::derived`).

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;
use sluice_state::{Position, StoreId, TaskState};

use crate::codec::{from_bincode, to_bincode, with_bincode};
use crate::context::TaskCtx;
use crate::node::{CompletionTarget, Data, Forward, Node, Punctuation};
use crate::offsets::{InFlight, RecordToken};
use crate::record::{OutputRecord, Record};
use crate::{ProcessError, TaskId};

/// A custom operator. One instance runs per task; it is never shared.
pub trait Processor<K, V>: Send + 'static {
    /// Key type of forwarded records.
    type OutKey: Data;
    /// Value type of forwarded records.
    type OutValue: Data;
    /// Output of the async calls this processor spawns (`()` if none).
    type Output: Send + 'static;

    /// Called once when the task starts, after its state was restored.
    fn init(
        &mut self,
        _ctx: &mut ProcessorContext<'_, Self::OutKey, Self::OutValue, Self::Output>,
    ) -> Result<(), ProcessError> {
        Ok(())
    }

    /// Handles one record.
    fn process(
        &mut self,
        record: Record<K, V>,
        ctx: &mut ProcessorContext<'_, Self::OutKey, Self::OutValue, Self::Output>,
    ) -> Result<(), ProcessError>;

    /// Handles the output of a call spawned with [`ProcessorContext::spawn`].
    /// When the call carried exactly one record, that record is current again.
    fn complete(
        &mut self,
        _output: Self::Output,
        _ctx: &mut ProcessorContext<'_, Self::OutKey, Self::OutValue, Self::Output>,
    ) -> Result<(), ProcessError> {
        Ok(())
    }

    /// Takes up again, after a restart, a record this processor held with
    /// [`ProcessorContext::spawn_resumable`] or
    /// [`ProcessorContext::hold_resumable`] when a commit made the hold its
    /// record's resume point: `content` is the content given then,
    /// bincode-encoded ([`crate::from_bincode`] reads it). The record is
    /// current (its position and original bytes, for dead letters); what the
    /// record did before the hold is committed and is not done again, so
    /// this starts the call (or holds the record) again, nothing else. A
    /// processor that holds records resumably must implement it.
    fn resume(
        &mut self,
        _content: &[u8],
        _ctx: &mut ProcessorContext<'_, Self::OutKey, Self::OutValue, Self::Output>,
    ) -> Result<(), ProcessError> {
        Err(ProcessError::Fatal(
            "a record this processor held resumably was stored by a commit, and the processor does not implement Processor::resume".into(),
        ))
    }

    /// Called on every punctuation tick with wall-clock and stream time.
    fn punctuate(
        &mut self,
        _time: Punctuation,
        _ctx: &mut ProcessorContext<'_, Self::OutKey, Self::OutValue, Self::Output>,
    ) -> Result<(), ProcessError> {
        Ok(())
    }

    /// Called before every commit of the task: forward or emit what the
    /// processor held back (e.g. the latest value per key since the last
    /// commit, as the aggregations' [`crate::EmitMode::OnCommit`] does). What
    /// it sends goes out with the commit's stores and offsets (in the same
    /// transaction under exactly-once).
    fn flush(
        &mut self,
        _ctx: &mut ProcessorContext<'_, Self::OutKey, Self::OutValue, Self::Output>,
    ) -> Result<(), ProcessError> {
        Ok(())
    }
}

/// What a processor can do while handling a record, a completion or a tick.
pub struct ProcessorContext<'a, K, V, O> {
    ctx: &'a mut TaskCtx,
    kids: &'a mut Forward<K, V>,
    node: usize,
    name: &'a str,
    _out: PhantomData<fn(O)>,
}

impl<K: Data, V: Data, O: Send + 'static> ProcessorContext<'_, K, V, O> {
    /// Sends a record to the downstream operators. A record forwarded
    /// outside of a current record (from `flush`, `punctuate`, or the
    /// completion of a call that carried several records) is a derived record
    /// of its own (see `crate::derived`): it can be held and dead-lettered
    /// like an input record.
    pub fn forward(&mut self, record: Record<K, V>) -> Result<(), ProcessError> {
        if self.ctx.current.is_none() {
            return self.ctx.forward_derived(self.kids, record, None);
        }
        self.kids.forward(record, self.ctx)
    }

    /// Starts an async call for the current record; its output comes back to
    /// [`Processor::complete`] and the record stays in flight until then.
    ///
    /// A crash while the call runs replays the record from its source. When
    /// the record had an effect by then (an output or a store write beside
    /// or before this call), that replay would make it again: use
    /// [`ProcessorContext::spawn_resumable`] in topologies where that can
    /// happen.
    pub fn spawn(&mut self, fut: impl Future<Output = O> + Send + 'static) {
        let tokens = self.ctx.carry_current().into_iter().collect();
        self.ctx.spawner.spawn(self.node, tokens, fut);
    }

    /// [`ProcessorContext::spawn`] for a call that can be started again
    /// from `content` after a restart: a commit taken while it runs, once
    /// the record had an effect, stores `content` (bincode-encoded, only
    /// then) instead of keeping the record unfinished, and a restart hands
    /// it to [`Processor::resume`] — so everything the record did before
    /// and beside this call commits exactly once, whatever the topology's
    /// shape.
    pub fn spawn_resumable<C: Serialize + Send + 'static>(
        &mut self,
        content: C,
        fut: impl Future<Output = O> + Send + 'static,
    ) {
        let tokens = self
            .ctx
            .hold(self.name, encoder(content), false)
            .into_iter()
            .collect();
        self.ctx.spawner.spawn(self.node, tokens, fut);
    }

    /// Starts an async call for records held earlier (e.g. a micro-batch).
    /// Move the [`InFlight`] handles into the future's output to get them back
    /// in `complete`; each record is finished when its handle is dropped.
    pub fn spawn_detached(&mut self, fut: impl Future<Output = O> + Send + 'static) {
        self.ctx.spawner.spawn(self.node, Vec::new(), fut);
    }

    /// Keeps the current record in flight until the returned handle is
    /// dropped (see [`ProcessorContext::spawn`] on a crash meanwhile).
    pub fn hold(&mut self) -> Option<InFlight> {
        self.ctx.carry_current().map(InFlight)
    }

    /// [`ProcessorContext::hold`] for a record the processor can take up
    /// again from `content` after a restart (see
    /// [`ProcessorContext::spawn_resumable`]).
    pub fn hold_resumable<C: Serialize + Send + 'static>(
        &mut self,
        content: C,
    ) -> Option<InFlight> {
        self.ctx
            .hold(self.name, encoder(content), true)
            .map(InFlight)
    }

    /// Runs `f` with a held record as the current record (its position stamps
    /// store writes; dead letters refer to it).
    pub fn with_record<R>(&mut self, held: &InFlight, f: impl FnOnce(&mut Self) -> R) -> R {
        let saved = self.ctx.current.replace(held.0.clone());
        let r = f(self);
        self.ctx.current = saved;
        r
    }

    /// The input position of the current record.
    pub fn position(&self) -> Option<Position> {
        self.ctx.position()
    }

    /// The task's stream time, ms.
    pub fn stream_time(&self) -> i64 {
        self.ctx.stream_time
    }

    /// The wall clock as of the last tick, ms.
    pub fn wall_clock_ms(&self) -> i64 {
        self.ctx.wall_clock_ms
    }

    /// The task this processor instance belongs to.
    pub fn task_id(&self) -> TaskId {
        self.ctx.task
    }

    /// The tokio runtime async calls run on.
    pub fn runtime(&self) -> tokio::runtime::Handle {
        self.ctx.spawner.handle().clone()
    }

    /// Async calls of this task not yet completed.
    pub fn pending_calls(&self) -> usize {
        self.ctx.spawner.pending()
    }

    /// Queues a record for any topic (results, alerts, dead letters). A
    /// record the producers could never send (over their
    /// `message.max.bytes`) is not queued: the error dead-letters the current
    /// record (`too_large`) when returned.
    pub fn emit(&mut self, record: OutputRecord) -> Result<(), ProcessError> {
        self.ctx.queue_output(record)
    }

    /// Sends the current record's original bytes to its source's dead-letter
    /// topic with a reason, category and attempt count. Fails when the source
    /// has no dead-letter topic.
    pub fn dead_letter(
        &mut self,
        reason: &str,
        category: &str,
        attempts: u32,
    ) -> Result<(), ProcessError> {
        self.ctx.dead_letter(reason, category, attempts)
    }

    /// The offset after this task's last committed output to a topic
    /// partition (known from delivery reports; `None` before the first).
    pub fn output_end(&self, topic: &str, partition: i32) -> Option<i64> {
        self.ctx
            .output_ends
            .get(&(topic.to_string(), partition))
            .copied()
    }

    /// Asks the runtime to commit soon (e.g. after a batch of state updates).
    pub fn request_commit(&mut self) {
        self.ctx.commit_requested = true;
    }

    /// Typed access to a key-value store attached to this processor.
    pub fn kv<SK: Serialize + DeserializeOwned, SV: Serialize + DeserializeOwned>(
        &mut self,
        name: &str,
    ) -> Result<KvStore<'_, SK, SV>, ProcessError> {
        let id = self.ctx.store(name).ok_or_else(|| {
            ProcessError::Fatal(format!("store {name} is not attached to this processor"))
        })?;
        let TaskCtx { state, current, .. } = &mut *self.ctx;
        Ok(KvStore {
            state: state
                .as_mut()
                .expect("operators with stores run in tasks that have state"),
            record: current.as_deref(),
            id,
            _types: PhantomData,
        })
    }

    /// Typed access to a window store attached to this processor (declared
    /// with `StreamBuilder::add_window_store`).
    pub fn window<SK: Serialize + DeserializeOwned, SV: Serialize + DeserializeOwned>(
        &mut self,
        name: &str,
    ) -> Result<WindowStore<'_, SK, SV>, ProcessError> {
        let id = self.ctx.store(name).ok_or_else(|| {
            ProcessError::Fatal(format!("store {name} is not attached to this processor"))
        })?;
        let TaskCtx { state, current, .. } = &mut *self.ctx;
        let state = state
            .as_mut()
            .expect("operators with stores run in tasks that have state");
        if !state
            .specs()
            .nth(id.0)
            .is_some_and(|s| matches!(s.kind, sluice_state::StoreKind::Window { .. }))
        {
            return Err(ProcessError::Fatal(format!(
                "store {name} is not a window store"
            )));
        }
        Ok(WindowStore {
            state,
            record: current.as_deref(),
            id,
            _types: PhantomData,
        })
    }
}

/// Encodes `content` when a commit converts its hold.
fn encoder<C: Serialize + Send + 'static>(content: C) -> crate::derived::Encoder {
    Box::new(move || to_bincode(&content))
}

/// A typed view of a window store: values per (key, window start); keys and
/// values are bincode-encoded. Windows older than the store's retention
/// behind stream time are expired by the aggregations that share the store,
/// or by [`WindowStore::expire_before`].
pub struct WindowStore<'a, K, V> {
    state: &'a mut TaskState,
    /// The current record: a write is its effect.
    record: Option<&'a RecordToken>,
    id: StoreId,
    _types: PhantomData<fn(K, V)>,
}

impl<K: Serialize + DeserializeOwned, V: Serialize + DeserializeOwned> WindowStore<'_, K, V> {
    /// Reads the value of one window of a key.
    pub fn get(&self, key: &K, window_start: i64) -> Result<Option<V>, ProcessError> {
        self.state
            .window_get(self.id, &to_bincode(key), window_start)?
            .map(|s| {
                from_bincode(&s.value)
                    .map_err(|e| ProcessError::Fatal(format!("corrupt window value: {e}")))
            })
            .transpose()
    }

    /// Writes one window of a key.
    pub fn put(&mut self, key: &K, window_start: i64, value: &V) {
        self.record.inspect(|r| r.mark_effect());
        self.state
            .window_put(self.id, &to_bincode(key), window_start, &to_bincode(value));
    }

    /// Changes one window of a key in place (`V::default()` when it has no
    /// value) and returns what `f` returns. The value stays decoded in the task's write cache until the next commit
    /// encodes it, so a window many records update costs one decode and one
    /// encode per commit instead of one per record.
    pub fn update<R>(
        &mut self,
        key: &K,
        window_start: i64,
        f: impl FnOnce(&mut V) -> R,
    ) -> Result<R, ProcessError>
    where
        V: Default + Send + 'static,
    {
        let id = self.id;
        self.record.inspect(|r| r.mark_effect());
        let value = with_bincode(key, |key| {
            self.state.window_update(id, key, window_start, |stored| {
                let v = match stored {
                    Some(s) => from_bincode(&s.value).map_err(|e| e.to_string())?,
                    None => V::default(),
                };
                Ok(Bincoded(v))
            })
        })?;
        Ok(f(&mut value.0))
    }

    /// Reads one window of a key without copying it when the write cache
    /// holds it decoded (see [`WindowStore::update`]); `f` gets `None` when
    /// the window has no value.
    pub fn peek<R>(
        &self,
        key: &K,
        window_start: i64,
        f: impl FnOnce(Option<&V>) -> R,
    ) -> Result<R, ProcessError>
    where
        V: Send + 'static,
    {
        let decoded = with_bincode(key, |key| {
            self.state
                .window_decoded::<Bincoded<V>>(self.id, key, window_start)
        });
        if let Some(v) = decoded {
            return Ok(f(Some(&v.0)));
        }
        Ok(f(self.get(key, window_start)?.as_ref()))
    }

    /// The windows of `key` that start in `[from, to)`, oldest first.
    pub fn fetch(&self, key: &K, from: i64, to: i64) -> Result<Vec<(i64, V)>, ProcessError> {
        let key = to_bincode(key);
        self.state
            .window_range(self.id, from, to)?
            .into_iter()
            .filter(|e| e.key == key)
            .map(|e| {
                let v = from_bincode(&e.value.value)
                    .map_err(|e| ProcessError::Fatal(format!("corrupt window value: {e}")))?;
                Ok((e.start_ms, v))
            })
            .collect()
    }

    /// Every window of every key that starts in `[from, to)`, in (start, key)
    /// order.
    pub fn fetch_all(&self, from: i64, to: i64) -> Result<Vec<(i64, K, V)>, ProcessError> {
        self.state
            .window_range(self.id, from, to)?
            .into_iter()
            .map(|e| {
                let k = from_bincode(&e.key)
                    .map_err(|e| ProcessError::Fatal(format!("corrupt window key: {e}")))?;
                let v = from_bincode(&e.value.value)
                    .map_err(|e| ProcessError::Fatal(format!("corrupt window value: {e}")))?;
                Ok((e.start_ms, k, v))
            })
            .collect()
    }

    /// Expires the windows that start before `before` (they leave reads at
    /// once, and RocksDB at the next commit).
    pub fn expire_before(&mut self, before: i64) -> Result<(), ProcessError> {
        self.record.inspect(|r| r.mark_effect());
        Ok(self.state.expire_windows(self.id, before)?)
    }
}

/// A value kept decoded in the write cache, encoded with bincode at the
/// commit.
struct Bincoded<V>(V);

impl<V: Serialize + Send + 'static> sluice_state::CachedValue for Bincoded<V> {
    fn encode(&self) -> Vec<u8> {
        to_bincode(&self.0)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// A typed view of a key-value store; keys and values are bincode-encoded.
pub struct KvStore<'a, K, V> {
    state: &'a mut TaskState,
    /// The current record: a write is its effect.
    record: Option<&'a RecordToken>,
    id: StoreId,
    _types: PhantomData<fn(K, V)>,
}

impl<K: Serialize + DeserializeOwned, V: Serialize + DeserializeOwned> KvStore<'_, K, V> {
    /// Reads a value.
    pub fn get(&self, key: &K) -> Result<Option<V>, ProcessError> {
        self.state
            .get(self.id, &to_bincode(key))?
            .map(|stored| {
                from_bincode(&stored.value)
                    .map_err(|e| ProcessError::Fatal(format!("corrupt store value: {e}")))
            })
            .transpose()
    }

    /// Writes a value.
    pub fn put(&mut self, key: &K, value: &V) {
        self.record.inspect(|r| r.mark_effect());
        self.state.put(self.id, to_bincode(key), &to_bincode(value));
    }

    /// Deletes a key.
    pub fn delete(&mut self, key: &K) {
        self.record.inspect(|r| r.mark_effect());
        self.state.delete(self.id, to_bincode(key));
    }

    /// Up to `limit` entries after the encoded key `after` (from the start
    /// when `None`), in encoded-key order, with their encoded keys: for
    /// incremental sweeps over a large store.
    pub fn scan_after_bytes(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, K, V)>, ProcessError> {
        self.state
            .scan_after(self.id, after, limit)?
            .into_iter()
            .map(|(kb, v)| {
                let k = from_bincode(&kb)
                    .map_err(|e| ProcessError::Fatal(format!("corrupt store key: {e}")))?;
                let v = from_bincode(&v.value)
                    .map_err(|e| ProcessError::Fatal(format!("corrupt store value: {e}")))?;
                Ok((kb, k, v))
            })
            .collect()
    }

    /// All entries whose encoded key starts with the encoding of `prefix`
    /// (useful with tuple keys whose first element is the prefix).
    pub fn scan_prefix_bytes(&self, prefix: &[u8]) -> Result<Vec<(K, V)>, ProcessError> {
        self.state
            .prefix_scan(self.id, prefix)?
            .into_iter()
            .map(|(k, v)| {
                let k = from_bincode(&k)
                    .map_err(|e| ProcessError::Fatal(format!("corrupt store key: {e}")))?;
                let v = from_bincode(&v.value)
                    .map_err(|e| ProcessError::Fatal(format!("corrupt store value: {e}")))?;
                Ok((k, v))
            })
            .collect()
    }
}

/// The state of a processor node in one task, shared between the node in the
/// operator tree and the completion dispatcher.
pub(crate) struct ProcState<P, K, V>
where
    P: Processor<K, V>,
{
    pub(crate) processor: P,
    pub(crate) kids: Forward<P::OutKey, P::OutValue>,
    pub(crate) node: usize,
    /// The processor's name in the topology.
    pub(crate) name: String,
    pub(crate) _in: PhantomData<fn(K, V)>,
}

/// The context type a processor `P` sees.
type CtxOf<'a, P, K, V> = ProcessorContext<
    'a,
    <P as Processor<K, V>>::OutKey,
    <P as Processor<K, V>>::OutValue,
    <P as Processor<K, V>>::Output,
>;

impl<P, K, V> ProcState<P, K, V>
where
    P: Processor<K, V>,
{
    fn pctx<'a>(&'a mut self, ctx: &'a mut TaskCtx) -> (&'a mut P, CtxOf<'a, P, K, V>) {
        (
            &mut self.processor,
            ProcessorContext {
                ctx,
                kids: &mut self.kids,
                node: self.node,
                name: &self.name,
                _out: PhantomData,
            },
        )
    }
}

impl<P, K, V> CompletionTarget for ProcState<P, K, V>
where
    P: Processor<K, V>,
    K: Send + 'static,
    V: Send + 'static,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn init(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let (p, mut pc) = self.pctx(ctx);
        p.init(&mut pc)
    }

    fn resume(&mut self, content: &[u8], ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let (p, mut pc) = self.pctx(ctx);
        p.resume(content, &mut pc)
    }

    fn complete(
        &mut self,
        output: Box<dyn std::any::Any + Send>,
        ctx: &mut TaskCtx,
    ) -> Result<(), ProcessError> {
        let output = output
            .downcast::<P::Output>()
            .map_err(|_| ProcessError::Fatal("async output of an unexpected type".into()))?;
        let (p, mut pc) = self.pctx(ctx);
        p.complete(*output, &mut pc)
    }
}

/// The operator-tree side of a processor.
pub(crate) struct ProcessorNode<P, K, V>
where
    P: Processor<K, V>,
{
    pub(crate) state: Arc<Mutex<ProcState<P, K, V>>>,
}

impl<P, K, V> Node<K, V> for ProcessorNode<P, K, V>
where
    P: Processor<K, V>,
    K: Data,
    V: Data,
{
    fn process(&mut self, rec: Record<K, V>, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let mut st = self.state.lock();
        let (p, mut pc) = st.pctx(ctx);
        p.process(rec, &mut pc)
    }

    fn punctuate(&mut self, time: Punctuation, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let mut st = self.state.lock();
        {
            let (p, mut pc) = st.pctx(ctx);
            p.punctuate(time, &mut pc)?;
        }
        st.kids.punctuate(time, ctx)
    }

    fn flush(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let mut st = self.state.lock();
        {
            let (p, mut pc) = st.pctx(ctx);
            p.flush(&mut pc)?;
        }
        st.kids.flush(ctx)
    }

    fn may_hold(&self) -> bool {
        true
    }

    fn resume(
        &mut self,
        node: &str,
        id: u64,
        bytes: &[u8],
        ctx: &mut TaskCtx,
    ) -> Result<bool, ProcessError> {
        self.state.lock().kids.resume(node, id, bytes, ctx)
    }
}
