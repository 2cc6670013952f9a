//! `invoke_llm`: calls the provider for each task (or micro-batch) and
//! forwards exactly one result per task, keyed by task id.
//!
//! Per task: look it up in the idempotency store (a redelivered task that
//! succeeded gets its stored result again without a call; the same input
//! replayed after a crash, or a dead letter replayed by `sluice dlq replay`
//! of a task that succeeded since, emits nothing; a task that failed and
//! comes back is a new attempt); build its prompt (a bad request is dead-lettered at
//! once); call asynchronously, the record held in flight. On completion:
//! success → a completed result; permanent failure → dead letter and a
//! failed result (a `400` first waits for its model's run: the same `400`
//! to a run of calls is a configuration fault, see [`trap`]); transient failure past the in-call retries → re-published
//! with `attemptNumber + 1`, or dead-lettered as `exhausted` on the last
//! attempt; configuration fault (401/403/unknown model), open breaker
//! without fallback, long rate limit → the task is held, intake stops,
//! readiness fails, and one held task probes the provider until it answers.
//!
//! A micro-batch is one call with the batch prompt; its answer is split back
//! per task and its usage apportioned exactly over them. An answer that cannot
//! be split, or a permanent failure of the batch, falls back to a call per
//! task (the failed call's usage is billed to them), so one bad task fails
//! alone.
//!
//! Exactly-once: a task's results, dead letters, re-published attempts and
//! idempotency entries commit in one transaction with the offsets of the
//! inputs they answer, so after a crash the input is answered again exactly
//! when its answer did not commit.

mod call;
pub mod health;
pub mod metrics;
mod output;
mod trap;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use chrono::Utc;
use serde::{Deserialize, Serialize};
use sluice_topology::{
    Data, Headers, InFlight, ProcessError, Processor, ProcessorContext, Punctuation, Record,
};

use crate::accounting::{Accounting, Amount, QuotaGate, Reservations};
use crate::config::Price;
use crate::envelope::{DlqCategory, Route, TaskResult};
use crate::llm::{ChatRequest, LlmClient, PromptBuilder, Usage};
use crate::pipeline::{BatchItem, LlmInput, Routed, Work};
use crate::trace::Tracer;
pub use call::CallDone;
pub use health::Health;
pub use metrics::OperatorMetrics;

/// Result header on a result given again to a redelivered task: the task's
/// one call was answered (and accounted) before.
pub const HEADER_DUPLICATE: &str = "sluice.duplicate";
/// Task header on a dead letter re-published by `sluice dlq replay`:
/// `<dead-letter topic>/<partition>/<offset>`. A replayed task whose id
/// already succeeded emits nothing (its result is out already), so
/// replaying twice never adds a second result.
pub const HEADER_REPLAY_OF: &str = "sluice.replay.of";
/// W3C trace context headers of a task (a result carries a child span of
/// its `traceparent`, see [`crate::trace`]).
pub const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

const MINUTE_MS: i64 = 60_000;

/// `errorCode` of a task a hard quota refused.
pub const QUOTA_EXCEEDED: &str = "quota_exceeded";

/// The idempotency key of a task: its type and its id, since two task types
/// may reuse an id. (Task types are topic-name suffixes, which cannot hold
/// `/`.) A task sent again must be sent with the same Kafka key, so it reaches
/// the partition — and the store — that answered it.
pub(crate) fn idempotency_key(task_type: &str, task_id: &str) -> String {
    format!("{task_type}/{task_id}")
}

/// A task under way, by tenant too: another tenant's task under the same id
/// never waits for (and gets) this one's answer.
pub(crate) fn in_flight_key(tenant: &str, key: &str) -> String {
    format!("{tenant}\n{key}")
}

