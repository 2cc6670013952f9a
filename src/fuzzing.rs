//! Entry points for `tests/fuzz.rs` into decoders that are private to the
//! crate. Each function calls the real decoder and nothing else: the fuzz
//! suite exercises exactly the code the service runs. Not part of the API.

/// The body of a provider's non-2xx answer, as the HTTP transport reads it
/// (see `llm::error::parse_error_body`): `(error.code, error.type,
/// error.message)`.
pub fn parse_error_body(body: &[u8]) -> (Option<String>, Option<String>, String) {
    crate::llm::error::parse_error_body(body)
}

/// What a task's earlier attempts were billed, read from its `sluice.billed`
/// header as the operator reads it (see `operator::billed_before`):
/// `(input, output, cached, cache write, cost µ$)`.
pub fn billed_before(headers: &[(String, Vec<u8>)]) -> (u64, u64, u64, u64, i64) {
    let (u, cost) = crate::steps::invoke_llm::billed_before(&headers.to_vec());
    (
        u.prompt_tokens,
        u.completion_tokens,
        u.cached_tokens,
        u.cache_write_tokens,
        cost,
    )
}

/// The headers the operator re-publishes a task with after billing it so
/// far (see `operator::with_billed`).
pub fn with_billed(
    headers: &[(String, Vec<u8>)],
    (input, output, cached, cache_write, cost): (u64, u64, u64, u64, i64),
) -> Vec<(String, Vec<u8>)> {
    let usage = crate::llm::wire::Usage {
        prompt_tokens: input,
        completion_tokens: output,
        cached_tokens: cached,
        cache_write_tokens: cache_write,
    };
    crate::steps::invoke_llm::with_billed(&headers.to_vec(), usage, cost)
}
