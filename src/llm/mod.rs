//! The LLM provider client and its middleware.
//!
//! Each model gets a stack of small layers, each testable alone:
//!
//! ```text
//! call ─► breaker check ─► limiter (AIMD, concurrency, priority queue) ─► breaker permit
//!          ▲                                                    │
//!          └──────────── retry (backoff, bounded) ◄── timeout ◄─ HTTP (ChatTransport)
//! ```
//!
//! Every attempt goes through the limiter (a retry is a new request to the provider) and the
//! breaker; an open breaker fails the call at once with [`ErrorClass::CircuitOpen`] so the
//! caller can route to a fallback model or hold intake. Retries inside a call are bounded by
//! [`RetryPolicy`]; a transient failure that outlasts them is returned with its class, and the
//! caller re-publishes the task with `attemptNumber + 1` or dead-letters it as `exhausted`.

pub mod breaker;
pub mod concurrency;
pub mod config;
pub mod error;
pub mod limiter;
pub mod metrics;
pub mod priority;
pub mod ratelimit;
pub mod retry;
pub mod secret;
pub mod transport;
pub mod wire;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

pub use breaker::{BreakerConfig, BreakerState, CircuitBreaker};
pub use concurrency::ConcurrencyConfig;
pub use config::{LlmConfig, MaxTokensField, ModelConfig, ProviderConfig};
pub use error::{ErrorClass, LlmError, PermanentKind};
pub use limiter::{AimdLimiter, LimiterConfig, Outcome, Permit};
pub use metrics::LlmMetrics;
pub use priority::Priority;
pub use ratelimit::RateLimitInfo;
pub use retry::{RetryDecision, RetryPolicy};
pub use secret::Secret;
pub use transport::{ChatTransport, HttpProvider};
pub use wire::{ChatRequest, ChatResponse, Message, ResponseFormat, Role, Usage};

/// One routable model: its transport and its own limiter and breaker.
#[derive(Clone)]
pub struct ModelEndpoint {
    /// Configured name (metric label, result `model`).
    pub name: String,
    /// Model id sent upstream.
    pub upstream_model: String,
    /// Whether the token cap goes in `max_completion_tokens`.
    pub max_completion_tokens: bool,
    /// Whether sampling parameters (`temperature`) are sent.
    pub send_sampling: bool,
    /// Completion tokens added to each call's cap for hidden reasoning.
    pub reasoning_tokens: u32,
    /// The most completion tokens one answer may have.
    pub max_output_tokens: u32,
    /// Timeout of one attempt.
    pub timeout: Duration,
    /// Time the model takes per completion token (a batch's timeout grows
    /// by it for each completion token its items are expected to produce).
    pub per_output_token: Duration,
    /// The provider hop.
    pub transport: Arc<dyn ChatTransport>,
    /// Adaptive rate limiter of this (provider, model).
    pub limiter: AimdLimiter,
    /// Circuit breaker of this (provider, model).
    pub breaker: CircuitBreaker,
}

impl std::fmt::Debug for ModelEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelEndpoint")
            .field("name", &self.name)
            .field("upstream_model", &self.upstream_model)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ModelEndpoint {
    /// An endpoint configured by `config`, talking through `transport`.
    pub fn new(config: &ModelConfig, transport: Arc<dyn ChatTransport>) -> Self {
        Self {
            name: config.name.clone(),
            upstream_model: config.upstream().to_string(),
            max_completion_tokens: config.max_tokens_field == MaxTokensField::MaxCompletionTokens,
            send_sampling: config.sends_sampling(),
            reasoning_tokens: config.reasoning_budget(),
            max_output_tokens: config.max_output_tokens,
            timeout: config.timeout(),
            per_output_token: Duration::from_millis(config.ms_per_output_token.into()),
            transport,
            limiter: AimdLimiter::new(config.limiter.clone()),
            breaker: CircuitBreaker::new(config.breaker),
        }
    }
}

/// A successful call.
#[derive(Debug, Clone, PartialEq)]
pub struct CallOutcome {
    /// The provider's answer.
    pub response: ChatResponse,
    /// Attempts made, this one included.
    pub attempts: u32,
    /// Time from the call to the answer, waits and retries included.
    pub latency: Duration,
}

/// A failed call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{error} after {attempts} attempt(s)")]
pub struct CallFailure {
    /// The last error.
    pub error: LlmError,
    /// Attempts made (0 when refused before any).
    pub attempts: u32,
}

