//! Quotas: a cap on a tenant's tokens or cost per window.
//!
//! A **hard** quota is enforced before each provider call, in the task that
//! owns the tenant's partition (tasks are keyed by tenant, so one task of
//! one instance decides for a tenant; no shared cache, exact with any number
//! of instances). `invoke_llm` reserves the call's worst case (the prompt
//! bound plus `max_tokens`, priced at the dearest model the call may end
//! on) against the window's settled usage plus the reservations still out.
//! A task that fits the settled usage but not with the reservations out
//! waits (its record held, uncommitted) until they settle; a task whose
//! worst case would pass the quota on settled usage alone gets a failed
//! result `quota_exceeded` (no call, no dead letter). So a tenant uses at
//! least its quota minus one task's worst case before its first refusal,
//! and never a token over it. When its result is emitted the reservation is released
//! and, in the same step of the same thread, the accountant adds the real
//! usage to the window, so settled usage plus reservations never pass the
//! quota. A **soft** quota is not enforced: crossing it raises an alert
//! (`kind = quota`) once per window and routes the tenant's tiered tasks one
//! tier down until the window ends. Either resets with its window.
//!
//! Reservations live in memory: after a crash the window comes back as
//! committed and every task not finished is read again and reserves again,
//! so nothing is reserved twice or left reserved.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use sluice_topology::{Data, ProcessError, ProcessorContext};

use super::{TenantUsage, WindowSpec};

/// Whether a quota refuses calls or only alerts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuotaMode {
    /// Calls that would pass it are refused (`quota_exceeded`).
    #[default]
    Hard,
    /// Crossing it alerts and routes down; nothing is refused.
    Soft,
}

/// A cap per window: tokens (prompt + completion), cost, or both.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// The window size it applies to (a name in `accounting.windows`).
    pub window: String,
    /// Prompt plus completion tokens per window.
    #[serde(default)]
    pub tokens: Option<u64>,
    /// Cost per window, micro-dollars.
    #[serde(default)]
    pub cost_micros: Option<i64>,
    /// `hard` (default) or `soft`.
    #[serde(default)]
    pub mode: QuotaMode,
}

/// Quotas: one for every tenant unless a tenant has its own.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Quotas {
    /// Every tenant's quota, unless overridden.
    pub default: Option<Quota>,
    /// Per tenant.
    pub tenants: BTreeMap<String, Quota>,
}

impl Quotas {
    /// A tenant's quota, if any.
    pub fn quota(&self, tenant: &str) -> Option<&Quota> {
        self.tenants.get(tenant).or(self.default.as_ref())
    }

    /// A tenant's hard quota, if any.
    pub fn hard(&self, tenant: &str) -> Option<&Quota> {
        self.quota(tenant).filter(|q| q.mode == QuotaMode::Hard)
    }

    /// Whether any quota is set.
    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.tenants.is_empty()
    }
}

/// Tokens and cost of a call, worst case or settled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Amount {
    /// Prompt plus completion tokens.
    pub tokens: u64,
    /// Micro-dollars.
    pub cost_micros: i64,
}

impl Amount {
    /// The sum of two amounts.
    pub fn plus(self, o: Amount) -> Amount {
        Amount {
            tokens: self.tokens + o.tokens,
            cost_micros: self.cost_micros + o.cost_micros,
        }
    }

    fn minus(self, o: Amount) -> Amount {
        Amount {
            tokens: self.tokens.saturating_sub(o.tokens),
            cost_micros: self.cost_micros - o.cost_micros,
        }
    }
}

/// Why a task was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exceeded {
    /// What the failed result says.
    pub message: String,
}

/// What the gate decides for a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuotaDecision {
    /// The tenant has no hard quota: nothing is reserved.
    Unlimited,
    /// The call's worst case is reserved.
    Reserved,
    /// It fits the settled usage, not with the reservations out: it waits
    /// for them to settle.
    Wait,
    /// Its worst case would pass the quota on the settled usage alone.
    Exceeded(Exceeded),
}

