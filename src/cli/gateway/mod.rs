//! `sluice gateway`: the HTTP front of the task topics.
//!
//! A caller submits a task (`POST /v1/tasks`) and gets `202 Accepted` with
//! its id as soon as the broker acknowledged the task record; it reads the
//! task's status (`GET /v1/tasks/{id}`, optionally long-polling), or waits
//! for its result over server-sent events (`GET /v1/tasks/{id}/events`).
//!
//! The gateway is a process of its own (not a part of `sluice run`): it
//! scales with callers, the pipeline with LLM throughput, and a gateway's
//! restart never moves a pipeline partition (whose calls may run for a
//! minute). It reads the same configuration file (topics, tenant rules,
//! tokens) and runs a stream application of its own, `<app id>-gateway`,
//! whose topology ([`status`]) materialises every task's status from the
//! task and results topics. Any gateway instance answers for any task: a
//! read is served where the task's tenant is held, forwarded there
//! otherwise (as usage queries are), never more than once.
//!
//! A submission is published by an idempotent producer, keyed by tenant, to
//! the partition the configured partitioner gives the tenant, so the
//! pipeline takes it where it belongs and its result lands in the same
//! partition number, where this gateway's status table finds both.

mod api;
pub mod config;
pub mod metrics;
pub mod status;
pub mod submit;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use parking_lot::Mutex;
use prometheus::Registry;
use rdkafka::producer::{FutureProducer, FutureRecord};
use sluice_topology::runtime::{AppStatus, EngineMetrics, KeyPartitioner, Queries, StreamsApp};

use crate::cli::run::RunError;
use crate::config::{Config, ConfigError};
use crate::envelope::{EnvelopeLimits, TenantRules};
use crate::http::auth::ApiTokens;
use crate::http::forward::{self, Forwarder, Holder};
use metrics::GatewayMetrics;
use status::{
    StatusKey, StatusSettings, StatusView, StoredStatus, Watchers, BACKLOG_STORE, QUOTA_STORE,
    STATUS_STORE,
};
use submit::{Submission, SubmitRules};

/// How long a read of an unknown task waits for it to appear: a status read
/// right after the 202 may reach the holder before its status table read
/// the task record (usually within a millisecond; under load, a commit or
/// two later).
const UNKNOWN_GRACE: Duration = Duration::from_secs(2);
/// How long a tenant's backlog, once read, serves admission decisions.
const BACKLOG_FRESH: Duration = Duration::from_millis(250);
/// How long the broker may take to acknowledge a task.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
/// Marks a forwarded status read that must not wait for an unknown task
/// (an idempotency check before publishing).
pub const NO_GRACE_HEADER: &str = "x-sluice-no-grace";
/// Added to a forwarded long poll's wait for its own timeout.
const FORWARD_MARGIN: Duration = Duration::from_secs(10);

/// Why a request is refused.
#[derive(Debug, Clone)]
pub struct Refusal {
    /// The status code.
    pub status: StatusCode,
    /// For the caller.
    pub reason: String,
    /// The field at fault (400).
    pub field: Option<String>,
    /// `Retry-After`, seconds (429, 503).
    pub retry_after: Option<u64>,
}

impl Refusal {
    /// A refusal without field or retry hint.
    pub fn new(status: StatusCode, reason: impl Into<String>) -> Refusal {
        Refusal {
            status,
            reason: reason.into(),
            field: None,
            retry_after: None,
        }
    }

    /// 503 with `Retry-After: 1`.
    pub fn unavailable(reason: impl Into<String>) -> Refusal {
        Refusal {
            retry_after: Some(1),
            ..Refusal::new(StatusCode::SERVICE_UNAVAILABLE, reason)
        }
    }
}

/// One gateway instance's shared state.
pub struct Gateway {
    config: config::GatewaySection,
    tokens: ApiTokens,
    rules: SubmitRules,
    queries: Queries,
    watchers: Arc<Watchers>,
    producer: FutureProducer,
    /// Task topic and partition count by task type.
    topics: HashMap<String, (String, i32)>,
    partitioner: KeyPartitioner,
    metrics: GatewayMetrics,
    forwarder: Forwarder,
    served_by: String,
    status: Arc<AppStatus>,
    registry: Registry,
    /// Whether any tenant has a hard quota.
    quotas_hard: bool,
    /// What admission last read per tenant, and when.
    standings: Mutex<HashMap<String, (TenantStanding, Instant)>>,
}

