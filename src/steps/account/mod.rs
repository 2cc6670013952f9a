//! `account`: per-tenant token and cost accounts in windowed stores.
//!
//! On the results stream, in the same task as the LLM call: tasks are keyed
//! by tenant, so the task that owns a tenant's partition owns its accounts,
//! and no other instance ever updates them. Each completed result adds its
//! request, tokens and cost (and its model's share) to the tenant's tumbling
//! window of every configured size (by default 1 minute, 1 hour, 1 day and
//! the calendar month), one RocksDB window store with a changelog topic per size, each
//! with its own retention. The updates go to the usage topic
//! (`ai.usage.tenant`), keyed by tenant, in the task's own partition: by
//! default the latest state of each window updated since the task's last
//! commit, once per commit, as a cached Kafka Streams table emits
//! ([`UsageUpdates::OnCommit`]), so the topic grows with the windows in use
//! rather than with results; or one record per result and window
//! ([`UsageUpdates::OnUpdate`]). When a
//! window's cost crosses a threshold of the tenant's budget for that window
//! size (default 50 %, 80 %, 100 %), one alert goes to the alerts topic
//! (`ai.alerts.cost`); the window itself records the (threshold, budget)
//! pairs alerted, so each (tenant, window, threshold, budget) is alerted
//! once, and a changed budget's thresholds alert again. A failed result
//! counts with what its calls were billed; a hard-quota refusal raises one
//! `quota_exceeded` alert per tenant and quota window.
//!
//! Under exactly-once the window updates, the usage records and the results
//! commit in one transaction, so the accounts always equal the sum of the
//! results a `read_committed` reader sees: a crash aborts the transaction,
//! and the restarted task counts again exactly what it emits again. Results
//! re-emitted to a redelivered task carry `sluice.duplicate` and are not
//! counted again.

pub mod config;
pub mod pricing;
pub mod quota;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus::{IntCounterVec, Opts, Registry};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use sluice_topology::{
    Data, KStream, OutputRecord, ProcessError, Processor, ProcessorContext, Punctuation, Record,
    StreamBuilder,
};

use crate::envelope::{TaskEnvelope, TaskResult, HEADER_DUPLICATE, QUOTA_EXCEEDED};
use crate::steps::route::DowngradeHook;
pub use quota::{Amount, Quota, QuotaDecision, QuotaGate, QuotaMode, Quotas, Reservations};

/// A window size and how long its windows are kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowSpec {
    /// Its name in usage records and store names (e.g. `1h`).
    pub name: String,
    /// Window size, ms (tumbling, aligned to the epoch); unset for calendar
    /// windows.
    #[serde(default)]
    pub size_ms: i64,
    /// Calendar windows instead of a fixed size: `"month"` (calendar
    /// months in UTC, 1st 00:00 to the next 1st).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calendar: Option<Calendar>,
    /// How long a window is kept after it starts, ms.
    pub retention_ms: i64,
}

/// Calendar windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Calendar {
    /// Calendar months, in UTC.
    Month,
}

/// The first instant (ms) of the calendar month `months` after the one
/// holding `at_ms`, in UTC.
fn month_start(at_ms: i64, months: i32) -> i64 {
    use chrono::{Datelike, TimeZone};
    let Some(at) = chrono::Utc.timestamp_millis_opt(at_ms).single() else {
        return at_ms;
    };
    let index = at.year() * 12 + at.month0() as i32 + months;
    chrono::Utc
        .with_ymd_and_hms(
            index.div_euclid(12),
            index.rem_euclid(12) as u32 + 1,
            1,
            0,
            0,
            0,
        )
        .single()
        .map_or(at_ms, |d| d.timestamp_millis())
}

impl WindowSpec {
    /// A fixed-size window spec.
    pub fn fixed(name: &str, size_ms: i64, retention_ms: i64) -> WindowSpec {
        WindowSpec {
            name: name.into(),
            size_ms,
            calendar: None,
            retention_ms,
        }
    }

    /// The start (ms) of the window holding `at_ms`.
    pub fn start_of(&self, at_ms: i64) -> i64 {
        match self.calendar {
            Some(Calendar::Month) => month_start(at_ms, 0),
            None => at_ms - at_ms.rem_euclid(self.size_ms.max(1)),
        }
    }

    /// The end (ms, exclusive) of the window starting at `start`.
    pub fn end_of(&self, start: i64) -> i64 {
        match self.calendar {
            Some(Calendar::Month) => month_start(start, 1),
            None => start + self.size_ms,
        }
    }

