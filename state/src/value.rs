//! The stored value format: a small header with the input position, then the
//! value bytes. The same bytes go to the local store and to the changelog.
//!
//! The header says which input a value reflects: the position of the record
//! that wrote it, and a floor: every record of that source at or below the
//! floor had finished when it was written. Records finish out of order behind
//! async operators, so the record that wrote a value says nothing about the
//! records before it; the floor does.

use crate::StateError;

/// First header version: position only (`covers` = at or below its offset).
const V1: u8 = 1;
/// Current header version: position and floor.
const V2: u8 = 2;
const V1_LEN: usize = 1 + 4 + 8;
const V2_LEN: usize = V1_LEN + 8;
const NO_SOURCE: u32 = u32::MAX;

/// The input position of a record: a source (a stable id of the input topic,
/// whose partition is the task's) and the record's offset there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Position {
    /// Stable id of the source topic (see `source_id` in the topology crate).
    pub source: u32,
    /// Offset of the input record in that source partition.
    pub offset: i64,
}

impl Position {
    /// True when state written in input order while at `self` reflects the
    /// input at `other`: same source, and `self` is at or past it.
    pub fn covers(&self, other: &Position) -> bool {
        self.source == other.source && self.offset >= other.offset
    }
}

/// A value as kept in a store: its bytes and the input it reflects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredValue {
    /// The input position of the record that wrote it, when one did.
    pub position: Option<Position>,
    /// Every record of the position's source at or below this offset had
    /// finished when the value was written (so its effect is in the value).
    pub floor: i64,
    /// The value bytes (encoded by the store's user).
    pub value: Vec<u8>,
}

impl StoredValue {
    /// A value written by the record at `position` in input order (every
    /// record before it finished).
    pub fn in_order(position: Option<Position>, value: Vec<u8>) -> Self {
        StoredValue {
            floor: position.map_or(-1, |p| p.offset - 1),
            position,
            value,
        }
    }

    /// True when this value already reflects the input record at `cur`: it is
    /// the record that wrote it, or one that had finished before (at or below
    /// the floor).
    pub fn covers(&self, cur: &Position) -> bool {
        self.position.is_some_and(|p| {
            p.source == cur.source && (p.offset == cur.offset || self.floor >= cur.offset)
        })
    }

    /// Encodes the header and value into one buffer.
    pub fn encode(&self) -> Vec<u8> {
        encode_parts(self.position, self.floor, &self.value)
    }

    /// Decodes bytes produced by [`StoredValue::encode`] (or by the first
    /// header version, whose positions cover everything at or below them).
    pub fn decode(store: &str, bytes: &[u8]) -> Result<Self, StateError> {
        let Some((position, floor, len)) = decode_header(bytes) else {
            return Err(StateError::Corrupt {
                store: store.to_string(),
                reason: format!(
                    "value header missing or unknown version ({} bytes)",
                    bytes.len()
                ),
            });
        };
        Ok(StoredValue {
            position,
            floor,
            value: bytes[len..].to_vec(),
        })
    }

    /// Reads only the position from encoded bytes.
    pub fn decode_position(bytes: &[u8]) -> Option<Position> {
        decode_header(bytes)?.0
    }
}

/// Position, floor and header length of encoded bytes.
fn decode_header(bytes: &[u8]) -> Option<(Option<Position>, i64, usize)> {
    let len = match *bytes.first()? {
        V1 => V1_LEN,
        V2 => V2_LEN,
        _ => return None,
    };
    if bytes.len() < len {
        return None;
    }
    let source = u32::from_le_bytes(bytes[1..5].try_into().ok()?);
    let offset = i64::from_le_bytes(bytes[5..13].try_into().ok()?);
    let position = (source != NO_SOURCE).then_some(Position { source, offset });
    let floor = if len == V2_LEN {
        i64::from_le_bytes(bytes[13..21].try_into().ok()?)
    } else {
        offset
    };
    Some((position, floor, len))
}

/// Encodes a position, floor and value without building a [`StoredValue`].
pub(crate) fn encode_parts(position: Option<Position>, floor: i64, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(V2_LEN + value.len());
    out.push(V2);
    let (source, offset) = position.map_or((NO_SOURCE, -1), |p| (p.source, p.offset));
    out.extend_from_slice(&source.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&floor.to_le_bytes());
    out.extend_from_slice(value);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(source: u32, offset: i64) -> Position {
        Position { source, offset }
    }

    #[test]
    fn round_trips_with_and_without_position() {
        let with = StoredValue {
            position: Some(at(7, 42)),
            floor: 30,
            value: b"abc".to_vec(),
        };
        assert_eq!(StoredValue::decode("s", &with.encode()).unwrap(), with);
        assert_eq!(StoredValue::decode_position(&with.encode()), with.position);
        let without = StoredValue::in_order(None, vec![]);
        assert_eq!(
            StoredValue::decode("s", &without.encode()).unwrap(),
            without
        );
    }

    #[test]
    fn reads_the_first_header_version() {
        let mut v1 = vec![V1];
        v1.extend_from_slice(&7u32.to_le_bytes());
        v1.extend_from_slice(&42i64.to_le_bytes());
        v1.extend_from_slice(b"x");
        let got = StoredValue::decode("s", &v1).unwrap();
        assert_eq!(
            (got.position, got.value.as_slice()),
            (Some(at(7, 42)), &b"x"[..])
        );
        assert!(got.covers(&at(7, 42)) && got.covers(&at(7, 3)));
        assert!(!got.covers(&at(7, 43)));
    }

    #[test]
    fn rejects_garbage() {
        assert!(StoredValue::decode("s", b"xy").is_err());
        assert!(StoredValue::decode("s", &[9u8; 20]).is_err());
        assert!(StoredValue::decode("s", &[V2; 14]).is_err());
    }

    #[test]
    fn covers_the_writer_and_what_finished_before_it() {
        // In order: everything up to the writer.
        let v = StoredValue::in_order(Some(at(1, 10)), vec![]);
        assert!(v.covers(&at(1, 10)) && v.covers(&at(1, 3)));
        assert!(!v.covers(&at(1, 11)) && !v.covers(&at(2, 3)));
        // Out of order: record 8 wrote it while 5 was still in flight.
        let v = StoredValue {
            position: Some(at(1, 8)),
            floor: 4,
            value: vec![],
        };
        assert!(v.covers(&at(1, 8)) && v.covers(&at(1, 4)));
        assert!(!v.covers(&at(1, 5)) && !v.covers(&at(1, 7)));
    }
}
