//! Configuration of providers and models (the `[[llm.providers]]` / `[[llm.models]]` tables).
//! Each field's doc comment is user documentation.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::breaker::BreakerConfig;
use super::error::LlmError;
use super::limiter::LimiterConfig;
use super::retry::RetryPolicy;
use super::secret::Secret;
use crate::error::ConfigError;

fn default_connect_timeout_ms() -> u64 {
    5_000
}

fn default_max_idle() -> usize {
    64
}

/// One OpenAI-compatible endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// Name referred to by models; appears in logs.
    pub name: String,
    /// Base URL, with or without the trailing `/v1` (e.g. `https://api.openai.com/v1`,
    /// `http://127.0.0.1:8000`); a URL ending in `/chat/completions` is used as it is (e.g.
    /// an Azure OpenAI deployment's).
    pub base_url: String,
    /// The header the API key is sent in, as it is (e.g. Azure's `api-key`); default
    /// `Authorization: Bearer <key>`.
    #[serde(default)]
    pub api_key_header: Option<String>,
    /// Extra headers sent with every request (e.g. `OpenAI-Organization`, `OpenAI-Project`).
    #[serde(default)]
    pub headers: sluice_topology::redact::Properties,
    /// Query parameters added to the URL (e.g. Azure's `api-version`).
    #[serde(default)]
    pub query: sluice_topology::redact::Properties,
    /// HTTP proxy the requests go through (`http://host:port`, optionally with
    /// `user:password@`), tunnelled with `CONNECT`. Unset: the `HTTPS_PROXY` / `HTTP_PROXY` /
    /// `ALL_PROXY` environment variables (and `NO_PROXY`) decide, as curl does. `"none"`:
    /// never a proxy.
    #[serde(default)]
    pub proxy: Option<sluice_topology::redact::SecretUrl>,
    /// Environment variable holding the API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// File holding the API key (e.g. a mounted Kubernetes Secret); surrounding whitespace is
    /// ignored. Takes precedence over `api_key_env`.
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// TCP/TLS connect timeout in milliseconds.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Idle keep-alive connections kept per host.
    #[serde(default = "default_max_idle")]
    pub max_idle_connections: usize,
    /// Speak HTTP/2 to the provider: calls share connections, each carrying up to
    /// `http2_max_streams` calls at once (another is opened when all are full), instead of
    /// a connection per call in flight (about 21 KiB each). `https://`: negotiated with
    /// ALPN, which the server must accept (hosted APIs do); `http://`: HTTP/2 without TLS
    /// (prior knowledge), which the server must speak (vLLM, llama.cpp and Ollama do not).
    #[serde(default)]
    pub http2: bool,
    /// Calls in flight on one HTTP/2 connection: at most the server's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` (commonly 100–256); calls beyond it would wait
    /// inside the connection instead of going out on another. 1 to 100,000.
    #[serde(default = "default_http2_max_streams")]
    pub http2_max_streams: usize,
}

fn default_http2_max_streams() -> usize {
    100
}

/// The most calls one HTTP/2 connection may be given.
pub const MAX_HTTP2_STREAMS: usize = 100_000;

impl ProviderConfig {
    /// A provider without an API key (vLLM, llama.cpp, Ollama, the simulator).
    pub fn new(name: impl Into<String>, base_url: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            base_url: base_url.into(),
            api_key_header: None,
            headers: Default::default(),
            query: Default::default(),
            proxy: None,
            api_key_env: None,
            api_key_file: None,
            connect_timeout_ms: default_connect_timeout_ms(),
            max_idle_connections: default_max_idle(),
            http2: false,
            http2_max_streams: default_http2_max_streams(),
        }
    }

    /// Reads the API key from the file or env var; `None` when neither is configured.
    /// Errors name the variable or path, never the value.
    pub fn resolve_api_key(&self) -> Result<Option<Secret>, LlmError> {
        if let Some(path) = &self.api_key_file {
            let raw = std::fs::read_to_string(path).map_err(|e| {
                LlmError::Config(format!(
                    "provider {}: cannot read api_key_file {}: {}",
                    self.name,
                    path.display(),
                    e.kind()
                ))
            })?;
            return non_empty(raw.trim(), &self.name, "api_key_file").map(Some);
        }
        if let Some(var) = &self.api_key_env {
            let raw = std::env::var(var).map_err(|_| {
                LlmError::Config(format!(
                    "provider {}: environment variable {var} is not set",
                    self.name
                ))
            })?;
            return non_empty(raw.trim(), &self.name, "api_key_env").map(Some);
        }
        Ok(None)
    }
}

