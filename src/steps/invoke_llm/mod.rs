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
//! without fallback, long rate limit → the fault holds that model only: its
//! jobs are parked (their records in flight, so a partition's intake pauses
//! only once they fill its in-flight budget), `/readyz` names the model, one
//! parked job per model probes it until it answers, and the other models'
//! tasks keep flowing.
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

pub mod apportion;
mod call;
pub mod metrics;
mod output;
mod policy;
pub mod prompt;
mod trap;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sluice_topology::{
    Data, Headers, InFlight, ProcessError, Processor, ProcessorContext, Punctuation, Record,
};

use crate::envelope::{DlqCategory, Route, TaskResult};
use crate::llm::{ChatRequest, LlmClient, Usage};
use crate::steps::account::pricing::{apportion_cost, cost_micros, Price};
use crate::steps::account::{Accounting, Amount, QuotaDecision, QuotaGate, Reservations};
use crate::steps::batch::{Batch, BatchItem};
pub use crate::steps::health::Health;
use crate::steps::route::Routed;
use crate::trace::Tracer;
pub use call::CallDone;
pub use metrics::OperatorMetrics;
pub use prompt::{PromptBuilder, PromptConfig};

pub use crate::envelope::{HEADER_BILLED, HEADER_DUPLICATE, HEADER_REPLAY_OF, QUOTA_EXCEEDED};

/// What `invoke_llm` accepts: a routed task, or a micro-batch of them.
pub trait LlmInput: Data {
    /// The tasks, one or several.
    fn into_work(self) -> Work;
}

/// The tasks of one `invoke_llm` input record (taken apart at once, never
/// stored, so the variants' sizes do not matter).
#[allow(clippy::large_enum_variant)]
pub enum Work {
    /// One task: the current record.
    One(Routed),
    /// A batch: each item holds its own input record.
    Batch(Batch),
}

impl LlmInput for Routed {
    fn into_work(self) -> Work {
        Work::One(self)
    }
}

impl LlmInput for Batch {
    fn into_work(self) -> Work {
        Work::Batch(self)
    }
}
/// The most tokens, or micro-dollars, a [`HEADER_BILLED`] figure may name: a
/// header naming more (written by no Sluice: a million calls of a million
/// tokens is 2^40) is not read, so no record can carry sums that wrap around
/// into a tenant's accounts.
const MAX_BILLED: u64 = 1 << 40;

/// What a task's earlier attempts were billed ([`HEADER_BILLED`]), if any.
pub(crate) fn billed_before(headers: &Headers) -> (Usage, i64) {
    let parsed = headers
        .iter()
        .rev()
        .find(|(k, _)| k == HEADER_BILLED)
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
        .and_then(|v| {
            let mut n = v
                .split(',')
                .map(|x| x.trim().parse::<u64>().ok().filter(|n| *n <= MAX_BILLED));
            let mut next = || n.next().flatten();
            let mut usage = Usage {
                prompt_tokens: next()?,
                completion_tokens: next()?,
                cached_tokens: next()?,
                cache_write_tokens: 0,
            };
            let cost = i64::try_from(next()?).ok()?;
            usage.cache_write_tokens = next().unwrap_or(0);
            Some((usage, cost))
        });
    parsed.unwrap_or_default()
}

/// `headers` with [`HEADER_BILLED`] set to what a task was billed so far.
pub(crate) fn with_billed(headers: &Headers, usage: Usage, cost_micros: i64) -> Headers {
    let mut out: Headers = headers
        .iter()
        .filter(|(k, _)| k != HEADER_BILLED)
        .cloned()
        .collect();
    if usage != Usage::default() || cost_micros != 0 {
        let mut v = format!(
            "{},{},{},{}",
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens,
            cost_micros.max(0)
        );
        if usage.cache_write_tokens > 0 {
            v.push_str(&format!(",{}", usage.cache_write_tokens));
        }
        out.push((HEADER_BILLED.into(), v.into_bytes()));
    }
    out
}

/// W3C trace context headers of a task (a result carries a child span of
/// its `traceparent`, see [`crate::trace`]).
pub const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

const MINUTE_MS: i64 = 60_000;

