//! Values that may be credentials, kept out of `Debug` output: [`Properties`]
//! (librdkafka client properties, HTTP headers, query parameters) and
//! [`SecretUrl`] (a URL that may carry a password).

use std::collections::BTreeMap;
use std::fmt;
use std::ops::{Deref, DerefMut};

/// Whether a property, header or parameter of this name may hold a
/// credential (`sasl.password`, `ssl.key.pem`, `Authorization`, `api-key`,
/// `sasl.oauthbearer.client.secret`, ...). Errs on the side of hiding.
pub fn is_sensitive(name: &str) -> bool {
    const PARTS: [&str; 10] = [
        "password",
        "secret",
        "token",
        "key",
        "auth",
        "bearer",
        "credential",
        "cookie",
        "signature",
        "jaas",
    ];
    let name = name.to_ascii_lowercase();
    PARTS.iter().any(|p| name.contains(p))
}

/// String values by name whose values may be credentials. `Debug` shows
/// every name, and the value of each name that names nothing secret (see
/// [`is_sensitive`]); the others print `***`. Otherwise a `BTreeMap`: it
/// derefs to one and is (de)serialised as one.
#[derive(Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Properties(BTreeMap<String, String>);

impl Properties {
    /// No properties.
    pub fn new() -> Self {
        Properties::default()
    }

    /// The map.
    pub fn into_inner(self) -> BTreeMap<String, String> {
        self.0
    }
}

impl fmt::Debug for Properties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(k, v)| {
                let shown: &dyn fmt::Debug = if is_sensitive(k) { &Hidden } else { v };
                (k, shown)
            }))
            .finish()
    }
}

/// Prints `***`.
struct Hidden;

impl fmt::Debug for Hidden {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl Deref for Properties {
    type Target = BTreeMap<String, String>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl DerefMut for Properties {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl From<BTreeMap<String, String>> for Properties {
    fn from(map: BTreeMap<String, String>) -> Self {
        Properties(map)
    }
}

impl FromIterator<(String, String)> for Properties {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Self {
        Properties(iter.into_iter().collect())
    }
}

impl<'a> IntoIterator for &'a Properties {
    type Item = (&'a String, &'a String);
    type IntoIter = std::collections::btree_map::Iter<'a, String, String>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// A URL that may carry a user and password (`http://user:pass@proxy:3128`).
/// `Debug` prints it with the password as `***` (all of it as `***` when it
/// does not parse); serialised as the string.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// Wraps a URL.
    pub fn new(url: impl Into<String>) -> Self {
        SecretUrl(url.into())
    }

    /// The URL itself; call only where it is used, never where it is logged.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // scheme://[user[:password]@]host...: hide what follows the user.
        let Some((scheme, rest)) = self.0.split_once("://") else {
            return f.write_str("\"***\"");
        };
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        match rest[..authority_end].rfind('@') {
            Some(at) => {
                let user = rest[..at].split(':').next().unwrap_or("");
                write!(f, "\"{scheme}://{user}:***@{}\"", &rest[at + 1..])
            }
            None => write!(f, "{:?}", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_names_and_harmless_values_only() {
        let p: Properties = [
            ("security.protocol", "sasl_ssl"),
            ("sasl.username", "svc"),
            ("sasl.password", "pw-1"),
            ("ssl.key.password", "pw-2"),
            ("ssl.key.pem", "-----BEGIN PRIVATE KEY-----pw-3"),
            ("sasl.oauthbearer.client.secret", "pw-4"),
            ("sasl.oauthbearer.config", "principal=x secret=pw-5"),
            ("Authorization", "Bearer pw-6"),
            ("api-key", "pw-7"),
            ("X-Goog-Api-Key", "pw-8"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        for shown in [format!("{p:?}"), format!("{p:#?}")] {
            for i in 1..=8 {
                assert!(!shown.contains(&format!("pw-{i}")), "{shown}");
            }
            assert!(
                shown.contains("sasl_ssl") && shown.contains("\"svc\""),
                "{shown}"
            );
            assert!(shown.contains("sasl.password"), "{shown}");
        }
        assert_eq!(p["sasl.password"], "pw-1", "the value itself is kept");
    }

    #[test]
    fn a_urls_password_is_hidden() {
        let shown = |u: &str| format!("{:?}", SecretUrl::new(u));
        assert_eq!(
            shown("http://user:pw@proxy:3128/x"),
            "\"http://user:***@proxy:3128/x\""
        );
        assert_eq!(shown("http://us:er:p@w@proxy"), "\"http://us:***@proxy\"");
        assert_eq!(shown("http://proxy:3128"), "\"http://proxy:3128\"");
        assert_eq!(shown("not a url pw"), "\"***\"");
        assert_eq!(SecretUrl::new("http://u:pw@h").expose(), "http://u:pw@h");
    }
}
