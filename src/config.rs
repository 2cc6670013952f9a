//! The `sluice run` configuration: a TOML file plus `SLUICE_<SECTION>__<KEY>`
//! environment overrides (e.g. `SLUICE_KAFKA__BOOTSTRAP_SERVERS`). Unknown keys
//! are rejected and every problem names its key; the CLI exits with code 2.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sluice_topology::runtime::{ClaimKey, GroupProtocol, Guarantee, KeyPartitioner, StreamsConfig};
use sluice_topology::RocksSettings;

use crate::llm::LlmConfig;
use crate::steps::account::pricing::Price;
use crate::steps::account::{default_windows, Budgets, Quotas, UsageUpdates, WindowSpec};
use crate::steps::invoke_llm::prompt::PromptConfig;
use crate::steps::route::{FeatureWeights, Router, Tier};
use crate::steps::BatchingConfig;

pub use crate::error::ConfigError;

/// The whole configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Application identity, state and processing settings.
    #[serde(default)]
    pub app: AppSection,
    /// Kafka connection and client settings.
    pub kafka: KafkaSection,
    /// Topic names, partitions and retention.
    #[serde(default)]
    pub topics: TopicsSection,
    /// Task validation and delivery settings.
    #[serde(default)]
    pub tasks: TasksSection,
    /// Providers, models, limiter, breaker and retry settings.
    pub llm: LlmConfig,
    /// Prompt templates per task type.
    #[serde(default)]
    pub prompts: PromptConfig,
    /// Which model serves which task, and fallbacks.
    #[serde(default)]
    pub routing: RoutingSection,
    /// Micro-batching of small tasks.
    #[serde(default)]
    pub batching: BatchingConfig,
    /// Per-tenant token and cost accounts.
    #[serde(default)]
    pub accounting: AccountingSection,
    /// Prices per model, in micro-dollars per million tokens.
    #[serde(default)]
    pub prices: BTreeMap<String, Price>,
    /// The HTTP listener (metrics, health, queries).
    #[serde(default)]
    pub http: HttpSection,
    /// Spans of the LLM step and their OTLP export.
    #[serde(default)]
    pub tracing: crate::trace::TracingSection,
    /// The HTTP task gateway (`sluice gateway`).
    #[serde(default)]
    pub gateway: GatewaySection,
}

/// `[app]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AppSection {
    /// Application id: consumer group, internal topic prefix, transactional id prefix.
    pub id: String,
    /// Directory for RocksDB state (a volume in Kubernetes).
    pub state_dir: PathBuf,
    /// `exactly_once` or `at_least_once`.
    pub guarantee: Guarantee,
    /// Commit interval in ms (default: 100 under exactly-once, 200 under at-least-once).
    pub commit_interval_ms: Option<u64>,
    /// Tasks in flight per input partition before the partition is paused.
    pub max_in_flight_per_partition: usize,
    /// How long a revocation or a shutdown waits for in-flight calls before
    /// abandoning them (ms). Default: the longest model `timeout_ms` plus
    /// [`DRAIN_MARGIN_MS`], so a call under way when its partition moves is
    /// answered rather than made again.
    pub drain_timeout_ms: Option<u64>,
    /// Threads that process tasks side by side (default: the number of cores).
    pub processing_threads: Option<usize>,
    /// RocksDB block cache shared by all tasks, MiB.
    pub rocksdb_block_cache_mb: usize,
    /// RocksDB memtable budget shared by all tasks, MiB.
    pub rocksdb_write_buffer_mb: usize,
    /// Record cache over the state stores shared by all tasks, MiB: committed
    /// entries kept in memory so hot keys are read without RocksDB (0: off).
    pub record_cache_mb: usize,
}

impl Default for AppSection {
    fn default() -> Self {
        AppSection {
            id: "sluice".into(),
            state_dir: PathBuf::from("/var/lib/sluice"),
            guarantee: Guarantee::ExactlyOnce,
            commit_interval_ms: None,
            max_in_flight_per_partition: 1000,
            drain_timeout_ms: None,
            processing_threads: None,
            rocksdb_block_cache_mb: 64,
            rocksdb_write_buffer_mb: 32,
            record_cache_mb: 16,
        }
    }
}

/// `[kafka]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSection {
    /// Bootstrap servers, comma-separated.
    pub bootstrap_servers: String,
    /// The consumer group protocol: `consumer` (KIP-848, brokers 4.0 and
    /// later; incremental rebalances) or `classic` (eager rebalances).
    #[serde(default = "default_group_protocol")]
    pub group_protocol: GroupProtocol,
    /// Static membership: this instance's `group.instance.id` (the Helm chart
    /// sets the pod's name). An instance restarting under the same id within
    /// the session timeout gets its partitions back without a rebalance.
    #[serde(default)]
    pub group_instance_id: Option<String>,
    /// Consumer group session timeout, ms (the classic protocol's; under the
    /// consumer protocol the broker's `group.consumer.session.timeout.ms`
    /// decides).
    #[serde(default = "default_session_timeout_ms")]
    pub session_timeout_ms: u64,
    /// Maximum time between polls, ms.
    #[serde(default = "default_max_poll_interval_ms")]
    pub max_poll_interval_ms: u64,
    /// Transaction timeout, ms (exactly-once).
    #[serde(default = "default_transaction_timeout_ms")]
    pub transaction_timeout_ms: u64,
    /// Extra librdkafka properties for every client Sluice creates (the
    /// engine's, the start-up checks', `sluice topics create`'s), e.g.
    /// `security.protocol`, `sasl.mechanism`, `ssl.ca.location`. A key
    /// ending in `_file` names a file whose contents (trimmed) become the
    /// property without the suffix, e.g. `"sasl.password_file" =
    /// "/run/secrets/kafka-password"` sets `sasl.password`; the file is read
    /// at start-up.
    #[serde(default)]
    pub client: sluice_topology::redact::Properties,
}

/// Suffix of a `[kafka.client]` key whose value is read from a file.
const FILE_SUFFIX: &str = "_file";

impl KafkaSection {
    /// The bootstrap servers and client properties every client gets.
    pub fn cluster(&self) -> crate::kafka::Cluster {
        crate::kafka::Cluster {
            bootstrap: self.bootstrap_servers.clone(),
            client: self.client.clone(),
        }
    }

