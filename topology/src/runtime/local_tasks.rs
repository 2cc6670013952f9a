//! This instance's tasks as the driver publishes them, with a reader of
//! each running task's state: what interactive queries and the instance
//! claims read.

use std::collections::{BTreeSet, HashMap};

use parking_lot::Mutex;
use sluice_state::StoreReader;
use tokio::sync::watch;

use crate::TaskId;

/// The tasks of this instance, as the driver publishes them, with a reader
/// of each running task's state.
#[derive(Debug, Default)]
pub(crate) struct LocalTasks {
    inner: Mutex<LocalInner>,
    /// Marked changed on every change of the tasks.
    changes: watch::Sender<()>,
}

#[derive(Debug, Default)]
struct LocalInner {
    running: BTreeSet<TaskId>,
    assigned: BTreeSet<TaskId>,
    readers: HashMap<TaskId, StoreReader>,
}

impl LocalTasks {
    /// Sets the running and the assigned (running or restoring) tasks;
    /// `reader_of` gives the state reader of a task that started running.
    pub(crate) fn publish(
        &self,
        running: BTreeSet<TaskId>,
        assigned: BTreeSet<TaskId>,
        reader_of: impl Fn(TaskId) -> Option<StoreReader>,
    ) {
        {
            let mut inner = self.inner.lock();
            if inner.running == running && inner.assigned == assigned {
                return;
            }
            let mut old = std::mem::take(&mut inner.readers);
            inner.readers = running
                .iter()
                .filter_map(|id| {
                    old.remove(id)
                        .filter(StoreReader::is_open)
                        .or_else(|| reader_of(*id))
                        .map(|r| (*id, r))
                })
                .collect();
            inner.running = running;
            inner.assigned = assigned;
        }
        self.changes.send_replace(());
    }

    /// Marked changed on every change of the tasks.
    pub(super) fn changes(&self) -> watch::Receiver<()> {
        self.changes.subscribe()
    }

    /// The tasks assigned here (running or restoring).
    pub(crate) fn assigned(&self) -> BTreeSet<TaskId> {
        self.inner.lock().assigned.clone()
    }

    /// How many tasks of sub-topology `subtopology` are assigned here.
    pub(super) fn assigned_in(&self, subtopology: usize) -> usize {
        self.inner
            .lock()
            .assigned
            .iter()
            .filter(|id| id.subtopology as usize == subtopology)
            .count()
    }

    /// Whether `id` runs here and whether it is assigned here.
    pub(super) fn state_of(&self, id: TaskId) -> (bool, bool) {
        let inner = self.inner.lock();
        (inner.running.contains(&id), inner.assigned.contains(&id))
    }

    /// The state reader of a running task, or why there is none.
    pub(super) fn reader(&self, id: TaskId) -> Result<StoreReader, NoReader> {
        let inner = self.inner.lock();
        if let Some(r) = inner.readers.get(&id) {
            return Ok(r.clone());
        }
        if inner.assigned.contains(&id) {
            Err(NoReader::Restoring)
        } else {
            Err(NoReader::NotAssigned)
        }
    }
}

/// Why a task's state cannot be read here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NoReader {
    /// The task is assigned here and still restoring.
    Restoring,
    /// The task is not assigned here.
    NotAssigned,
}
