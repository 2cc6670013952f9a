//! Time windows and the aggregation operators (windowed and not) with their
//! grace period, emit modes and window expiry. What an aggregation forwards
//! to an operator that may hold it (an async step) is a derived record of
//! its own (see `crate::derived`).

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sluice_state::StoreId;

use crate::codec::{from_bincode, to_bincode};
use crate::context::TaskCtx;
use crate::derived::Resumable;
use crate::node::{Data, Forward, Node, Punctuation};
use crate::record::{Headers, Record};
use crate::ProcessError;

/// A time window, `[start, end)` in ms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Window {
    /// Inclusive start, ms.
    pub start: i64,
    /// Exclusive end, ms.
    pub end: i64,
}

/// A key qualified by the window it was aggregated in.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Windowed<K> {
    /// The record key.
    pub key: K,
    /// The window.
    pub window: Window,
}

/// Tumbling (advance = size) or hopping (advance < size) windows aligned to the
/// epoch, with a grace period for late records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimeWindows {
    /// Window length, ms.
    pub size_ms: i64,
    /// Distance between window starts, ms.
    pub advance_ms: i64,
    /// How long after its end a window still accepts records, ms.
    pub grace_ms: i64,
}

impl TimeWindows {
    /// Non-overlapping windows of `size`.
    pub fn tumbling(size: Duration) -> Self {
        let ms = size.as_millis() as i64;
        TimeWindows {
            size_ms: ms,
            advance_ms: ms,
            grace_ms: 0,
        }
    }

    /// Overlapping windows of `size` starting every `advance`.
    pub fn hopping(size: Duration, advance: Duration) -> Self {
        TimeWindows {
            size_ms: size.as_millis() as i64,
            advance_ms: advance.as_millis() as i64,
            grace_ms: 0,
        }
    }

    /// Sets the grace period.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace_ms = grace.as_millis() as i64;
        self
    }

    /// The windows a timestamp falls in, oldest first.
    pub fn windows_for(&self, ts: i64) -> impl Iterator<Item = Window> + '_ {
        let last_start = ts - ts.rem_euclid(self.advance_ms);
        let mut start = last_start;
        while start - self.advance_ms > ts - self.size_ms {
            start -= self.advance_ms;
        }
        (0..)
            .map(move |i| start + i * self.advance_ms)
            .take_while(move |s| *s <= last_start)
            .map(move |s| Window {
                start: s,
                end: s + self.size_ms,
            })
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.size_ms <= 0 || self.advance_ms <= 0 || self.grace_ms < 0 {
            return Err("window size and advance must be positive, grace non-negative".into());
        }
        if self.advance_ms > self.size_ms {
            return Err("window advance must not exceed its size".into());
        }
        Ok(())
    }
}

/// When an aggregation forwards its results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmitMode {
    /// Every update of every window (a changelog stream of the table).
    OnUpdate,
    /// The latest value of each updated key, once per commit (like Kafka
    /// Streams' record cache): output grows with distinct keys per commit, not
    /// with input records.
    OnCommit,
    /// Once per window, when stream time passes its end plus grace.
    OnWindowClose,
}

/// Stream time and emission progress of a windowed aggregation, kept in its
/// store under a key outside every window-key range (see [`META_KEY`]).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub(crate) struct AggMeta {
    /// The closing time reached (see `TaskCtx::closing_time`).
    stream_time: i64,
    /// Every window whose end is at or before this was emitted (final mode).
    emitted_until: i64,
}

/// The metadata key: one zero byte sorts before every window key (the
/// smallest is eight zero bytes), so no window range read or expiry, which
/// span `[encode_window_key(from), encode_window_key(to))`, ever covers it.
const META_KEY: &[u8] = b"\0";
/// Where earlier versions kept the metadata (inside the expiry range).
const LEGACY_META_KEY: &[u8] = b"\0meta";

/// Where an aggregation's results go: its children, and whether they may
/// hold a result past the call that hands it over (then every result is a
/// derived record, stored by a commit while in flight under the
/// aggregation's store name).
pub(crate) struct Emitter<K, A> {
    pub(crate) kids: Forward<K, A>,
    /// The aggregation's store name, when results are derived records.
    derived_as: Option<String>,
}

/// A result as a derived record keeps it: key, value, timestamp, headers.
type Encoded<K, A> = (K, A, i64, Headers);

