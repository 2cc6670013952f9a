//! Entry points for the fuzz suite (`tests/fuzz.rs` of the `sluice` crate)
//! into decoders that are private to this crate. Each function calls the
//! real decoder and encoder and nothing else. Not part of the API.

use crate::offsets::TaskProgress;

/// Decodes a progress record as a task's restore reads it from its store
/// (`TaskProgress::decode`), and encodes what it read again
/// (`TaskProgress::encode`, the current format).
pub fn decode_progress(bytes: &[u8]) -> Result<Vec<u8>, String> {
    TaskProgress::decode(bytes).map(|p| p.encode())
}
