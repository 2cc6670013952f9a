//! The in-operator retry policy: exponential backoff with full jitter, bounded attempts and
//! total delay, stopping at once on errors a retry cannot fix.

use std::time::Duration;

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::error::{ErrorClass, LlmError};

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Try again after this delay.
    RetryAfter(Duration),
    /// Give up; the caller decides (re-publish, dead-letter, stop intake).
    Stop,
}

fn default_max_attempts() -> u32 {
    3
}
fn default_base_ms() -> u64 {
    200
}
fn default_max_delay_ms() -> u64 {
    5_000
}
fn default_max_total_delay_ms() -> u64 {
    15_000
}

/// Bounded exponential backoff with full jitter (`delay = uniform(0, min(max, base·2^(n-1)))`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Attempts per call, the first included. Past them a transient failure is handed to the
    /// caller, which re-publishes the task with `attemptNumber + 1` or dead-letters it.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// Backoff base in milliseconds.
    #[serde(default = "default_base_ms")]
    pub base_ms: u64,
    /// Cap on one backoff delay in milliseconds; a `Retry-After` longer than this stops the
    /// retries instead of blocking the operator.
    #[serde(default = "default_max_delay_ms")]
    pub max_delay_ms: u64,
    /// Cap on the sum of delays of one call, in milliseconds.
    #[serde(default = "default_max_total_delay_ms")]
    pub max_total_delay_ms: u64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: default_max_attempts(),
            base_ms: default_base_ms(),
            max_delay_ms: default_max_delay_ms(),
            max_total_delay_ms: default_max_total_delay_ms(),
        }
    }
}

impl RetryPolicy {
    /// Backoff base.
    pub fn base(&self) -> Duration {
        Duration::from_millis(self.base_ms)
    }

    /// Cap on one delay.
    pub fn max_delay(&self) -> Duration {
        Duration::from_millis(self.max_delay_ms)
    }

    /// Cap on the total delay of one call.
    pub fn max_total_delay(&self) -> Duration {
        Duration::from_millis(self.max_total_delay_ms)
    }

    /// The upper bound of the jittered delay after `attempt` (1-based) failed attempts.
    pub fn backoff_ceiling(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(30);
        self.base()
            .saturating_mul(1u32 << exp)
            .min(self.max_delay())
    }

    /// Decides after `attempt` (1-based) attempts have failed, the last with `error`.
    pub fn decide(&self, attempt: u32, error: &LlmError) -> RetryDecision {
        self.decide_with(attempt, error, &mut rand::rng())
    }

