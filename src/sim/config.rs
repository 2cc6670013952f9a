//! Configuration of the simulated provider: served models, keys, limits, latency and fault
//! injection.
//!
//! Every field can be changed while the simulator runs (`PUT /admin/config`,
//! [`SimHandle::set_config`](super::SimHandle::set_config)); a change takes effect for the
//! next request.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Upper bound on `hang_ms` and latency parameters (one hour), so a typo cannot park a
/// request for days.
const MAX_DELAY_MS: u64 = 3_600_000;

/// Complete configuration of the simulated provider.
///
/// Loaded from TOML (`sluice sim-provider --config FILE`) or JSON (`PUT /admin/config`).
/// Unknown keys are rejected; every field has a default, so an empty document is a valid
/// configuration: any model, any API key, no limits, no latency, no faults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimConfig {
    /// Models this provider serves. Requests for any other model are answered 404
    /// `model_not_found`. `None` accepts every model name.
    pub models: Option<Vec<String>>,

    /// Accepted API keys (sent as `Authorization: Bearer <key>`). Empty accepts every
    /// request, with or without a key (like vLLM, llama.cpp or Ollama).
    pub api_keys: Vec<String>,

    /// Seed of the random generator used for latency sampling (the only randomness).
    pub seed: u64,

    /// Whether the limits below apply to each model separately (`per_model`) or to all
    /// requests together (`global`).
    pub limit_scope: LimitScope,

    /// Requests per second, refilled continuously into a bucket of `burst` requests.
    /// `None` disables the per-second limit.
    pub rps: Option<f64>,

    /// Size of the per-second bucket: how many requests may arrive at once. Defaults to one
    /// second's worth of `rps` (at least 1).
    pub burst: Option<u32>,

    /// Requests per minute (a bucket of `rpm` requests refilled at `rpm / 60` per second).
    /// `None` disables the per-minute limit.
    pub rpm: Option<u32>,

    /// Tokens per minute (a bucket of `tpm` tokens refilled at `tpm / 60` per second). A
    /// request costs its prompt tokens plus `max_tokens` when given, else its completion
    /// tokens. `None` disables the token limit.
    pub tpm: Option<u64>,

    /// Send the OpenAI rate-limit headers (`x-ratelimit-*` on every chat completion response,
    /// `Retry-After` and `retry-after-ms` on 429s). `false` behaves like vLLM, llama.cpp or
    /// Ollama: a bare 429 status and body.
    pub rate_limit_headers: bool,

    /// Time the model "thinks" before answering (also before injected 5xx answers).
    pub latency: Latency,

    /// Queueing mode, like a self-hosted server (llama.cpp, vLLM, Ollama) with this many
    /// slots: each admitted request holds a slot while it is held (`hang_*`) and for its
    /// latency; requests beyond the slots wait for one in arrival order, so the latency a
    /// client sees grows with the queue. Such servers queue instead of answering 429 (set
    /// no `rps`/`rpm`/`tpm` to simulate one). Per model unless `limit_scope` is `global`.
    /// `None` serves every request at once.
    pub slots: Option<u32>,

    /// Per-model overrides of latency and limits, keyed by model name. Only used for limits
    /// when `limit_scope` is `per_model`.
    pub model_overrides: BTreeMap<String, ModelOverrides>,

    /// Fraction (0..=1) of requests answered with a 500, 502 or 503 server error.
    pub error_rate: f64,

    /// Answer every request with this HTTP status (400..=599) and an OpenAI-style error body,
    /// until cleared. Simulates an outage (503), a revoked key (401), and so on.
    pub status_override: Option<u16>,

    /// Periodic rate-limit storms: answer everything 429 for `duration_s` at the start of
    /// every `every_s` seconds, counted from when this setting was applied.
    pub burst_429: Option<Burst429>,

    /// Fraction (0..=1) of requests held for `hang_ms` before being processed.
    pub hang_rate: f64,

    /// How long a hung request is held, in milliseconds. `0` holds it until the client gives
    /// up (or the simulator shuts down).
    pub hang_ms: u64,

    /// Fraction (0..=1) of requests answered 200 with a body that is not a valid chat
    /// completion (invalid JSON, or JSON without `choices`).
    pub malformed_rate: f64,

    /// Fraction (0..=1) of requests whose 200 answer is cut: its headers and the start of
    /// its body are sent, then the connection is dropped mid-body.
    pub reset_rate: f64,

    /// Fraction (0..=1) of user contents rejected with 400 `content_policy_violation`. The
    /// choice hashes the user content, so the same content is always rejected or never.
    pub content_policy_rate: f64,

    /// Any request whose user content contains this text is rejected with 400
    /// `content_policy_violation`.
    pub content_policy_marker: Option<String>,

    /// Fraction (0..=1) of micro-batch requests whose answer cannot be split (an item
    /// dropped, an item given twice, text that is not JSON, or JSON cut short). The choice
    /// hashes the request, so the same batch always gets the same answer.
    pub batch_malformed_rate: f64,

    /// Fraction (0..=1) of well-formed micro-batch answers that list their items in
    /// another order than asked (as models do): each still under its own id.
    pub batch_reorder_rate: f64,

    /// Prompts longer than this many tokens are rejected with 400 `context_length_exceeded`.
    pub context_length: Option<u32>,

    /// How many distinct system prompts are remembered for `cached_tokens` (oldest forgotten
    /// first).
    pub prompt_cache_entries: usize,

    /// The header the API key comes in, as it is (Azure OpenAI's `api-key`), instead of
    /// `Authorization: Bearer <key>`.
    pub api_key_header: Option<String>,

    /// Headers every request must carry with these values (e.g. `OpenAI-Organization`);
    /// others are answered 401.
    pub required_headers: BTreeMap<String, String>,

    /// Query parameters every request must carry with these values (e.g. Azure's
    /// `api-version`); others are answered 404 `Resource not found`, as Azure does.
    pub required_query: BTreeMap<String, String>,

    /// Milliseconds of latency per completion token, on top of `latency` (a server
    /// generating at a steady rate: long answers take longer).
    pub ms_per_output_token: f64,

    /// Any request whose user content contains this text is answered with a refusal
    /// (`content: null`, `message.refusal`), billed like an answer.
    pub refusal_marker: Option<String>,

    /// Answers carry no `usage` (as some proxies and servers send them).
    pub omit_usage: bool,

    /// Answers start with a `<think>…</think>` block (as DeepSeek-R1 on Ollama, or Groq's
    /// raw reasoning format); its tokens count as completion tokens.
    pub think_prefix: bool,

    /// The shape of the `context_length` error: OpenAI's, vLLM's or llama.cpp's.
    pub context_error_style: ContextErrorStyle,
}

