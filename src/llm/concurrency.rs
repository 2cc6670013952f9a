//! Adaptive concurrency of one (provider, model): how many calls may be in flight at once,
//! learned from latency, for providers that queue instead of answering 429 (llama.cpp,
//! vLLM, Ollama: a fixed number of slots, the rest waits in the server).
//!
//! In the spirit of TCP Vegas and Netflix's concurrency limits, with means instead of
//! minimums, because LLM latency scatters widely even on an idle provider:
//!
//! * **Like with like.** Answers are grouped by output tokens (buckets growing by √2); each
//!   bucket gets a scale from its first answers, so an answer's *relative latency* `x` (its
//!   latency over its bucket's scale) does not depend on its size. A bucket first seen
//!   under load takes the relative latency of the answers around it, so scales of all
//!   sizes agree.
//! * **Rounds.** Decisions are taken once per round: the answers to calls sent since the
//!   last decision, at least 8 and half the limit (about a round trip). A round gives the
//!   mean relative latency, its spread, and the mean calls in flight `c` when they were
//!   sent.
//! * **Reference.** The round with the lowest load so far stands for the unloaded provider
//!   (rounds at a similar load are pooled into it). A round whose mean exceeds the
//!   reference by more than 2.5 standard errors — and by `min_delay_ms` in time — shows a
//!   queue of `q = c × (1 − x_ref / x)` calls (Vegas: with `n` slots and `c > n` calls in
//!   flight, latency is `c / n` times the unloaded one, and `q = c − n`). Anything less is
//!   scatter, not queueing: a provider whose latency does not grow with load never shrinks
//!   the limit, however noisy.
//! * **Control.** Below `min_queue` the limit grows — doubling per round until the first
//!   queue is seen, then by a tenth per round — but only while it held a caller back. Above
//!   `max_queue` it drops to the estimated slot count plus the middle of the band (never
//!   more than halving per round). Both thresholds scale with `max(1, log10(limit))`. A
//!   timeout is congestion beyond doubt: the limit halves, once per event (calls sent
//!   before the cut belong to it), and is not a latency sample.
//! * **Re-probing.** Every `probe_interval_ms` (and at least 30 round trips) one round runs
//!   at half the reference's load, refreshing the reference (it moves towards the truly
//!   unloaded latency, and follows a provider that got slower or faster).
//! * **Rate-limited providers.** A 429 or `x-ratelimit-*` headers mean the provider limits
//!   by rate, and the rate pacers are in charge: for a minute after such a signal the
//!   concurrency limit is not enforced, and it follows the calls in flight upward, so it
//!   never costs throughput there.
//!
//! Time is `tokio::time::Instant`, so tests drive it with paused time.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

fn default_enabled() -> bool {
    true
}
fn default_initial_limit() -> usize {
    4
}
fn default_min_limit() -> usize {
    1
}
fn default_max_limit() -> usize {
    1_000
}
fn default_min_queue() -> f64 {
    1.0
}
fn default_max_queue() -> f64 {
    3.0
}
fn default_min_delay_ms() -> u64 {
    20
}
fn default_probe_interval_ms() -> u64 {
    30_000
}

/// Tuning of the adaptive concurrency limit of a model (see the module documentation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConcurrencyConfig {
    /// Learn a limit on calls in flight from latency. `false` leaves only the static
    /// `max_concurrency`.
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    /// Calls in flight allowed before any answer came back.
    #[serde(default = "default_initial_limit")]
    pub initial_limit: usize,
    /// Floor of the limit (at least 1).
    #[serde(default = "default_min_limit")]
    pub min_limit: usize,
    /// Ceiling of the limit.
    #[serde(default = "default_max_limit")]
    pub max_limit: usize,
    /// The limit grows while fewer calls than this are estimated to wait at the provider
    /// (scaled by `max(1, log10(limit))`).
    #[serde(default = "default_min_queue")]
    pub min_queue: f64,
    /// The limit drops when more calls than this are estimated to wait at the provider
    /// (scaled the same way).
    #[serde(default = "default_max_queue")]
    pub max_queue: f64,
    /// A mean queueing delay below this many milliseconds counts as no queue (at a few
    /// milliseconds per call, the host's own scheduling says nothing about the provider).
    #[serde(default = "default_min_delay_ms")]
    pub min_delay_ms: u64,
    /// Interval of the probe rounds that refresh the unloaded reference, in milliseconds
    /// (at least 30 round trips).
    #[serde(default = "default_probe_interval_ms")]
    pub probe_interval_ms: u64,
}

