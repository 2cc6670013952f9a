//! Token-bucket rate limits (requests/second with burst, requests/minute, tokens/minute) and
//! the OpenAI rate-limit header values they produce.
//!
//! Time is passed in by the caller, so the buckets are tested without sleeping. Limits are
//! re-read on every admission: a configuration change applies to the next request, and a
//! bucket keeps its fill (clamped to its new size).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::config::EffectiveLimits;

/// Above this many distinct limit keys (model names) the limiter forgets all buckets, so a
/// client inventing model names cannot grow memory without bound.
const MAX_KEYS: usize = 4096;

/// A continuously refilled token bucket.
#[derive(Clone, Debug)]
pub(crate) struct Bucket {
    capacity: f64,
    per_second: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    /// A full bucket of `capacity` tokens refilled at `per_second`.
    pub(crate) fn new(capacity: f64, per_second: f64, now: Instant) -> Self {
        Self {
            capacity,
            per_second,
            tokens: capacity,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.per_second).min(self.capacity);
        self.last = now.max(self.last);
    }

    /// Changes size and rate, keeping the current fill (clamped to the new size).
    fn reconfigure(&mut self, capacity: f64, per_second: f64, now: Instant) {
        self.refill(now);
        self.capacity = capacity;
        self.per_second = per_second;
        self.tokens = self.tokens.min(capacity);
    }

    /// A cost larger than the bucket is charged as a full bucket, so it can pass eventually.
    fn effective_cost(&self, cost: f64) -> f64 {
        cost.min(self.capacity)
    }

    /// How long until `cost` tokens are available (zero if they are now).
    pub(crate) fn wait_for(&self, cost: f64) -> Duration {
        let missing = self.effective_cost(cost) - self.tokens;
        if missing <= 1e-9 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(missing / self.per_second)
        }
    }

    fn take(&mut self, cost: f64) {
        self.tokens -= self.effective_cost(cost);
    }

    /// Whole tokens left.
    pub(crate) fn remaining(&self) -> u64 {
        self.tokens.max(0.0).floor() as u64
    }

    /// How long until the bucket is full again.
    pub(crate) fn until_full(&self) -> Duration {
        let missing = self.capacity - self.tokens;
        if missing <= 1e-9 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(missing / self.per_second)
        }
    }

    /// Size of the bucket, in whole tokens.
    pub(crate) fn limit(&self) -> u64 {
        self.capacity.floor() as u64
    }

    fn view(&self) -> BucketView {
        BucketView {
            limit: self.limit(),
            remaining: self.remaining(),
            reset: self.until_full(),
        }
    }
}

/// What the rate-limit headers report about one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BucketView {
    pub limit: u64,
    pub remaining: u64,
    pub reset: Duration,
}

/// The state reported in `x-ratelimit-*` headers after a decision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LimitSnapshot {
    /// The binding request bucket (per second or per minute, whichever has fewer left).
    pub requests: Option<BucketView>,
    /// The token bucket.
    pub tokens: Option<BucketView>,
}

/// Which limit refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LimitKind {
    RequestsPerSecond,
    RequestsPerMinute,
    TokensPerMinute,
}

impl LimitKind {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            LimitKind::RequestsPerSecond => "requests per second (RPS)",
            LimitKind::RequestsPerMinute => "requests per min (RPM)",
            LimitKind::TokensPerMinute => "tokens per min (TPM)",
        }
    }
}

/// Outcome of [`RateLimiter::admit`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum RateDecision {
    /// The request may proceed; its cost has been taken.
    Allowed(LimitSnapshot),
    /// The request is refused; nothing was taken.
    Limited {
        /// The limit that refused it (the one with the longest wait).
        kind: LimitKind,
        /// The limit's size.
        limit: u64,
        /// When every limit would admit the request.
        retry_after: Duration,
        /// Header values.
        snapshot: LimitSnapshot,
    },
}

/// The buckets of one limit key.
#[derive(Debug, Default)]
struct LimitSet {
    rps: Option<Bucket>,
    rpm: Option<Bucket>,
    tpm: Option<Bucket>,
}

fn sync_bucket(slot: &mut Option<Bucket>, want: Option<(f64, f64)>, now: Instant) {
    match (slot.as_mut(), want) {
        (_, None) => *slot = None,
        (None, Some((capacity, rate))) => *slot = Some(Bucket::new(capacity, rate, now)),
        (Some(bucket), Some((capacity, rate))) => bucket.reconfigure(capacity, rate, now),
    }
}

