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
        let prompt = u32::try_from(self.estimated_prompt_tokens()).unwrap_or(u32::MAX);
        prompt.saturating_add(self.completion_cap().unwrap_or(256))
    }

    /// The completion token cap the request carries, in either field.
    pub fn completion_cap(&self) -> Option<u32> {
        self.max_tokens.or(self.max_completion_tokens)
    }
}

impl ChatRequest {
    /// A true upper bound of the prompt's tokens, for hard quotas: its bytes
    /// (a byte-level BPE token, as OpenAI's, Llama 3's or Qwen's tokenizers
    /// make, is at least one byte, whatever the script: CJK text, digits and
    /// base64 take more tokens per byte than prose, never more than one),
    /// the response format's schema, and the chat framing (at most 8 tokens
    /// a message, 8 to start the answer).
    pub fn prompt_token_bound(&self) -> u64 {
        let messages: usize = self.messages.iter().map(|m| m.content.len() + 8).sum();
        let format = self
            .response_format
            .as_ref()
            .and_then(|f| serde_json::to_vec(f).ok())
            .map_or(0, |f| f.len());
        (messages + format + 8) as u64
    }

    /// Estimated prompt tokens: the messages' text and a small per-message
    /// overhead (see [`estimate_tokens`]).
    pub fn estimated_prompt_tokens(&self) -> u64 {
        estimate_tokens(self.messages.iter().map(|m| m.content.len() + 16).sum())
    }
}

/// Sluice's one token estimate of a text of `bytes` bytes, wherever a
/// count is needed before (or without) the provider's: about four
/// characters per token, rounded up.
pub fn estimate_tokens(bytes: usize) -> u64 {
    bytes.div_ceil(4) as u64
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
    /// Prompt tokens written to the provider's cache (Anthropic-style cache creation:
    /// `cache_creation_input_tokens`, or `prompt_tokens_details.cache_write_tokens` /
    /// `cache_creation_tokens`; 0 if absent), counted in `prompt_tokens`.
    #[serde(default)]
    pub cache_write_tokens: u64,
}

impl Usage {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.cached_tokens += other.cached_tokens;
        self.cache_write_tokens += other.cache_write_tokens;
    }

    /// Prompt plus completion tokens.
    pub fn total(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }
}

/// A parsed chat completion.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatResponse {
    /// Text of the first choice: its content (text parts joined), without a leading
    /// `<think>…</think>` block; empty when the model said nothing (or only refused).
    pub content: String,
    /// Token usage.
    pub usage: Usage,
    /// The provider did not report usage (missing or `null`): `usage` is zero here and
    /// the client estimates it from the request and the answer.
    pub usage_missing: bool,
    /// Why generation stopped (`stop`, `length`, …).
    pub finish_reason: Option<String>,
    /// The model declined to answer (`message.refusal`).
    pub refusal: Option<String>,
    /// Rate-limit headers of the response.
    pub rate_limit: RateLimitInfo,
}

impl ChatResponse {
    /// Fills in usage the provider did not report, estimated from the request and the
    /// answer (about 4 characters per token): tokens it billed still land on results.
    pub fn estimate_missing_usage(&mut self, request: &ChatRequest) {
        if !self.usage_missing {
            return;
        }
        let answer = self.content.len() + self.refusal.as_ref().map_or(0, String::len);
        self.usage = Usage {
            prompt_tokens: request.estimated_prompt_tokens(),
            completion_tokens: estimate_tokens(answer),
            cached_tokens: 0,
            cache_write_tokens: 0,
        };
    }

    /// Generation stopped at the completion token cap: the answer is cut short.
    pub fn truncated(&self) -> bool {
        self.finish_reason.as_deref() == Some("length")
    }
}

