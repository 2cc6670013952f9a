//! One paced and adapted dimension of the limiter (requests/s or tokens/s):
//! its GCRA pacer, the supplied rate it infers from answers and headers, its
//! cuts on congestion and its growth (see the module above for the policy).

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Below `(1 - NEAR_BAND) × ceiling` the rate climbs fast.
pub(super) const NEAR_BAND: f64 = 0.1;
/// Fast climb far below the ceiling, as a fraction of it per second.
pub(super) const RECOVERY_GROWTH: f64 = 0.5;
/// Growth while headers show an untouched budget, as a fraction of the rate per second...
pub(super) const UNDER_USED_GROWTH: f64 = 0.1;
/// ...and at most this fraction per round trip.
pub(super) const UNDER_USED_PER_ROUND_TRIP: f64 = 0.03;
/// A dimension grows only if it held back a waiter this recently.
pub(super) const BINDING_WINDOW: Duration = Duration::from_secs(1);
/// Admissions unanswered for longer than this (hung calls) stop admission-time accounting.
pub(super) const RESOLVE_HORIZON: Duration = Duration::from_secs(5);
/// At most one early-warning cut per this long.
pub(super) const EARLY_HOLDOFF: Duration = Duration::from_secs(1);
/// The remembered largest `remaining` value decays with this time constant.
pub(super) const REMAINING_MAX_DECAY: Duration = Duration::from_secs(60);
/// Headers seen this recently make a dimension "informed".
pub(super) const HEADERS_FRESH: Duration = Duration::from_secs(10);
/// A loss within a window of the previous cut compounds to this fraction of the rate.
pub(super) const COMPOUND_DECREASE: f64 = 0.85;
/// Deepest early-warning cut, as a fraction of the current rate.
pub(super) const EARLY_MAX_DECREASE: f64 = 0.9;
/// Early-warning cut, as a fraction of the current rate, when levels are unreadable.
pub(super) const UNREADABLE_EARLY_DECREASE: f64 = 0.95;
/// Smallest largest-remaining for which "full" can be read from `remaining`.
pub(super) const MIN_READABLE_LEVELS: f64 = 3.0;
/// A budget at or below this share of the largest remaining seen is "nearly spent".
pub(super) const LOW_WATER: f64 = 0.5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Requests,
    Tokens,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Signal {
    /// A 429.
    Loss,
    /// Headers say the budget is nearly spent.
    Early,
}

/// One admission of a header observation, ordered by admission sequence.
#[derive(Debug, Clone, Copy)]
pub(super) struct Obs {
    pub(super) seq: u64,
    pub(super) issued: Instant,
    /// Units admitted up to and including this request (requests: `seq`; tokens: estimate).
    pub(super) cum_cost: f64,
    pub(super) remaining: f64,
}

/// One paced and adapted dimension.
#[derive(Debug)]
pub(super) struct Dim {
    /// Units per second; infinite when not (yet) paced.
    pub(super) rate: f64,
    pub(super) min: f64,
    pub(super) max: f64,
    /// This instance's part of the group limit, units per second (infinite without one).
    pub(super) cap: f64,
    pub(super) ceiling: Option<f64>,
    pub(super) above_since: Option<Instant>,
    /// GCRA theoretical arrival time.
    pub(super) tat: Instant,
    /// Requests admitted up to the last cut: their answers belong to that event.
    pub(super) cut_seq: u64,
    pub(super) last_cut: Option<Instant>,
    pub(super) last_binding: Option<Instant>,
    pub(super) obs: VecDeque<Obs>,
    pub(super) remaining_max: f64,
    /// When an answer last showed the budget full (nothing of it used).
    pub(super) latest_full_at: Option<Instant>,
    /// The provider's advertised limit (`x-ratelimit-limit-*`) and the admission it was
    /// seen on.
    pub(super) limit: Option<(f64, u64)>,
}

impl Dim {
    pub(super) fn new(rate: f64, min: f64, max: f64, cap: f64, now: Instant) -> Self {
        let mut dim = Self {
            rate,
            min,
            max,
            cap,
            ceiling: None,
            above_since: None,
            tat: now,
            cut_seq: 0,
            last_cut: None,
            last_binding: None,
            obs: VecDeque::new(),
            remaining_max: 0.0,
            latest_full_at: None,
            limit: None,
        };
        dim.rate = dim.rate.min(dim.hi());
        dim
    }

    pub(super) fn paced(&self) -> bool {
        self.rate.is_finite()
    }

    /// Upper bound of the rate: the configured maximum, or the group cap when lower.
    pub(super) fn hi(&self) -> f64 {
        self.max.min(self.cap)
    }

    /// Lower bound of the rate: the configured floor, unless the group cap is lower.
    pub(super) fn lo(&self) -> f64 {
        self.min.min(self.hi())
    }

