//! Operator nodes as instantiated inside a task, and the factories the DSL
//! records to instantiate them once per task.

use rustc_hash::FxHashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use sluice_state::StoreId;

use crate::context::TaskCtx;
use crate::partitions::KeyPartitioner;
use crate::record::{OutputRecord, Record};
use crate::{Codec, ProcessError, TopologyError};

/// Values that can flow between operators.
pub trait Data: Clone + Send + 'static {}
impl<T: Clone + Send + 'static> Data for T {}

/// Wall-clock and stream time, handed to operators on every punctuation tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Punctuation {
    /// Wall-clock time, ms since the epoch.
    pub wall_clock_ms: i64,
    /// The task's stream time (highest record timestamp seen), ms.
    pub stream_time: i64,
}

/// An operator inside a task, receiving records of type `(K, V)`.
pub(crate) trait Node<K, V>: Send {
    fn process(&mut self, rec: Record<K, V>, ctx: &mut TaskCtx) -> Result<(), ProcessError>;
    fn punctuate(&mut self, p: Punctuation, ctx: &mut TaskCtx) -> Result<(), ProcessError>;
    /// Called before every commit: forward anything held back (cached
    /// aggregation results), then flush the children.
    fn flush(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError>;
    /// True when this node or one below it may keep a record in flight past
    /// the call that hands it over (a processor: an async call, a hold).
    /// Aggregations answer for themselves: what they forward is theirs.
    fn may_hold(&self) -> bool;
    /// Forwards again a record the operator that owns store `node` derived
    /// before a restart (see `crate::derived`); false when no operator here
    /// owns it.
    fn resume(
        &mut self,
        node: &str,
        id: u64,
        bytes: &[u8],
        ctx: &mut TaskCtx,
    ) -> Result<bool, ProcessError>;
}

/// An async-capable operator's completion entry point.
pub(crate) trait CompletionTarget: Send {
    /// The processor's name (unique in the topology).
    fn name(&self) -> &str;
    fn init(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError>;
    /// Takes up a hold a commit converted before a restart (see
    /// `crate::derived`), the hold's record current.
    fn resume(&mut self, content: &[u8], ctx: &mut TaskCtx) -> Result<(), ProcessError>;
    fn complete(
        &mut self,
        output: Box<dyn std::any::Any + Send>,
        ctx: &mut TaskCtx,
    ) -> Result<(), ProcessError>;
}

/// Builds node instances for one task.
pub(crate) struct Instantiator<'a> {
    pub(crate) stores: &'a FxHashMap<String, StoreId>,
    pub(crate) targets: Vec<Arc<Mutex<dyn CompletionTarget>>>,
    pub(crate) app_id: &'a str,
    /// Operators below a merge, instantiated once per task and shared by the
    /// merged streams (keyed by the merged stream's slot).
    pub(crate) merged: FxHashMap<usize, Box<dyn std::any::Any>>,
}

impl Instantiator<'_> {
    pub(crate) fn store(&self, name: &str) -> Result<StoreId, TopologyError> {
        self.stores.get(name).copied().ok_or_else(|| {
            TopologyError::Invalid(format!("store {name} is not attached to this sub-topology"))
        })
    }

    /// Registers an async target; returns its node id.
    pub(crate) fn register(&mut self, target: Arc<Mutex<dyn CompletionTarget>>) -> usize {
        self.targets.push(target);
        self.targets.len() - 1
    }
}

