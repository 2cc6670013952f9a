//! The stored value format: a version byte, then the value bytes. The same
//! bytes go to the local store and to the changelog.
//!
//! Earlier versions also stamped every value with the input position that
//! wrote it; those bytes are still read (the stamp is skipped). A commit's
//! progress record, kept in the task's own store, says which input the state
//! reflects.

use crate::StateError;

/// Earlier versions: a position (13 bytes), then a floor (8 more).
const V1: u8 = 1;
const V2: u8 = 2;
/// The current version: the value follows the version byte.
const V3: u8 = 3;
const V1_LEN: usize = 1 + 4 + 8;
const V2_LEN: usize = V1_LEN + 8;
const V3_LEN: usize = 1;

/// The input position of a record: a source (a stable id of the input topic,
/// whose partition is the task's) and the record's offset there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Position {
    /// Stable id of the source topic (see `source_id` in the topology crate).
    pub source: u32,
    /// Offset of the input record in that source partition.
    pub offset: i64,
}

/// A value as kept in a store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredValue {
    /// The value bytes (encoded by the store's user).
    pub value: Vec<u8>,
}

impl StoredValue {
    /// A value.
    pub fn new(value: Vec<u8>) -> Self {
        StoredValue { value }
    }

    /// Encodes the header and value into one buffer.
    pub fn encode(&self) -> Vec<u8> {
        encode_value(&self.value)
    }

    /// Decodes bytes produced by [`StoredValue::encode`] (or by an earlier
    /// version).
    pub fn decode(store: &str, bytes: &[u8]) -> Result<Self, StateError> {
        let Some(len) = header_len(bytes) else {
            return Err(StateError::Corrupt {
                store: store.to_string(),
                reason: format!(
                    "value header missing or unknown version ({} bytes)",
                    bytes.len()
                ),
            });
        };
        Ok(StoredValue {
            value: bytes[len..].to_vec(),
        })
    }
}

/// Length of the header of encoded bytes, if they have a valid one.
fn header_len(bytes: &[u8]) -> Option<usize> {
    let len = match *bytes.first()? {
        V1 => V1_LEN,
        V2 => V2_LEN,
        V3 => V3_LEN,
        _ => return None,
    };
    (bytes.len() >= len).then_some(len)
}

/// Encodes a value without building a [`StoredValue`].
pub(crate) fn encode_value(value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(V3_LEN + value.len());
    out.push(V3);
    out.extend_from_slice(value);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        for v in [&b"abc"[..], b""] {
            let s = StoredValue::new(v.to_vec());
            assert_eq!(StoredValue::decode("s", &s.encode()).unwrap(), s);
            assert_eq!(s.encode().len(), v.len() + 1);
        }
    }

    #[test]
    fn reads_the_earlier_versions() {
        let mut v1 = vec![V1];
        v1.extend_from_slice(&7u32.to_le_bytes());
        v1.extend_from_slice(&42i64.to_le_bytes());
        v1.extend_from_slice(b"x");
        assert_eq!(StoredValue::decode("s", &v1).unwrap().value, b"x");
        let mut v2 = vec![V2];
        v2.extend_from_slice(&7u32.to_le_bytes());
        v2.extend_from_slice(&42i64.to_le_bytes());
        v2.extend_from_slice(&41i64.to_le_bytes());
        v2.extend_from_slice(b"yz");
        assert_eq!(StoredValue::decode("s", &v2).unwrap().value, b"yz");
    }

    #[test]
    fn rejects_garbage() {
        assert!(StoredValue::decode("s", b"").is_err());
        assert!(StoredValue::decode("s", b"xy").is_err());
        assert!(StoredValue::decode("s", &[9u8; 20]).is_err());
        assert!(StoredValue::decode("s", &[V2; 14]).is_err());
    }
}
