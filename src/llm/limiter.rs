//! The adaptive rate limiter of one (provider, model), shared by every task of an instance.
//!
//! Two paced dimensions — requests/s and tokens/s (reported as tokens/min) — each a GCRA
//! pacer whose rate is steered by feedback from the provider:
//!
//! * **What the provider supplies.** The rate it accepted over the last second, counted by
//!   *admission* time over calls already answered (free of latency smearing), else by answer
//!   time. With `x-ratelimit-remaining-*` headers, `(admitted − refused + Δremaining) / Δt`
//!   between two answers, which is exact for token buckets as long as the bucket was not
//!   full in between.
//! * **Congestion events.** A 429 cuts the rate to a fraction of the supplied rate (0.95
//!   without headers, where 429s are the routine signal; 0.93 with them). With headers, an
//!   answer showing the budget at or below half of its largest value and not lasting until
//!   its reset (or through the answer's own age) is an *early warning*: a gentle cut (0.97 of
//!   the supplied rate, never below 0.9 of the current one) before any 429, at most once a
//!   second. Answers to requests admitted before a cut belong to the same event, so a burst
//!   of 429s cuts once; a new loss within a second of the last cut compounds (×0.85 of the
//!   current rate), which tracks a sudden quota drop while measurements still lag it. The
//!   supplied rate becomes the remembered ceiling.
//! * **Advertised limit.** When `x-ratelimit-limit-*` changes, rate and ceiling are rescaled
//!   by the same ratio at once (units do not matter).
//! * **Growth.** Only while the dimension holds callers back: fast far below the ceiling,
//!   1.5 % of it per second just under it, then accelerating above it so a raised quota is
//!   found again; brisk while headers show the budget untouched (the ceiling is stale).
//!   Slow start doubles until the first event, or until headers show the budget draining.
//!   Every growth is slowed when answers are slow: feedback arrives once per round trip.
//! * **Pauses.** `Retry-After` / `retry-after-ms` stops all admissions until it passes.
//! * **Fairness.** Waiters queue per priority and are admitted by weighted fair queueing
//!   (default weights 8/4/1 for high/normal/batch): high goes first, batch still progresses.
//!   Only the head waiter sleeps on a timer, the others on their own `Notify`: no spinning.
//!   Whoever frees capacity (an answer, a cancellation) admits as many waiters as the
//!   bounds allow there and then and hands each its grant, so a freed slot is refilled
//!   without waiting for a chain of wake-ups, one scheduling hop per admission.
//!
//! * **Group limits.** With `group_rps` / `group_tpm` (the provider's limit for the whole
//!   consumer group), each dimension is capped at that limit times this instance's share of
//!   the group's work ([`AimdLimiter::set_group_share`]): the shares of all instances sum to
//!   at most 1, so together they never exceed the limit, and the adaptation above still
//!   steers below the cap. A changed share rescales the rate, the learned ceiling and the
//!   pacer's backlog by the same ratio at once, as a changed advertised limit does: what
//!   this instance learned about the group's rate carries over.
//!
//! * **Concurrency.** Calls in flight are bounded by the static `max_concurrency`, if set,
//!   and by an adaptive limit learned from latency ([`super::concurrency`]) for providers
//!   that queue instead of answering 429; a 429 or rate-limit headers leave the pacers
//!   alone in charge.
//!
//! Time is `tokio::time::Instant`, so tests drive it with paused time.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::concurrency::{ConcurrencyControl, Sample};
use super::ratelimit::RateLimitInfo;
use crate::llm::priority::Priority;
pub use config::LimiterConfig;
use pacer::*;

mod config;
mod pacer;

/// What became of a call admitted by a [`Permit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The provider answered (any non-429 answer that consumed quota).
    Success {
        /// Headers of the answer.
        rate_limit: RateLimitInfo,
        /// Tokens actually used (prompt + completion).
        tokens_used: u32,
        /// Completion tokens of the answer (0 for a rejection): the size its latency is
        /// compared by.
        output_tokens: u32,
    },
    /// HTTP 429.
    RateLimited {
        /// The pause the provider asked for.
        retry_after: Option<Duration>,
        /// Headers of the answer.
        rate_limit: RateLimitInfo,
    },
    /// No answer within the call's timeout: nothing about the rate, but congestion for the
    /// concurrency limit.
    TimedOut,
    /// Failed without telling anything about the rate (5xx, connection error).
    Failure,
}

