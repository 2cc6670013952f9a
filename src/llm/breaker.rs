//! The circuit breaker of one (provider, model).
//!
//! Closed → Open on `consecutive_failures` failures in a row, or when the error rate over a
//! rolling window reaches `error_rate` with at least `min_requests` calls. Open for `open_ms`,
//! then HalfOpen: up to `half_open_probes` probe calls; that many successes close it, one
//! failure re-opens it. Only provider failures count (transient and malformed answers):
//! permanent 4xx and 429 are neutral — the latter is the limiter's job.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::error::ErrorClass;

fn default_consecutive() -> u32 {
    5
}
fn default_error_rate() -> f64 {
    0.5
}
fn default_min_requests() -> u32 {
    20
}
fn default_window_ms() -> u64 {
    10_000
}
fn default_open_ms() -> u64 {
    10_000
}
fn default_probes() -> u32 {
    3
}

/// Thresholds of a [`CircuitBreaker`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive failures that open the circuit.
    #[serde(default = "default_consecutive")]
    pub consecutive_failures: u32,
    /// Failure share over the rolling window that opens the circuit (0..=1).
    #[serde(default = "default_error_rate")]
    pub error_rate: f64,
    /// Calls needed in the window before `error_rate` applies.
    #[serde(default = "default_min_requests")]
    pub min_requests: u32,
    /// Rolling window length in milliseconds.
    #[serde(default = "default_window_ms")]
    pub window_ms: u64,
    /// How long the circuit stays open before probing, in milliseconds.
    #[serde(default = "default_open_ms")]
    pub open_ms: u64,
    /// Probe calls allowed while half-open; that many successes close the circuit.
    #[serde(default = "default_probes")]
    pub half_open_probes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: default_consecutive(),
            error_rate: default_error_rate(),
            min_requests: default_min_requests(),
            window_ms: default_window_ms(),
            open_ms: default_open_ms(),
            half_open_probes: default_probes(),
        }
    }
}

/// The externally visible state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls flow.
    Closed,
    /// A few probe calls flow.
    HalfOpen,
    /// Calls are refused.
    Open,
}

impl BreakerState {
    /// Gauge value for `sluice_breaker_state`: 0 closed, 1 half-open, 2 open.
    pub fn as_gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        }
    }
}

/// Refusal from [`CircuitBreaker::try_acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("circuit open (next probe in {retry_in:?})")]
pub struct Open {
    /// Time until probes are allowed (zero when half-open with all probe slots taken).
    pub retry_in: Duration,
}

#[derive(Debug)]
enum Phase {
    Closed,
    Open { until: Instant },
    HalfOpen { in_flight: u32, successes: u32 },
}

/// Number of buckets in the rolling window.
const BUCKETS: u32 = 10;

#[derive(Debug)]
struct Bucket {
    start: Instant,
    ok: u32,
    failed: u32,
}

#[derive(Debug)]
struct Inner {
    phase: Phase,
    /// Bumped on every transition; permits of older generations are ignored.
    generation: u64,
    consecutive: u32,
    window: VecDeque<Bucket>,
}

/// A circuit breaker; cheap to clone, clones share state.
#[derive(Debug, Clone)]
pub struct CircuitBreaker {
    config: BreakerConfig,
    inner: Arc<Mutex<Inner>>,
}

/// Admission to one call; report its result with [`BreakerPermit::record`] (or the specific
/// methods). Dropping it unreported is neutral.
#[must_use = "report the call's result"]
#[derive(Debug)]
pub struct BreakerPermit {
    breaker: CircuitBreaker,
    generation: u64,
    probe: bool,
    done: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Success,
    Failure,
    Neutral,
}

impl BreakerPermit {
    /// Whether this call is a half-open probe.
    pub fn is_probe(&self) -> bool {
        self.probe
    }

    /// Reports a call result: `None` is success; errors count by class.
    pub fn record(self, error: Option<&ErrorClass>) {
        match error {
            None => self.success(),
            Some(c) if c.counts_as_provider_failure() => self.failure(),
            Some(_) => self.neutral(),
        }
    }

    /// The provider answered.
    pub fn success(mut self) {
        self.finish(Verdict::Success);
    }

    /// The provider failed (transient or malformed).
    pub fn failure(mut self) {
        self.finish(Verdict::Failure);
    }

    /// Neither (429, permanent 4xx, cancelled).
    pub fn neutral(mut self) {
        self.finish(Verdict::Neutral);
    }

    fn finish(&mut self, verdict: Verdict) {
        if !self.done {
            self.done = true;
            self.breaker
                .on_result(self.generation, self.probe, verdict, Instant::now());
        }
    }
}

