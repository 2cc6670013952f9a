//! The LLM task operator: consumes task envelopes, calls the provider through
//! the client middleware, and emits exactly one result per task.
//!
//! Per record: validate (poison → dead letter at once); look the task id up in
//! the idempotency store (a redelivered, completed task re-emits its stored
//! result without a call; the same input replayed after a crash emits nothing);
//! choose the model (payload, task type, fallback while a breaker is open);
//! call asynchronously. On completion: success → completed result; permanent
//! failure → dead letter and failed result; transient failure past the
//! in-call retries → re-published with `attemptNumber + 1`, or dead-lettered as
//! `exhausted` on the last attempt; configuration fault (401/403/unknown model)
//! → the task is held in flight, intake stops, readiness fails, and one held
//! task probes the provider until it answers again.
//!
//! Exactly-once on any broker: results go to the partition of the results
//! topics that matches the task's input partition, carrying the input position
//! in headers, so a task that takes over a partition can read the results its
//! previous owner left in an interrupted transaction (see [`recover`]) and
//! never answer the same input twice.

pub mod health;
pub mod metrics;
mod recover;

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::Utc;
use serde::{Deserialize, Serialize};
use sluice_topology::{
    BytesCodec, Headers, InFlight, OutputRecord, Position, ProcessError, Processor,
    ProcessorContext, Punctuation, Record, SourceOptions, StreamBuilder, Topology, TopologyError,
};

use crate::config::{Config, Price};
use crate::envelope::{decode_task, DlqCategory, EnvelopeLimits, Route, TaskEnvelope, TaskResult};
use crate::llm::{CallFailure, CallOutcome, ChatRequest, ErrorClass, LlmClient, PromptBuilder};
use crate::route::Router;
pub use health::Health;
pub use metrics::OperatorMetrics;

/// Store of completed task ids → stored result (changelogged).
pub const COMPLETED_STORE: &str = "completed";
/// Operator bookkeeping (results topic ends, sweep progress).
pub const META_STORE: &str = "operator-meta";

/// Result header: id of the source topic of the task's input.
pub const HEADER_SOURCE: &str = "sluice.source";
/// Result header: offset of the task's input record.
pub const HEADER_OFFSET: &str = "sluice.offset";
/// W3C trace context headers carried from task to result.
pub const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

const MINUTE_MS: i64 = 60_000;

/// The idempotency key of a task: its type and its id, since two task types
/// may reuse an id. (Task types are topic-name suffixes, which cannot hold
/// `/`.) A task sent again must be sent with the same Kafka key, so it reaches
/// the partition — and the store — that answered it.
pub(crate) fn idempotency_key(task_type: &str, task_id: &str) -> String {
    format!("{task_type}/{task_id}")
}

/// The minute an idempotency entry written now expires in.
pub(crate) fn expiry_bucket(config: &Config) -> i64 {
    now_ms() / MINUTE_MS + config.tasks.idempotency_ttl_hours as i64 * 60
}

/// Everything the operator instances of one application share.
pub struct Operator {
    /// The provider client (limiters and breakers are shared by all tasks).
    pub client: LlmClient,
    /// Prompt templates.
    pub prompts: PromptBuilder,
    /// Routing rules: tiers, pinned task types, fallback chains.
    pub router: Router,
    /// Prices per model.
    pub prices: BTreeMap<String, Price>,
    /// The configuration (routing, topics, tasks).
    pub config: Config,
    /// Faults and intake holds.
    pub health: Health,
    /// Metrics.
    pub metrics: OperatorMetrics,
}

/// A result as kept in the idempotency store.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StoredOutcome {
    /// The result, as JSON (as emitted).
    #[serde(with = "byte_string")]
    pub result_json: Vec<u8>,
    /// Whether it went to the completed topic.
    pub success: bool,
    /// When the entry expires: minutes since the epoch.
    pub bucket: i64,
}

