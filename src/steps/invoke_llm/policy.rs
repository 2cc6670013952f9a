//! What `invoke_llm` does with a call that failed past the client's own
//! retries: one table from the error's class (and whether the call was a
//! micro-batch) to an action. `call.rs` carries the actions out.
//!
//! | class                         | a task's call                         | a batch's call                   |
//! |-------------------------------|---------------------------------------|----------------------------------|
//! | `400` (`bad_request`)         | wait for the model's run ([`super::trap`]) | a call per task             |
//! | other permanent (content policy, too large) | dead letter + failed result | a call per task         |
//! | configuration (401/403/404)   | hold the model                        | hold the model                   |
//! | circuit open                  | fallback model, else hold the model   | same                             |
//! | rate limited past the wait    | hold the model until `Retry-After`    | same                             |
//! | transient, malformed          | re-publish (backoff), last attempt: dead letter `exhausted` | halve it |
//!
//! Whatever the action, what the provider billed for the call goes on the
//! tasks' results. A held model's jobs are parked (no task fails, nothing is
//! dead-lettered) until a probe is answered; other models go on.

use std::time::Duration;

use crate::envelope::DlqCategory;
use crate::llm::{ErrorClass, PermanentKind};

/// What becomes of a failed call's tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    /// A `400` to one task: its model's run of refusals decides whether it
    /// is the task's own (dead letter) or the model's fault (hold).
    AwaitRun,
    /// Which task of the batch the provider refused is unknown: each is
    /// called alone.
    CallEachAlone,
    /// The task fails for good: a dead letter of this category.
    DeadLetter(DlqCategory),
    /// The model cannot answer anyone: its jobs are parked under
    /// `<fault>:<model>`, probed now and then, not before `not_before`.
    HoldModel {
        fault: &'static str,
        not_before: Option<Duration>,
    },
    /// Its breaker is open: a fallback model, else hold it.
    Reroute,
    /// Each half of the batch is called on its own.
    Halve,
    /// The task gets another attempt later, or fails as `exhausted`.
    Republish,
}

/// The dead-letter category of a call the provider refused for good.
pub(super) fn dlq_category(kind: PermanentKind) -> DlqCategory {
    match kind {
        PermanentKind::BadRequest => DlqCategory::BadRequest,
        PermanentKind::ContentPolicy => DlqCategory::ContentPolicy,
        PermanentKind::TooLarge => DlqCategory::TooLarge,
    }
}

/// The action for a failed call of `class`; `batch` when the call was a
/// micro-batch's, `trap` when a run of identical `400`s may make the model
/// a configuration fault.
pub(super) fn action(class: ErrorClass, batch: bool, trap: bool) -> Action {
    match class {
        ErrorClass::Permanent(PermanentKind::BadRequest) if !batch && trap => Action::AwaitRun,
        ErrorClass::Permanent(_) if batch => Action::CallEachAlone,
        ErrorClass::Permanent(kind) => Action::DeadLetter(dlq_category(kind)),
        ErrorClass::Config => Action::HoldModel {
            fault: "provider",
            not_before: None,
        },
        ErrorClass::CircuitOpen => Action::Reroute,
        ErrorClass::RateLimited { retry_after } => Action::HoldModel {
            fault: "rate_limited",
            not_before: Some(retry_after.unwrap_or_default()),
        },
        ErrorClass::Transient | ErrorClass::Malformed if batch => Action::Halve,
        ErrorClass::Transient | ErrorClass::Malformed => Action::Republish,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table() {
        use Action::*;
        let bad = ErrorClass::Permanent(PermanentKind::BadRequest);
        let policy = ErrorClass::Permanent(PermanentKind::ContentPolicy);
        assert_eq!(action(bad, false, true), AwaitRun);
        assert_eq!(
            action(bad, false, false),
            DeadLetter(DlqCategory::BadRequest)
        );
        assert_eq!(action(bad, true, true), CallEachAlone);
        assert_eq!(action(policy, true, true), CallEachAlone);
        assert_eq!(
            action(policy, false, true),
            DeadLetter(DlqCategory::ContentPolicy)
        );
        for batch in [false, true] {
            assert_eq!(
                action(ErrorClass::Config, batch, true),
                HoldModel {
                    fault: "provider",
                    not_before: None
                }
            );
            assert_eq!(action(ErrorClass::CircuitOpen, batch, true), Reroute);
            let wait = Some(Duration::from_secs(30));
            assert_eq!(
                action(ErrorClass::RateLimited { retry_after: wait }, batch, true),
                HoldModel {
                    fault: "rate_limited",
                    not_before: wait
                }
            );
        }
        assert_eq!(action(ErrorClass::Transient, true, true), Halve);
        assert_eq!(action(ErrorClass::Malformed, true, true), Halve);
        assert_eq!(action(ErrorClass::Transient, false, true), Republish);
        assert_eq!(action(ErrorClass::Malformed, false, true), Republish);
    }

    #[test]
    fn each_refusal_kind_has_its_dead_letter_category_and_the_same_code() {
        for kind in [
            PermanentKind::BadRequest,
            PermanentKind::ContentPolicy,
            PermanentKind::TooLarge,
        ] {
            assert_eq!(dlq_category(kind).as_str(), kind.as_str());
        }
        assert_eq!(
            dlq_category(PermanentKind::ContentPolicy),
            DlqCategory::ContentPolicy
        );
    }
}
