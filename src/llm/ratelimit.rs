//! Rate-limit state reported by the provider: [`RateLimitInfo`], the header names it is read
//! from, and the parsing of counts, reset durations and `Retry-After`.

use std::time::Duration;

use http::HeaderMap;

/// Rate-limit state reported by the provider in response headers. All fields are optional:
/// vLLM, llama.cpp and Ollama send none of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateLimitInfo {
    /// `x-ratelimit-limit-requests`.
    pub limit_requests: Option<u64>,
    /// `x-ratelimit-remaining-requests`.
    pub remaining_requests: Option<u64>,
    /// `x-ratelimit-reset-requests` (e.g. `1s`, `6m0s`, `120ms`).
    pub reset_requests: Option<Duration>,
    /// `x-ratelimit-limit-tokens`.
    pub limit_tokens: Option<u64>,
    /// `x-ratelimit-remaining-tokens`.
    pub remaining_tokens: Option<u64>,
    /// `x-ratelimit-reset-tokens`.
    pub reset_tokens: Option<Duration>,
    /// `retry-after-ms`, else `Retry-After` (seconds or HTTP date).
    pub retry_after: Option<Duration>,
}

/// Header names read by [`RateLimitInfo::from_headers`].
pub mod rate_limit_headers {
    /// Request quota.
    pub const LIMIT_REQUESTS: &str = "x-ratelimit-limit-requests";
    /// Requests left.
    pub const REMAINING_REQUESTS: &str = "x-ratelimit-remaining-requests";
    /// Time until the request quota is replenished.
    pub const RESET_REQUESTS: &str = "x-ratelimit-reset-requests";
    /// Token quota.
    pub const LIMIT_TOKENS: &str = "x-ratelimit-limit-tokens";
    /// Tokens left.
    pub const REMAINING_TOKENS: &str = "x-ratelimit-remaining-tokens";
    /// Time until the token quota is replenished.
    pub const RESET_TOKENS: &str = "x-ratelimit-reset-tokens";
    /// Standard HTTP header, seconds or HTTP date.
    pub const RETRY_AFTER: &str = "retry-after";
    /// Millisecond variant (OpenAI, Azure).
    pub const RETRY_AFTER_MS: &str = "retry-after-ms";
}

impl RateLimitInfo {
    /// Parses the `x-ratelimit-*` and retry-after headers; malformed values are ignored.
    pub fn from_headers(headers: &HeaderMap) -> Self {
        use rate_limit_headers::*;
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
        };
        let num = |name: &str| text(name).and_then(parse_count);
        let dur = |name: &str| text(name).and_then(parse_reset_duration);
        let mut info = Self {
            limit_requests: num(LIMIT_REQUESTS),
            remaining_requests: num(REMAINING_REQUESTS),
            reset_requests: dur(RESET_REQUESTS),
            limit_tokens: num(LIMIT_TOKENS),
            remaining_tokens: num(REMAINING_TOKENS),
            reset_tokens: dur(RESET_TOKENS),
            retry_after: None,
        };
        let precise = text(RETRY_AFTER_MS)
            .and_then(|v| v.parse::<f64>().ok())
            .and_then(|ms| seconds(ms / 1000.0));
        info.retry_after = precise.or_else(|| {
            let raw = text(RETRY_AFTER)?;
            let after = parse_retry_after(raw)?;
            Some(if raw.bytes().all(|b| b.is_ascii_digit()) {
                info.refine_whole_seconds(after)
            } else {
                after
            })
        });
        info
    }

    /// A whole-second `Retry-After` is rounded up: the true wait lies in `(n - 1 s, n]`.
    /// When the same answer says when the exhausted budget resets, that refines it.
    fn refine_whole_seconds(&self, after: Duration) -> Duration {
        let exhausted = |remaining: Option<u64>, reset: Option<Duration>| {
            reset.filter(|_| remaining == Some(0))
        };
        let reset = exhausted(self.remaining_requests, self.reset_requests)
            .into_iter()
            .chain(exhausted(self.remaining_tokens, self.reset_tokens))
            .max();
        match reset {
            Some(reset) => reset
                .min(after)
                .max(after.saturating_sub(Duration::from_secs(1))),
            None => after,
        }
    }

    /// True when no header was present.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// Counts are integers, but some proxies send `12.0`.
fn parse_count(s: &str) -> Option<u64> {
    s.parse::<u64>().ok().or_else(|| {
        s.parse::<f64>()
            .ok()
            .filter(|f| f.is_finite() && *f >= 0.0)
            .map(|f| f as u64)
    })
}

/// Parses a reset duration in Go's format (`1s`, `6m0s`, `120ms`, `0.5s`, `1h2m3.5s`); a bare
/// number is seconds.
pub fn parse_reset_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    if let Ok(secs) = s.parse::<f64>() {
        return seconds(secs);
    }
    let mut total = 0.0_f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_end == 0 {
            return None;
        }
        let value: f64 = rest[..num_end].parse().ok()?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    seconds(total)
}

/// `Retry-After`: delta seconds (integer or decimal) or an HTTP date.
fn parse_retry_after(s: &str) -> Option<Duration> {
    if let Ok(secs) = s.parse::<f64>() {
        return seconds(secs);
    }
    let when = chrono::DateTime::parse_from_rfc2822(s).ok()?;
    let delta = when.with_timezone(&chrono::Utc) - chrono::Utc::now();
    Some(delta.to_std().unwrap_or(Duration::ZERO).min(MAX_WAIT))
}

/// The longest wait a header can ask for: a provider's daily quota resets within a day, and
/// every wait read from a header stays in `Instant` arithmetic's range.
pub const MAX_WAIT: Duration = Duration::from_secs(86_400);

/// A wait in seconds as a provider wrote it: `None` when negative or not a number, at most
/// [`MAX_WAIT`] however large (a header never panics the client).
fn seconds(secs: f64) -> Option<Duration> {
    if secs.is_nan() || secs < 0.0 {
        return None;
    }
    Some(Duration::try_from_secs_f64(secs).map_or(MAX_WAIT, |d| d.min(MAX_WAIT)))
}

#[cfg(test)]
mod tests;
