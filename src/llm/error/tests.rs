//! Error tests: classification by status and code, and `Display` never leaking the provider's
//! message.

use super::*;

fn status_err(status: u16, code: Option<&str>, kind: Option<&str>) -> LlmError {
    LlmError::Status {
        status,
        code: code.map(str::to_string),
        kind: kind.map(str::to_string),
        message: String::new(),
        rate_limit: Box::default(),
    }
}

#[test]
fn classification_by_status_and_code() {
    use ErrorClass::*;
    use PermanentKind::*;
    let cases = [
        (
            status_err(400, None, Some("invalid_request_error")),
            Permanent(BadRequest),
        ),
        (status_err(422, None, None), Permanent(BadRequest)),
        (
            status_err(400, Some("content_policy_violation"), None),
            Permanent(ContentPolicy),
        ),
        (
            status_err(400, None, Some("content_filter")),
            Permanent(ContentPolicy),
        ),
        (
            status_err(400, Some("context_length_exceeded"), None),
            Permanent(TooLarge),
        ),
        (status_err(413, None, None), Permanent(TooLarge)),
        (status_err(401, Some("invalid_api_key"), None), Config),
        (status_err(403, None, None), Config),
        (status_err(404, Some("model_not_found"), None), Config),
        (status_err(400, Some("model_not_found"), None), Config),
        (status_err(429, Some("insufficient_quota"), None), Config),
        (
            status_err(429, None, None),
            RateLimited { retry_after: None },
        ),
        (status_err(408, None, None), Transient),
        (status_err(409, None, None), Transient),
        (status_err(500, None, None), Transient),
        (status_err(503, None, None), Transient),
        (LlmError::Timeout(Duration::from_secs(1)), Transient),
        (LlmError::Connect("refused".into()), Transient),
        (LlmError::Malformed("x".into()), Malformed),
        (
            LlmError::ContentFiltered(Default::default()),
            Permanent(ContentPolicy),
        ),
        (LlmError::CircuitOpen("m".into()), CircuitOpen),
    ];
    for (err, class) in cases {
        assert_eq!(err.class(), class, "{err:?}");
    }
    assert_eq!(
        status_err(400, Some("context_length_exceeded"), None).code(),
        "too_large"
    );
    assert_eq!(LlmError::Timeout(Duration::ZERO).code(), "timeout");
    assert_eq!(PermanentKind::ContentPolicy.as_str(), "content_policy");
}

#[test]
fn error_display_never_contains_the_provider_message() {
    let err = LlmError::Status {
        status: 400,
        code: Some("context_length_exceeded".into()),
        kind: None,
        message: "your prompt 'SECRET TEXT' is too long".into(),
        rate_limit: Box::default(),
    };
    assert!(!err.to_string().contains("SECRET"));
}

/// Context-length errors of servers that give no OpenAI code, and content-dependent 400s,
/// are classified by what they mean, not filed as a request the provider cannot take.
#[test]
fn other_servers_context_errors_and_content_dependent_400s() {
    let from_body = |status: u16, body: &str| {
        let (code, kind, message) = parse_error_body(body.as_bytes());
        LlmError::Status {
            status,
            code,
            kind,
            message,
            rate_limit: Box::default(),
        }
        .class()
    };
    use ErrorClass::*;
    use PermanentKind::*;
    // vLLM: a flat error object, code 400, the limit only in the message.
    let vllm = r#"{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5120 tokens (4096 in the messages, 1024 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#;
    assert_eq!(from_body(400, vllm), Permanent(TooLarge));
    // llama.cpp server.
    let llama = r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":5000,"n_ctx":4096}}"#;
    assert_eq!(from_body(400, llama), Permanent(TooLarge));
    let old_llama = r#"{"error":{"code":400,"message":"the request exceeds the available context size. try increasing the context size or enable context shift","type":"invalid_request_error"}}"#;
    assert_eq!(from_body(400, old_llama), Permanent(TooLarge));
    // OpenAI: a prompt flagged by the usage policy.
    let flagged = r#"{"error":{"message":"Invalid prompt: your prompt was flagged as potentially violating our usage policy.","type":"invalid_request_error","param":null,"code":"invalid_prompt"}}"#;
    assert_eq!(from_body(400, flagged), Permanent(ContentPolicy));
    // Groq: the model's JSON failed validation: this answer, not the request.
    let groq = r#"{"error":{"message":"Failed to generate JSON. Please adjust your prompt. See 'failed_generation' for more details.","type":"invalid_request_error","code":"json_validate_failed","failed_generation":"{\"a\": "}}"#;
    assert_eq!(from_body(400, groq), Malformed);
    // A plain bad request stays one.
    let plain = r#"{"error":{"message":"Unsupported value: 'temperature' does not support 0.0 with this model.","type":"invalid_request_error","param":"temperature","code":"unsupported_value"}}"#;
    assert_eq!(from_body(400, plain), Permanent(BadRequest));
}

/// A provider's code and type are cut like its message: an answer cannot put kilobytes into
/// every failed result and dead letter that names them.
#[test]
fn long_codes_and_types_are_cut() {
    let long = "é".repeat(5_000);
    let body = serde_json::json!({"error": {"code": long, "type": long, "message": long}});
    let (code, kind, message) = parse_error_body(body.to_string().as_bytes());
    let (code, kind) = (code.unwrap(), kind.unwrap());
    assert!(
        code.len() <= MAX_ERROR_CODE && code.len() >= MAX_ERROR_CODE - 1,
        "{code}"
    );
    assert!(kind.len() <= MAX_ERROR_CODE, "{kind}");
    assert!(code.chars().all(|c| c == 'é'));
    assert!(message.len() <= MAX_ERROR_MESSAGE);
    // Short ones, and numeric codes, are kept whole.
    let (code, kind, _) =
        parse_error_body(br#"{"error":{"code":429,"type":"rate_limit_exceeded"}}"#);
    assert_eq!(code.as_deref(), Some("429"));
    assert_eq!(kind.as_deref(), Some("rate_limit_exceeded"));
}