impl<K, A> Emitter<K, A>
where
    K: Data + Serialize + DeserializeOwned,
    A: Data + Serialize + DeserializeOwned,
{
    pub(crate) fn new(kids: Forward<K, A>, store: &str) -> Self {
        let derived_as = kids.may_hold().then(|| store.to_string());
        Emitter { kids, derived_as }
    }

    /// Forwards one result.
    fn emit(&mut self, rec: Record<K, A>, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let Some(node) = &self.derived_as else {
            return self.kids.forward(rec, ctx);
        };
        let bytes = to_bincode(&(&rec.key, &rec.value, rec.timestamp, &rec.headers));
        let content = Resumable {
            node: node.clone(),
            bytes,
        };
        ctx.forward_derived(&mut self.kids, rec, Some(content))
    }

    /// Forwards again a result this aggregation derived before a restart.
    fn resume(
        &mut self,
        node: &str,
        id: u64,
        bytes: &[u8],
        ctx: &mut TaskCtx,
    ) -> Result<bool, ProcessError> {
        if self.derived_as.as_deref() != Some(node) {
            return self.kids.resume(node, id, bytes, ctx);
        }
        let (key, value, timestamp, headers): Encoded<K, A> = from_bincode(bytes)
            .map_err(|e| ProcessError::Fatal(format!("corrupt derived record of {node}: {e}")))?;
        let rec = Record {
            key,
            value,
            timestamp,
            headers,
        };
        ctx.forward_resumed(&mut self.kids, rec, id)?;
        Ok(true)
    }
}

/// The aggregate function of an aggregation.
pub(crate) type AggFn<K, V, A> = Arc<dyn Fn(&K, &V, A) -> A + Send + Sync>;

/// Windowed aggregation over a window store.
pub(crate) struct WindowAggNode<K, V, A> {
    pub(crate) store: StoreId,
    pub(crate) windows: TimeWindows,
    pub(crate) retention_ms: i64,
    pub(crate) emit: EmitMode,
    pub(crate) init: Arc<dyn Fn() -> A + Send + Sync>,
    pub(crate) agg: AggFn<K, V, A>,
    pub(crate) out: Emitter<Windowed<K>, A>,
    pub(crate) meta: Option<AggMeta>,
    pub(crate) last_expiry: i64,
    /// Metadata changed since the last flush. It is written to the store at
    /// the flush, once per commit rather than once per record (stream time
    /// moves with almost every record).
    meta_unsaved: bool,
    /// Latest results not yet forwarded (`OnCommit`), one per window of a
    /// key updated since the last flush, sorted by (window start, key) at the
    /// flush. The write cache's entry of each window says where its result
    /// is ([`CachedAggregate::pending`]): the per-record update finds both
    /// with the one lookup of the write cache.
    pending: Vec<PendingResult<K, A>>,
}

/// A windowed aggregate's latest result waiting for the flush.
pub(crate) struct PendingResult<K, A> {
    start: i64,
    key: Vec<u8>,
    /// Its place when it was taken.
    taken: usize,
    rec: Record<Windowed<K>, A>,
}

/// Cached results not yet forwarded, keyed by their encoded key.
pub(crate) type PendingMap<Key, R> = rustc_hash::FxHashMap<Key, R>;

/// Forwards cached results in key order (deterministic output at each flush).
fn emit_sorted<Key: Ord, K2, A2>(
    pending: &mut PendingMap<Key, Record<K2, A2>>,
    out: &mut Emitter<K2, A2>,
    ctx: &mut TaskCtx,
) -> Result<(), ProcessError>
where
    K2: Data + Serialize + DeserializeOwned,
    A2: Data + Serialize + DeserializeOwned,
{
    let mut recs: Vec<(Key, Record<K2, A2>)> = pending.drain().collect();
    recs.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    for (_, rec) in recs {
        out.emit(rec, ctx)?;
    }
    Ok(())
}