    /// Sets the group cap. A change rescales the rate, the learned ceiling and the pacer's
    /// backlog by the cap's ratio at once, as a changed advertised limit does (what was
    /// learned about the group's rate carries over), never above the new cap. The floor is
    /// not applied here: the round trip through a share of nearly nothing (a rebalance)
    /// then gives back the rate it started from.
    pub(super) fn set_cap(&mut self, cap: f64, now: Instant) {
        let old = std::mem::replace(&mut self.cap, cap);
        if !self.paced() || old == cap {
            return;
        }
        let ratio = if old.is_finite() && cap.is_finite() {
            cap / old
        } else {
            1.0
        };
        let before = self.rate;
        let hi = self.hi();
        self.rate = (self.rate * ratio).min(hi).max(f64::MIN_POSITIVE);
        self.ceiling = self.ceiling.map(|c| (c * ratio).min(hi));
        self.above_since = None;
        // The backlog is a number of units admitted ahead: at the new rate it takes longer
        // (or less long) to pass.
        if self.tat > now {
            let debt = self.tat.duration_since(now).as_secs_f64() * before / self.rate;
            self.tat = now + secs(debt);
        }
    }

    /// Earliest next admission (GCRA with `tolerance` of slack); `None` when not paced.
    pub(super) fn ready_at(&self, tolerance: Duration) -> Option<Instant> {
        self.paced()
            .then(|| self.tat.checked_sub(tolerance).unwrap_or(self.tat))
    }

    pub(super) fn admit(&mut self, cost: f64, now: Instant) {
        if self.paced() {
            self.tat = self.tat.max(now) + secs(cost / self.rate);
        }
    }

    /// Grows the rate for `dt` seconds, if this dimension was the bottleneck.
    pub(super) fn grow(&mut self, now: Instant, dt: f64, g: &Growth) {
        let binding = self
            .last_binding
            .is_some_and(|t| now.saturating_duration_since(t) <= BINDING_WINDOW);
        if !self.paced() || !binding || dt <= 0.0 {
            return;
        }
        let r = self.rate;
        let under_used = self
            .latest_full_at
            .is_some_and(|t| now.saturating_duration_since(t) <= BINDING_WINDOW);
        let next = match self.ceiling {
            None => r * (g.slow_start * dt).exp(),
            // Headers show an untouched budget below the ceiling: climb back briskly.
            Some(c) if under_used && r < c => (r + g.under_used * r * dt).min(c),
            Some(c) if r < c * (1.0 - NEAR_BAND) => {
                (r + RECOVERY_GROWTH * c * dt).min(c * (1.0 - NEAR_BAND))
            }
            Some(c) if r < c => r + g.probe * c * dt,
            Some(c) => {
                if under_used {
                    // The remembered ceiling is not the provider's limit.
                    self.ceiling = Some(r);
                }
                let since = *self.above_since.get_or_insert(now);
                let k = 1.0 + now.saturating_duration_since(since).as_secs_f64() / g.accel_period;
                r + g.probe * c.max(r) * k * dt
            }
        };
        if self.ceiling.is_some_and(|c| next < c) {
            self.above_since = None;
        }
        self.rate = next.clamp(self.lo(), self.hi());
    }

    pub(super) fn cut(&mut self, to: f64, supplied: f64, seq: u64, now: Instant) {
        let to = to.clamp(self.lo(), self.hi());
        self.rate = if self.paced() { to.min(self.rate) } else { to };
        self.ceiling = Some(supplied.max(self.rate).clamp(self.lo(), self.hi()));
        self.above_since = None;
        self.cut_seq = seq;
        self.last_cut = Some(now);
        // No tolerance burst right after a cut: the next admission is one interval away.
        if self.paced() {
            self.tat = self.tat.max(now + secs(2.0 / self.rate));
        }
    }

    /// Follows the provider's advertised limit. When it changes, the rate and ceiling are
    /// rescaled by the same ratio at once (whatever its unit), and answers to requests
    /// admitted before count as part of this adjustment.
    pub(super) fn follow_limit(&mut self, limit: f64, seq: u64, seq_now: u64, now: Instant) {
        if limit <= 0.0 || self.limit.is_some_and(|(_, at)| seq < at) {
            return;
        }
        let previous = self.limit.replace((limit, seq));
        let Some((old, _)) = previous else { return };
        if (limit - old).abs() < f64::EPSILON || !self.paced() {
            return;
        }
        let ratio = limit / old;
        let (lo, hi) = (self.lo(), self.hi());
        self.rate = (self.rate * ratio).clamp(lo, hi);
        self.ceiling = self.ceiling.map(|c| (c * ratio).clamp(lo, hi));
        self.above_since = None;
        self.cut_seq = seq_now;
        self.last_cut = Some(now);
        self.obs.clear();
        self.latest_full_at = None;
    }

