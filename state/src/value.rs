//! The stored value format: a small header with the input position, then the
//! value bytes. The same bytes go to the local store and to the changelog.

use crate::StateError;

const VERSION: u8 = 1;
const HEADER_LEN: usize = 1 + 4 + 8;
const NO_SOURCE: u32 = u32::MAX;

/// The input position a state value reflects: a source (a stable id of the
/// input topic, whose partition is the task's) and the offset of the last input
/// record applied to the value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Position {
    /// Stable id of the source topic (see `source_id` in the topology crate).
    pub source: u32,
    /// Offset of the input record in that source partition.
    pub offset: i64,
}

impl Position {
    /// True when a value stamped with `self` already reflects the input at
    /// `other`: same source, and the stamped offset is at or past it.
    pub fn covers(&self, other: &Position) -> bool {
        self.source == other.source && self.offset >= other.offset
    }
}

/// A value as kept in a store: its bytes and the position it reflects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredValue {
    /// The input position reflected, when the write came from an input record.
    pub position: Option<Position>,
    /// The value bytes (encoded by the store's user).
    pub value: Vec<u8>,
}

impl StoredValue {
    /// Encodes the header and value into one buffer.
    pub fn encode(&self) -> Vec<u8> {
        encode_parts(self.position, &self.value)
    }

    /// Decodes bytes produced by [`StoredValue::encode`].
    pub fn decode(store: &str, bytes: &[u8]) -> Result<Self, StateError> {
        if bytes.len() < HEADER_LEN || bytes[0] != VERSION {
            return Err(StateError::Corrupt {
                store: store.to_string(),
                reason: format!(
                    "value header missing or unknown version ({} bytes)",
                    bytes.len()
                ),
            });
        }
        let source = u32::from_le_bytes(bytes[1..5].try_into().expect("4 bytes"));
        let offset = i64::from_le_bytes(bytes[5..13].try_into().expect("8 bytes"));
        let position = (source != NO_SOURCE).then_some(Position { source, offset });
        Ok(StoredValue {
            position,
            value: bytes[HEADER_LEN..].to_vec(),
        })
    }

    /// Reads only the position from encoded bytes.
    pub fn decode_position(bytes: &[u8]) -> Option<Position> {
        if bytes.len() < HEADER_LEN || bytes[0] != VERSION {
            return None;
        }
        let source = u32::from_le_bytes(bytes[1..5].try_into().ok()?);
        let offset = i64::from_le_bytes(bytes[5..13].try_into().ok()?);
        (source != NO_SOURCE).then_some(Position { source, offset })
    }
}

/// Encodes a position and value without building a [`StoredValue`].
pub(crate) fn encode_parts(position: Option<Position>, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + value.len());
    out.push(VERSION);
    let (source, offset) = position.map_or((NO_SOURCE, -1), |p| (p.source, p.offset));
    out.extend_from_slice(&source.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(value);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_with_and_without_position() {
        let with = StoredValue {
            position: Some(Position {
                source: 7,
                offset: 42,
            }),
            value: b"abc".to_vec(),
        };
        assert_eq!(StoredValue::decode("s", &with.encode()).unwrap(), with);
        assert_eq!(StoredValue::decode_position(&with.encode()), with.position);
        let without = StoredValue {
            position: None,
            value: vec![],
        };
        assert_eq!(
            StoredValue::decode("s", &without.encode()).unwrap(),
            without
        );
    }

    #[test]
    fn rejects_garbage() {
        assert!(StoredValue::decode("s", b"xy").is_err());
        assert!(StoredValue::decode("s", &[9u8; 20]).is_err());
    }

    #[test]
    fn covers_needs_same_source_and_later_offset() {
        let p = Position {
            source: 1,
            offset: 10,
        };
        assert!(p.covers(&Position {
            source: 1,
            offset: 10
        }));
        assert!(p.covers(&Position {
            source: 1,
            offset: 3
        }));
        assert!(!p.covers(&Position {
            source: 1,
            offset: 11
        }));
        assert!(!p.covers(&Position {
            source: 2,
            offset: 3
        }));
    }
}
