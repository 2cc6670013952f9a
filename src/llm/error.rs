//! The provider call error [`LlmError`], its [`ErrorClass`] (what the caller should do) and
//! [`PermanentKind`], the classification of HTTP statuses and OpenAI error codes, and the
//! parsing of error bodies.

use std::time::Duration;

use super::ratelimit::RateLimitInfo;

/// Why a request that reached the provider cannot succeed as is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermanentKind {
    /// Malformed or unsupported request.
    BadRequest,
    /// Refused by the provider's content policy.
    ContentPolicy,
    /// Prompt exceeds the context window or the request size limit.
    TooLarge,
}

impl PermanentKind {
    /// A bounded label (`bad_request`, `content_policy`, `too_large`).
    pub fn as_str(self) -> &'static str {
        match self {
            PermanentKind::BadRequest => "bad_request",
            PermanentKind::ContentPolicy => "content_policy",
            PermanentKind::TooLarge => "too_large",
        }
    }
}

/// What the caller should do about an [`LlmError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retry with backoff (408/409/5xx, timeouts, connection errors).
    Transient,
    /// 429: retry after the hint; the limiter slows down.
    RateLimited {
        /// The provider's `Retry-After`, if any.
        retry_after: Option<Duration>,
    },
    /// Never retry; dead-letter under this category.
    Permanent(PermanentKind),
    /// 401/403/404-model: stop intake, report unhealthy, keep the messages.
    Config,
    /// 2xx with an unparsable body; retried like a transient error.
    Malformed,
    /// The model's circuit breaker is open: use the fallback model or hold intake.
    CircuitOpen,
}

impl ErrorClass {
    /// Whether an in-operator retry may help.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ErrorClass::Transient | ErrorClass::RateLimited { .. } | ErrorClass::Malformed
        )
    }

    /// Whether the circuit breaker counts this as a provider failure.
    pub fn counts_as_provider_failure(&self) -> bool {
        matches!(self, ErrorClass::Transient | ErrorClass::Malformed)
    }
}

/// A provider call failure.
///
/// `Display` never includes the provider's message body (which may quote input); it is kept
/// in [`LlmError::Status::message`] for the result's `errorMessage`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LlmError {
    /// The provider answered with a non-success status.
    #[error("provider answered HTTP {status} (code {code:?}, type {kind:?})")]
    Status {
        /// HTTP status.
        status: u16,
        /// OpenAI `error.code`.
        code: Option<String>,
        /// OpenAI `error.type`.
        kind: Option<String>,
        /// OpenAI `error.message`, truncated.
        message: String,
        /// Rate-limit headers of the response (boxed: keeps the error small).
        rate_limit: Box<RateLimitInfo>,
    },
    /// A 2xx whose only choice was withheld by the provider's content filter;
    /// the provider billed its usage all the same.
    #[error("answer withheld by the provider's content filter")]
    ContentFiltered(super::Usage),
    /// No answer within the model's timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// Could not connect.
    #[error("connection failed: {0}")]
    Connect(String),
    /// Other transport failure (reset, truncated body).
    #[error("transport error: {0}")]
    Transport(String),
    /// A 2xx whose body could not be understood.
    #[error("malformed response: {0}")]
    Malformed(String),
    /// The breaker of this model is open.
    #[error("circuit open for model {0}")]
    CircuitOpen(String),
    /// Local configuration problem (unknown model, unreadable API key file).
    #[error("configuration error: {0}")]
    Config(String),
}

/// Error codes that mean the content was refused (OpenAI's `invalid_prompt`: a prompt
/// flagged as violating the usage policy).
const CONTENT_POLICY_CODES: [&str; 5] = [
    "content_policy_violation",
    "content_filter",
    "moderation_blocked",
    "content_policy",
    "invalid_prompt",
];
/// Error codes and types that mean the input is too large (llama.cpp's
/// `exceed_context_size_error`).
const TOO_LARGE_CODES: [&str; 5] = [
    "context_length_exceeded",
    "string_above_max_length",
    "request_too_large",
    "tokens_exceeded",
    "exceed_context_size_error",
];
/// Messages of servers that report a prompt over the context without a code: vLLM's
/// "This model's maximum context length is …", llama.cpp's "the request exceeds the
/// available context size".
const TOO_LARGE_MESSAGES: [&str; 3] = [
    "maximum context length",
    "exceeds the available context size",
    "context length exceeded",
];
/// Error codes for an answer the model failed to give in the requested format (Groq's
/// `json_validate_failed`): the model's fault for this content, worth another try,
/// never a sign that the request itself is wrong.
const OUTPUT_FORMAT_CODES: [&str; 1] = ["json_validate_failed"];
/// OpenAI error codes that mean a configuration or account problem.
const CONFIG_CODES: [&str; 5] = [
    "model_not_found",
    "invalid_api_key",
    "insufficient_quota",
    "account_deactivated",
    "unsupported_model",
];

impl LlmError {
    /// What the provider billed for a failed call that it answered (a
    /// withheld answer's usage).
    pub fn billed(&self) -> Option<super::Usage> {
        match self {
            LlmError::ContentFiltered(usage) => Some(*usage),
            _ => None,
        }
    }

