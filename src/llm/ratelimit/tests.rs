//! Rate-limit tests: reset durations in Go's format and the parsing of rate-limit and
//! retry-after headers.

use super::*;
use axum::http::HeaderValue;

#[test]
fn reset_durations_in_go_format() {
    let ms = |m: u64| Some(Duration::from_millis(m));
    assert_eq!(parse_reset_duration("1s"), ms(1000));
    assert_eq!(parse_reset_duration("6m0s"), ms(360_000));
    assert_eq!(parse_reset_duration("120ms"), ms(120));
    assert_eq!(parse_reset_duration("0.5s"), ms(500));
    assert_eq!(parse_reset_duration("1h2m3.5s"), ms(3_723_500));
    assert_eq!(parse_reset_duration("2"), ms(2000));
    assert_eq!(
        parse_reset_duration("17.4ms").map(|d| d.as_micros()),
        Some(17_400)
    );
    assert_eq!(parse_reset_duration(""), None);
    assert_eq!(parse_reset_duration("soon"), None);
    assert_eq!(parse_reset_duration("5x"), None);
    assert_eq!(parse_reset_duration("-1s"), None);
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, HeaderValue::from_str(v).unwrap());
    }
    h
}

#[test]
fn rate_limit_headers_are_parsed() {
    let info = RateLimitInfo::from_headers(&headers(&[
        ("x-ratelimit-limit-requests", "3000"),
        ("x-ratelimit-remaining-requests", "2999"),
        ("x-ratelimit-reset-requests", "20ms"),
        ("x-ratelimit-limit-tokens", "250000"),
        ("x-ratelimit-remaining-tokens", "249900"),
        ("x-ratelimit-reset-tokens", "6m0s"),
        ("retry-after", "2"),
    ]));
    assert_eq!(
        info,
        RateLimitInfo {
            limit_requests: Some(3000),
            remaining_requests: Some(2999),
            reset_requests: Some(Duration::from_millis(20)),
            limit_tokens: Some(250_000),
            remaining_tokens: Some(249_900),
            reset_tokens: Some(Duration::from_secs(360)),
            retry_after: Some(Duration::from_secs(2)),
        }
    );
    // retry-after-ms wins over the coarse Retry-After.
    let info =
        RateLimitInfo::from_headers(&headers(&[("retry-after", "1"), ("retry-after-ms", "250")]));
    assert_eq!(info.retry_after, Some(Duration::from_millis(250)));
    // A whole-second Retry-After is refined by the reset of the exhausted budget...
    let info = RateLimitInfo::from_headers(&headers(&[
        ("retry-after", "1"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "40ms"),
    ]));
    assert_eq!(info.retry_after, Some(Duration::from_millis(40)));
    // ...within its rounding only.
    let info = RateLimitInfo::from_headers(&headers(&[
        ("retry-after", "30"),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "20ms"),
    ]));
    assert_eq!(info.retry_after, Some(Duration::from_secs(29)));
    // A budget that is not exhausted says nothing about the wait.
    let info = RateLimitInfo::from_headers(&headers(&[
        ("retry-after", "1"),
        ("x-ratelimit-remaining-requests", "3"),
        ("x-ratelimit-reset-requests", "40ms"),
    ]));
    assert_eq!(info.retry_after, Some(Duration::from_secs(1)));
    // HTTP date in the past: retry now.
    let info = RateLimitInfo::from_headers(&headers(&[(
        "retry-after",
        "Wed, 21 Oct 2015 07:28:00 GMT",
    )]));
    assert_eq!(info.retry_after, Some(Duration::ZERO));
    // Garbage is ignored, absent headers are empty.
    let info = RateLimitInfo::from_headers(&headers(&[("x-ratelimit-remaining-requests", "many")]));
    assert!(info.is_empty());
}

/// No value a provider writes in a header panics the client: absurdly long waits are read
/// as the longest wait there is, negative or unreadable ones are ignored.
#[test]
fn absurd_header_values_never_panic_and_stay_in_range() {
    let huge = [
        "1e20",
        "99999999999999999999",
        "1e308",
        "inf",
        "18446744073709551616",
        "Fri, 31 Dec 9999 23:59:59 GMT",
    ];
    for v in huge {
        let info = RateLimitInfo::from_headers(&headers(&[
            ("retry-after", v),
            ("retry-after-ms", v),
            ("x-ratelimit-reset-requests", v),
            ("x-ratelimit-reset-tokens", &format!("{v}h")),
        ]));
        for d in [info.retry_after, info.reset_requests]
            .into_iter()
            .chain([info.reset_tokens])
            .flatten()
        {
            assert!(d <= MAX_WAIT, "{v}: {d:?}");
        }
        assert!(info.retry_after.is_some() || v.starts_with("inf"), "{v}");
    }
    assert_eq!(parse_reset_duration("99999999999h"), Some(MAX_WAIT));
    assert_eq!(parse_reset_duration("1e400s"), None);
    assert_eq!(parse_reset_duration("NaN"), None);
    let info = RateLimitInfo::from_headers(&headers(&[("retry-after-ms", "-5")]));
    assert_eq!(info.retry_after, None);
}
