//! Faults of models (a provider rejecting credentials, a breaker open with
//! no fallback, a long rate limit, a trapped `400`): each holds only the
//! jobs routed to its model. The tasks holding them keep their records in
//! flight, so a partition's intake pauses only once its held jobs fill its
//! in-flight budget; the other models' tasks keep flowing. An instance is
//! ready while any of its models serves.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use parking_lot::Mutex;
use sluice_topology::TaskId;

/// A fault: its model, what went wrong, and the tasks holding jobs because
/// of it.
#[derive(Debug, Clone)]
struct Fault {
    model: String,
    detail: String,
    holders: BTreeSet<TaskId>,
    /// No probe of the model before this time (a provider's `Retry-After`).
    not_before_ms: i64,
}

/// Active faults by name, shared by the operator and the HTTP endpoints.
#[derive(Clone, Default, Debug)]
pub struct Health {
    faults: Arc<Mutex<BTreeMap<String, Fault>>>,
    /// The models the instance calls (it is ready while one is not held).
    models: Arc<BTreeSet<String>>,
    /// Conditions an operator should know of that hold nothing up (e.g.
    /// producers partitioning tasks unlike `[tasks] partitioner`), by name.
    warnings: Arc<Mutex<BTreeMap<String, String>>>,
}

impl Health {
    /// Health of an instance calling `models`.
    pub fn new(models: impl IntoIterator<Item = String>) -> Self {
        Health {
            faults: Default::default(),
            models: Arc::new(models.into_iter().collect()),
            warnings: Default::default(),
        }
    }

    /// Records a fault of `model` met by a task, which holds jobs because
    /// of it.
    pub fn raise(&self, holder: TaskId, model: &str, name: &str, detail: &str) {
        let mut f = self.faults.lock();
        if !f.contains_key(name) {
            tracing::error!(fault = name, model, detail, "holding the model's tasks");
        }
        let fault = entry(&mut f, name, model);
        fault.detail = detail.to_string();
        fault.holders.insert(holder);
    }

    /// No probe of the fault's model before `until_ms` (a provider's
    /// `Retry-After`), whichever task probes it.
    pub fn defer(&self, name: &str, model: &str, until_ms: i64) {
        let mut f = self.faults.lock();
        let fault = entry(&mut f, name, model);
        fault.not_before_ms = fault.not_before_ms.max(until_ms);
    }

    /// Clears every fault of `model` (it answered: their cause is gone for
    /// every task).
    pub fn clear_model(&self, model: &str) {
        self.faults.lock().retain(|name, fault| {
            let gone = fault.model == model;
            if gone {
                tracing::info!(fault = name, "fault cleared; its model's tasks go on");
            }
            !gone
        });
    }

    /// A task is gone from this instance (moved, closed): the faults only it
    /// held are cleared, since no job of theirs is left here to probe them.
    pub fn release(&self, holder: TaskId) {
        self.release_where(holder, |_| true);
    }

    /// A task holds no job of `model` any more: the faults of the model
    /// only it held are cleared.
    pub fn release_model(&self, holder: TaskId, model: &str) {
        self.release_where(holder, |f| f.model == model);
    }

    fn release_where(&self, holder: TaskId, which: impl Fn(&Fault) -> bool) {
        let mut f = self.faults.lock();
        f.retain(|name, fault| {
            if !which(fault) || !fault.holders.remove(&holder) || !fault.holders.is_empty() {
                return true;
            }
            tracing::info!(fault = name, task = %holder, "no task holds jobs for the fault any more");
            false
        });
    }

    /// The active fault holding `model`'s jobs, if any: (name, detail).
    pub fn holding(&self, model: &str) -> Option<(String, String)> {
        self.faults
            .lock()
            .iter()
            .find(|(_, f)| f.model == model)
            .map(|(name, f)| (name.clone(), f.detail.clone()))
    }

    /// No probe of `model` before this time (the latest `Retry-After` of its
    /// faults; 0 when none says so).
    pub fn not_before(&self, model: &str) -> i64 {
        self.faults
            .lock()
            .values()
            .filter(|f| f.model == model)
            .map(|f| f.not_before_ms)
            .max()
            .unwrap_or(0)
    }

    /// Records (or updates) a warning shown by `/readyz`; it does not make
    /// the instance unready.
    pub fn warn(&self, name: &str, detail: String) {
        self.warnings.lock().insert(name.to_string(), detail);
    }

    /// The warnings by name.
    pub fn warnings(&self) -> BTreeMap<String, String> {
        self.warnings.lock().clone()
    }

    /// Active faults (name → detail).
    pub fn faults(&self) -> BTreeMap<String, String> {
        self.faults
            .lock()
            .iter()
            .map(|(name, f)| (name.clone(), f.detail.clone()))
            .collect()
    }

    /// The models whose jobs are held.
    pub fn held_models(&self) -> BTreeSet<String> {
        self.faults
            .lock()
            .values()
            .map(|f| f.model.clone())
            .collect()
    }

    /// Whether some model is not held (with no models known: whether none
    /// is).
    pub fn serving(&self) -> bool {
        let held = self.held_models();
        if self.models.is_empty() {
            return held.is_empty();
        }
        self.models.iter().any(|m| !held.contains(m))
    }
}

fn entry<'a>(faults: &'a mut BTreeMap<String, Fault>, name: &str, model: &str) -> &'a mut Fault {
    faults.entry(name.to_string()).or_insert_with(|| Fault {
        model: model.to_string(),
        detail: String::new(),
        holders: BTreeSet::new(),
        not_before_ms: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(partition: i32) -> TaskId {
        TaskId {
            subtopology: 0,
            partition,
        }
    }

    #[test]
    fn a_fault_holds_its_model_until_cleared_or_every_holder_left() {
        let h = Health::new(["small".to_string(), "large".to_string()]);
        h.raise(task(0), "small", "provider:small", "401");
        h.raise(task(1), "small", "provider:small", "401");
        h.raise(task(1), "large", "breaker:large", "open");
        assert_eq!(h.holding("large").unwrap().0, "breaker:large");
        assert!(!h.serving(), "every model held");
        // Task 1 moves away: the fault only it held goes; the shared one stays.
        h.release(task(1));
        assert_eq!(
            h.faults().keys().cloned().collect::<Vec<_>>(),
            vec!["provider:small".to_string()]
        );
        assert!(h.holding("large").is_none());
        assert!(h.serving(), "large serves");
        // A holder that has no job of the model left lets it go.
        h.raise(task(2), "large", "breaker:large", "open");
        h.release_model(task(0), "large");
        assert!(h.holding("large").is_some(), "task 0 never held large");
        h.release_model(task(0), "small");
        assert!(h.holding("small").is_none());
        // A model's answer ends its faults whoever held them, and with them
        // the wait a Retry-After set.
        h.defer("rate_limited:large", "large", 1_000);
        assert_eq!(h.not_before("large"), 1_000);
        assert_eq!(h.not_before("small"), 0);
        h.clear_model("large");
        assert!(h.faults().is_empty());
        assert_eq!(h.not_before("large"), 0);
        assert_eq!(h.held_models(), BTreeSet::new());
    }
}
