//! The task status table: a topology that materialises every task's status
//! from the task topics (a task record there is an accepted submission:
//! `pending`) and the results topics (`completed` or `failed`, with the
//! result), into a changelogged key-value store keyed by (tenant, task id).
//!
//! Task topics are keyed by tenant, and a result goes to the partition of
//! its task's input partition, so a tenant's tasks and results share one
//! partition number: the status of every task of a tenant is in one task of
//! this topology, found by the tenant's key like its usage windows. The
//! same task keeps each tenant's backlog (tasks pending) and, once the
//! pipeline refused one of its tasks `quota_exceeded`, the end of the hard
//! quota's window: admission reads both.
//!
//! Each status written is also handed to [`Watchers`] at once, before the
//! store commits it: a long poll or an event stream waiting on the task is
//! answered as soon as the committed result was read (results are read
//! `read_committed`), and a read in the commit's interval still finds it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sluice_topology::{
    BytesCodec, ProcessError, Processor, ProcessorContext, Punctuation, Record, StreamBuilder,
    Topology, TopologyError,
};
use tokio::sync::oneshot;

use super::metrics::GatewayMetrics;
use crate::envelope::{decode_task, normalise_tenant, EnvelopeLimits, TaskResult};
use crate::steps::account::{Quotas, WindowSpec};

/// The status store: (tenant, task id) → [`StoredStatus`].
pub const STATUS_STORE: &str = "gateway-status";
/// The backlog store: tenant → tasks pending.
pub const BACKLOG_STORE: &str = "gateway-backlog";
/// The quota store: tenant → end of the hard-quota window the pipeline
/// refused a task in (ms).
pub const QUOTA_STORE: &str = "gateway-quota";
/// The failure code of a task refused for its tenant's hard quota.
const QUOTA_EXCEEDED: &str = "quota_exceeded";

/// Where a task is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Accepted (on its task topic), no result yet.
    Pending,
    /// Answered: a result on the completed topic.
    Completed,
    /// Given up: a result on the failed topic.
    Failed,
}

impl Phase {
    /// Whether the task has its result.
    pub fn is_final(self) -> bool {
        self != Phase::Pending
    }

    /// The event name of an event stream's last event.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "pending",
            Phase::Completed => "completed",
            Phase::Failed => "failed",
        }
    }
}

/// A task's status as stored (bincode).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredStatus {
    /// The task's type.
    pub task_type: String,
    /// Where it is.
    pub phase: Phase,
    /// When it was submitted (`submittedAt` of its first record seen), ms;
    /// `None` for a result whose task was never seen here.
    pub accepted_ms: Option<i64>,
    /// The result record as JSON text, once final.
    pub result: Option<String>,
    /// Last change, ms (wall clock): the time-to-live counts from it.
    pub updated_ms: i64,
}

/// A task's status as the API answers it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusView {
    /// The task.
    pub task_id: String,
    /// Its tenant.
    pub tenant_id: String,
    /// Its type.
    pub task_type: String,
    /// `pending`, `completed` or `failed`.
    pub status: Phase,
    /// When it was submitted (RFC 3339), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_at: Option<String>,
    /// The result record, as on the results topic, once final.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
}

impl StatusView {
    /// The view of a stored status.
    pub fn of(tenant: &str, task_id: &str, s: &StoredStatus) -> StatusView {
        StatusView {
            task_id: task_id.to_string(),
            tenant_id: tenant.to_string(),
            task_type: s.task_type.clone(),
            status: s.phase,
            accepted_at: s.accepted_ms.and_then(|ms| {
                chrono::DateTime::from_timestamp_millis(ms)
                    .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
            }),
            result: s
                .result
                .as_deref()
                .and_then(|r| serde_json::from_str(r).ok()),
        }
    }
}

/// The key of a status: normalised tenant, task id.
pub type StatusKey = (String, String);

/// How long a status written stays in [`Watchers`]' recent list: well over
/// a commit interval, so a read between the write and its commit finds it.
const RECENT: Duration = Duration::from_secs(10);

/// How long an accepted task is expected without its record being read.
const EXPECTED_FOR: Duration = Duration::from_secs(300);

/// Who waits on which task, and the statuses written lately (not yet
/// committed, perhaps), shared by the status processors and the HTTP
/// handlers of one instance.
#[derive(Default)]
pub struct Watchers {
    inner: Mutex<WatchersInner>,
}