impl LimitSet {
    /// Brings the buckets in line with `limits` and refills them to `now`.
    fn sync(&mut self, limits: &EffectiveLimits, now: Instant) {
        let rps = limits.rps.zip(limits.burst_size()).map(|(r, b)| (b, r));
        let rpm = limits.rpm.map(|r| (f64::from(r), f64::from(r) / 60.0));
        let tpm = limits.tpm.map(|t| (t as f64, t as f64 / 60.0));
        sync_bucket(&mut self.rps, rps, now);
        sync_bucket(&mut self.rpm, rpm, now);
        sync_bucket(&mut self.tpm, tpm, now);
    }

    fn snapshot(&self) -> LimitSnapshot {
        let requests = match (&self.rps, &self.rpm) {
            (None, None) => None,
            (Some(b), None) | (None, Some(b)) => Some(b.view()),
            (Some(s), Some(m)) => Some(if s.remaining() < m.remaining() {
                s.view()
            } else {
                m.view()
            }),
        };
        LimitSnapshot {
            requests,
            tokens: self.tpm.as_ref().map(Bucket::view),
        }
    }
}

/// Rate limits for every key (a model name, or one shared key under global scope).
#[derive(Debug, Default)]
pub(crate) struct RateLimiter {
    sets: HashMap<String, LimitSet>,
}

impl RateLimiter {
    fn set_for(&mut self, key: &str) -> &mut LimitSet {
        if !self.sets.contains_key(key) && self.sets.len() >= MAX_KEYS {
            self.sets.clear();
        }
        self.sets.entry(key.to_owned()).or_default()
    }

    /// Admits one request costing `tokens` under `limits`, or says how long to wait.
    pub(crate) fn admit(
        &mut self,
        key: &str,
        limits: &EffectiveLimits,
        tokens: u64,
        now: Instant,
    ) -> RateDecision {
        let set = self.set_for(key);
        set.sync(limits, now);
        let mut worst: Option<(LimitKind, u64, Duration)> = None;
        let checks = [
            (LimitKind::RequestsPerSecond, &set.rps, 1.0),
            (LimitKind::RequestsPerMinute, &set.rpm, 1.0),
            (LimitKind::TokensPerMinute, &set.tpm, tokens as f64),
        ];
        for (kind, bucket, cost) in checks {
            if let Some(bucket) = bucket {
                let wait = bucket.wait_for(cost);
                if !wait.is_zero() && worst.is_none_or(|(_, _, w)| wait > w) {
                    worst = Some((kind, bucket.limit(), wait));
                }
            }
        }
        if let Some((kind, limit, retry_after)) = worst {
            return RateDecision::Limited {
                kind,
                limit,
                retry_after,
                snapshot: set.snapshot(),
            };
        }
        for (bucket, cost) in [
            (&mut set.rps, 1.0),
            (&mut set.rpm, 1.0),
            (&mut set.tpm, tokens as f64),
        ] {
            if let Some(bucket) = bucket {
                bucket.take(cost);
            }
        }
        RateDecision::Allowed(set.snapshot())
    }

    /// Current header values for `key` without taking anything.
    pub(crate) fn peek(
        &mut self,
        key: &str,
        limits: &EffectiveLimits,
        now: Instant,
    ) -> LimitSnapshot {
        let set = self.set_for(key);
        set.sync(limits, now);
        set.snapshot()
    }
}

/// Formats a duration the way OpenAI's `x-ratelimit-reset-*` headers do: `120ms`, `1s`,
/// `17.28s`, `6m0s`, `1h2m3s`.
pub(crate) fn format_reset(d: Duration) -> String {
    // Rounded up, so a client waiting this long finds the capacity back.
    let total_ms = d.as_nanos().div_ceil(1_000_000);
    if total_ms == 0 {
        return "0s".to_owned();
    }
    if total_ms < 1000 {
        return format!("{total_ms}ms");
    }
    let hours = total_ms / 3_600_000;
    let minutes = (total_ms / 60_000) % 60;
    let secs_ms = total_ms % 60_000;
    let secs = if secs_ms % 1000 == 0 {
        format!("{}s", secs_ms / 1000)
    } else {
        let text = format!("{}.{:03}", secs_ms / 1000, secs_ms % 1000);
        format!("{}s", text.trim_end_matches('0'))
    };
    if hours > 0 {
        format!("{hours}h{minutes}m{secs}")
    } else if minutes > 0 {
        format!("{minutes}m{secs}")
    } else {
        secs
    }
}
