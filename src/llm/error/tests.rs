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
        (LlmError::ContentFiltered, Permanent(ContentPolicy)),
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
    assert_eq!(
        PermanentKind::ContentPolicy.dlq_category(),
        DlqCategory::ContentPolicy
    );
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