impl CallFailure {
    /// What the caller should do.
    pub fn class(&self) -> ErrorClass {
        self.error.class()
    }
}

/// The composed client over all configured models.
#[derive(Debug, Clone)]
pub struct LlmClient {
    /// Each model's endpoint, with its metric series resolved once.
    endpoints: Arc<HashMap<String, (ModelEndpoint, metrics::ModelMetrics)>>,
    retry: RetryPolicy,
    metrics: LlmMetrics,
}

impl LlmClient {
    /// A client over explicit endpoints.
    pub fn new(endpoints: Vec<ModelEndpoint>, retry: RetryPolicy, metrics: LlmMetrics) -> Self {
        let endpoints = endpoints
            .into_iter()
            .map(|e| {
                let mm = metrics.for_model(&e.name);
                (e.name.clone(), (e, mm))
            })
            .collect();
        Self {
            endpoints: Arc::new(endpoints),
            retry,
            metrics,
        }
    }

    /// Builds HTTP providers and model endpoints from config, registering metrics into
    /// `registry`.
    pub fn from_config(
        config: &LlmConfig,
        registry: &prometheus::Registry,
    ) -> Result<Self, LlmError> {
        let mut providers: HashMap<&str, Arc<dyn ChatTransport>> = HashMap::new();
        for p in &config.providers {
            let transport: Arc<dyn ChatTransport> = Arc::new(HttpProvider::new(p)?);
            if providers.insert(p.name.as_str(), transport).is_some() {
                return Err(LlmError::Config(format!(
                    "provider {} defined twice",
                    p.name
                )));
            }
        }
        let mut endpoints = Vec::with_capacity(config.models.len());
        for m in &config.models {
            let transport = providers.get(m.provider.as_str()).ok_or_else(|| {
                LlmError::Config(format!(
                    "model {} refers to unknown provider {}",
                    m.name, m.provider
                ))
            })?;
            endpoints.push(ModelEndpoint::new(m, transport.clone()));
        }
        let metrics = LlmMetrics::register(registry)
            .map_err(|e| LlmError::Config(format!("metrics registration: {e}")))?;
        Ok(Self::new(endpoints, config.retry, metrics))
    }