    /// The class the caller acts on.
    pub fn class(&self) -> ErrorClass {
        match self {
            LlmError::Status {
                status,
                code,
                kind,
                message,
                rate_limit,
            } => classify_status(
                *status,
                code.as_deref(),
                kind.as_deref(),
                message,
                rate_limit,
            ),
            LlmError::ContentFiltered(_) => ErrorClass::Permanent(PermanentKind::ContentPolicy),
            LlmError::Timeout(_) | LlmError::Connect(_) | LlmError::Transport(_) => {
                ErrorClass::Transient
            }
            LlmError::Malformed(_) => ErrorClass::Malformed,
            LlmError::CircuitOpen(_) => ErrorClass::CircuitOpen,
            LlmError::Config(_) => ErrorClass::Config,
        }
    }

    /// A bounded label for metrics and `errorCode`.
    pub fn code(&self) -> &'static str {
        match self.class() {
            ErrorClass::Transient => match self {
                LlmError::Timeout(_) => "timeout",
                _ => "transient",
            },
            ErrorClass::RateLimited { .. } => "rate_limited",
            ErrorClass::Permanent(k) => k.as_str(),
            ErrorClass::Config => "config",
            ErrorClass::Malformed => "malformed",
            ErrorClass::CircuitOpen => "circuit_open",
        }
    }

    /// The provider's own error message, if it gave one (may quote input:
    /// never logged per task).
    pub fn provider_message(&self) -> Option<&str> {
        match self {
            LlmError::Status { message, .. } if !message.is_empty() => Some(message),
            _ => None,
        }
    }

    /// Rate-limit headers carried by the error, if any.
    pub fn rate_limit(&self) -> Option<&RateLimitInfo> {
        match self {
            LlmError::Status { rate_limit, .. } => Some(rate_limit.as_ref()),
            _ => None,
        }
    }
}

fn classify_status(
    status: u16,
    code: Option<&str>,
    kind: Option<&str>,
    message: &str,
    rate_limit: &RateLimitInfo,
) -> ErrorClass {
    let is = |set: &[&str]| {
        code.is_some_and(|c| set.contains(&c)) || kind.is_some_and(|k| set.contains(&k))
    };
    let says = |set: &[&str]| {
        let m = message.to_ascii_lowercase();
        set.iter().any(|s| m.contains(s))
    };
    if is(&CONFIG_CODES) {
        return ErrorClass::Config;
    }
    match status {
        429 => ErrorClass::RateLimited {
            retry_after: rate_limit.retry_after,
        },
        401 | 403 | 404 => ErrorClass::Config,
        408 | 409 | 425 => ErrorClass::Transient,
        413 => ErrorClass::Permanent(PermanentKind::TooLarge),
        500..=599 => ErrorClass::Transient,
        400..=499 if is(&CONTENT_POLICY_CODES) => {
            ErrorClass::Permanent(PermanentKind::ContentPolicy)
        }
        400..=499 if is(&TOO_LARGE_CODES) || says(&TOO_LARGE_MESSAGES) => {
            ErrorClass::Permanent(PermanentKind::TooLarge)
        }
        400..=499 if is(&OUTPUT_FORMAT_CODES) => ErrorClass::Malformed,
        400..=499 => ErrorClass::Permanent(PermanentKind::BadRequest),
        // 1xx/3xx reaching us means a misbehaving proxy: retry.
        _ => ErrorClass::Transient,
    }
}

/// Longest provider error message kept.
const MAX_ERROR_MESSAGE: usize = 300;

/// The body of an error answer: OpenAI's `{"error":{…}}` or vLLM's flat `{"message":…}`.
pub(crate) fn parse_error_body(body: &[u8]) -> (Option<String>, Option<String>, String) {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return (None, None, String::new());
    };
    let e = match v.get("error") {
        Some(inner @ serde_json::Value::Object(_)) => inner,
        _ => &v,
    };
    let text = |key: &str, max: usize| {
        let mut s = match e.get(key) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => return None,
        };
        if s.len() > max {
            let mut cut = max;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            s.truncate(cut);
        }
        Some(s)
    };
    // A provider's code and type name a kind of error (a few words): longer
    // ones are cut like the message, so no answer puts kilobytes into every
    // failed result and dead letter that quotes them.
    (
        text("code", MAX_ERROR_CODE),
        text("type", MAX_ERROR_CODE),
        text("message", MAX_ERROR_MESSAGE).unwrap_or_default(),
    )
}

/// Longest error code or type kept from a provider's answer, bytes.
const MAX_ERROR_CODE: usize = 64;

/// Short category of a serde_json error, without the input excerpt.
pub(super) trait ClassifyStr {
    fn classify_str(&self) -> &'static str;
}

impl ClassifyStr for serde_json::Error {
    fn classify_str(&self) -> &'static str {
        match self.classify() {
            serde_json::error::Category::Io => "io",
            serde_json::error::Category::Syntax => "syntax",
            serde_json::error::Category::Data => "unexpected shape",
            serde_json::error::Category::Eof => "truncated",
        }
    }
}

#[cfg(test)]
mod tests;