/// The completion cap of a hard-quota tenant's call whose template and model
/// set none.
const DEFAULT_HARD_QUOTA_CAP: u32 = 16_384;

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
    /// While a model is held, how often one of its parked jobs probes it, ms.
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
    /// The most completion tokens each model writes in one answer: the cap
    /// a hard-quota tenant's call gets when its template sets none.
    pub max_output_tokens: BTreeMap<String, u32>,
    /// The per-tenant accounts `account` keeps after this step: hard quotas
    /// are enforced against them before each call (see
    /// [`crate::steps::account::quota`]).
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

    /// Its own window store: task outcomes (idempotency), and how long it
    /// keeps them.
    pub fn idempotency_store(&self) -> (String, std::time::Duration) {
        let w = self.idempotency_windows();
        let kept = w.ttl_ms + w.segment_ms;
        (
            self.completed_store(),
            std::time::Duration::from_millis(kept as u64),
        )
    }

    /// The hard-quota gate, if any.
    pub fn quota(&self) -> Option<&QuotaGate> {
        self.0.quota.as_ref()
    }

    /// The accounts kept after this step (their stores are attached to it).
    pub fn accounting(&self) -> Option<&Accounting> {
        self.settings().accounting.as_ref()
    }

    /// The idempotency store: `<task type>/<task id>` → stored result, in
    /// windows of its writing time.
    pub fn completed_store(&self) -> String {
        format!("{}-outcomes", self.name())
    }

    fn settings(&self) -> &LlmSettings {
        &self.0.settings
    }

    fn idempotency_windows(&self) -> IdempotencyWindows {
        IdempotencyWindows::new(self.settings().idempotency_ttl_hours as i64 * 60 * MINUTE_MS)
    }
}

/// The idempotency store's windows: an outcome goes into the window of the
/// time it is written (a seventh of the time to live, at least a minute),
/// and a whole window is dropped (one range delete, nothing per entry) once
/// its newest entry is older than the time to live. So the store holds at
/// most the outcomes of the last `ttl + segment`, whatever the rate, and a
/// look-up reads one key in each of at most nine windows, newest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IdempotencyWindows {
    ttl_ms: i64,
    segment_ms: i64,
}

impl IdempotencyWindows {
    pub(crate) fn new(ttl_ms: i64) -> Self {
        let ttl_ms = ttl_ms.max(MINUTE_MS);
        IdempotencyWindows {
            ttl_ms,
            segment_ms: (ttl_ms / 7).max(MINUTE_MS),
        }
    }

    /// The window an outcome written at `now` goes into.
    pub(crate) fn window_of(&self, now: i64) -> i64 {
        now.div_euclid(self.segment_ms) * self.segment_ms
    }

    /// Windows starting before this hold only outcomes older than the time
    /// to live: they are dropped.
    pub(crate) fn expire_before(&self, now: i64) -> i64 {
        self.window_of(now - self.ttl_ms)
    }