/// The `invoke_llm` operator's own settings.
#[derive(Clone, Debug)]
pub struct LlmSettings {
    /// The operator's name; its store is `<name>-completed`.
    pub name: String,
    /// Deliveries of a task before it is dead-lettered as `exhausted`.
    pub max_attempts: u32,
    /// Backoff of re-published attempts: the base and the longest.
    pub retry_backoff: (std::time::Duration, std::time::Duration),
    /// How long completed task ids are remembered, hours.
    pub idempotency_ttl_hours: u64,
    /// While intake is held, how often one held task probes the provider, ms.
    pub probe_interval_ms: u64,
    /// Consecutive calls of a model refused with the same `400` that make it
    /// a configuration fault (see [`trap`]); 0 dead-letters every `400` at once.
    pub bad_request_trap_after: u32,
    /// How long a task refused with a `400` waits for its model's run to
    /// decide before it is dead-lettered, ms.
    pub bad_request_wait_ms: u64,
    /// Fallback model per model, while a model's breaker is open.
    pub fallbacks: BTreeMap<String, String>,
    /// Prices per model (a result's `costMicros`).
    pub prices: BTreeMap<String, Price>,
    /// The per-tenant accounts `account` keeps after this step: hard quotas
    /// are enforced against them before each call (see
    /// [`crate::accounting::quota`]).
    pub accounting: Option<Accounting>,
}

/// The `invoke_llm` operator's settings and the parts its instances share
/// (the client, whose limiters and breakers serve every task, the faults,
/// the metrics).
#[derive(Clone)]
pub struct LlmStep(Arc<StepInner>);

struct StepInner {
    settings: LlmSettings,
    quota: Option<QuotaGate>,
    client: LlmClient,
    prompts: PromptBuilder,
    health: Health,
    metrics: OperatorMetrics,
    bad_requests: trap::BadRequestRuns,
    tracer: Tracer,
}

impl LlmStep {
    /// A step calling `client` with prompts from `prompts`; its results'
    /// spans are not exported.
    pub fn new(
        settings: LlmSettings,
        client: LlmClient,
        prompts: PromptBuilder,
        health: Health,
        metrics: OperatorMetrics,
    ) -> Self {
        Self::traced(settings, client, prompts, health, metrics, Tracer::local())
    }

    /// A step whose results' spans go to `tracer`.
    pub fn traced(
        settings: LlmSettings,
        client: LlmClient,
        prompts: PromptBuilder,
        health: Health,
        metrics: OperatorMetrics,
        tracer: Tracer,
    ) -> Self {
        LlmStep(Arc::new(StepInner {
            tracer,
            quota: settings
                .accounting
                .as_ref()
                .and_then(Accounting::quota_gate),
            bad_requests: trap::BadRequestRuns::new(settings.bad_request_trap_after),
            settings,
            client,
            prompts,
            health,
            metrics,
        }))
    }

    /// The operator's name.
    pub fn name(&self) -> &str {
        &self.0.settings.name
    }

    /// Its own stores: completed tasks (idempotency).
    pub fn store_names(&self) -> [String; 1] {
        [self.completed_store()]
    }

    /// The hard-quota gate, if any.
    pub fn quota(&self) -> Option<&QuotaGate> {
        self.0.quota.as_ref()
    }

    /// The accounts kept after this step (their stores are attached to it).
    pub fn accounting(&self) -> Option<&Accounting> {
        self.settings().accounting.as_ref()
    }

    /// The idempotency store: `<task type>/<task id>` → stored result.
    pub fn completed_store(&self) -> String {
        format!("{}-completed", self.name())
    }

    fn settings(&self) -> &LlmSettings {
        &self.0.settings
    }