pub(crate) type NodeFactory<K, V> =
    Arc<dyn Fn(&mut Instantiator<'_>) -> Result<Box<dyn Node<K, V>>, TopologyError> + Send + Sync>;

/// The children registered on one stream, filled while the DSL is used.
pub(crate) type Slot<K, V> = Arc<Mutex<Vec<NodeFactory<K, V>>>>;

pub(crate) fn new_slot<K, V>() -> Slot<K, V> {
    Arc::new(Mutex::new(Vec::new()))
}

/// The children of a node: forwards each record to all of them.
pub(crate) struct Forward<K, V> {
    kids: Vec<Box<dyn Node<K, V>>>,
}

impl<K: Data, V: Data> Forward<K, V> {
    pub(crate) fn instantiate(
        slot: &Slot<K, V>,
        inst: &mut Instantiator<'_>,
    ) -> Result<Self, TopologyError> {
        let factories: Vec<NodeFactory<K, V>> = slot.lock().clone();
        let kids = factories
            .iter()
            .map(|f| f(inst))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Forward { kids })
    }

    pub(crate) fn forward(
        &mut self,
        rec: Record<K, V>,
        ctx: &mut TaskCtx,
    ) -> Result<(), ProcessError> {
        let Some((last, rest)) = self.kids.split_last_mut() else {
            return Ok(());
        };
        for kid in rest {
            kid.process(rec.clone(), ctx)?;
        }
        last.process(rec, ctx)
    }

    pub(crate) fn punctuate(
        &mut self,
        p: Punctuation,
        ctx: &mut TaskCtx,
    ) -> Result<(), ProcessError> {
        for kid in &mut self.kids {
            kid.punctuate(p, ctx)?;
        }
        Ok(())
    }

    pub(crate) fn flush(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        for kid in &mut self.kids {
            kid.flush(ctx)?;
        }
        Ok(())
    }

    pub(crate) fn may_hold(&self) -> bool {
        self.kids.iter().any(|k| k.may_hold())
    }

    pub(crate) fn resume(
        &mut self,
        node: &str,
        id: u64,
        bytes: &[u8],
        ctx: &mut TaskCtx,
    ) -> Result<bool, ProcessError> {
        for kid in &mut self.kids {
            if kid.resume(node, id, bytes, ctx)? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// A function from a record to zero or more records, passed to `emit`.
pub(crate) type FlatMapFn<K, V, K2, V2> =
    Arc<dyn Fn(Record<K, V>, &mut dyn FnMut(Record<K2, V2>)) + Send + Sync>;

/// A stateless operator: a function from a record to zero or more records.
pub(crate) struct StatelessNode<K, V, K2, V2> {
    pub(crate) f: FlatMapFn<K, V, K2, V2>,
    pub(crate) kids: Forward<K2, V2>,
}

impl<K: Data, V: Data, K2: Data, V2: Data> Node<K, V> for StatelessNode<K, V, K2, V2> {
    fn process(&mut self, rec: Record<K, V>, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let mut outs = Vec::new();
        (self.f)(rec, &mut |r| outs.push(r));
        for r in outs {
            self.kids.forward(r, ctx)?;
        }
        Ok(())
    }

    fn punctuate(&mut self, p: Punctuation, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        self.kids.punctuate(p, ctx)
    }

    fn flush(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        self.kids.flush(ctx)
    }

    fn may_hold(&self) -> bool {
        self.kids.may_hold()
    }

    fn resume(
        &mut self,
        node: &str,
        id: u64,
        bytes: &[u8],
        ctx: &mut TaskCtx,
    ) -> Result<bool, ProcessError> {
        self.kids.resume(node, id, bytes, ctx)
    }
}

/// Routes each record to the first branch whose predicate accepts it.
pub(crate) struct BranchNode<K, V> {
    #[allow(clippy::type_complexity)]
    pub(crate) predicates: Vec<Arc<dyn Fn(&Record<K, V>) -> bool + Send + Sync>>,
    pub(crate) branches: Vec<Forward<K, V>>,
}

impl<K: Data, V: Data> Node<K, V> for BranchNode<K, V> {
    fn process(&mut self, rec: Record<K, V>, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        for (pred, branch) in self.predicates.iter().zip(self.branches.iter_mut()) {
            if pred(&rec) {
                return branch.forward(rec, ctx);
            }
        }
        Ok(())
    }

    fn punctuate(&mut self, p: Punctuation, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        for b in &mut self.branches {
            b.punctuate(p, ctx)?;
        }
        Ok(())
    }

    fn flush(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        for b in &mut self.branches {
            b.flush(ctx)?;
        }
        Ok(())
    }

    fn may_hold(&self) -> bool {
        self.branches.iter().any(Forward::may_hold)
    }

    fn resume(
        &mut self,
        node: &str,
        id: u64,
        bytes: &[u8],
        ctx: &mut TaskCtx,
    ) -> Result<bool, ProcessError> {
        for b in &mut self.branches {
            if b.resume(node, id, bytes, ctx)? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// Where a sink writes.
#[derive(Clone, Debug)]
pub(crate) enum SinkTopic {
    /// A user topic, by full name.
    External(String),
    /// An internal topic, by suffix (prefixed with the application id).
    Internal(String),
}

/// Encodes records and queues them for a topic.
pub(crate) struct SinkNode<K, V> {
    pub(crate) topic: String,
    pub(crate) key_codec: Arc<dyn Codec<K>>,
    pub(crate) value_codec: Arc<dyn Codec<V>>,
    /// A repartition topic: records carry their origin (see `origin_headers`).
    pub(crate) internal: bool,
    /// The partitioner and partition count records are placed with (none:
    /// the producer's murmur2 over the topic's partitions).
    pub(crate) partition_by: Option<(KeyPartitioner, i32)>,
}

impl<K: Data, V: Data> Node<K, V> for SinkNode<K, V> {
    fn process(&mut self, rec: Record<K, V>, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let key = self
            .key_codec
            .encode(&rec.key)
            .map_err(|e| ProcessError::Fatal(format!("encoding a key for {}: {e}", self.topic)))?;
        let value = self.value_codec.encode(&rec.value).map_err(|e| {
            ProcessError::Fatal(format!("encoding a value for {}: {e}", self.topic))
        })?;
        let headers = if self.internal {
            ctx.origin_headers(&rec.headers)
        } else {
            rec.headers
        };
        let partition = match (self.partition_by, &key) {
            (Some((p, n)), Some(k)) => Some(p.partition(k, n)),
            _ => None,
        };
        ctx.queue_output(OutputRecord {
            topic: self.topic.clone(),
            partition,
            key,
            value,
            timestamp: rec.timestamp,
            headers,
        })
    }

    fn punctuate(&mut self, _: Punctuation, _: &mut TaskCtx) -> Result<(), ProcessError> {
        Ok(())
    }

    fn flush(&mut self, _: &mut TaskCtx) -> Result<(), ProcessError> {
        Ok(())
    }

    fn may_hold(&self) -> bool {
        false
    }

    fn resume(&mut self, _: &str, _: u64, _: &[u8], _: &mut TaskCtx) -> Result<bool, ProcessError> {
        Ok(false)
    }
}

impl SinkTopic {
    pub(crate) fn resolve(&self, app_id: &str) -> String {
        match self {
            SinkTopic::External(t) => t.clone(),
            SinkTopic::Internal(s) => format!("{app_id}-{s}"),
        }
    }
}
