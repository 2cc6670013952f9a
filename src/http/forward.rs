//! Answering for state another instance holds, shared by usage queries and
//! the gateway's task statuses: where the partition of a key is held, and
//! asking that instance, once.
//!
//! A forwarded request carries [`FORWARDED_HEADER`] and is never forwarded
//! again, so two instances that disagree for a moment (during a rebalance)
//! answer 503 instead of bouncing a request between them. It carries the
//! caller's token too: the holder checks it again.

use std::time::Duration;

use axum::http::HeaderMap;
use serde::{Deserialize, Serialize};
use sluice_topology::runtime::{Queries, QueryError};

/// Marks a request one instance forwarded to another.
pub const FORWARDED_HEADER: &str = "x-sluice-forwarded";

/// The body of an answer that is not a report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, for people.
    pub reason: String,
}

/// Where the partition of a key is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// Here, in this partition.
    Local(i32),
    /// By the instance at this URL.
    Remote(String),
    /// Not answerable now (restoring here, the holder not known yet, or a
    /// forwarded request that reached an instance not holding it): why.
    Unavailable(String),
}

/// Where the partition of `key` in `store` is held, as this instance knows;
/// a `forwarded` request is never sent on.
pub fn holder(
    queries: &Queries,
    store: &str,
    key: &[u8],
    forwarded: bool,
) -> Result<Holder, QueryError> {
    let md = queries.metadata_for_key(store, key)?;
    if md.local {
        return Ok(Holder::Local(md.partition));
    }
    let own = queries.application_server();
    Ok(match md.host {
        _ if md.restoring => Holder::Unavailable(format!(
            "partition {} is restoring on this instance",
            md.partition
        )),
        Some(host) if Some(host.as_str()) != own && !forwarded => Holder::Remote(host),
        Some(host) if Some(host.as_str()) != own => Holder::Unavailable(format!(
            "forwarded here, but this instance does not hold partition {} ({host} does, as far \
             as it knows)",
            md.partition
        )),
        _ => Holder::Unavailable(format!(
            "no instance is known to hold partition {} yet",
            md.partition
        )),
    })
}

/// Whether a request came from another instance.
pub fn is_forwarded(headers: &HeaderMap) -> bool {
    headers.contains_key(FORWARDED_HEADER)
}

/// Whether `s` survives as a path segment of a URL as written (see [`url`]).
pub fn is_segment(s: &str) -> bool {
    !matches!(s, "." | "..") && !s.contains(['\t', '\n', '\r'])
}

/// The URL of `segments` (each one percent-encoded as a path segment) below
/// `base`, with the `query` pairs. A segment the URL standard would not
/// keep as written (`.` and `..` are dot segments; tabs and line breaks are
/// dropped) is refused: the URL would name something else.
pub fn url(base: &str, segments: &[&str], query: &[(&str, &str)]) -> Result<reqwest::Url, String> {
    if let Some(bad) = segments.iter().find(|s| !is_segment(s)) {
        return Err(format!("{bad:?} cannot be a path segment"));
    }
    let mut url = reqwest::Url::parse(base).map_err(|e| format!("{base}: {e}"))?;
    url.path_segments_mut()
        .map_err(|()| format!("{base}: not a base URL"))?
        .pop_if_empty()
        .extend(segments);
    if !query.is_empty() {
        url.query_pairs_mut().extend_pairs(query);
    }
    Ok(url)
}

/// Asks other instances. Never redirected (a holder's answer is relayed,
/// not another server's), never through a proxy from the environment.
#[derive(Clone)]
pub struct Forwarder {
    client: reqwest::Client,
}

impl Default for Forwarder {
    fn default() -> Self {
        Forwarder {
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .no_proxy()
                .build()
                .unwrap_or_default(),
        }
    }
}

impl Forwarder {
    /// A request to another instance, marked forwarded, carrying the
    /// caller's `Authorization`.
    pub fn request(
        &self,
        method: reqwest::Method,
        url: reqwest::Url,
        caller: &HeaderMap,
        timeout: Duration,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .request(method, url)
            .timeout(timeout)
            .header(FORWARDED_HEADER, "1");
        if let Some(auth) = caller.get(axum::http::header::AUTHORIZATION) {
            req = req.header(axum::http::header::AUTHORIZATION, auth.as_bytes());
        }
        req
    }

    /// Sends `req` to the instance at `host`: its answer, or why there was
    /// none (a redirect counts as none).
    pub async fn send(
        &self,
        host: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, String> {
        let resp = req
            .send()
            .await
            .map_err(|e| format!("{host} did not answer: {e}"))?;
        if resp.status().is_redirection() {
            return Err(format!("{host} answered with a redirect; not followed"));
        }
        Ok(resp)
    }
}

/// The reason an error answer of `host` gives (its `{"reason": …}` body),
/// else its status.
pub async fn reason_of(host: &str, resp: reqwest::Response) -> String {
    let code = resp.status();
    resp.json::<ErrorBody>()
        .await
        .map(|b| b.reason)
        .unwrap_or_else(|_| format!("{host} answered {code}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_and_query_are_encoded_below_the_base() {
        let u = url(
            "http://h:8080/",
            &["v1", "tasks", "a b/c?d#e"],
            &[("tenant", "t&x=1"), ("wait", "5ms")],
        )
        .unwrap();
        assert_eq!(
            u.as_str(),
            "http://h:8080/v1/tasks/a%20b%2Fc%3Fd%23e?tenant=t%26x%3D1&wait=5ms"
        );
        let u = url("http://h/base", &["v1", "tasks:accepted"], &[]).unwrap();
        assert_eq!(u.as_str(), "http://h/base/v1/tasks:accepted");
        assert!(url("not a url", &["v1"], &[]).is_err());
        // Segments the URL would drop or change are refused.
        for bad in [".", "..", "ac\nme", "a\tb", "x\r"] {
            assert!(url("http://h/", &["v1", bad], &[]).is_err(), "{bad:?}");
        }
        assert!(url("http://h/", &["v1", "...", ".a", "a."], &[]).is_ok());
    }
}