fn non_empty(key: &str, provider: &str, source: &str) -> Result<Secret, LlmError> {
    if key.is_empty() {
        Err(LlmError::Config(format!(
            "provider {provider}: {source} is empty"
        )))
    } else {
        Ok(Secret::new(key))
    }
}

fn default_ms_per_output_token() -> u32 {
    20
}

fn default_timeout_ms() -> u64 {
    60_000
}

fn default_max_output_tokens() -> u32 {
    16_384
}

/// Reasoning tokens a `max_completion_tokens` model gets on top of each call's cap unless
/// configured otherwise.
pub const DEFAULT_REASONING_TOKENS: u32 = 4_096;

/// How a model takes its completion token cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaxTokensField {
    /// `max_tokens`.
    #[default]
    MaxTokens,
    /// `max_completion_tokens`.
    MaxCompletionTokens,
}

/// A model as Sluice routes to it: its provider, upstream id, timeout and traffic controls.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Name used in routing tiers, results and the `model` metric label.
    pub name: String,
    /// The [`ProviderConfig::name`] serving it.
    pub provider: String,
    /// Model id sent upstream; defaults to `name`.
    #[serde(default)]
    pub upstream_model: Option<String>,
    /// The request field of the completion token cap: `max_tokens`, or
    /// `max_completion_tokens` for models that reject `max_tokens` (OpenAI's reasoning
    /// models).
    #[serde(default)]
    pub max_tokens_field: MaxTokensField,
    /// Whether sampling parameters (`temperature`) are sent. Unset: yes for `max_tokens`
    /// models, no for `max_completion_tokens` ones (reasoning models reject them with a
    /// 400 every time).
    #[serde(default)]
    pub send_sampling: Option<bool>,
    /// Completion tokens added to every call's cap for the model's hidden reasoning. Unset:
    /// 0 for `max_tokens` models, [`DEFAULT_REASONING_TOKENS`] for `max_completion_tokens`
    /// ones (a task's cap alone, classify's 16 tokens, would be spent before any answer).
    #[serde(default)]
    pub reasoning_tokens: Option<u32>,
    /// The most completion tokens the model produces in one answer (OpenAI's chat models:
    /// 16,384): a micro-batch's summed caps stay within it.
    #[serde(default = "default_max_output_tokens")]
    pub max_output_tokens: u32,
    /// Per-call timeout in milliseconds (one attempt, not the retries).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// How long the model takes per completion token, ms (20: 50 tokens a
    /// second): a micro-batch's call gets this much more time per completion
    /// token its items are expected to produce, on top of `timeout_ms`.
    #[serde(default = "default_ms_per_output_token")]
    pub ms_per_output_token: u32,
    /// Adaptive rate limiter of this model.
    #[serde(default)]
    pub limiter: LimiterConfig,
    /// Circuit breaker of this model.
    #[serde(default)]
    pub breaker: BreakerConfig,
}

impl ModelConfig {
    /// A model with default timeout, limiter and breaker.
    pub fn new(name: impl Into<String>, provider: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            provider: provider.into(),
            upstream_model: None,
            max_tokens_field: MaxTokensField::default(),
            send_sampling: None,
            reasoning_tokens: None,
            max_output_tokens: default_max_output_tokens(),
            timeout_ms: default_timeout_ms(),
            ms_per_output_token: default_ms_per_output_token(),
            limiter: LimiterConfig::default(),
            breaker: BreakerConfig::default(),
        }
    }

    /// Whether the model is sent sampling parameters.
    pub fn sends_sampling(&self) -> bool {
        self.send_sampling
            .unwrap_or(self.max_tokens_field == MaxTokensField::MaxTokens)
    }

    /// Completion tokens added to each call's cap for reasoning.
    pub fn reasoning_budget(&self) -> u32 {
        self.reasoning_tokens
            .unwrap_or(match self.max_tokens_field {
                MaxTokensField::MaxTokens => 0,
                MaxTokensField::MaxCompletionTokens => DEFAULT_REASONING_TOKENS,
            })
    }

    /// The id sent upstream.
    pub fn upstream(&self) -> &str {
        self.upstream_model.as_deref().unwrap_or(&self.name)
    }

    /// The per-attempt timeout.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