/// The smallest group share: an instance without partitions makes no calls, and a share of
/// exactly 0 could not be rescaled from.
pub const MIN_GROUP_SHARE: f64 = 1e-6;

#[derive(Debug)]
struct Waiter {
    id: u64,
    cost: u32,
    notify: Arc<Notify>,
}

#[derive(Debug)]
struct State {
    /// This instance's share of the group limits.
    share: f64,
    started: Instant,
    last_advance: Instant,
    req: Dim,
    tok: Dim,
    pause_until: Option<Instant>,
    /// Recent pauses (start, end), excluded from rate measurements.
    pauses: VecDeque<(Instant, Instant)>,
    in_flight: usize,
    /// Admissions so far; the last admitted request has this number.
    seq: u64,
    /// Estimated tokens admitted so far.
    cum_tokens: f64,
    queues: [VecDeque<Waiter>; 3],
    /// Fair-queueing virtual finish time per priority.
    vtime: [f64; 3],
    vclock: f64,
    next_waiter: u64,
    served: [u64; 3],
    rate_limited: u64,
    /// Answer time and tokens of recent successes.
    accepted: VecDeque<(Instant, u32)>,
    /// Smoothed time from admission to answer, seconds.
    latency: Option<f64>,
    /// Admission time of each call not yet recorded, by sequence number.
    outstanding: BTreeMap<u64, Instant>,
    /// Admission time, tokens and acceptance of recently answered calls.
    resolved: VecDeque<(Instant, u32, bool)>,
    /// Sequence numbers of recent 429s (admitted by us, refused by the provider).
    refused: VecDeque<(u64, f64)>,
    /// Grants made on a waiter's behalf (by whoever freed capacity), not yet picked up.
    handed: HashMap<u64, Grant>,
    /// The adaptive concurrency limit, when enabled.
    concurrency: Option<ConcurrencyControl>,
}

/// What a waiter should do.
enum Step {
    Granted(Grant),
    Sleep(Instant),
    Park,
}

/// Waiters to wake once the state lock is released.
type Wake = Vec<Arc<Notify>>;

fn wake_all(wake: Wake) {
    for n in wake {
        n.notify_one();
    }
}

#[derive(Debug, Clone, Copy)]
struct Grant {
    seq: u64,
    issued: Instant,
    req_rate: f64,
    tok_rate: f64,
    cum_tokens: f64,
    /// Calls in flight when this one was admitted (itself excluded).
    in_flight_before: usize,
}

#[derive(Debug)]
struct Shared {
    config: LimiterConfig,
    state: Mutex<State>,
}

/// An adaptive limiter on requests/s and tokens/min; cheap to clone, clones share state.
#[derive(Debug, Clone)]
pub struct AimdLimiter {
    shared: Arc<Shared>,
}

/// Admission of one call; report what happened with [`Permit::record`]. Dropping it
/// unreported counts as [`Outcome::Failure`].
#[must_use = "record the call's outcome"]
#[derive(Debug)]
pub struct Permit {
    shared: Arc<Shared>,
    priority: Priority,
    est_tokens: u32,
    grant: Grant,
    done: bool,
}

impl Permit {
    /// The priority the permit was granted to.
    pub fn priority(&self) -> Priority {
        self.priority
    }

    /// Reports the call's outcome, steering the shared rates.
    pub fn record(mut self, outcome: Outcome) {
        self.finish(outcome);
    }

    fn finish(&mut self, outcome: Outcome) {
        if self.done {
            return;
        }
        self.done = true;
        let wake = {
            let mut st = self.shared.state.lock();
            st.on_outcome(&self.shared.config, self, outcome, Instant::now())
        };
        wake_all(wake);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.finish(Outcome::Failure);
    }
}