#[derive(Deserialize)]
struct WireResponse {
    #[serde(default)]
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct WireChoice {
    #[serde(default)]
    message: Option<WireMessage>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct WireMessage {
    /// A string, `null`, or an array of content parts (`{"type":"text","text":…}`).
    #[serde(default)]
    content: serde_json::Value,
    #[serde(default)]
    refusal: Option<String>,
}

/// Token counts; every field may be missing or `null`.
#[derive(Deserialize, Default)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<WireUsageDetails>,
    /// DeepSeek's count of prompt tokens served from its cache.
    #[serde(default)]
    prompt_cache_hit_tokens: Option<u64>,
    /// Prompt tokens written to the cache, as LiteLLM and Anthropic-style servers report them.
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens_details: Option<WireCompletionDetails>,
    #[serde(default)]
    total_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct WireUsageDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
    #[serde(default, alias = "cache_creation_tokens")]
    cache_write_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct WireCompletionDetails {
    #[serde(default)]
    reasoning_tokens: Option<u64>,
}

/// Completion tokens billed. They include reasoning tokens, as OpenAI counts them; a
/// server that reports reasoning beside the completion (its `total_tokens` is prompt +
/// completion + reasoning) has them added, since they are billed as output.
fn completion_tokens(usage: &WireUsage) -> u64 {
    let completion = usage.completion_tokens.unwrap_or(0);
    let reasoning = usage
        .completion_tokens_details
        .as_ref()
        .and_then(|d| d.reasoning_tokens)
        .unwrap_or(0);
    let prompt = usage.prompt_tokens.unwrap_or(0);
    match usage.total_tokens {
        Some(total)
            if reasoning > 0
                && total == prompt.saturating_add(completion).saturating_add(reasoning) =>
        {
            completion + reasoning
        }
        _ => completion,
    }
}

/// The text of a message's `content`: a string, or the text parts of an array joined.
fn content_text(content: &serde_json::Value) -> Option<String> {
    match content {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(parts) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter(|p| {
                    p.get("type")
                        .and_then(serde_json::Value::as_str)
                        .is_none_or(|t| t == "text" || t == "output_text")
                })
                .filter_map(|p| p.get("text").and_then(serde_json::Value::as_str))
                .collect();
            (!texts.is_empty()).then(|| texts.concat())
        }
        _ => None,
    }
}

/// Removes a reasoning block the server left at the start of the content
/// (`<think>…</think>`, as DeepSeek-R1 on Ollama, Groq's raw format or vLLM without a
/// reasoning parser answer). An unclosed block is all reasoning: nothing is left.
fn strip_think(content: &str) -> &str {
    let trimmed = content.trim_start();
    let Some(rest) = trimmed.strip_prefix("<think>") else {
        return content;
    };
    match rest.find("</think>") {
        Some(end) => rest[end + "</think>".len()..].trim_start(),
        None => "",
    }
}

/// Parses a 2xx body. Every shape OpenAI-compatible servers answer with is read: usage
/// missing or `null`, content `null`, an array of parts or after a `<think>` block, a
/// refusal, provider-specific cache counts. Only a body that is not a chat completion, or
/// one without a choice, is malformed.
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
    let (content, refusal) = match choice.message {
        Some(m) => (
            content_text(&m.content),
            m.refusal.filter(|r| !r.is_empty()),
        ),
        None => (None, None),
    };
    let usage_missing = wire.usage.is_none();
    let usage = wire.usage.unwrap_or_default();
    let prompt_tokens = usage.prompt_tokens.unwrap_or(0);
    let details = usage.prompt_tokens_details.as_ref();
    let cached_tokens = details
        .and_then(|d| d.cached_tokens)
        .or(usage.prompt_cache_hit_tokens)
        .unwrap_or(0)
        .min(prompt_tokens);
    let cache_write_tokens = details
        .and_then(|d| d.cache_write_tokens)
        .or(usage.cache_creation_input_tokens)
        .unwrap_or(0)
        .min(prompt_tokens - cached_tokens);
    let usage = Usage {
        prompt_tokens,
        completion_tokens: completion_tokens(&usage),
        cached_tokens,
        cache_write_tokens,
    };
    if content.is_none()
        && refusal.is_none()
        && choice.finish_reason.as_deref() == Some("content_filter")
    {
        return Err(LlmError::ContentFiltered(usage));
    }
    Ok(ChatResponse {
        content: strip_think(content.as_deref().unwrap_or_default()).to_string(),
        usage,
        usage_missing,
        finish_reason: choice.finish_reason,
        refusal,
        rate_limit,
    })
}

#[cfg(test)]
mod tests;