/// Which server's context-length error the simulator imitates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContextErrorStyle {
    /// `{"error":{"code":"context_length_exceeded",…}}`.
    #[default]
    Openai,
    /// A flat `{"object":"error","message":"This model's maximum context length is …",
    /// "type":"BadRequestError","code":400}`.
    Vllm,
    /// `{"error":{"code":400,"type":"exceed_context_size_error",…}}`.
    LlamaCpp,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            models: None,
            api_keys: Vec::new(),
            seed: 0x5eed,
            limit_scope: LimitScope::PerModel,
            rps: None,
            burst: None,
            rpm: None,
            tpm: None,
            rate_limit_headers: true,
            latency: Latency::default(),
            slots: None,
            model_overrides: BTreeMap::new(),
            error_rate: 0.0,
            status_override: None,
            burst_429: None,
            hang_rate: 0.0,
            hang_ms: 0,
            malformed_rate: 0.0,
            reset_rate: 0.0,
            content_policy_rate: 0.0,
            content_policy_marker: None,
            batch_malformed_rate: 0.0,
            batch_reorder_rate: 0.0,
            context_length: None,
            prompt_cache_entries: 10_000,
            api_key_header: None,
            required_headers: BTreeMap::new(),
            required_query: BTreeMap::new(),
            ms_per_output_token: 0.0,
            refusal_marker: None,
            omit_usage: false,
            think_prefix: false,
            context_error_style: ContextErrorStyle::default(),
        }
    }
}

/// Whether rate limits are kept per model or shared by all models.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitScope {
    /// One set of buckets per model name.
    #[default]
    PerModel,
    /// One set of buckets for every request.
    Global,
}

