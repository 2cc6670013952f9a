//! The DSL: [`StreamBuilder`] and the stream types its methods return. Using
//! the DSL records node factories; [`StreamBuilder::build`] groups them into
//! sub-topologies, which the runtime (or the test driver) instantiates once per
//! task.

use std::collections::HashSet;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;
use sluice_state::{StoreKind, StoreSpec};

use crate::codec::BincodeCodec;
use crate::context::TaskCtx;
use crate::node::{
    new_slot, BranchNode, Data, FlatMapFn, Forward, Instantiator, Node, NodeFactory, Punctuation,
    SinkNode, SinkTopic, Slot, StatelessNode,
};
use crate::partitions::KeyPartitioner;
use crate::processor::{ProcState, Processor, ProcessorNode};
use crate::record::Record;
use crate::topology::{RawView, SourceDef, SourceNode, SourceTopic, SubTopology, Topology};
use crate::window::{EmitMode, Emitter, KvAggNode, TimeWindows, WindowAggNode, Windowed};
use crate::{Codec, ProcessError, TopologyError};

/// What to do with a source record that cannot be decoded (or that an operator
/// dead-letters).
#[derive(Clone, Debug, Default)]
pub struct SourceOptions {
    /// Dead-letter topic for undecodable records. Without one, an undecodable
    /// record stops the task (records are never dropped silently).
    pub dead_letter_topic: Option<String>,
}

struct StoreDef {
    spec: StoreSpec,
    group: Option<usize>,
}

#[derive(Default)]
struct BuilderInner {
    sources: Vec<SourceDef>,
    stores: Vec<StoreDef>,
    parent: Vec<usize>,
    names: HashSet<String>,
    errors: Vec<String>,
    /// Groups that run a custom processor (whose async calls may complete
    /// out of order).
    processor_groups: Vec<usize>,
}

impl BuilderInner {
    fn new_group(&mut self) -> usize {
        self.parent.push(self.parent.len());
        self.parent.len() - 1
    }

    fn find(&mut self, g: usize) -> usize {
        let mut root = g;
        while self.parent[root] != root {
            root = self.parent[root];
        }
        let mut cur = g;
        while self.parent[cur] != root {
            let next = self.parent[cur];
            self.parent[cur] = root;
            cur = next;
        }
        root
    }

    fn union(&mut self, a: usize, b: usize) -> usize {
        let (ra, rb) = (self.find(a), self.find(b));
        let (lo, hi) = (ra.min(rb), ra.max(rb));
        self.parent[hi] = lo;
        lo
    }

    fn claim_name(&mut self, name: &str) {
        if !self.names.insert(name.to_string()) {
            self.errors.push(format!("name {name} is used twice"));
        }
    }

    fn add_store(&mut self, spec: StoreSpec, group: Option<usize>) {
        self.claim_name(&spec.name);
        self.stores.push(StoreDef { spec, group });
    }

    /// Connects a store to a group (a store joins the sub-topology of every
    /// operator that uses it).
    fn attach_store(&mut self, name: &str, group: usize) {
        let Some(i) = self.stores.iter().position(|s| s.spec.name == name) else {
            self.errors.push(format!("store {name} is not declared"));
            return;
        };
        match self.stores[i].group {
            None => self.stores[i].group = Some(group),
            Some(g) => {
                self.union(g, group);
            }
        }
    }
}

/// Builds a topology.
#[derive(Clone, Default)]
pub struct StreamBuilder {
    inner: Arc<Mutex<BuilderInner>>,
}