#[derive(Default)]
struct WatchersInner {
    waiting: HashMap<StatusKey, Vec<oneshot::Sender<StoredStatus>>>,
    recent: HashMap<StatusKey, StoredStatus>,
    order: VecDeque<(Instant, StatusKey)>,
    /// Tasks a gateway accepted whose record this table has not read yet.
    expected: HashMap<StatusKey, (StoredStatus, Instant)>,
}

impl Watchers {
    /// A status was written: remember it and wake whoever waits on it.
    pub fn publish(&self, key: &StatusKey, status: &StoredStatus) {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        while inner
            .order
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > RECENT)
        {
            if let Some((_, old)) = inner.order.pop_front() {
                inner.recent.remove(&old);
            }
        }
        inner.expected.remove(key);
        inner.recent.insert(key.clone(), status.clone());
        inner.order.push_back((now, key.clone()));
        if let Some(waiters) = inner.waiting.remove(key) {
            for w in waiters {
                let _ = w.send(status.clone());
            }
        }
    }

    /// The status written lately for `key`, or that a gateway accepted it
    /// (its record not read yet), if either.
    pub fn recent(&self, key: &StatusKey) -> Option<StoredStatus> {
        let inner = self.inner.lock();
        inner
            .recent
            .get(key)
            .or_else(|| inner.expected.get(key).map(|(s, _)| s))
            .cloned()
    }

    /// When a gateway accepted `key`, if it said so and its record was not
    /// read yet.
    pub fn accepted_ms(&self, key: &StatusKey) -> Option<i64> {
        let inner = self.inner.lock();
        inner.expected.get(key).and_then(|(s, _)| s.accepted_ms)
    }

    /// A gateway accepted the task `key` (the broker acknowledged its
    /// record): it is pending until the table reads the record, so a read
    /// right after the 202, or an idempotent retry, finds it.
    pub fn expect(&self, key: &StatusKey, pending: StoredStatus) {
        let mut inner = self.inner.lock();
        if !inner.recent.contains_key(key) {
            inner
                .expected
                .insert(key.clone(), (pending, Instant::now()));
        }
    }

    /// Waits for the next status written for `key`: the one written lately
    /// when it is `final` already, else a receiver of the next.
    pub fn subscribe(
        &self,
        key: &StatusKey,
    ) -> Result<StoredStatus, oneshot::Receiver<StoredStatus>> {
        let mut inner = self.inner.lock();
        if let Some(s) = inner.recent.get(key).filter(|s| s.phase.is_final()) {
            return Ok(s.clone());
        }
        let (tx, rx) = oneshot::channel();
        let waiters = inner.waiting.entry(key.clone()).or_default();
        waiters.retain(|w| !w.is_closed());
        waiters.push(tx);
        Err(rx)
    }

    /// Forgets waiters that gave up (their receivers dropped), and
    /// expectations of records never read here (their partition moved).
    pub fn prune(&self) {
        let mut inner = self.inner.lock();
        inner.waiting.retain(|_, ws| {
            ws.retain(|w| !w.is_closed());
            !ws.is_empty()
        });
        inner
            .expected
            .retain(|_, (_, at)| at.elapsed() < EXPECTED_FOR);
    }
}

/// What the status processor reads: a task record or a result record.
#[derive(Clone, Debug)]
pub enum Incoming {
    /// A task record's value.
    Task(Option<Vec<u8>>),
    /// A result record's value.
    Result(Option<Vec<u8>>),
}

/// The settings of the status topology.
#[derive(Clone)]
pub struct StatusSettings {
    /// The task topics.
    pub task_topics: Vec<String>,
    /// The task types (to decode task records).
    pub task_types: Vec<String>,
    /// Task record limits (to decode task records).
    pub limits: EnvelopeLimits,
    /// The results topics.
    pub result_topics: Vec<String>,
    /// How long a status is kept after its last change.
    pub ttl: Duration,
    /// The accounting windows (to find a hard quota's window).
    pub windows: Vec<WindowSpec>,
    /// The tenants' quotas.
    pub quotas: Quotas,
}

