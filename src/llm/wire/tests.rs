//! Chat completion bodies in the shapes OpenAI-compatible servers answer with (the fixtures
//! follow each server's documented response), parsed as the client reads them.

use super::*;

fn parse(name: &str, body: &str) -> ChatResponse {
    parse_chat_body(body.as_bytes(), RateLimitInfo::default())
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn usage(prompt: u64, completion: u64, cached: u64) -> Usage {
    Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: cached,
        cache_write_tokens: 0,
    }
}

/// Cache writes as LiteLLM (and Anthropic through it) and OpenRouter report them, and
/// reasoning tokens reported beside the completion (Gemini's OpenAI-compatible
/// endpoint: `total_tokens` = prompt + completion + reasoning) are billed.
#[test]
fn cache_writes_and_separate_reasoning_tokens_are_read() {
    let litellm = r#"{"choices":[{"message":{"role":"assistant","content":"news"},"finish_reason":"stop"}],
        "usage":{"prompt_tokens":2100,"completion_tokens":3,"total_tokens":2103,
        "prompt_tokens_details":{"cached_tokens":1000},"cache_creation_input_tokens":1024,
        "cache_read_input_tokens":1000}}"#;
    let r = parse("litellm", litellm);
    assert_eq!(
        (r.usage.cached_tokens, r.usage.cache_write_tokens),
        (1000, 1024)
    );
    let openrouter = r#"{"choices":[{"message":{"content":"news"},"finish_reason":"stop"}],
        "usage":{"prompt_tokens":500,"completion_tokens":3,
        "prompt_tokens_details":{"cached_tokens":0,"cache_write_tokens":480}}}"#;
    assert_eq!(
        parse("openrouter", openrouter).usage.cache_write_tokens,
        480
    );
    let gemini = r#"{"choices":[{"message":{"content":"news"},"finish_reason":"stop"}],
        "usage":{"prompt_tokens":40,"completion_tokens":2,"total_tokens":142,
        "completion_tokens_details":{"reasoning_tokens":100}}}"#;
    assert_eq!(parse("gemini", gemini).usage, usage(40, 102, 0));
    // OpenAI counts reasoning within completion_tokens: not added twice.
    let openai = r#"{"choices":[{"message":{"content":"news"},"finish_reason":"stop"}],
        "usage":{"prompt_tokens":40,"completion_tokens":102,"total_tokens":142,
        "completion_tokens_details":{"reasoning_tokens":100}}}"#;
    assert_eq!(parse("o-series", openai).usage, usage(40, 102, 0));
}

#[test]
fn every_servers_answer_is_read() {
    let r = parse("openai", include_str!("fixtures/openai.json"));
    assert_eq!(r.content, "Hello! How can I assist you today?");
    assert_eq!((r.usage, r.usage_missing), (usage(19, 10, 0), false));
    assert_eq!((r.truncated(), r.refusal.as_deref()), (false, None));

    let r = parse("azure", include_str!("fixtures/azure.json"));
    assert_eq!(r.content, "news");
    assert_eq!(r.usage, usage(1024, 1, 512));

    let r = parse("vllm", include_str!("fixtures/vllm-reasoning.json"));
    assert_eq!(r.content, "sports", "reasoning_content is not the answer");
    assert_eq!(r.usage, usage(42, 21, 0));

    let r = parse("llama.cpp", include_str!("fixtures/llamacpp.json"));
    assert!(r.truncated());
    assert_eq!(r.usage, usage(35, 8, 0));

    let r = parse("ollama", include_str!("fixtures/ollama-think.json"));
    assert_eq!(r.content, "news", "the <think> block is not the answer");
    assert_eq!(r.usage, usage(40, 25, 0));

    let r = parse("groq", include_str!("fixtures/groq.json"));
    assert_eq!(r.content, "Markets rallied after the report.");
    assert_eq!(r.usage, usage(18, 7, 0));

    let r = parse("deepseek", include_str!("fixtures/deepseek.json"));
    assert_eq!(r.content, r#"{"company": "Acme", "amount": 120}"#);
    assert_eq!(
        r.usage,
        usage(120, 230, 64),
        "DeepSeek's cache hits are cached tokens; reasoning tokens are completion tokens"
    );
}

#[test]
fn refusals_truncation_missing_usage_and_content_parts_are_answers_not_malformed() {
    let r = parse("refusal", include_str!("fixtures/openai-refusal.json"));
    assert_eq!(r.content, "");
    assert_eq!(
        r.refusal.as_deref(),
        Some("I'm sorry, I cannot assist with that request.")
    );
    assert_eq!(r.usage, usage(81, 11, 0), "a refusal is billed");

    let r = parse(
        "o3-mini",
        include_str!("fixtures/openai-reasoning-length.json"),
    );
    assert_eq!(r.content, "");
    assert!(r.truncated(), "reasoning spent the whole cap");
    assert_eq!(r.usage, usage(60, 16, 0));

    let r = parse("parts", include_str!("fixtures/no-usage-parts.json"));
    assert_eq!(r.content, "Markets rallied.");
    assert!(r.usage_missing);
    assert_eq!(r.usage, Usage::default());

    let body = r#"{"choices":[{"message":{"content":"ok"},"finish_reason":"stop"}]}"#;
    assert!(parse("no usage field", body).usage_missing);
    let body = r#"{"choices":[{"message":{"content":null},"finish_reason":"stop"}],
        "usage":{"prompt_tokens":null,"completion_tokens":3}}"#;
    let r = parse("null content, null count", body);
    assert_eq!((r.content.as_str(), r.usage), ("", usage(0, 3, 0)));
}

