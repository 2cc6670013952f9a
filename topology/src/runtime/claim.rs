//! Instance claims: what one instance holds (an [`InstanceClaim`], signed
//! with a [`ClaimKey`] when the instances share one), which claim holds a
//! partition, and the [`Directory`] of every instance's newest claim.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use hmac::{Hmac, Mac};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// What one instance holds, as published on the instances topic.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceClaim {
    /// The instance's `application_server`.
    pub server: String,
    /// Source partitions of the tasks assigned to it (restoring or
    /// running), by topic.
    pub partitions: BTreeMap<String, Vec<i32>>,
    /// When it was assigned these partitions (ms since the epoch, its clock).
    pub assigned_ms: i64,
    /// When it wrote this claim (ms since the epoch, its clock).
    pub updated_ms: i64,
    /// HMAC-SHA256 of the claim without this field, hex, under the
    /// instances' [`ClaimKey`] (absent when they have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

/// The secret instances of one application sign their claims with (at
/// least 32 bytes). Never printed.
#[derive(Clone)]
pub struct ClaimKey(Arc<[u8]>);

impl std::fmt::Debug for ClaimKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClaimKey(<redacted>)")
    }
}

impl ClaimKey {
    /// The shortest key accepted, bytes.
    pub const MIN_LEN: usize = 32;

    /// A key from its bytes (surrounding white space, as a file's final
    /// newline, is not part of it).
    pub fn new(bytes: &[u8]) -> Result<Self, String> {
        let key = bytes.trim_ascii();
        if key.len() < Self::MIN_LEN {
            return Err(format!(
                "the claims key has {} bytes; at least {} are needed",
                key.len(),
                Self::MIN_LEN
            ));
        }
        Ok(ClaimKey(key.into()))
    }

    fn mac(&self, claim: &InstanceClaim) -> Option<Hmac<Sha256>> {
        let unsigned = InstanceClaim {
            signature: None,
            ..claim.clone()
        };
        let bytes = serde_json::to_vec(&unsigned).ok()?;
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).ok()?;
        mac.update(&bytes);
        Some(mac)
    }

    /// `claim` signed.
    pub fn sign(&self, claim: InstanceClaim) -> InstanceClaim {
        let signature = self.mac(&claim).map(|m| {
            m.finalize()
                .into_bytes()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        });
        InstanceClaim { signature, ..claim }
    }

    /// Whether `claim` carries a valid signature (compared in constant time).
    pub fn verify(&self, claim: &InstanceClaim) -> bool {
        let Some(sig) = claim.signature.as_deref().and_then(from_hex) else {
            return false;
        };
        self.mac(claim)
            .is_some_and(|m| m.verify_slice(&sig).is_ok())
    }
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Whether a claim written at `updated_ms` counts at `now_ms`: renewed
/// within `timeout_ms`, and not written further ahead of this clock.
fn is_fresh(updated_ms: i64, now_ms: i64, timeout_ms: i64) -> bool {
    (now_ms - updated_ms).abs() <= timeout_ms
}

impl InstanceClaim {
    fn holds(&self, topics: &[String], partition: i32) -> bool {
        topics.iter().any(|t| {
            self.partitions
                .get(t)
                .is_some_and(|ps| ps.contains(&partition))
        })
    }
}

/// The claim that holds `partition` of any of `topics` at `now_ms`: among
/// claims renewed within `timeout_ms` and not by `except`, the newest
/// assignment (then the newest renewal, then the server name, so every
/// instance picks the same one).
pub(crate) fn resolve_owner<'a>(
    claims: impl IntoIterator<Item = &'a InstanceClaim>,
    topics: &[String],
    partition: i32,
    now_ms: i64,
    timeout_ms: i64,
    except: Option<&str>,
) -> Option<&'a InstanceClaim> {
    claims
        .into_iter()
        .filter(|c| is_fresh(c.updated_ms, now_ms, timeout_ms))
        .filter(|c| except != Some(c.server.as_str()))
        .filter(|c| c.holds(topics, partition))
        .max_by(|a, b| {
            (a.assigned_ms, a.updated_ms, &a.server).cmp(&(b.assigned_ms, b.updated_ms, &b.server))
        })
}

/// Every instance's newest claim, as read from the instances topic.
#[derive(Debug, Default)]
pub(crate) struct Directory {
    claims: RwLock<HashMap<String, InstanceClaim>>,
    /// With a key, only claims it signed count.
    key: Option<ClaimKey>,
    /// Servers whose unsigned or forged claims were logged.
    refused: Mutex<BTreeSet<String>>,
}

impl Directory {
    /// A directory trusting the claims `key` signed (any claim without one).
    pub(crate) fn new(key: Option<ClaimKey>) -> Self {
        Directory {
            key,
            ..Default::default()
        }
    }