impl StatusSettings {
    /// The end of the window of `tenant`'s hard quota that contains `at_ms`.
    fn quota_window_end(&self, tenant: &str, at_ms: i64) -> Option<i64> {
        let quota = self.quotas.hard(tenant)?;
        let w = self.windows.iter().find(|w| w.name == quota.window)?;
        Some(w.end_of(w.start_of(at_ms)))
    }
}

/// The status topology: task and results topics into the status and
/// backlog stores.
pub fn topology(
    settings: &StatusSettings,
    watchers: Arc<Watchers>,
    metrics: GatewayMetrics,
) -> Result<Topology, TopologyError> {
    let b = StreamBuilder::new();
    b.add_kv_store(STATUS_STORE, true);
    b.add_kv_store(BACKLOG_STORE, true);
    b.add_kv_store(QUOTA_STORE, true);
    let topics = |v: &[String]| v.to_vec();
    let task_topics = topics(&settings.task_topics);
    let result_topics = topics(&settings.result_topics);
    let tasks = b
        .stream(
            &task_topics.iter().map(String::as_str).collect::<Vec<_>>(),
            BytesCodec,
            BytesCodec,
        )
        .map_values(|_, v| Incoming::Task(v));
    let results = b
        .stream(
            &result_topics.iter().map(String::as_str).collect::<Vec<_>>(),
            BytesCodec,
            BytesCodec,
        )
        .map_values(|_, v| Incoming::Result(v));
    let settings = settings.clone();
    tasks.merge(&results).process(
        "gateway-status-table",
        &[STATUS_STORE, BACKLOG_STORE, QUOTA_STORE],
        move || StatusTable {
            settings: settings.clone(),
            watchers: watchers.clone(),
            metrics: metrics.clone(),
            sweep_after: None,
            next_pass_ms: i64::MIN,
            pending: 0,
            partition: None,
        },
    );
    b.build()
}

/// Entries looked at per punctuation by the time-to-live sweep.
const SWEEP_BATCH: usize = 500;
/// The longest time between two passes of the sweep over a store.
const SWEEP_PASS_MAX: Duration = Duration::from_secs(600);

/// The time between the starts of two sweep passes over a store: a
/// hundredth of the time-to-live (a status outlives it by at most that
/// much more, plus the pass itself: 500 entries per 50 ms punctuation),
/// at most [`SWEEP_PASS_MAX`]. Without a pause, a task of a
/// few hundred thousand statuses read and decoded them all again every
/// few seconds, idle or not.
fn sweep_pass_interval(ttl: Duration) -> Duration {
    (ttl / 100).min(SWEEP_PASS_MAX)
}

/// The status processor of one task (partition).
struct StatusTable {
    settings: StatusSettings,
    watchers: Arc<Watchers>,
    metrics: GatewayMetrics,
    /// Where the time-to-live sweep goes on (encoded key).
    sweep_after: Option<Vec<u8>>,
    /// When the next sweep pass may start (wall clock, ms).
    next_pass_ms: i64,
    /// Tasks pending in this partition (for the gauge).
    pending: i64,
    partition: Option<i32>,
}

type Ctx<'a> = ProcessorContext<'a, (), (), ()>;

impl StatusTable {
    fn set_pending(&mut self, delta: i64) {
        self.pending += delta;
        if let Some(p) = self.partition {
            self.metrics.set_partition_pending(p, self.pending);
        }
    }

    fn backlog(&mut self, ctx: &mut Ctx<'_>, tenant: &str, delta: i64) -> Result<(), ProcessError> {
        let mut store = ctx.kv::<String, i64>(BACKLOG_STORE)?;
        let key = tenant.to_string();
        let n = (store.get(&key)?.unwrap_or(0) + delta).max(0);
        if n == 0 {
            store.delete(&key);
        } else {
            store.put(&key, &n);
        }
        self.set_pending(delta);
        Ok(())
    }

