//! An instance's state as others see it (health endpoints, readiness),
//! and the holds that stop its intake.

use std::collections::BTreeSet;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::TaskId;

/// Life-cycle state of an instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AppState {
    /// Created, not yet part of the group.
    Starting,
    /// Partitions are being (re)assigned.
    Rebalancing,
    /// Some assigned tasks are restoring their state.
    Restoring,
    /// Every assigned task is processing.
    Running,
    /// Stopped cleanly.
    Stopped,
    /// Stopped by an error.
    Failed(String),
}

/// Shared view of an instance's state, for health endpoints.
#[derive(Debug)]
pub struct AppStatus {
    state: Mutex<AppState>,
    tasks: Mutex<BTreeSet<TaskId>>,
    /// Why the cluster counts as unreachable (see [`super::probe`]); `None` while
    /// it answers.
    broker_fault: Mutex<Option<String>>,
}

impl AppStatus {
    pub(super) fn new() -> Self {
        AppStatus {
            state: Mutex::new(AppState::Starting),
            tasks: Mutex::new(BTreeSet::new()),
            broker_fault: Mutex::new(None),
        }
    }

    /// The current state.
    pub fn state(&self) -> AppState {
        self.state.lock().clone()
    }

    /// True once every assigned task has restored and is processing, while
    /// the cluster answers.
    pub fn is_ready(&self) -> bool {
        *self.state.lock() == AppState::Running && self.broker_fault.lock().is_none()
    }

    /// Why the cluster counts as unreachable now (its last probe failed).
    pub fn broker_fault(&self) -> Option<String> {
        self.broker_fault.lock().clone()
    }

    pub(crate) fn set_broker_fault(&self, fault: Option<String>) {
        *self.broker_fault.lock() = fault;
    }

    /// Tasks this instance runs.
    pub fn tasks(&self) -> Vec<TaskId> {
        self.tasks.lock().iter().copied().collect()
    }

    pub(crate) fn set(&self, s: AppState) {
        *self.state.lock() = s;
    }

    pub(crate) fn set_tasks(&self, tasks: impl IntoIterator<Item = TaskId>) {
        *self.tasks.lock() = tasks.into_iter().collect();
    }
}

/// Holds intake: while any hold is active, every assigned partition is paused
/// (polling continues). For an application that must stop consuming without
/// losing its place, e.g. while its provider rejects its credentials.
#[derive(Clone, Debug, Default)]
pub struct IntakeControl {
    holds: Arc<Mutex<BTreeSet<String>>>,
}

impl IntakeControl {
    /// Adds a named hold.
    pub fn hold(&self, reason: &str) {
        self.holds.lock().insert(reason.to_string());
    }

    /// Removes a named hold.
    pub fn release(&self, reason: &str) {
        self.holds.lock().remove(reason);
    }

    /// True while any hold is active.
    pub fn is_held(&self) -> bool {
        !self.holds.lock().is_empty()
    }

    /// The active holds.
    pub fn holds(&self) -> Vec<String> {
        self.holds.lock().iter().cloned().collect()
    }
}