/// Per-model settings that override the top-level ones for that model.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelOverrides {
    /// Latency distribution of this model.
    pub latency: Option<Latency>,
    /// Requests per second of this model (see [`SimConfig::rps`]).
    pub rps: Option<f64>,
    /// Burst of this model (see [`SimConfig::burst`]).
    pub burst: Option<u32>,
    /// Requests per minute of this model (see [`SimConfig::rpm`]).
    pub rpm: Option<u32>,
    /// Tokens per minute of this model (see [`SimConfig::tpm`]).
    pub tpm: Option<u64>,
    /// Answer every request for this model with this status (an outage of
    /// one model; see [`SimConfig::status_override`]).
    pub status_override: Option<u16>,
    /// Refuse requests that set `max_tokens` (400 `unsupported_parameter`), as OpenAI's
    /// reasoning models do; they take `max_completion_tokens`.
    pub reject_max_tokens: bool,
    /// A reasoning model: requests that set `temperature` are refused (400
    /// `unsupported_value`, as o-series and gpt-5 models do), and each answer first spends
    /// this many hidden reasoning tokens of the completion cap (reported in
    /// `completion_tokens_details.reasoning_tokens`); a cap they exhaust leaves an empty
    /// answer with `finish_reason = length`.
    pub reasoning_tokens: Option<u64>,
}

/// A latency distribution, written with a `kind` tag, e.g.
/// `latency = { kind = "lognormal", median_ms = 300, p99_ms = 2000 }`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Latency {
    /// Always the same delay.
    Fixed {
        /// Delay in milliseconds.
        ms: u64,
    },
    /// A delay drawn uniformly from `[min_ms, max_ms]`.
    Uniform {
        /// Smallest delay in milliseconds.
        min_ms: u64,
        /// Largest delay in milliseconds.
        max_ms: u64,
    },
    /// A log-normal delay with the given median and 99th percentile (capped at ten times
    /// the 99th percentile).
    Lognormal {
        /// Median delay in milliseconds.
        median_ms: u64,
        /// 99th-percentile delay in milliseconds (at least the median).
        p99_ms: u64,
    },
}

impl Default for Latency {
    fn default() -> Self {
        Latency::Fixed { ms: 0 }
    }
}

/// Periodic 429 storm (see [`SimConfig::burst_429`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Burst429 {
    /// Period of the storm, in seconds.
    pub every_s: f64,
    /// Length of the storm within each period, in seconds.
    pub duration_s: f64,
}

/// The limits that apply to one model after overrides are resolved.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct EffectiveLimits {
    pub rps: Option<f64>,
    pub burst: Option<u32>,
    pub rpm: Option<u32>,
    pub tpm: Option<u64>,
}

impl EffectiveLimits {
    /// Bucket size of the per-second limit.
    pub(crate) fn burst_size(&self) -> Option<f64> {
        let rps = self.rps?;
        Some(match self.burst {
            Some(b) => f64::from(b.max(1)),
            None => rps.ceil().max(1.0),
        })
    }
}