    fn on_task(&mut self, ctx: &mut Ctx<'_>, bytes: &[u8]) -> Result<(), ProcessError> {
        let s = &self.settings;
        // Bad task records are the pipeline's to dead-letter; the table only
        // has nothing to show for them.
        let Ok(task) = decode_task(bytes, &s.limits, &s.task_types) else {
            self.metrics.skipped("task_undecodable");
            return Ok(());
        };
        let Some(tenant) = task.tenant().map(normalise_tenant) else {
            self.metrics.skipped("task_undecodable");
            return Ok(());
        };
        let key: StatusKey = (tenant.clone(), task.task_id.clone());
        if ctx
            .kv::<StatusKey, StoredStatus>(STATUS_STORE)?
            .get(&key)?
            .is_some()
        {
            // A re-published attempt, a replay, or a result read first.
            return Ok(());
        }
        let status = StoredStatus {
            task_type: task.task_type,
            phase: Phase::Pending,
            accepted_ms: Some(task.submitted_at.timestamp_millis()),
            result: None,
            updated_ms: ctx.wall_clock_ms(),
        };
        ctx.kv::<StatusKey, StoredStatus>(STATUS_STORE)?
            .put(&key, &status);
        self.backlog(ctx, &tenant, 1)?;
        self.watchers.publish(&key, &status);
        Ok(())
    }

    fn on_result(&mut self, ctx: &mut Ctx<'_>, bytes: &[u8]) -> Result<(), ProcessError> {
        let Ok(result) = serde_json::from_slice::<TaskResult>(bytes) else {
            self.metrics.skipped("result_undecodable");
            return Ok(());
        };
        let tenant = normalise_tenant(&result.tenant_id);
        let key: StatusKey = (tenant.clone(), result.task_id.clone());
        let before = ctx.kv::<StatusKey, StoredStatus>(STATUS_STORE)?.get(&key)?;
        let accepted_ms = match &before {
            Some(s) if s.phase.is_final() => {
                // One result per task: a second one is not the task's answer.
                self.metrics.skipped("second_result");
                return Ok(());
            }
            Some(s) => s.accepted_ms,
            // Read before its task record: a gateway that accepted it said when.
            None => self.watchers.accepted_ms(&key),
        };
        let now = ctx.wall_clock_ms();
        let status = StoredStatus {
            task_type: result.task_type.clone(),
            phase: if result.success {
                Phase::Completed
            } else {
                Phase::Failed
            },
            accepted_ms,
            result: Some(String::from_utf8_lossy(bytes).into_owned()),
            updated_ms: now,
        };
        ctx.kv::<StatusKey, StoredStatus>(STATUS_STORE)?
            .put(&key, &status);
        if result.error_code.as_deref() == Some(QUOTA_EXCEEDED) {
            self.quota_refused(ctx, &tenant, result.completed_at.timestamp_millis())?;
        }
        if before.is_some() {
            self.backlog(ctx, &tenant, -1)?;
        }
        if let Some(at) = accepted_ms {
            self.metrics.accept_to_result(now - at);
        }
        self.watchers.publish(&key, &status);
        Ok(())
    }

    /// The pipeline refused a task of `tenant` for its hard quota at
    /// `at_ms`: its window counts as used up until it ends.
    fn quota_refused(
        &mut self,
        ctx: &mut Ctx<'_>,
        tenant: &str,
        at_ms: i64,
    ) -> Result<(), ProcessError> {
        let Some(end) = self.settings.quota_window_end(tenant, at_ms) else {
            return Ok(());
        };
        let mut store = ctx.kv::<String, i64>(QUOTA_STORE)?;
        let key = tenant.to_string();
        if store.get(&key)?.is_none_or(|until| until < end) {
            store.put(&key, &end);
        }
        Ok(())
    }

    /// Deletes statuses unchanged for longer than the time-to-live, a few
    /// hundred entries per tick (a pending one leaves the backlog too), in
    /// passes over the store that start [`sweep_pass_interval`] apart.
    fn sweep(&mut self, ctx: &mut Ctx<'_>, now: i64) -> Result<(), ProcessError> {
        if self.sweep_after.is_none() {
            // A new pass: not before its time.
            if now < self.next_pass_ms {
                return Ok(());
            }
            self.next_pass_ms = now + sweep_pass_interval(self.settings.ttl).as_millis() as i64;
        }
        let ttl = self.settings.ttl.as_millis() as i64;
        let batch = ctx
            .kv::<StatusKey, StoredStatus>(STATUS_STORE)?
            .scan_after_bytes(self.sweep_after.as_deref(), SWEEP_BATCH)?;
        self.sweep_after = (batch.len() == SWEEP_BATCH)
            .then(|| batch.last().map(|(k, _, _)| k.clone()))
            .flatten();
        for (_, key, status) in batch {
            if now - status.updated_ms > ttl {
                ctx.kv::<StatusKey, StoredStatus>(STATUS_STORE)?
                    .delete(&key);
                if !status.phase.is_final() {
                    self.backlog(ctx, &key.0, -1)?;
                }
            }
        }
        Ok(())
    }
}

