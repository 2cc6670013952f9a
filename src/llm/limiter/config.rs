//! The limiter's settings (`[llm.models.limiter]`) and their defaults.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::llm::concurrency::ConcurrencyConfig;

fn default_initial_rps() -> f64 {
    10.0
}
fn default_min_rps() -> f64 {
    0.2
}
fn default_max_rps() -> f64 {
    10_000.0
}
fn default_min_tpm() -> f64 {
    1_000.0
}
fn default_weights() -> [u32; 3] {
    [8, 4, 1]
}
fn default_decrease() -> f64 {
    0.95
}
fn default_informed_decrease() -> f64 {
    0.93
}
fn default_early_decrease() -> f64 {
    0.97
}
fn default_probe_growth() -> f64 {
    0.015
}
fn default_window_ms() -> u64 {
    1_000
}
fn default_max_pause_ms() -> u64 {
    60_000
}

/// Tuning of an [`AimdLimiter`]. The defaults suit hosted APIs and local servers alike.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimiterConfig {
    /// Requests/s before any feedback; slow-start doubles it each second until congestion.
    #[serde(default = "default_initial_rps")]
    pub initial_rps: f64,
    /// Floor of the request rate.
    #[serde(default = "default_min_rps")]
    pub min_rps: f64,
    /// Cap of the request rate (a known contractual limit, if any).
    #[serde(default = "default_max_rps")]
    pub max_rps: f64,
    /// Tokens/min before any token feedback; unset means tokens are not paced until the
    /// provider signals a token limit.
    #[serde(default)]
    pub initial_tpm: Option<f64>,
    /// Floor of the token rate, per minute.
    #[serde(default = "default_min_tpm")]
    pub min_tpm: f64,
    /// Cap on calls in flight; unset means no cap.
    #[serde(default)]
    pub max_concurrency: Option<usize>,
    /// Adaptive limit on calls in flight, learned from latency, for providers that queue
    /// instead of answering 429 (llama.cpp, vLLM, Ollama).
    #[serde(default)]
    pub concurrency: ConcurrencyConfig,
    /// Fair-queueing weights of `high`, `normal`, `batch`.
    #[serde(default = "default_weights")]
    pub weights: [u32; 3],
    /// On a 429, the new rate as a fraction of the recently supplied rate. Without
    /// rate-limit headers 429s are the routine signal, so the cut is gentle.
    #[serde(default = "default_decrease")]
    pub decrease_factor: f64,
    /// The same when the provider sends `x-ratelimit-remaining-*` headers: a 429 then means
    /// the early warning came too late, so the cut is deeper.
    #[serde(default = "default_informed_decrease")]
    pub informed_decrease_factor: f64,
    /// On an early warning from headers (budget nearly spent), the same fraction.
    #[serde(default = "default_early_decrease")]
    pub early_decrease_factor: f64,
    /// Growth just under the ceiling, as a fraction of the ceiling per second.
    #[serde(default = "default_probe_growth")]
    pub probe_growth: f64,
    /// Window over which the supplied rate is measured, in milliseconds.
    #[serde(default = "default_window_ms")]
    pub window_ms: u64,
    /// Longest `Retry-After` honoured, in milliseconds.
    #[serde(default = "default_max_pause_ms")]
    pub max_pause_ms: u64,
    /// The provider's request limit for the whole consumer group, requests/s: each instance
    /// caps its request rate at this times its share of the LLM step's partitions. Unset
    /// means no group cap.
    #[serde(default)]
    pub group_rps: Option<f64>,
    /// The provider's token limit for the whole consumer group, tokens/min: each instance
    /// caps its token rate at this times its share of the LLM step's partitions, and paces
    /// tokens from the start (as with `initial_tpm`). Unset means no group cap.
    #[serde(default)]
    pub group_tpm: Option<f64>,
}

impl LimiterConfig {
    /// The measurement window, kept within 50 ms..=60 s.
    pub(super) fn window(&self) -> Duration {
        Duration::from_millis(self.window_ms.clamp(50, 60_000))
    }

    /// Whether a group limit (`group_rps` or `group_tpm`) is set.
    pub fn has_group_limit(&self) -> bool {
        self.group_rps.is_some() || self.group_tpm.is_some()
    }

    /// Checks the keys that have no safe reading when wrong; the error names the key.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        for (key, value) in [("group_rps", self.group_rps), ("group_tpm", self.group_tpm)] {
            if value.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                return Err((key, "must be a positive number".into()));
            }
        }
        Ok(())
    }
}

impl Default for LimiterConfig {
    fn default() -> Self {
        Self {
            initial_rps: default_initial_rps(),
            min_rps: default_min_rps(),
            max_rps: default_max_rps(),
            initial_tpm: None,
            min_tpm: default_min_tpm(),
            max_concurrency: None,
            concurrency: ConcurrencyConfig::default(),
            weights: default_weights(),
            decrease_factor: default_decrease(),
            informed_decrease_factor: default_informed_decrease(),
            early_decrease_factor: default_early_decrease(),
            probe_growth: default_probe_growth(),
            window_ms: default_window_ms(),
            max_pause_ms: default_max_pause_ms(),
            group_rps: None,
            group_tpm: None,
        }
    }
}
