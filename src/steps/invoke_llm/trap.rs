//! The bad-request trap: a run of consecutive calls of one model refused
//! with the same 400 is a configuration fault, not a run of bad tasks.
//!
//! A `400` the provider gives every task of a model (a parameter the model
//! rejects, a broken prompt template) would otherwise dead-letter the whole
//! topic, one task at a time. So a single-task `400` (`bad_request`) is not
//! dead-lettered at once: the job waits until the model's run decides.
//!
//! * Another answer of the model breaks the run (a success, or a `400` with
//!   another message): the waiting task's `400` was its own, and it is
//!   dead-lettered.
//! * The run reaches `after` calls with the same message: the model is
//!   trapped. Its jobs are held like those of a rejected key (parked,
//!   `/readyz` naming the model with the provider's message, a probe now and
//!   then), and calls of it stop until a probe is answered.
//! * Nothing decides within the wait (a lone task with nothing else calling
//!   the model): the task is dead-lettered, and the run still counts, so
//!   a trickle of identical refusals is trapped all the same.
//!
//! * A task refused again with its run's message after the model was held
//!   (a probe, or a resumed job) does not count: the probes go to tasks not
//!   refused yet, so a second task refused alike confirms the fault and an
//!   answer ends it; then a task that is refused again while its model
//!   answers others is dead-lettered, instead of its refusal trapping the
//!   model again (a few bad tasks in a row would hold it for good).
//!
//! The runs are shared by every task of an instance, like the client's
//! breakers, since a model's calls come from every task.

use std::collections::HashMap;

use parking_lot::Mutex;

/// A model's current run of identical `400`s.
#[derive(Debug, Default)]
struct Run {
    /// The provider's message (what makes two refusals "the same").
    message: String,
    /// Consecutive calls refused with it.
    count: u32,
    /// Bumped whenever a run ends, so a waiting job sees its run is gone.
    epoch: u64,
}

/// What became of the run a waiting job's `400` belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The model answered otherwise since: the `400` was the task's own.
    Broken,
    /// The run reached the threshold: a configuration fault.
    Trapped,
    /// Not decided yet.
    Open,
}

/// Runs of identical `400`s per model.
#[derive(Debug)]
pub(crate) struct BadRequestRuns {
    /// Calls in a run that make it a configuration fault; 0 turns the trap
    /// off (every `400` is dead-lettered at once).
    after: u32,
    runs: Mutex<HashMap<String, Run>>,
}

impl BadRequestRuns {
    pub(crate) fn new(after: u32) -> Self {
        BadRequestRuns {
            after,
            runs: Mutex::new(HashMap::new()),
        }
    }

    /// Whether the trap is on.
    pub(crate) fn enabled(&self) -> bool {
        self.after > 0
    }

    /// A call of `model` was refused with `message`: the run's epoch, and
    /// whether the run is now a configuration fault.
    pub(crate) fn refused(&self, model: &str, message: &str) -> (u64, bool) {
        let mut runs = self.runs.lock();
        let run = runs.entry(model.to_string()).or_default();
        if run.message != message {
            if run.count > 0 {
                run.epoch += 1;
            }
            run.message = message.to_string();
            run.count = 0;
        }
        run.count = run.count.saturating_add(1);
        (run.epoch, run.count >= self.after)
    }

    /// The epoch of `model`'s current run.
    pub(crate) fn epoch(&self, model: &str) -> u64 {
        self.runs.lock().get(model).map_or(0, |r| r.epoch)
    }

    /// Whether `message` is the refusal of `model`'s current (or last) run.
    pub(crate) fn is_run_of(&self, model: &str, message: &str) -> bool {
        self.runs
            .lock()
            .get(model)
            .is_some_and(|r| r.message == message)
    }

    /// A call of `model` was answered (or refused otherwise): its run ends.
    pub(crate) fn answered(&self, model: &str) {
        let mut runs = self.runs.lock();
        if let Some(run) = runs.get_mut(model) {
            if run.count > 0 {
                run.count = 0;
                run.epoch += 1;
            }
        }
    }

    /// What became of the run of `epoch` in which `model` refused a job.
    pub(crate) fn verdict(&self, model: &str, epoch: u64) -> Verdict {
        match self.runs.lock().get(model) {
            Some(run) if run.epoch == epoch && run.count >= self.after => Verdict::Trapped,
            Some(run) if run.epoch == epoch && run.count > 0 => Verdict::Open,
            _ => Verdict::Broken,
        }
    }

    /// The message of `model`'s run when it is a configuration fault.
    pub(crate) fn trapped(&self, model: &str) -> Option<String> {
        let runs = self.runs.lock();
        let run = runs.get(model)?;
        (self.after > 0 && run.count >= self.after).then(|| run.message.clone())
    }

    /// The fault's name and what `/readyz` says about it.
    pub(crate) fn fault(&self, model: &str, message: &str) -> (String, String) {
        (
            fault_name(model),
            format!(
                "{} consecutive calls of {model} were refused with the same 400 \
                 (a parameter or prompt the model rejects?); its tasks are kept \
                 until it answers: {message}",
                self.after
            ),
        )
    }
}

/// The health fault of a trapped model.
fn fault_name(model: &str) -> String {
    format!("bad_request:{model}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_of_the_same_refusal_traps_the_model() {
        let runs = BadRequestRuns::new(3);
        let (e1, t1) = runs.refused("m", "bad param");
        let (e2, t2) = runs.refused("m", "bad param");
        assert!(!t1 && !t2);
        assert_eq!(e1, e2);
        assert_eq!(runs.verdict("m", e1), Verdict::Open);
        let (e3, t3) = runs.refused("m", "bad param");
        assert!(t3 && e3 == e1);
        assert_eq!(runs.verdict("m", e1), Verdict::Trapped);
        assert_eq!(runs.trapped("m").as_deref(), Some("bad param"));
        // Another model is not concerned.
        assert_eq!(runs.trapped("other"), None);
        // An answer (a probe's) ends the fault.
        runs.answered("m");
        assert_eq!(runs.trapped("m"), None);
        assert_eq!(runs.verdict("m", e1), Verdict::Broken);
    }

    #[test]
    fn an_answer_or_another_refusal_breaks_the_run() {
        let runs = BadRequestRuns::new(3);
        let (e, _) = runs.refused("m", "bad param");
        runs.answered("m");
        assert_eq!(runs.verdict("m", e), Verdict::Broken);
        let (e, _) = runs.refused("m", "bad param");
        runs.refused("m", "bad param");
        let (e2, trapped) = runs.refused("m", "another message");
        assert!(!trapped, "a different refusal starts a new run");
        assert_ne!(e, e2);
        assert_eq!(runs.verdict("m", e), Verdict::Broken);
        assert_eq!(runs.verdict("m", e2), Verdict::Open);
    }

    #[test]
    fn off_when_after_is_zero() {
        let runs = BadRequestRuns::new(0);
        assert!(!runs.enabled());
    }
}