    /// The longest a window of this spec lasts, ms.
    pub fn longest_ms(&self) -> i64 {
        match self.calendar {
            Some(Calendar::Month) => 31 * DAY_MS,
            None => self.size_ms,
        }
    }

    /// How long a window is kept after it starts: its retention, at least its
    /// longest size.
    pub fn kept_ms(&self) -> i64 {
        self.retention_ms.max(self.longest_ms())
    }
}

const HOUR_MS: i64 = 3_600_000;
const DAY_MS: i64 = 24 * HOUR_MS;

/// A threshold in millionths of its budget (how windows record it).
fn millionths(threshold: f64) -> u32 {
    (threshold * 1e6).round().clamp(0.0, f64::from(u32::MAX)) as u32
}

/// The default windows: 1 minute, 1 hour, 1 day (UTC days), and the
/// calendar month (UTC), kept long enough to bill the month before.
pub fn default_windows() -> Vec<WindowSpec> {
    vec![
        WindowSpec::fixed("1m", 60_000, 2 * HOUR_MS),
        WindowSpec::fixed("1h", HOUR_MS, 2 * DAY_MS),
        WindowSpec::fixed("1d", DAY_MS, 35 * DAY_MS),
        WindowSpec {
            calendar: Some(Calendar::Month),
            ..WindowSpec::fixed("1mo", 0, 100 * DAY_MS)
        },
    ]
}

/// One model's share of a window.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelUsage {
    /// Results counted: answered, or failed after their calls were billed.
    pub requests: u64,
    /// Prompt tokens (cached included).
    pub input_tokens: u64,
    /// Completion tokens.
    pub output_tokens: u64,
    /// Prompt tokens served from cache.
    pub cached_tokens: u64,
    /// Cost, micro-dollars.
    pub cost_micros: i64,
}

impl ModelUsage {
    fn add(&mut self, r: &TaskResult) {
        self.requests += 1;
        self.input_tokens += r.input_tokens;
        self.output_tokens += r.output_tokens;
        self.cached_tokens += r.cached_tokens;
        self.cost_micros += r.cost_micros;
    }
}

/// The per-model shares of a window, in model-name order. A tenant uses a
/// few models, so a short sorted list beats a tree map; it encodes as a map
/// (the same bytes and JSON a `BTreeMap` has).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ByModel(Vec<(String, ModelUsage)>);

impl ByModel {
    /// A model's share, if it has one.
    pub fn get(&self, model: &str) -> Option<&ModelUsage> {
        self.find(model).ok().map(|i| &self.0[i].1)
    }

    /// A model's share, added (zero) when it has none.
    pub fn entry(&mut self, model: &str) -> &mut ModelUsage {
        let i = match self.find(model) {
            Ok(i) => i,
            Err(i) => {
                // One more slot, not the four an empty `Vec` grows to: most
                // windows hold one or two models, and many are in memory.
                self.0.reserve_exact(1);
                self.0.insert(i, (model.to_string(), ModelUsage::default()));
                i
            }
        };
        &mut self.0[i].1
    }

    fn find(&self, model: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(m, _)| m.as_str().cmp(model))
    }

    /// Every model's share, in model-name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &ModelUsage)> {
        self.0.iter().map(|(m, u)| (m.as_str(), u))
    }

    /// Number of models.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True without any model.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::ops::Index<&str> for ByModel {
    type Output = ModelUsage;

    fn index(&self, model: &str) -> &ModelUsage {
        self.get(model)
            .unwrap_or_else(|| panic!("no usage of model {model}"))
    }
}

impl From<ByModel> for BTreeMap<String, ModelUsage> {
    fn from(m: ByModel) -> Self {
        m.0.into_iter().collect()
    }
}

impl Serialize for ByModel {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(m, u)| (m, u)))
    }
}

