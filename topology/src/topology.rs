//! A built topology: sub-topologies (connected groups of operators that share
//! tasks), their sources, stores and internal topics.

use rustc_hash::FxHashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use parking_lot::Mutex;
use sluice_state::{StoreId, StoreKind, StoreSpec};

use crate::context::TaskCtx;
use crate::node::{CompletionTarget, Instantiator, Punctuation};
use crate::record::Headers;
use crate::{ProcessError, TopologyError};

/// A source topic of a sub-topology.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SourceTopic {
    /// A user topic.
    External(String),
    /// An internal (repartition) topic, by suffix; its partition count is
    /// `partitions` when set, else follows the sub-topology that writes it.
    Internal {
        suffix: String,
        upstream: usize,
        partitions: Option<i32>,
    },
}

/// Stable id of a source topic, stamped into state positions and named
/// by the progress record (FNV-1a, 31 bits): a sub-topology's source topics
/// must have distinct ids ([`SubTopology::check_source_ids`]).
pub fn source_id(topic: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in topic.as_bytes() {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h & 0x7fff_ffff
}

impl SourceTopic {
    pub(crate) fn resolve(&self, app_id: &str) -> String {
        match self {
            SourceTopic::External(t) => t.clone(),
            SourceTopic::Internal { suffix, .. } => format!("{app_id}-{suffix}"),
        }
    }
}

/// An undecoded record as handed to a source.
pub(crate) struct RawView<'a> {
    pub(crate) key: Option<&'a [u8]>,
    pub(crate) value: Option<&'a [u8]>,
    pub(crate) timestamp: i64,
    pub(crate) headers: Headers,
}

