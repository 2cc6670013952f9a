//! `[gateway]`: the gateway's configuration section and its checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;
use crate::http::config::{advertised, check_listen_and_url};

/// `[gateway]`: the HTTP task gateway, `sluice gateway` (see
/// `src/cli/gateway`). It reads the same file as `sluice run` (topics, tasks,
/// tokens, quotas) and runs as its own stream application,
/// `<app id>-gateway`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewaySection {
    /// Address of the gateway's listener.
    pub listen: String,
    /// The URL other gateway instances reach this one at (status reads are
    /// forwarded to the instance holding the task's tenant). Default:
    /// `http://<listen address>` unless that is a wildcard address.
    pub advertised_url: Option<String>,
    /// Directory of the gateway's state (its task status store). Default:
    /// `<app.state_dir>/gateway`.
    pub state_dir: Option<PathBuf>,
    /// Largest request body, bytes (a larger one: 413).
    pub max_body_bytes: usize,
    /// Most tasks in one `POST /v1/tasks:batch`.
    pub max_batch: usize,
    /// A tenant with this many tasks accepted and not yet answered gets 429
    /// for new ones (0: no bound).
    pub max_backlog_per_tenant: u64,
    /// Period of the keep-alive comments of an event stream, ms.
    pub keepalive_ms: u64,
    /// Longest `wait` of a status read (long polling), ms.
    pub max_wait_ms: u64,
    /// How long a task's status is kept after its last change, hours.
    pub status_ttl_hours: u64,
    /// How long the status table's fetches may wait at the broker for
    /// 64 KiB of records, ms (0: every fetch answered as soon as any
    /// record is there). Every accepted task is read back; answering a
    /// fetch per few records costs the broker more than the records do.
    pub fetch_wait_ms: u64,
}

impl Default for GatewaySection {
    fn default() -> Self {
        GatewaySection {
            listen: "127.0.0.1:8090".into(),
            advertised_url: None,
            state_dir: None,
            max_body_bytes: 1024 * 1024,
            max_batch: 100,
            max_backlog_per_tenant: 10_000,
            keepalive_ms: 15_000,
            max_wait_ms: 30_000,
            status_ttl_hours: 7 * 24,
            fetch_wait_ms: 10,
        }
    }
}

impl GatewaySection {
    /// The URL this gateway advertises once bound to `bound`.
    pub fn advertised(&self, bound: std::net::SocketAddr) -> Option<String> {
        advertised(self.advertised_url.as_deref(), bound)
    }

    /// Checks of the section's own keys.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_listen_and_url("gateway", &self.listen, self.advertised_url.as_deref())?;
        for (key, value) in [
            ("gateway.max_body_bytes", self.max_body_bytes as u64),
            ("gateway.max_batch", self.max_batch as u64),
            ("gateway.keepalive_ms", self.keepalive_ms),
            ("gateway.max_wait_ms", self.max_wait_ms),
            ("gateway.status_ttl_hours", self.status_ttl_hours),
        ] {
            if value == 0 {
                return Err(ConfigError::new(key, "must be at least 1"));
            }
        }
        if self.fetch_wait_ms > GATEWAY_FETCH_WAIT_MAX_MS {
            return Err(ConfigError::new(
                "gateway.fetch_wait_ms",
                format!(
                    "must be at most {GATEWAY_FETCH_WAIT_MAX_MS} (a result reaches its readers \
                     up to this much later)"
                ),
            ));
        }
        Ok(())
    }
}

/// The longest `[gateway] fetch_wait_ms`.
const GATEWAY_FETCH_WAIT_MAX_MS: u64 = 1000;

#[cfg(test)]
mod tests {
    use crate::config::tests_support::load;
    use crate::config::MINIMAL;

    #[test]
    fn the_gateway_fetch_wait_is_bounded_and_names_its_key() {
        assert_eq!(load(MINIMAL, &[]).unwrap().gateway.fetch_wait_ms, 10);
        for (value, ok) in [("0", true), ("1000", true), ("1001", false)] {
            let text = format!("{MINIMAL}\n[gateway]\nfetch_wait_ms = {value}\n");
            match load(&text, &[]) {
                Ok(c) => {
                    assert!(ok, "{value} accepted");
                    assert_eq!(c.gateway.fetch_wait_ms.to_string(), value);
                }
                Err(e) => {
                    assert!(!ok, "{value}: {e}");
                    assert_eq!(e.key, "gateway.fetch_wait_ms");
                }
            }
        }
    }
}