    /// The minute an idempotency entry written now expires in.
    pub(crate) fn expiry_bucket(&self) -> i64 {
        now_ms() / MINUTE_MS + self.settings().idempotency_ttl_hours as i64 * 60
    }
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

/// A task admitted for a call.
struct Item {
    routed: Routed,
    headers: Headers,
    held: InFlight,
    request: ChatRequest,
    /// Usage of failed batch calls billed to this task.
    extra: Usage,
    /// Their cost (this task's shares of those calls' costs).
    extra_cost_micros: i64,
}

/// Why a task failed for good.
struct Failure {
    category: DlqCategory,
    message: String,
    attempts: u32,
    /// What the provider billed for the task's earlier calls (its shares of
    /// batch calls whose answers were unusable) and its cost: on the failed
    /// result, so it reaches the tenant's accounts.
    billed: (Usage, i64),
}

type Ctx<'a> = ProcessorContext<'a, String, TaskResult, CallDone>;

/// The operator (one instance per task).
pub struct LlmProcessor {
    step: LlmStep,
    completed_store: String,
    /// Tasks with a call under way (by tenant and idempotency key) →
    /// redeliveries of them waiting for its result.
    in_flight: HashMap<String, Vec<(InFlight, Headers)>>,
    parked: Vec<call::Job>,
    /// Jobs refused with a `400`, waiting for their model's run to decide
    /// (see [`trap`]).
    refused: Vec<call::Refused>,
    /// Models this task raised a fault for; a success of one clears it.
    faulted: HashSet<String>,
    probing: bool,
    last_probe_ms: i64,
    /// No probe before this time (a provider's `Retry-After`).
    probe_not_before_ms: i64,
    /// The task this processor runs in (known from `init`).
    task: Option<sluice_topology::TaskId>,
    /// Token and cost series per model, resolved on first use.
    counters: HashMap<String, metrics::ModelCounters>,
    /// Where the expiry sweep of the completed store goes on from.
    sweep_cursor: Option<Vec<u8>>,
    last_sweep_ms: i64,
    /// Hard-quota reservations of the calls under way, per tenant.
    reservations: Reservations,
    /// The reservation of each task under way (by in-flight key).
    reserved: HashMap<String, (String, Amount)>,
}

fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

impl LlmProcessor {
    /// An instance of `step`.
    pub fn new(step: LlmStep) -> Self {
        LlmProcessor {
            completed_store: step.completed_store(),
            step,
            in_flight: Default::default(),
            parked: Vec::new(),
            refused: Vec::new(),
            faulted: HashSet::new(),
            probing: false,
            last_probe_ms: 0,
            probe_not_before_ms: 0,
            task: None,
            counters: Default::default(),
            sweep_cursor: None,
            last_sweep_ms: 0,
            reservations: Reservations::default(),
            reserved: HashMap::new(),
        }
    }

    fn metrics(&self) -> &OperatorMetrics {
        &self.step.0.metrics
    }

    /// Idempotency and prompt for one task (its record current): `None`
    /// when it needs no call of its own.
    fn admit(&mut self, ctx: &mut Ctx<'_>, item: BatchItem) -> Result<Option<Item>, ProcessError> {
        let env = &item.task.task.envelope;
        let key = idempotency_key(&env.task_type, &env.task_id);
        // A redelivered task that succeeded gets its stored result again
        // without a call, a replayed dead letter of it nothing. A stored
        // failure is not final: a task that failed and comes back (or is
        // replayed) is a new attempt (its cause may be gone).
        if let Some(stored) = ctx
            .kv::<String, StoredOutcome>(&self.completed_store)?
            .get(&key)?
        {
            if stored.success {
                match serde_json::from_slice::<TaskResult>(&stored.result_json) {
                    Ok(result) if result.tenant_id == item.task.task.tenant() => {
                        self.metrics().duplicates.inc();
                        // A replayed dead letter of a task that succeeded
                        // since: its result is out already.
                        if !is_replay(&item.headers) {
                            forward_result(ctx, &self.step, result, &item.headers, true)?;
                        }
                        return Ok(None);
                    }
                    // Another tenant's task under the same id: never its
                    // answer; a task of its own.
                    Ok(_) => self.metrics().id_conflicts.inc(),
                    Err(_) => {}
                }
            }
        }
        let flight = in_flight_key(item.task.task.tenant(), &key);
        if let Some(waiters) = self.in_flight.get_mut(&flight) {
            waiters.push((item.held, item.headers));
            return Ok(None);
        }
        let request = match self.step.0.prompts.build_request(env) {
            Ok(r) => r,
            Err(e) => {
                let why = Failure {
                    category: DlqCategory::BadRequest,
                    message: e.to_string(),
                    attempts: 0,
                    billed: (Usage::default(), 0),
                };
                let model = item.task.model.clone();
                self.fail(ctx, &item.task, &item.headers, &model, why)?;
                return Ok(None);
            }
        };
        if let Some(gate) = self.step.quota() {
            let tenant = item.task.task.tenant().to_string();
            let worst = self.worst_case(&item.task, &request);
            match gate.reserve(ctx, &mut self.reservations, &tenant, worst, now_ms())? {
                Err(exceeded) => {
                    self.reject(ctx, &item.task, &item.headers, exceeded.message)?;
                    return Ok(None);
                }
                Ok(true) => {
                    self.metrics().reservations.inc();
                    self.reserved.insert(flight.clone(), (tenant, worst));
                }
                Ok(false) => {}
            }
        }
        self.in_flight.insert(flight, Vec::new());
        Ok(Some(Item {
            routed: item.task,
            headers: item.headers,
            held: item.held,
            request,
            extra: Usage::default(),
            extra_cost_micros: 0,
        }))
    }