impl<'de> Deserialize<'de> for ByModel {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = ByModel;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map of model names to usage")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<ByModel, A::Error> {
                let mut out = ByModel(Vec::with_capacity(map.size_hint().unwrap_or(0).min(16)));
                while let Some((model, usage)) = map.next_entry::<String, ModelUsage>()? {
                    match out.find(&model) {
                        Ok(i) => out.0[i].1 = usage,
                        Err(i) => {
                            out.0.reserve_exact(1);
                            out.0.insert(i, (model, usage))
                        }
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_map(Visit)
    }
}

/// A tenant's window: totals, the per-model breakdown, and the alerts it
/// raised (kept with the window, so an alert is emitted once per window,
/// across restarts and replays).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantUsage {
    /// Totals over every model.
    pub total: ModelUsage,
    /// Per model.
    pub by_model: ByModel,
    /// Budget alerts raised: (threshold in millionths, budget in
    /// micro-dollars). A threshold of a budget alerts once; the same
    /// threshold of another budget (the budget changed) alerts again.
    pub alerted: Vec<(u32, i64)>,
    /// Whether the tenant's soft quota for this window was alerted.
    pub quota_alerted: bool,
    /// Whether a hard-quota refusal in this window was alerted.
    pub refusal_alerted: bool,
    /// A window written before alerts were recorded by budget: how many of
    /// the configured thresholds it had alerted (read as those thresholds
    /// of the current budget).
    legacy_alerted: Option<u8>,
}

/// In place of the count of thresholds alerted that earlier versions wrote
/// at the same position: the window records its alerts by budget.
const ALERTS_BY_BUDGET: u8 = u8::MAX;

/// Windows are stored with bincode, which has no field names: the layout is
/// (total, by_model, marker, quota_alerted, alerted, refusal_alerted), and
/// a window of an earlier version has its count of thresholds alerted where
/// the marker is (and nothing after `quota_alerted` that is read).
impl Serialize for TenantUsage {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let mut t = s.serialize_tuple(6)?;
        t.serialize_element(&self.total)?;
        t.serialize_element(&self.by_model)?;
        t.serialize_element(&ALERTS_BY_BUDGET)?;
        t.serialize_element(&self.quota_alerted)?;
        t.serialize_element(&self.alerted)?;
        t.serialize_element(&self.refusal_alerted)?;
        t.end()
    }
}

impl<'de> Deserialize<'de> for TenantUsage {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = TenantUsage;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a tenant's window")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<TenantUsage, A::Error> {
                use serde::de::Error;
                macro_rules! next {
                    ($i:expr) => {
                        seq.next_element()?
                            .ok_or_else(|| A::Error::invalid_length($i, &self))?
                    };
                }
                let total = next!(0);
                let by_model = next!(1);
                let marker: u8 = next!(2);
                let quota_alerted = next!(3);
                if marker != ALERTS_BY_BUDGET {
                    return Ok(TenantUsage {
                        total,
                        by_model,
                        quota_alerted,
                        legacy_alerted: Some(marker),
                        ..TenantUsage::default()
                    });
                }
                Ok(TenantUsage {
                    total,
                    by_model,
                    quota_alerted,
                    alerted: next!(4),
                    refusal_alerted: next!(5),
                    legacy_alerted: None,
                })
            }
        }
        d.deserialize_tuple(6, Visit)
    }
}

impl TenantUsage {
    /// Adds a completed result.
    pub fn add(&mut self, r: &TaskResult) {
        self.total.add(r);
        self.by_model.entry(&r.model).add(r);
    }

    /// Prompt plus completion tokens, and cost: what quotas count.
    pub fn amount(&self) -> Amount {
        Amount {
            tokens: self.total.input_tokens + self.total.output_tokens,
            cost_micros: self.total.cost_micros,
        }
    }
}

/// When window updates go to the usage topic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageUpdates {
    /// The latest state of each window updated since the task's last
    /// commit, once per commit (in the commit's transaction under
    /// exactly-once), as Kafka Streams' record cache emits a table's
    /// updates: the usage topic grows with the windows in use, not with the
    /// results.
    #[default]
    OnCommit,
    /// Every update: one record per counted result and window.
    OnUpdate,
}

/// A usage update, on the usage topic (keyed by tenant): the tenant and
/// its window's totals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageRecord {
    /// The tenant.
    pub tenant_id: String,
    /// The window.
    #[serde(flatten)]
    pub usage: WindowUsage,
}

/// One window of a tenant: in usage updates, and in answers to usage
/// queries (zeros when it has no usage).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WindowUsage {
    /// The window size's name (`1m`, `1h`, …).
    pub window: String,
    /// Window start, ms since the epoch.
    pub window_start: i64,
    /// Window end (exclusive), ms since the epoch.
    pub window_end: i64,
    /// Results counted: answered, or failed after their calls were billed.
    pub requests: u64,
    /// Prompt tokens (cached included).
    pub input_tokens: u64,
    /// Completion tokens.
    pub output_tokens: u64,
    /// Prompt tokens served from cache.
    pub cached_tokens: u64,
    /// Cost, micro-dollars.
    pub cost_micros: i64,
    /// Per model.
    pub by_model: BTreeMap<String, ModelUsage>,
}