    /// Replaces each `<property>_file` of `[kafka.client]` by `<property>`
    /// holding the file's contents, trimmed.
    fn read_secret_files(&mut self) -> Result<(), ConfigError> {
        let files: Vec<(String, String)> = self
            .client
            .iter()
            .filter(|(k, _)| k.ends_with(FILE_SUFFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (key, path) in files {
            let name = format!("kafka.client.\"{key}\"");
            let property = key.trim_end_matches(FILE_SUFFIX).to_string();
            if property.is_empty() {
                return Err(ConfigError::new(name, "names no property"));
            }
            if self.client.contains_key(&property) {
                return Err(ConfigError::new(
                    name,
                    format!("set either {property} or {key}, not both"),
                ));
            }
            let text = std::fs::read_to_string(&path)
                .map_err(|e| ConfigError::new(name.clone(), format!("cannot read {path}: {e}")))?;
            let value = text.trim();
            if value.is_empty() {
                return Err(ConfigError::new(name, format!("{path} is empty")));
            }
            self.client.remove(&key);
            self.client.insert(property, value.to_string());
        }
        Ok(())
    }
}

fn default_group_protocol() -> GroupProtocol {
    GroupProtocol::Consumer
}

/// What the default drain timeout adds to the longest model timeout: the
/// answer's handling and the batch window.
pub const DRAIN_MARGIN_MS: u64 = 5_000;

fn default_session_timeout_ms() -> u64 {
    10_000
}
fn default_max_poll_interval_ms() -> u64 {
    300_000
}
fn default_transaction_timeout_ms() -> u64 {
    60_000
}

/// `[topics]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopicsSection {
    /// Task types accepted; each has a topic `<tasks_prefix><type>` and a
    /// dead-letter topic `<tasks_prefix><type>.dlq`.
    pub task_types: Vec<String>,
    /// Prefix of task topics.
    pub tasks_prefix: String,
    /// Topic of successful results.
    pub results_completed: String,
    /// Topic of failed results.
    pub results_failed: String,
    /// Topic of per-tenant usage updates.
    pub usage: String,
    /// Topic of cost alerts.
    pub alerts: String,
    /// Partitions of the topics `sluice topics create` makes. Task topics must
    /// share one partition count; results topics need at least as many.
    pub partitions: i32,
    /// Replication factor of created topics and of the engine's internal
    /// topics; -1 (the default) for the cluster's `default.replication.factor`.
    pub replication_factor: i32,
    /// Retention of results topics, ms (30 days).
    pub results_retention_ms: i64,
    /// Retention of dead-letter topics, ms (30 days).
    pub dlq_retention_ms: i64,
}

impl Default for TopicsSection {
    fn default() -> Self {
        TopicsSection {
            task_types: vec!["summarize".into(), "classify".into(), "extract".into()],
            tasks_prefix: "ai.tasks.".into(),
            results_completed: "ai.results.completed".into(),
            results_failed: "ai.results.failed".into(),
            usage: "ai.usage.tenant".into(),
            alerts: "ai.alerts.cost".into(),
            partitions: 6,
            replication_factor: -1,
            results_retention_ms: 30 * 24 * 3600 * 1000,
            dlq_retention_ms: 30 * 24 * 3600 * 1000,
        }
    }
}

impl TopicsSection {
    /// The topic of a task type.
    pub fn task_topic(&self, task_type: &str) -> String {
        format!("{}{task_type}", self.tasks_prefix)
    }

    /// The dead-letter topic of a task type.
    pub fn dlq_topic(&self, task_type: &str) -> String {
        format!("{}{task_type}.dlq", self.tasks_prefix)
    }
}

/// `[accounting]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccountingSection {
    /// Whether completed results are accounted per tenant.
    pub enabled: bool,
    /// Tumbling window sizes and their retention.
    pub windows: Vec<WindowSpec>,
    /// Cost budgets per window name, micro-dollars (a default and per tenant).
    pub budgets: Budgets,
    /// When window updates go to the usage topic: `on_commit` (the latest
    /// state of each window updated, once per commit) or `on_update` (one
    /// record per result and window).
    pub usage_updates: UsageUpdates,
    /// Fractions of a budget that raise an alert, rising.
    pub thresholds: Vec<f64>,
    /// Token and cost quotas per window (a default and per tenant), hard or
    /// soft.
    pub quotas: Quotas,
    /// Route a tenant's tiered tasks one tier down once its cost passes this
    /// fraction of a budget (off when unset; a soft quota crossed always does).
    pub downgrade_at: Option<f64>,
}

impl Default for AccountingSection {
    fn default() -> Self {
        AccountingSection {
            enabled: true,
            windows: default_windows(),
            budgets: Budgets::default(),
            usage_updates: UsageUpdates::default(),
            thresholds: vec![0.5, 0.8, 1.0],
            quotas: Quotas::default(),
            downgrade_at: None,
        }
    }
}

/// `[tasks]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TasksSection {
    /// Largest task record accepted, bytes; larger ones are dead-lettered.
    pub max_bytes: usize,
    /// Deliveries of a task (re-published with `attemptNumber + 1` after a
    /// transient failure) before it is dead-lettered as `exhausted`.
    pub max_attempts: u32,
    /// Backoff of a re-published attempt: attempt `n` is not called before a
    /// time drawn uniformly (full jitter) from zero to
    /// `retry_backoff_ms × 2^(n − 2)`, at most `retry_backoff_max_ms`.
    pub retry_backoff_ms: u64,
    /// The longest backoff of a re-published attempt, ms; also the longest a
    /// task waits for any `notBefore` it carries.
    pub retry_backoff_max_ms: u64,
    /// How long completed task ids are remembered for idempotency, hours.
    pub idempotency_ttl_hours: u64,
    /// While intake is held (bad credentials, open breaker without fallback),
    /// how often one held task probes the provider, ms.
    pub probe_interval_ms: u64,
    /// Consecutive calls of one model refused with the same `400` that make
    /// it a configuration fault (a parameter or template the model rejects):
    /// its tasks are held instead of dead-lettered. 0 dead-letters every
    /// `400` at once.
    pub bad_request_trap_after: u32,
    /// How long a task refused with a `400` waits for its model's run to
    /// decide (another answer: dead-lettered; the run reaching
    /// `bad_request_trap_after`: held), ms.
    pub bad_request_wait_ms: u64,
    /// How the services publishing tasks partition them by tenant:
    /// `murmur2` (Java clients, Kafka Streams, librdkafka's `murmur2_random`)
    /// or `crc32` (librdkafka's default `consistent_random`: Python, Go, .NET,
    /// Node clients left at their default). Usage queries find the instance
    /// holding a tenant's accounts with it.
    pub partitioner: KeyPartitioner,
    /// How each tenant keeps one owner (the task holding its accounts and
    /// quotas) whatever the producers do: `auto` checks every task's key
    /// and partition against its tenant under `partitioner` and sends a
    /// task that does not match through an internal topic keyed by tenant
    /// (every task when the task topics' partition counts differ);
    /// `always` sends every task through it; `never` dead-letters a task
    /// whose key or partition does not match (`wrong_key`).
    pub repartition: Repartition,
    /// What a tenant id must match once normalised (trimmed, ASCII letters
    /// lower-cased); a task whose tenant does not is dead-lettered
    /// `invalid_tenant`.
    pub tenant_pattern: String,
    /// The tenants accepted (empty: any matching `tenant_pattern`); a task of
    /// another tenant is dead-lettered `unknown_tenant`.
    pub tenants: Vec<String>,
}

/// `[tasks] repartition`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Repartition {
    /// The tasks whose key or partition does not match their tenant (all
    /// of them when the task topics' partition counts differ).
    #[default]
    Auto,
    /// Every task.
    Always,
    /// None: a task whose key or partition does not match its tenant is
    /// dead-lettered `wrong_key`.
    Never,
}

impl Default for TasksSection {
    fn default() -> Self {
        TasksSection {
            max_bytes: 1024 * 1024,
            max_attempts: 5,
            retry_backoff_ms: 30_000,
            retry_backoff_max_ms: 300_000,
            idempotency_ttl_hours: 7 * 24,
            probe_interval_ms: 2_000,
            bad_request_trap_after: 5,
            bad_request_wait_ms: 10_000,
            partitioner: KeyPartitioner::Murmur2,
            repartition: Repartition::Auto,
            tenant_pattern: crate::envelope::DEFAULT_TENANT_PATTERN.into(),
            tenants: Vec::new(),
        }
    }
}

/// `[routing]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingSection {
    /// Model for tasks no other rule covers (default: the first model).
    pub default_model: Option<String>,
    /// Model per task type.
    pub by_task_type: BTreeMap<String, String>,
    /// Fallback model per model, used while a model's breaker is open (followed
    /// model to model: a fallback chain).
    pub fallbacks: BTreeMap<String, String>,
    /// Complexity tiers by rising `max_score` (empty: no complexity routing).
    pub tiers: Vec<Tier>,
    /// How the complexity of a task without `payload.complexity` is computed.
    pub features: FeatureWeights,
    /// Whether a task's own `payload.model` and `payload.complexity` are
    /// honoured. Off by default: a producer could otherwise pick the dearest
    /// model for every task.
    pub allow_task_overrides: bool,
}