impl StreamBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// A stream from one or more topics (co-partitioned, as they share tasks).
    /// Undecodable records stop the task; see [`StreamBuilder::stream_with`].
    pub fn stream<K: Data, V: Data>(
        &self,
        topics: &[&str],
        key: impl Codec<K>,
        value: impl Codec<V>,
    ) -> KStream<K, V> {
        self.stream_with(topics, key, value, SourceOptions::default())
    }

    /// A stream from topics, with a dead-letter topic for undecodable records.
    pub fn stream_with<K: Data, V: Data>(
        &self,
        topics: &[&str],
        key: impl Codec<K>,
        value: impl Codec<V>,
        options: SourceOptions,
    ) -> KStream<K, V> {
        let topics = topics
            .iter()
            .map(|t| SourceTopic::External(t.to_string()))
            .collect();
        self.source(
            topics,
            Arc::new(key),
            Arc::new(value),
            options.dead_letter_topic,
        )
    }

    fn source<K: Data, V: Data>(
        &self,
        topics: Vec<SourceTopic>,
        key: Arc<dyn Codec<K>>,
        value: Arc<dyn Codec<V>>,
        dead_letter: Option<String>,
    ) -> KStream<K, V> {
        let mut inner = self.inner.lock();
        let group = inner.new_group();
        let slot = new_slot::<K, V>();
        let kids = slot.clone();
        inner.sources.push(SourceDef {
            topics,
            group,
            dead_letter,
            factory: Arc::new(move |inst| {
                Ok(Box::new(TypedSource {
                    key: key.clone(),
                    value: value.clone(),
                    kids: Forward::instantiate(&kids, inst)?,
                }) as Box<dyn SourceNode>)
            }),
        });
        drop(inner);
        KStream {
            builder: self.clone(),
            slot,
            group,
        }
    }

    /// Declares a key-value store for processors.
    pub fn add_kv_store(&self, name: &str, changelogged: bool) {
        self.add_kv_store_with(name, changelogged, false);
    }

    /// Whether a store of this name is declared.
    pub fn has_store(&self, name: &str) -> bool {
        self.inner.lock().stores.iter().any(|s| s.spec.name == name)
    }

    /// Declares a key-value store for processors whose committed entries stay
    /// in the record cache (for keys read again, as an aggregation's are).
    pub fn add_cached_kv_store(&self, name: &str, changelogged: bool) {
        self.add_kv_store_with(name, changelogged, true);
    }

    fn add_kv_store_with(&self, name: &str, changelogged: bool, cached: bool) {
        self.inner.lock().add_store(
            StoreSpec {
                name: name.to_string(),
                kind: StoreKind::KeyValue,
                changelogged,
                cached,
            },
            None,
        );
    }

    /// Declares a window store for processors.
    pub fn add_window_store(&self, name: &str, retention: Duration) {
        self.add_window_store_with(name, retention, true);
    }

    /// Declares a window store whose committed entries stay in the record
    /// cache (`cached`, for windows read again, as an aggregation's are) or
    /// not (entries rarely read again: they would only push others out).
    pub fn add_window_store_with(&self, name: &str, retention: Duration, cached: bool) {
        self.inner.lock().add_store(
            StoreSpec {
                name: name.to_string(),
                kind: StoreKind::Window {
                    retention_ms: retention.as_millis() as i64,
                },
                changelogged: true,
                cached,
            },
            None,
        );
    }

    /// Groups the operators into sub-topologies and checks the topology.
    pub fn build(self) -> Result<Topology, TopologyError> {
        let mut inner = self.inner.lock();
        if !inner.errors.is_empty() {
            return Err(TopologyError::Invalid(inner.errors.join("; ")));
        }
        if inner.sources.is_empty() {
            return Err(TopologyError::Invalid("the topology has no source".into()));
        }
        for s in &inner.stores {
            if s.group.is_none() {
                return Err(TopologyError::Invalid(format!(
                    "store {} is used by no operator",
                    s.spec.name
                )));
            }
        }
        // Sub-topology ids in order of first source.
        let mut roots: Vec<usize> = Vec::new();
        let groups: Vec<usize> = (0..inner.sources.len())
            .map(|i| {
                let g = inner.sources[i].group;
                inner.find(g)
            })
            .collect();
        for g in &groups {
            if !roots.contains(g) {
                roots.push(*g);
            }
        }
        let index_of = |root: usize| roots.iter().position(|r| *r == root).expect("root listed");
        let mut subtopologies: Vec<SubTopology> = (0..roots.len())
            .map(|id| SubTopology {
                id,
                sources: Vec::new(),
                stores: Vec::new(),
            })
            .collect();
        let sources = std::mem::take(&mut inner.sources);
        for (mut src, g) in sources.into_iter().zip(groups) {
            // Internal sources point at the group that writes them; map to ids.
            for t in &mut src.topics {
                if let SourceTopic::Internal { upstream, .. } = t {
                    let root = inner.find(*upstream);
                    *upstream = index_of(root);
                }
            }
            subtopologies[index_of(g)].sources.push(src);
        }
        let stores: Vec<(StoreSpec, usize)> = inner
            .stores
            .iter()
            .map(|s| (s.spec.clone(), s.group.expect("checked above")))
            .collect();
        for (spec, g) in stores {
            let root = inner.find(g);
            let Some(id) = roots.iter().position(|r| *r == root) else {
                return Err(TopologyError::Invalid(format!(
                    "store {} is not reachable from a source",
                    spec.name
                )));
            };
            subtopologies[id].stores.push(spec);
        }
        for sub in &subtopologies {
            sub.check_source_ids(None)?;
        }
        // A sub-topology whose records can finish out of order (a processor)
        // or that keeps state gets a progress store: its commits record which
        // records above the committed offset they already cover.
        let processor_roots: Vec<usize> = inner
            .processor_groups
            .clone()
            .into_iter()
            .map(|g| inner.find(g))
            .collect();
        for (id, sub) in subtopologies.iter_mut().enumerate() {
            if sub.stores.is_empty() && !processor_roots.contains(&roots[id]) {
                continue;
            }
            let name = Topology::progress_store(id);
            if sub.stores.iter().any(|s| s.name == name) {
                return Err(TopologyError::Invalid(format!(
                    "store name {name} is reserved for the engine"
                )));
            }
            sub.stores.push(StoreSpec {
                name,
                kind: StoreKind::KeyValue,
                changelogged: true,
                cached: false,
            });
        }
        Ok(Topology { subtopologies })
    }
}

