//! Faults that make an instance unready without stopping it (a provider
//! rejecting credentials, a model whose breaker is open with no fallback).
//! Each fault also holds intake under the same name.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use sluice_topology::runtime::IntakeControl;

/// Active faults by name, shared by the operator and the HTTP endpoints.
#[derive(Clone, Default, Debug)]
pub struct Health {
    faults: Arc<Mutex<BTreeMap<String, String>>>,
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

    /// Records a fault and holds intake.
    pub fn raise(&self, name: &str, detail: &str) {
        let mut f = self.faults.lock();
        if !f.contains_key(name) {
            tracing::error!(fault = name, detail, "holding intake");
        }
        f.insert(name.to_string(), detail.to_string());
        self.intake.hold(name);
    }

    /// Clears a fault and releases its hold.
    pub fn clear(&self, name: &str) {
        if self.faults.lock().remove(name).is_some() {
            tracing::info!(fault = name, "fault cleared; resuming intake");
        }
        self.intake.release(name);
    }

    /// Active faults (name → detail).
    pub fn faults(&self) -> BTreeMap<String, String> {
        self.faults.lock().clone()
    }

    /// The intake control faults hold.
    pub fn intake(&self) -> &IntakeControl {
        &self.intake
    }
}