impl SimConfig {
    /// Reads a TOML configuration file; errors name the offending key path.
    pub fn from_toml_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Invalid(format!("cannot read {}: {e}", path.display())))?;
        Self::from_toml_str(&text).map_err(|ConfigError::Invalid(e)| {
            ConfigError::Invalid(format!("{}: {e}", path.display()))
        })
    }

    /// Parses a TOML configuration and validates it.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let de =
            toml::Deserializer::parse(text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let config: SimConfig = serde_path_to_error::deserialize(de)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// Parses a JSON configuration and validates it.
    pub fn from_json_value(value: serde_json::Value) -> Result<Self, ConfigError> {
        let config: SimConfig = serde_path_to_error::deserialize(value)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// Returns a copy of this configuration with the top-level fields present in `patch`
    /// replaced (`null` clears an optional field); other fields keep their value.
    pub fn merged_with(&self, patch: serde_json::Value) -> Result<Self, ConfigError> {
        let serde_json::Value::Object(patch) = patch else {
            return Err(ConfigError::Invalid(
                "the configuration must be a JSON object".to_owned(),
            ));
        };
        let mut current = match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => return Err(ConfigError::Invalid("cannot serialize config".to_owned())),
        };
        for (key, value) in patch {
            current.insert(key, value);
        }
        Self::from_json_value(serde_json::Value::Object(current))
    }

    /// Checks ranges that serde cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fraction = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(ConfigError::Invalid(format!(
                    "{name}: must be between 0 and 1, got {v}"
                )))
            }
        };
        fraction("error_rate", self.error_rate)?;
        fraction("hang_rate", self.hang_rate)?;
        fraction("malformed_rate", self.malformed_rate)?;
        fraction("reset_rate", self.reset_rate)?;
        fraction("content_policy_rate", self.content_policy_rate)?;
        fraction("batch_malformed_rate", self.batch_malformed_rate)?;
        fraction("batch_reorder_rate", self.batch_reorder_rate)?;
        if self.hang_ms > MAX_DELAY_MS {
            return Err(ConfigError::Invalid(format!(
                "hang_ms: at most {MAX_DELAY_MS}"
            )));
        }
        if let Some(status) = self.status_override {
            if !(400..=599).contains(&status) {
                return Err(ConfigError::Invalid(format!(
                    "status_override: must be an error status (400..=599), got {status}"
                )));
            }
        }
        if let Some(b) = self.burst_429 {
            let ok = b.every_s.is_finite()
                && b.every_s > 0.0
                && b.duration_s.is_finite()
                && b.duration_s >= 0.0
                && b.duration_s <= b.every_s;
            if !ok {
                return Err(ConfigError::Invalid(
                    "burst_429: need every_s > 0 and 0 <= duration_s <= every_s".to_owned(),
                ));
            }
        }
        if self.slots == Some(0) {
            return Err(ConfigError::Invalid("slots: must be at least 1".to_owned()));
        }
        if !(0.0..=1_000.0).contains(&self.ms_per_output_token) {
            return Err(ConfigError::Invalid(format!(
                "ms_per_output_token: must be between 0 and 1000, got {}",
                self.ms_per_output_token
            )));
        }
        if self.prompt_cache_entries == 0 {
            return Err(ConfigError::Invalid(
                "prompt_cache_entries: must be at least 1".to_owned(),
            ));
        }
        validate_limits("", self.rps, self.burst, self.rpm, self.tpm)?;
        self.latency.validate("latency")?;
        for (model, o) in &self.model_overrides {
            validate_limits(
                &format!("model_overrides.{model}."),
                o.rps,
                o.burst,
                o.rpm,
                o.tpm,
            )?;
            if let Some(latency) = &o.latency {
                latency.validate(&format!("model_overrides.{model}.latency"))?;
            }
        }
        Ok(())
    }

    /// Limits that apply to `model` (the top-level ones under `global` scope).
    pub(crate) fn limits_for(&self, model: &str) -> EffectiveLimits {
        let top = EffectiveLimits {
            rps: self.rps,
            burst: self.burst,
            rpm: self.rpm,
            tpm: self.tpm,
        };
        if self.limit_scope == LimitScope::Global {
            return top;
        }
        match self.model_overrides.get(model) {
            None => top,
            Some(o) => EffectiveLimits {
                rps: o.rps.or(top.rps),
                burst: o.burst.or(top.burst),
                rpm: o.rpm.or(top.rpm),
                tpm: o.tpm.or(top.tpm),
            },
        }
    }

    /// Latency distribution of `model`.
    pub(crate) fn latency_for(&self, model: &str) -> Latency {
        self.model_overrides
            .get(model)
            .and_then(|o| o.latency)
            .unwrap_or(self.latency)
    }
}

fn validate_limits(
    prefix: &str,
    rps: Option<f64>,
    burst: Option<u32>,
    rpm: Option<u32>,
    tpm: Option<u64>,
) -> Result<(), ConfigError> {
    if let Some(rps) = rps {
        if !(rps.is_finite() && rps > 0.0) {
            return Err(ConfigError::Invalid(format!(
                "{prefix}rps: must be a positive number, got {rps}"
            )));
        }
    }
    if burst == Some(0) {
        return Err(ConfigError::Invalid(format!(
            "{prefix}burst: must be at least 1"
        )));
    }
    if rpm == Some(0) {
        return Err(ConfigError::Invalid(format!(
            "{prefix}rpm: must be at least 1"
        )));
    }
    if tpm == Some(0) {
        return Err(ConfigError::Invalid(format!(
            "{prefix}tpm: must be at least 1"
        )));
    }
    Ok(())
}

impl Latency {
    fn validate(&self, path: &str) -> Result<(), ConfigError> {
        let bad = |msg: &str| Err(ConfigError::Invalid(format!("{path}: {msg}")));
        match *self {
            Latency::Fixed { ms } if ms > MAX_DELAY_MS => bad("ms too large"),
            Latency::Uniform { min_ms, max_ms } if min_ms > max_ms => bad("min_ms > max_ms"),
            Latency::Uniform { max_ms, .. } if max_ms > MAX_DELAY_MS => bad("max_ms too large"),
            Latency::Lognormal { median_ms, p99_ms } if median_ms == 0 || p99_ms < median_ms => {
                bad("need 0 < median_ms <= p99_ms")
            }
            Latency::Lognormal { p99_ms, .. } if p99_ms > MAX_DELAY_MS => bad("p99_ms too large"),
            _ => Ok(()),
        }
    }
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A field is missing, unknown, of the wrong type or out of range.
    #[error("invalid simulator config: {0}")]
    Invalid(String),
}