    /// A call's worst case: the prompt estimate plus the completion cap,
    /// priced at the dearest rates of the models it may end on (its own and
    /// its fallbacks).
    fn worst_case(&self, routed: &Routed, request: &ChatRequest) -> Amount {
        let output = u64::from(request.max_tokens.unwrap_or(256));
        let tokens = u64::from(request.estimated_tokens());
        let prices = &self.step.settings().prices;
        let fallbacks = &self.step.settings().fallbacks;
        let mut dearest = Price::default();
        let mut model = Some(routed.model.as_str());
        let mut seen = HashSet::new();
        while let Some(m) = model.filter(|m| seen.insert(*m)) {
            if let Some(p) = prices.get(m) {
                dearest.input = dearest.input.max(p.input);
                dearest.output = dearest.output.max(p.output);
                dearest.cached = dearest.cached.max(p.cached);
            }
            model = fallbacks.get(m).map(String::as_str);
        }
        Amount {
            tokens,
            cost_micros: cost_micros(&dearest, tokens.saturating_sub(output), 0, output),
        }
    }

    /// A task a hard quota refuses: a failed result `quota_exceeded` (no
    /// call, no dead letter). Its record is current.
    fn reject(
        &mut self,
        ctx: &mut Ctx<'_>,
        routed: &Routed,
        headers: &Headers,
        message: String,
    ) -> Result<(), ProcessError> {
        self.metrics().quota_rejections.inc();
        let mut r = self.base_result(routed, &routed.model, false);
        r.error_code = Some(QUOTA_EXCEEDED.to_string());
        r.error_message = Some(message);
        self.emit_result(ctx, headers, r)
    }

    /// A task's call is over: its reservation is released (the accountant
    /// settles its real usage as its result passes, in this same step) and
    /// the redeliveries that waited for it are returned.
    fn end_flight(&mut self, flight: &str) -> Vec<(InFlight, Headers)> {
        if let Some((tenant, amount)) = self.reserved.remove(flight) {
            self.reservations.release(&tenant, amount);
            self.metrics().reservations.dec();
        }
        self.in_flight.remove(flight).unwrap_or_default()
    }

    fn base_result(&self, routed: &Routed, model: &str, success: bool) -> TaskResult {
        let task = &routed.task;
        let route = if model == routed.model {
            routed.route.clone()
        } else {
            Route {
                tier: model.to_string(),
                reason: format!("fallback:{}:circuit_open", routed.model),
            }
        };
        TaskResult {
            task_id: task.envelope.task_id.clone(),
            task_type: task.envelope.task_type.clone(),
            tenant_id: task.tenant().to_string(),
            success,
            completed_at: Utc::now(),
            processing_ms: (now_ms() - task.received_ms).max(0) as u64,
            model: model.to_string(),
            route,
            input_tokens: 0,
            output_tokens: 0,
            cached_tokens: 0,
            cost_micros: 0,
            attempts: task.envelope.attempt_number,
            batch_id: None,
            output: serde_json::Value::Null,
            error_code: None,
            error_message: None,
            metadata: task.envelope.metadata.clone(),
        }
    }