    /// [`RetryPolicy::decide`] with an injected random source.
    pub fn decide_with<R: Rng + ?Sized>(
        &self,
        attempt: u32,
        error: &LlmError,
        rng: &mut R,
    ) -> RetryDecision {
        let class = error.class();
        if !class.is_retryable() || attempt >= self.max_attempts {
            return RetryDecision::Stop;
        }
        let ceiling = self.backoff_ceiling(attempt);
        let jittered = Duration::from_secs_f64(rng.random_range(0.0..=ceiling.as_secs_f64()));
        let delay = match class {
            ErrorClass::RateLimited {
                retry_after: Some(hint),
            } if hint > jittered => {
                if hint > self.max_delay() {
                    return RetryDecision::Stop;
                }
                hint
            }
            _ => jittered,
        };
        RetryDecision::RetryAfter(delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::ratelimit::RateLimitInfo;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn status(status: u16, code: Option<&str>, retry_after: Option<Duration>) -> LlmError {
        LlmError::Status {
            status,
            code: code.map(str::to_string),
            kind: None,
            message: String::new(),
            rate_limit: Box::new(RateLimitInfo {
                retry_after,
                ..Default::default()
            }),
        }
    }

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 6,
            base_ms: 100,
            max_delay_ms: 1_000,
            max_total_delay_ms: 5_000,
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let p = policy();
        let ceilings: Vec<u64> = (1..=6)
            .map(|a| p.backoff_ceiling(a).as_millis() as u64)
            .collect();
        assert_eq!(ceilings, vec![100, 200, 400, 800, 1000, 1000]);
        assert_eq!(p.backoff_ceiling(200), Duration::from_millis(1000));
    }

    #[test]
    fn full_jitter_spans_zero_to_ceiling() {
        let p = policy();
        let mut rng = StdRng::seed_from_u64(7);
        let err = LlmError::Timeout(Duration::from_secs(1));
        for attempt in 1..=4 {
            let ceiling = p.backoff_ceiling(attempt);
            let samples: Vec<Duration> = (0..2000)
                .map(|_| match p.decide_with(attempt, &err, &mut rng) {
                    RetryDecision::RetryAfter(d) => d,
                    RetryDecision::Stop => panic!("transient must retry"),
                })
                .collect();
            assert!(samples.iter().all(|d| *d <= ceiling));
            let min = samples.iter().min().unwrap();
            let max = samples.iter().max().unwrap();
            let mean: f64 =
                samples.iter().map(Duration::as_secs_f64).sum::<f64>() / samples.len() as f64;
            // Full jitter: the whole range is used, centred on half the ceiling.
            assert!(min.as_secs_f64() < 0.05 * ceiling.as_secs_f64());
            assert!(max.as_secs_f64() > 0.95 * ceiling.as_secs_f64());
            assert!((mean / ceiling.as_secs_f64() - 0.5).abs() < 0.05, "{mean}");
        }
    }

    #[test]
    fn stops_after_max_attempts() {
        let p = policy();
        let err = status(503, None, None);
        assert!(matches!(p.decide(5, &err), RetryDecision::RetryAfter(_)));
        assert_eq!(p.decide(6, &err), RetryDecision::Stop);
    }

    #[test]
    fn permanent_config_and_open_circuit_stop_at_once() {
        let p = policy();
        for err in [
            status(400, None, None),
            status(400, Some("content_policy_violation"), None),
            status(400, Some("context_length_exceeded"), None),
            status(401, None, None),
            status(404, Some("model_not_found"), None),
            LlmError::CircuitOpen("m".into()),
            LlmError::ContentFiltered(Default::default()),
        ] {
            assert_eq!(p.decide(1, &err), RetryDecision::Stop, "{err}");
        }
    }

    #[test]
    fn transient_and_malformed_retry() {
        let p = policy();
        for err in [
            status(500, None, None),
            status(502, None, None),
            status(408, None, None),
            status(409, None, None),
            LlmError::Connect("refused".into()),
            LlmError::Malformed("syntax".into()),
        ] {
            assert!(
                matches!(p.decide(1, &err), RetryDecision::RetryAfter(_)),
                "{err}"
            );
        }
    }

    #[test]
    fn retry_after_hint_wins_when_longer() {
        let p = policy();
        let mut rng = StdRng::seed_from_u64(1);
        let err = status(429, None, Some(Duration::from_millis(700)));
        // Ceiling after attempt 1 is 100 ms, so the 700 ms hint always wins.
        for _ in 0..100 {
            assert_eq!(
                p.decide_with(1, &err, &mut rng),
                RetryDecision::RetryAfter(Duration::from_millis(700))
            );
        }
        // A short hint does not shorten the jittered backoff below itself.
        let err = status(429, None, Some(Duration::from_millis(1)));
        let mut longer = 0;
        for _ in 0..200 {
            match p.decide_with(4, &err, &mut rng) {
                RetryDecision::RetryAfter(d) => {
                    assert!(d >= Duration::from_millis(1) && d <= p.backoff_ceiling(4));
                    if d > Duration::from_millis(1) {
                        longer += 1;
                    }
                }
                RetryDecision::Stop => panic!("429 must retry"),
            }
        }
        assert!(longer > 190);
        // A hint beyond the per-delay cap hands the task back to the caller.
        let err = status(429, None, Some(Duration::from_secs(30)));
        assert_eq!(p.decide(1, &err), RetryDecision::Stop);
        // 429 without a hint retries with plain backoff.
        let err = status(429, None, None);
        assert!(matches!(p.decide(1, &err), RetryDecision::RetryAfter(_)));
    }
}
