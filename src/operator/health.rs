//! Faults that make an instance unready without stopping it (a provider
//! rejecting credentials, a model whose breaker is open with no fallback).
//! Each fault also holds intake under the same name.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use parking_lot::Mutex;
use sluice_topology::runtime::IntakeControl;
use sluice_topology::TaskId;

/// A fault: what went wrong, and the tasks holding jobs because of it.
#[derive(Debug, Clone)]
struct Fault {
    detail: String,
    holders: BTreeSet<TaskId>,
}

/// Active faults by name, shared by the operator and the HTTP endpoints.
#[derive(Clone, Default, Debug)]
pub struct Health {
    faults: Arc<Mutex<BTreeMap<String, Fault>>>,
    intake: IntakeControl,
}

impl Health {
    /// Faults hold and release this intake control.
    pub fn new(intake: IntakeControl) -> Self {
        Health {
            faults: Default::default(),
            intake,
        }
    }

    /// Records a fault met by a task (which holds jobs because of it) and
    /// holds intake.
    pub fn raise(&self, holder: TaskId, name: &str, detail: &str) {
        let mut f = self.faults.lock();
        if !f.contains_key(name) {
            tracing::error!(fault = name, detail, "holding intake");
        }
        let fault = f.entry(name.to_string()).or_insert_with(|| Fault {
            detail: String::new(),
            holders: BTreeSet::new(),
        });
        fault.detail = detail.to_string();
        fault.holders.insert(holder);
        self.intake.hold(name);
    }

    /// Clears a fault (its cause is gone for every task) and releases its hold.
    pub fn clear(&self, name: &str) {
        if self.faults.lock().remove(name).is_some() {
            tracing::info!(fault = name, "fault cleared; resuming intake");
        }
        self.intake.release(name);
    }

    /// A task is gone from this instance (moved, closed): the faults only it
    /// held are cleared, since no job of theirs is left here to probe them.
    pub fn release(&self, holder: TaskId) {
        let mut f = self.faults.lock();
        let mut gone = Vec::new();
        for (name, fault) in f.iter_mut() {
            if fault.holders.remove(&holder) && fault.holders.is_empty() {
                gone.push(name.clone());
            }
        }
        for name in gone {
            f.remove(&name);
            tracing::info!(fault = name, task = %holder, "no task holds jobs for the fault any more; resuming intake");
            self.intake.release(&name);
        }
    }

    /// Active faults (name → detail).
    pub fn faults(&self) -> BTreeMap<String, String> {
        self.faults
            .lock()
            .iter()
            .map(|(name, f)| (name.clone(), f.detail.clone()))
            .collect()
    }

    /// The intake control faults hold.
    pub fn intake(&self) -> &IntakeControl {
        &self.intake
    }
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
    fn a_fault_holds_intake_until_cleared_or_every_holder_left() {
        let h = Health::new(IntakeControl::default());
        h.raise(task(0), "provider:small", "401");
        h.raise(task(1), "provider:small", "401");
        h.raise(task(1), "breaker:large", "open");
        assert!(h.intake().is_held());
        // Task 1 moves away: the fault only it held goes; the shared one stays.
        h.release(task(1));
        assert_eq!(
            h.faults().keys().cloned().collect::<Vec<_>>(),
            vec!["provider:small".to_string()]
        );
        assert!(h.intake().is_held());
        h.release(task(0));
        assert!(h.faults().is_empty());
        assert!(!h.intake().is_held(), "nothing held once every holder left");
        // Clearing ends a fault whoever held it.
        h.raise(task(2), "provider:small", "401");
        h.clear("provider:small");
        assert!(!h.intake().is_held());
    }
}