    /// Configured model names.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.endpoints.keys().map(String::as_str)
    }

    /// The endpoint of a model.
    pub fn endpoint(&self, model: &str) -> Option<&ModelEndpoint> {
        self.endpoints.get(model).map(|(e, _)| e)
    }

    /// Whether any model has a group limit (`group_rps`, `group_tpm`) to share.
    pub fn has_group_limits(&self) -> bool {
        self.endpoints
            .values()
            .any(|(e, _)| e.limiter.has_group_limit())
    }

    /// Sets this instance's share of every model's group limits (see
    /// [`AimdLimiter::set_group_share`]) and publishes it; models without one are left alone.
    pub fn set_group_share(&self, share: f64) {
        for (ep, mm) in self.endpoints.values() {
            if ep.limiter.has_group_limit() {
                ep.limiter.set_group_share(share);
                mm.publish_group_share(ep.limiter.group_share());
                mm.publish_state(&ep.limiter, ep.breaker.state());
            }
        }
    }

    /// Whether the model's breaker refuses calls right now (route to a fallback).
    pub fn is_open(&self, model: &str) -> bool {
        self.endpoints
            .get(model)
            .is_some_and(|(e, _)| e.breaker.is_open())
    }

    /// Calls `model` with `request` (its `model` field is replaced by the upstream id),
    /// waiting in the limiter at `priority`, retrying transient failures within the budget.
    pub async fn call(
        &self,
        model: &str,
        request: ChatRequest,
        priority: Priority,
    ) -> Result<CallOutcome, CallFailure> {
        self.call_expecting(model, request, priority, 0).await
    }

    /// As [`LlmClient::call`], for an answer expected to run to
    /// `expected_output` completion tokens (a micro-batch's): each attempt
    /// may take the model's timeout plus the time the model takes to write
    /// them.
    pub async fn call_expecting(
        &self,
        model: &str,
        mut request: ChatRequest,
        priority: Priority,
        expected_output: u32,
    ) -> Result<CallOutcome, CallFailure> {
        let Some((ep, mm)) = self.endpoints.get(model) else {
            return Err(CallFailure {
                error: LlmError::Config(format!("unknown model {model}")),
                attempts: 0,
            });
        };
        request.model = ep.upstream_model.clone();
        if !ep.send_sampling {
            request.temperature = None;
        }
        if ep.reasoning_tokens > 0 {
            for cap in [&mut request.max_tokens, &mut request.max_completion_tokens]
                .into_iter()
                .flatten()
            {
                *cap = cap.saturating_add(ep.reasoning_tokens);
            }
        }
        if ep.max_completion_tokens {
            request.max_completion_tokens =
                request.max_tokens.take().or(request.max_completion_tokens);
        }
        let est_tokens = request.estimated_tokens();
        let timeout = ep.timeout + ep.per_output_token * expected_output;
        let started = Instant::now();
        let mut attempts = 0u32;
        let mut slept = Duration::ZERO;
        loop {
            let result = self
                .attempt(ep, mm, &request, (priority, est_tokens), timeout)
                .await;
            mm.publish_state(&ep.limiter, ep.breaker.state());
            let error = match result {
                Attempt::Answered(response) => {
                    return Ok(CallOutcome {
                        response,
                        attempts: attempts + 1,
                        latency: started.elapsed(),
                    })
                }
                Attempt::Refused(error) => return Err(CallFailure { error, attempts }),
                Attempt::Failed(error) => error,
            };
            attempts += 1;
            match self.retry.decide(attempts, &error) {
                RetryDecision::RetryAfter(delay)
                    if slept + delay <= self.retry.max_total_delay() =>
                {
                    self.metrics.observe_retry(&ep.name);
                    tokio::time::sleep(delay).await;
                    slept += delay;
                }
                _ => return Err(CallFailure { error, attempts }),
            }
        }
    }

    async fn attempt(
        &self,
        ep: &ModelEndpoint,
        mm: &metrics::ModelMetrics,
        request: &ChatRequest,
        (priority, est_tokens): (Priority, u32),
        timeout: Duration,
    ) -> Attempt {
        let refused = || {
            self.metrics.observe_refused(&ep.name, "circuit_open");
            Attempt::Refused(LlmError::CircuitOpen(ep.name.clone()))
        };
        // Fail fast without queueing while open.
        if ep.breaker.is_open() {
            return refused();
        }
        let permit = ep.limiter.acquire(priority, est_tokens).await;
        mm.observe_admission(priority);
        let Ok(probe) = ep.breaker.try_acquire() else {
            drop(permit);
            return refused();
        };
        let sent = Instant::now();
        let result = match tokio::time::timeout(timeout, ep.transport.send(request)).await {
            Ok(Err(LlmError::Timeout(_))) | Err(_) => Err(LlmError::Timeout(timeout)),
            Ok(r) => r,
        };
        let seconds = sent.elapsed().as_secs_f64();
        match result {
            Ok(mut response) => {
                response.estimate_missing_usage(request);
                let tokens = u32::try_from(response.usage.total()).unwrap_or(u32::MAX);
                permit.record(Outcome::Success {
                    rate_limit: response.rate_limit,
                    tokens_used: tokens,
                    output_tokens: u32::try_from(response.usage.completion_tokens)
                        .unwrap_or(u32::MAX),
                });
                probe.success();
                mm.observe_ok(seconds);
                Attempt::Answered(response)
            }
            Err(error) => {
                let class = error.class();
                let rate_limit = error.rate_limit().copied().unwrap_or_default();
                match class {
                    ErrorClass::RateLimited { retry_after } => {
                        permit.record(Outcome::RateLimited {
                            retry_after,
                            rate_limit,
                        })
                    }
                    // A rejected request still went through the provider's rate limiter.
                    ErrorClass::Permanent(_) => permit.record(Outcome::Success {
                        rate_limit,
                        tokens_used: 0,
                        output_tokens: 0,
                    }),
                    // No answer in time: the provider may be queueing.
                    _ if matches!(error, LlmError::Timeout(_)) => permit.record(Outcome::TimedOut),
                    _ => permit.record(Outcome::Failure),
                }
                probe.record(Some(&class));
                self.metrics.observe_call(&ep.name, error.code(), seconds);
                Attempt::Failed(error)
            }
        }
    }
}

enum Attempt {
    Answered(ChatResponse),
    /// Refused before reaching the provider (no attempt counted).
    Refused(LlmError),
    Failed(LlmError),
}

#[cfg(test)]
mod tests;