impl AimdLimiter {
    /// A limiter starting at `initial_rps` (and `initial_tpm` if set).
    pub fn new(config: LimiterConfig) -> Self {
        let now = Instant::now();
        let min_rps = config.min_rps.max(1e-3);
        // Until told its share, an instance may take the whole group limit (its share
        // cannot be more).
        let req = Dim::new(
            config
                .initial_rps
                .clamp(min_rps, config.max_rps.max(min_rps)),
            min_rps,
            config.max_rps.max(min_rps),
            config.group_rps.unwrap_or(f64::INFINITY),
            now,
        );
        let min_tps = config.min_tpm.max(1.0) / 60.0;
        let tok = Dim::new(
            config
                .initial_tpm
                .or(config.group_tpm)
                .map_or(f64::INFINITY, |t| (t / 60.0).max(min_tps)),
            min_tps,
            f64::INFINITY,
            config.group_tpm.map_or(f64::INFINITY, |t| t / 60.0),
            now,
        );
        let state = State {
            share: 1.0,
            started: now,
            last_advance: now,
            req,
            tok,
            pause_until: None,
            pauses: VecDeque::new(),
            in_flight: 0,
            seq: 0,
            cum_tokens: 0.0,
            queues: Default::default(),
            vtime: [0.0; 3],
            vclock: 0.0,
            next_waiter: 0,
            served: [0; 3],
            rate_limited: 0,
            accepted: VecDeque::new(),
            latency: None,
            outstanding: BTreeMap::new(),
            resolved: VecDeque::new(),
            refused: VecDeque::new(),
            handed: HashMap::new(),
            concurrency: config
                .concurrency
                .enabled
                .then(|| ConcurrencyControl::new(config.concurrency.clone(), now)),
        };
        Self {
            shared: Arc::new(Shared {
                config,
                state: Mutex::new(state),
            }),
        }
    }

    /// Waits for admission of one call of about `est_tokens` tokens. Cancel-safe: dropping
    /// the future leaves the queue.
    pub async fn acquire(&self, priority: Priority, est_tokens: u32) -> Permit {
        let notify = Arc::new(Notify::new());
        let id = {
            let mut st = self.shared.state.lock();
            st.enqueue(priority, est_tokens, notify.clone())
        };
        let mut guard = QueueGuard {
            shared: &self.shared,
            id,
            priority,
            est_tokens,
            queued: true,
        };
        loop {
            let mut wake = Wake::new();
            let step = {
                let mut st = self.shared.state.lock();
                st.poll(&self.shared.config, id, priority, Instant::now(), &mut wake)
            };
            // This waiter is awake: a stored wake-up would only make it spin.
            wake.retain(|n| !Arc::ptr_eq(n, &notify));
            wake_all(wake);
            match step {
                Step::Granted(grant) => {
                    guard.queued = false;
                    return Permit {
                        shared: self.shared.clone(),
                        priority,
                        est_tokens,
                        grant,
                        done: false,
                    };
                }
                Step::Sleep(deadline) => {
                    tokio::select! {
                        _ = notify.notified() => {}
                        _ = tokio::time::sleep_until(deadline) => {}
                    }
                }
                Step::Park => notify.notified().await,
            }
        }
    }

    /// Sets this instance's share of the group limits (`group_rps`, `group_tpm`): the part
    /// of the group's work it holds, kept within [`MIN_GROUP_SHARE`]..=1. The caps follow at
    /// once, rescaling the current rates by the change (see the module documentation);
    /// without group limits only the figure is kept.
    pub fn set_group_share(&self, share: f64) {
        let share = if share.is_nan() {
            MIN_GROUP_SHARE
        } else {
            share.clamp(MIN_GROUP_SHARE, 1.0)
        };
        let config = &self.shared.config;
        let mut wake = Wake::new();
        {
            let mut st = self.shared.state.lock();
            if st.share == share {
                return;
            }
            let now = Instant::now();
            // Growth so far happened under the old caps.
            st.advance(config, now);
            st.share = share;
            if let Some(rps) = config.group_rps {
                st.req.set_cap(rps * share, now);
            }
            if let Some(tpm) = config.group_tpm {
                st.tok.set_cap(tpm / 60.0 * share, now);
            }
            // A raised cap lets waiters in sooner than the head's timer says.
            st.dispatch(config, now, &mut wake);
        }
        wake_all(wake);
    }

    /// This instance's share of the group limits (1 until [`AimdLimiter::set_group_share`]).
    pub fn group_share(&self) -> f64 {
        self.shared.state.lock().share
    }

    /// Whether the limiter has a group limit to share (`group_rps` or `group_tpm`).
    pub fn has_group_limit(&self) -> bool {
        self.shared.config.has_group_limit()
    }

    /// Current request rate target, per second.
    pub fn current_rps(&self) -> f64 {
        self.shared.state.lock().req.rate
    }

    /// Current token rate target, per minute; `None` while tokens are not paced.
    pub fn current_tpm(&self) -> Option<f64> {
        let st = self.shared.state.lock();
        st.tok.paced().then(|| st.tok.rate * 60.0)
    }