impl Default for ConcurrencyConfig {
    fn default() -> Self {
        Self {
            enabled: default_enabled(),
            initial_limit: default_initial_limit(),
            min_limit: default_min_limit(),
            max_limit: default_max_limit(),
            min_queue: default_min_queue(),
            max_queue: default_max_queue(),
            min_delay_ms: default_min_delay_ms(),
            probe_interval_ms: default_probe_interval_ms(),
        }
    }
}

impl ConcurrencyConfig {
    /// Checks the ranges serde cannot express; the error names the offending key.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.min_limit == 0 {
            return Err(("min_limit", "must be at least 1".into()));
        }
        if self.max_limit < self.min_limit {
            return Err(("max_limit", "must be at least min_limit".into()));
        }
        if !(self.min_limit..=self.max_limit).contains(&self.initial_limit) {
            return Err((
                "initial_limit",
                "must be between min_limit and max_limit".into(),
            ));
        }
        if !(self.min_queue.is_finite() && self.min_queue > 0.0) {
            return Err(("min_queue", "must be a positive number".into()));
        }
        if !(self.max_queue.is_finite() && self.max_queue > self.min_queue) {
            return Err(("max_queue", "must be a number above min_queue".into()));
        }
        Ok(())
    }
}

/// Latency buckets by output tokens: `2 × log2(tokens)`, so neighbours differ by √2.
const BUCKETS: usize = 64;
/// Answers that set a bucket's scale.
const SCALE_SAMPLES: u32 = 4;
/// Answers a round needs at least.
const MIN_ROUND: usize = 8;
/// Answers a probe round needs.
const PROBE_ROUND: usize = 4;
/// Standard errors by which a round's mean must exceed the reference to show a queue.
const SIGNIFICANCE: f64 = 2.5;
/// Rounds at up to this factor of the reference's load are pooled into it.
const SAME_LOAD: f64 = 1.25;
/// The reference holds at most this many answers (older ones weigh less).
const REFERENCE_CAP: f64 = 256.0;
/// How long a 429 or rate-limit headers keep the rate pacers alone in charge.
const RATE_SIGNAL_HOLD: Duration = Duration::from_secs(60);
/// Growth per round after slow start, as a fraction of the limit (at least one call).
const GROWTH: f64 = 0.1;
/// Probes wait at least this many round trips.
const PROBE_ROUND_TRIPS: f64 = 30.0;

/// One answered call, as the controller sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sample {
    /// Admission sequence number of the call.
    pub seq: u64,
    /// Calls in flight when it was sent, itself excluded.
    pub in_flight_before: usize,
    /// Time from admission to answer, seconds.
    pub latency: f64,
    /// Output (completion) tokens of the answer.
    pub output_tokens: u32,
}

/// A bucket's latency scale: the mean of its first answers, each over the relative
/// latency of the answers around it.
#[derive(Debug, Clone, Copy, Default)]
struct Scale {
    sum: f64,
    n: u32,
}

/// Sums over a set of answers: relative latency, its square, calls in flight, latency.
#[derive(Debug, Clone, Copy, Default)]
struct Stats {
    n: f64,
    x: f64,
    x2: f64,
    c: f64,
    latency: f64,
}

impl Stats {
    fn add(&mut self, x: f64, c: f64, latency: f64) {
        self.n += 1.0;
        self.x += x;
        self.x2 += x * x;
        self.c += c;
        self.latency += latency;
    }

    fn mean(&self) -> f64 {
        self.x / self.n.max(1.0)
    }

    fn load(&self) -> f64 {
        self.c / self.n.max(1.0)
    }

    /// Variance of the mean.
    fn var_of_mean(&self) -> f64 {
        if self.n < 2.0 {
            return 0.0;
        }
        let m = self.mean();
        ((self.x2 - self.n * m * m) / (self.n - 1.0)).max(0.0) / self.n
    }

    fn pool(&mut self, other: &Stats) {
        self.n += other.n;
        self.x += other.x;
        self.x2 += other.x2;
        self.c += other.c;
        self.latency += other.latency;
        if self.n > REFERENCE_CAP {
            let k = REFERENCE_CAP / self.n;
            self.n *= k;
            self.x *= k;
            self.x2 *= k;
            self.c *= k;
            self.latency *= k;
        }
    }
}

