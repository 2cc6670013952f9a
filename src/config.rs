//! The `sluice run` configuration: a TOML file plus `SLUICE_<SECTION>__<KEY>`
//! environment overrides (e.g. `SLUICE_KAFKA__BOOTSTRAP_SERVERS`). Unknown keys
//! are rejected and every problem names its key; the CLI exits with code 2.
//!
//! This module only composes: each section's type and its own checks live
//! beside the part that uses it (`[kafka]` in [`crate::kafka`], `[tasks]` in
//! [`crate::steps::source`], `[routing]` in [`crate::steps::route`],
//! `[batching]` in [`crate::steps::batch`], `[prompts]` in
//! [`crate::steps::invoke_llm::prompt`], `[accounting]` in
//! [`crate::steps::account::config`], `[llm]` in [`crate::llm::config`],
//! `[http]` in [`crate::http::config`], `[tracing]` in [`crate::trace`],
//! `[gateway]` in [`crate::cli::gateway::config`]); here are `[app]`,
//! `[topics]` and `[prices]`, loading, the environment overrides, and the
//! checks across sections.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sluice_topology::runtime::{Guarantee, StreamsConfig};
use sluice_topology::RocksSettings;

use crate::cli::gateway::config::GatewaySection;
use crate::http::config::HttpSection;
use crate::kafka::KafkaSection;
use crate::llm::LlmConfig;
use crate::steps::account::config::AccountingSection;
use crate::steps::account::pricing::Price;
use crate::steps::batch::BatchingConfig;
use crate::steps::invoke_llm::prompt::PromptConfig;
use crate::steps::route::{Router, RoutingSection};
use crate::steps::source::TasksSection;

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

/// What the default drain timeout adds to the longest model timeout: the
/// answer's handling and the batch window.
pub const DRAIN_MARGIN_MS: u64 = 5_000;

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

/// The smallest valid configuration: an unreachable broker, one provider
/// (`sim`, where nothing listens) and one priced model (`small`). The
/// configuration tests, the command-line tests and the metrics catalogue
/// start from it and add what they test.
#[doc(hidden)]
pub const MINIMAL: &str = r#"
[kafka]
bootstrap_servers = "127.0.0.1:1"

[[llm.providers]]
name = "sim"
base_url = "http://127.0.0.1:1/v1"

[[llm.models]]
name = "small"
provider = "sim"

[prices.small]
input = 150000
output = 600000
"#;

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

    /// Checks of every section, then across sections.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.tracing.validate()?;
        self.kafka.validate()?;
        self.validate_app()?;
        self.validate_topics()?;
        self.tasks.validate()?;
        self.llm.validate()?;
        self.routing.validate(|m| self.knows_model(m))?;
        self.batching.validate(&self.topics.task_types)?;
        self.validate_prices()?;
        self.accounting.validate()?;
        self.http.validate()?;
        self.gateway.validate()
    }

    fn validate_app(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    fn validate_topics(&self) -> Result<(), ConfigError> {
        if self.topics.replication_factor < 1 && self.topics.replication_factor != -1 {
            return Err(ConfigError::new(
                "topics.replication_factor",
                "must be at least 1, or -1 for the cluster's default",
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
        Ok(())
    }

    /// Every model priced, every price a model's. Costs are exact sums of
    /// integers: a model without a price would count as free without anyone
    /// noticing.
    fn validate_prices(&self) -> Result<(), ConfigError> {
        for m in &self.llm.models {
            if !self.prices.contains_key(&m.name) {
                return Err(ConfigError::new(
                    format!("prices.{}", m.name),
                    "every model needs a price (input and output micro-dollars per million tokens; cached and cache_write optional)",
                ));
            }
        }
        for m in self.prices.keys() {
            if !self.knows_model(m) {
                return Err(ConfigError::new(
                    format!("prices.{m}"),
                    format!("unknown model {m}"),
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
        self.routing.router(&self.llm.models[0].name)
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

/// What the configuration tests of every section share.
#[cfg(test)]
pub(crate) mod tests_support {
    use super::{Config, ConfigError};

    /// Parses `text` with the environment overrides `env` (name, value).
    pub(crate) fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_toml_with_env(
            text,
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }
}

#[cfg(test)]
mod tests {
    use sluice_topology::runtime::{GroupProtocol, KeyPartitioner};

    use super::*;

    use super::tests_support::load;

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
                "bootstrap_servers = \"127.0.0.1:1\"\n",
                &format!(
                    "bootstrap_servers = \"127.0.0.1:1\"\nclient = {{ \"sasl.username\" = \"svc\", \
                     \"sasl.password_file\" = \"{}\", \"ssl.key.pem\" = \"pw-pem\" }}\n",
                    file.display()
                ),
            )
            .replace(
                "base_url = \"http://127.0.0.1:1/v1\"\n",
                "base_url = \"http://127.0.0.1:1/v1\"\nproxy = \"http://me:pw-proxy@proxy:3128\"\n\
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
            assert!(shown.contains("127.0.0.1:1"), "{shown}");
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
                    "bootstrap_servers = \"127.0.0.1:1\"\n",
                    &format!("bootstrap_servers = \"127.0.0.1:1\"\n{client}\n"),
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
    fn http2_streams_out_of_range_name_the_key() {
        for bad in ["0", "100001"] {
            let text = MINIMAL.replace(
                "base_url = \"http://127.0.0.1:1/v1\"",
                &format!(
                    "base_url = \"http://127.0.0.1:1/v1\"\nhttp2 = true\nhttp2_max_streams = {bad}"
                ),
            );
            let err = load(&text, &[]).unwrap_err();
            assert_eq!(
                err.key, "llm.providers[0].http2_max_streams",
                "{bad}: {err}"
            );
        }
        let text = MINIMAL.replace(
            "base_url = \"http://127.0.0.1:1/v1\"",
            "base_url = \"http://127.0.0.1:1/v1\"\nhttp2 = true",
        );
        let c = load(&text, &[]).unwrap();
        assert!(c.llm.providers[0].http2);
        assert_eq!(c.llm.providers[0].http2_max_streams, 100);
    }

    #[test]
    fn missing_api_key_env_names_the_provider() {
        let text = MINIMAL.replace(
            "base_url = \"http://127.0.0.1:1/v1\"",
            "base_url = \"http://127.0.0.1:1/v1\"\napi_key_env = \"SLUICE_TEST_NO_SUCH_KEY\"",
        );
        let err = load(&text, &[]).unwrap_err();
        assert_eq!(err.key, "llm.providers[0]");
        assert!(err.message.contains("SLUICE_TEST_NO_SUCH_KEY"));
    }
}
