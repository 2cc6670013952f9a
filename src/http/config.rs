//! `[http]`: the listener's configuration section, and the address checks
//! it shares with the gateway's.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use sluice_topology::runtime::ClaimKey;

use crate::error::ConfigError;
use crate::http::auth::ApiTokens;

/// `[http]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSection {
    /// Address of the metrics/health/query listener (loopback by default;
    /// the Helm chart listens on every interface, behind its NetworkPolicy).
    pub listen: String,
    /// The URL other instances reach this one's listener at (e.g.
    /// `http://sluice-0.sluice-headless:8080`): queries for tenants this
    /// instance holds are forwarded there. The Helm chart sets it per pod
    /// (`SLUICE_HTTP__ADVERTISED_URL`). Default: `http://<listen address>`,
    /// unless that is a wildcard address (`0.0.0.0`, `[::]`); then other
    /// instances cannot forward queries here.
    pub advertised_url: Option<String>,
    /// Bearer tokens of the query API (`/v1/...`): a file of lines
    /// `<token> <scope>`, the scope `admin` (every tenant) or
    /// `tenant:<id>` (that tenant only). Unset: the query API answers 401 to
    /// everyone. `/healthz`, `/readyz` and `/metrics` need no token.
    pub tokens_file: Option<PathBuf>,
    /// A secret the instances share (at least 32 bytes): each signs its
    /// claim on `<app id>-instances` (which partitions it holds, where it
    /// listens) with it, and queries are forwarded only to instances whose
    /// claims it signed. Unset: any claim on that topic is believed, so
    /// only its ACLs keep others from diverting queries and their tokens.
    pub claims_key_file: Option<PathBuf>,
}

impl Default for HttpSection {
    fn default() -> Self {
        HttpSection {
            listen: "127.0.0.1:8080".into(),
            advertised_url: None,
            tokens_file: None,
            claims_key_file: None,
        }
    }
}

impl HttpSection {
    /// The URL this instance advertises once its listener is bound to
    /// `bound` (see [`HttpSection::advertised_url`]).
    pub fn advertised(&self, bound: std::net::SocketAddr) -> Option<String> {
        advertised(self.advertised_url.as_deref(), bound)
    }

    /// The query API's tokens (none without `tokens_file`: the API then
    /// answers 401 to everyone).
    pub fn tokens(&self) -> Result<ApiTokens, ConfigError> {
        match &self.tokens_file {
            None => Ok(Default::default()),
            Some(path) => {
                ApiTokens::load(path).map_err(|e| ConfigError::new("http.tokens_file", e))
            }
        }
    }

    /// The key instance claims are signed with (none without
    /// `claims_key_file`).
    pub fn claims_key(&self) -> Result<Option<ClaimKey>, ConfigError> {
        let Some(path) = &self.claims_key_file else {
            return Ok(None);
        };
        let bytes = std::fs::read(path).map_err(|e| {
            ConfigError::new(
                "http.claims_key_file",
                format!("cannot read {}: {e}", path.display()),
            )
        })?;
        ClaimKey::new(&bytes)
            .map(Some)
            .map_err(|e| ConfigError::new("http.claims_key_file", e))
    }

    /// Checks of the section's own keys (the files it names are read).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.tokens()?;
        self.claims_key()?;
        check_listen_and_url("http", &self.listen, self.advertised_url.as_deref())
    }
}

/// The URL an instance advertises: `configured`, else `http://<bound>`
/// unless that is a wildcard address.
pub(crate) fn advertised(configured: Option<&str>, bound: std::net::SocketAddr) -> Option<String> {
    match configured {
        Some(url) => Some(url.trim_end_matches('/').to_string()),
        None if bound.ip().is_unspecified() => None,
        None => Some(format!("http://{bound}")),
    }
}

/// Checks a section's `listen` address and `advertised_url`.
pub(crate) fn check_listen_and_url(
    section: &str,
    listen: &str,
    url: Option<&str>,
) -> Result<(), ConfigError> {
    if listen.parse::<std::net::SocketAddr>().is_err() {
        return Err(ConfigError::new(
            format!("{section}.listen"),
            "must be an address like 127.0.0.1:8080",
        ));
    }
    if let Some(url) = url {
        let ok = reqwest::Url::parse(url).is_ok_and(|u| {
            matches!(u.scheme(), "http" | "https")
                && u.host().is_some()
                && u.query().is_none()
                && u.fragment().is_none()
        });
        if !ok {
            return Err(ConfigError::new(
                format!("{section}.advertised_url"),
                "must be an http(s) URL like http://sluice-0.sluice:8080",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::tests_support::load;
    use crate::config::MINIMAL;

    #[test]
    fn a_claims_key_file_must_be_readable_and_long_enough() {
        let dir = tempfile::tempdir().unwrap();
        let with = |path: &std::path::Path| {
            load(
                MINIMAL,
                &[("SLUICE_HTTP__CLAIMS_KEY_FILE", path.to_str().unwrap())],
            )
        };
        let short = dir.path().join("short");
        std::fs::write(&short, "only sixteen byt\n").unwrap();
        let e = with(&short).unwrap_err();
        assert_eq!(e.key, "http.claims_key_file");
        assert!(e.message.contains("at least 32"), "{}", e.message);
        let e = with(&dir.path().join("missing")).unwrap_err();
        assert_eq!(e.key, "http.claims_key_file");
        let good = dir.path().join("key");
        std::fs::write(&good, "0123456789abcdef0123456789abcdef\n").unwrap();
        let c = with(&good).unwrap();
        assert!(c.http.claims_key().unwrap().is_some());
        assert!(load(MINIMAL, &[])
            .unwrap()
            .http
            .claims_key()
            .unwrap()
            .is_none());
    }

    #[test]
    fn the_advertised_url_is_an_http_url_or_follows_the_listener() {
        let bound: std::net::SocketAddr = "127.0.0.1:4321".parse().unwrap();
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.http.advertised_url, None);
        assert_eq!(
            c.http.advertised(bound).as_deref(),
            Some("http://127.0.0.1:4321")
        );
        assert_eq!(c.http.advertised("0.0.0.0:8080".parse().unwrap()), None);
        let c = load(
            MINIMAL,
            &[(
                "SLUICE_HTTP__ADVERTISED_URL",
                "http://sluice-0.sluice-headless.ns.svc.cluster.local:8080/",
            )],
        )
        .unwrap();
        assert_eq!(
            c.http.advertised(bound).as_deref(),
            Some("http://sluice-0.sluice-headless.ns.svc.cluster.local:8080")
        );
        for bad in ["sluice-0:8080", "ftp://x", "http://x/?a=1", "not a url"] {
            let err = load(MINIMAL, &[("SLUICE_HTTP__ADVERTISED_URL", bad)]).unwrap_err();
            assert_eq!(err.key, "http.advertised_url", "{bad}: {err}");
        }
    }
}