impl WindowUsage {
    /// The window of size `w` starting at `start` holding `usage`.
    pub fn new(w: &WindowSpec, start: i64, usage: TenantUsage) -> Self {
        WindowUsage {
            window: w.name.clone(),
            window_start: start,
            window_end: w.end_of(start),
            requests: usage.total.requests,
            input_tokens: usage.total.input_tokens,
            output_tokens: usage.total.output_tokens,
            cached_tokens: usage.total.cached_tokens,
            cost_micros: usage.total.cost_micros,
            by_model: usage.by_model.into(),
        }
    }
}

/// A cost alert, on the alerts topic (keyed by tenant).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AlertRecord {
    /// `<tenant>/<window>/<window start>/<threshold>/<budget micros>` (a
    /// budget's), `…/quota` (a soft quota's) or `…/quota_exceeded` (a hard
    /// quota's first refusal): the same alert always has the same id.
    pub alert_id: String,
    /// `budget` (a threshold of the cost budget), `quota` (a soft quota
    /// crossed) or `quota_exceeded` (a hard quota refused a task).
    pub kind: String,
    /// The tenant.
    pub tenant_id: String,
    /// The window size's name.
    pub window: String,
    /// Window start, ms since the epoch.
    pub window_start: i64,
    /// Window end (exclusive), ms since the epoch.
    pub window_end: i64,
    /// The fraction of the budget crossed (e.g. 0.8).
    pub threshold: f64,
    /// Spent in the window when it was crossed, micro-dollars.
    pub spent_micros: i64,
    /// The window's budget (for a quota: its cost cap, 0 without one),
    /// micro-dollars.
    pub budget_micros: i64,
    /// A quota alert: tokens used in the window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spent_tokens: Option<u64>,
    /// A quota alert: the quota's token cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota_tokens: Option<u64>,
    /// When the alert was emitted.
    pub emitted_at: chrono::DateTime<chrono::Utc>,
}

/// Budgets per window name (micro-dollars), with per-tenant overrides.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Budgets {
    /// Every tenant's budget per window name, unless overridden.
    pub default: BTreeMap<String, i64>,
    /// Per tenant: budget per window name.
    pub tenants: BTreeMap<String, BTreeMap<String, i64>>,
}

impl Budgets {
    /// A tenant's budget for a window size, if any.
    pub fn budget(&self, tenant: &str, window: &str) -> Option<i64> {
        self.tenants
            .get(tenant)
            .and_then(|b| b.get(window))
            .or_else(|| self.default.get(window))
            .copied()
            .filter(|b| *b > 0)
    }
}

/// The `account` operator's settings.
#[derive(Clone, Debug)]
pub struct AccountingSettings {
    /// The operator's name; its stores are `<name>-<window name>`.
    pub name: String,
    /// Window sizes.
    pub windows: Vec<WindowSpec>,
    /// Where usage updates go.
    pub usage_topic: String,
    /// When they go.
    pub usage_updates: UsageUpdates,
    /// Budgets.
    pub budgets: Budgets,
    /// Alert thresholds, fractions of a budget, rising.
    pub thresholds: Vec<f64>,
    /// Where cost alerts go.
    pub alerts_topic: String,
    /// Token and cost quotas.
    pub quotas: Quotas,
    /// Route a tenant's tasks one tier down once its cost passes this
    /// fraction of a budget (soft quotas crossed always do).
    pub downgrade_at: Option<f64>,
}

/// What adding a result to its windows emits.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// A threshold (or soft quota) crossed.
    Alert(AlertRecord),
    /// A window's totals changed (read them from its store).
    Usage {
        /// The window size: an index into the configured windows.
        window: usize,
        /// The window's start, ms since the epoch.
        start: i64,
    },
}

/// The `account` operator.
#[derive(Clone)]
pub struct Accounting(Arc<Inner>);

impl std::fmt::Debug for Accounting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Accounting").field(&self.0.settings).finish()
    }
}

struct Inner {
    settings: AccountingSettings,
    /// The window store of each window size, in `settings.windows` order.
    stores: Vec<String>,
    /// Tenants routed down, until the end of the window that put them there
    /// (ms). Every task of a tenant runs where its partition is, so this
    /// instance's view is the tenant's.
    pressure: Mutex<HashMap<String, i64>>,
    alerts: Option<IntCounterVec>,
}

