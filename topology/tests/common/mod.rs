//! What the in-process tests' resumable processors share: how a string
//! record is kept as a hold's content and read back in `Processor::resume`.

use sluice_topology::{from_bincode, ProcessError, Record};

/// A hold's content for a string record: key, value, timestamp.
pub type Content = (String, String, i64);

/// The content that takes `r` up again after a restart.
pub fn content_of(r: &Record<String, String>) -> Content {
    (r.key.clone(), r.value.clone(), r.timestamp)
}

/// The record a hold's content (as `Processor::resume` gets it) stands for.
pub fn record_from(content: &[u8]) -> Result<Record<String, String>, ProcessError> {
    let (key, value, timestamp): Content =
        from_bincode(content).map_err(|e| ProcessError::Fatal(e.0))?;
    Ok(Record::new(key, value, timestamp))
}
