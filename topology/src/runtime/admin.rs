//! Start-up checks and internal topics: source topics must exist and be
//! co-partitioned within a sub-topology; repartition and changelog topics are
//! created with the right partition counts and cleanup policies, and the
//! instance-metadata topic when the instance takes interactive queries.
//! Repartition topics keep their records until they are consumed: no
//! retention by time (a backfill of old events must not lose records before
//! a lagging task reads them); the records below the reading task's committed
//! offset are deleted instead ([`purge`]).

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use sluice_state::StoreKind;

use super::config::StreamsConfig;
use super::kafka::client_config;
use crate::topology::SourceTopic;
use crate::{Topology, TopologyError};

/// Partition counts of existing topics (absent topics are missing).
pub(crate) fn partition_counts(
    cfg: &StreamsConfig,
    topics: &[String],
) -> Result<HashMap<String, i32>, TopologyError> {
    let consumer: BaseConsumer = client_config(cfg).create()?;
    let md = consumer.fetch_metadata(None, Duration::from_secs(30))?;
    let mut out = HashMap::new();
    for t in md.topics() {
        if topics.iter().any(|x| x == t.name()) && t.error().is_none() && !t.partitions().is_empty()
        {
            out.insert(t.name().to_string(), t.partitions().len() as i32);
        }
    }
    Ok(out)
}

/// A topic to create: name, partitions, configs.
struct TopicSpec {
    name: String,
    partitions: i32,
    configs: Vec<(String, String)>,
}

/// Partition counts of the dead-letter topics, by name.
pub(crate) type DeadLetterPartitions = HashMap<String, i32>;

/// What start-up learnt about the topics.
pub(crate) struct PreparedTopics {
    /// Partition counts of the dead-letter topics.
    pub(crate) dead_letters: DeadLetterPartitions,
    /// Partitions (and so tasks) of each sub-topology, by id.
    pub(crate) subtopology_partitions: Vec<i32>,
}