/// The decoding entry of a sub-topology, instantiated per task.
pub(crate) trait SourceNode: Send {
    fn process(&mut self, view: RawView<'_>, ctx: &mut TaskCtx) -> Result<(), ProcessError>;
    fn punctuate(&mut self, p: Punctuation, ctx: &mut TaskCtx) -> Result<(), ProcessError>;
    fn flush(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError>;
    /// See [`crate::node::Node::resume`].
    fn resume(
        &mut self,
        node: &str,
        id: u64,
        bytes: &[u8],
        ctx: &mut TaskCtx,
    ) -> Result<bool, ProcessError>;
}

pub(crate) type SourceFactory =
    Arc<dyn Fn(&mut Instantiator<'_>) -> Result<Box<dyn SourceNode>, TopologyError> + Send + Sync>;

/// A source as declared in the DSL.
#[derive(Clone)]
pub(crate) struct SourceDef {
    pub(crate) topics: Vec<SourceTopic>,
    pub(crate) group: usize,
    pub(crate) dead_letter: Option<String>,
    pub(crate) factory: SourceFactory,
}

/// Operators that share tasks: everything reachable from a set of sources.
pub struct SubTopology {
    /// Index of the sub-topology.
    pub id: usize,
    pub(crate) sources: Vec<SourceDef>,
    pub(crate) stores: Vec<StoreSpec>,
}

impl SubTopology {
    /// Source topics with the application id applied, in source order.
    pub fn source_topics(&self, app_id: &str) -> Vec<String> {
        self.sources
            .iter()
            .flat_map(|s| s.topics.iter().map(|t| t.resolve(app_id)))
            .collect()
    }

    /// Checks that no two source topics of this sub-topology share a source
    /// id (a 31-bit hash of the topic's name, which state positions and the
    /// progress record carry to tell a task's partitions apart): with
    /// `app_id`, every topic as resolved; without, the user's topics only
    /// (internal topics are named after the application id).
    pub(crate) fn check_source_ids(&self, app_id: Option<&str>) -> Result<(), TopologyError> {
        let mut seen: std::collections::HashMap<u32, String> = Default::default();
        let topics = self.sources.iter().flat_map(|s| &s.topics);
        for topic in topics.filter_map(|t| match (t, app_id) {
            (SourceTopic::External(name), _) => Some(name.clone()),
            (SourceTopic::Internal { .. }, Some(app)) => Some(t.resolve(app)),
            (SourceTopic::Internal { .. }, None) => None,
        }) {
            let id = source_id(&topic);
            match seen.get(&id) {
                Some(other) if *other != topic => {
                    return Err(TopologyError::Invalid(format!(
                        "source topics {other} and {topic} have the same source id ({id}), \
                         which tells a task's input partitions apart: rename one"
                    )))
                }
                _ => {
                    seen.insert(id, topic);
                }
            }
        }
        Ok(())
    }

    /// The stores of this sub-topology.
    pub fn stores(&self) -> &[StoreSpec] {
        &self.stores
    }

    /// The internal topics read: suffix, writing sub-topology, partitions
    /// asked for.
    pub(crate) fn internal_sources(&self) -> impl Iterator<Item = (&str, usize, Option<i32>)> {
        self.sources.iter().flat_map(|s| {
            s.topics.iter().filter_map(|t| match t {
                SourceTopic::Internal {
                    suffix,
                    upstream,
                    partitions,
                } => Some((suffix.as_str(), *upstream, *partitions)),
                SourceTopic::External(_) => None,
            })
        })
    }

    /// Instantiates the operators for one task: a source node per declared
    /// source (index-aligned with `self.sources`) and the async targets.
    pub(crate) fn instantiate(
        &self,
        app_id: &str,
        stores: &FxHashMap<String, StoreId>,
    ) -> Result<Instance, TopologyError> {
        let mut inst = Instantiator {
            stores,
            targets: Vec::new(),
            app_id,
            merged: Default::default(),
        };
        let sources = self
            .sources
            .iter()
            .map(|s| (s.factory)(&mut inst))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Instance {
            sources,
            targets: inst.targets,
        })
    }
}

/// The operators of one task.
pub(crate) struct Instance {
    pub(crate) sources: Vec<Box<dyn SourceNode>>,
    pub(crate) targets: Vec<Arc<Mutex<dyn CompletionTarget>>>,
}

/// A topology ready to run: built by [`crate::StreamBuilder::build`].
pub struct Topology {
    pub(crate) subtopologies: Vec<SubTopology>,
}

impl Topology {
    /// The sub-topologies, in id order.
    pub fn subtopologies(&self) -> &[SubTopology] {
        &self.subtopologies
    }

    /// Name of the engine's progress store of a sub-topology (see
    /// `SlotProgress`): which records above a commit's offsets it covered.
    pub fn progress_store(subtopology: usize) -> String {
        format!("sluice-progress-{subtopology}")
    }

    /// Name of a store's changelog topic.
    pub fn changelog_topic(app_id: &str, store: &str) -> String {
        format!("{app_id}-{store}-changelog")
    }

    /// Name of the internal topic `KStream::repartition(name)` writes through.
    pub fn repartition_topic(app_id: &str, name: &str) -> String {
        format!("{app_id}-{}", Self::repartition_suffix(name))
    }

    pub(crate) fn repartition_suffix(name: &str) -> String {
        format!("{name}-repartition")
    }

    /// A human-readable description (sources, stores, internal topics).
    pub fn describe(&self, app_id: &str) -> String {
        let mut out = String::new();
        for st in &self.subtopologies {
            let _ = writeln!(out, "Sub-topology {}", st.id);
            for s in &st.sources {
                let topics: Vec<String> = s.topics.iter().map(|t| t.resolve(app_id)).collect();
                let _ = writeln!(
                    out,
                    "  source {:?}{}",
                    topics,
                    s.dead_letter
                        .as_ref()
                        .map(|d| format!(" (dead letters to {d})"))
                        .unwrap_or_default()
                );
            }
            for store in &st.stores {
                let kind = match store.kind {
                    StoreKind::KeyValue => "key-value".to_string(),
                    StoreKind::Window { retention_ms } => {
                        format!("window, retention {retention_ms} ms")
                    }
                };
                let _ = writeln!(
                    out,
                    "  store {} ({kind}){}",
                    store.name,
                    if store.changelogged {
                        format!(", changelog {}", Self::changelog_topic(app_id, &store.name))
                    } else {
                        String::new()
                    }
                );
            }
        }
        out
    }
}