impl<K, V, A> WindowAggNode<K, V, A>
where
    K: Data + Serialize + DeserializeOwned,
    V: Data,
    A: Data + Serialize + DeserializeOwned,
{
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        store: StoreId,
        store_name: &str,
        windows: TimeWindows,
        retention_ms: i64,
        emit: EmitMode,
        init: Arc<dyn Fn() -> A + Send + Sync>,
        agg: AggFn<K, V, A>,
        kids: Forward<Windowed<K>, A>,
    ) -> Self {
        WindowAggNode {
            store,
            windows,
            retention_ms,
            emit,
            init,
            agg,
            out: Emitter::new(kids, store_name),
            meta: None,
            last_expiry: i64::MIN,
            meta_unsaved: false,
            pending: Vec::new(),
        }
    }

    /// The aggregation's metadata, read from its store the first time; the
    /// task's stream time is at least the one it holds (the task restores it
    /// from its progress record too).
    fn load_meta(&mut self, ctx: &mut TaskCtx) -> Result<AggMeta, ProcessError> {
        if let Some(m) = self.meta {
            return Ok(m);
        }
        let stored = match ctx.state().get(self.store, META_KEY)? {
            Some(stored) => Some(stored),
            None => ctx.state().get(self.store, LEGACY_META_KEY)?,
        };
        let m = match stored {
            Some(stored) => from_bincode(&stored.value)
                .map_err(|e| ProcessError::Fatal(format!("corrupt aggregation metadata: {e}")))?,
            None => AggMeta {
                stream_time: i64::MIN,
                emitted_until: i64::MIN,
            },
        };
        ctx.stream_time = ctx.stream_time.max(m.stream_time);
        ctx.closing_time = ctx.closing_time.max(m.stream_time);
        self.meta = Some(m);
        Ok(m)
    }

    fn save_meta(&mut self, m: AggMeta) {
        self.meta = Some(m);
        self.meta_unsaved = true;
    }

    /// Writes metadata changed since the last flush to the store.
    fn write_meta(&mut self, ctx: &mut TaskCtx) {
        if let (true, Some(m)) = (std::mem::take(&mut self.meta_unsaved), self.meta) {
            ctx.state_mut()
                .put(self.store, META_KEY.to_vec(), &to_bincode(&m));
        }
    }

    /// Emits every window closed by stream time and not emitted yet.
    fn emit_closed(
        &mut self,
        ctx: &mut TaskCtx,
        mut meta: AggMeta,
    ) -> Result<AggMeta, ProcessError> {
        let closed_until = ctx.closing_time.saturating_sub(self.windows.grace_ms);
        if closed_until <= meta.emitted_until {
            return Ok(meta);
        }
        let size = self.windows.size_ms;
        let from = meta.emitted_until.saturating_sub(size).saturating_add(1);
        let to = closed_until.saturating_sub(size).saturating_add(1);
        // Window starts are multiples of the advance: most steps of stream
        // time close no window, and need no scan.
        let advance = self.windows.advance_ms;
        let first_start = from.saturating_add((advance - from.rem_euclid(advance)) % advance);
        if first_start < to {
            for entry in ctx.state().window_range(self.store, from, to)? {
                let key: K = from_bincode(&entry.key)
                    .map_err(|e| ProcessError::Fatal(format!("corrupt window key: {e}")))?;
                let value: A = from_bincode(&entry.value.value)
                    .map_err(|e| ProcessError::Fatal(format!("corrupt window value: {e}")))?;
                let window = Window {
                    start: entry.start_ms,
                    end: entry.start_ms + size,
                };
                self.out.emit(
                    Record::new(Windowed { key, window }, value, window.end - 1),
                    ctx,
                )?;
            }
        }
        meta.emitted_until = closed_until;
        Ok(meta)
    }

    fn expire(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let st = ctx.closing_time;
        if st == i64::MIN || st < self.last_expiry.saturating_add(self.windows.advance_ms) {
            return Ok(());
        }
        self.last_expiry = st;
        ctx.state_mut()
            .expire_windows(self.store, st.saturating_sub(self.retention_ms))?;
        Ok(())
    }
}

