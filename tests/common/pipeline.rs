//! The LLM pipeline's test fixture: a simulator, a `sluice run` config with
//! the test's own topics, instances of the app, tasks and their results.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::Message;
use sluice::envelope::TaskResult;
use sluice::kafka::{produce, read_topics, OutRecord};
use sluice::sim::{SimConfig, SimHandle};

use super::{bootstrap, eventually, temp_dir, unique, Proc};

/// Config of tests about single calls (their count, their order through the
/// limiter, a breaker's probes): micro-batching off.
/// The query API's admin token in the fixture's tokens file.
pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

/// `tenant-0`'s own token in the fixture's tokens file.
pub const TENANT0_TOKEN: &str = "test-tenant-0-token-0123456789";

/// `tenant-<i>`'s own token in the fixture's tokens file (`i` < 10).
pub fn tenant_token(i: usize) -> String {
    format!("test-tenant-{i}-token-0123456789")
}

/// Writes the fixture's tokens file into `dir`: the admin token, and one
/// token for each of `tenant-0` … `tenant-9`, `tenant-9`'s kept hashed.
fn tokens_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let path = dir.path().join("tokens");
    let mut text = format!("{ADMIN_TOKEN} admin\n");
    for i in 0..10 {
        let token = match i {
            9 => sluice::http::auth::hashed(&tenant_token(i)),
            _ => tenant_token(i),
        };
        text.push_str(&format!("{token} tenant:tenant-{i}\n"));
    }
    std::fs::write(&path, text).unwrap();
    path
}

/// The secret the fixture's instances sign their claims with.
pub const CLAIMS_KEY: &str = "test-claims-key-0123456789abcdef0123456789";

pub const UNBATCHED: &str = "[batching]\nenabled = false\n";

/// A simulator, a config and the topics of one test.
pub struct Pipeline {
    pub rt: tokio::runtime::Runtime,
    /// The cluster the pipeline and the test's own clients use.
    pub cluster: sluice::kafka::Cluster,
    pub sim: SimHandle,
    pub prefix: String,
    pub config: PathBuf,
    pub _dir: tempfile::TempDir,
    pub state: tempfile::TempDir,
}

impl Pipeline {
    pub fn new(sim_config: SimConfig, extra_toml: &str) -> Pipeline {
        Self::with(sim_config, "exactly_once", extra_toml)
    }

    pub fn with(sim_config: SimConfig, guarantee: &str, extra_toml: &str) -> Pipeline {
        Self::with_partitions(sim_config, guarantee, extra_toml, 2, &[])
    }

    /// Topics of `partitions` partitions, but the task topics of the task
    /// types in `task_topics`, which get the partition count given there.
    pub fn with_partitions(
        sim_config: SimConfig,
        guarantee: &str,
        extra_toml: &str,
        partitions: i32,
        task_topics: &[(&str, i32)],
    ) -> Pipeline {
        let cluster = sluice::kafka::Cluster::from(&bootstrap());
        Self::build(
            sim_config,
            guarantee,
            extra_toml,
            partitions,
            task_topics,
            cluster,
        )
    }

    /// Exactly-once on `cluster` (its client properties go to
    /// `[kafka.client]`, and the test's own clients use them too).
    pub fn over(
        cluster: sluice::kafka::Cluster,
        sim_config: SimConfig,
        extra_toml: &str,
    ) -> Pipeline {
        Self::build(sim_config, "exactly_once", extra_toml, 2, &[], cluster)
    }