    /// Applies one record of the instances topic: a claim replaces the
    /// server's previous one, a tombstone removes it. Records that do not
    /// parse, and with a key claims it did not sign, are ignored (logged
    /// once per server); so are tombstones, with a key (a forged one could
    /// otherwise hide an instance; its claim expires by itself).
    pub(crate) fn apply(&self, key: Option<&[u8]>, value: Option<&[u8]>) {
        let Some(server) = key.and_then(|k| std::str::from_utf8(k).ok()) else {
            return;
        };
        let Some(value) = value else {
            if self.key.is_none() {
                self.claims.write().remove(server);
            }
            return;
        };
        match serde_json::from_slice::<InstanceClaim>(value) {
            Ok(claim) if self.key.as_ref().is_some_and(|k| !k.verify(&claim)) => {
                if self.refused.lock().insert(server.to_string()) {
                    tracing::warn!(
                        server,
                        "instance claim without a valid signature (forged, or an instance \
                         with another claims key); ignored"
                    );
                }
            }
            Ok(claim) if claim.server == server => {
                self.claims.write().insert(server.to_string(), claim);
            }
            Ok(_) => tracing::warn!(server, "instance claim names another server; ignored"),
            Err(e) => tracing::warn!(server, error = %e, "unreadable instance claim; ignored"),
        }
    }

    /// The server of the instance holding `partition` of `topics` (see
    /// [`resolve_owner`]).
    pub(crate) fn owner(
        &self,
        topics: &[String],
        partition: i32,
        now_ms: i64,
        timeout_ms: i64,
        except: Option<&str>,
    ) -> Option<String> {
        let claims = self.claims.read();
        resolve_owner(
            claims.values(),
            topics,
            partition,
            now_ms,
            timeout_ms,
            except,
        )
        .map(|c| c.server.clone())
    }