impl<K, V, A> Node<K, V> for WindowAggNode<K, V, A>
where
    K: Data + Serialize + DeserializeOwned,
    V: Data,
    A: Data + Serialize + DeserializeOwned,
{
    fn process(&mut self, rec: Record<K, V>, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let mut meta = self.load_meta(ctx)?;
        // Late or not by the stream time when the record arrived: the same
        // answer whatever the order async calls before this node end in.
        let stream_time = ctx.record_stream_time();
        let key_bytes = to_bincode(&rec.key);
        for window in self.windows.windows_for(rec.timestamp) {
            if window.end.saturating_add(self.windows.grace_ms) <= stream_time {
                ctx.counters.late_dropped += 1;
                continue;
            }
            // Read, changed and written back in one write-cache lookup; the
            // aggregate stays decoded there until the commit encodes it, and
            // says where its pending result is.
            let init = &self.init;
            let cached =
                ctx.state_mut()
                    .window_update(self.store, &key_bytes, window.start, |stored| {
                        let current = match stored {
                            Some(s) => from_bincode(&s.value)
                                .map_err(|e| format!("corrupt window value: {e}"))?,
                            None => init(),
                        };
                        Ok(CachedAggregate {
                            value: Some(current),
                            pending: None,
                        })
                    })?;
            let current = cached.value.take().expect("an aggregate between updates");
            let updated = (self.agg)(&rec.key, &rec.value, current);
            cached.value = Some(updated.clone());
            let out = || Record {
                key: Windowed {
                    key: rec.key.clone(),
                    window,
                },
                value: updated.clone(),
                timestamp: rec.timestamp,
                headers: rec.headers.clone(),
            };
            match self.emit {
                EmitMode::OnUpdate => self.out.emit(out(), ctx)?,
                EmitMode::OnCommit => match cached
                    .pending
                    .and_then(|at| self.pending.get_mut(at))
                    // The place holds until the flush empties the results:
                    // it is this window's result only if it says so.
                    .filter(|waiting| waiting.start == window.start && waiting.key == key_bytes)
                {
                    // Updated in place: no key copies per record.
                    Some(waiting) => {
                        let waiting = &mut waiting.rec;
                        waiting.value = updated.clone();
                        waiting.timestamp = rec.timestamp;
                        waiting.headers.clone_from(&rec.headers);
                    }
                    None => {
                        let taken = self.pending.len();
                        cached.pending = Some(taken);
                        self.pending.push(PendingResult {
                            start: window.start,
                            key: key_bytes.clone(),
                            taken,
                            rec: out(),
                        });
                    }
                },
                EmitMode::OnWindowClose => {}
            }
        }
        let before = meta;
        // Windows close by the closing time: held back while records that
        // arrived before it are still in flight.
        if ctx.closing_time > meta.stream_time {
            meta.stream_time = ctx.closing_time;
        }
        if self.emit == EmitMode::OnWindowClose {
            meta = self.emit_closed(ctx, meta)?;
        }
        if meta.stream_time != before.stream_time || meta.emitted_until != before.emitted_until {
            self.save_meta(meta);
        }
        self.expire(ctx)
    }

    fn punctuate(&mut self, p: Punctuation, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        self.out.kids.punctuate(p, ctx)
    }

    fn flush(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        self.write_meta(ctx);
        let mut pending = std::mem::take(&mut self.pending);
        latest_in_order(&mut pending);
        for waiting in pending.drain(..) {
            self.out.emit(waiting.rec, ctx)?;
        }
        // The allocation is kept for the next period.
        self.pending = pending;
        self.out.kids.flush(ctx)
    }

    fn may_hold(&self) -> bool {
        false
    }

    fn resume(
        &mut self,
        node: &str,
        id: u64,
        bytes: &[u8],
        ctx: &mut TaskCtx,
    ) -> Result<bool, ProcessError> {
        self.out.resume(node, id, bytes, ctx)
    }
}

/// Sorts pending results by (window start, key), keeping the last of each
/// window: should a window's write-cache entry be made again before the
/// flush, it starts a second result, and the later one is the latest.
fn latest_in_order<K, A>(pending: &mut Vec<PendingResult<K, A>>) {
    // A window's results stay in the order they were taken (`taken`: the
    // results are unique, so an unstable sort keeps that order and moves
    // less than a stable one).
    pending.sort_unstable_by(|a, b| (a.start, &a.key, a.taken).cmp(&(b.start, &b.key, b.taken)));
    pending.dedup_by(|later, kept| {
        let same = later.start == kept.start && later.key == kept.key;
        if same {
            std::mem::swap(later, kept);
        }
        same
    });
}

/// A windowed aggregate kept decoded in the task's write cache between
/// commits (encoded with bincode at the commit).
struct CachedAggregate<A> {
    /// Empty only while an update holds it.
    value: Option<A>,
    /// Where this window's result is in its node's pending results, once it
    /// has one (`OnCommit`).
    pending: Option<usize>,
}