impl Accounting {
    /// An operator with `settings` (no metrics).
    pub fn new(settings: AccountingSettings) -> Self {
        Self::with_alerts(settings, None)
    }

    fn with_alerts(settings: AccountingSettings, alerts: Option<IntCounterVec>) -> Self {
        let stores = settings
            .windows
            .iter()
            .map(|w| store_name(&settings.name, w))
            .collect();
        Accounting(Arc::new(Inner {
            settings,
            stores,
            pressure: Mutex::new(HashMap::new()),
            alerts,
        }))
    }

    /// An operator counting its alerts in `sluice_alerts_emitted_total{kind}`.
    pub fn registered(
        settings: AccountingSettings,
        registry: &Registry,
    ) -> prometheus::Result<Self> {
        let alerts = IntCounterVec::new(
            Opts::new(
                "sluice_alerts_emitted_total",
                "Cost alerts emitted, by kind (budget, quota, quota_exceeded).",
            ),
            &["kind"],
        )?;
        registry.register(Box::new(alerts.clone()))?;
        Ok(Self::with_alerts(settings, Some(alerts)))
    }

    fn settings(&self) -> &AccountingSettings {
        &self.0.settings
    }

    /// The gate `invoke_llm` enforces hard quotas with (none without quotas).
    pub fn quota_gate(&self) -> Option<QuotaGate> {
        let s = self.settings();
        if s.quotas.is_empty() {
            return None;
        }
        let windows = s
            .windows
            .iter()
            .filter(|w| {
                s.quotas
                    .default
                    .iter()
                    .chain(s.quotas.tenants.values())
                    .any(|q| q.window == w.name)
            })
            .map(|w| (w.name.clone(), (self.store_name(w), w.clone())))
            .collect();
        Some(QuotaGate::new(s.quotas.clone(), windows))
    }

    /// Whether any tenant can be routed down (`downgrade_at` set, or a soft
    /// quota).
    pub fn routes_down(&self) -> bool {
        let s = self.settings();
        s.downgrade_at.is_some()
            || s.quotas
                .default
                .iter()
                .chain(s.quotas.tenants.values())
                .any(|q| q.mode == QuotaMode::Soft)
    }

    /// The router's down-routing hook: a tenant past a soft quota (or
    /// `downgrade_at` of a budget) in a window that has not ended.
    pub fn downgrade_hook(&self) -> DowngradeHook {
        let me = self.clone();
        Arc::new(move |task: &TaskEnvelope| {
            let Some(tenant) = task.tenant() else {
                return false;
            };
            let now = chrono::Utc::now().timestamp_millis();
            me.0.pressure
                .lock()
                .get(tenant)
                .is_some_and(|until| now < *until)
        })
    }

    /// The window store of a window size.
    pub fn store_name(&self, window: &WindowSpec) -> String {
        store_name(&self.settings().name, window)
    }

    /// The window stores, in `windows` order.
    fn stores(&self) -> &[String] {
        &self.0.stores
    }

    /// Declares the window stores (unless declared already: `invoke_llm`
    /// reads them too) and returns their names, in `windows` order.
    pub fn declare_stores(&self, builder: &StreamBuilder) -> &[String] {
        for (w, name) in self.windows().iter().zip(self.stores()) {
            if !builder.has_store(name) {
                builder.add_window_store(name, Duration::from_millis(w.kept_ms() as u64));
            }
        }
        self.stores()
    }

    /// The window sizes.
    pub fn windows(&self) -> &[WindowSpec] {
        &self.settings().windows
    }
}

/// The window store of a window size, for the operator named `name`.
fn store_name(name: &str, window: &WindowSpec) -> String {
    format!("{name}-{}", window.name)
}

/// `account` on a stream of results.
pub trait AccountStreamExt {
    /// Adds each completed result to its tenant's windows and passes every
    /// result on unchanged.
    fn account(&self, accounting: &Accounting) -> KStream<String, TaskResult>;
}

impl AccountStreamExt for KStream<String, TaskResult> {
    fn account(&self, accounting: &Accounting) -> KStream<String, TaskResult> {
        let names = accounting.declare_stores(self.builder());
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let a = accounting.clone();
        self.process(&accounting.settings().name, &refs, move || Accountant {
            accounting: a.clone(),
            last_expiry_ms: 0,
            held: Held::default(),
        })
    }
}