/// The reference: the least loaded answers seen, standing for the unloaded provider.
#[derive(Debug, Clone, Copy)]
struct Reference {
    stats: Stats,
    refreshed: Instant,
}

/// The controller state of one limiter.
#[derive(Debug)]
pub(super) struct ConcurrencyControl {
    config: ConcurrencyConfig,
    limit: f64,
    slow_start: bool,
    scales: [Scale; BUCKETS],
    /// Smoothed relative latency of recent answers (scales new buckets).
    recent_x: f64,
    round: Stats,
    round_started: Option<Instant>,
    reference: Option<Reference>,
    /// Answers to calls admitted up to this sequence number were decided on already.
    decided_seq: u64,
    /// A caller waited on this limit during the round.
    held_back: bool,
    /// Timeouts of calls admitted up to this sequence number belong to the last cut.
    timeout_cut_seq: u64,
    rate_signal_at: Option<Instant>,
    /// The bound of a running probe round.
    probe: Option<usize>,
    /// Smoothed latency, seconds.
    latency: Option<f64>,
}

impl ConcurrencyControl {
    pub(super) fn new(config: ConcurrencyConfig, _now: Instant) -> Self {
        let min = config.min_limit.max(1);
        let max = config.max_limit.max(min);
        let limit = config.initial_limit.clamp(min, max) as f64;
        Self {
            config,
            limit,
            slow_start: true,
            scales: [Scale::default(); BUCKETS],
            recent_x: 1.0,
            round: Stats::default(),
            round_started: None,
            reference: None,
            decided_seq: 0,
            held_back: false,
            timeout_cut_seq: 0,
            rate_signal_at: None,
            probe: None,
            latency: None,
        }
    }

    fn floor(&self) -> f64 {
        self.config.min_limit.max(1) as f64
    }

    fn ceiling(&self) -> f64 {
        self.config.max_limit.max(self.config.min_limit.max(1)) as f64
    }

    /// Whether a recent rate-limit signal puts the rate pacers alone in charge.
    fn suspended(&self, now: Instant) -> bool {
        self.rate_signal_at
            .is_some_and(|t| now.saturating_duration_since(t) < RATE_SIGNAL_HOLD)
    }

    fn round_trip(&self) -> f64 {
        self.latency.unwrap_or(0.0)
    }

    fn probe_interval(&self) -> f64 {
        (self.config.probe_interval_ms as f64 / 1000.0).max(PROBE_ROUND_TRIPS * self.round_trip())
    }

    /// The learned limit (the figure exported as a gauge).
    pub(super) fn limit(&self) -> usize {
        self.limit.floor().max(1.0) as usize
    }

    /// The bound on calls in flight now; `None` while rate-limit signals suspend it.
    pub(super) fn bound(&mut self, now: Instant) -> Option<usize> {
        if self.suspended(now) {
            return None;
        }
        Some(self.probe.unwrap_or_else(|| self.limit()))
    }

    /// A waiter was held back by [`bound`](Self::bound) (outside a probe).
    pub(super) fn held_back(&mut self) {
        if self.probe.is_none() {
            self.held_back = true;
        }
    }

    /// A 429, or an answer with rate-limit headers.
    pub(super) fn on_rate_signal(&mut self, now: Instant) {
        self.rate_signal_at = Some(now);
        self.probe = None;
    }

    /// A call timed out: halve the limit, once per event.
    pub(super) fn on_timeout(&mut self, seq: u64, seq_now: u64) {
        if seq <= self.timeout_cut_seq {
            return;
        }
        let to = (self.limit * 0.5).max(self.floor());
        tracing::debug!(from = self.limit, to, "concurrency decrease on a timeout");
        self.limit = to;
        self.slow_start = false;
        self.timeout_cut_seq = seq_now;
        self.probe = None;
        self.new_round(seq_now);
    }

