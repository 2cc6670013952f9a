//! The wall clock the runtime stamps claims and untimed records with.

use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock time, ms since the epoch.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
