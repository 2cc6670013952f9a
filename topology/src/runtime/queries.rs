//! Interactive queries (Kafka Streams' `queryMetadataForKey` and read-only
//! stores): which instance holds a key's state, and reads of the state this
//! instance holds, from any thread while processing goes on.
//!
//! A key's partition is the one its source topic's producers chose
//! ([`StreamsConfig::key_partitioner`], murmur2 for the engine's own
//! repartition topics), so the task (sub-topology, partition) that holds its
//! state is known. This instance knows its own tasks; other instances'
//! come from their claims on the instances topic (see `instances`). Reads go
//! to RocksDB through the task's [`StoreReader`]: they see the state as of
//! the task's last commit and never wait for processing.
//!
//! It also tells how much of a sub-topology this instance holds
//! ([`Queries::assignment`]), and when that changes
//! ([`Queries::assignment_changes`]): an instance sharing something with the
//! rest of its group (a provider's rate limit, say) in proportion to its
//! partitions follows it from there.

use std::collections::HashMap;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use sluice_state::{StateError, StoreKind, StoreReader, WindowRange};
use tokio::sync::watch;

use super::claim::{Directory, InstanceClaim};
use super::clock::now_ms;
use super::config::StreamsConfig;
use super::local_tasks::{LocalTasks, NoReader};
use crate::partitions::KeyPartitioner;
use crate::topology::SourceTopic;
use crate::{from_bincode, to_bincode, CodecError, TaskId, Topology};

/// Where a key's state lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyMetadata {
    /// The partition (of the store's sub-topology's source topics) the key
    /// belongs to.
    pub partition: i32,
    /// The `application_server` of the instance holding it, if known: this
    /// instance's own when it is assigned here (running or restoring).
    pub host: Option<String>,
    /// True when this instance runs the task holding it: its state can be
    /// read here now.
    pub local: bool,
    /// True when the task is assigned here and still restoring its state.
    pub restoring: bool,
}

/// How much of a sub-topology this instance holds: its tasks assigned here
/// (running or restoring) out of all its tasks (its partition count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The sub-topology's tasks assigned to this instance.
    pub assigned: usize,
    /// The sub-topology's partition count: its tasks in the whole group.
    pub partitions: usize,
}

impl Assignment {
    /// `assigned / partitions`, in 0..=1. The shares of the group's instances
    /// sum to 1 once its assignment settles, and to less while partitions
    /// move (a revoked task leaves its old owner before it reaches the new).
    pub fn share(&self) -> f64 {
        if self.partitions == 0 {
            0.0
        } else {
            (self.assigned as f64 / self.partitions as f64).min(1.0)
        }
    }
}

/// Why a query could not be answered.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// No store of this name in the topology.
    #[error("unknown store {0}")]
    UnknownStore(String),
    /// The store is not of the kind the query reads.
    #[error("store {store} is not a {expected} store")]
    WrongStoreKind {
        /// The store.
        store: String,
        /// `window` or `key-value`.
        expected: &'static str,
    },
    /// The stores read together belong to different sub-topologies (so to
    /// different tasks).
    #[error("stores {0} and {1} are not in the same sub-topology")]
    NotCoLocated(String, String),
    /// The task holding the partition does not run here (ask its host).
    #[error("partition {partition} of store {store} is not held by this instance")]
    NotLocal {
        /// The store.
        store: String,
        /// The key's partition.
        partition: i32,
    },
    /// The task holding the partition is assigned here and restoring (ask
    /// again later).
    #[error("partition {partition} of store {store} is restoring here")]
    Restoring {
        /// The store.
        store: String,
        /// The key's partition.
        partition: i32,
    },
    /// Reading the store failed.
    #[error(transparent)]
    State(#[from] StateError),
    /// A stored value did not decode as the type asked for.
    #[error("store {store}: {error}")]
    Codec {
        /// The store.
        store: String,
        /// What failed.
        error: CodecError,
    },
}

impl QueryError {
    /// True when the state is held elsewhere or not ready yet: ask the
    /// key's host, or again later. Other errors are the caller's mistake or
    /// a store fault.
    pub fn unavailable(&self) -> bool {
        matches!(
            self,
            QueryError::NotLocal { .. } | QueryError::Restoring { .. }
        )
    }
}