    /// An answered call. `seq_now` is the last admission's sequence number.
    pub(super) fn on_sample(&mut self, s: Sample, seq_now: u64, now: Instant) {
        if !(s.latency.is_finite() && s.latency > 0.0) || s.output_tokens == 0 {
            return;
        }
        self.latency = Some(
            self.latency
                .map_or(s.latency, |l| 0.9 * l + 0.1 * s.latency),
        );
        let bucket = ((2.0 * f64::from(s.output_tokens).log2()) as usize).min(BUCKETS - 1);
        let scale = &mut self.scales[bucket];
        if scale.n < SCALE_SAMPLES {
            scale.sum += s.latency / self.recent_x;
            scale.n += 1;
        }
        let x = s.latency / (scale.sum / f64::from(scale.n));
        self.recent_x = 0.9 * self.recent_x + 0.1 * x;
        let c = (s.in_flight_before + 1) as f64;
        if self.suspended(now) {
            // The rate pacers are in charge: never bind below what they let through.
            self.limit = self.limit.max(c).min(self.ceiling());
            self.new_round(seq_now);
            return;
        }
        if s.seq <= self.decided_seq {
            return;
        }
        self.round.add(x, c, s.latency);
        let started = *self.round_started.get_or_insert(now);
        let needed = match self.probe {
            Some(_) => PROBE_ROUND,
            None => MIN_ROUND.max((self.limit / 2.0) as usize),
        };
        let long = now.saturating_duration_since(started).as_secs_f64() >= 4.0 * self.round_trip()
            && self.round.n >= PROBE_ROUND as f64;
        if self.round.n >= needed as f64 || long {
            self.decide(seq_now, now);
        }
    }

    /// Ends a round: refreshes the reference and adjusts the limit from the queue estimate.
    fn decide(&mut self, seq_now: u64, now: Instant) {
        let r = self.round;
        let probing = self.probe.take().is_some();
        let Some(mut reference) = self.reference else {
            self.reference = Some(Reference {
                stats: r,
                refreshed: now,
            });
            self.grow();
            return self.new_round(seq_now);
        };
        let spread = (r.var_of_mean() + reference.stats.var_of_mean()).sqrt();
        let (x, x_ref) = (r.mean(), reference.stats.mean());
        let delay = r.latency / r.n * (1.0 - x_ref / x);
        let rise =
            x - x_ref > SIGNIFICANCE * spread && delay * 1000.0 >= self.config.min_delay_ms as f64;
        let drop = x_ref - x > SIGNIFICANCE * spread;
        let stale = now
            .saturating_duration_since(reference.refreshed)
            .as_secs_f64()
            >= self.probe_interval();
        // A less loaded round is a better reference; a similar one refines it; a probe or a
        // stale reference is replaced by what the provider shows now; a significant drop
        // means the provider got faster.
        let lighter = r.load() * SAME_LOAD < reference.stats.load();
        let similar = r.load() <= reference.stats.load() * SAME_LOAD;
        if probing || drop || (similar && (lighter || stale)) {
            reference = Reference {
                stats: r,
                refreshed: now,
            };
        } else if similar && !rise {
            reference.stats.pool(&r);
        }
        self.reference = Some(reference);
        if probing {
            return self.new_round(seq_now);
        }
        let queue = if rise {
            r.load() * (1.0 - x_ref / x)
        } else {
            0.0
        };
        let scale = self.limit.log10().max(1.0);
        let (low, high) = (self.config.min_queue * scale, self.config.max_queue * scale);
        let before = self.limit;
        if queue > high {
            let target = self.limit - queue + (low + high) / 2.0;
            self.limit = target.min(self.limit - 1.0).max(self.limit * 0.5);
            self.slow_start = false;
        } else if queue < low {
            self.grow();
        } else {
            self.slow_start = false;
        }
        self.limit = self.limit.clamp(self.floor(), self.ceiling());
        if self.limit != before {
            tracing::debug!(from = before, to = self.limit, queue, "concurrency limit");
        }
        if stale && !similar {
            // Next round: half the reference's load, to measure it afresh.
            let bound = (reference.stats.load() / 2.0).floor().max(1.0) as usize;
            tracing::debug!(bound, "concurrency reference probe");
            self.probe = Some(bound.min(self.limit()));
        }
        self.new_round(seq_now);
    }

    /// Grows the limit if it held a caller back this round.
    fn grow(&mut self) {
        if !self.held_back {
            return;
        }
        self.limit = if self.slow_start {
            self.limit * 2.0
        } else {
            self.limit + (GROWTH * self.limit).max(1.0)
        };
        self.limit = self.limit.clamp(self.floor(), self.ceiling());
    }

    fn new_round(&mut self, seq_now: u64) {
        self.round = Stats::default();
        self.round_started = None;
        self.decided_seq = seq_now;
        self.held_back = false;
    }
}

#[cfg(test)]
mod tests;