    /// Forwards a result (completed or failed) and remembers it; redeliveries
    /// that waited for it get it too. The item's record is current.
    fn emit_result(
        &mut self,
        ctx: &mut Ctx<'_>,
        headers: &Headers,
        result: TaskResult,
    ) -> Result<(), ProcessError> {
        let json = serde_json::to_vec(&result)
            .map_err(|e| ProcessError::Fatal(format!("result encoding: {e}")))?;
        let key = idempotency_key(&result.task_type, &result.task_id);
        let success = result.success;
        ctx.kv::<String, StoredOutcome>(&self.completed_store)?.put(
            &key,
            &StoredOutcome {
                result_json: json,
                success,
                bucket: self.step.expiry_bucket(),
            },
        );
        self.metrics().result(success).inc();
        // Redeliveries that arrived while the call was under way get the same
        // result, without a call of their own.
        let flight = in_flight_key(&result.tenant_id, &key);
        for (waiter, headers) in self.end_flight(&flight) {
            self.metrics().duplicates.inc();
            if success && is_replay(&headers) {
                continue;
            }
            let again = result.clone();
            let step = &self.step;
            ctx.with_record(&waiter, |ctx| {
                forward_result(ctx, step, again, &headers, true)
            })?;
        }
        forward_result(ctx, &self.step, result, headers, false)
    }

    /// Dead-letters a task and forwards its failed result (its record current).
    fn fail(
        &mut self,
        ctx: &mut Ctx<'_>,
        routed: &Routed,
        headers: &Headers,
        model: &str,
        why: Failure,
    ) -> Result<(), ProcessError> {
        let code = why.category.as_str();
        ctx.dead_letter(code, code, why.attempts)?;
        let mut r = self.base_result(routed, model, false);
        r.attempts = why.attempts;
        let (usage, cost) = why.billed;
        self.bill(&mut r, usage, cost);
        r.error_code = Some(code.to_string());
        r.error_message = Some(why.message);
        self.emit_result(ctx, headers, r)
    }