    /// Permits granted so far to `priority` (its achieved share when compared).
    pub fn served(&self, priority: Priority) -> u64 {
        self.shared.state.lock().served[priority.index()]
    }

    /// 429 answers recorded so far.
    pub fn rate_limited_total(&self) -> u64 {
        self.shared.state.lock().rate_limited
    }

    /// Callers waiting for admission.
    pub fn waiting(&self) -> usize {
        self.shared
            .state
            .lock()
            .queues
            .iter()
            .map(VecDeque::len)
            .sum()
    }

    /// Calls admitted and not yet recorded.
    pub fn in_flight(&self) -> usize {
        self.shared.state.lock().in_flight
    }

    /// The bound on calls in flight: the adaptive limit (while a 429 or rate-limit headers
    /// suspend it, the figure it follows the calls in flight with), capped by
    /// `max_concurrency`; `None` when neither applies.
    pub fn concurrency_limit(&self) -> Option<usize> {
        let st = self.shared.state.lock();
        let adaptive = st.concurrency.as_ref().map(ConcurrencyControl::limit);
        min_bound(self.shared.config.max_concurrency, adaptive)
    }
}

fn min_bound(a: Option<usize>, b: Option<usize>) -> Option<usize> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Removes a cancelled waiter (returning a grant made on its behalf) and hands the head
/// position on.
struct QueueGuard<'a> {
    shared: &'a Arc<Shared>,
    id: u64,
    priority: Priority,
    est_tokens: u32,
    queued: bool,
}

impl Drop for QueueGuard<'_> {
    fn drop(&mut self) {
        if !self.queued {
            return;
        }
        let mut wake = Wake::new();
        let handed = {
            let mut st = self.shared.state.lock();
            let handed = st.handed.remove(&self.id);
            if handed.is_none() {
                st.queues[self.priority.index()].retain(|w| w.id != self.id);
                st.dispatch(&self.shared.config, Instant::now(), &mut wake);
            }
            handed
        };
        wake_all(wake);
        // An unused grant is returned like a failed call.
        drop(handed.map(|grant| Permit {
            shared: self.shared.clone(),
            priority: self.priority,
            est_tokens: self.est_tokens,
            grant,
            done: false,
        }));
    }
}

impl State {
    fn enqueue(&mut self, priority: Priority, cost: u32, notify: Arc<Notify>) -> u64 {
        let i = priority.index();
        if self.queues[i].is_empty() {
            self.vtime[i] = self.vtime[i].max(self.vclock);
        }
        let id = self.next_waiter;
        self.next_waiter += 1;
        self.queues[i].push_back(Waiter { id, cost, notify });
        id
    }

    /// The priority class served next: smallest virtual finish time, ties to the higher.
    fn head_class(&self, weights: &[u32; 3]) -> Option<usize> {
        (0..3)
            .filter(|&i| !self.queues[i].is_empty())
            .min_by(|&a, &b| {
                let fa = self.vtime[a] + 1.0 / f64::from(weights[a].max(1));
                let fb = self.vtime[b] + 1.0 / f64::from(weights[b].max(1));
                fa.total_cmp(&fb).then(a.cmp(&b))
            })
    }

    /// Applies growth for the time since the last call.
    fn advance(&mut self, config: &LimiterConfig, now: Instant) {
        let dt = now
            .saturating_duration_since(self.last_advance)
            .as_secs_f64();
        self.last_advance = now;
        let g = Growth::new(config.probe_growth, self.latency.unwrap_or(0.0));
        self.req.grow(now, dt, &g);
        self.tok.grow(now, dt, &g);
    }

    /// One waiter's turn: picks up a grant made on its behalf, else admits what can be
    /// admitted now (waking those admitted) and tells the waiter how to wait.
    fn poll(
        &mut self,
        config: &LimiterConfig,
        id: u64,
        priority: Priority,
        now: Instant,
        wake: &mut Wake,
    ) -> Step {
        self.advance(config, now);
        if let Some(grant) = self.handed.remove(&id) {
            return Step::Granted(grant);
        }
        let blocked = self.dispatch(config, now, wake);
        if let Some(grant) = self.handed.remove(&id) {
            return Step::Granted(grant);
        }
        let i = priority.index();
        let is_head = self.head_class(&config.weights) == Some(i)
            && self.queues[i].front().is_some_and(|w| w.id == id);
        match blocked {
            // Only the head sleeps on a timer; `dispatch` woke it if it is another waiter.
            Some(at) if is_head => Step::Sleep(at),
            _ => Step::Park,
        }
    }