/// The whole `[llm]` section.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmConfig {
    /// Provider endpoints.
    #[serde(default)]
    pub providers: Vec<ProviderConfig>,
    /// Models.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// In-operator retry budget for transient failures.
    #[serde(default)]
    pub retry: RetryPolicy,
}

impl LlmConfig {
    /// Checks of the section's own keys: at least one model, each on a
    /// configured provider with valid limiter settings; each provider's key
    /// found and its HTTP/2 stream limit in range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.models.is_empty() {
            return Err(ConfigError::new(
                "llm.models",
                "must define at least one model",
            ));
        }
        let providers: Vec<&str> = self.providers.iter().map(|p| p.name.as_str()).collect();
        for (i, m) in self.models.iter().enumerate() {
            if !providers.contains(&m.provider.as_str()) {
                return Err(ConfigError::new(
                    format!("llm.models[{i}].provider"),
                    format!("unknown provider {}", m.provider),
                ));
            }
            m.limiter.validate().map_err(|(key, message)| {
                ConfigError::new(format!("llm.models[{i}].limiter.{key}"), message)
            })?;
            m.limiter.concurrency.validate().map_err(|(key, message)| {
                ConfigError::new(
                    format!("llm.models[{i}].limiter.concurrency.{key}"),
                    message,
                )
            })?;
        }
        for (i, p) in self.providers.iter().enumerate() {
            p.resolve_api_key()
                .map_err(|e| ConfigError::new(format!("llm.providers[{i}]"), e.to_string()))?;
            if !(1..=MAX_HTTP2_STREAMS).contains(&p.http2_max_streams) {
                return Err(ConfigError::new(
                    format!("llm.providers[{i}].http2_max_streams"),
                    format!(
                        "must be 1 to {MAX_HTTP2_STREAMS}, got {}",
                        p.http2_max_streams
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_key_from_file_is_trimmed_and_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "sk-very-secret\n").unwrap();
        let mut cfg = ProviderConfig::new("openai", "https://api.openai.com/v1");
        cfg.api_key_file = Some(path);
        let key = cfg.resolve_api_key().unwrap().unwrap();
        assert_eq!(key.expose(), "sk-very-secret");
        assert_eq!(format!("{key:?} {key}"), "*** ***");
        let provider = super::super::transport::HttpProvider::new(&cfg).unwrap();
        assert!(!format!("{provider:?}").contains("very-secret"));
    }

    #[test]
    fn api_key_from_env_and_errors_name_the_source() {
        let mut cfg = ProviderConfig::new("groq", "https://api.groq.com/openai/v1");
        cfg.api_key_env = Some("SLUICE_TEST_SURELY_UNSET_KEY_VAR".into());
        let err = cfg.resolve_api_key().unwrap_err();
        assert!(err.to_string().contains("SLUICE_TEST_SURELY_UNSET_KEY_VAR"));
        cfg.api_key_env = Some("PATH".into());
        assert!(cfg.resolve_api_key().unwrap().is_some());
        cfg.api_key_env = None;
        assert!(cfg.resolve_api_key().unwrap().is_none());
    }

    #[test]
    fn model_config_rejects_unknown_keys_and_defaults() {
        let m: ModelConfig = toml::from_str("name = \"small\"\nprovider = \"sim\"").unwrap();
        assert_eq!(m.upstream(), "small");
        assert_eq!(m.timeout(), Duration::from_secs(60));
        let err = toml::from_str::<ModelConfig>("name = \"a\"\nprovider = \"b\"\ntimeout = 1");
        assert!(err.is_err());
    }
}
