//! Bearer tokens of the query API (`/v1/...`).
//!
//! Tokens come from `[http] tokens_file`: one per line, `<token> <scope>`,
//! the scope `admin` (every tenant) or `tenant:<id>` (that tenant only);
//! blank lines and lines starting with `#` are skipped. A token may be kept
//! hashed at rest as `sha256:<64 hex digits>` (its SHA-256, from
//! `sluice token-hash`); only digests are held in memory either way. Without tokens the
//! query API answers 401 to everyone: a tenant's spend is never open.
//! `/healthz`, `/readyz` and `/metrics` stay open (probes and scrapers
//! carry no tokens; keep them on the cluster network, see the chart's
//! NetworkPolicy).

use std::collections::HashMap;
use std::path::Path;

use axum::http::{HeaderMap, StatusCode};
use sha2::{Digest, Sha256};

/// What a token may read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every tenant.
    Admin,
    /// One tenant (normalised id).
    Tenant(String),
}

/// The API's tokens.
#[derive(Debug, Clone, Default)]
pub struct ApiTokens {
    /// Scopes by the SHA-256 of their token.
    by_digest: HashMap<[u8; 32], Scope>,
}

/// The SHA-256 of a token, as `sha256:<hex>` (the hashed form of a tokens
/// file line).
pub fn hashed(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// The digest a `sha256:<hex>` line names.
fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Why a request is not let through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied {
    /// 401 (no or unknown token) or 403 (a token of another tenant).
    pub status: StatusCode,
    /// For the caller.
    pub reason: String,
}

impl ApiTokens {
    /// The tokens of a tokens file's text; an error names the line.
    pub fn parse(text: &str) -> Result<ApiTokens, String> {
        let mut by_digest = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(token), Some(scope), None) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(format!("line {}: expected `<token> <scope>`", i + 1));
            };
            let digest = match token.strip_prefix("sha256:") {
                Some(hex) => parse_digest(hex)
                    .ok_or_else(|| format!("line {}: `sha256:` needs 64 hex digits", i + 1))?,
                None if token.len() < 16 => {
                    return Err(format!(
                        "line {}: a token needs at least 16 characters",
                        i + 1
                    ))
                }
                None => Sha256::digest(token.as_bytes()).into(),
            };
            let scope = match scope.strip_prefix("tenant:") {
                _ if scope == "admin" => Scope::Admin,
                Some(t) if !t.is_empty() => Scope::Tenant(crate::envelope::normalise_tenant(t)),
                _ => {
                    return Err(format!(
                        "line {}: scope must be `admin` or `tenant:<id>`",
                        i + 1
                    ))
                }
            };
            if by_digest.insert(digest, scope).is_some() {
                return Err(format!("line {}: token listed twice", i + 1));
            }
        }
        Ok(ApiTokens { by_digest })
    }

    /// Whether no token is configured (every request is refused).
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// The tokens of the file at `path`.
    pub fn load(path: &Path) -> Result<ApiTokens, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::parse(&text)
    }

    /// Whether the request's bearer token may read `tenant`.
    pub fn authorize(&self, headers: &HeaderMap, tenant: &str) -> Result<(), Denied> {
        match self.scope(headers)? {
            Scope::Admin => Ok(()),
            Scope::Tenant(t) if t == crate::envelope::normalise_tenant(tenant) => Ok(()),
            Scope::Tenant(_) => Err(Denied {
                status: StatusCode::FORBIDDEN,
                reason: "this token reads another tenant".into(),
            }),
        }
    }

    /// The scope of the request's bearer token.
    pub fn scope(&self, headers: &HeaderMap) -> Result<Scope, Denied> {
        let unauthorized = |reason: &str| Denied {
            status: StatusCode::UNAUTHORIZED,
            reason: reason.to_string(),
        };
        if self.by_digest.is_empty() {
            return Err(unauthorized(
                "the query API has no tokens ([http] tokens_file): nobody may read it",
            ));
        }
        let token = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(|| unauthorized("a bearer token is required"))?;
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_digest
            .get(&digest)
            .cloned()
            .ok_or_else(|| unauthorized("unknown token"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            axum::http::header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn admin_reads_all_a_tenant_token_only_its_tenant() {
        let tokens = ApiTokens::parse(
            "# tokens\nadmin-0123456789abcdef admin\nacme-0123456789abcdef tenant:Acme\n",
        )
        .unwrap();
        let status = |h: &HeaderMap, t: &str| tokens.authorize(h, t).err().map(|d| d.status);
        assert_eq!(status(&bearer("admin-0123456789abcdef"), "globex"), None);
        assert_eq!(status(&bearer("acme-0123456789abcdef"), "acme"), None);
        assert_eq!(
            status(&bearer("acme-0123456789abcdef"), "globex"),
            Some(StatusCode::FORBIDDEN)
        );
        assert_eq!(
            status(&bearer("guess-0123456789abcdef"), "acme"),
            Some(StatusCode::UNAUTHORIZED)
        );
        assert_eq!(
            status(&HeaderMap::new(), "acme"),
            Some(StatusCode::UNAUTHORIZED)
        );
        let none = ApiTokens::default();
        assert!(none
            .authorize(&bearer("admin-0123456789abcdef"), "acme")
            .is_err());
    }

    #[test]
    fn a_token_kept_hashed_at_rest_is_the_token() {
        let line = format!("{} tenant:acme\n", hashed("acme-0123456789abcdef"));
        assert!(line.starts_with("sha256:") && !line.contains("0123456789abcdef"));
        let tokens = ApiTokens::parse(&line).unwrap();
        assert_eq!(
            tokens.scope(&bearer("acme-0123456789abcdef")).unwrap(),
            Scope::Tenant("acme".into())
        );
        assert_eq!(
            tokens
                .scope(&bearer(&hashed("acme-0123456789abcdef")))
                .unwrap_err()
                .status,
            StatusCode::UNAUTHORIZED,
            "the digest itself is not a token"
        );
    }

    #[test]
    fn a_bad_tokens_file_names_its_line() {
        for (text, want) in [
            ("short admin", "line 1"),
            ("x-0123456789abcdef reader", "line 1"),
            ("\nx-0123456789abcdef admin extra", "line 2"),
            (
                "x-0123456789abcdef admin\nx-0123456789abcdef tenant:a",
                "line 2",
            ),
            ("sha256:abc admin", "line 1"),
        ] {
            let err = ApiTokens::parse(text).unwrap_err();
            assert!(err.starts_with(want), "{text:?}: {err}");
        }
    }
}