struct TypedSource<K, V> {
    key: Arc<dyn Codec<K>>,
    value: Arc<dyn Codec<V>>,
    kids: Forward<K, V>,
}

impl<K: Data, V: Data> SourceNode for TypedSource<K, V> {
    fn process(&mut self, view: RawView<'_>, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        let key = self
            .key
            .decode(view.key)
            .map_err(|e| ProcessError::dead_letter(format!("undecodable key: {e}"), "poison"))?;
        let value = self
            .value
            .decode(view.value)
            .map_err(|e| ProcessError::dead_letter(format!("undecodable value: {e}"), "poison"))?;
        self.kids.forward(
            Record {
                key,
                value,
                timestamp: view.timestamp,
                headers: view.headers,
            },
            ctx,
        )
    }

    fn punctuate(&mut self, p: Punctuation, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        self.kids.punctuate(p, ctx)
    }

    fn flush(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        self.kids.flush(ctx)
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

/// A stream of records of type `(K, V)`.
pub struct KStream<K, V> {
    builder: StreamBuilder,
    slot: Slot<K, V>,
    group: usize,
}

impl<K, V> Clone for KStream<K, V> {
    fn clone(&self) -> Self {
        KStream {
            builder: self.builder.clone(),
            slot: self.slot.clone(),
            group: self.group,
        }
    }
}

impl<K: Data, V: Data> KStream<K, V> {
    /// The builder this stream belongs to (to declare stores for an operator
    /// added to it).
    pub fn builder(&self) -> &StreamBuilder {
        &self.builder
    }

    fn child<K2: Data, V2: Data>(
        &self,
        factory: impl Fn(Slot<K2, V2>) -> NodeFactory<K, V>,
    ) -> KStream<K2, V2> {
        let slot = new_slot::<K2, V2>();
        self.slot.lock().push(factory(slot.clone()));
        KStream {
            builder: self.builder.clone(),
            slot,
            group: self.group,
        }
    }

    fn stateless<K2: Data, V2: Data>(
        &self,
        f: impl Fn(Record<K, V>, &mut dyn FnMut(Record<K2, V2>)) + Send + Sync + 'static,
    ) -> KStream<K2, V2> {
        let f: FlatMapFn<K, V, K2, V2> = Arc::new(f);
        self.child(move |kids: Slot<K2, V2>| {
            let f = f.clone();
            Arc::new(move |inst: &mut Instantiator<'_>| {
                Ok(Box::new(StatelessNode {
                    f: f.clone(),
                    kids: Forward::instantiate(&kids, inst)?,
                }) as Box<dyn Node<K, V>>)
            })
        })
    }

    /// Transforms each record.
    pub fn map<K2: Data, V2: Data>(
        &self,
        f: impl Fn(Record<K, V>) -> Record<K2, V2> + Send + Sync + 'static,
    ) -> KStream<K2, V2> {
        self.stateless(move |r, out| out(f(r)))
    }

    /// Transforms each value, keeping key, timestamp and headers.
    pub fn map_values<V2: Data>(
        &self,
        f: impl Fn(&K, V) -> V2 + Send + Sync + 'static,
    ) -> KStream<K, V2> {
        self.stateless(move |r: Record<K, V>, out| {
            let v = f(&r.key, r.value);
            out(Record {
                key: r.key,
                value: v,
                timestamp: r.timestamp,
                headers: r.headers,
            })
        })
    }

    /// Keeps the records the predicate accepts.
    pub fn filter(
        &self,
        pred: impl Fn(&Record<K, V>) -> bool + Send + Sync + 'static,
    ) -> KStream<K, V> {
        self.stateless(move |r, out| {
            if pred(&r) {
                out(r)
            }
        })
    }

    /// Turns each record into zero or more records.
    pub fn flat_map<K2: Data, V2: Data, I>(
        &self,
        f: impl Fn(Record<K, V>) -> I + Send + Sync + 'static,
    ) -> KStream<K2, V2>
    where
        I: IntoIterator<Item = Record<K2, V2>>,
    {
        self.stateless(move |r, out| {
            for r2 in f(r) {
                out(r2)
            }
        })
    }

    /// Splits the stream: each record goes to the first branch whose predicate
    /// accepts it (records no predicate accepts are dropped; add a catch-all).
    #[allow(clippy::type_complexity)]
    pub fn branch(
        &self,
        predicates: Vec<Box<dyn Fn(&Record<K, V>) -> bool + Send + Sync>>,
    ) -> Vec<KStream<K, V>> {
        let preds: Vec<Arc<dyn Fn(&Record<K, V>) -> bool + Send + Sync>> =
            predicates.into_iter().map(Arc::from).collect();
        let slots: Vec<Slot<K, V>> = preds.iter().map(|_| new_slot()).collect();
        let kid_slots = slots.clone();
        self.slot
            .lock()
            .push(Arc::new(move |inst: &mut Instantiator<'_>| {
                Ok(Box::new(BranchNode {
                    predicates: preds.clone(),
                    branches: kid_slots
                        .iter()
                        .map(|s| Forward::instantiate(s, inst))
                        .collect::<Result<Vec<_>, _>>()?,
                }) as Box<dyn Node<K, V>>)
            }));
        slots
            .into_iter()
            .map(|slot| KStream {
                builder: self.builder.clone(),
                slot,
                group: self.group,
            })
            .collect()
    }