/// A store as queries see it.
#[derive(Clone, Copy, Debug)]
struct StoreInfo {
    subtopology: usize,
    window: bool,
}

/// A sub-topology as queries see it.
#[derive(Clone, Debug)]
struct SubInfo {
    topics: Vec<String>,
    partitions: i32,
    partitioner: KeyPartitioner,
}

/// Interactive queries of a running application: cheap to clone, usable
/// from any thread (e.g. HTTP handlers).
#[derive(Clone, Debug)]
pub struct Queries {
    inner: Arc<QueriesInner>,
}

#[derive(Debug)]
struct QueriesInner {
    server: Option<String>,
    stores: HashMap<String, StoreInfo>,
    subs: Vec<SubInfo>,
    local: Arc<LocalTasks>,
    directory: Option<Arc<Directory>>,
    claim_timeout_ms: i64,
}

impl Queries {
    /// Queries over `topology`, whose sub-topologies have `partitions`
    /// partitions each (by id).
    pub(crate) fn new(
        cfg: &StreamsConfig,
        topology: &Topology,
        partitions: &[i32],
        local: Arc<LocalTasks>,
        directory: Option<Arc<Directory>>,
    ) -> Self {
        let mut stores = HashMap::new();
        let mut subs = Vec::new();
        for st in topology.subtopologies() {
            for s in st.stores() {
                stores.insert(
                    s.name.clone(),
                    StoreInfo {
                        subtopology: st.id,
                        window: matches!(s.kind, StoreKind::Window { .. }),
                    },
                );
            }
            // Producers of the source topics chose the partitions; the
            // engine writes its repartition topics with murmur2.
            let external = st
                .sources
                .iter()
                .flat_map(|s| &s.topics)
                .any(|t| matches!(t, SourceTopic::External(_)));
            subs.push(SubInfo {
                topics: st.source_topics(&cfg.application_id),
                partitions: partitions.get(st.id).copied().unwrap_or(1),
                partitioner: if external {
                    cfg.key_partitioner
                } else {
                    KeyPartitioner::Murmur2
                },
            });
        }
        Queries {
            inner: Arc::new(QueriesInner {
                server: cfg.application_server.clone(),
                stores,
                subs,
                local,
                directory,
                claim_timeout_ms: cfg.instance_claim_timeout().as_millis() as i64,
            }),
        }
    }

    /// This instance's `application_server`.
    pub fn application_server(&self) -> Option<&str> {
        self.inner.server.as_deref()
    }

    fn store(&self, store: &str) -> Result<StoreInfo, QueryError> {
        self.inner
            .stores
            .get(store)
            .copied()
            .ok_or_else(|| QueryError::UnknownStore(store.to_string()))
    }

    /// Where the state of `key` in `store` lives. `key` is the key as its
    /// source topic carries it (the bytes the producers' partitioner
    /// hashed), which may differ from its encoding in the store.
    pub fn metadata_for_key(&self, store: &str, key: &[u8]) -> Result<KeyMetadata, QueryError> {
        let info = self.store(store)?;
        let sub = &self.inner.subs[info.subtopology];
        let partition = sub.partitioner.partition(key, sub.partitions);
        let id = TaskId {
            subtopology: info.subtopology as u32,
            partition,
        };
        let (running, assigned) = self.inner.local.state_of(id);
        let own = self.inner.server.clone();
        let host = if assigned {
            own
        } else {
            self.inner.directory.as_ref().and_then(|d| {
                d.owner(
                    &sub.topics,
                    partition,
                    now_ms(),
                    self.inner.claim_timeout_ms,
                    own.as_deref(),
                )
            })
        };
        Ok(KeyMetadata {
            partition,
            host,
            local: running,
            restoring: assigned && !running,
        })
    }

    /// How much of the sub-topology holding `store` is assigned to this
    /// instance (see [`Assignment::share`]). Before the first assignment, and
    /// between a revocation and the assignment that follows, nothing is.
    pub fn assignment(&self, store: &str) -> Result<Assignment, QueryError> {
        let sub = self.store(store)?.subtopology;
        Ok(Assignment {
            assigned: self.inner.local.assigned_in(sub),
            partitions: usize::try_from(self.inner.subs[sub].partitions).unwrap_or(0),
        })
    }