impl Drop for BreakerPermit {
    fn drop(&mut self) {
        self.finish(Verdict::Neutral);
    }
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            inner: Arc::new(Mutex::new(Inner {
                phase: Phase::Closed,
                generation: 0,
                consecutive: 0,
                window: VecDeque::new(),
            })),
        }
    }

    /// The current state (moving Open to HalfOpen once the cool-down has passed).
    pub fn state(&self) -> BreakerState {
        let mut inner = self.inner.lock();
        self.refresh(&mut inner, Instant::now());
        match inner.phase {
            Phase::Closed => BreakerState::Closed,
            Phase::Open { .. } => BreakerState::Open,
            Phase::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Whether a call would be refused right now (without taking a probe slot).
    pub fn is_open(&self) -> bool {
        self.state() == BreakerState::Open
    }

    /// Admits one call, or refuses while open / while all probe slots are taken.
    pub fn try_acquire(&self) -> Result<BreakerPermit, Open> {
        let now = Instant::now();
        let mut inner = self.inner.lock();
        self.refresh(&mut inner, now);
        let generation = inner.generation;
        let probe = match &mut inner.phase {
            Phase::Closed => false,
            Phase::Open { until } => {
                return Err(Open {
                    retry_in: until.saturating_duration_since(now),
                })
            }
            Phase::HalfOpen {
                in_flight,
                successes,
            } => {
                if *in_flight + *successes >= self.config.half_open_probes.max(1) {
                    return Err(Open {
                        retry_in: Duration::ZERO,
                    });
                }
                *in_flight += 1;
                true
            }
        };
        Ok(BreakerPermit {
            breaker: self.clone(),
            generation,
            probe,
            done: false,
        })
    }

    fn refresh(&self, inner: &mut Inner, now: Instant) {
        if let Phase::Open { until } = inner.phase {
            if now >= until {
                inner.phase = Phase::HalfOpen {
                    in_flight: 0,
                    successes: 0,
                };
                inner.generation += 1;
            }
        }
    }

    fn open(&self, inner: &mut Inner, now: Instant) {
        inner.phase = Phase::Open {
            until: now + Duration::from_millis(self.config.open_ms),
        };
        inner.generation += 1;
        inner.consecutive = 0;
        inner.window.clear();
    }

    fn on_result(&self, generation: u64, probe: bool, verdict: Verdict, now: Instant) {
        let mut inner = self.inner.lock();
        self.refresh(&mut inner, now);
        if generation != inner.generation {
            return;
        }
        match &mut inner.phase {
            Phase::Closed => {
                if verdict == Verdict::Neutral {
                    return;
                }
                let failed = verdict == Verdict::Failure;
                self.count(&mut inner, now, failed);
                if failed {
                    inner.consecutive += 1;
                } else {
                    inner.consecutive = 0;
                }
                let (ok, bad) = inner
                    .window
                    .iter()
                    .fold((0u32, 0u32), |(o, f), b| (o + b.ok, f + b.failed));
                let total = ok + bad;
                let rate_trips = total >= self.config.min_requests.max(1)
                    && f64::from(bad) >= self.config.error_rate * f64::from(total);
                if failed && (inner.consecutive >= self.config.consecutive_failures || rate_trips) {
                    self.open(&mut inner, now);
                }
            }
            Phase::HalfOpen {
                in_flight,
                successes,
            } if probe => {
                *in_flight = in_flight.saturating_sub(1);
                match verdict {
                    Verdict::Neutral => {}
                    Verdict::Failure => self.open(&mut inner, now),
                    Verdict::Success => {
                        *successes += 1;
                        if *successes >= self.config.half_open_probes.max(1) {
                            inner.phase = Phase::Closed;
                            inner.generation += 1;
                            inner.consecutive = 0;
                            inner.window.clear();
                        }
                    }
                }
            }
            _ => {}
        }
    }

    fn count(&self, inner: &mut Inner, now: Instant, failed: bool) {
        let window = Duration::from_millis(self.config.window_ms.max(1));
        let bucket_len = window / BUCKETS;
        while inner
            .window
            .front()
            .is_some_and(|b| now.saturating_duration_since(b.start) >= window)
        {
            inner.window.pop_front();
        }
        let fresh = match inner.window.back() {
            Some(b) => now.saturating_duration_since(b.start) >= bucket_len,
            None => true,
        };
        if fresh {
            inner.window.push_back(Bucket {
                start: now,
                ok: 0,
                failed: 0,
            });
        }
        if let Some(b) = inner.window.back_mut() {
            if failed {
                b.failed += 1;
            } else {
                b.ok += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::error::PermanentKind;

    fn config() -> BreakerConfig {
        BreakerConfig {
            consecutive_failures: 3,
            error_rate: 0.5,
            min_requests: 10,
            window_ms: 10_000,
            open_ms: 5_000,
            half_open_probes: 2,
        }
    }

    fn fail(b: &CircuitBreaker) {
        b.try_acquire().unwrap().failure();
    }

    fn succeed(b: &CircuitBreaker) {
        b.try_acquire().unwrap().success();
    }

    #[tokio::test(start_paused = true)]
    async fn opens_on_consecutive_failures() {
        let b = CircuitBreaker::new(config());
        fail(&b);
        fail(&b);
        succeed(&b); // resets the streak
        fail(&b);
        fail(&b);
        assert_eq!(b.state(), BreakerState::Closed);
        fail(&b);
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.state().as_gauge(), 2);
        let err = b.try_acquire().unwrap_err();
        assert_eq!(err.retry_in, Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn opens_on_error_rate_with_minimum_volume() {
        let b = CircuitBreaker::new(config());
        // Alternate: never 3 in a row, but 50% errors.
        for _ in 0..4 {
            succeed(&b);
            fail(&b);
        }
        // 8 calls < min_requests: still closed.
        assert_eq!(b.state(), BreakerState::Closed);
        succeed(&b);
        fail(&b);
        // 10 calls, 5 failed: 50% reaches the threshold.
        assert_eq!(b.state(), BreakerState::Open);
    }

    #[tokio::test(start_paused = true)]
    async fn old_failures_leave_the_window() {
        let b = CircuitBreaker::new(config());
        // 9 calls, 5 failed, never 3 in a row: below the volume minimum.
        for i in 0..9 {
            if i % 2 == 0 {
                fail(&b);
            } else {
                succeed(&b);
            }
        }
        assert_eq!(b.state(), BreakerState::Closed);
        tokio::time::advance(Duration::from_secs(11)).await;
        // Counting the old calls this would be 11 calls with 6 failures (55%).
        succeed(&b);
        fail(&b);
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_errors_and_429_are_neutral() {
        let b = CircuitBreaker::new(config());
        for _ in 0..10 {
            let p = b.try_acquire().unwrap();
            p.record(Some(&ErrorClass::Permanent(PermanentKind::BadRequest)));
            let p = b.try_acquire().unwrap();
            p.record(Some(&ErrorClass::RateLimited { retry_after: None }));
            let p = b.try_acquire().unwrap();
            p.record(Some(&ErrorClass::Config));
        }
        assert_eq!(b.state(), BreakerState::Closed);
        for _ in 0..3 {
            b.try_acquire()
                .unwrap()
                .record(Some(&ErrorClass::Transient));
        }
        assert_eq!(b.state(), BreakerState::Open);
    }

    #[tokio::test(start_paused = true)]
    async fn half_open_probes_close_it() {
        let b = CircuitBreaker::new(config());
        for _ in 0..3 {
            fail(&b);
        }
        tokio::time::advance(Duration::from_millis(4_999)).await;
        assert_eq!(b.state(), BreakerState::Open);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert_eq!(b.state().as_gauge(), 1);
        let p1 = b.try_acquire().unwrap();
        let p2 = b.try_acquire().unwrap();
        assert!(p1.is_probe() && p2.is_probe());
        // Only two probes at a time.
        assert_eq!(b.try_acquire().unwrap_err().retry_in, Duration::ZERO);
        p1.success();
        assert_eq!(b.state(), BreakerState::HalfOpen);
        // A finished success does not free a slot for a third probe.
        assert!(b.try_acquire().is_err());
        p2.success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(!b.try_acquire().unwrap().is_probe());
    }

    #[tokio::test(start_paused = true)]
    async fn probe_failure_reopens_and_late_results_are_ignored() {
        let b = CircuitBreaker::new(config());
        let stale = b.try_acquire().unwrap(); // issued while closed
        for _ in 0..3 {
            fail(&b);
        }
        tokio::time::advance(Duration::from_secs(5)).await;
        let probe = b.try_acquire().unwrap();
        // A call admitted before the circuit opened must not count as a probe result.
        stale.success();
        assert_eq!(b.state(), BreakerState::HalfOpen);
        probe.failure();
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(
            b.try_acquire().unwrap_err().retry_in,
            Duration::from_secs(5)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn dropped_probe_frees_its_slot() {
        let b = CircuitBreaker::new(config());
        for _ in 0..3 {
            fail(&b);
        }
        tokio::time::advance(Duration::from_secs(5)).await;
        let p1 = b.try_acquire().unwrap();
        let p2 = b.try_acquire().unwrap();
        drop(p1);
        let p3 = b.try_acquire().unwrap();
        p2.success();
        p3.success();
        assert_eq!(b.state(), BreakerState::Closed);
    }
}