/// One instance per task.
struct Accountant {
    accounting: Accounting,
    last_expiry_ms: i64,
    /// [`UsageUpdates::OnCommit`]: the windows updated since the last
    /// commit, with their latest state.
    held: Held,
}

/// Windows held before they are emitted at a commit, at most: past it they
/// are emitted at once (as a full record cache evicts), which bounds the
/// outputs one flush makes.
const MAX_HELD_WINDOWS: usize = 100_000;

/// Windows updated since the last commit, per tenant (their state is read
/// back from the stores when they are emitted).
#[derive(Default)]
struct Held {
    by_tenant: FxHashMap<String, Vec<Pending>>,
    windows: usize,
}

/// A window updated since the last commit.
struct Pending {
    /// An index into the windows.
    window: usize,
    start: i64,
    /// The latest completion time of the results counted into it since the
    /// last commit (the usage record's timestamp).
    at: i64,
}

/// A usage record as written: [`UsageRecord`]'s JSON, serialized without
/// serde's (slow) flattening.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct UsageOut<'a> {
    tenant_id: &'a str,
    window: &'a str,
    window_start: i64,
    window_end: i64,
    requests: u64,
    input_tokens: u64,
    output_tokens: u64,
    cached_tokens: u64,
    cost_micros: i64,
    by_model: &'a ByModel,
}

impl<'a> UsageOut<'a> {
    fn new(tenant_id: &'a str, w: &'a WindowSpec, start: i64, usage: &'a TenantUsage) -> Self {
        UsageOut {
            tenant_id,
            window: &w.name,
            window_start: start,
            window_end: w.end_of(start),
            requests: usage.total.requests,
            input_tokens: usage.total.input_tokens,
            output_tokens: usage.total.output_tokens,
            cached_tokens: usage.total.cached_tokens,
            cost_micros: usage.total.cost_micros,
            by_model: &usage.by_model,
        }
    }
}

type Ctx<'a> = ProcessorContext<'a, String, TaskResult, ()>;

impl Held {
    /// Holds a window updated.
    fn hold(&mut self, tenant: &str, window: usize, start: i64, at: i64) {
        let held = match self.by_tenant.get_mut(tenant) {
            Some(held) => held,
            None => self.by_tenant.entry(tenant.to_string()).or_default(),
        };
        match held
            .iter_mut()
            .find(|p| p.window == window && p.start == start)
        {
            Some(p) => p.at = p.at.max(at),
            None => {
                held.push(Pending { window, start, at });
                self.windows += 1;
            }
        }
    }

    /// Everything held, tenants in order.
    fn take(&mut self) -> Vec<(String, Vec<Pending>)> {
        self.windows = 0;
        let mut tenants: Vec<_> = self.by_tenant.drain().collect();
        tenants.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        tenants
    }
}

impl Accountant {
    /// Emits the windows held, tenants in order.
    fn emit_held(&mut self, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        if self.held.windows == 0 {
            return Ok(());
        }
        let accounting = self.accounting.clone();
        let (settings, windows) = (accounting.settings(), accounting.windows());
        for (tenant, updates) in self.held.take() {
            for p in updates {
                let w = &windows[p.window];
                let store = &accounting.stores()[p.window];
                let record = usage_record(ctx, store, &tenant, w, p.start)?;
                emit_json(ctx, &settings.usage_topic, &tenant, p.at, record)?;
            }
        }
        Ok(())
    }
}

/// The usage record of a tenant's window as its store holds it now (JSON).
fn usage_record(
    ctx: &mut Ctx<'_>,
    store: &str,
    tenant: &String,
    w: &WindowSpec,
    start: i64,
) -> Result<Vec<u8>, ProcessError> {
    ctx.window::<String, TenantUsage>(store)?
        .peek(tenant, start, |usage| {
            let empty = TenantUsage::default();
            let usage = usage.unwrap_or(&empty);
            serde_json::to_vec(&UsageOut::new(tenant, w, start, usage))
        })?
        .map_err(|e| ProcessError::Fatal(format!("usage record encoding: {e}")))
}

/// Emits a JSON record keyed by tenant in the task's own partition (as its
/// results).
fn emit_json(
    ctx: &mut Ctx<'_>,
    topic: &str,
    tenant: &str,
    at: i64,
    json: Vec<u8>,
) -> Result<(), ProcessError> {
    ctx.emit(OutputRecord {
        topic: topic.to_string(),
        partition: Some(ctx.task_id().partition),
        key: Some(tenant.as_bytes().to_vec()),
        value: Some(json),
        timestamp: at,
        headers: Vec::new(),
    })?;
    Ok(())
}