#[test]
fn think_blocks_are_stripped_only_at_the_start() {
    assert_eq!(strip_think("<think>a</think>\n\nb"), "b");
    assert_eq!(strip_think("  <think>\na\n</think>b"), "b");
    assert_eq!(strip_think("<think>never closed"), "");
    assert_eq!(strip_think("b <think>x</think>"), "b <think>x</think>");
    assert_eq!(strip_think("plain"), "plain");
}

#[test]
fn only_bodies_that_are_not_completions_are_malformed() {
    for body in [
        "{not json",
        r#"{"choices":[]}"#,
        r#"{"object":"list"}"#,
        "[]",
    ] {
        assert!(
            matches!(
                parse_chat_body(body.as_bytes(), RateLimitInfo::default()),
                Err(LlmError::Malformed(_))
            ),
            "{body}"
        );
    }
    let filtered = r#"{"choices":[{"message":{"content":null},"finish_reason":"content_filter"}],
        "usage":{"prompt_tokens":5,"completion_tokens":0}}"#;
    // Withheld, and billed all the same.
    assert_eq!(
        parse_chat_body(filtered.as_bytes(), RateLimitInfo::default()),
        Err(LlmError::ContentFiltered(Usage {
            prompt_tokens: 5,
            completion_tokens: 0,
            cached_tokens: 0,
            cache_write_tokens: 0,
        }))
    );
}

#[test]
fn usage_a_provider_did_not_report_is_estimated() {
    let request = ChatRequest {
        model: "m".into(),
        messages: vec![
            Message::system("x".repeat(84)),
            Message::user("y".repeat(84)),
        ],
        max_tokens: Some(50),
        max_completion_tokens: None,
        temperature: None,
        response_format: None,
    };
    let mut r = parse("parts", include_str!("fixtures/no-usage-parts.json"));
    r.estimate_missing_usage(&request);
    assert_eq!(r.usage, usage(50, 4, 0));
    let mut reported = parse("openai", include_str!("fixtures/openai.json"));
    reported.estimate_missing_usage(&request);
    assert_eq!(reported.usage, usage(19, 10, 0), "reported usage is kept");
}

/// The hard-quota bound counts a token per byte at most: CJK text (about a
/// token a character in OpenAI's o200k, three bytes each), digits and base64
/// stay under it, where a quarter of the bytes would not.
#[test]
fn the_prompt_bound_is_never_below_a_byte_level_tokenizers_count() {
    let cjk = "数据流处理".repeat(200); // 1,000 characters, 3,000 bytes
    let digits = "7".repeat(1_000);
    for text in [cjk.as_str(), digits.as_str()] {
        let r = ChatRequest {
            model: "m".into(),
            messages: vec![Message::system("Answer."), Message::user(text)],
            max_tokens: Some(16),
            max_completion_tokens: None,
            temperature: None,
            response_format: None,
        };
        // At least a token per byte of text, so at least one per character.
        let bytes = (text.len() + "Answer.".len()) as u64;
        assert!(
            r.prompt_token_bound() >= bytes,
            "{}",
            r.prompt_token_bound()
        );
        // The pacing estimate (a quarter of the bytes) is no bound: a
        // tokenizer giving a token per CJK character or per 3 digits passes it.
        let per_char_or_3_digits = if text == digits { 334 } else { 1_000 };
        assert!(r.estimated_prompt_tokens() < per_char_or_3_digits);
    }
}