/// Where a tenant stands, as admission reads it: its backlog and its
/// hard-quota window.
#[derive(Clone, Copy, Debug, Default)]
pub struct TenantStanding {
    /// Tasks accepted and not answered.
    pub pending: u64,
    /// Until when its hard quota's window counts as used up, ms.
    pub quota_until_ms: Option<i64>,
}

impl Gateway {
    /// Where `tenant`'s entries in `store` are held; `forwarded` requests
    /// are never forwarded again.
    fn holder(&self, store: &str, tenant: &str, forwarded: bool) -> Result<Holder, Refusal> {
        forward::holder(&self.queries, store, tenant.as_bytes(), forwarded)
            .map_err(|e| Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
    }

    /// The status of `key` held here: the latest written (perhaps not
    /// committed yet), else the committed one.
    fn local_status(
        &self,
        partition: i32,
        key: &StatusKey,
    ) -> Result<Option<StoredStatus>, Refusal> {
        if let Some(s) = self.watchers.recent(key) {
            return Ok(Some(s));
        }
        self.queries
            .get::<StatusKey, StoredStatus>(STATUS_STORE, partition, key)
            .map_err(|e| {
                if e.unavailable() {
                    Refusal::unavailable(e.to_string())
                } else {
                    Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
                }
            })
    }

    /// A task's status, waiting up to `wait` while it is pending, and up
    /// to `grace` while it is unknown (a read right after its 202); `None`
    /// for a task unknown for `tenant`.
    pub async fn status_of(
        &self,
        tenant: &str,
        task_id: &str,
        wait: Duration,
        grace: Duration,
        headers: &HeaderMap,
    ) -> Result<Option<StatusView>, Refusal> {
        // No submission has such an id (`.`, `..`, line breaks and tabs are
        // refused), and it could not be asked of another instance: unknown
        // on every instance alike.
        if !forward::is_segment(task_id) {
            return Ok(None);
        }
        let partition = match self.holder(STATUS_STORE, tenant, forward::is_forwarded(headers))? {
            Holder::Local(p) => p,
            Holder::Remote(host) => {
                return self
                    .forward_status(&host, tenant, task_id, wait, grace, headers)
                    .await
            }
            Holder::Unavailable(reason) => return Err(Refusal::unavailable(reason)),
        };
        let key: StatusKey = (tenant.to_string(), task_id.to_string());
        let deadline = Instant::now() + wait;
        let grace = Instant::now() + grace;
        loop {
            let waiter = self.watchers.subscribe(&key);
            let rx = match waiter {
                Ok(done) => return Ok(Some(StatusView::of(tenant, task_id, &done))),
                Err(rx) => rx,
            };
            let current = self.local_status(partition, &key)?;
            let until = match &current {
                Some(s) if s.phase.is_final() => {
                    return Ok(Some(StatusView::of(tenant, task_id, s)))
                }
                Some(_) => deadline,
                None => deadline.max(grace),
            };
            let now = Instant::now();
            if now >= until {
                return Ok(current.map(|s| StatusView::of(tenant, task_id, &s)));
            }
            match tokio::time::timeout(until - now, rx).await {
                Ok(Ok(s)) if s.phase.is_final() => {
                    return Ok(Some(StatusView::of(tenant, task_id, &s)))
                }
                // Pending now, or the waiter was dropped: look again.
                Ok(_) => {}
                Err(_) => {
                    let last = self.local_status(partition, &key)?;
                    return Ok(last.map(|s| StatusView::of(tenant, task_id, &s)));
                }
            }
        }
    }

    /// Sends a request to the instance at `host` (marked forwarded, with
    /// the caller's token): its answer, or 503 naming why there was none.
    async fn ask(
        &self,
        host: &str,
        method: reqwest::Method,
        url: Result<reqwest::Url, String>,
        headers: &HeaderMap,
        timeout: Duration,
        build: impl FnOnce(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, Refusal> {
        let url = url.map_err(|e| Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, e))?;
        let req = build(self.forwarder.request(method, url, headers, timeout));
        self.forwarder
            .send(host, req)
            .await
            .map_err(Refusal::unavailable)
    }

    async fn forward_status(
        &self,
        host: &str,
        tenant: &str,
        task_id: &str,
        wait: Duration,
        grace: Duration,
        headers: &HeaderMap,
    ) -> Result<Option<StatusView>, Refusal> {
        let wait_ms = format!("{}ms", wait.as_millis());
        let url = forward::url(
            host,
            &["v1", "tasks", task_id],
            &[("tenant", tenant), ("wait", &wait_ms)],
        );
        let resp = self
            .ask(
                host,
                reqwest::Method::GET,
                url,
                headers,
                wait + FORWARD_MARGIN,
                |req| {
                    if grace.is_zero() {
                        req.header(NO_GRACE_HEADER, "1")
                    } else {
                        req
                    }
                },
            )
            .await?;
        match resp.status().as_u16() {
            200 => resp
                .json::<StatusView>()
                .await
                .map(Some)
                .map_err(|e| Refusal::unavailable(format!("forwarded answer of {host}: {e}"))),
            404 => Ok(None),
            code => {
                let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_GATEWAY);
                let reason = forward::reason_of(host, resp).await;
                Err(Refusal {
                    retry_after: (code == 503).then_some(1),
                    ..Refusal::new(status, reason)
                })
            }
        }
    }

    /// What admission knows of `tenant`, read where the tenant is held.
    pub async fn admission_of(
        &self,
        tenant: &str,
        headers: &HeaderMap,
    ) -> Result<TenantStanding, Refusal> {
        match self.holder(BACKLOG_STORE, tenant, forward::is_forwarded(headers))? {
            Holder::Local(p) => {
                let read = |store: &str| {
                    self.queries
                        .get::<String, i64>(store, p, &tenant.to_string())
                        .map_err(|e| Refusal::unavailable(e.to_string()))
                };
                Ok(TenantStanding {
                    pending: read(BACKLOG_STORE)?.unwrap_or(0).max(0) as u64,
                    quota_until_ms: read(QUOTA_STORE)?,
                })
            }
            Holder::Remote(host) => {
                let url = forward::url(&host, &["v1", "tenants", tenant, "backlog"], &[]);
                let resp = self
                    .ask(
                        &host,
                        reqwest::Method::GET,
                        url,
                        headers,
                        FORWARD_MARGIN,
                        |r| r,
                    )
                    .await?;
                if !resp.status().is_success() {
                    return Err(Refusal::unavailable(forward::reason_of(&host, resp).await));
                }
                let body: api::BacklogBody = resp.json().await.map_err(|e| {
                    Refusal::unavailable(format!("forwarded answer of {host}: {e}"))
                })?;
                Ok(TenantStanding {
                    pending: body.pending,
                    quota_until_ms: body
                        .quota_exhausted_until
                        .and_then(|t| chrono::DateTime::parse_from_rfc3339(&t).ok())
                        .map(|t| t.timestamp_millis()),
                })
            }
            Holder::Unavailable(reason) => Err(Refusal::unavailable(reason)),
        }
    }

    /// Whether `tenant` may submit `n` more tasks: its hard quota's window is
    /// not used up (the pipeline refused none of its tasks in it), and its
    /// backlog (read at most [`BACKLOG_FRESH`] ago, plus what this instance
    /// accepted since) stays under the bound. When neither can be read (a
    /// rebalance), the tasks are admitted: the pipeline still enforces the
    /// quota, and the bound is a brake, not an account.
    async fn admit(&self, tenant: &str, n: u64, headers: &HeaderMap) -> Result<(), Refusal> {
        let bound = self.config.max_backlog_per_tenant;
        if bound == 0 && !self.quotas_hard {
            return Ok(());
        }
        let cached = self
            .standings
            .lock()
            .get(tenant)
            .filter(|(_, at)| at.elapsed() < BACKLOG_FRESH)
            .map(|(a, _)| *a);
        let known = match cached {
            Some(a) => a,
            None => match self.admission_of(tenant, headers).await {
                Ok(a) => {
                    self.standings
                        .lock()
                        .insert(tenant.to_string(), (a, Instant::now()));
                    a
                }
                Err(e) => {
                    tracing::debug!(tenant, reason = %e.reason, "admission unknown: admitted");
                    return Ok(());
                }
            },
        };
        let now = chrono::Utc::now().timestamp_millis();
        if let Some(until) = known.quota_until_ms.filter(|until| *until > now) {
            self.metrics.rejected("quota", n);
            let seconds = (until - now + 999) / 1000;
            return Err(Refusal {
                retry_after: Some(seconds.max(1) as u64),
                ..Refusal::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "the tenant's hard quota for this window is used up (a task was refused \
                     quota_exceeded); it resets when the window ends",
                )
            });
        }
        if bound > 0 && known.pending + n > bound {
            self.metrics.rejected("backlog", n);
            return Err(Refusal {
                retry_after: Some(1),
                ..Refusal::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "the tenant has {} tasks pending, at its bound of {bound} \
                         ([gateway] max_backlog_per_tenant)",
                        known.pending
                    ),
                )
            });
        }
        Ok(())
    }

    /// Counts `n` tasks accepted into the cached backlog of `tenant`.
    fn accepted(&self, tenant: &str, n: u64) {
        if let Some((a, _)) = self.standings.lock().get_mut(tenant) {
            a.pending += n;
        }
        self.metrics.accepted.inc_by(n);
    }

    /// Publishes checked submissions (all of one tenant) and waits for the
    /// broker's acknowledgements. A submission whose id is the caller's and
    /// that is known already is not published again. Returns, in order,
    /// whether each was a replay.
    async fn publish(
        &self,
        subs: &[Submission],
        headers: &HeaderMap,
    ) -> Result<Vec<bool>, Refusal> {
        let mut replayed = Vec::with_capacity(subs.len());
        for s in subs {
            let known = match &s.id {
                submit::IdSource::Caller(id) => self
                    .status_of(&s.tenant, id, Duration::ZERO, Duration::ZERO, headers)
                    .await?
                    .is_some(),
                submit::IdSource::Fresh(_) => false,
            };
            replayed.push(known);
        }
        let fresh = replayed.iter().filter(|r| !**r).count() as u64;
        if let Some(first) = subs.first() {
            self.admit(&first.tenant, fresh, headers).await?;
        }
        let sends = subs
            .iter()
            .zip(&replayed)
            .filter(|(_, r)| !**r)
            .map(|(s, _)| {
                let (topic, partitions) = &self.topics[&s.envelope.task_type];
                let partition = self.partitioner.partition(s.tenant.as_bytes(), *partitions);
                let record = FutureRecord::to(topic)
                    .key(s.tenant.as_bytes())
                    .payload(&s.bytes)
                    .partition(partition);
                self.producer.send(record, PUBLISH_TIMEOUT)
            });
        for delivery in futures::future::join_all(sends).await {
            if let Err((e, _)) = delivery {
                self.metrics.rejected("unavailable", 1);
                return Err(Refusal::unavailable(format!(
                    "the broker did not acknowledge the task: {e}"
                )));
            }
        }
        if let Some(first) = subs.first() {
            self.accepted(&first.tenant, fresh);
            let published: Vec<Expected> = subs
                .iter()
                .zip(&replayed)
                .filter(|(_, r)| !**r)
                .map(|(s, _)| Expected {
                    task_id: s.id.id().to_string(),
                    task_type: s.envelope.task_type.clone(),
                    accepted_ms: s.envelope.submitted_at.timestamp_millis(),
                })
                .collect();
            self.note_accepted(&first.tenant, &published, headers).await;
        }
        Ok(replayed)
    }

    /// Tells the holder of `tenant`'s statuses that these tasks were
    /// accepted, so a read right after the 202, or an idempotent retry on
    /// any instance, finds them pending before the holder read their
    /// records. Best effort: without it, reads wait [`UNKNOWN_GRACE`] for the
    /// records instead.
    async fn note_accepted(&self, tenant: &str, tasks: &[Expected], headers: &HeaderMap) {
        if tasks.is_empty() {
            return;
        }
        match self.holder(STATUS_STORE, tenant, false) {
            Ok(Holder::Local(_)) => self.expect(tenant, tasks),
            Ok(Holder::Remote(host)) => {
                let url = forward::url(&host, &["v1", "tasks:accepted"], &[("tenant", tenant)]);
                let body = ExpectedBody {
                    tasks: tasks.to_vec(),
                };
                let sent = self.ask(
                    &host,
                    reqwest::Method::POST,
                    url,
                    headers,
                    FORWARD_MARGIN,
                    |r| r.json(&body),
                );
                match sent.await {
                    Ok(r) if r.status().is_success() => {}
                    Ok(r) => {
                        tracing::debug!(%host, status = %r.status(), "accepted tasks not noted")
                    }
                    Err(e) => {
                        tracing::debug!(%host, reason = %e.reason, "accepted tasks not noted")
                    }
                }
            }
            Ok(Holder::Unavailable(reason)) => {
                tracing::debug!(%reason, "accepted tasks not noted")
            }
            Err(e) => tracing::debug!(reason = %e.reason, "accepted tasks not noted"),
        }
    }

    /// Expects accepted tasks of `tenant` here.
    fn expect(&self, tenant: &str, tasks: &[Expected]) {
        for t in tasks {
            let pending = StoredStatus {
                task_type: t.task_type.clone(),
                phase: status::Phase::Pending,
                accepted_ms: Some(t.accepted_ms),
                result: None,
                updated_ms: t.accepted_ms,
            };
            self.watchers
                .expect(&(tenant.to_string(), t.task_id.clone()), pending);
        }
    }
}