/// `[http]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSection {
    /// Address of the metrics/health/query listener (loopback by default;
    /// the Helm chart listens on every interface, behind its NetworkPolicy).
    pub listen: String,
    /// The URL other instances reach this one's listener at (e.g.
    /// `http://sluice-0.sluice-headless:8080`): queries for tenants this
    /// instance holds are forwarded there. The Helm chart sets it per pod
    /// (`SLUICE_HTTP__ADVERTISED_URL`). Default: `http://<listen address>`,
    /// unless that is a wildcard address (`0.0.0.0`, `[::]`); then other
    /// instances cannot forward queries here.
    pub advertised_url: Option<String>,
    /// Bearer tokens of the query API (`/v1/...`): a file of lines
    /// `<token> <scope>`, the scope `admin` (every tenant) or
    /// `tenant:<id>` (that tenant only). Unset: the query API answers 401 to
    /// everyone. `/healthz`, `/readyz` and `/metrics` need no token.
    pub tokens_file: Option<PathBuf>,
    /// A secret the instances share (at least 32 bytes): each signs its
    /// claim on `<app id>-instances` (which partitions it holds, where it
    /// listens) with it, and queries are forwarded only to instances whose
    /// claims it signed. Unset: any claim on that topic is believed, so
    /// only its ACLs keep others from diverting queries and their tokens.
    pub claims_key_file: Option<PathBuf>,
}

impl Default for HttpSection {
    fn default() -> Self {
        HttpSection {
            listen: "127.0.0.1:8080".into(),
            advertised_url: None,
            tokens_file: None,
            claims_key_file: None,
        }
    }
}

impl HttpSection {
    /// The URL this instance advertises once its listener is bound to
    /// `bound` (see [`HttpSection::advertised_url`]).
    pub fn advertised(&self, bound: std::net::SocketAddr) -> Option<String> {
        advertised(self.advertised_url.as_deref(), bound)
    }

    /// The query API's tokens (none without `tokens_file`: the API then
    /// answers 401 to everyone).
    pub fn tokens(&self) -> Result<crate::http::auth::ApiTokens, ConfigError> {
        match &self.tokens_file {
            None => Ok(Default::default()),
            Some(path) => crate::http::auth::ApiTokens::load(path)
                .map_err(|e| ConfigError::new("http.tokens_file", e)),
        }
    }

    /// The key instance claims are signed with (none without
    /// `claims_key_file`).
    pub fn claims_key(&self) -> Result<Option<ClaimKey>, ConfigError> {
        let Some(path) = &self.claims_key_file else {
            return Ok(None);
        };
        let bytes = std::fs::read(path).map_err(|e| {
            ConfigError::new(
                "http.claims_key_file",
                format!("cannot read {}: {e}", path.display()),
            )
        })?;
        ClaimKey::new(&bytes)
            .map(Some)
            .map_err(|e| ConfigError::new("http.claims_key_file", e))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.tokens()?;
        self.claims_key()?;
        check_listen_and_url("http", &self.listen, self.advertised_url.as_deref())
    }
}

/// The URL an instance advertises: `configured`, else `http://<bound>`
/// unless that is a wildcard address.
fn advertised(configured: Option<&str>, bound: std::net::SocketAddr) -> Option<String> {
    match configured {
        Some(url) => Some(url.trim_end_matches('/').to_string()),
        None if bound.ip().is_unspecified() => None,
        None => Some(format!("http://{bound}")),
    }
}

/// Checks a section's `listen` address and `advertised_url`.
fn check_listen_and_url(section: &str, listen: &str, url: Option<&str>) -> Result<(), ConfigError> {
    if listen.parse::<std::net::SocketAddr>().is_err() {
        return Err(ConfigError::new(
            format!("{section}.listen"),
            "must be an address like 127.0.0.1:8080",
        ));
    }
    if let Some(url) = url {
        let ok = reqwest::Url::parse(url).is_ok_and(|u| {
            matches!(u.scheme(), "http" | "https")
                && u.host().is_some()
                && u.query().is_none()
                && u.fragment().is_none()
        });
        if !ok {
            return Err(ConfigError::new(
                format!("{section}.advertised_url"),
                "must be an http(s) URL like http://sluice-0.sluice:8080",
            ));
        }
    }
    Ok(())
}

/// `[gateway]`: the HTTP task gateway, `sluice gateway` (see
/// `src/gateway`). It reads the same file as `sluice run` (topics, tasks,
/// tokens, quotas) and runs as its own stream application,
/// `<app id>-gateway`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewaySection {
    /// Address of the gateway's listener.
    pub listen: String,
    /// The URL other gateway instances reach this one at (status reads are
    /// forwarded to the instance holding the task's tenant). Default:
    /// `http://<listen address>` unless that is a wildcard address.
    pub advertised_url: Option<String>,
    /// Directory of the gateway's state (its task status store). Default:
    /// `<app.state_dir>/gateway`.
    pub state_dir: Option<PathBuf>,
    /// Largest request body, bytes (a larger one: 413).
    pub max_body_bytes: usize,
    /// Most tasks in one `POST /v1/tasks:batch`.
    pub max_batch: usize,
    /// A tenant with this many tasks accepted and not yet answered gets 429
    /// for new ones (0: no bound).
    pub max_backlog_per_tenant: u64,
    /// Period of the keep-alive comments of an event stream, ms.
    pub keepalive_ms: u64,
    /// Longest `wait` of a status read (long polling), ms.
    pub max_wait_ms: u64,
    /// How long a task's status is kept after its last change, hours.
    pub status_ttl_hours: u64,
    /// How long the status table's fetches may wait at the broker for
    /// 64 KiB of records, ms (0: every fetch answered as soon as any
    /// record is there). Every accepted task is read back; answering a
    /// fetch per few records costs the broker more than the records do.
    pub fetch_wait_ms: u64,
}

impl Default for GatewaySection {
    fn default() -> Self {
        GatewaySection {
            listen: "127.0.0.1:8090".into(),
            advertised_url: None,
            state_dir: None,
            max_body_bytes: 1024 * 1024,
            max_batch: 100,
            max_backlog_per_tenant: 10_000,
            keepalive_ms: 15_000,
            max_wait_ms: 30_000,
            status_ttl_hours: 7 * 24,
            fetch_wait_ms: 10,
        }
    }
}

impl GatewaySection {
    /// The URL this gateway advertises once bound to `bound`.
    pub fn advertised(&self, bound: std::net::SocketAddr) -> Option<String> {
        advertised(self.advertised_url.as_deref(), bound)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        check_listen_and_url("gateway", &self.listen, self.advertised_url.as_deref())?;
        for (key, value) in [
            ("gateway.max_body_bytes", self.max_body_bytes as u64),
            ("gateway.max_batch", self.max_batch as u64),
            ("gateway.keepalive_ms", self.keepalive_ms),
            ("gateway.max_wait_ms", self.max_wait_ms),
            ("gateway.status_ttl_hours", self.status_ttl_hours),
        ] {
            if value == 0 {
                return Err(ConfigError::new(key, "must be at least 1"));
            }
        }
        if self.fetch_wait_ms > GATEWAY_FETCH_WAIT_MAX_MS {
            return Err(ConfigError::new(
                "gateway.fetch_wait_ms",
                format!(
                    "must be at most {GATEWAY_FETCH_WAIT_MAX_MS} (a result reaches its readers \
                     up to this much later)"
                ),
            ));
        }
        Ok(())
    }
}

/// The longest `[gateway] fetch_wait_ms`.
const GATEWAY_FETCH_WAIT_MAX_MS: u64 = 1000;

/// Environment variables with this prefix and a `__` override config keys.
pub const ENV_PREFIX: &str = "SLUICE_";