impl<A: Serialize + Send + 'static> sluice_state::CachedValue for CachedAggregate<A> {
    fn encode(&self) -> Vec<u8> {
        to_bincode(self.value.as_ref().expect("an aggregate between updates"))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// Aggregation over a key-value store (no windows).
pub(crate) struct KvAggNode<K, V, A> {
    pub(crate) store: StoreId,
    pub(crate) init: Arc<dyn Fn() -> A + Send + Sync>,
    pub(crate) agg: AggFn<K, V, A>,
    pub(crate) emit: EmitMode,
    pub(crate) out: Emitter<K, A>,
    pub(crate) pending: PendingMap<Vec<u8>, Record<K, A>>,
}

impl<K, V, A> Node<K, V> for KvAggNode<K, V, A>
where
    K: Data + Serialize + DeserializeOwned,
    V: Data,
    A: Data + Serialize + DeserializeOwned,
{
    fn process(&mut self, rec: Record<K, V>, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let key_bytes = to_bincode(&rec.key);
        let stored = ctx.state().get(self.store, &key_bytes)?;
        let current = match stored {
            Some(s) => from_bincode(&s.value)
                .map_err(|e| ProcessError::Fatal(format!("corrupt value: {e}")))?,
            None => (self.init)(),
        };
        let updated = (self.agg)(&rec.key, &rec.value, current);
        ctx.state_mut()
            .put(self.store, key_bytes.clone(), &to_bincode(&updated));
        let Record {
            key,
            timestamp,
            headers,
            ..
        } = rec;
        let out = Record {
            key,
            value: updated,
            timestamp,
            headers,
        };
        if self.emit == EmitMode::OnCommit {
            self.pending.insert(key_bytes, out);
            Ok(())
        } else {
            self.out.emit(out, ctx)
        }
    }

    fn punctuate(&mut self, p: Punctuation, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        self.out.kids.punctuate(p, ctx)
    }

    fn flush(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        emit_sorted(&mut self.pending, &mut self.out, ctx)?;
        self.out.kids.flush(ctx)
    }

    fn may_hold(&self) -> bool {
        false
    }

    fn resume(
        &mut self,
        node: &str,
        id: u64,
        bytes: &[u8],
        ctx: &mut TaskCtx,
    ) -> Result<bool, ProcessError> {
        self.out.resume(node, id, bytes, ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_sorts_below_every_window_key() {
        // Expiry and window range reads cover [window key of `from`, window
        // key of `to`); the smallest window key is that of i64::MIN.
        let lowest = sluice_state::encode_window_key(i64::MIN, b"");
        assert!(META_KEY < lowest.as_slice());
        assert!(
            LEGACY_META_KEY > lowest.as_slice(),
            "the old key sat inside the ranges"
        );
    }

    #[test]
    fn pending_results_are_forwarded_in_window_and_key_order_the_last_of_each_window() {
        let result = |start: i64, key: &[u8], value: u64, taken: usize| PendingResult {
            start,
            key: key.to_vec(),
            taken,
            rec: Record::new(
                Windowed {
                    key: key.to_vec(),
                    window: Window {
                        start,
                        end: start + 60_000,
                    },
                },
                value,
                start,
            ),
        };
        let mut pending: Vec<_> = [
            (60_000, b"b", 1),
            (0, b"b", 2),
            (60_000, b"a", 3),
            (0, b"b", 4),
            (60_000, b"b", 5),
            (0, b"a", 6),
            (0, b"b", 7),
        ]
        .into_iter()
        .enumerate()
        .map(|(taken, (start, key, value))| result(start, key, value, taken))
        .collect();
        latest_in_order(&mut pending);
        let got: Vec<(i64, &[u8], u64)> = pending
            .iter()
            .map(|p| (p.start, p.key.as_slice(), p.rec.value))
            .collect();
        let want: Vec<(i64, &[u8], u64)> = vec![
            (0, b"a", 6),
            (0, b"b", 7),
            (60_000, b"a", 3),
            (60_000, b"b", 5),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn tumbling_windows() {
        let w = TimeWindows::tumbling(Duration::from_secs(60));
        let got: Vec<Window> = w.windows_for(61_000).collect();
        assert_eq!(
            got,
            vec![Window {
                start: 60_000,
                end: 120_000
            }]
        );
        let got: Vec<Window> = w.windows_for(60_000).collect();
        assert_eq!(
            got,
            vec![Window {
                start: 60_000,
                end: 120_000
            }]
        );
        assert_eq!(w.windows_for(59_999).next().unwrap().start, 0);
    }

    #[test]
    fn hopping_windows_cover_the_timestamp() {
        let w = TimeWindows::hopping(Duration::from_secs(60), Duration::from_secs(20));
        let got: Vec<i64> = w.windows_for(65_000).map(|w| w.start).collect();
        assert_eq!(got, vec![20_000, 40_000, 60_000]);
        for win in w.windows_for(65_000) {
            assert!(win.start <= 65_000 && 65_000 < win.end);
        }
        assert!(
            TimeWindows::hopping(Duration::from_secs(1), Duration::from_secs(2))
                .validate()
                .is_err()
        );
    }
}