    /// Merges another stream into this one. Both then share tasks, so their
    /// sources must be co-partitioned (checked at start).
    pub fn merge(&self, other: &KStream<K, V>) -> KStream<K, V> {
        let group = self.builder.inner.lock().union(self.group, other.group);
        let slot = new_slot::<K, V>();
        // The operators below are instantiated once per task and shared by
        // both streams: an aggregation there is one operator with one cache,
        // whichever input a record came from.
        let id = Arc::as_ptr(&slot) as *const () as usize;
        for (i, parent) in [&self.slot, &other.slot].into_iter().enumerate() {
            let kids = slot.clone();
            parent
                .lock()
                .push(Arc::new(move |inst: &mut Instantiator<'_>| {
                    let shared = match inst
                        .merged
                        .get(&id)
                        .and_then(|k| k.downcast_ref::<SharedKids<K, V>>())
                    {
                        Some(k) => k.clone(),
                        None => {
                            let k: SharedKids<K, V> =
                                Arc::new(Mutex::new(Forward::instantiate(&kids, inst)?));
                            inst.merged.insert(id, Box::new(k.clone()));
                            k
                        }
                    };
                    Ok(Box::new(Merge {
                        kids: shared,
                        owner: i == 0,
                    }) as Box<dyn Node<K, V>>)
                }));
        }
        KStream {
            builder: self.builder.clone(),
            slot,
            group,
        }
    }

    /// Writes the stream to a topic.
    pub fn to(&self, topic: &str, key: impl Codec<K>, value: impl Codec<V>) {
        self.sink(
            SinkTopic::External(topic.to_string()),
            Arc::new(key),
            Arc::new(value),
            None,
        );
    }

    fn sink(
        &self,
        topic: SinkTopic,
        key: Arc<dyn Codec<K>>,
        value: Arc<dyn Codec<V>>,
        partition_by: Option<(KeyPartitioner, i32)>,
    ) {
        self.slot
            .lock()
            .push(Arc::new(move |inst: &mut Instantiator<'_>| {
                Ok(Box::new(SinkNode {
                    topic: topic.resolve(inst.app_id),
                    key_codec: key.clone(),
                    value_codec: value.clone(),
                    internal: matches!(topic, SinkTopic::Internal(_)),
                    partition_by,
                }) as Box<dyn Node<K, V>>)
            }));
    }

    /// Runs a custom processor (see [`Processor`]) with access to `stores`.
    pub fn process<P>(
        &self,
        name: &str,
        stores: &[&str],
        supplier: impl Fn() -> P + Send + Sync + 'static,
    ) -> KStream<P::OutKey, P::OutValue>
    where
        P: Processor<K, V>,
    {
        {
            let mut inner = self.builder.inner.lock();
            inner.claim_name(name);
            inner.processor_groups.push(self.group);
            for s in stores {
                inner.attach_store(s, self.group);
            }
        }
        let supplier = Arc::new(supplier);
        let name = name.to_string();
        self.child(move |kids: Slot<P::OutKey, P::OutValue>| {
            let supplier = supplier.clone();
            let name = name.clone();
            Arc::new(move |inst: &mut Instantiator<'_>| {
                let kids = Forward::instantiate(&kids, inst)?;
                let state = Arc::new(Mutex::new(ProcState {
                    processor: supplier(),
                    kids,
                    node: 0,
                    name: name.clone(),
                    _in: PhantomData,
                }));
                let node = inst.register(state.clone());
                state.lock().node = node;
                Ok(Box::new(ProcessorNode { state }) as Box<dyn Node<K, V>>)
            })
        })
    }

    /// [`KStream::repartition`] with codecs of one's own: a stream of raw
    /// bytes goes through as the bytes it was read as (its keys hashed as
    /// they are, so the partition a key lands on is the one a producer's
    /// murmur2 partitioner picks). Each record carries its origin in headers
    /// ([`crate::origin_headers`]): a record dead-lettered downstream goes
    /// to the dead-letter topic of the source it first came from, naming
    /// that source's topic, partition and offset, with the bytes the
    /// repartition topic holds. `partitions` sets the topic's partition
    /// count (default: `StreamsConfig::repartition_partitions`, else the
    /// writer's), so streams from topics of different counts can meet.
    pub fn repartition_with(
        &self,
        name: &str,
        key: impl Codec<K>,
        value: impl Codec<V>,
        partitions: Option<i32>,
    ) -> KStream<K, V> {
        self.repartition_inner(name, key, value, partitions, None)
    }

    /// [`KStream::repartition_with`] into `partitions` partitions chosen by
    /// `partitioner` from the key bytes (instead of the producer's murmur2):
    /// records land where producers using that partitioner put the same
    /// key, so a stream read from a topic they wrote can be merged with its
    /// own repartitioned records in one task per key.
    pub fn repartition_partitioned(
        &self,
        name: &str,
        key: impl Codec<K>,
        value: impl Codec<V>,
        partitions: i32,
        partitioner: KeyPartitioner,
    ) -> KStream<K, V> {
        self.repartition_inner(
            name,
            key,
            value,
            Some(partitions),
            Some((partitioner, partitions)),
        )
    }

    fn repartition_inner(
        &self,
        name: &str,
        key: impl Codec<K>,
        value: impl Codec<V>,
        partitions: Option<i32>,
        partition_by: Option<(KeyPartitioner, i32)>,
    ) -> KStream<K, V> {
        let suffix = Topology::repartition_suffix(name);
        self.builder.inner.lock().claim_name(&suffix);
        let (key, value): (Arc<dyn Codec<K>>, Arc<dyn Codec<V>>) = (Arc::new(key), Arc::new(value));
        self.sink(
            SinkTopic::Internal(suffix.clone()),
            key.clone(),
            value.clone(),
            partition_by,
        );
        self.builder.source(
            vec![SourceTopic::Internal {
                suffix,
                upstream: self.group,
                partitions,
            }],
            key,
            value,
            None,
        )
    }

    /// Groups by the existing key (the input must already be partitioned by it).
    pub fn group_by_key(&self) -> KGroupedStream<K, V> {
        KGroupedStream {
            stream: self.clone(),
            repartition: false,
            emit: EmitMode::OnCommit,
        }
    }
}