/// A task accepted, as one instance tells the holder of its tenant.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Expected {
    /// The task.
    pub task_id: String,
    /// Its type.
    pub task_type: String,
    /// When it was accepted, ms.
    pub accepted_ms: i64,
}

/// The body of the internal `POST /v1/tasks:accepted`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ExpectedBody {
    /// The tasks.
    pub tasks: Vec<Expected>,
}

/// Loads the config and runs the gateway until SIGTERM/SIGINT.
pub async fn run(config_path: &Path) -> Result<(), RunError> {
    let config = Config::load(config_path)?;
    run_until(config, crate::cli::run::signals()).await
}

/// The task topics' partition counts, which must equal the results
/// topics': the gateway finds a tenant's tasks and results in one partition
/// number.
fn partitions(config: &Config) -> Result<HashMap<String, (String, i32)>, RunError> {
    let t = &config.topics;
    let mut names: Vec<String> = t.task_types.iter().map(|x| t.task_topic(x)).collect();
    names.push(t.results_completed.clone());
    names.push(t.results_failed.clone());
    let counts = crate::kafka::partition_counts(config.kafka.cluster(), &names)?;
    let mut out = HashMap::new();
    let mut seen: Vec<(String, i32)> = Vec::new();
    for name in &names {
        let Some(n) = counts.get(name) else {
            return Err(ConfigError::new(
                "topics",
                format!("topic {name} does not exist (run `sluice topics create`)"),
            )
            .into());
        };
        seen.push((name.clone(), *n));
    }
    if seen.iter().any(|(_, n)| *n != seen[0].1) {
        return Err(ConfigError::new(
            "topics.partitions",
            format!(
                "the gateway needs task and results topics of one partition count (a tenant's \
                 tasks and results meet in one partition number), found {seen:?}"
            ),
        )
        .into());
    }
    for ty in &t.task_types {
        let topic = t.task_topic(ty);
        let n = counts[&topic];
        out.insert(ty.clone(), (topic, n));
    }
    Ok(out)
}