    /// The claims renewed within `timeout_ms`, by server.
    pub(crate) fn fresh(&self, now_ms: i64, timeout_ms: i64) -> Vec<InstanceClaim> {
        let mut out: Vec<InstanceClaim> = self
            .claims
            .read()
            .values()
            .filter(|c| is_fresh(c.updated_ms, now_ms, timeout_ms))
            .cloned()
            .collect();
        out.sort_by(|a, b| a.server.cmp(&b.server));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(
        server: &str,
        parts: &[(&str, &[i32])],
        assigned_ms: i64,
        updated_ms: i64,
    ) -> InstanceClaim {
        InstanceClaim {
            server: server.into(),
            partitions: parts
                .iter()
                .map(|(t, ps)| (t.to_string(), ps.to_vec()))
                .collect(),
            assigned_ms,
            updated_ms,
            signature: None,
        }
    }

    fn topics(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_newest_fresh_assignment_holds_a_partition() {
        let a = claim("http://a", &[("in", &[0, 1])], 1_000, 20_000);
        let b = claim("http://b", &[("in", &[1])], 5_000, 19_000);
        let all = [a.clone(), b.clone()];
        let owner = |p, now, except| {
            resolve_owner(&all, &topics(&["in"]), p, now, 10_000, except).map(|c| c.server.clone())
        };
        assert_eq!(owner(0, 21_000, None).as_deref(), Some("http://a"));
        // Both claim 1 (a rebalance moved it to b): the newer assignment wins.
        assert_eq!(owner(1, 21_000, None).as_deref(), Some("http://b"));
        // Another topic of the sub-topology names the partition as well.
        assert_eq!(
            resolve_owner(&all, &topics(&["other", "in"]), 0, 21_000, 10_000, None)
                .map(|c| c.server.as_str()),
            Some("http://a")
        );
        assert_eq!(owner(2, 21_000, None), None, "nobody claims partition 2");
        // The asking instance knows its own partitions better than its claim.
        assert_eq!(
            owner(1, 21_000, Some("http://b")).as_deref(),
            Some("http://a")
        );
    }

    #[test]
    fn a_claim_not_renewed_in_time_is_gone() {
        let a = claim("http://a", &[("in", &[0])], 1_000, 20_000);
        let b = claim("http://b", &[("in", &[0])], 5_000, 9_000);
        let all = [a, b];
        let owner = |now| {
            resolve_owner(&all, &topics(&["in"]), 0, now, 10_000, None).map(|c| c.server.clone())
        };
        // b's newer assignment wins while its claim is fresh ...
        assert_eq!(owner(19_000).as_deref(), Some("http://b"));
        // ... and counts as gone once it is older than the timeout.
        assert_eq!(owner(19_001).as_deref(), Some("http://a"));
        assert_eq!(owner(30_001), None);
    }

    #[test]
    fn a_claim_from_the_future_is_not_fresh_for_ever() {
        // Written an hour ahead of this clock: without the bound it would
        // win every partition until then.
        let forged = claim("http://evil", &[("in", &[0])], i64::MAX / 2, 3_620_000);
        let a = claim("http://a", &[("in", &[0])], 1_000, 19_000);
        let all = [forged, a];
        let owner = |now| {
            resolve_owner(&all, &topics(&["in"]), 0, now, 10_000, None).map(|c| c.server.clone())
        };
        assert_eq!(owner(20_000).as_deref(), Some("http://a"));
        // A claim a little ahead (clocks differ) still counts.
        let ahead = [claim("http://b", &[("in", &[0])], 1_000, 25_000)];
        assert!(resolve_owner(&ahead, &topics(&["in"]), 0, 20_000, 10_000, None).is_some());
    }

    #[test]
    fn with_a_key_only_the_claims_it_signed_count() {
        let key = ClaimKey::new(b"0123456789abcdef0123456789abcdef\n").unwrap();
        let other = ClaimKey::new(b"another key of at least 32 bytes, as well").unwrap();
        assert!(ClaimKey::new(b"too short").is_err());
        assert!(!format!("{key:?}").contains("0123"), "never printed");
        let d = Directory::new(Some(key.clone()));
        let t = topics(&["in"]);
        let json = |c: &InstanceClaim| serde_json::to_vec(c).unwrap();
        let genuine = key.sign(claim("http://a", &[("in", &[0])], 1, 10));
        assert!(key.verify(&genuine));
        d.apply(Some(b"http://a"), Some(&json(&genuine)));
        assert_eq!(d.owner(&t, 0, 10, 100, None).as_deref(), Some("http://a"));
        // Unsigned, signed with another key, or altered after signing: a
        // newer assignment of the partition, ignored all the same.
        let unsigned = claim("http://evil", &[("in", &[0])], 5, 10);
        let wrong = other.sign(claim("http://evil2", &[("in", &[0])], 5, 10));
        let mut altered = key.sign(claim("http://evil3", &[("in", &[1])], 5, 10));
        altered.partitions.insert("in".into(), vec![0]);
        let mut garbled = key.sign(claim("http://evil4", &[("in", &[0])], 5, 10));
        garbled.signature = Some("zz".into());
        for c in [&unsigned, &wrong, &altered, &garbled] {
            assert!(!key.verify(c), "{c:?}");
            d.apply(Some(c.server.as_bytes()), Some(&json(c)));
        }
        assert_eq!(d.owner(&t, 0, 10, 100, None).as_deref(), Some("http://a"));
        assert_eq!(d.fresh(10, 100).len(), 1);
        // A tombstone anyone could write hides nothing; a signed claim of
        // nothing (a clean stop) does.
        d.apply(Some(b"http://a"), None);
        assert_eq!(d.owner(&t, 0, 10, 100, None).as_deref(), Some("http://a"));
        d.apply(
            Some(b"http://a"),
            Some(&json(&key.sign(claim("http://a", &[], 2, 11)))),
        );
        assert_eq!(d.owner(&t, 0, 11, 100, None), None);
        // Without a key every well-formed claim counts.
        let open = Directory::default();
        open.apply(Some(b"http://evil"), Some(&json(&unsigned)));
        assert_eq!(
            open.owner(&t, 0, 10, 100, None).as_deref(),
            Some("http://evil")
        );
    }

    #[test]
    fn the_directory_keeps_each_servers_newest_claim_until_its_tombstone() {
        let d = Directory::default();
        let json = |c: &InstanceClaim| serde_json::to_vec(c).unwrap();
        let t = topics(&["in"]);
        d.apply(
            Some(b"http://a"),
            Some(&json(&claim("http://a", &[("in", &[0, 1])], 1, 10))),
        );
        d.apply(
            Some(b"http://b"),
            Some(&json(&claim("http://b", &[], 2, 10))),
        );
        assert_eq!(d.owner(&t, 1, 10, 100, None).as_deref(), Some("http://a"));
        // a newer claim replaces the older one of the same server
        d.apply(
            Some(b"http://a"),
            Some(&json(&claim("http://a", &[("in", &[0])], 3, 20))),
        );
        d.apply(
            Some(b"http://b"),
            Some(&json(&claim("http://b", &[("in", &[1])], 3, 20))),
        );
        assert_eq!(d.owner(&t, 1, 20, 100, None).as_deref(), Some("http://b"));
        assert_eq!(d.fresh(20, 100).len(), 2);
        // Garbage and claims in another server's name change nothing.
        d.apply(Some(b"http://b"), Some(b"{not json"));
        d.apply(
            Some(b"http://c"),
            Some(&json(&claim("http://b", &[("in", &[0])], 9, 20))),
        );
        d.apply(None, Some(b"{}"));
        assert_eq!(d.owner(&t, 0, 20, 100, None).as_deref(), Some("http://a"));
        // A clean stop deletes the claim.
        d.apply(Some(b"http://b"), None);
        assert_eq!(d.owner(&t, 1, 20, 100, None), None);
        assert_eq!(d.fresh(20, 100).len(), 1);
        // The wire form is camelCase JSON.
        let text = String::from_utf8(json(&claim("http://a", &[("in", &[0])], 1, 2))).unwrap();
        assert_eq!(
            text,
            r#"{"server":"http://a","partitions":{"in":[0]},"assignedMs":1,"updatedMs":2}"#
        );
    }
}