impl<K, V> KStream<K, V>
where
    K: Data + Serialize + DeserializeOwned,
    V: Data + Serialize + DeserializeOwned,
{
    /// Writes the stream through an internal topic `<app-id>-<name>-repartition`
    /// partitioned by key, and continues from it in a new sub-topology.
    pub fn repartition(&self, name: &str) -> KStream<K, V> {
        self.repartition_with(
            name,
            BincodeCodec::<K>::default(),
            BincodeCodec::<V>::default(),
            None,
        )
    }

    /// Re-keys the stream for grouping; the aggregation repartitions by the new key.    /// Re-keys the stream for grouping; the aggregation repartitions by the new key.
    pub fn group_by<K2>(
        &self,
        f: impl Fn(&Record<K, V>) -> K2 + Send + Sync + 'static,
    ) -> KGroupedStream<K2, V>
    where
        K2: Data + Serialize + DeserializeOwned,
    {
        KGroupedStream {
            stream: self.map(move |r| {
                let key = f(&r);
                Record {
                    key,
                    value: r.value,
                    timestamp: r.timestamp,
                    headers: r.headers,
                }
            }),
            repartition: true,
            emit: EmitMode::OnCommit,
        }
    }
}

/// The operators below a merge, shared by the merged streams of a task.
type SharedKids<K, V> = Arc<Mutex<Forward<K, V>>>;

