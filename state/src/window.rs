//! Window store key layout: the window start (big-endian, sign bit flipped so
//! byte order is time order) followed by the record key. Time-first order makes
//! expiry one range delete and closed-window scans one range read.

/// Length of the time prefix of a window key.
pub const fn window_key_prefix_len() -> usize {
    8
}

/// Encodes `(window start, key)` into a store key.
pub fn encode_window_key(start_ms: i64, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + key.len());
    out.extend_from_slice(&window_start_bytes(start_ms));
    out.extend_from_slice(key);
    out
}

/// The first bytes of a window's store keys: the start, ordered as signed.
pub(crate) fn window_start_bytes(start_ms: i64) -> [u8; 8] {
    ((start_ms as u64) ^ (1 << 63)).to_be_bytes()
}

/// Decodes a store key made by [`encode_window_key`]; `None` for keys that are
/// not window keys (shorter than the prefix).
pub fn decode_window_key(bytes: &[u8]) -> Option<(i64, &[u8])> {
    if bytes.len() < 8 {
        return None;
    }
    let raw = u64::from_be_bytes(bytes[..8].try_into().ok()?);
    Some(((raw ^ (1 << 63)) as i64, &bytes[8..]))
}

/// One window of one key, as returned by range reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowEntry {
    /// Window start, ms.
    pub start_ms: i64,
    /// The record key bytes.
    pub key: Vec<u8>,
    /// The stored value.
    pub value: crate::StoredValue,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_order_is_time_order() {
        let times = [-5_000i64, -1, 0, 1, 60_000, i64::MAX / 2];
        let keys: Vec<Vec<u8>> = times.iter().map(|t| encode_window_key(*t, b"k")).collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
        for (t, k) in times.iter().zip(&keys) {
            assert_eq!(decode_window_key(k), Some((*t, &b"k"[..])));
        }
        assert_eq!(decode_window_key(b"short"), None);
    }
}
