//! The OpenAI-compatible `/v1/chat/completions` wire types: the request, the parsed response
//! and its token usage, and the parsing of a 2xx body.

use serde::{Deserialize, Serialize};

use super::error::{ClassifyStr, LlmError};
use super::ratelimit::RateLimitInfo;

/// Author of a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions.
    System,
    /// The input.
    User,
    /// A model answer.
    Assistant,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// What is said.
    pub content: String,
}

impl Message {
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self {
            role: Role::System,
            content: content.into(),
        }
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: Role::User,
            content: content.into(),
        }
    }
}

/// The `response_format` of a chat request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Free text.
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON matching a schema (`{"name": …, "schema": …}`).
    JsonSchema {
        /// The schema wrapper as OpenAI expects it.
        json_schema: serde_json::Value,
    },
}

/// A chat completion request (the subset Sluice uses).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatRequest {
    /// Upstream model id; the composed client overwrites it with the configured one.
    pub model: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Completion token cap.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Completion token cap, for models that reject `max_tokens` (the client moves it here
    /// for a model configured so).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u32>,
    /// Sampling temperature.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Output format constraint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ResponseFormat>,
}

impl ChatRequest {
    /// Worst-case token estimate used for limiter admission: about 4 characters per prompt
    /// token plus a small per-message overhead, plus the completion cap.
    pub fn estimated_tokens(&self) -> u32 {
        let chars: usize = self.messages.iter().map(|m| m.content.len() + 16).sum();
        let prompt = u32::try_from(chars.div_ceil(4)).unwrap_or(u32::MAX);
        prompt.saturating_add(
            self.max_tokens
                .or(self.max_completion_tokens)
                .unwrap_or(256),
        )
    }
}

/// Token usage reported by the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens billed (cached ones included).
    pub prompt_tokens: u64,
    /// Completion tokens billed.
    pub completion_tokens: u64,
    /// Prompt tokens served from cache (`prompt_tokens_details.cached_tokens`, 0 if absent).
    pub cached_tokens: u64,
}

impl Usage {
    /// Prompt plus completion tokens.
    pub fn total(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }
}

/// A parsed chat completion.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatResponse {
    /// Text of the first choice.
    pub content: String,
    /// Token usage.
    pub usage: Usage,
    /// Why generation stopped (`stop`, `length`, …).
    pub finish_reason: Option<String>,
    /// Rate-limit headers of the response.
    pub rate_limit: RateLimitInfo,
}

#[derive(Deserialize)]
struct WireResponse {
    #[serde(default)]
    choices: Vec<WireChoice>,
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct WireChoice {
    message: Option<WireMessage>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct WireMessage {
    content: Option<String>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    prompt_tokens_details: Option<WireUsageDetails>,
}

#[derive(Deserialize)]
struct WireUsageDetails {
    cached_tokens: Option<u64>,
}

/// Parses a 2xx body.
pub fn parse_chat_body(body: &[u8], rate_limit: RateLimitInfo) -> Result<ChatResponse, LlmError> {
    let wire: WireResponse = serde_json::from_slice(body).map_err(|e| {
        LlmError::Malformed(format!(
            "body is not a chat completion: {}",
            e.classify_str()
        ))
    })?;
    let choice = wire
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| LlmError::Malformed("no choices".into()))?;
    let usage = wire
        .usage
        .ok_or_else(|| LlmError::Malformed("no usage".into()))?;
    let content = match choice.message.and_then(|m| m.content) {
        Some(c) => c,
        None if choice.finish_reason.as_deref() == Some("content_filter") => {
            return Err(LlmError::ContentFiltered)
        }
        None => return Err(LlmError::Malformed("no message content".into())),
    };
    Ok(ChatResponse {
        content,
        usage: Usage {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            cached_tokens: usage
                .prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0),
        },
        finish_reason: choice.finish_reason,
        rate_limit,
    })
}