/// One of the merged streams' way into their shared operators. Records go
/// through both; the first stream's passes on the once-per-task calls
/// (init, flush, punctuation, resuming), so the shared operators get each
/// once.
struct Merge<K, V> {
    kids: SharedKids<K, V>,
    owner: bool,
}

impl<K: Data, V: Data> Node<K, V> for Merge<K, V> {
    fn process(&mut self, rec: Record<K, V>, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        self.kids.lock().forward(rec, ctx)
    }

    fn punctuate(&mut self, p: Punctuation, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        match self.owner {
            true => self.kids.lock().punctuate(p, ctx),
            false => Ok(()),
        }
    }

    fn flush(&mut self, ctx: &mut TaskCtx) -> Result<(), ProcessError> {
        match self.owner {
            true => self.kids.lock().flush(ctx),
            false => Ok(()),
        }
    }

    fn may_hold(&self) -> bool {
        self.kids.lock().may_hold()
    }

    fn resume(
        &mut self,
        node: &str,
        id: u64,
        bytes: &[u8],
        ctx: &mut TaskCtx,
    ) -> Result<bool, ProcessError> {
        match self.owner {
            true => self.kids.lock().resume(node, id, bytes, ctx),
            false => Ok(false),
        }
    }
}

/// A stream grouped by key, ready to aggregate.
pub struct KGroupedStream<K, V> {
    stream: KStream<K, V>,
    repartition: bool,
    emit: EmitMode,
}