impl Processor<Option<Vec<u8>>, Incoming> for StatusTable {
    type OutKey = ();
    type OutValue = ();
    type Output = ();

    fn init(&mut self, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        let partition = ctx.task_id().partition;
        self.partition = Some(partition);
        let pending: i64 = ctx
            .kv::<String, i64>(BACKLOG_STORE)?
            .scan_prefix_bytes(&[])?
            .into_iter()
            .map(|(_, n)| n)
            .sum();
        self.pending = pending;
        self.metrics.set_partition_pending(partition, pending);
        Ok(())
    }

    fn process(
        &mut self,
        record: Record<Option<Vec<u8>>, Incoming>,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), ProcessError> {
        match record.value {
            Incoming::Task(Some(v)) => self.on_task(ctx, &v),
            Incoming::Result(Some(v)) => self.on_result(ctx, &v),
            Incoming::Task(None) | Incoming::Result(None) => {
                self.metrics.skipped("tombstone");
                Ok(())
            }
        }
    }

    fn punctuate(&mut self, time: Punctuation, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        self.watchers.prune();
        self.sweep(ctx, time.wall_clock_ms)
    }
}

impl Drop for StatusTable {
    fn drop(&mut self) {
        if let Some(p) = self.partition {
            self.metrics.forget_partition(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_topology::TopologyTestDriver;

    const TASKS: &str = "t.tasks.classify";
    const HOUR_MS: i64 = 3_600_000;

    fn table() -> TopologyTestDriver {
        let settings = StatusSettings {
            task_topics: vec![TASKS.into()],
            task_types: vec!["classify".into()],
            limits: EnvelopeLimits::default(),
            result_topics: vec!["t.results.completed".into(), "t.results.failed".into()],
            ttl: Duration::from_millis(HOUR_MS as u64),
            windows: Vec::new(),
            quotas: Quotas::default(),
        };
        let metrics = GatewayMetrics::register(&prometheus::Registry::new()).unwrap();
        let topology = topology(&settings, Arc::new(Watchers::default()), metrics).unwrap();
        TopologyTestDriver::new(topology).unwrap()
    }

    fn accept(driver: &mut TopologyTestDriver, id: &str) {
        let task = serde_json::json!({
            "taskId": id,
            "tenantId": "acme",
            "taskType": "classify",
            "submittedAt": "2026-12-05T10:00:00Z",
            "attemptNumber": 1,
            "payload": { "content": "shares rose", "labels": ["news", "tech"] },
        });
        let bytes = serde_json::to_vec(&task).unwrap();
        driver
            .pipe_raw(TASKS, Some(b"acme"), Some(&bytes), 0)
            .unwrap();
    }

    /// Statuses of the status store deleted so far (committed).
    fn deleted(driver: &mut TopologyTestDriver) -> usize {
        driver.commit().unwrap();
        driver
            .changelog_records()
            .iter()
            .filter(|(store, r)| store == STATUS_STORE && r.value.is_none())
            .count()
    }

    #[test]
    fn expired_statuses_are_swept_in_passes_a_hundredth_of_the_ttl_apart() {
        let t0 = 1_800_000_000_000;
        let interval = sweep_pass_interval(Duration::from_millis(HOUR_MS as u64));
        assert_eq!(interval, Duration::from_secs(36));
        let mut driver = table();
        driver.punctuate(t0).unwrap();
        accept(&mut driver, "a");
        // A pass 10 s before the status expires finds nothing to delete.
        driver.punctuate(t0 + HOUR_MS - 10_000).unwrap();
        assert_eq!(deleted(&mut driver), 0);
        // Expired 1 s later, but the next pass is not due yet.
        driver.punctuate(t0 + HOUR_MS + 1_000).unwrap();
        assert_eq!(
            deleted(&mut driver),
            0,
            "a pass started before its interval"
        );
        // The next pass (36 s after the last one started) deletes it.
        driver.punctuate(t0 + HOUR_MS + 26_000).unwrap();
        assert_eq!(deleted(&mut driver), 1);
    }
}