/// A `Vec<u8>` field as one byte string (a copy) instead of a sequence of
/// bytes (a call per byte); bincode writes both the same way.
mod byte_string {
    use serde::{de, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct Bytes;
        impl<'de> de::Visitor<'de> for Bytes {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(b) = seq.next_element()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        d.deserialize_byte_buf(Bytes)
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Meta {
    /// Next offset after this task's committed results, per results topic.
    results_end: BTreeMap<String, i64>,
}

const META_KEY: &str = "meta";

/// One task on its way through the provider.
struct Job {
    task: TaskEnvelope,
    tenant: String,
    headers: Headers,
    key: Option<Vec<u8>>,
    source_topic: String,
    received_ms: i64,
    model: String,
    route: Route,
    request: Option<ChatRequest>,
    /// Set on a call that probes a held provider.
    probe: bool,
}

/// What comes back from a call.
pub struct CallDone {
    job: Box<Job>,
    result: Result<CallOutcome, CallFailure>,
    held: InFlight,
}

/// Builds the operator topology: every task topic (with its dead-letter topic)
/// merged into one stream — they must be co-partitioned — and processed by the
/// LLM operator with its stores.
pub fn build_topology(op: Arc<Operator>) -> Result<Topology, TopologyError> {
    let cfg = &op.config;
    let b = StreamBuilder::new();
    b.add_kv_store(COMPLETED_STORE, true);
    b.add_kv_store(META_STORE, true);
    let mut streams = cfg.topics.task_types.iter().map(|t| {
        b.stream_with(
            &[&cfg.topics.task_topic(t)],
            BytesCodec,
            BytesCodec,
            SourceOptions {
                dead_letter_topic: Some(cfg.topics.dlq_topic(t)),
            },
        )
    });
    let first = streams
        .next()
        .ok_or_else(|| TopologyError::Invalid("no task types configured".into()))?;
    let merged = streams.fold(first, |acc, s| acc.merge(&s));
    let shared = op.clone();
    merged.process("llm", &[COMPLETED_STORE, META_STORE], move || {
        LlmTaskProcessor::new(shared.clone())
    });
    b.build()
}

type Ctx<'a> = ProcessorContext<'a, (), (), CallDone>;
type RawKey = Option<Vec<u8>>;

/// One instance per task (input partition).
pub struct LlmTaskProcessor {
    op: Arc<Operator>,
    /// Tasks with a call under way → redeliveries of them waiting for its result.
    in_flight: std::collections::HashMap<String, Vec<(InFlight, Headers)>>,
    parked: Vec<(Box<Job>, InFlight)>,
    probing: bool,
    last_probe_ms: i64,
    /// No probe before this time (a provider's `Retry-After`).
    probe_not_before_ms: i64,
    /// The task this processor runs in (known from `init`).
    task: Option<sluice_topology::TaskId>,
    meta: Meta,
    meta_dirty: bool,
    /// Token and cost series per model, resolved on first use.
    counters: std::collections::HashMap<String, metrics::ModelCounters>,
    /// Where the expiry sweep of the completed store goes on from.
    sweep_cursor: Option<Vec<u8>>,
    last_sweep_ms: i64,
}

fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

impl LlmTaskProcessor {
    fn new(op: Arc<Operator>) -> Self {
        LlmTaskProcessor {
            op,
            in_flight: Default::default(),
            parked: Vec::new(),
            probing: false,
            last_probe_ms: 0,
            probe_not_before_ms: 0,
            task: None,
            meta: Meta::default(),
            meta_dirty: false,
            counters: Default::default(),
            sweep_cursor: None,
            last_sweep_ms: 0,
        }
    }

    fn results_partition(&self, ctx: &Ctx<'_>) -> i32 {
        ctx.task_id().partition
    }

    /// The model a task goes to, and why.
    fn route(&self, task: &TaskEnvelope) -> (String, Route) {
        let client = &self.op.client;
        let d = self
            .op
            .router
            .route(task, |m| client.endpoint(m).is_some(), false);
        self.op
            .metrics
            .routes
            .with_label_values(&[&d.route.tier])
            .inc();
        (d.model, d.route)
    }

    /// Sends a result (completed or failed) and remembers it.
    fn emit_result(
        &mut self,
        ctx: &mut Ctx<'_>,
        job: &Job,
        result: &TaskResult,
    ) -> Result<(), ProcessError> {
        let json = serde_json::to_vec(result)
            .map_err(|e| ProcessError::Fatal(format!("result encoding: {e}")))?;
        let topics = &self.op.config.topics;
        let topic = if result.success {
            topics.results_completed.clone()
        } else {
            topics.results_failed.clone()
        };
        let partition = self.results_partition(ctx);
        let position = ctx.position();
        ctx.emit(result_record(
            topic.clone(),
            partition,
            &result.task_id,
            json.clone(),
            &job.headers,
            position,
        ));
        let bucket = expiry_bucket(&self.op.config);
        let key = idempotency_key(&result.task_type, &result.task_id);
        ctx.kv::<String, StoredOutcome>(COMPLETED_STORE)?.put(
            &key,
            &StoredOutcome {
                result_json: json,
                success: result.success,
                bucket,
            },
        );
        self.op.metrics.result(result.success).inc();
        // Redeliveries that arrived while the call was under way get the same
        // result, without a call of their own.
        for (waiter, headers) in self.in_flight.remove(&key).unwrap_or_default() {
            self.op.metrics.duplicates.inc();
            let (topic, json) = (topic.clone(), result_json_again(result)?);
            ctx.with_record(&waiter, |ctx| {
                let position = ctx.position();
                ctx.emit(result_record(
                    topic,
                    partition,
                    &result.task_id,
                    json,
                    &headers,
                    position,
                ));
            });
        }
        Ok(())
    }

    fn base_result(&self, job: &Job, success: bool) -> TaskResult {
        TaskResult {
            task_id: job.task.task_id.clone(),
            task_type: job.task.task_type.clone(),
            tenant_id: job.tenant.clone(),
            success,
            completed_at: Utc::now(),
            processing_ms: (now_ms() - job.received_ms).max(0) as u64,
            model: job.model.clone(),
            route: job.route.clone(),
            input_tokens: 0,
            output_tokens: 0,
            cached_tokens: 0,
            cost_micros: 0,
            attempts: job.task.attempt_number,
            batch_id: None,
            output: serde_json::Value::Null,
            error_code: None,
            error_message: None,
            metadata: job.task.metadata.clone(),
        }
    }

    fn fail(
        &mut self,
        ctx: &mut Ctx<'_>,
        job: &Job,
        category: DlqCategory,
        code: &str,
        message: &str,
        attempts: u32,
    ) -> Result<(), ProcessError> {
        ctx.dead_letter(code, category.as_str(), attempts)?;
        let mut r = self.base_result(job, false);
        r.attempts = attempts;
        r.error_code = Some(code.to_string());
        r.error_message = Some(message.to_string());
        self.emit_result(ctx, job, &r)
    }

    /// Starts (or restarts) the provider call of a job, routing around an open
    /// breaker when a fallback exists, else holding the job.
    fn start_call(&mut self, ctx: &mut Ctx<'_>, mut job: Box<Job>, held: InFlight) {
        if !job.probe && self.op.client.is_open(&job.model) {
            let client = &self.op.client;
            let fallback = self
                .op
                .router
                .fallback(&job.model, |m| client.is_open(m))
                .map(str::to_string);
            match fallback {
                Some(fallback) => {
                    self.op
                        .metrics
                        .fallbacks
                        .with_label_values(&[&job.model])
                        .inc();
                    job.route = Route {
                        tier: fallback.clone(),
                        reason: format!("fallback:{}:circuit_open", job.model),
                    };
                    job.model = fallback.clone();
                }
                _ => {
                    let fault = format!("breaker:{}", job.model);
                    self.hold(ctx, &fault, "circuit open and no fallback model", job, held);
                    return;
                }
            }
        }
        let Some(request) = job.request.clone() else {
            return;
        };
        let client = self.op.client.clone();
        let priority = job.task.priority;
        ctx.spawn_detached(async move {
            let result = client.call(&job.model, request, priority).await;
            CallDone { job, result, held }
        });
    }

    /// Raises `fault` for this task (holding intake) and parks the job
    /// until a probe finds the provider answering again.
    fn hold(&mut self, ctx: &Ctx<'_>, fault: &str, detail: &str, job: Box<Job>, held: InFlight) {
        self.op.health.raise(ctx.task_id(), fault, detail);
        self.park(job, held);
    }

    fn park(&mut self, job: Box<Job>, held: InFlight) {
        self.parked.push((job, held));
        self.op.metrics.parked.set(self.parked.len() as i64);
    }

    fn finish(&mut self, ctx: &mut Ctx<'_>, done: CallDone) -> Result<(), ProcessError> {
        let CallDone {
            mut job,
            result,
            held,
        } = done;
        let was_probe = std::mem::take(&mut job.probe);
        if was_probe {
            self.probing = false;
        }
        match result {
            Ok(outcome) => {
                if was_probe || !self.parked.is_empty() {
                    self.recovered(ctx, &job.model);
                }
                let usage = outcome.response.usage;
                let price = self.op.prices.get(&job.model).copied().unwrap_or_default();
                let mut r = self.base_result(&job, true);
                r.input_tokens = usage.prompt_tokens;
                r.output_tokens = usage.completion_tokens;
                r.cached_tokens = usage.cached_tokens.min(usage.prompt_tokens);
                r.cost_micros =
                    cost_micros(&price, r.input_tokens, r.cached_tokens, r.output_tokens);
                r.attempts = job.task.attempt_number - 1 + outcome.attempts;
                r.output = output_value(&job.task.task_type, &outcome.response.content);
                let m = match self.counters.get(&job.model) {
                    Some(m) => m,
                    None => self
                        .counters
                        .entry(job.model.clone())
                        .or_insert_with(|| self.op.metrics.model_counters(&job.model)),
                };
                m.input.inc_by(r.input_tokens);
                m.output.inc_by(r.output_tokens);
                m.cached.inc_by(r.cached_tokens);
                m.cost.inc_by(r.cost_micros.max(0) as u64);
                self.emit_result(ctx, &job, &r)
            }
            Err(failure) => {
                let attempts = job.task.attempt_number - 1 + failure.attempts.max(1);
                match failure.class() {
                    ErrorClass::Permanent(kind) => {
                        if was_probe {
                            self.recovered(ctx, &job.model);
                        }
                        let cat = kind.dlq_category();
                        self.fail(
                            ctx,
                            &job,
                            cat,
                            cat.as_str(),
                            &failure.error.to_string(),
                            attempts,
                        )
                    }
                    ErrorClass::Config => {
                        let fault = format!("provider:{}", job.model);
                        self.hold(ctx, &fault, &failure.error.to_string(), job, held);
                        Ok(())
                    }
                    ErrorClass::CircuitOpen => {
                        if self.op.router.has_fallback(&job.model) {
                            self.start_call(ctx, job, held);
                        } else {
                            let fault = format!("breaker:{}", job.model);
                            self.hold(ctx, &fault, "circuit open and no fallback model", job, held);
                        }
                        Ok(())
                    }
                    ErrorClass::RateLimited { retry_after } => {
                        // Rate limiting is never a task failure: the job waits,
                        // intake held, until the time the provider gave (a
                        // Retry-After longer than a call may wait: Azure's
                        // 30-60 s, a daily quota), then a probe tries again.
                        let wait = retry_after.map_or(0, |d| d.as_millis() as i64);
                        self.probe_not_before_ms = self.probe_not_before_ms.max(now_ms() + wait);
                        let fault = format!("rate_limited:{}", job.model);
                        let detail = "rate limited by the provider; waiting as told";
                        self.hold(ctx, &fault, detail, job, held);
                        Ok(())
                    }
                    ErrorClass::Transient | ErrorClass::Malformed => {
                        if job.task.attempt_number < self.op.config.tasks.max_attempts {
                            self.republish(ctx, &job)
                        } else {
                            self.fail(
                                ctx,
                                &job,
                                DlqCategory::Exhausted,
                                "exhausted",
                                &failure.error.to_string(),
                                attempts,
                            )
                        }
                    }
                }
            }
        }
    }

    /// The provider answered again: clear the faults of the model and restart
    /// every held job.
    fn recovered(&mut self, ctx: &mut Ctx<'_>, model: &str) {
        self.op.health.clear(&format!("provider:{model}"));
        self.op.health.clear(&format!("breaker:{model}"));
        self.op.health.clear(&format!("rate_limited:{model}"));
        let parked = std::mem::take(&mut self.parked);
        self.op.metrics.parked.set(0);
        for (job, held) in parked {
            ctx.with_record(&held.clone(), |ctx| self.start_call(ctx, job, held));
        }
    }

    /// Re-publishes the task to its topic with the next attempt number.
    fn republish(&mut self, ctx: &mut Ctx<'_>, job: &Job) -> Result<(), ProcessError> {
        let mut task = job.task.clone();
        task.attempt_number += 1;
        let value = serde_json::to_vec(&task)
            .map_err(|e| ProcessError::Fatal(format!("task encoding: {e}")))?;
        ctx.emit(OutputRecord {
            topic: job.source_topic.clone(),
            partition: Some(ctx.task_id().partition),
            key: job.key.clone(),
            value: Some(value),
            timestamp: now_ms(),
            headers: job.headers.clone(),
        });
        self.op.metrics.republished.inc();
        // Redeliveries that waited on this attempt finish without a result of
        // their own: the re-published task produces the task's one result.
        self.in_flight
            .remove(&idempotency_key(&job.task.task_type, &job.task.task_id));
        Ok(())
    }

    fn save_meta(&mut self, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        if self.meta_dirty {
            ctx.kv::<String, Meta>(META_STORE)?
                .put_at(&META_KEY.to_string(), &self.meta, None);
            self.meta_dirty = false;
        }
        Ok(())
    }

    /// Removes idempotency entries whose time is up, a page per tick: an
    /// incremental sweep costs nothing per task and bounds the work per tick.
    fn sweep(&mut self, ctx: &mut Ctx<'_>, now: i64) -> Result<(), ProcessError> {
        const PAGE: usize = 1024;
        if now - self.last_sweep_ms < 1_000 {
            return Ok(());
        }
        self.last_sweep_ms = now;
        let current = now / MINUTE_MS;
        let mut completed = ctx.kv::<String, StoredOutcome>(COMPLETED_STORE)?;
        let page = completed.scan_after_bytes(self.sweep_cursor.as_deref(), PAGE)?;
        if page.is_empty() {
            self.sweep_cursor = None;
            return Ok(());
        }
        for (_, task_id, outcome) in &page {
            if outcome.bucket <= current {
                completed.delete(task_id);
            }
        }
        self.sweep_cursor = page.last().map(|(kb, _, _)| kb.clone());
        Ok(())
    }
}

/// A task leaving this instance (moved to another, closed) takes its held
/// jobs along: the faults only it held no longer hold this instance's intake
/// (nothing here would ever probe them).
impl Drop for LlmTaskProcessor {
    fn drop(&mut self) {
        if let Some(task) = self.task {
            self.op.health.release(task);
        }
    }
}

impl Processor<RawKey, Option<Vec<u8>>> for LlmTaskProcessor {
    type OutKey = ();
    type OutValue = ();
    type Output = CallDone;

    fn init(&mut self, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        self.task = Some(ctx.task_id());
        if let Some(meta) = ctx
            .kv::<String, Meta>(META_STORE)?
            .get(&META_KEY.to_string())?
        {
            self.meta = meta;
        }
        if self.op.config.app.guarantee == sluice_topology::runtime::Guarantee::ExactlyOnce {
            recover::recover_results(self, ctx)?;
        }
        Ok(())
    }

    fn process(
        &mut self,
        record: Record<RawKey, Option<Vec<u8>>>,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), ProcessError> {
        let received_ms = now_ms();
        let cfg = &self.op.config;
        let limits = EnvelopeLimits {
            max_bytes: cfg.tasks.max_bytes,
            ..EnvelopeLimits::default()
        };
        let Some(bytes) = record.value.as_deref() else {
            return ctx.dead_letter("missing_value", DlqCategory::Poison.as_str(), 1);
        };
        let task = match decode_task(bytes, &limits, &cfg.topics.task_types) {
            Ok(t) => t,
            Err(poison) => {
                return ctx.dead_letter(&poison.reason(), DlqCategory::Poison.as_str(), 1)
            }
        };
        // Idempotency: the same input replayed emits nothing; a redelivered
        // task that succeeded re-emits its stored result without a call. A
        // stored failure is not final: a task that failed and comes back is
        // a new attempt (its cause may be gone).
        let current = ctx.position();
        let key = idempotency_key(&task.task_type, &task.task_id);
        if let Some((stored, position)) = ctx
            .kv::<String, StoredOutcome>(COMPLETED_STORE)?
            .get_with_position(&key)?
        {
            if position.is_some() && position == current {
                return Ok(());
            }
            if stored.success {
                self.op.metrics.duplicates.inc();
                let partition = self.results_partition(ctx);
                ctx.emit(result_record(
                    self.op.config.topics.results_completed.clone(),
                    partition,
                    &task.task_id,
                    stored.result_json,
                    &record.headers,
                    current,
                ));
                return Ok(());
            }
        }
        if let Some(waiters) = self.in_flight.get_mut(&key) {
            if let Some(held) = ctx.hold() {
                waiters.push((held, record.headers));
            }
            return Ok(());
        }
        let tenant = task.tenant().unwrap_or_default().to_string();
        let (model, route) = self.route(&task);
        let source_topic = cfg.topics.task_topic(&task.task_type);
        let (request, bad_request) = match self.op.prompts.build_request(&task) {
            Ok(r) => (Some(r), None),
            Err(e) => (None, Some(e)),
        };
        let job = Job {
            task,
            tenant,
            headers: record.headers,
            key: record.key,
            source_topic,
            received_ms,
            model,
            route,
            request,
            probe: false,
        };
        if let Some(e) = bad_request {
            return self.fail(
                ctx,
                &job,
                DlqCategory::BadRequest,
                "bad_request",
                &e.to_string(),
                0,
            );
        }
        let Some(held) = ctx.hold() else {
            return Err(ProcessError::Fatal("no current record".into()));
        };
        self.in_flight.insert(key, Vec::new());
        self.start_call(ctx, Box::new(job), held);
        Ok(())
    }

    fn complete(&mut self, done: CallDone, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        let held = done.held.clone();
        ctx.with_record(&held, |ctx| self.finish(ctx, done))
    }

    fn punctuate(&mut self, time: Punctuation, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        // Probe a held provider with one held task.
        let probe_every = self.op.config.tasks.probe_interval_ms as i64;
        if !self.parked.is_empty()
            && !self.probing
            && time.wall_clock_ms - self.last_probe_ms >= probe_every
            && time.wall_clock_ms >= self.probe_not_before_ms
        {
            self.last_probe_ms = time.wall_clock_ms;
            let (mut job, held) = self.parked.remove(0);
            self.op.metrics.parked.set(self.parked.len() as i64);
            job.probe = true;
            self.probing = true;
            ctx.with_record(&held.clone(), |ctx| self.start_call(ctx, job, held));
        }
        // Where this task's committed results end (see `recover`).
        let partition = ctx.task_id().partition;
        let topics = self.op.config.topics.clone();
        for topic in [&topics.results_completed, &topics.results_failed] {
            if let Some(end) = ctx.output_end(topic, partition) {
                if self.meta.results_end.get(topic) != Some(&end) {
                    self.meta.results_end.insert(topic.clone(), end);
                    self.meta_dirty = true;
                }
            }
        }
        self.sweep(ctx, time.wall_clock_ms)?;
        self.save_meta(ctx)
    }
}

/// A result record: keyed by task id, in the task's own partition, with the
/// trace context of `trace_from` and the input position in headers.
fn result_record(
    topic: String,
    partition: i32,
    task_id: &str,
    json: Vec<u8>,
    trace_from: &Headers,
    position: Option<Position>,
) -> OutputRecord {
    let mut headers: Headers = trace_from
        .iter()
        .filter(|(k, _)| TRACE_HEADERS.contains(&k.as_str()))
        .cloned()
        .collect();
    if let Some(p) = position {
        headers.push((HEADER_SOURCE.into(), p.source.to_string().into_bytes()));
        headers.push((HEADER_OFFSET.into(), p.offset.to_string().into_bytes()));
    }
    OutputRecord {
        topic,
        partition: Some(partition),
        key: Some(task_id.as_bytes().to_vec()),
        value: Some(json),
        timestamp: now_ms(),
        headers,
    }
}

fn result_json_again(result: &TaskResult) -> Result<Vec<u8>, ProcessError> {
    serde_json::to_vec(result).map_err(|e| ProcessError::Fatal(format!("result encoding: {e}")))
}

/// Cost in micro-dollars of a call, from prices per million tokens (rounded
/// half up; integer so that totals are exact sums).
pub fn cost_micros(price: &Price, input: u64, cached: u64, output: u64) -> i64 {
    let uncached = input.saturating_sub(cached) as u128;
    let total = uncached * price.input as u128
        + cached as u128 * price.cached as u128
        + output as u128 * price.output as u128;
    ((total + 500_000) / 1_000_000) as i64
}

/// The `output` of a result: JSON for `extract` when the answer parses, else text.
fn output_value(task_type: &str, content: &str) -> serde_json::Value {
    if task_type == "extract" {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(content) {
            return v;
        }
    }
    serde_json::Value::String(content.to_string())
}

/// Position of a result from its headers.
pub fn result_position(headers: &Headers) -> Option<Position> {
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    };
    Some(Position {
        source: get(HEADER_SOURCE)?.parse().ok()?,
        offset: get(HEADER_OFFSET)?.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_is_integer_micros_with_cached_rate() {
        let p = Price {
            input: 150_000,
            output: 600_000,
            cached: 75_000,
        };
        // 1000 input (200 cached), 500 output:
        // 800*0.15 + 200*0.075 + 500*0.6 = 120 + 15 + 300 = 435 micros
        assert_eq!(cost_micros(&p, 1000, 200, 500), 435);
        assert_eq!(cost_micros(&Price::default(), 1000, 0, 1000), 0);
        assert_eq!(cost_micros(&p, 3, 0, 0), 0); // 0.45 rounds down
        assert_eq!(cost_micros(&p, 4, 0, 0), 1); // 0.6 rounds up
    }

    #[test]
    fn extract_outputs_are_json_when_they_parse() {
        assert_eq!(
            output_value("extract", "{\"a\":1}"),
            serde_json::json!({"a": 1})
        );
        assert_eq!(output_value("extract", "nope"), serde_json::json!("nope"));
        assert_eq!(
            output_value("summarize", "{\"a\":1}"),
            serde_json::json!("{\"a\":1}")
        );
    }

    #[test]
    fn stored_outcomes_encode_as_before_and_round_trip() {
        /// The encoding before `result_json` was a byte string.
        #[derive(Serialize)]
        struct Before {
            result_json: Vec<u8>,
            success: bool,
            bucket: i64,
        }
        let json = br#"{"taskId":"t1","success":true}"#.to_vec();
        let now = StoredOutcome {
            result_json: json.clone(),
            success: true,
            bucket: 29_000_000,
        };
        let bytes = sluice_topology::to_bincode(&now);
        let before = Before {
            result_json: json.clone(),
            success: true,
            bucket: 29_000_000,
        };
        assert_eq!(bytes, sluice_topology::to_bincode(&before));
        let back: StoredOutcome = sluice_topology::from_bincode(&bytes).unwrap();
        assert_eq!(back.result_json, json);
        assert!(back.success);
        assert_eq!(back.bucket, 29_000_000);
    }

    #[test]
    fn result_positions_round_trip_through_headers() {
        let h: Headers = vec![
            (HEADER_SOURCE.into(), b"12".to_vec()),
            (HEADER_OFFSET.into(), b"34".to_vec()),
        ];
        assert_eq!(
            result_position(&h),
            Some(Position {
                source: 12,
                offset: 34
            })
        );
        assert_eq!(result_position(&vec![]), None);
    }
}