    /// A receiver marked changed whenever this instance's tasks change
    /// (assigned, revoked, restored): wait on it
    /// (`changed().await`) and read [`Queries::assignment`] again.
    pub fn assignment_changes(&self) -> watch::Receiver<()> {
        self.inner.local.changes()
    }

    /// The instances known to hold partitions (their fresh claims), this one
    /// included once its own claim was read back.
    pub fn instances(&self) -> Vec<InstanceClaim> {
        self.inner
            .directory
            .as_ref()
            .map(|d| d.fresh(now_ms(), self.inner.claim_timeout_ms))
            .unwrap_or_default()
    }

    /// The committed windows of `key` in each range (stores of one
    /// sub-topology), read from one snapshot of the local task holding
    /// `partition` (see [`Queries::metadata_for_key`]). Keys and values are
    /// bincode-encoded, as [`crate::WindowStore`] and the DSL's windowed
    /// aggregations store them.
    pub fn fetch_windows<K: Serialize, V: DeserializeOwned>(
        &self,
        partition: i32,
        key: &K,
        ranges: &[WindowRange<'_>],
    ) -> Result<Vec<Vec<(i64, V)>>, QueryError> {
        let Some(first) = ranges.first() else {
            return Ok(Vec::new());
        };
        let sub = self.store(first.store)?.subtopology;
        for r in ranges {
            let info = self.store(r.store)?;
            if !info.window {
                return Err(QueryError::WrongStoreKind {
                    store: r.store.to_string(),
                    expected: "window",
                });
            }
            if info.subtopology != sub {
                return Err(QueryError::NotCoLocated(
                    first.store.to_string(),
                    r.store.to_string(),
                ));
            }
        }
        let id = TaskId {
            subtopology: sub as u32,
            partition,
        };
        let reader = self.reader(id, first.store)?;
        let found = reader
            .fetch_windows(&to_bincode(key), ranges)
            .map_err(|e| self.closed_as_moved(e, id, first.store))?;
        found
            .into_iter()
            .zip(ranges)
            .map(|(windows, r)| {
                windows
                    .into_iter()
                    .map(|(start, v)| {
                        from_bincode(&v.value).map(|v| (start, v)).map_err(|error| {
                            QueryError::Codec {
                                store: r.store.to_string(),
                                error,
                            }
                        })
                    })
                    .collect()
            })
            .collect()
    }

    /// The committed value of `key` in a key-value store, from the local
    /// task holding `partition`. Keys and values are bincode-encoded, as
    /// [`crate::KvStore`] stores them.
    pub fn get<K: Serialize, V: DeserializeOwned>(
        &self,
        store: &str,
        partition: i32,
        key: &K,
    ) -> Result<Option<V>, QueryError> {
        let info = self.store(store)?;
        if info.window {
            return Err(QueryError::WrongStoreKind {
                store: store.to_string(),
                expected: "key-value",
            });
        }
        let id = TaskId {
            subtopology: info.subtopology as u32,
            partition,
        };
        let reader = self.reader(id, store)?;
        let value = reader
            .get(store, &to_bincode(key))
            .map_err(|e| self.closed_as_moved(e, id, store))?;
        value
            .map(|v| from_bincode(&v.value))
            .transpose()
            .map_err(|error| QueryError::Codec {
                store: store.to_string(),
                error,
            })
    }

    /// The state reader of task `id` (for a query of `store`), or why
    /// there is none.
    fn reader(&self, id: TaskId, store: &str) -> Result<StoreReader, QueryError> {
        let (store, partition) = (store.to_string(), id.partition);
        self.inner.local.reader(id).map_err(|why| match why {
            NoReader::Restoring => QueryError::Restoring { store, partition },
            NoReader::NotAssigned => QueryError::NotLocal { store, partition },
        })
    }

    /// A reader closed under the query: its task just left (or is being
    /// restored again).
    fn closed_as_moved(&self, e: StateError, id: TaskId, store: &str) -> QueryError {
        match e {
            StateError::Closed => self
                .reader(id, store)
                .err()
                .unwrap_or(QueryError::NotLocal {
                    store: store.to_string(),
                    partition: id.partition,
                }),
            other => QueryError::State(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::time::Duration;

    use super::*;
    use crate::{BytesCodec, Processor, ProcessorContext, Record, StreamBuilder};

    /// Counts per key in a window store (what the queries read).
    struct Count;

    impl Processor<Option<Vec<u8>>, Option<Vec<u8>>> for Count {
        type OutKey = Option<Vec<u8>>;
        type OutValue = Option<Vec<u8>>;
        type Output = ();

        fn process(
            &mut self,
            record: Record<Option<Vec<u8>>, Option<Vec<u8>>>,
            ctx: &mut ProcessorContext<'_, Self::OutKey, Self::OutValue, ()>,
        ) -> Result<(), crate::ProcessError> {
            let key =
                String::from_utf8_lossy(record.key.as_deref().unwrap_or_default()).into_owned();
            let mut w = ctx.window::<String, u64>("counts")?;
            let n = w.get(&key, 0)?.unwrap_or(0);
            w.put(&key, 0, &(n + 1));
            ctx.forward(record)
        }
    }

    fn topology() -> Topology {
        let b = StreamBuilder::new();
        b.add_window_store("counts", Duration::from_secs(60));
        b.add_kv_store("kv", true);
        b.stream(&["in"], BytesCodec, BytesCodec)
            .process("count", &["counts", "kv"], || Count);
        b.build().unwrap()
    }

    fn queries(
        partitioner: KeyPartitioner,
        local: Arc<LocalTasks>,
        directory: Arc<Directory>,
    ) -> Queries {
        let mut cfg = StreamsConfig::new("app", "localhost:9092", "/tmp/none");
        cfg.application_server = Some("http://me".into());
        cfg.key_partitioner = partitioner;
        cfg.session_timeout = Duration::from_secs(10);
        Queries::new(&cfg, &topology(), &[4], local, Some(directory))
    }

    fn task(partition: i32) -> TaskId {
        TaskId {
            subtopology: 0,
            partition,
        }
    }

    fn claim(server: &str, partitions: &[i32], updated_ms: i64) -> Vec<u8> {
        serde_json::to_vec(&InstanceClaim {
            server: server.into(),
            partitions: [("in".to_string(), partitions.to_vec())].into(),
            assigned_ms: 1,
            updated_ms,
            signature: None,
        })
        .unwrap()
    }

    #[test]
    fn metadata_names_this_instance_or_the_claims_owner_by_the_configured_partitioner() {
        let key = b"hejsan";
        let murmur = KeyPartitioner::Murmur2.partition(key, 4);
        let crc = KeyPartitioner::Crc32.partition(key, 4);
        assert_ne!(murmur, crc, "the key tells the partitioners apart");
        let local = Arc::new(LocalTasks::default());
        let directory = Arc::new(Directory::default());
        let now = now_ms();
        directory.apply(
            Some(b"http://other"),
            Some(&claim("http://other", &[crc], now)),
        );
        let q = queries(KeyPartitioner::Crc32, local.clone(), directory.clone());
        let md = q.metadata_for_key("counts", key).unwrap();
        assert_eq!(
            md,
            KeyMetadata {
                partition: crc,
                host: Some("http://other".into()),
                local: false,
                restoring: false,
            }
        );
        // The same key under murmur2 lands in a partition nobody claims.
        let q2 = queries(KeyPartitioner::Murmur2, local.clone(), directory.clone());
        let md = q2.metadata_for_key("kv", key).unwrap();
        assert_eq!((md.partition, md.host), (murmur, None));
        // Assigned here: this instance, restoring until it runs.
        local.publish(BTreeSet::new(), [task(crc)].into(), |_| None);
        let md = q.metadata_for_key("counts", key).unwrap();
        assert_eq!(md.host.as_deref(), Some("http://me"));
        assert!(md.restoring && !md.local);
        let range = WindowRange {
            store: "counts",
            from_ms: 0,
            to_ms: 1,
        };
        let err = q
            .fetch_windows::<String, u64>(crc, &"hejsan".into(), &[range])
            .unwrap_err();
        assert!(
            matches!(err, QueryError::Restoring { .. }) && err.unavailable(),
            "{err}"
        );
        // An old claim counts as gone (3 session timeouts).
        directory.apply(
            Some(b"http://other"),
            Some(&claim("http://other", &[crc], now - 31_000)),
        );
        local.publish(BTreeSet::new(), BTreeSet::new(), |_| None);
        assert_eq!(q.metadata_for_key("counts", key).unwrap().host, None);
        assert!(matches!(
            q.metadata_for_key("nope", key),
            Err(QueryError::UnknownStore(_))
        ));
    }

    #[test]
    fn assignment_counts_the_stores_subtopology_tasks_held_here_and_signals_changes() {
        let local = Arc::new(LocalTasks::default());
        let q = queries(KeyPartitioner::Murmur2, local.clone(), Default::default());
        let mut changes = q.assignment_changes();
        let held = |q: &Queries| q.assignment("counts").unwrap();
        assert_eq!(
            held(&q),
            Assignment {
                assigned: 0,
                partitions: 4
            }
        );
        assert_eq!(held(&q).share(), 0.0);
        assert!(!changes.has_changed().unwrap());
        // One task running, one restoring: both are held here.
        local.publish([task(1)].into(), [task(1), task(3)].into(), |_| None);
        assert!(changes.has_changed().unwrap());
        changes.borrow_and_update();
        assert_eq!(held(&q).assigned, 2);
        assert_eq!(held(&q).share(), 0.5);
        // The same tasks published again change nothing.
        local.publish([task(1)].into(), [task(1), task(3)].into(), |_| None);
        assert!(!changes.has_changed().unwrap());
        // Tasks of another sub-topology do not count.
        let other = TaskId {
            subtopology: 1,
            partition: 0,
        };
        local.publish(BTreeSet::new(), [task(0), other].into(), |_| None);
        assert!(changes.has_changed().unwrap());
        assert_eq!(held(&q).share(), 0.25);
        assert!(matches!(
            q.assignment("nope"),
            Err(QueryError::UnknownStore(_))
        ));
    }

    #[test]
    fn local_reads_see_the_running_tasks_committed_state() {
        use sluice_state::{RocksEnv, TaskState};
        let dir = tempfile::tempdir().unwrap();
        let specs = topology().subtopologies()[0].stores().to_vec();
        let mut state =
            TaskState::open(dir.path(), &specs, &RocksEnv::new(Default::default())).unwrap();
        let (counts, kv) = (
            state.store_id("counts").unwrap(),
            state.store_id("kv").unwrap(),
        );
        let a = "a".to_string();
        state.window_put(counts, &to_bincode(&a), 60_000, &to_bincode(&3u64));
        state.window_put(counts, &to_bincode(&a), 180_000, &to_bincode(&4u64));
        state.put(kv, to_bincode(&a), &to_bincode(&7u64));
        state.commit_local(&HashMap::new()).unwrap();
        let local = Arc::new(LocalTasks::default());
        let q = queries(KeyPartitioner::Murmur2, local.clone(), Default::default());
        let range = |from_ms, to_ms| WindowRange {
            store: "counts",
            from_ms,
            to_ms,
        };
        assert!(matches!(
            q.get::<String, u64>("kv", 1, &a),
            Err(QueryError::NotLocal { partition: 1, .. })
        ));
        local.publish([task(1)].into(), [task(1)].into(), |id| {
            (id == task(1)).then(|| state.reader())
        });
        let got: Vec<Vec<(i64, u64)>> = q
            .fetch_windows(1, &a, &[range(0, 120_000), range(120_000, 240_000)])
            .unwrap();
        assert_eq!(got, vec![vec![(60_000, 3)], vec![(180_000, 4)]]);
        assert_eq!(q.get::<String, u64>("kv", 1, &a).unwrap(), Some(7));
        assert_eq!(
            q.get::<String, u64>("kv", 1, &"b".to_string()).unwrap(),
            None
        );
        assert!(matches!(
            q.get::<String, u64>("counts", 1, &a),
            Err(QueryError::WrongStoreKind { .. })
        ));
        assert!(matches!(
            q.fetch_windows::<String, String>(1, &a, &[range(0, 120_000)]),
            Err(QueryError::Codec { .. })
        ));
        assert!(matches!(
            q.fetch_windows::<String, u64>(0, &a, &[range(0, 1)]),
            Err(QueryError::NotLocal { partition: 0, .. })
        ));
        // The task's state closes (it moved away): the reader closes with it.
        drop(state);
        let err = q.get::<String, u64>("kv", 1, &a).unwrap_err();
        assert!(matches!(err, QueryError::NotLocal { .. }), "{err}");
    }
}