/// An alert of `tenant`'s quota `q` on its window starting at `start`
/// (`kind`: `quota` for a soft quota crossed, `quota_exceeded` for a hard
/// quota's first refusal; the kind ends the alert id).
fn quota_alert(
    kind: &str,
    q: &Quota,
    tenant: &str,
    w: &WindowSpec,
    start: i64,
    usage: &TenantUsage,
) -> AlertRecord {
    let a = usage.amount();
    AlertRecord {
        alert_id: format!("{tenant}/{}/{start}/{kind}", w.name),
        kind: kind.into(),
        tenant_id: tenant.to_string(),
        window: w.name.clone(),
        window_start: start,
        window_end: w.end_of(start),
        threshold: 1.0,
        spent_micros: a.cost_micros,
        budget_micros: q.cost_micros.unwrap_or_default(),
        spent_tokens: Some(a.tokens),
        quota_tokens: q.tokens,
        emitted_at: chrono::Utc::now(),
    }
}

/// Adding results to windows, and what that crosses.
impl Accounting {
    /// Adds a result to its tenant's window of every size and returns what
    /// to emit for it (alerts crossed, then the usage update, per window).
    /// A result counts when it was answered or billed (a failed result
    /// carries what its calls were billed); a hard-quota refusal raises one
    /// `quota_exceeded` alert per tenant and quota window. Every result given
    /// is counted: each is emitted once (see the module docs).
    pub fn add_result<K: Data, V: Data, O: Send + 'static>(
        &self,
        ctx: &mut ProcessorContext<'_, K, V, O>,
        r: &TaskResult,
    ) -> Result<Vec<Update>, ProcessError> {
        let counted = r.accounted();
        let refused = r.error_code.as_deref() == Some(QUOTA_EXCEEDED);
        let quota_window = refused
            .then(|| self.settings().quotas.quota(&r.tenant_id))
            .flatten()
            .map(|q| q.window.as_str());
        let at = r.completed_at.timestamp_millis();
        let mut out = Vec::new();
        for (i, (w, store)) in self.windows().iter().zip(self.stores()).enumerate() {
            let refusal = quota_window == Some(w.name.as_str());
            if !counted && !refusal {
                continue;
            }
            let start = w.start_of(at);
            let mut windows = ctx.window::<String, TenantUsage>(store)?;
            let alerts = windows.update(&r.tenant_id, start, |usage| {
                let mut alerts = Vec::new();
                if counted {
                    usage.add(r);
                    alerts = self.crossed(&r.tenant_id, w, start, usage);
                }
                if refusal {
                    alerts.extend(self.refusal(&r.tenant_id, w, start, usage));
                }
                alerts
            })?;
            out.extend(alerts.into_iter().map(Update::Alert));
            if counted {
                out.push(Update::Usage { window: i, start });
            }
        }
        Ok(out)
    }

    /// The first hard-quota refusal of a tenant in its quota's window: one
    /// `quota_exceeded` alert.
    fn refusal(
        &self,
        tenant: &str,
        w: &WindowSpec,
        start: i64,
        usage: &mut TenantUsage,
    ) -> Option<AlertRecord> {
        let q = self.settings().quotas.quota(tenant)?;
        if usage.refusal_alerted {
            return None;
        }
        usage.refusal_alerted = true;
        Some(quota_alert(QUOTA_EXCEEDED, q, tenant, w, start, usage))
    }

    /// The alerts a window's new total crosses: each threshold of each
    /// budget once per window (`usage.alerted` records them), so a raised
    /// budget's thresholds alert again and a threshold added later alerts
    /// once.
    fn crossed(
        &self,
        tenant: &str,
        w: &WindowSpec,
        start: i64,
        usage: &mut TenantUsage,
    ) -> Vec<AlertRecord> {
        let settings = self.settings();
        let mut alerts = self.quota_crossed(tenant, w, start, usage);
        let Some(budget) = settings.budgets.budget(tenant, &w.name) else {
            return alerts;
        };
        let spent = usage.total.cost_micros;
        if settings
            .downgrade_at
            .is_some_and(|f| spent as f64 >= f * budget as f64)
        {
            self.press(tenant, w.end_of(start));
        }
        if let Some(n) = usage.legacy_alerted.take() {
            // What the window's earlier version had alerted, at this budget.
            let done = settings.thresholds.iter().take(usize::from(n));
            usage.alerted.extend(done.map(|t| (millionths(*t), budget)));
        }
        for &threshold in &settings.thresholds {
            let key = (millionths(threshold), budget);
            if (spent as f64) < threshold * budget as f64 || usage.alerted.contains(&key) {
                continue;
            }
            usage.alerted.push(key);
            alerts.push(AlertRecord {
                alert_id: format!("{tenant}/{}/{start}/{threshold}/{budget}", w.name),
                kind: "budget".into(),
                tenant_id: tenant.to_string(),
                window: w.name.clone(),
                window_start: start,
                window_end: w.end_of(start),
                threshold,
                spent_micros: spent,
                budget_micros: budget,
                spent_tokens: None,
                quota_tokens: None,
                emitted_at: chrono::Utc::now(),
            });
        }
        alerts
    }

    /// A soft quota on this window crossed for the first time: its alert,
    /// and the tenant routed down until the window ends.
    fn quota_crossed(
        &self,
        tenant: &str,
        w: &WindowSpec,
        start: i64,
        usage: &mut TenantUsage,
    ) -> Vec<AlertRecord> {
        let Some(q) = self.settings().quotas.quota(tenant) else {
            return Vec::new();
        };
        let a = usage.amount();
        let over = q.tokens.is_some_and(|cap| a.tokens > cap)
            || q.cost_micros.is_some_and(|cap| a.cost_micros > cap);
        if q.mode != QuotaMode::Soft || q.window != w.name || !over {
            return Vec::new();
        }
        self.press(tenant, w.end_of(start));
        if usage.quota_alerted {
            return Vec::new();
        }
        usage.quota_alerted = true;
        vec![quota_alert("quota", q, tenant, w, start, usage)]
    }

    /// Routes `tenant` down until `until` (ms).
    fn press(&self, tenant: &str, until: i64) {
        let mut p = self.0.pressure.lock();
        let e = p.entry(tenant.to_string()).or_insert(until);
        *e = (*e).max(until);
    }
}