impl<K, V> KGroupedStream<K, V>
where
    K: Data + Serialize + DeserializeOwned,
    V: Data + Serialize + DeserializeOwned,
{
    fn input(&self, name: &str) -> KStream<K, V> {
        if self.repartition {
            self.stream.repartition(name)
        } else {
            self.stream.clone()
        }
    }

    /// Forward every update instead of the latest value per key once per
    /// commit (the default, like Kafka Streams' record cache).
    pub fn emit_on_update(mut self) -> Self {
        self.emit = EmitMode::OnUpdate;
        self
    }

    /// Windows the grouped stream.
    pub fn windowed_by(self, windows: TimeWindows) -> TimeWindowedKStream<K, V> {
        let emit = self.emit;
        TimeWindowedKStream {
            grouped: self,
            windows,
            emit,
            retention: None,
        }
    }

    /// Aggregates per key into a key-value store named `name`.
    pub fn aggregate<A>(
        &self,
        name: &str,
        init: impl Fn() -> A + Send + Sync + 'static,
        agg: impl Fn(&K, &V, A) -> A + Send + Sync + 'static,
    ) -> KTable<K, A>
    where
        A: Data + Serialize + DeserializeOwned,
    {
        let input = self.input(name);
        {
            let mut inner = input.builder.inner.lock();
            inner.add_store(
                StoreSpec {
                    name: name.to_string(),
                    kind: StoreKind::KeyValue,
                    changelogged: true,
                    cached: true,
                },
                Some(input.group),
            );
        }
        let init: Arc<dyn Fn() -> A + Send + Sync> = Arc::new(init);
        let agg: crate::window::AggFn<K, V, A> = Arc::new(agg);
        let store = name.to_string();
        let emit = self.emit;
        KTable {
            stream: input.child(move |kids: Slot<K, A>| {
                let (init, agg, store) = (init.clone(), agg.clone(), store.clone());
                Arc::new(move |inst: &mut Instantiator<'_>| {
                    Ok(Box::new(KvAggNode {
                        store: inst.store(&store)?,
                        init: init.clone(),
                        agg: agg.clone(),
                        emit,
                        out: Emitter::new(Forward::instantiate(&kids, inst)?, &store),
                        pending: Default::default(),
                    }) as Box<dyn Node<K, V>>)
                })
            }),
        }
    }

    /// Counts records per key.
    pub fn count(&self, name: &str) -> KTable<K, u64> {
        self.aggregate(name, || 0u64, |_, _, c| c + 1)
    }
}