    /// Puts what the provider billed for a task on its result (completed or
    /// failed) and counts it in the result model's token and cost counters.
    fn bill(&mut self, r: &mut TaskResult, usage: Usage, cost_micros: i64) {
        r.input_tokens = usage.prompt_tokens;
        r.output_tokens = usage.completion_tokens;
        r.cached_tokens = usage.cached_tokens.min(usage.prompt_tokens);
        r.cost_micros = cost_micros;
        let m = match self.counters.get(&r.model) {
            Some(m) => m,
            None => {
                let m = self.metrics().model_counters(&r.model);
                self.counters.entry(r.model.clone()).or_insert(m)
            }
        };
        m.input.inc_by(r.input_tokens);
        m.output.inc_by(r.output_tokens);
        m.cached.inc_by(r.cached_tokens);
        m.cost.inc_by(r.cost_micros.max(0) as u64);
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
        let mut completed = ctx.kv::<String, StoredOutcome>(&self.completed_store)?;
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
impl Drop for LlmProcessor {
    fn drop(&mut self) {
        if let Some(task) = self.task {
            self.step.0.health.release(task);
        }
        self.metrics().reservations.sub(self.reserved.len() as i64);
    }
}

impl<K: Data, V: LlmInput> Processor<K, V> for LlmProcessor {
    type OutKey = String;
    type OutValue = TaskResult;
    type Output = CallDone;

    fn init(&mut self, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        self.task = Some(ctx.task_id());
        Ok(())
    }

    fn process(&mut self, record: Record<K, V>, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        let (batch_id, items) = match record.value.into_work() {
            Work::One(task) => {
                let Some(held) = ctx.hold() else {
                    return Err(ProcessError::Fatal("no current record".into()));
                };
                let item = BatchItem {
                    task,
                    headers: record.headers,
                    held,
                };
                (None, vec![item])
            }
            Work::Batch(b) => (b.id, b.items),
        };
        let mut admitted = Vec::with_capacity(items.len());
        for item in items {
            let held = item.held.clone();
            if let Some(a) = ctx.with_record(&held, |ctx| self.admit(ctx, item))? {
                admitted.push(a);
            }
        }
        self.start(ctx, admitted, batch_id);
        Ok(())
    }

    fn complete(&mut self, done: CallDone, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        self.finish(ctx, done)
    }

    fn punctuate(&mut self, time: Punctuation, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        // Probe a held provider with one held job.
        let probe_every = self.step.settings().probe_interval_ms as i64;
        if !self.parked.is_empty()
            && !self.probing
            && time.wall_clock_ms - self.last_probe_ms >= probe_every
            && time.wall_clock_ms >= self.probe_not_before_ms
        {
            self.last_probe_ms = time.wall_clock_ms;
            let mut job = self.parked.remove(0);
            self.count_parked();
            job.probe = true;
            self.probing = true;
            self.start_call(ctx, job);
        }
        self.decide_refused(ctx)?;
        self.sweep(ctx, time.wall_clock_ms)
    }
}

/// Forwards a result keyed by task id, with the trace context of
/// `trace_from` in headers; a result
/// given again to a redelivered task (no call of its own) is marked
/// [`HEADER_DUPLICATE`], so its tokens are not accounted twice.
fn forward_result(
    ctx: &mut Ctx<'_>,
    step: &LlmStep,
    result: TaskResult,
    trace_from: &Headers,
    duplicate: bool,
) -> Result<(), ProcessError> {
    let mut headers = step.0.tracer.result_headers(trace_from, &result, duplicate);
    if duplicate {
        headers.push((HEADER_DUPLICATE.into(), b"1".to_vec()));
    }
    let key = result.task_id.clone();
    ctx.forward(Record {
        key,
        value: result,
        timestamp: now_ms(),
        headers,
    })
}

/// Whether a task's headers mark it as a replayed dead letter.
fn is_replay(headers: &Headers) -> bool {
    headers.iter().any(|(k, _)| k == HEADER_REPLAY_OF)
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

/// Splits a call's cost over the usage shares of its tasks: the call's cost
/// is rounded once (from its whole usage) and given out in proportion to
/// each share's exact cost by largest remainder, so the tasks' costs sum to
/// the call's cost exactly.
pub fn apportion_cost(price: &Price, shares: &[Usage]) -> Vec<i64> {
    let (mut input, mut cached, mut output) = (0u64, 0u64, 0u64);
    let weights: Vec<u64> = shares
        .iter()
        .map(|s| {
            let c = s.cached_tokens.min(s.prompt_tokens);
            input += s.prompt_tokens;
            cached += c;
            output += s.completion_tokens;
            let exact = (s.prompt_tokens - c) as u128 * price.input as u128
                + c as u128 * price.cached as u128
                + s.completion_tokens as u128 * price.output as u128;
            u64::try_from(exact).unwrap_or(u64::MAX)
        })
        .collect();
    let total = cost_micros(price, input, cached, output).max(0) as u64;
    crate::llm::apportion::apportion(total, &weights)
        .into_iter()
        .map(|c| c as i64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over 10,000 random batches, the tasks' costs sum to the call's cost
    /// to the micro-dollar, and each is within a micro-dollar of its exact
    /// share.
    #[test]
    fn batch_costs_sum_to_the_calls_cost_exactly() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xc057);
        for _ in 0..10_000 {
            let price = Price {
                input: rng.random_range(0..20_000_000),
                output: rng.random_range(0..80_000_000),
                cached: rng.random_range(0..10_000_000),
            };
            let shares: Vec<Usage> = (0..rng.random_range(1..=32))
                .map(|_| {
                    let prompt = rng.random_range(0..3_000);
                    Usage {
                        prompt_tokens: prompt,
                        completion_tokens: rng.random_range(0..2_000),
                        cached_tokens: rng.random_range(0..=prompt),
                    }
                })
                .collect();
            let costs = apportion_cost(&price, &shares);
            let sum = |f: fn(&Usage) -> u64| shares.iter().map(f).sum::<u64>();
            let call = cost_micros(
                &price,
                sum(|u| u.prompt_tokens),
                sum(|u| u.cached_tokens),
                sum(|u| u.completion_tokens),
            );
            assert_eq!(costs.iter().sum::<i64>(), call, "{price:?} {shares:?}");
            for (share, cost) in shares.iter().zip(&costs) {
                let exact = cost_micros_exact(&price, share);
                assert!(
                    (*cost as f64 - exact).abs() <= 1.0 + 1e-9,
                    "{cost} vs {exact}"
                );
            }
        }
    }

    fn cost_micros_exact(price: &Price, u: &Usage) -> f64 {
        ((u.prompt_tokens - u.cached_tokens) as f64 * price.input as f64
            + u.cached_tokens as f64 * price.cached as f64
            + u.completion_tokens as f64 * price.output as f64)
            / 1e6
    }

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
}
