//! Tenant usage queries: `GET /v1/tenants/{id}/usage` and `sluice usage`.
//!
//! A tenant's accounts live in the task that owns its partition of the task
//! topics (tasks are keyed by tenant), so exactly one instance holds them.
//! Any instance answers: from its own state when it holds the tenant,
//! otherwise by forwarding the request to the instance that does (found
//! through the engine's instance metadata), once (see
//! [`crate::http::forward`]).

use std::time::Duration;

use axum::http::HeaderMap;
use serde::{Deserialize, Serialize};
use sluice_topology::runtime::{Queries, QueryError, WindowRange};

use crate::http::forward::{self, Forwarder, Holder};
pub use crate::steps::account::WindowUsage;
use crate::steps::account::{Accounting, TenantUsage, WindowSpec};

/// How long a forwarded request may take.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

/// A tenant's current windows, as `GET /v1/tenants/{id}/usage` answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TenantUsageReport {
    /// The tenant.
    pub tenant_id: String,
    /// The instance that read the accounts (its advertised URL).
    pub served_by: String,
    /// One entry per configured window size, in configuration order: the
    /// window containing the time of the query.
    pub windows: Vec<WindowUsage>,
}

/// Where a tenant's usage is.
#[derive(Debug)]
pub enum Lookup {
    /// Held here: the report.
    Local(TenantUsageReport),
    /// Held by the instance at this URL.
    Remote(String),
    /// Not answerable now (restoring, the holder not known yet, or a
    /// forwarded query that reached an instance not holding the tenant).
    Unavailable(String),
    /// Held here, and no window of the tenant is kept: not a tenant this
    /// partition has seen (a billing page must not show it $0). The reason
    /// names the partition, for a partitioner that is not the producers'.
    Unknown(String),
}

/// Why a usage query failed for good.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    /// The `window` asked for is not a configured window size.
    #[error("unknown window {0}")]
    UnknownWindow(String),
    /// Reading the state failed.
    #[error(transparent)]
    Query(#[from] QueryError),
}

/// Answers usage queries on one instance.
#[derive(Clone)]
pub struct UsageQueries {
    queries: Queries,
    accounting: Accounting,
    served_by: String,
    forwarder: Forwarder,
}

impl UsageQueries {
    /// Queries of `accounting`'s windows through the engine's `queries`;
    /// `served_by` names this instance in reports.
    pub fn new(queries: Queries, accounting: Accounting, served_by: String) -> Self {
        UsageQueries {
            queries,
            accounting,
            served_by,
            forwarder: Forwarder::default(),
        }
    }

    /// Finds `tenant`'s windows containing `now_ms` (only the one named
    /// `window`, when given); a `forwarded` query is never sent on.
    pub fn lookup(
        &self,
        tenant: &str,
        window: Option<&str>,
        now_ms: i64,
        forwarded: bool,
    ) -> Result<Lookup, UsageError> {
        let windows: Vec<&WindowSpec> = self
            .accounting
            .windows()
            .iter()
            .filter(|w| window.is_none_or(|name| w.name == name))
            .collect();
        if windows.is_empty() {
            return Err(UsageError::UnknownWindow(window.unwrap_or_default().into()));
        }
        let names: Vec<String> = windows
            .iter()
            .map(|w| self.accounting.store_name(w))
            .collect();
        // Tasks are keyed by tenant id: its bytes chose the partition.
        let partition =
            match forward::holder(&self.queries, &names[0], tenant.as_bytes(), forwarded)? {
                Holder::Local(p) => p,
                Holder::Remote(host) => return Ok(Lookup::Remote(host)),
                Holder::Unavailable(reason) => return Ok(Lookup::Unavailable(reason)),
            };
        let starts: Vec<i64> = windows.iter().map(|w| w.start_of(now_ms)).collect();
        let ranges: Vec<WindowRange<'_>> = names
            .iter()
            .zip(&starts)
            .map(|(store, start)| WindowRange {
                store,
                from_ms: *start,
                to_ms: start + 1,
            })
            .collect();
        let found = match self.queries.fetch_windows::<String, TenantUsage>(
            partition,
            &tenant.to_string(),
            &ranges,
        ) {
            Ok(found) => found,
            Err(e) if e.unavailable() => return Ok(Lookup::Unavailable(e.to_string())),
            Err(e) => return Err(e.into()),
        };
        if found.iter().all(Vec::is_empty) && !self.seen(partition, tenant, &names, now_ms)? {
            return Ok(Lookup::Unknown(format!(
                "unknown_tenant: partition {} holds no usage of {tenant} in any kept window \
                 (is [tasks] partitioner the one the producers use?)",
                partition
            )));
        }
        let windows = windows
            .iter()
            .zip(starts)
            .zip(found)
            .map(|((w, start), mut usage)| {
                let usage = usage.pop().map(|(_, u)| u).unwrap_or_default();
                WindowUsage::new(w, start, usage)
            })
            .collect();
        Ok(Lookup::Local(TenantUsageReport {
            tenant_id: tenant.to_string(),
            served_by: self.served_by.clone(),
            windows,
        }))
    }

    /// Whether the local task of `partition` keeps any window of `tenant`
    /// in `stores` (up to `now_ms`).
    fn seen(
        &self,
        partition: i32,
        tenant: &str,
        stores: &[String],
        now_ms: i64,
    ) -> Result<bool, UsageError> {
        let ranges: Vec<WindowRange<'_>> = stores
            .iter()
            .map(|store| WindowRange {
                store,
                from_ms: i64::MIN,
                to_ms: now_ms.saturating_add(1),
            })
            .collect();
        match self.queries.fetch_windows::<String, TenantUsage>(
            partition,
            &tenant.to_string(),
            &ranges,
        ) {
            Ok(found) => Ok(found.iter().any(|w| !w.is_empty())),
            // Not provable now: answer with what the current windows say.
            Err(e) if e.unavailable() => Ok(true),
            Err(e) => Err(e.into()),
        }
    }

    /// Asks the instance at `host`, passing the `caller`'s token on (the
    /// holder checks it too): its status and body, or why it could not be
    /// asked.
    pub async fn forward(
        &self,
        host: &str,
        tenant: &str,
        window: Option<&str>,
        caller: &HeaderMap,
    ) -> Result<(u16, bytes::Bytes), String> {
        let url = usage_url(host, tenant, window)?;
        let req = self
            .forwarder
            .request(reqwest::Method::GET, url, caller, FORWARD_TIMEOUT);
        let resp = self.forwarder.send(host, req).await?;
        let status = resp.status().as_u16();
        let body = resp
            .bytes()
            .await
            .map_err(|e| format!("{host} did not answer: {e}"))?;
        Ok((status, body))
    }
}

/// The usage URL of `tenant` on the instance at `base`.
pub fn usage_url(base: &str, tenant: &str, window: Option<&str>) -> Result<reqwest::Url, String> {
    let query: &[(&str, &str)] = match window {
        Some(w) => &[("window", w)],
        None => &[],
    };
    forward::url(base, &["v1", "tenants", tenant, "usage"], query)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_keep_a_base_path_and_encode_the_tenant() {
        let u = usage_url("http://sluice-0.svc:8080", "acme", None).unwrap();
        assert_eq!(u.as_str(), "http://sluice-0.svc:8080/v1/tenants/acme/usage");
        let u = usage_url("https://gw/sluice/", "a b/c", Some("1h")).unwrap();
        assert_eq!(
            u.as_str(),
            "https://gw/sluice/v1/tenants/a%20b%2Fc/usage?window=1h"
        );
        assert!(usage_url("localhost:8080", "a", None).is_err());
    }
}