    /// Admits waiters in fair-queueing order while the concurrency bound and the pacers
    /// allow, recording each grant for its waiter to pick up and queueing its wake-up, so
    /// freed capacity is used at once rather than one scheduling hop at a time. Returns
    /// when the head is held back by a pacer or pause (and queues the head's wake-up so it
    /// sleeps on its timer), or `None` when nothing waits or the concurrency bound is met.
    fn dispatch(
        &mut self,
        config: &LimiterConfig,
        now: Instant,
        wake: &mut Wake,
    ) -> Option<Instant> {
        loop {
            let i = self.head_class(&config.weights)?;
            // No share of the group limits (no partitions here): no calls at all, until a
            // share comes (its setter dispatches again).
            if self.share <= MIN_GROUP_SHARE && config.has_group_limit() {
                return None;
            }
            let adaptive = self.concurrency.as_mut().and_then(|c| c.bound(now));
            if min_bound(config.max_concurrency, adaptive).is_some_and(|m| self.in_flight >= m) {
                if adaptive.is_some_and(|m| self.in_flight >= m) {
                    if let Some(c) = self.concurrency.as_mut() {
                        c.held_back();
                    }
                }
                return None;
            }
            let cost = self.queues[i].front().map_or(0, |w| w.cost);
            let req_tol = secs(1.0 / self.req.rate);
            let req_ready = self.req.ready_at(req_tol);
            let tok_ready = self.tok.ready_at(Duration::from_secs(1));
            let pause = self.pause_until.filter(|p| *p > now);
            let ready = [req_ready, tok_ready, pause]
                .into_iter()
                .flatten()
                .max()
                .filter(|t| *t > now);
            if let Some(at) = ready {
                // Whichever pacer holds the head back is the bottleneck and may grow.
                if pause.is_none_or(|p| p < at) {
                    match (req_ready, tok_ready) {
                        (Some(r), Some(t)) if t > r => self.tok.last_binding = Some(now),
                        _ => self.req.last_binding = Some(now),
                    }
                }
                if let Some(w) = self.queues[i].front() {
                    wake.push(w.notify.clone());
                }
                return Some(at);
            }
            // Admit the head.
            let waiter = self.queues[i].pop_front()?;
            let weight = f64::from(config.weights[i].max(1));
            self.vclock = self.vtime[i];
            self.vtime[i] += 1.0 / weight;
            self.req.admit(1.0, now);
            self.tok.admit(f64::from(cost), now);
            self.seq += 1;
            self.cum_tokens += f64::from(cost);
            self.in_flight += 1;
            self.outstanding.insert(self.seq, now);
            self.served[i] += 1;
            let grant = Grant {
                seq: self.seq,
                issued: now,
                req_rate: self.req.rate,
                tok_rate: self.tok.rate,
                cum_tokens: self.cum_tokens,
                in_flight_before: self.in_flight - 1,
            };
            // The limit is fully used: it may grow.
            if adaptive.is_some_and(|m| self.in_flight >= m) {
                if let Some(c) = self.concurrency.as_mut() {
                    c.held_back();
                }
            }
            self.handed.insert(waiter.id, grant);
            wake.push(waiter.notify);
        }
    }