impl Config {
    /// Loads a file, applies environment overrides, and validates.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::new(path.display().to_string(), format!("cannot read: {e}"))
        })?;
        Self::from_toml_with_env(&text, std::env::vars())
    }

    /// Parses TOML text, applies overrides from `env`, and validates.
    pub fn from_toml_with_env(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut value: toml::Table = toml::from_str(text).map_err(|e| {
            let key = e
                .span()
                .map(|s| format!("byte {}", s.start))
                .unwrap_or_else(|| "file".into());
            ConfigError::new(key, e.message().to_string())
        })?;
        // Overrides as typed TOML scalars, each kept as text too: a key that
        // wants a string gets the text (a numeric password stays a string).
        let mut overrides: Vec<(Vec<String>, String)> = Vec::new();
        for (k, v) in env {
            let Some(rest) = k.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            if !rest.contains("__") {
                continue;
            }
            let path: Vec<String> = rest.split("__").map(str::to_lowercase).collect();
            set_path(&mut value, &path, parse_env_value(&v))
                .map_err(|m| ConfigError::new(format!("{k} ({})", path.join(".")), m))?;
            overrides.push((path, v));
        }
        let cfg: Config = loop {
            let de = toml::Value::Table(value.clone());
            match serde_path_to_error::deserialize(de) {
                Ok(cfg) => break cfg,
                Err(e) => {
                    let path = e.path().to_string();
                    let as_text = overrides
                        .iter()
                        .position(|(p, _)| p.join(".") == path)
                        .map(|i| overrides.swap_remove(i));
                    if let Some((p, text)) = as_text {
                        set_path(&mut value, &p, toml::Value::String(text))
                            .map_err(|m| ConfigError::new(path, m))?;
                        continue;
                    }
                    return Err(ConfigError::new(
                        if path.is_empty() { "file".into() } else { path },
                        e.inner().to_string(),
                    ));
                }
            }
        };
        let mut cfg = cfg;
        cfg.validate()?;
        cfg.kafka.read_secret_files()?;
        Ok(cfg)
    }

    /// Semantic checks across keys.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.tracing.validate()?;
        if self.kafka.bootstrap_servers.trim().is_empty() {
            return Err(ConfigError::new(
                "kafka.bootstrap_servers",
                "must not be empty",
            ));
        }
        if self.app.id.is_empty()
            || !self
                .app
                .id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        {
            return Err(ConfigError::new(
                "app.id",
                "must be non-empty and use only [A-Za-z0-9._-]",
            ));
        }
        if self.app.processing_threads == Some(0) {
            return Err(ConfigError::new(
                "app.processing_threads",
                "must be at least 1",
            ));
        }
        let max = sluice_topology::runtime::MAX_IN_FLIGHT_PER_PARTITION;
        if !(1..=max).contains(&self.app.max_in_flight_per_partition) {
            return Err(ConfigError::new(
                "app.max_in_flight_per_partition",
                format!("must be between 1 and {max}"),
            ));
        }
        if self.topics.replication_factor < 1 && self.topics.replication_factor != -1 {
            return Err(ConfigError::new(
                "topics.replication_factor",
                "must be at least 1, or -1 for the cluster's default",
            ));
        }
        if self.drain_timeout_ms() >= self.kafka.max_poll_interval_ms {
            // A revocation drains inside the rebalance, which must end within
            // max.poll.interval.ms (the broker's rebalance timeout).
            return Err(ConfigError::new(
                "app.drain_timeout_ms",
                format!(
                    "{} ms (set, or the longest model timeout_ms plus {DRAIN_MARGIN_MS}) must be below kafka.max_poll_interval_ms ({} ms)",
                    self.drain_timeout_ms(),
                    self.kafka.max_poll_interval_ms
                ),
            ));
        }
        if let Some(id) = &self.kafka.group_instance_id {
            if id.trim().is_empty() || id.chars().any(char::is_whitespace) {
                return Err(ConfigError::new(
                    "kafka.group_instance_id",
                    "must be a non-empty id without spaces",
                ));
            }
        }
        if self.kafka.session_timeout_ms >= self.kafka.max_poll_interval_ms {
            return Err(ConfigError::new(
                "kafka.session_timeout_ms",
                "must be below kafka.max_poll_interval_ms",
            ));
        }
        if self.topics.task_types.is_empty() {
            return Err(ConfigError::new(
                "topics.task_types",
                "must list at least one task type",
            ));
        }
        if self.topics.partitions < 1 {
            return Err(ConfigError::new("topics.partitions", "must be at least 1"));
        }
        for t in &self.topics.task_types {
            if !self.prompts.templates.contains_key(t) {
                return Err(ConfigError::new(
                    format!("prompts.templates.{t}"),
                    "every task type in topics.task_types needs a prompt template",
                ));
            }
        }
        if self.tasks.max_attempts == 0 {
            return Err(ConfigError::new("tasks.max_attempts", "must be at least 1"));
        }
        let rules = crate::envelope::TenantRules::new(&self.tasks.tenant_pattern, &[])
            .map_err(|e| ConfigError::new("tasks.tenant_pattern", e.to_string()))?;
        for (i, t) in self.tasks.tenants.iter().enumerate() {
            rules.check(t).map_err(|_| {
                ConfigError::new(
                    format!("tasks.tenants[{i}]"),
                    "does not match tasks.tenant_pattern",
                )
            })?;
        }
        if self.tasks.retry_backoff_max_ms < self.tasks.retry_backoff_ms
            || self.tasks.retry_backoff_max_ms > 86_400_000
        {
            return Err(ConfigError::new(
                "tasks.retry_backoff_max_ms",
                "must be at least tasks.retry_backoff_ms and at most a day (86400000)",
            ));
        }
        if self.llm.models.is_empty() {
            return Err(ConfigError::new(
                "llm.models",
                "must define at least one model",
            ));
        }
        let providers: Vec<&str> = self.llm.providers.iter().map(|p| p.name.as_str()).collect();
        for (i, m) in self.llm.models.iter().enumerate() {
            if !providers.contains(&m.provider.as_str()) {
                return Err(ConfigError::new(
                    format!("llm.models[{i}].provider"),
                    format!("unknown provider {}", m.provider),
                ));
            }
            m.limiter.validate().map_err(|(key, message)| {
                ConfigError::new(format!("llm.models[{i}].limiter.{key}"), message)
            })?;
            m.limiter.concurrency.validate().map_err(|(key, message)| {
                ConfigError::new(
                    format!("llm.models[{i}].limiter.concurrency.{key}"),
                    message,
                )
            })?;
        }
        let known = |m: &str| self.knows_model(m);
        if let Some(m) = &self.routing.default_model {
            if !known(m) {
                return Err(ConfigError::new(
                    "routing.default_model",
                    format!("unknown model {m}"),
                ));
            }
        }
        for (t, m) in &self.routing.by_task_type {
            if !known(m) {
                return Err(ConfigError::new(
                    format!("routing.by_task_type.{t}"),
                    format!("unknown model {m}"),
                ));
            }
        }
        for (from, to) in &self.routing.fallbacks {
            if !known(from) {
                return Err(ConfigError::new(
                    format!("routing.fallbacks.{from}"),
                    format!("unknown model {from}"),
                ));
            }
            if !known(to) {
                return Err(ConfigError::new(
                    format!("routing.fallbacks.{from}"),
                    format!("unknown model {to}"),
                ));
            }
        }
        self.validate_tiers()?;
        self.validate_batching()?;
        self.validate_accounting()?;
        for m in self.prices.keys() {
            if !known(m) {
                return Err(ConfigError::new(
                    format!("prices.{m}"),
                    format!("unknown model {m}"),
                ));
            }
        }
        self.http.validate()?;
        self.gateway.validate()?;
        for (i, p) in self.llm.providers.iter().enumerate() {
            p.resolve_api_key()
                .map_err(|e| ConfigError::new(format!("llm.providers[{i}]"), e.to_string()))?;
            if !(1..=crate::llm::config::MAX_HTTP2_STREAMS).contains(&p.http2_max_streams) {
                return Err(ConfigError::new(
                    format!("llm.providers[{i}].http2_max_streams"),
                    format!(
                        "must be 1 to {}, got {}",
                        crate::llm::config::MAX_HTTP2_STREAMS,
                        p.http2_max_streams
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The drain timeout: `[app] drain_timeout_ms`, or the longest model
    /// timeout plus [`DRAIN_MARGIN_MS`].
    pub fn drain_timeout_ms(&self) -> u64 {
        self.app.drain_timeout_ms.unwrap_or_else(|| {
            self.llm
                .models
                .iter()
                .map(|m| m.timeout_ms)
                .max()
                .unwrap_or(0)
                + DRAIN_MARGIN_MS
        })
    }

    /// The engine configuration.
    pub fn streams(&self) -> StreamsConfig {
        let mut s = StreamsConfig::new(
            &self.app.id,
            &self.kafka.bootstrap_servers,
            &self.app.state_dir,
        );
        s.guarantee = self.app.guarantee;
        s.commit_interval = self.app.commit_interval_ms.map(Duration::from_millis);
        s.max_in_flight_per_partition = self.app.max_in_flight_per_partition;
        s.drain_timeout = Duration::from_millis(self.drain_timeout_ms());
        if let Some(n) = self.app.processing_threads {
            s.processing_threads = n;
        }
        s.group_protocol = self.kafka.group_protocol;
        s.group_instance_id = self.kafka.group_instance_id.clone();
        s.session_timeout = Duration::from_millis(self.kafka.session_timeout_ms);
        s.max_poll_interval = Duration::from_millis(self.kafka.max_poll_interval_ms);
        s.transaction_timeout = Duration::from_millis(self.kafka.transaction_timeout_ms);
        s.replication_factor = self.topics.replication_factor;
        s.client_overrides = self.kafka.client.clone();
        s.key_partitioner = self.tasks.partitioner;
        s.rocksdb = RocksSettings {
            block_cache_bytes: self.app.rocksdb_block_cache_mb << 20,
            write_buffer_manager_bytes: self.app.rocksdb_write_buffer_mb << 20,
            record_cache_bytes: self.app.record_cache_mb << 20,
            ..RocksSettings::default()
        };
        s
    }

    /// The routing rules (see [`Router`]).
    pub fn router(&self) -> Router {
        Router {
            default_model: self
                .routing
                .default_model
                .clone()
                .unwrap_or_else(|| self.llm.models[0].name.clone()),
            by_task_type: self.routing.by_task_type.clone(),
            tiers: self.routing.tiers.clone(),
            fallbacks: self.routing.fallbacks.clone(),
            features: self.routing.features.clone(),
            allow_task_overrides: self.routing.allow_task_overrides,
        }
    }

    fn validate_accounting(&self) -> Result<(), ConfigError> {
        // Costs are exact sums of integers: a model without a price would
        // count as free without anyone noticing.
        for m in &self.llm.models {
            if !self.prices.contains_key(&m.name) {
                return Err(ConfigError::new(
                    format!("prices.{}", m.name),
                    "every model needs a price (input and output micro-dollars per million tokens; cached and cache_write optional)",
                ));
            }
        }
        let windows = &self.accounting.windows;
        for (i, w) in windows.iter().enumerate() {
            let key = |field: &str| format!("accounting.windows[{i}].{field}");
            if w.name.is_empty()
                || !w.name.chars().all(|c| c.is_ascii_alphanumeric())
                || windows[..i].iter().any(|o| o.name == w.name)
            {
                return Err(ConfigError::new(
                    key("name"),
                    "must be a unique, non-empty name of letters and digits",
                ));
            }
            match (w.calendar, w.size_ms) {
                (None, s) if s <= 0 => {
                    return Err(ConfigError::new(
                        key("size_ms"),
                        "must be positive (or set calendar = \"month\")",
                    ))
                }
                (Some(_), s) if s != 0 => {
                    return Err(ConfigError::new(
                        key("size_ms"),
                        "must be unset for a calendar window",
                    ))
                }
                _ => {}
            }
            if w.retention_ms < w.longest_ms() {
                return Err(ConfigError::new(
                    key("retention_ms"),
                    "must be at least the window size",
                ));
            }
        }
        let t = &self.accounting.thresholds;
        if t.len() > 16
            || t.iter().any(|x| !(x.is_finite() && *x > 0.0))
            || t.windows(2).any(|p| p[0] >= p[1])
        {
            return Err(ConfigError::new(
                "accounting.thresholds",
                "at most 16 positive fractions, rising",
            ));
        }
        let budgets = &self.accounting.budgets;
        let named = std::iter::once(("default".to_string(), &budgets.default)).chain(
            budgets
                .tenants
                .iter()
                .map(|(tenant, b)| (format!("tenants.{tenant}"), b)),
        );
        for (at, b) in named {
            for (window, micros) in b {
                let key = format!("accounting.budgets.{at}.{window}");
                if !windows.iter().any(|w| &w.name == window) {
                    return Err(ConfigError::new(key, "not a window in accounting.windows"));
                }
                if *micros <= 0 {
                    return Err(ConfigError::new(key, "must be positive (micro-dollars)"));
                }
            }
        }
        if let Some(f) = self.accounting.downgrade_at {
            if !(f.is_finite() && f > 0.0) {
                return Err(ConfigError::new(
                    "accounting.downgrade_at",
                    "must be a positive fraction of a budget",
                ));
            }
        }
        let quotas = &self.accounting.quotas;
        let named = quotas
            .default
            .iter()
            .map(|q| ("default".to_string(), q))
            .chain(
                quotas
                    .tenants
                    .iter()
                    .map(|(t, q)| (format!("tenants.{t}"), q)),
            );
        for (at, q) in named {
            let key = |field: &str| format!("accounting.quotas.{at}.{field}");
            if !self.accounting.enabled {
                return Err(ConfigError::new(
                    "accounting.enabled",
                    "quotas need accounting (their windows are its windows)",
                ));
            }
            if !windows.iter().any(|w| w.name == q.window) {
                return Err(ConfigError::new(
                    key("window"),
                    "not a window in accounting.windows",
                ));
            }
            if q.tokens.is_none() && q.cost_micros.is_none() {
                return Err(ConfigError::new(
                    key("tokens"),
                    "a quota needs tokens, cost_micros or both",
                ));
            }
            if q.tokens == Some(0) {
                return Err(ConfigError::new(key("tokens"), "must be positive"));
            }
            if q.cost_micros.is_some_and(|c| c <= 0) {
                return Err(ConfigError::new(key("cost_micros"), "must be positive"));
            }
        }
        Ok(())
    }

    fn validate_batching(&self) -> Result<(), ConfigError> {
        let b = &self.batching;
        if !(1..=60_000).contains(&b.window_ms) {
            return Err(ConfigError::new(
                "batching.window_ms",
                "must be between 1 and 60000",
            ));
        }
        if b.max_items == 0 {
            return Err(ConfigError::new("batching.max_items", "must be at least 1"));
        }
        if b.max_item_tokens == 0 || b.max_tokens < b.max_item_tokens {
            return Err(ConfigError::new(
                "batching.max_tokens",
                "must be at least batching.max_item_tokens, which must be at least 1",
            ));
        }
        for (i, t) in b.exclude_task_types.iter().enumerate() {
            if !self.topics.task_types.contains(t) {
                return Err(ConfigError::new(
                    format!("batching.exclude_task_types[{i}]"),
                    format!("{t} is not in topics.task_types"),
                ));
            }
        }
        Ok(())
    }

    fn validate_tiers(&self) -> Result<(), ConfigError> {
        let tiers = &self.routing.tiers;
        let mut last = 0.0;
        for (i, t) in tiers.iter().enumerate() {
            let key = |field: &str| format!("routing.tiers[{i}].{field}");
            if t.name.trim().is_empty() || tiers[..i].iter().any(|o| o.name == t.name) {
                return Err(ConfigError::new(key("name"), "empty or repeated tier name"));
            }
            if !self.knows_model(&t.model) {
                return Err(ConfigError::new(
                    key("model"),
                    format!("unknown model {}", t.model),
                ));
            }
            if !(t.max_score > last && t.max_score <= 1.0) {
                return Err(ConfigError::new(
                    key("max_score"),
                    "must rise from tier to tier, within (0, 1]",
                ));
            }
            last = t.max_score;
        }
        if !tiers.is_empty() && last < 1.0 {
            return Err(ConfigError::new(
                format!("routing.tiers[{}].max_score", tiers.len() - 1),
                "the last tier must reach 1.0",
            ));
        }
        let f = &self.routing.features;
        let unit = |v: f64| (0.0..=1.0).contains(&v);
        for (t, v) in &f.type_complexity {
            if !unit(*v) {
                return Err(ConfigError::new(
                    format!("routing.features.type_complexity.{t}"),
                    "must be within [0, 1]",
                ));
            }
        }
        if !unit(f.default_type_complexity) {
            return Err(ConfigError::new(
                "routing.features.default_type_complexity",
                "must be within [0, 1]",
            ));
        }
        for (name, w) in [
            ("type_weight", f.type_weight),
            ("size_weight", f.size_weight),
            ("structure_weight", f.structure_weight),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(ConfigError::new(
                    format!("routing.features.{name}"),
                    "must be a non-negative number",
                ));
            }
        }
        Ok(())
    }

    /// Whether `model` names a configured model.
    fn knows_model(&self, model: &str) -> bool {
        self.llm.models.iter().any(|m| m.name == model)
    }
}

fn parse_env_value(raw: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

fn set_path(table: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    let (last, parents) = path.split_last().ok_or("empty key")?;
    let mut cur = table;
    for p in parents {
        let entry = cur
            .entry(p.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry
            .as_table_mut()
            .ok_or_else(|| format!("{p} is not a table"))?;
    }
    cur.insert(last.clone(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[kafka]
bootstrap_servers = "localhost:9092"

[[llm.providers]]
name = "sim"
base_url = "http://127.0.0.1:8089/v1"

[[llm.models]]
name = "small"
provider = "sim"

[prices.small]
input = 150000
output = 600000
"#;

    fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_toml_with_env(
            text,
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    #[test]
    fn a_claims_key_file_must_be_readable_and_long_enough() {
        let dir = tempfile::tempdir().unwrap();
        let with = |path: &std::path::Path| {
            load(
                MINIMAL,
                &[("SLUICE_HTTP__CLAIMS_KEY_FILE", path.to_str().unwrap())],
            )
        };
        let short = dir.path().join("short");
        std::fs::write(&short, "only sixteen byt\n").unwrap();
        let e = with(&short).unwrap_err();
        assert_eq!(e.key, "http.claims_key_file");
        assert!(e.message.contains("at least 32"), "{}", e.message);
        let e = with(&dir.path().join("missing")).unwrap_err();
        assert_eq!(e.key, "http.claims_key_file");
        let good = dir.path().join("key");
        std::fs::write(&good, "0123456789abcdef0123456789abcdef\n").unwrap();
        let c = with(&good).unwrap();
        assert!(c.http.claims_key().unwrap().is_some());
        assert!(load(MINIMAL, &[])
            .unwrap()
            .http
            .claims_key()
            .unwrap()
            .is_none());
    }

    #[test]
    fn the_drain_follows_the_longest_model_timeout_unless_set() {
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.drain_timeout_ms(), 60_000 + DRAIN_MARGIN_MS);
        assert_eq!(c.streams().drain_timeout, Duration::from_millis(65_000));
        let longer = MINIMAL.replace(
            "provider = \"sim\"\n",
            "provider = \"sim\"\ntimeout_ms = 120000\n",
        );
        assert_eq!(load(&longer, &[]).unwrap().drain_timeout_ms(), 125_000);
        let set = load(MINIMAL, &[("SLUICE_APP__DRAIN_TIMEOUT_MS", "1000")]).unwrap();
        assert_eq!(set.drain_timeout_ms(), 1000);
        // A drain the rebalance cannot wait for is refused, naming the key.
        let err = load(MINIMAL, &[("SLUICE_KAFKA__MAX_POLL_INTERVAL_MS", "60000")]).unwrap_err();
        assert_eq!(err.key, "app.drain_timeout_ms", "{err:?}");
    }

    #[test]
    fn group_protocol_and_static_membership() {
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.streams().group_protocol, GroupProtocol::Consumer);
        assert_eq!(c.streams().group_instance_id, None);
        let c = load(
            MINIMAL,
            &[
                ("SLUICE_KAFKA__GROUP_PROTOCOL", "classic"),
                ("SLUICE_KAFKA__GROUP_INSTANCE_ID", "sluice-2"),
            ],
        )
        .unwrap();
        assert_eq!(c.streams().group_protocol, GroupProtocol::Classic);
        assert_eq!(c.streams().group_instance_id.as_deref(), Some("sluice-2"));
        let err = load(MINIMAL, &[("SLUICE_KAFKA__GROUP_INSTANCE_ID", "a b")]).unwrap_err();
        assert_eq!(err.key, "kafka.group_instance_id", "{err:?}");
        let err = load(MINIMAL, &[("SLUICE_KAFKA__GROUP_PROTOCOL", "eager")]).unwrap_err();
        assert!(err.to_string().contains("group_protocol"), "{err}");
    }

    #[test]
    fn minimal_config_has_defaults() {
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.app.guarantee, Guarantee::ExactlyOnce);
        assert_eq!(c.topics.task_topic("summarize"), "ai.tasks.summarize");
        assert_eq!(c.topics.dlq_topic("summarize"), "ai.tasks.summarize.dlq");
        assert_eq!(c.router().default_model, "small");
        assert_eq!(c.streams().commit_interval(), Duration::from_millis(100));
    }

    #[test]
    fn adaptive_concurrency_is_on_by_default_and_bad_bounds_name_the_key() {
        let c = load(MINIMAL, &[]).unwrap();
        let conc = &c.llm.models[0].limiter.concurrency;
        assert!(conc.enabled);
        assert_eq!((conc.min_limit, conc.initial_limit), (1, 4));
        let with = |table: &str| {
            MINIMAL.replace(
                "provider = \"sim\"",
                &format!("provider = \"sim\"\nlimiter = {{ concurrency = {{ {table} }} }}"),
            )
        };
        let c = load(&with("enabled = false"), &[]).unwrap();
        assert!(!c.llm.models[0].limiter.concurrency.enabled);
        for (table, key) in [
            ("min_limit = 0", "min_limit"),
            (
                "max_limit = 2, initial_limit = 2, min_limit = 3",
                "max_limit",
            ),
            ("initial_limit = 5000", "initial_limit"),
            ("max_queue = 0.5", "max_queue"),
        ] {
            let err = load(&with(table), &[]).unwrap_err();
            assert_eq!(
                err.key,
                format!("llm.models[0].limiter.concurrency.{key}"),
                "{table}: {err}"
            );
        }
        let err = load(&with("max_inflight = 3"), &[]).unwrap_err();
        assert!(err.to_string().contains("max_inflight"), "{err}");
    }

    #[test]
    fn group_limits_must_be_positive_numbers_and_bad_ones_name_the_key() {
        let with = |table: &str| {
            MINIMAL.replace(
                "provider = \"sim\"",
                &format!("provider = \"sim\"\nlimiter = {{ {table} }}"),
            )
        };
        let c = load(&with("group_rps = 20.0, group_tpm = 90000.0"), &[]).unwrap();
        let limiter = &c.llm.models[0].limiter;
        assert_eq!(
            (limiter.group_rps, limiter.group_tpm),
            (Some(20.0), Some(90000.0))
        );
        assert!(load(MINIMAL, &[]).unwrap().llm.models[0]
            .limiter
            .group_rps
            .is_none());
        for (table, key) in [
            ("group_rps = 0.0", "group_rps"),
            ("group_rps = -3.0", "group_rps"),
            ("group_rps = inf", "group_rps"),
            ("group_tpm = nan", "group_tpm"),
            ("group_tpm = 0.0", "group_tpm"),
        ] {
            let err = load(&with(table), &[]).unwrap_err();
            assert_eq!(
                err.key,
                format!("llm.models[0].limiter.{key}"),
                "{table}: {err}"
            );
            assert!(err.message.contains("positive"), "{table}: {err}");
        }
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_path() {
        let err = load(&format!("{MINIMAL}\n[app]\nguarantees = \"x\"\n"), &[]).unwrap_err();
        assert!(err.key.contains("app"), "{err}");
        assert!(err.to_string().contains("guarantees"), "{err}");
        let err = load(
            &MINIMAL.replace("provider = \"sim\"", "provider = \"sim\"\ntimeout = 3"),
            &[],
        )
        .unwrap_err();
        assert!(err.key.starts_with("llm.models"), "{err}");
    }

    #[test]
    fn wrong_types_and_bad_references_name_the_key() {
        let err = load(
            &format!("{MINIMAL}\n[app]\nmax_in_flight_per_partition = \"many\"\n"),
            &[],
        )
        .unwrap_err();
        assert_eq!(err.key, "app.max_in_flight_per_partition", "{err}");
        let err = load(
            &format!("{MINIMAL}\n[routing]\ndefault_model = \"huge\"\n"),
            &[],
        )
        .unwrap_err();
        assert_eq!(err.key, "routing.default_model");
        let err = load(
            &format!("{MINIMAL}\n[prices.nope]\ninput = 1\noutput = 1\n"),
            &[],
        )
        .unwrap_err();
        assert_eq!(err.key, "prices.nope");
        // A price without its output rate (or an empty one) is refused, not
        // read as free output.
        let err = load(&MINIMAL.replace("output = 600000\n", ""), &[]).unwrap_err();
        assert_eq!(err.key, "prices.small", "{err}");
        assert!(err.to_string().contains("output"), "{err}");
        let err = load(
            &MINIMAL.replace("input = 150000\noutput = 600000\n", ""),
            &[],
        )
        .unwrap_err();
        assert_eq!(err.key, "prices.small", "{err}");
        // Unset cache rates follow the input price.
        let price = load(MINIMAL, &[]).unwrap().prices["small"];
        assert_eq!(
            (price.cached_rate(), price.cache_write_rate()),
            (150_000, 187_500)
        );
        let err = load(
            &MINIMAL.replace("provider = \"sim\"", "provider = \"other\""),
            &[],
        )
        .unwrap_err();
        assert_eq!(err.key, "llm.models[0].provider");
    }

    /// A calendar-month window is configured with `calendar = "month"`,
    /// never with a fixed size too.
    #[test]
    fn calendar_windows_are_configured_and_checked() {
        let month = "\n[[accounting.windows]]\nname = \"1mo\"\ncalendar = \"month\"\nretention_ms = 8640000000\n";
        let c = load(&format!("{MINIMAL}{month}"), &[]).unwrap();
        assert_eq!(
            c.accounting.windows[0].calendar,
            Some(crate::steps::account::Calendar::Month)
        );
        let both = month.replace("calendar", "size_ms = 1000\ncalendar");
        let err = load(&format!("{MINIMAL}{both}"), &[]).unwrap_err();
        assert_eq!(err.key, "accounting.windows[0].size_ms", "{err}");
        let short = month.replace("8640000000", "86400000");
        let err = load(&format!("{MINIMAL}{short}"), &[]).unwrap_err();
        assert_eq!(err.key, "accounting.windows[0].retention_ms", "{err}");
        let neither = month.replace("calendar = \"month\"\n", "");
        let err = load(&format!("{MINIMAL}{neither}"), &[]).unwrap_err();
        assert_eq!(err.key, "accounting.windows[0].size_ms", "{err}");
    }

    const TIERED: &str = r#"
[[llm.models]]
name = "large"
provider = "sim"

[prices.large]
input = 2500000
output = 10000000

[routing]
fallbacks = { large = "small" }
tiers = [
    { name = "cheap", max_score = 0.5, model = "small" },
    { name = "strong", max_score = 1.0, model = "large" },
]

[routing.features]
type_complexity = { classify = 0.1 }
"#;

    #[test]
    fn complexity_tiers_route_and_are_validated() {
        let c = load(&format!("{MINIMAL}{TIERED}"), &[]).unwrap();
        let r = c.router();
        assert_eq!(r.tiers.len(), 2);
        assert_eq!(r.features.type_complexity["classify"], 0.1);
        assert_eq!(r.fallback("large", |m| m == "large"), Some("small"));
        let bad = |from: &str, to: &str| {
            load(&format!("{MINIMAL}{}", TIERED.replace(from, to)), &[])
                .unwrap_err()
                .key
        };
        assert_eq!(
            bad("model = \"large\" }", "model = \"huge\" }"),
            "routing.tiers[1].model"
        );
        assert_eq!(
            bad("max_score = 0.5", "max_score = 1.0"),
            "routing.tiers[1].max_score"
        );
        assert_eq!(
            bad("max_score = 1.0,", "max_score = 0.9,"),
            "routing.tiers[1].max_score"
        );
        assert_eq!(
            bad("name = \"strong\"", "name = \"cheap\""),
            "routing.tiers[1].name"
        );
        assert_eq!(
            bad("classify = 0.1", "classify = 1.5"),
            "routing.features.type_complexity.classify"
        );
    }

    #[test]
    fn processing_threads_must_be_positive() {
        let err = load(&format!("{MINIMAL}\n[app]\nprocessing_threads = 0\n"), &[]).unwrap_err();
        assert_eq!(err.key, "app.processing_threads", "{err}");
        let c = load(&format!("{MINIMAL}\n[app]\nprocessing_threads = 3\n"), &[]).unwrap();
        assert_eq!(c.app.processing_threads, Some(3));
    }

    #[test]
    fn environment_overrides_apply_with_types() {
        let c = load(
            MINIMAL,
            &[
                ("SLUICE_KAFKA__BOOTSTRAP_SERVERS", "broker:9093"),
                ("SLUICE_APP__MAX_IN_FLIGHT_PER_PARTITION", "7"),
                ("SLUICE_APP__GUARANTEE", "at_least_once"),
                ("SLUICE_LOG", "debug"),
            ],
        )
        .unwrap();
        assert_eq!(c.kafka.bootstrap_servers, "broker:9093");
        assert_eq!(c.app.max_in_flight_per_partition, 7);
        assert_eq!(c.app.guarantee, Guarantee::AtLeastOnce);
        let err = load(MINIMAL, &[("SLUICE_APP__NOPE", "1")]).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
    }

    /// Credentials in the configuration never show in its `Debug` output
    /// (which a log line or a panic message may carry): Kafka client
    /// passwords (inline, from files, from the environment), provider
    /// headers and query keys, a proxy's password, a collector's headers.
    #[test]
    fn debug_output_shows_no_credential() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("password");
        std::fs::write(&file, "pw-file\n").unwrap();
        let text = MINIMAL
            .replace(
                "bootstrap_servers = \"localhost:9092\"\n",
                &format!(
                    "bootstrap_servers = \"localhost:9092\"\nclient = {{ \"sasl.username\" = \"svc\", \
                     \"sasl.password_file\" = \"{}\", \"ssl.key.pem\" = \"pw-pem\" }}\n",
                    file.display()
                ),
            )
            .replace(
                "base_url = \"http://127.0.0.1:8089/v1\"\n",
                "base_url = \"http://127.0.0.1:8089/v1\"\nproxy = \"http://me:pw-proxy@proxy:3128\"\n\
                 headers = { \"x-api-key\" = \"pw-header\", \"OpenAI-Project\" = \"proj-1\" }\n\
                 query = { \"api-version\" = \"2024-06-01\", \"key\" = \"pw-query\" }\n",
            )
            + "\n[tracing]\notlp_headers = { authorization = \"Bearer pw-otlp\" }\n";
        let c = load(
            &text,
            &[(
                "SLUICE_KAFKA__CLIENT__SASL.OAUTHBEARER.CLIENT.SECRET",
                "pw-env",
            )],
        )
        .unwrap();
        assert_eq!(c.kafka.client["sasl.password"], "pw-file");
        for shown in [
            format!("{c:?}"),
            format!("{c:#?}"),
            format!("{:?}", c.kafka.cluster()),
        ] {
            for secret in [
                "pw-file",
                "pw-pem",
                "pw-proxy",
                "pw-header",
                "pw-query",
                "pw-otlp",
                "pw-env",
            ] {
                assert!(!shown.contains(secret), "{secret} in {shown}");
            }
            // What helps a reader stays.
            assert!(shown.contains("localhost:9092"), "{shown}");
        }
        let shown = format!("{c:?}");
        for harmless in ["\"svc\"", "proj-1", "2024-06-01", "proxy:3128"] {
            assert!(shown.contains(harmless), "{harmless} in {shown}");
        }
    }

    #[test]
    fn kafka_client_secrets_come_from_files() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("password");
        std::fs::write(&secret, "s3cret-from-file\n").unwrap();
        let with = |client: &str| {
            load(
                &MINIMAL.replace(
                    "bootstrap_servers = \"localhost:9092\"\n",
                    &format!("bootstrap_servers = \"localhost:9092\"\n{client}\n"),
                ),
                &[],
            )
        };
        let c = with(&format!(
            "client = {{ \"sasl.password_file\" = \"{}\", \"sasl.username\" = \"svc\" }}",
            secret.display()
        ))
        .unwrap();
        assert_eq!(c.kafka.client["sasl.password"], "s3cret-from-file");
        assert!(!c.kafka.client.contains_key("sasl.password_file"));
        assert_eq!(
            c.kafka.cluster().client["sasl.password"],
            "s3cret-from-file",
            "every client gets it"
        );
        // From the environment too, as deployments mount secrets.
        let c = load(
            MINIMAL,
            &[(
                "SLUICE_KAFKA__CLIENT__SSL.KEY.PASSWORD_FILE",
                &secret.display().to_string(),
            )],
        )
        .unwrap();
        assert_eq!(c.kafka.client["ssl.key.password"], "s3cret-from-file");

        let missing = dir.path().join("absent");
        let err = with(&format!(
            "client = {{ \"sasl.password_file\" = \"{}\" }}",
            missing.display()
        ))
        .unwrap_err();
        assert_eq!(err.key, "kafka.client.\"sasl.password_file\"", "{err}");
        let err = with(&format!(
            "client = {{ \"sasl.password_file\" = \"{}\", \"sasl.password\" = \"x\" }}",
            secret.display()
        ))
        .unwrap_err();
        assert_eq!(err.key, "kafka.client.\"sasl.password_file\"", "{err}");
        assert!(!err.to_string().contains("s3cret"), "{err}");
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let err = with(&format!(
            "client = {{ \"sasl.password_file\" = \"{}\" }}",
            empty.display()
        ))
        .unwrap_err();
        assert!(err.message.contains("empty"), "{err}");
    }

    #[test]
    fn a_numeric_override_of_a_string_key_stays_a_string() {
        let c = load(
            MINIMAL,
            &[
                ("SLUICE_KAFKA__CLIENT__SASL.PASSWORD", "12345"),
                ("SLUICE_KAFKA__BOOTSTRAP_SERVERS", "9092"),
                ("SLUICE_APP__MAX_IN_FLIGHT_PER_PARTITION", "7"),
            ],
        )
        .unwrap();
        assert_eq!(c.kafka.client["sasl.password"], "12345");
        assert_eq!(c.kafka.bootstrap_servers, "9092");
        assert_eq!(c.app.max_in_flight_per_partition, 7);
        let err = load(
            MINIMAL,
            &[("SLUICE_APP__MAX_IN_FLIGHT_PER_PARTITION", "many")],
        )
        .unwrap_err();
        assert_eq!(err.key, "app.max_in_flight_per_partition", "{err}");
    }

    #[test]
    fn the_task_partitioner_is_murmur2_unless_set_and_is_validated() {
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.streams().key_partitioner, KeyPartitioner::Murmur2);
        let c = load(
            &format!("{MINIMAL}\n[tasks]\npartitioner = \"crc32\"\n"),
            &[],
        )
        .unwrap();
        assert_eq!(c.streams().key_partitioner, KeyPartitioner::Crc32);
        let err = load(MINIMAL, &[("SLUICE_TASKS__PARTITIONER", "fnv1a")]).unwrap_err();
        assert_eq!(err.key, "tasks.partitioner", "{err}");
        assert!(err.message.contains("murmur2"), "{err}");
    }

    #[test]
    fn the_advertised_url_is_an_http_url_or_follows_the_listener() {
        let bound: std::net::SocketAddr = "127.0.0.1:4321".parse().unwrap();
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.http.advertised_url, None);
        assert_eq!(
            c.http.advertised(bound).as_deref(),
            Some("http://127.0.0.1:4321")
        );
        assert_eq!(c.http.advertised("0.0.0.0:8080".parse().unwrap()), None);
        let c = load(
            MINIMAL,
            &[(
                "SLUICE_HTTP__ADVERTISED_URL",
                "http://sluice-0.sluice-headless.ns.svc.cluster.local:8080/",
            )],
        )
        .unwrap();
        assert_eq!(
            c.http.advertised(bound).as_deref(),
            Some("http://sluice-0.sluice-headless.ns.svc.cluster.local:8080")
        );
        for bad in ["sluice-0:8080", "ftp://x", "http://x/?a=1", "not a url"] {
            let err = load(MINIMAL, &[("SLUICE_HTTP__ADVERTISED_URL", bad)]).unwrap_err();
            assert_eq!(err.key, "http.advertised_url", "{bad}: {err}");
        }
    }

    #[test]
    fn http2_streams_out_of_range_name_the_key() {
        for bad in ["0", "100001"] {
            let text = MINIMAL.replace(
                "base_url = \"http://127.0.0.1:8089/v1\"",
                &format!("base_url = \"http://127.0.0.1:8089/v1\"\nhttp2 = true\nhttp2_max_streams = {bad}"),
            );
            let err = load(&text, &[]).unwrap_err();
            assert_eq!(
                err.key, "llm.providers[0].http2_max_streams",
                "{bad}: {err}"
            );
        }
        let text = MINIMAL.replace(
            "base_url = \"http://127.0.0.1:8089/v1\"",
            "base_url = \"http://127.0.0.1:8089/v1\"\nhttp2 = true",
        );
        let c = load(&text, &[]).unwrap();
        assert!(c.llm.providers[0].http2);
        assert_eq!(c.llm.providers[0].http2_max_streams, 100);
    }

    #[test]
    fn the_gateway_fetch_wait_is_bounded_and_names_its_key() {
        assert_eq!(load(MINIMAL, &[]).unwrap().gateway.fetch_wait_ms, 10);
        for (value, ok) in [("0", true), ("1000", true), ("1001", false)] {
            let text = format!("{MINIMAL}\n[gateway]\nfetch_wait_ms = {value}\n");
            match load(&text, &[]) {
                Ok(c) => {
                    assert!(ok, "{value} accepted");
                    assert_eq!(c.gateway.fetch_wait_ms.to_string(), value);
                }
                Err(e) => {
                    assert!(!ok, "{value}: {e}");
                    assert_eq!(e.key, "gateway.fetch_wait_ms");
                }
            }
        }
    }

    #[test]
    fn missing_api_key_env_names_the_provider() {
        let text = MINIMAL.replace(
            "base_url = \"http://127.0.0.1:8089/v1\"",
            "base_url = \"http://127.0.0.1:8089/v1\"\napi_key_env = \"SLUICE_TEST_NO_SUCH_KEY\"",
        );
        let err = load(&text, &[]).unwrap_err();
        assert_eq!(err.key, "llm.providers[0]");
        assert!(err.message.contains("SLUICE_TEST_NO_SUCH_KEY"));
    }
}
