//! Crash and hang points for the tests: `SLUICE_FAILPOINT=<name>:<n>` in a
//! process's environment makes the n-th pass at the point named `name`
//! abort the process (as if killed) or block its thread for good, or turns
//! a switch on. Without the variable every point is a no-op.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::OnceLock;

/// A crash point for tests: with `SLUICE_FAILPOINT=<name>:<n>` in the
/// environment, the process aborts (as if killed) the n-th time it reaches the
/// point named `name`. Without the variable this is a no-op.
pub(in crate::runtime) fn failpoint(name: &str) {
    failpoint_at(name, false);
}

/// As [`failpoint`], for a point passed by transactions: with
/// `SLUICE_FAILPOINT=<name>+outputs:<n>` only the passes of transactions that
/// carry output records count (a crash that must find results in the
/// transaction it interrupts, however long the first results take).
pub(in crate::runtime) fn failpoint_at(name: &str, carries_outputs: bool) {
    if reached(name, carries_outputs) {
        eprintln!("failpoint {name} reached: aborting");
        std::process::abort();
    }
}

/// A point where a client call never returns, for tests: with
/// `SLUICE_FAILPOINT=<name>:<n>` the n-th pass blocks its thread for good
/// (as librdkafka's `send_offsets_to_transaction` can: see
/// [`super::kafka::send_offsets_to_transaction`]).
pub(in crate::runtime) fn hang_point(name: &str) {
    if reached(name, false) {
        eprintln!("failpoint {name} reached: this call never returns");
        loop {
            std::thread::park();
        }
    }
}

/// A switch for tests: true at the n-th pass at point `name` when
/// `SLUICE_FAILPOINT=<name>:<n>`, to take a path that forces a rare ordering
/// of events or a failure (see its callers).
pub(in crate::runtime) fn switched_on(name: &str) -> bool {
    reached(name, false)
}

/// Whether this pass at point `name` is the one `SLUICE_FAILPOINT` names
/// (see [`failpoint_at`]).
fn reached(name: &str, carries_outputs: bool) -> bool {
    static REMAINING: AtomicI64 = AtomicI64::new(i64::MIN);
    /// The point's name, whether only passes with outputs count, `n`.
    static CONFIG: OnceLock<Option<(String, bool, i64)>> = OnceLock::new();
    let Some((point, outputs_only, n)) = CONFIG.get_or_init(|| {
        let v = std::env::var("SLUICE_FAILPOINT").ok()?;
        let (p, n) = v.split_once(':')?;
        let (p, outputs_only) = match p.strip_suffix("+outputs") {
            Some(p) => (p, true),
            None => (p, false),
        };
        Some((p.to_string(), outputs_only, n.parse().ok()?))
    }) else {
        return false;
    };
    if point != name || (*outputs_only && !carries_outputs) {
        return false;
    }
    let _ = REMAINING.compare_exchange(i64::MIN, *n, Ordering::SeqCst, Ordering::SeqCst);
    REMAINING.fetch_sub(1, Ordering::SeqCst) == 1
}
