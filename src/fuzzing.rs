//! Entry points for `tests/fuzz.rs` into decoders that are private to the
//! crate. Each function calls the real decoder and nothing else: the fuzz
//! suite exercises exactly the code the service runs. Not part of the API.

/// The body of a provider's non-2xx answer, as the HTTP transport reads it
/// (see `llm::error::parse_error_body`): `(error.code, error.type,
/// error.message)`.
pub fn parse_error_body(body: &[u8]) -> (Option<String>, Option<String>, String) {
    crate::llm::error::parse_error_body(body)
}