    fn build(
        sim_config: SimConfig,
        guarantee: &str,
        extra_toml: &str,
        partitions: i32,
        task_topics: &[(&str, i32)],
        cluster: sluice::kafka::Cluster,
    ) -> Pipeline {
        // Inline, and only when there are properties: a test's extra TOML
        // may have a [kafka.client] table of its own.
        let client = match cluster.client.is_empty() {
            true => String::new(),
            false => {
                let props: Vec<String> = cluster
                    .client
                    .iter()
                    .map(|(k, v)| format!("{k:?} = {v:?}"))
                    .collect();
                format!("client = {{ {} }}", props.join(", "))
            }
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let sim = rt
            .block_on(sluice::sim::start(
                sim_config,
                "127.0.0.1:0".parse().unwrap(),
            ))
            .unwrap();
        let prefix = unique("llm");
        let dir = temp_dir();
        let state = temp_dir();
        let config = dir.path().join("sluice.toml");
        let toml = format!(
            r#"
[app]
id = "{prefix}-app"
state_dir = "{state}"
guarantee = "{guarantee}"
max_in_flight_per_partition = 2000

[kafka]
bootstrap_servers = "{bootstrap}"
session_timeout_ms = 6000
{client}

[topics]
tasks_prefix = "{prefix}.tasks."
results_completed = "{prefix}.results.completed"
results_failed = "{prefix}.results.failed"
usage = "{prefix}.usage"
alerts = "{prefix}.alerts"
partitions = {partitions}

[tasks]
max_bytes = 4096
probe_interval_ms = 500
# Re-published attempts wait a tenth of a second or so, not half a minute.
retry_backoff_ms = 100
retry_backoff_max_ms = 1000

[[llm.providers]]
name = "sim"
base_url = "{url}"

[[llm.models]]
name = "small"
provider = "sim"
timeout_ms = 30000
limiter = {{ initial_rps = 400 }}
breaker = {{ open_ms = 2000 }}

[[llm.models]]
name = "large"
provider = "sim"
timeout_ms = 30000
limiter = {{ initial_rps = 400 }}

[routing]
default_model = "small"
# The tests pick tiers with the tasks' own payload.complexity.
allow_task_overrides = true

[prices.small]
input = 150000
output = 600000
cached = 75000

[prices.large]
input = 2500000
output = 10000000
cached = 1250000

[http]
listen = "127.0.0.1:0"
tokens_file = "{tokens}"
claims_key_file = "{claims_key}"
{extra_toml}
"#,
            state = state.path().display(),
            bootstrap = cluster.bootstrap,
            url = sim.base_url(),
            tokens = tokens_file(&dir).display(),
            claims_key = {
                let path = dir.path().join("claims-key");
                std::fs::write(&path, format!("{CLAIMS_KEY}\n")).unwrap();
                path.display().to_string()
            },
        );
        std::fs::write(&config, toml).unwrap();
        let p = Pipeline {
            rt,
            cluster,
            sim,
            prefix,
            config,
            _dir: dir,
            state,
        };
        for (task_type, n) in task_topics {
            let topic = p.topic(task_type);
            sluice::kafka::create_topics(&p.cluster, &[(&topic, *n, &[])]).unwrap();
        }
        let out = std::process::Command::new(super::sluice_bin())
            .args([
                "topics",
                "create",
                "--config",
                &p.config.display().to_string(),
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "topics create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        p
    }

    pub fn topic(&self, task_type: &str) -> String {
        format!("{}.tasks.{task_type}", self.prefix)
    }

    pub fn dlq(&self, task_type: &str) -> String {
        format!("{}.tasks.{task_type}.dlq", self.prefix)
    }

    pub fn completed(&self) -> String {
        format!("{}.results.completed", self.prefix)
    }

    pub fn failed(&self) -> String {
        format!("{}.results.failed", self.prefix)
    }

    /// Starts `sluice run` and waits until it is ready.
    pub fn start(&self, name: &str) -> App {
        self.start_env(name, &[])
    }

    /// Starts `sluice run` with extra environment and waits until it listens
    /// (and, without extra environment, until it is ready).
    pub fn start_env(&self, name: &str, env: &[(&str, &str)]) -> App {
        self.start_with(name, &self.config, env, env.is_empty())
    }

    /// Changes the generated config before an instance starts: each
    /// `(from, to)` replaces the first `from`, which must be there (an edit
    /// that matched nothing would leave the test not testing what it says).
    pub fn edit_config(&self, edits: &[(&str, &str)]) {
        let mut text = std::fs::read_to_string(&self.config).unwrap();
        for (from, to) in edits {
            assert!(text.contains(from), "the config has no {from:?}:\n{text}");
            text = text.replacen(from, to, 1);
        }
        std::fs::write(&self.config, text).unwrap();
    }

    /// Starts a second instance with its own state directory and `extra`
    /// appended to its config; waits until it listens.
    pub fn start_other(&self, name: &str, extra: &str) -> (App, tempfile::TempDir) {
        let state = temp_dir();
        let text = std::fs::read_to_string(&self.config).unwrap().replace(
            &format!("state_dir = \"{}\"", self.state.path().display()),
            &format!("state_dir = \"{}\"", state.path().display()),
        );
        let config = state.path().join("sluice.toml");
        std::fs::write(&config, format!("{text}\n{extra}\n")).unwrap();
        (self.start_with(name, &config, &[], false), state)
    }

    /// Starts an instance that aborts at `failpoint` (`<point>:<n>`, see
    /// the engine's commit), publishes `tasks`, and waits until it aborted.
    pub fn crash_at(&self, name: &str, failpoint: &str, tasks: &[Task]) {
        let mut app = self.start_env(name, &[("SLUICE_FAILPOINT", failpoint)]);
        self.produce(tasks);
        let status = eventually(
            Duration::from_secs(120),
            "the failpoint aborts the process",
            || app.proc.child.try_wait().unwrap(),
        );
        assert!(!status.success());
    }

    pub fn start_with(
        &self,
        name: &str,
        config: &std::path::Path,
        env: &[(&str, &str)],
        wait_ready: bool,
    ) -> App {
        self.start_logged(name, config, env, wait_ready, false)
    }

    /// As [`Pipeline::start_with`], keeping the instance's log lines when
    /// `keep_log` (see [`Proc::log`]).
    pub fn start_logged(
        &self,
        name: &str,
        config: &std::path::Path,
        env: &[(&str, &str)],
        wait_ready: bool,
        keep_log: bool,
    ) -> App {
        let args = [
            "run".into(),
            "--config".into(),
            config.display().to_string(),
        ];
        let proc = Proc::spawn_logged(name, &args, env, keep_log);
        let line = proc
            .wait_line(Duration::from_secs(60), |l| l.starts_with("LISTENING "))
            .expect("sluice run listens");
        let addr: SocketAddr = line["LISTENING ".len()..].trim().parse().unwrap();
        let app = App { proc, addr };
        if wait_ready {
            eventually(Duration::from_secs(90), "ready", || {
                (self.http(&app, "/readyz").0 == 200).then_some(())
            });
        }
        app
    }

    /// GETs `path` of `app` with the admin token.
    pub fn http(&self, app: &App, path: &str) -> (u16, String) {
        self.http_as(app, path, Some(ADMIN_TOKEN))
    }

    /// GETs `path` of `app` with `token` (none: no `Authorization`).
    pub fn http_as(&self, app: &App, path: &str, token: Option<&str>) -> (u16, String) {
        let url = format!("http://{}{path}", app.addr);
        self.rt.block_on(async {
            let mut request = reqwest::Client::new().get(&url);
            if let Some(t) = token {
                request = request.bearer_auth(t);
            }
            match request.send().await {
                Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
                Err(_) => (0, String::new()),
            }
        })
    }

    pub fn metric(&self, app: &App, name: &str) -> f64 {
        let (_, text) = self.http(app, "/metrics");
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    pub fn produce(&self, tasks: &[Task]) {
        let mut by_topic: BTreeMap<String, Vec<OutRecord>> = BTreeMap::new();
        for t in tasks {
            by_topic
                .entry(self.topic(&t.task_type))
                .or_default()
                .push(t.record());
        }
        for (topic, recs) in by_topic {
            produce(&self.cluster, &topic, recs).unwrap();
        }
    }

    /// Results (completed and failed) read committed until `n` distinct task
    /// ids have one, then a little longer to catch duplicates.
    pub fn results(&self, n: usize, timeout: Duration) -> Vec<(TaskResult, OwnedMessage)> {
        let topics = [self.completed(), self.failed()];
        let t: Vec<&str> = topics.iter().map(String::as_str).collect();
        let distinct = |m: &[OwnedMessage]| {
            m.iter()
                .filter_map(|m| m.key())
                .collect::<std::collections::HashSet<_>>()
                .len()
        };
        read_topics(&self.cluster, &t, true, timeout, |m| distinct(m) >= n).unwrap();
        std::thread::sleep(Duration::from_secs(2));
        read_topics(&self.cluster, &t, true, Duration::from_secs(5), |_| false)
            .unwrap()
            .into_iter()
            .map(|m| {
                (
                    serde_json::from_slice::<TaskResult>(m.payload().unwrap()).unwrap(),
                    m,
                )
            })
            .collect()
    }

    /// Every result, once at least `n` were read (or `timeout` passed);
    /// unlike [`Pipeline::results`], results of one task count each.
    pub fn results_at_least(&self, n: usize, timeout: Duration) -> Vec<(TaskResult, OwnedMessage)> {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.results(1, Duration::from_secs(5));
            if r.len() >= n || Instant::now() > deadline {
                return r;
            }
        }
    }

    pub fn dead_letters(&self, task_type: &str) -> Vec<OwnedMessage> {
        read_topics(
            &self.cluster,
            &[&self.dlq(task_type)],
            true,
            Duration::from_secs(3),
            |_| false,
        )
        .unwrap()
    }
}

pub struct App {
    pub proc: Proc,
    pub addr: SocketAddr,
}

#[derive(Clone)]
pub struct Task {
    pub id: String,
    pub task_type: String,
    pub tenant: String,
    pub priority: &'static str,
    pub content: String,
    /// `payload.complexity`, when the caller gives one.
    pub complexity: Option<f64>,
    /// The task's own W3C trace context.
    pub traceparent: String,
    /// Its Kafka key, when the producer keys it by something else than its
    /// tenant.
    pub key: Option<String>,
}

impl Task {
    pub fn new(i: usize, task_type: &str, tenant: &str, priority: &'static str) -> Task {
        Task {
            id: format!("task-{i}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
            task_type: task_type.into(),
            tenant: tenant.into(),
            priority,
            content: format!("Document {i} about {task_type} for {tenant}: the quick brown fox jumps over the lazy dog."),
            complexity: None,
            traceparent: format!("00-{}-00f067aa0ba902b7-01", uuid::Uuid::new_v4().simple()),
            key: None,
        }
    }

    pub fn json(&self) -> serde_json::Value {
        let mut payload = serde_json::json!({ "content": self.content });
        match self.task_type.as_str() {
            "summarize" => payload["maxWords"] = 8.into(),
            "classify" => payload["labels"] = serde_json::json!(["news", "sports", "tech"]),
            "extract" => {
                payload["schema"] = serde_json::json!({"type": "object", "properties": {"topic": {"type": "string"}}})
            }
            _ => {}
        }
        if let Some(c) = self.complexity {
            payload["complexity"] = c.into();
        }
        serde_json::json!({
            "taskId": self.id,
            "taskType": self.task_type,
            "tenantId": self.tenant,
            "requesterId": "svc",
            "priority": self.priority,
            // Both wire forms: RFC 3339, and epoch milliseconds as Java
            // producers write it.
            "submittedAt": if self.id.as_bytes()[self.id.len() - 1] % 2 == 0 {
                serde_json::json!(chrono::Utc::now().to_rfc3339())
            } else {
                serde_json::json!(chrono::Utc::now().timestamp_millis())
            },
            "attemptNumber": 1,
            "payload": payload,
            "metadata": { "correlationId": format!("corr-{}", self.id) },
        })
    }

    pub fn record(&self) -> OutRecord {
        OutRecord {
            key: Some(
                self.key
                    .as_ref()
                    .unwrap_or(&self.tenant)
                    .clone()
                    .into_bytes(),
            ),
            value: Some(serde_json::to_vec(&self.json()).unwrap()),
            headers: vec![("traceparent".into(), self.traceparent.clone().into_bytes())],
            ..Default::default()
        }
    }
}

pub fn mixed_tasks(n: usize) -> Vec<Task> {
    let types = ["summarize", "classify", "extract"];
    let tenants = ["acme", "globex", "initech", "umbrella"];
    (0..n)
        .map(|i| {
            Task::new(
                i,
                types[i % 3],
                tenants[(i / 3) % 4],
                ["high", "normal", "batch"][i % 3],
            )
        })
        .collect()
}

pub fn header(m: &OwnedMessage, name: &str) -> Option<String> {
    m.headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value.map(|v| String::from_utf8_lossy(v).into_owned()))
}

pub fn count_by_task(results: &[(TaskResult, OwnedMessage)]) -> HashMap<String, usize> {
    let mut n = HashMap::new();
    for (r, _) in results {
        *n.entry(r.task_id.clone()).or_insert(0) += 1;
    }
    n
}

/// No task is lost and none has two results; each result carries its task's
/// metadata.
pub fn assert_each_answered_once(tasks: &[Task], results: &[(TaskResult, OwnedMessage)]) {
    for (r, _) in results {
        assert_eq!(
            r.metadata.get("correlationId"),
            Some(&format!("corr-{}", r.task_id)),
            "result of {} carries its task's metadata",
            r.task_id
        );
    }
    let counts = count_by_task(results);
    let missing = tasks.iter().filter(|t| !counts.contains_key(&t.id)).count();
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert_eq!(missing, 0, "no task lost");
    assert!(
        twice.is_empty(),
        "{} tasks answered twice: {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
}

/// Tasks of one type whose prompts can share a batch (same labels).
pub fn classify_tasks(n: usize) -> Vec<Task> {
    (0..n)
        .map(|i| Task::new(i, "classify", ["acme", "globex"][i % 2], "normal"))
        .collect()
}

/// Every token the provider billed is in exactly one result.
pub fn assert_results_bill_what_the_provider_billed(
    p: &Pipeline,
    results: &[(TaskResult, OwnedMessage)],
) {
    let stats = p.sim.stats();
    let sum = |f: fn(&TaskResult) -> u64| results.iter().map(|(r, _)| f(r)).sum::<u64>();
    assert_eq!(sum(|r| r.input_tokens), stats.prompt_tokens, "input tokens");
    assert_eq!(
        sum(|r| r.output_tokens),
        stats.completion_tokens,
        "output tokens"
    );
    assert_eq!(
        sum(|r| r.cached_tokens),
        stats.cached_tokens,
        "cached tokens"
    );
}

/// The label the simulator gives a classify task alone.
pub fn expected_label(task_id: &str, tasks: &[Task]) -> String {
    let t = tasks.iter().find(|t| t.id == task_id).unwrap();
    let labels = ["news", "sports", "tech"];
    let i = sluice::sim::fnv1a64(t.content.trim().as_bytes()) % labels.len() as u64;
    labels[i as usize].to_string()
}

/// Every result a success and no dead letter of `task_type`: nothing the
/// run met was permanent.
pub fn assert_none_failed_or_dead_lettered(
    p: &Pipeline,
    results: &[(TaskResult, OwnedMessage)],
    task_type: &str,
) {
    let failed: Vec<_> = results
        .iter()
        .filter(|(r, _)| !r.success)
        .map(|(r, _)| (r.task_id.clone(), r.error_code.clone(), r.attempts))
        .collect();
    assert!(failed.is_empty(), "tasks failed: {failed:?}");
    assert!(
        p.dead_letters(task_type).is_empty(),
        "nothing dead-lettered"
    );
}

/// Publishes tasks to a task topic on a thread of its own, a batch every
/// interval, until stopped.
pub struct Publisher {
    running: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Task>>,
}

impl Publisher {
    /// Publishes `batch(n)` to `p`'s topic of `task_type` every `every`,
    /// `n` counting the tasks published before (for fresh ids).
    pub fn start(
        p: &Pipeline,
        task_type: &str,
        every: Duration,
        batch: impl Fn(usize) -> Vec<Task> + Send + 'static,
    ) -> Publisher {
        let running = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (cluster, topic, go_on) = (p.cluster.clone(), p.topic(task_type), running.clone());
        let thread = std::thread::spawn(move || {
            let mut published = Vec::new();
            while go_on.load(std::sync::atomic::Ordering::Relaxed) {
                let tasks = batch(published.len());
                let records: Vec<OutRecord> = tasks.iter().map(Task::record).collect();
                produce(&cluster, &topic, records).unwrap();
                published.extend(tasks);
                std::thread::sleep(every);
            }
            published
        });
        Publisher { running, thread }
    }

    /// Stops publishing: every task published.
    pub fn stop(self) -> Vec<Task> {
        self.running
            .store(false, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("the publisher ran")
    }
}