    fn prune(&mut self, now: Instant, window: Duration) {
        let keep = RESOLVE_HORIZON + window * 2;
        while self
            .resolved
            .front()
            .is_some_and(|(t, _, _)| now.saturating_duration_since(*t) > keep)
        {
            self.resolved.pop_front();
        }
        while self
            .accepted
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > window)
        {
            self.accepted.pop_front();
        }
        let oldest = self
            .req
            .obs
            .front()
            .map_or(u64::MAX, |o| o.seq)
            .min(self.tok.obs.front().map_or(u64::MAX, |o| o.seq));
        while self.refused.front().is_some_and(|(s, _)| *s < oldest) {
            self.refused.pop_front();
        }
        if self.refused.len() > 4096 {
            self.refused.pop_front();
        }
    }

    /// Accepted (requests/s, tokens/s): by admission time over the last window of fully
    /// answered admissions (exact: no smearing by latency), else by answer time over the
    /// last window. `None` when there is too little history or a pause distorts it.
    fn accepted_rate(&self, now: Instant, window: Duration) -> Option<(f64, f64)> {
        self.accepted_by_admission(now, window)
            .or_else(|| self.accepted_by_answer(now, window))
    }

    fn accepted_by_admission(&self, now: Instant, window: Duration) -> Option<(f64, f64)> {
        // Up to the oldest unanswered admission everything is known. Past a typical latency,
        // stragglers (a heavy latency tail) are extrapolated from their neighbours instead
        // of holding the window back.
        let settled = self
            .outstanding
            .first_key_value()
            .map_or(now, |(_, t)| *t)
            .min(now);
        let typical = now.checked_sub(secs(self.latency?).min(RESOLVE_HORIZON))?;
        let end = settled.max(typical);
        let start = end.checked_sub(window)?;
        if start < self.started {
            return None;
        }
        let paused: Duration = self
            .pauses
            .iter()
            .map(|(a, b)| (*b).min(end).saturating_duration_since((*a).max(start)))
            .sum();
        let span = window.saturating_sub(paused);
        if span < window / 2 {
            return None;
        }
        let inside = |t: &Instant| *t > start && *t <= end;
        let (mut accepted, mut refused, mut tokens) = (0.0, 0.0, 0.0);
        for (t, tok, ok) in &self.resolved {
            if inside(t) {
                if *ok {
                    accepted += 1.0;
                    tokens += f64::from(*tok);
                } else {
                    refused += 1.0;
                }
            }
        }
        if accepted + refused < 1.0 {
            return None;
        }
        let pending = self.outstanding.values().filter(|t| inside(t)).count() as f64;
        let scale = 1.0 + pending / (accepted + refused);
        let span = span.as_secs_f64();
        Some((accepted * scale / span, tokens * scale / span))
    }

    fn accepted_by_answer(&self, now: Instant, window: Duration) -> Option<(f64, f64)> {
        // Answers trail admissions by the latency: until a window plus a latency has passed
        // since the start, the count says more about latency than about the provider.
        let warm = window + secs(self.latency.unwrap_or(f64::INFINITY));
        if now.saturating_duration_since(self.started) < warm
            || self.last_pause_end(now, window).is_some()
        {
            return None;
        }
        let span = window.as_secs_f64();
        let n = self.accepted.len() as f64;
        let tokens: f64 = self.accepted.iter().map(|(_, t)| f64::from(*t)).sum();
        Some((n / span, tokens / span))
    }

    /// End of the latest pause, if it ended within the window.
    fn last_pause_end(&self, now: Instant, window: Duration) -> Option<Instant> {
        self.pauses
            .back()
            .map(|(_, end)| *end)
            .filter(|end| now.saturating_duration_since(*end) < window)
    }

    fn refused_between(&self, dim: Kind, from: u64, to: u64) -> f64 {
        self.refused
            .iter()
            .filter(|(s, _)| *s > from && *s <= to)
            .map(|(_, cost)| if dim == Kind::Requests { 1.0 } else { *cost })
            .sum()
    }

    fn on_outcome(
        &mut self,
        config: &LimiterConfig,
        permit: &Permit,
        outcome: Outcome,
        now: Instant,
    ) -> Wake {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.advance(config, now);
        let window = config.window();
        let g = permit.grant;
        self.outstanding.remove(&g.seq);
        match outcome {
            Outcome::Success { tokens_used, .. } => {
                self.resolved.push_back((g.issued, tokens_used, true));
                let sample = now.saturating_duration_since(g.issued).as_secs_f64();
                self.latency = Some(self.latency.map_or(sample, |l| 0.9 * l + 0.1 * sample));
            }
            Outcome::RateLimited { .. } => self.resolved.push_back((g.issued, 0, false)),
            Outcome::TimedOut | Outcome::Failure => {}
        }
        self.steer_concurrency(permit, outcome, now);
        match outcome {
            Outcome::Success {
                rate_limit,
                tokens_used,
                ..
            } => {
                self.accepted.push_back((now, tokens_used));
                // Settle the token pacer to the real usage.
                if self.tok.paced() {
                    let diff = f64::from(tokens_used) - f64::from(permit.est_tokens);
                    let shift = diff / self.tok.rate;
                    self.tok.tat = if shift >= 0.0 {
                        self.tok.tat + secs(shift)
                    } else {
                        self.tok
                            .tat
                            .checked_sub(secs(-shift))
                            .unwrap_or(self.tok.tat)
                            .max(now)
                    };
                }
                self.prune(now, window);
                self.observe_headers(config, permit, &rate_limit, false, now, window);
            }
            Outcome::RateLimited {
                retry_after,
                rate_limit,
            } => {
                self.rate_limited += 1;
                self.refused
                    .push_back((g.seq, f64::from(permit.est_tokens)));
                self.prune(now, window);
                self.observe_headers(config, permit, &rate_limit, true, now, window);
                if let Some(ra) = retry_after.or(rate_limit.retry_after) {
                    self.pause(
                        now,
                        ra.min(Duration::from_millis(config.max_pause_ms)),
                        window,
                    );
                }
                let kind = self.attribute(&rate_limit, permit.est_tokens);
                self.signal(config, kind, Signal::Loss, g, now, window);
            }
            Outcome::TimedOut | Outcome::Failure => {}
        }
        let mut wake = Wake::new();
        self.dispatch(config, now, &mut wake);
        wake
    }

    /// Feeds an outcome to the adaptive concurrency limit.
    fn steer_concurrency(&mut self, permit: &Permit, outcome: Outcome, now: Instant) {
        let seq_now = self.seq;
        let Some(c) = self.concurrency.as_mut() else {
            return;
        };
        let g = permit.grant;
        match outcome {
            Outcome::Success {
                rate_limit,
                output_tokens,
                ..
            } => {
                if rate_limit != RateLimitInfo::default() {
                    c.on_rate_signal(now);
                }
                let sample = Sample {
                    seq: g.seq,
                    in_flight_before: g.in_flight_before,
                    latency: now.saturating_duration_since(g.issued).as_secs_f64(),
                    output_tokens,
                };
                c.on_sample(sample, seq_now, now);
            }
            Outcome::RateLimited { .. } => c.on_rate_signal(now),
            Outcome::TimedOut => c.on_timeout(g.seq, seq_now),
            Outcome::Failure => {}
        }
    }

    /// Stops admissions for `length` from `now`.
    fn pause(&mut self, now: Instant, length: Duration, window: Duration) {
        let until = now + length.min(MAX_INTERVAL);
        self.pause_until = Some(self.pause_until.map_or(until, |p| p.max(until)));
        self.req.tat = self.req.tat.max(until);
        match self.pauses.back_mut() {
            Some((_, end)) if *end >= now => *end = (*end).max(until),
            _ => self.pauses.push_back((now, until)),
        }
        while self
            .pauses
            .front()
            .is_some_and(|(_, end)| now.saturating_duration_since(*end) > window * 2)
        {
            self.pauses.pop_front();
        }
    }

    /// Which dimension a 429 is about.
    fn attribute(&self, rl: &RateLimitInfo, est_tokens: u32) -> Kind {
        match (rl.remaining_requests, rl.remaining_tokens) {
            (Some(0), _) => Kind::Requests,
            (_, Some(t)) if t < u64::from(est_tokens.max(1)) => Kind::Tokens,
            (Some(_), _) => Kind::Requests,
            _ => match (self.req.last_binding, self.tok.last_binding) {
                (r, Some(t)) if self.tok.paced() && r.is_none_or(|r| t > r) => Kind::Tokens,
                _ => Kind::Requests,
            },
        }
    }

    /// Learns from rate-limit headers of an answer (`refused`: it was a 429).
    fn observe_headers(
        &mut self,
        config: &LimiterConfig,
        permit: &Permit,
        rl: &RateLimitInfo,
        refused: bool,
        now: Instant,
        window: Duration,
    ) {
        let g = permit.grant;
        let age = now.saturating_duration_since(g.issued);
        if let Some(limit) = rl.limit_requests {
            self.req.follow_limit(limit as f64, g.seq, self.seq, now);
        }
        if let Some(limit) = rl.limit_tokens {
            self.tok.follow_limit(limit as f64, g.seq, self.seq, now);
        }
        if let Some(remaining) = rl.remaining_requests {
            let remaining = remaining as f64;
            let obs = Obs {
                seq: g.seq,
                issued: g.issued,
                cum_cost: g.seq as f64,
                remaining,
            };
            self.req.observe(obs, window, now);
            self.req.end_slow_start_if_draining(remaining, g.req_rate);
            if !refused
                && self
                    .req
                    .nearly_spent(remaining, rl.reset_requests, g.req_rate, age)
            {
                self.signal(config, Kind::Requests, Signal::Early, g, now, window);
            }
        }
        if let Some(remaining) = rl.remaining_tokens {
            let remaining = remaining as f64;
            let obs = Obs {
                seq: g.seq,
                issued: g.issued,
                cum_cost: g.cum_tokens,
                remaining,
            };
            self.tok.observe(obs, window, now);
            let rate = if g.tok_rate.is_finite() {
                g.tok_rate
            } else {
                self.accepted_rate(now, window).map_or(0.0, |a| a.1)
            };
            let spent = remaining < f64::from(permit.est_tokens)
                || self.tok.nearly_spent(remaining, rl.reset_tokens, rate, age);
            if !refused && spent {
                self.signal(config, Kind::Tokens, Signal::Early, g, now, window);
            }
        }
    }

    /// A congestion event on one dimension: cut once per event.
    fn signal(
        &mut self,
        config: &LimiterConfig,
        kind: Kind,
        signal: Signal,
        g: Grant,
        now: Instant,
        window: Duration,
    ) {
        let accepted = self.accepted_rate(now, window);
        let dim = match kind {
            Kind::Requests => &self.req,
            Kind::Tokens => &self.tok,
        };
        if g.seq <= dim.cut_seq && dim.last_cut.is_some() {
            return;
        }
        if signal == Signal::Early
            && dim
                .last_cut
                .is_some_and(|t| now.saturating_duration_since(t) < EARLY_HOLDOFF)
        {
            return;
        }
        // A tiny budget reads 0 even below the provider's rate (two close admissions drain
        // it): during slow start that is no evidence of the limit.
        if signal == Signal::Early && dim.ceiling.is_none() && !dim.levels_readable() {
            return;
        }
        let bounds = dim.supply_bounds(window);
        let from_headers = bounds.map(|(first, last)| {
            let rejected = self.refused_between(kind, first.seq, last.seq);
            Dim::header_supply(first, last, rejected)
        });
        let accepted = accepted.map(|(r, t)| match kind {
            Kind::Requests => r,
            Kind::Tokens => t,
        });
        let dim = match kind {
            Kind::Requests => &mut self.req,
            Kind::Tokens => &mut self.tok,
        };
        let informed = dim
            .obs
            .back()
            .is_some_and(|o| now.saturating_duration_since(o.issued) < HEADERS_FRESH);
        let early = config.early_decrease_factor;
        let loss = if informed {
            config.informed_decrease_factor
        } else {
            config.decrease_factor
        };
        let (to, supplied) = match signal {
            Signal::Early => {
                let Some(s) = from_headers.or(accepted) else {
                    return;
                };
                // An early warning never cuts deeply: other instances sharing the quota see
                // it at the same moment, and a tiny budget overflows unseen, so the supply
                // reads low.
                let gentlest = if dim.levels_readable() {
                    EARLY_MAX_DECREASE
                } else {
                    UNREADABLE_EARLY_DECREASE
                };
                let mut floor = 0.5 * accepted.unwrap_or(0.0);
                if dim.paced() {
                    floor = floor.max(gentlest * dim.rate);
                }
                ((early * s).max(floor), s.max(floor))
            }
            Signal::Loss => match from_headers.or(accepted) {
                Some(s) => (loss * s, s),
                // Nothing measurable: plain multiplicative decrease.
                None if dim.paced() => (loss * dim.rate, dim.rate),
                None => return,
            },
        };
        // A loss soon after the previous cut means that cut did not reach the provider's
        // rate yet (measurements lag a change): keep decreasing multiplicatively.
        let recent_loss = signal == Signal::Loss
            && dim
                .last_cut
                .is_some_and(|t| now.saturating_duration_since(t) < window);
        let to = if recent_loss && dim.paced() {
            to.min(COMPOUND_DECREASE * dim.rate)
        } else {
            to
        };
        // One event never more than halves the rate.
        let to = if dim.paced() {
            to.max(0.5 * dim.rate)
        } else {
            to
        };
        tracing::debug!(
            kind = ?kind,
            signal = ?signal,
            from = dim.rate,
            to,
            supplied,
            "limiter decrease"
        );
        dim.cut(to, supplied, self.seq, now);
    }
}

#[cfg(test)]
mod tests;