/// Checks sources and creates internal topics.
pub(crate) fn prepare_topics(
    cfg: &StreamsConfig,
    topology: &Topology,
) -> Result<PreparedTopics, TopologyError> {
    let app = &cfg.application_id;
    let mut all: Vec<String> = Vec::new();
    let mut dead_letters: Vec<String> = Vec::new();
    for st in topology.subtopologies() {
        all.extend(st.source_topics(app));
        for s in st.stores() {
            all.push(Topology::changelog_topic(app, &s.name));
        }
        dead_letters.extend(st.sources.iter().filter_map(|s| s.dead_letter.clone()));
    }
    all.extend(dead_letters.iter().cloned());
    let instances = super::instances::instances_topic(app);
    all.push(instances.clone());
    let existing = partition_counts(cfg, &all)?;
    let mut dlq_partitions = DeadLetterPartitions::new();
    for d in dead_letters {
        let c = *existing
            .get(&d)
            .ok_or_else(|| TopologyError::MissingTopic(format!("{d} (dead-letter topic)")))?;
        dlq_partitions.insert(d, c);
    }
    let n = topology.subtopologies().len();
    let mut parts: Vec<Option<i32>> = vec![None; n];
    // External sources first; then repartition-fed sub-topologies in order
    // (each follows its writer).
    for st in topology.subtopologies() {
        let mut topics = Vec::new();
        let mut counts = Vec::new();
        for s in &st.sources {
            for t in &s.topics {
                if let SourceTopic::External(name) = t {
                    let c = *existing
                        .get(name)
                        .ok_or_else(|| TopologyError::MissingTopic(name.clone()))?;
                    topics.push(name.clone());
                    counts.push(c);
                }
            }
        }
        if counts.windows(2).any(|w| w[0] != w[1]) {
            return Err(TopologyError::NotCoPartitioned {
                subtopology: st.id,
                topics,
                counts,
            });
        }
        parts[st.id] = counts.first().copied();
    }
    for _ in 0..n {
        for st in topology.subtopologies() {
            for (suffix, upstream, asked) in st.internal_sources() {
                let name = format!("{app}-{suffix}");
                let want = match (
                    asked.or(cfg.repartition_partitions),
                    existing.get(&name),
                    parts[upstream],
                ) {
                    (_, Some(c), _) => Some(*c),
                    (Some(c), None, _) => Some(c),
                    (None, None, up) => up,
                };
                if let Some(w) = want {
                    match parts[st.id] {
                        None => parts[st.id] = Some(w),
                        Some(p) if p != w => {
                            return Err(TopologyError::NotCoPartitioned {
                                subtopology: st.id,
                                topics: st.source_topics(app),
                                counts: vec![p, w],
                            })
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    let subtopology_partitions: Vec<i32> = parts
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            p.ok_or_else(|| TopologyError::Invalid(format!("cannot size sub-topology {i}")))
        })
        .collect::<Result<_, _>>()?;

    let mut to_create: Vec<TopicSpec> = Vec::new();
    for st in topology.subtopologies() {
        let p = subtopology_partitions[st.id];
        for (suffix, _, _) in st.internal_sources() {
            let name = format!("{app}-{suffix}");
            let configs = vec![
                ("cleanup.policy".to_string(), "delete".to_string()),
                ("retention.ms".to_string(), "-1".to_string()),
            ];
            check_or_plan(&existing, &name, p, configs, &mut to_create)?;
        }
        for s in st.stores() {
            if !s.changelogged {
                continue;
            }
            let name = Topology::changelog_topic(app, &s.name);
            let configs = match s.kind {
                StoreKind::KeyValue => vec![("cleanup.policy".to_string(), "compact".to_string())],
                StoreKind::Window { retention_ms } => vec![
                    ("cleanup.policy".to_string(), "compact,delete".to_string()),
                    (
                        "retention.ms".to_string(),
                        (retention_ms + cfg.windowed_changelog_extra_retention.as_millis() as i64)
                            .to_string(),
                    ),
                ],
            };
            check_or_plan(&existing, &name, p, configs, &mut to_create)?;
        }
    }
    if cfg.application_server.is_some() {
        // One partition: every instance reads every claim.
        let configs = vec![("cleanup.policy".to_string(), "compact".to_string())];
        check_or_plan(&existing, &instances, 1, configs, &mut to_create)?;
    }
    create_topics(cfg, &to_create)?;
    Ok(PreparedTopics {
        dead_letters: dlq_partitions,
        subtopology_partitions,
    })
}

fn check_or_plan(
    existing: &HashMap<String, i32>,
    name: &str,
    partitions: i32,
    configs: Vec<(String, String)>,
    plan: &mut Vec<TopicSpec>,
) -> Result<(), TopologyError> {
    match existing.get(name) {
        Some(c) if *c != partitions => Err(TopologyError::Invalid(format!(
            "internal topic {name} has {c} partitions, the topology needs {partitions}"
        ))),
        Some(_) => Ok(()),
        None => {
            plan.push(TopicSpec {
                name: name.to_string(),
                partitions,
                configs,
            });
            Ok(())
        }
    }
}

fn create_topics(cfg: &StreamsConfig, topics: &[TopicSpec]) -> Result<(), TopologyError> {
    if topics.is_empty() {
        return Ok(());
    }
    let admin: AdminClient<DefaultClientContext> = client_config(cfg).create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| {
            t.configs.iter().fold(
                NewTopic::new(
                    &t.name,
                    t.partitions,
                    TopicReplication::Fixed(cfg.replication_factor),
                ),
                |nt, (k, v)| nt.set(k, v),
            )
        })
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = futures::executor::block_on(admin.create_topics(&new, &opts))?;
    for r in results {
        if let Err((name, code)) = r {
            if code != RDKafkaErrorCode::TopicAlreadyExists {
                return Err(TopologyError::Invalid(format!(
                    "cannot create topic {name}: {code}"
                )));
            }
        }
    }
    await_visible(cfg, topics)
}

/// How long created topics may take to show in the cluster's metadata.
const VISIBLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Waits until the cluster's metadata shows every created topic with all its
/// partitions led. A topic's creation is acknowledged before every broker's
/// metadata holds it: a client asking a moment later (a task's restore
/// looking up its changelog's end) can be told the partition is unknown.
fn await_visible(cfg: &StreamsConfig, topics: &[TopicSpec]) -> Result<(), TopologyError> {
    let consumer: BaseConsumer = client_config(cfg).create()?;
    let deadline = std::time::Instant::now() + VISIBLE_TIMEOUT;
    loop {
        let md = consumer.fetch_metadata(None, Duration::from_secs(10))?;
        let missing: Vec<&str> = topics
            .iter()
            .filter(|t| {
                !md.topics().iter().any(|m| {
                    m.name() == t.name
                        && m.error().is_none()
                        && m.partitions().len() == t.partitions as usize
                        && m.partitions().iter().all(|p| p.leader() >= 0)
                })
            })
            .map(|t| t.name.as_str())
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(TopologyError::Invalid(format!(
                "created topics not in the cluster's metadata after {}s: {}",
                VISIBLE_TIMEOUT.as_secs(),
                missing.join(", ")
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Deletes the records below `offsets` (a reading task's committed offsets
/// in repartition topics): they were consumed, and the topics keep records
/// without a time limit. A failure is only logged: the next purge covers it.
pub(crate) fn purge(
    admin: &AdminClient<DefaultClientContext>,
    offsets: &rdkafka::TopicPartitionList,
) {
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let deleting = admin.delete_records(offsets, &opts);
    let offsets = offsets.clone();
    // The admin client's own thread completes the request; nothing waits for it.
    std::thread::Builder::new()
        .name("sluice-purge".into())
        .spawn(move || match futures::executor::block_on(deleting) {
            Ok(result) => {
                for e in result.elements() {
                    if let Err(err) = e.error() {
                        tracing::debug!(topic = e.topic(), partition = e.partition(), error = %err, "purging consumed repartition records failed");
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, ?offsets, "purging consumed repartition records failed"),
        })
        .ok();
}