    /// The windows a look-up at `now` reads, newest first.
    pub(crate) fn live(&self, now: i64) -> impl Iterator<Item = i64> {
        let (newest, oldest, step) = (
            self.window_of(now),
            self.expire_before(now),
            self.segment_ms,
        );
        (0..)
            .map(move |i| newest - i * step)
            .take_while(move |w| *w >= oldest)
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

/// The operator (one instance per task): the step's settings, the tasks
/// whose call is under way, and two parts of its own — hard-quota
/// [`Admission`] and the [`call::Holds`] of jobs whose model cannot answer.
pub struct LlmProcessor {
    step: LlmStep,
    completed_store: String,
    /// Tasks with a call under way (by tenant and idempotency key) →
    /// redeliveries of them waiting for its result.
    in_flight: HashMap<String, Vec<(InFlight, Headers)>>,
    /// Hard-quota reservations and the tasks waiting for them.
    admission: Admission,
    /// Jobs held back while their model cannot answer.
    holds: call::Holds,
    /// The task this processor runs in (known from `init`).
    task: Option<sluice_topology::TaskId>,
    /// Token and cost series per model, resolved on first use.
    counters: HashMap<String, metrics::ModelCounters>,
    /// The idempotency store's windows.
    windows: IdempotencyWindows,
}

/// Hard-quota admission of this task's calls: what the calls under way
/// reserved (see [`QuotaGate`]) and the tasks waiting for their tenant's
/// reservations to settle.
#[derive(Default)]
struct Admission {
    /// Hard-quota reservations of the calls under way, per tenant.
    reservations: Reservations,
    /// The reservation of each task under way (by in-flight key).
    reserved: HashMap<String, (String, Amount)>,
    /// Tasks of hard-quota tenants waiting for their tenant's reservations
    /// out to settle, in arrival order (their records held).
    waiting: Vec<Item>,
}

impl Admission {
    /// Whether a task of `tenant` waits already (a later one waits behind
    /// it, in order).
    fn has_waiting(&self, tenant: &str) -> bool {
        self.waiting
            .iter()
            .any(|w| w.routed.task.tenant() == tenant)
    }

    /// Notes the reservation of the task under way under `flight`.
    fn note(&mut self, flight: String, tenant: String, amount: Amount) {
        self.reserved.insert(flight, (tenant, amount));
    }

    /// Releases the reservation of the task under `flight`, if it has one:
    /// whether it had.
    fn release(&mut self, flight: &str) -> bool {
        match self.reserved.remove(flight) {
            Some((tenant, amount)) => {
                self.reservations.release(&tenant, amount);
                true
            }
            None => false,
        }
    }
}

fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

impl LlmProcessor {
    /// An instance of `step`.
    pub fn new(step: LlmStep) -> Self {
        LlmProcessor {
            completed_store: step.completed_store(),
            windows: step.idempotency_windows(),
            step,
            in_flight: Default::default(),
            admission: Admission::default(),
            holds: call::Holds::default(),
            task: None,
            counters: Default::default(),
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
        if let Some(stored) = self.stored_outcome(ctx, &key)? {
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
        // What earlier attempts were billed without an answer: on this
        // attempt's result, whatever it is.
        let billed = billed_before(&item.headers);
        let mut request = match self.step.0.prompts.build_request(env) {
            Ok(r) => r,
            Err(e) => {
                let why = Failure {
                    category: DlqCategory::BadRequest,
                    message: e.to_string(),
                    attempts: 0,
                    billed,
                };
                let model = item.task.model.clone();
                self.fail(ctx, &item.task, &item.headers, &model, why)?;
                return Ok(None);
            }
        };
        if request.completion_cap().is_none()
            && self
                .step
                .quota()
                .is_some_and(|g| g.is_hard(item.task.task.tenant()))
        {
            // A hard quota's worst case needs a cap: the model's own limit.
            let cap = self.step.settings().max_output_tokens.get(&item.task.model);
            request.max_tokens = Some(cap.copied().unwrap_or(DEFAULT_HARD_QUOTA_CAP));
        }
        let (extra, extra_cost_micros) = billed;
        let admitted = Item {
            routed: item.task,
            headers: item.headers,
            held: item.held,
            request,
            extra,
            extra_cost_micros,
        };
        // Behind tasks of its tenant that wait, it waits too, in order.
        let behind = self.admission.has_waiting(admitted.routed.task.tenant());
        let admission = match behind {
            true => QuotaDecision::Wait,
            false => self.reserve(ctx, &admitted)?,
        };
        match admission {
            QuotaDecision::Exceeded(exceeded) => {
                let billed = (admitted.extra, admitted.extra_cost_micros);
                self.reject(
                    ctx,
                    &admitted.routed,
                    &admitted.headers,
                    exceeded.message,
                    billed,
                )?;
                Ok(None)
            }
            QuotaDecision::Wait => {
                self.in_flight.insert(flight, Vec::new());
                self.admission.waiting.push(admitted);
                self.metrics().quota_waiting.inc();
                Ok(None)
            }
            QuotaDecision::Reserved | QuotaDecision::Unlimited => {
                self.in_flight.insert(flight, Vec::new());
                Ok(Some(admitted))
            }
        }
    }

    /// Asks the hard-quota gate for `item`'s call (its record current):
    /// reserved (and remembered under its in-flight key), wait, or refused.
    fn reserve(&mut self, ctx: &mut Ctx<'_>, item: &Item) -> Result<QuotaDecision, ProcessError> {
        let task = &item.routed.task;
        let Some(gate) = self
            .step
            .quota()
            .filter(|g| g.is_hard(task.tenant()))
            .cloned()
        else {
            // No worst case to work out for a tenant without a hard quota.
            return Ok(QuotaDecision::Unlimited);
        };
        let tenant = task.tenant().to_string();
        let worst = self.worst_case(&item.routed, &item.request);
        let admission = gate.reserve(
            ctx,
            &mut self.admission.reservations,
            &tenant,
            worst,
            now_ms(),
        )?;
        if admission == QuotaDecision::Reserved {
            let key = idempotency_key(&task.envelope.task_type, &task.envelope.task_id);
            self.metrics().reservations.inc();
            self.admission
                .note(in_flight_key(&tenant, &key), tenant, worst);
        }
        Ok(admission)
    }

    /// Asks again for the tasks waiting on their tenant's reservations
    /// (after calls settled, and on every punctuation: a new window frees
    /// its quota): each tenant's in arrival order, until one must wait
    /// again. Those reserved are called, one call each; those that no
    /// longer fit are refused.
    fn admit_waiting(&mut self, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        if self.admission.waiting.is_empty() {
            return Ok(());
        }
        let before = self.admission.waiting.len() as i64;
        let mut blocked: HashSet<String> = HashSet::new();
        let mut ready = Vec::new();
        for item in std::mem::take(&mut self.admission.waiting) {
            let tenant = item.routed.task.tenant().to_string();
            if blocked.contains(&tenant) {
                self.admission.waiting.push(item);
                continue;
            }
            let held = item.held.clone();
            ctx.with_record(&held, |ctx| {
                match self.reserve(ctx, &item)? {
                    QuotaDecision::Reserved | QuotaDecision::Unlimited => ready.push(item),
                    QuotaDecision::Wait => {
                        blocked.insert(tenant);
                        self.admission.waiting.push(item);
                    }
                    QuotaDecision::Exceeded(exceeded) => {
                        let billed = (item.extra, item.extra_cost_micros);
                        self.reject(ctx, &item.routed, &item.headers, exceeded.message, billed)?;
                    }
                }
                Ok::<_, ProcessError>(())
            })?;
        }
        self.metrics()
            .quota_waiting
            .sub(before - self.admission.waiting.len() as i64);
        for item in ready {
            self.start(ctx, vec![item], None);
        }
        Ok(())
    }

    /// A call's worst case: a true upper bound of its prompt tokens (see
    /// [`ChatRequest::prompt_token_bound`]) plus its completion cap, priced
    /// at the dearest rates of the models it may end on (its own and its
    /// fallbacks).
    fn worst_case(&self, routed: &Routed, request: &ChatRequest) -> Amount {
        let output = u64::from(request.completion_cap().unwrap_or(DEFAULT_HARD_QUOTA_CAP));
        let prompt = request.prompt_token_bound();
        let prices = &self.step.settings().prices;
        let fallbacks = &self.step.settings().fallbacks;
        let mut dearest = Price::new(0, 0);
        let mut model = Some(routed.model.as_str());
        let mut seen = HashSet::new();
        while let Some(m) = model.filter(|m| seen.insert(*m)) {
            if let Some(p) = prices.get(m) {
                dearest = dearest.dearest(p);
            }
            model = fallbacks.get(m).map(String::as_str);
        }
        Amount {
            tokens: prompt + output,
            cost_micros: dearest.bound_micros(prompt, output),
        }
    }

    /// A task a hard quota refuses: a failed result `quota_exceeded` (no
    /// further call, no dead letter) carrying what its earlier calls were
    /// billed (`billed`: usage and cost, spent already). Its record is
    /// current.
    fn reject(
        &mut self,
        ctx: &mut Ctx<'_>,
        routed: &Routed,
        headers: &Headers,
        message: String,
        (usage, cost_micros): (Usage, i64),
    ) -> Result<(), ProcessError> {
        self.metrics().quota_rejections.inc();
        let mut r = self.base_result(routed, &routed.model, false);
        self.bill(&mut r, usage, cost_micros);
        r.error_code = Some(QUOTA_EXCEEDED.to_string());
        r.error_message = Some(message);
        self.emit_result(ctx, headers, r, routed.task.envelope.submitted_at)
    }

    /// A task's call is over: its reservation is released (the accountant
    /// settles its real usage as its result passes, in this same step) and
    /// the redeliveries that waited for it are returned.
    fn end_flight(&mut self, flight: &str) -> Vec<(InFlight, Headers)> {
        if self.admission.release(flight) {
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
        submitted_at: DateTime<Utc>,
    ) -> Result<(), ProcessError> {
        let json = serde_json::to_vec(&result)
            .map_err(|e| ProcessError::Fatal(format!("result encoding: {e}")))?;
        let key = idempotency_key(&result.task_type, &result.task_id);
        let success = result.success;
        ctx.window::<String, StoredOutcome>(&self.completed_store)?
            .put(
                &key,
                self.windows.window_of(now_ms()),
                &StoredOutcome {
                    result_json: json,
                    success,
                },
            );
        self.metrics().result(success).inc();
        // The user-visible latency: from the producer's submittedAt (a clock
        // behind ours counts as no time, not as negative).
        let latency = (result.completed_at - submitted_at)
            .num_milliseconds()
            .max(0);
        self.metrics()
            .task_latency
            .with_label_values(&[result.task_type.as_str()])
            .observe(latency as f64 / 1000.0);
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
        self.emit_result(ctx, headers, r, routed.task.envelope.submitted_at)
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

    /// A task's latest outcome in the idempotency store (the newest window
    /// holding one).
    fn stored_outcome(
        &self,
        ctx: &mut Ctx<'_>,
        key: &String,
    ) -> Result<Option<StoredOutcome>, ProcessError> {
        let store = ctx.window::<String, StoredOutcome>(&self.completed_store)?;
        for window in self.windows.live(now_ms()) {
            if let Some(found) = store.get(key, window)? {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    /// Drops the idempotency windows whose outcomes are all past their time
    /// (a no-op until a window's time comes).
    fn expire(&mut self, ctx: &mut Ctx<'_>, now: i64) -> Result<(), ProcessError> {
        ctx.window::<String, StoredOutcome>(&self.completed_store)?
            .expire_before(self.windows.expire_before(now))
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
        self.metrics()
            .reservations
            .sub(self.admission.reserved.len() as i64);
        self.metrics()
            .quota_waiting
            .sub(self.admission.waiting.len() as i64);
        self.metrics().parked.sub(self.holds.parked_counted);
    }
}

impl<K: Data, V: LlmInput> Processor<K, V> for LlmProcessor {
    type OutKey = String;
    type OutValue = TaskResult;
    type Output = CallDone;

    fn init(&mut self, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        self.task = Some(ctx.task_id());
        self.expire(ctx, now_ms())
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
        self.finish(ctx, done)?;
        self.admit_waiting(ctx)
    }

    fn punctuate(&mut self, time: Punctuation, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        self.admit_waiting(ctx)?;
        self.probe_held(ctx, time.wall_clock_ms);
        self.decide_refused(ctx)?;
        self.expire(ctx, time.wall_clock_ms)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_outcomes_encode_their_json_as_one_byte_string() {
        /// The encoding of a plain byte vector.
        #[derive(Serialize)]
        struct Plain {
            result_json: Vec<u8>,
            success: bool,
        }
        let json = br#"{"taskId":"t1","success":true}"#.to_vec();
        let now = StoredOutcome {
            result_json: json.clone(),
            success: true,
        };
        let bytes = sluice_topology::to_bincode(&now);
        let plain = Plain {
            result_json: json.clone(),
            success: true,
        };
        assert_eq!(bytes, sluice_topology::to_bincode(&plain));
        let back: StoredOutcome = sluice_topology::from_bincode(&bytes).unwrap();
        assert_eq!(back.result_json, json);
        assert!(back.success);
    }

    #[test]
    fn idempotency_windows_keep_an_outcome_its_time_to_live_and_at_most_a_segment_more() {
        const DAY: i64 = 24 * 60 * MINUTE_MS;
        let w = IdempotencyWindows::new(7 * DAY);
        assert_eq!(w.segment_ms, DAY);
        let written = 100 * DAY + 12_345_678;
        let window = w.window_of(written);
        for later in [0, DAY, 7 * DAY - 1, 7 * DAY] {
            let now = written + later;
            assert!(w.expire_before(now) <= window, "dropped {later} ms later");
            assert!(
                w.live(now).any(|x| x == window),
                "not read {later} ms later"
            );
        }
        // Gone once its whole window is older than the time to live.
        let now = window + 8 * DAY;
        assert!(w.expire_before(now) > window);
        assert!(w.live(now).all(|x| x != window));
        // A look-up reads at most nine windows, newest first.
        let live: Vec<i64> = w.live(written).collect();
        assert!(
            live.len() <= 9 && live.windows(2).all(|p| p[0] - p[1] == DAY),
            "{live:?}"
        );
        // A short time to live: windows of a minute.
        assert_eq!(IdempotencyWindows::new(1).segment_ms, MINUTE_MS);
    }

    /// A million outcomes written over two weeks at a steady rate: the
    /// store holds only the windows still live (dropped whole, a range
    /// delete each, whatever the rate), every outcome younger than the time
    /// to live is found, and none older than it plus a segment.
    #[test]
    fn a_million_outcomes_stay_bounded_by_their_windows() {
        use sluice_state::{RocksEnv, StoreKind, StoreSpec, TaskState};
        use sluice_topology::to_bincode;
        const DAY: i64 = 24 * 60 * MINUTE_MS;
        let w = IdempotencyWindows::new(7 * DAY);
        let dir = tempfile::tempdir().unwrap();
        let spec = StoreSpec {
            name: "outcomes".into(),
            kind: StoreKind::Window {
                retention_ms: 8 * DAY,
            },
            // Not restored from a changelog on reopening: what RocksDB kept.
            changelogged: false,
            cached: false,
        };
        let env = RocksEnv::new(Default::default());
        let mut st = TaskState::open(dir.path(), std::slice::from_ref(&spec), &env).unwrap();
        let id = st.store_id("outcomes").unwrap();
        let value = to_bincode(&StoredOutcome {
            result_json: b"{}".to_vec(),
            success: true,
        });
        let key = |minute: i64, j: i64| to_bincode(&format!("summarize/task-{minute}-{j}"));
        let (minutes, per_minute) = (14 * 24 * 60, 50);
        let start = 1_000 * DAY;
        for m in 0..minutes {
            let now = start + m * MINUTE_MS;
            for j in 0..per_minute {
                st.window_put(id, &key(m, j), w.window_of(now), &value);
            }
            if m % 10 == 9 {
                st.expire_windows(id, w.expire_before(now)).unwrap();
                st.flush_changelog();
                st.commit_local(&HashMap::new()).unwrap();
            }
        }
        assert_eq!(minutes * per_minute, 1_008_000);
        let now = start + (minutes - 1) * MINUTE_MS;
        drop(st);
        // Reopened: what RocksDB itself holds.
        let st = TaskState::open(dir.path(), &[spec], &env).unwrap();
        let oldest = w.expire_before(now);
        assert!(st.window_range(id, i64::MIN, oldest).unwrap().is_empty());
        let held: usize = w
            .live(now)
            .map(|x| st.window_range(id, x, x + w.segment_ms).unwrap().len())
            .sum();
        let expected = (0..minutes)
            .filter(|m| w.window_of(start + m * MINUTE_MS) >= oldest)
            .count() as i64
            * per_minute;
        assert_eq!(held as i64, expected);
        assert!(held as i64 <= 8 * 24 * 60 * per_minute, "{held}");
        // Look-ups as the operator makes them: newest window first.
        let find = |m: i64| {
            w.live(now)
                .find(|x| st.window_get(id, &key(m, 7), *x).unwrap().is_some())
                .is_some()
        };
        let age = |m: i64| now - (start + m * MINUTE_MS);
        let young = (0..minutes).rev().take_while(|m| age(*m) < 7 * DAY);
        assert!(young.clone().count() > 9_000);
        assert!(
            young.step_by(97).all(find),
            "an outcome younger than the TTL lost"
        );
        let old = (0..minutes).filter(|m| age(*m) >= 8 * DAY);
        assert!(old.clone().count() > 8_000);
        assert!(
            !old.step_by(97).any(find),
            "an outcome past TTL + segment kept"
        );
    }
}