/// Hard-quota admission for `invoke_llm`: reads the tenant's window (the
/// accountant's store) and keeps the reservations of one task's calls.
#[derive(Clone, Debug)]
pub struct QuotaGate {
    quotas: Quotas,
    /// Store and window spec per window name.
    windows: HashMap<String, (String, WindowSpec)>,
}

impl QuotaGate {
    pub(super) fn new(quotas: Quotas, windows: HashMap<String, (String, WindowSpec)>) -> Self {
        QuotaGate { quotas, windows }
    }

    /// Whether `tenant` has a hard quota (its tasks are batched only with
    /// its own, so a batch's usage is apportioned within its reservations).
    pub fn is_hard(&self, tenant: &str) -> bool {
        self.quotas.hard(tenant).is_some()
    }

    /// Reserves `worst` for `tenant` when its settled usage in the current
    /// window plus what `reserved` holds for it still leaves room; [`Wait`]
    /// when only the reservations out leave none; [`Exceeded`] when the
    /// settled usage alone does. Without a hard quota nothing is reserved.
    /// It may grow a reservation already made (a batch's spoiled call
    /// billed to its tasks).
    ///
    /// [`Wait`]: QuotaDecision::Wait
    /// [`Exceeded`]: QuotaDecision::Exceeded
    pub fn reserve<K: Data, V: Data, O: Send + 'static>(
        &self,
        ctx: &mut ProcessorContext<'_, K, V, O>,
        reserved: &mut Reservations,
        tenant: &str,
        worst: Amount,
        now_ms: i64,
    ) -> Result<QuotaDecision, ProcessError> {
        let Some(q) = self.quotas.hard(tenant) else {
            return Ok(QuotaDecision::Unlimited);
        };
        let Some((store, w)) = self.windows.get(&q.window) else {
            return Ok(QuotaDecision::Unlimited);
        };
        let start = w.start_of(now_ms);
        let used = ctx
            .window::<String, TenantUsage>(store)?
            .peek(&tenant.to_string(), start, |u| u.map(TenantUsage::amount))?
            .unwrap_or_default();
        let over = |a: Amount| {
            q.tokens.is_some_and(|cap| a.tokens > cap)
                || q.cost_micros.is_some_and(|cap| a.cost_micros > cap)
        };
        let alone = used.plus(worst);
        if over(alone) {
            let (what, cap, used_n, worst_n) = match q.tokens.filter(|cap| alone.tokens > *cap) {
                Some(cap) => (
                    "tokens",
                    cap as i64,
                    used.tokens as i64,
                    worst.tokens as i64,
                ),
                None => (
                    "micro-dollars",
                    q.cost_micros.unwrap_or_default(),
                    used.cost_micros,
                    worst.cost_micros,
                ),
            };
            return Ok(QuotaDecision::Exceeded(Exceeded {
                message: format!(
                    "hard quota of {cap} {what} per {} window: {used_n} used, this task up to {worst_n}",
                    q.window
                ),
            }));
        }
        if over(alone.plus(reserved.of(tenant))) {
            return Ok(QuotaDecision::Wait);
        }
        reserved.add(tenant, worst);
        Ok(QuotaDecision::Reserved)
    }
}

/// The reservations of one task's calls still under way, per tenant.
#[derive(Debug, Default)]
pub struct Reservations {
    by_tenant: HashMap<String, Amount>,
}

impl Reservations {
    /// What `tenant` holds.
    pub fn of(&self, tenant: &str) -> Amount {
        self.by_tenant.get(tenant).copied().unwrap_or_default()
    }

    fn add(&mut self, tenant: &str, a: Amount) {
        let e = self.by_tenant.entry(tenant.to_string()).or_default();
        *e = e.plus(a);
    }

    /// Releases a reservation made for `tenant`.
    pub fn release(&mut self, tenant: &str, a: Amount) {
        if let Some(e) = self.by_tenant.get_mut(tenant) {
            *e = e.minus(a);
            if *e == Amount::default() {
                self.by_tenant.remove(tenant);
            }
        }
    }
}