/// Runs the gateway of a loaded config until `shutdown` resolves.
pub async fn run_until(
    config: Config,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), RunError> {
    let registry = Registry::new();
    let tokens = config.http.tokens()?;
    if tokens.is_empty() {
        tracing::warn!("no tokens ([http] tokens_file): the gateway refuses every task (401)");
    }
    let engine_metrics = EngineMetrics::register(&registry)?;
    let metrics = GatewayMetrics::register(&registry)?;
    let topics = partitions(&config)?;
    let t = &config.topics;
    let tenants =
        TenantRules::new(&config.tasks.tenant_pattern, &config.tasks.tenants).unwrap_or_default();
    let limits = EnvelopeLimits {
        max_bytes: config.tasks.max_bytes,
        tenants: tenants.clone(),
        ..EnvelopeLimits::default()
    };
    let settings = StatusSettings {
        task_topics: t.task_types.iter().map(|x| t.task_topic(x)).collect(),
        task_types: t.task_types.clone(),
        limits,
        result_topics: vec![t.results_completed.clone(), t.results_failed.clone()],
        ttl: Duration::from_secs(config.gateway.status_ttl_hours * 3600),
        windows: config.accounting.windows.clone(),
        quotas: if config.accounting.enabled {
            config.accounting.quotas.clone()
        } else {
            Default::default()
        },
    };
    let watchers = Arc::new(Watchers::default());
    let topology = status::topology(&settings, watchers.clone(), metrics.clone())?;
    let gw = &config.gateway;
    let addr: std::net::SocketAddr = gw
        .listen
        .parse()
        .map_err(|_| ConfigError::new("gateway.listen", "not an address"))?;
    let listener = crate::http::bind(addr).await?;
    let bound = listener.local_addr()?;
    let mut streams = config.streams();
    streams.application_id = format!("{}-gateway", config.app.id);
    streams
        .consumer_overrides
        .extend(status_fetch(gw.fetch_wait_ms));
    streams.state_dir = gw
        .state_dir
        .clone()
        .unwrap_or_else(|| config.app.state_dir.join("gateway"));
    // Static membership is the pipeline's (its pods'); a gateway instance
    // joins its own group without one.
    streams.group_instance_id = None;
    streams.application_server = gw.advertised(bound);
    streams.instance_claim_key = config.http.claims_key()?;
    let served_by = streams
        .application_server
        .clone()
        .unwrap_or_else(|| format!("http://{bound}"));
    let producer: FutureProducer = crate::kafka::base(config.kafka.cluster())
        .set("enable.idempotence", "true")
        // An idempotent producer may keep 5 requests in flight per
        // partition, but librdkafka 2.12 counts the messages in flight
        // against that limit: a partition with a batch of 5 or more out
        // sends nothing until it returns, and once a waiting batch's linger
        // has run out, the broker thread polls without sleeping meanwhile.
        // The longer the linger, the less of that wait is spun (at 1 ms that
        // thread spun for a fifth of the gateway's CPU under load), and the
        // longer the 202 waits (5 ms: 40 % fewer accepted POSTs from 64
        // connections).
        .set("linger.ms", "2")
        .create()
        .map_err(crate::kafka::KafkaError::from)?;
    let app = StreamsApp::new(topology, streams, engine_metrics)
        .with_runtime(tokio::runtime::Handle::current())
        .start()
        .map_err(RunError::Start)?;
    let gateway = Arc::new(Gateway {
        config: gw.clone(),
        tokens,
        rules: SubmitRules {
            task_types: t.task_types.clone(),
            tenants,
            max_task_bytes: config.tasks.max_bytes,
        },
        queries: app.queries(),
        watchers,
        producer,
        topics,
        partitioner: config.tasks.partitioner,
        metrics,
        forwarder: Forwarder::default(),
        served_by,
        status: app.status(),
        registry,
        quotas_hard: {
            let q = &config.accounting.quotas;
            let hard =
                |q: &crate::steps::account::Quota| q.mode == crate::steps::account::QuotaMode::Hard;
            config.accounting.enabled
                && (q.default.iter().any(hard) || q.tenants.values().any(hard))
        },
        standings: Mutex::default(),
    });
    let http = tokio::spawn({
        let router = api::router(gateway.clone());
        async move {
            if let Err(e) = axum::serve(listener, router).await {
                tracing::error!(error = %e, "gateway listener stopped");
            }
        }
    });
    tracing::info!(%bound, "gateway listening");
    println!("LISTENING {bound}");
    let result = crate::cli::run::wait(&app, shutdown).await;
    app.shutdown();
    let joined = tokio::task::spawn_blocking(move || app.join()).await?;
    http.abort();
    result?;
    joined?;
    println!("STOPPED");
    Ok(())
}

/// The status table consumer's fetch settings for `[gateway]
/// fetch_wait_ms`: the table reads back every task the gateways accept, and
/// a fetch answered as soon as any record is there brings a few records
/// each; waiting for 64 KiB (or the time) cut the broker's CPU per
/// accepted task by a fifth to a third (docs/benchmarks.md). 0: the
/// engine's own fetch settings (a fetch answered as soon as a record is
/// there).
fn status_fetch(wait_ms: u64) -> Vec<(String, String)> {
    if wait_ms == 0 {
        return Vec::new();
    }
    vec![
        ("fetch.min.bytes".into(), (64 * 1024).to_string()),
        ("fetch.wait.max.ms".into(), wait_ms.to_string()),
    ]
}

/// `Retry-After` as a header value.
fn retry_after(seconds: u64) -> HeaderValue {
    HeaderValue::from_str(&seconds.to_string()).unwrap_or(HeaderValue::from_static("1"))
}