/// A grouped, windowed stream, ready to aggregate.
pub struct TimeWindowedKStream<K, V> {
    grouped: KGroupedStream<K, V>,
    windows: TimeWindows,
    emit: EmitMode,
    retention: Option<Duration>,
}

impl<K, V> TimeWindowedKStream<K, V>
where
    K: Data + Serialize + DeserializeOwned,
    V: Data + Serialize + DeserializeOwned,
{
    /// Forward every update instead of the latest value per window once per
    /// commit (the default).
    pub fn emit_on_update(mut self) -> Self {
        self.emit = EmitMode::OnUpdate;
        self
    }

    /// Emit each window once, when it closes (stream time past end + grace),
    /// instead of on every update.
    pub fn emit_final(mut self) -> Self {
        self.emit = EmitMode::OnWindowClose;
        self
    }

    /// Keeps windows this long (at least window size plus grace).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Aggregates per key and window into a window store named `name`.
    pub fn aggregate<A>(
        &self,
        name: &str,
        init: impl Fn() -> A + Send + Sync + 'static,
        agg: impl Fn(&K, &V, A) -> A + Send + Sync + 'static,
    ) -> KTable<Windowed<K>, A>
    where
        A: Data + Serialize + DeserializeOwned,
    {
        let input = self.grouped.input(name);
        let windows = self.windows;
        let min_retention = windows.size_ms + windows.grace_ms;
        let retention_ms = self
            .retention
            .map(|r| r.as_millis() as i64)
            .unwrap_or(0)
            .max(min_retention);
        {
            let mut inner = input.builder.inner.lock();
            if let Err(e) = windows.validate() {
                inner.errors.push(format!("{name}: {e}"));
            }
            inner.add_store(
                StoreSpec {
                    name: name.to_string(),
                    kind: StoreKind::Window { retention_ms },
                    changelogged: true,
                    cached: true,
                },
                Some(input.group),
            );
        }
        let init: Arc<dyn Fn() -> A + Send + Sync> = Arc::new(init);
        let agg: crate::window::AggFn<K, V, A> = Arc::new(agg);
        let store = name.to_string();
        let emit = self.emit;
        KTable {
            stream: input.child(move |kids: Slot<Windowed<K>, A>| {
                let (init, agg, store) = (init.clone(), agg.clone(), store.clone());
                Arc::new(move |inst: &mut Instantiator<'_>| {
                    Ok(Box::new(WindowAggNode::new(
                        inst.store(&store)?,
                        &store,
                        windows,
                        retention_ms,
                        emit,
                        init.clone(),
                        agg.clone(),
                        Forward::instantiate(&kids, inst)?,
                    )) as Box<dyn Node<K, V>>)
                })
            }),
        }
    }

    /// Counts records per key and window.
    pub fn count(&self, name: &str) -> KTable<Windowed<K>, u64> {
        self.aggregate(name, || 0u64, |_, _, c| c + 1)
    }

    /// Combines values per key and window.
    pub fn reduce(
        &self,
        name: &str,
        f: impl Fn(&V, &V) -> V + Send + Sync + 'static,
    ) -> KTable<Windowed<K>, V> {
        self.aggregate(
            name,
            || None::<V>,
            move |_, v, acc| {
                Some(match acc {
                    None => v.clone(),
                    Some(a) => f(&a, v),
                })
            },
        )
        .map_values_table(|v| v.expect("a window holds at least one record"))
    }
}

/// The changelog stream of an aggregation's table.
pub struct KTable<K, V> {
    stream: KStream<K, V>,
}

impl<K: Data, V: Data> KTable<K, V> {
    /// The table's updates as a stream.
    pub fn to_stream(&self) -> KStream<K, V> {
        self.stream.clone()
    }

    fn map_values_table<V2: Data>(
        &self,
        f: impl Fn(V) -> V2 + Send + Sync + 'static,
    ) -> KTable<K, V2> {
        KTable {
            stream: self.stream.map_values(move |_, v| f(v)),
        }
    }
}