    /// Slow start ends, without a cut, once an answer shows the budget draining: the rate
    /// at that admission is at least what the provider supplies, so the rate goes back to it
    /// and becomes the ceiling. (One below full is not draining: the pacer may admit two at
    /// once.)
    pub(super) fn end_slow_start_if_draining(&mut self, remaining: f64, rate_at_issue: f64) {
        if self.ceiling.is_none()
            && self.paced()
            && self.levels_readable()
            && remaining < self.remaining_max - 1.0
        {
            let at = rate_at_issue.clamp(self.lo(), self.hi());
            self.rate = self.rate.min(at);
            self.ceiling = Some(at);
        }
    }

    /// Whether `remaining` has enough resolution to tell a full budget from a used one (a
    /// burst of 2 reads only 0 or 1).
    pub(super) fn levels_readable(&self) -> bool {
        self.remaining_max >= MIN_READABLE_LEVELS
    }

    /// Records an observation of the provider's remaining budget at admission.
    pub(super) fn observe(&mut self, o: Obs, window: Duration, now: Instant) {
        if let Some(last) = self.obs.back() {
            let decay = (-(o
                .issued
                .saturating_duration_since(last.issued)
                .as_secs_f64())
                / REMAINING_MAX_DECAY.as_secs_f64())
            .exp();
            self.remaining_max = (self.remaining_max * decay).max(o.remaining);
        } else {
            self.remaining_max = o.remaining;
        }
        let at = self.obs.partition_point(|x| x.seq < o.seq);
        if at == self.obs.len() {
            let full = self.levels_readable() && o.remaining >= self.remaining_max;
            self.latest_full_at = if full { Some(now) } else { None };
        }
        self.obs.insert(at, o);
        let newest = self.obs.iter().map(|x| x.issued).max().unwrap_or(o.issued);
        while self
            .obs
            .front()
            .is_some_and(|x| newest.saturating_duration_since(x.issued) > window)
        {
            self.obs.pop_front();
        }
    }

    /// The observations bounding the supply measurement: within the window and after the
    /// last one that showed a full budget (refill into a full bucket is lost, so it would
    /// bias the estimate low).
    pub(super) fn supply_bounds(&self, window: Duration) -> Option<(Obs, Obs)> {
        let last = *self.obs.back()?;
        let full_at = self.obs.iter().rposition(|o| {
            self.levels_readable() && o.remaining >= self.remaining_max && o.seq != last.seq
        });
        let start = full_at.unwrap_or(0);
        let first = self.obs[start];
        let span = last.issued.saturating_duration_since(first.issued);
        (self.obs.len() - start >= 3 && span >= window / 2).then_some((first, last))
    }

    /// The budget the provider replenished per second between two observations:
    /// `(admitted between them − rejected + Δremaining) / Δt`.
    pub(super) fn header_supply(first: Obs, last: Obs, rejected: f64) -> f64 {
        let span = last
            .issued
            .saturating_duration_since(first.issued)
            .as_secs_f64()
            .max(1e-3);
        let admitted = (last.cum_cost - first.cum_cost - rejected).max(0.0);
        ((admitted + last.remaining - first.remaining) / span).max(0.0)
    }

    /// Early-warning test: nearly spent, and at our rate it would not last until the reset
    /// nor through the `age` of the observation (what we sent since may already have used it).
    pub(super) fn nearly_spent(
        &self,
        remaining: f64,
        reset: Option<Duration>,
        rate_at_issue: f64,
        age: Duration,
    ) -> bool {
        let low = remaining <= (LOW_WATER * self.remaining_max).max(1.0)
            && remaining < self.remaining_max;
        let short = match reset {
            Some(r) => remaining < rate_at_issue * r.max(age).as_secs_f64(),
            None => remaining < 1.0,
        };
        low && short
    }
}

/// Growth speeds, slowed when answers are slow: feedback arrives once per round trip, so
/// the rate may only move so far per round trip without overshooting.
pub(super) struct Growth {
    /// Growth just under the ceiling, fraction of it per second.
    pub(super) probe: f64,
    /// Log-growth per second while no ceiling is known (doubling per period).
    pub(super) slow_start: f64,
    /// Above the ceiling, growth accelerates by one `probe` step per this many seconds.
    pub(super) accel_period: f64,
    /// Growth per second, as a fraction of the rate, while headers show the budget unused.
    pub(super) under_used: f64,
}

impl Growth {
    pub(super) fn new(probe: f64, latency: f64) -> Self {
        let period = (2.0 * latency).max(1.0);
        Self {
            probe,
            slow_start: std::f64::consts::LN_2 / period,
            accel_period: period,
            under_used: UNDER_USED_GROWTH.min(UNDER_USED_PER_ROUND_TRIP / latency.max(1e-3)),
        }
    }
}

/// Longest interval the limiter computes with (keeps `Instant` arithmetic in
/// range): the longest wait a provider's header can ask for.
pub(super) const MAX_INTERVAL: Duration = crate::llm::ratelimit::MAX_WAIT;

pub(super) fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s.max(0.0))
        .unwrap_or(MAX_INTERVAL)
        .min(MAX_INTERVAL)
}