impl Processor<String, TaskResult> for Accountant {
    type OutKey = String;
    type OutValue = TaskResult;
    type Output = ();

    fn process(
        &mut self,
        record: Record<String, TaskResult>,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), ProcessError> {
        let r = &record.value;
        // A result given again to a redelivered task was accounted with its
        // one call.
        let duplicate = record.header(HEADER_DUPLICATE).is_some();
        if !duplicate {
            let at = r.completed_at.timestamp_millis();
            let settings = self.accounting.settings();
            let updates = self.accounting.add_result(ctx, r)?;
            for update in updates {
                match update {
                    Update::Alert(alert) => {
                        if let Some(m) = &self.accounting.0.alerts {
                            m.with_label_values(&[&alert.kind]).inc();
                        }
                        let json = serde_json::to_vec(&alert).map_err(|e| {
                            ProcessError::Fatal(format!("alert record encoding: {e}"))
                        })?;
                        emit_json(ctx, &settings.alerts_topic, &r.tenant_id, at, json)?;
                    }
                    Update::Usage { window, start } => match settings.usage_updates {
                        UsageUpdates::OnUpdate => {
                            let w = &self.accounting.windows()[window];
                            let store = &self.accounting.stores()[window];
                            let json = usage_record(ctx, store, &r.tenant_id, w, start)?;
                            emit_json(ctx, &settings.usage_topic, &r.tenant_id, at, json)?
                        }
                        UsageUpdates::OnCommit => self.held.hold(&r.tenant_id, window, start, at),
                    },
                }
            }
            if self.held.windows >= MAX_HELD_WINDOWS {
                self.emit_held(ctx)?;
            }
        }
        ctx.forward(record)
    }

    /// [`UsageUpdates::OnCommit`]: each window updated since the last
    /// commit (or the last eviction), in its latest state.
    fn flush(&mut self, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        self.emit_held(ctx)
    }

    fn punctuate(&mut self, time: Punctuation, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        if time.wall_clock_ms - self.last_expiry_ms < 60_000 {
            return Ok(());
        }
        self.last_expiry_ms = time.wall_clock_ms;
        self.accounting
            .0
            .pressure
            .lock()
            .retain(|_, until| *until > time.wall_clock_ms);
        let accounting = self.accounting.clone();
        for (w, store) in accounting.windows().iter().zip(accounting.stores()) {
            ctx.window::<String, TenantUsage>(store)?
                .expire_before(time.wall_clock_ms - w.kept_ms())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
