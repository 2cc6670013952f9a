//! Provider calls of `invoke_llm`: starting them (alone or as a batch),
//! routing around open breakers, holding jobs while the provider cannot
//! answer, and turning outcomes into results.

use sluice_topology::{OutputRecord, ProcessError};

use super::output;
use super::trap::{self, Verdict};
use super::{idempotency_key, in_flight_key, now_ms, Ctx, Failure, Item, LlmProcessor};
use crate::accounting::Amount;
use crate::envelope::DlqCategory;
use crate::llm::apportion::apportion_batch_usage;
use crate::llm::prompt::{self, split_batch_answer, BatchSplitError};
use crate::llm::{
    CallFailure, CallOutcome, ChatRequest, ErrorClass, PermanentKind, ResponseFormat, Usage,
};

/// One provider call: a task, or a micro-batch of tasks.
pub(super) struct Job {
    items: Vec<Item>,
    /// The model called (a fallback replaces the routed one).
    model: String,
    batch: Option<BatchCall>,
    /// Set on a call that probes a held provider.
    pub(super) probe: bool,
}

/// A job refused with a `400`, waiting for its model's run of refusals to
/// decide (see [`trap`]).
pub(super) struct Refused {
    job: Job,
    /// The run it belongs to.
    epoch: u64,
    since_ms: i64,
    /// The error (the dead letter's reason if it comes to that).
    message: String,
    /// Attempts the call took.
    attempts: u32,
}

/// A batch's id and its one request.
struct BatchCall {
    id: String,
    request: ChatRequest,
    /// Batch-local item ids, in item order.
    ids: Vec<String>,
    /// Per item, the length of its own part of the prompt (the rest is
    /// shared): how the prompt tokens are split.
    own_prompt: Vec<u64>,
}

/// A task's share of a successful call.
struct Answer {
    usage: Usage,
    /// The task's share of a batch call's cost (shares sum to the call's
    /// cost); `None` for a call of its own (priced from its usage).
    cost_micros: Option<i64>,
    /// Attempts the call took.
    attempts: u32,
    /// The task's output, or the error code and message of an answer that
    /// cannot be one (a failed result, billed all the same).
    output: Result<serde_json::Value, (&'static str, String)>,
    batch_id: Option<String>,
}

/// What comes back from a call.
pub struct CallDone {
    job: Job,
    result: Result<CallOutcome, CallFailure>,
}

impl LlmProcessor {
    /// Starts the calls of admitted tasks: one call for a batch of several,
    /// else one each.
    pub(super) fn start(&mut self, ctx: &mut Ctx<'_>, items: Vec<Item>, batch_id: Option<String>) {
        let Some(first) = items.first() else { return };
        let model = first.routed.model.clone();
        let batch = match (batch_id, items.len()) {
            (Some(id), n) if n > 1 => self.batch_call(id, &items),
            _ => None,
        };
        match batch {
            Some(batch) => {
                let job = Job {
                    items,
                    model,
                    batch: Some(batch),
                    probe: false,
                };
                self.start_call(ctx, job);
            }
            None => self.call_singly(ctx, items, model),
        }
    }

    /// The batch request of `items`, or `None` when they cannot share one.
    fn batch_call(&self, id: String, items: &[Item]) -> Option<BatchCall> {
        let ids = prompt::batch_item_ids(items.len());
        let pairs: Vec<(String, &crate::envelope::TaskEnvelope)> = ids
            .iter()
            .cloned()
            .zip(items.iter().map(|i| &i.routed.task.envelope))
            .collect();
        let prompts = &self.step.0.prompts;
        let built = prompts.build_batch(&pairs).ok()?;
        // Each item's cap and its JSON wrapper, within what the model can
        // answer at once (the batcher sizes batches to fit; this is the
        // bound whatever assembled the batch).
        let summed = items
            .iter()
            .map(|i| prompts.batch_item_cap(&i.routed.task.envelope.task_type))
            .fold(0u32, u32::saturating_add);
        let limit = self
            .step
            .0
            .client
            .endpoint(&items[0].routed.model)
            .map_or(u32::MAX, |ep| ep.max_output_tokens);
        let max_tokens = Some(summed.min(limit));
        Some(BatchCall {
            id,
            request: ChatRequest {
                model: String::new(),
                messages: built.messages,
                max_tokens,
                max_completion_tokens: None,
                temperature: items[0].request.temperature,
                response_format: Some(ResponseFormat::JsonObject),
            },
            ids,
            own_prompt: built.own_chars.iter().map(|c| *c as u64).collect(),
        })
    }

    /// A call per task.
    fn call_singly(&mut self, ctx: &mut Ctx<'_>, items: Vec<Item>, model: String) {
        for item in items {
            let job = Job {
                items: vec![item],
                model: model.clone(),
                batch: None,
                probe: false,
            };
            self.start_call(ctx, job);
        }
    }

    /// Starts (or restarts) a job's call: on its routed model again once that
    /// model's breaker closed (a job moved to a fallback returns), around an
    /// open breaker to a fallback, else held.
    pub(super) fn start_call(&mut self, ctx: &mut Ctx<'_>, mut job: Job) {
        let client = &self.step.0.client;
        let routed = &job.items[0].routed.model;
        if job.model != *routed && !client.is_open(routed) {
            job.model = routed.clone();
        }
        if !job.probe && client.is_open(&job.model) {
            match self.reroute(ctx, job) {
                Some(j) => job = j,
                None => return,
            }
        }
        if !job.probe {
            let runs = &self.step.0.bad_requests;
            if let Some(message) = runs.trapped(&job.model) {
                let (fault, detail) = runs.fault(&job.model, &message);
                self.hold(ctx, &fault, &detail, job);
                return;
            }
        }
        self.spawn_call(ctx, job);
    }

    /// Moves a job whose model cannot take it to the first fallback whose
    /// breaker is closed; without one, holds it (`None`).
    fn reroute(&mut self, ctx: &mut Ctx<'_>, mut job: Job) -> Option<Job> {
        let client = &self.step.0.client;
        let fallbacks = &self.step.settings().fallbacks;
        let Some(fallback) = crate::route::fallback(fallbacks, &job.model, |m| client.is_open(m))
            .map(str::to_string)
        else {
            let fault = format!("breaker:{}", job.model);
            self.hold(ctx, &fault, "circuit open and no fallback model", job);
            return None;
        };
        self.metrics()
            .fallbacks
            .with_label_values(&[&job.model])
            .inc_by(job.items.len() as u64);
        job.model = fallback;
        Some(job)
    }

    fn spawn_call(&mut self, ctx: &mut Ctx<'_>, job: Job) {
        let client = self.step.0.client.clone();
        let request = match &job.batch {
            Some(b) => b.request.clone(),
            None => job.items[0].request.clone(),
        };
        let priority = job
            .items
            .iter()
            .map(|i| i.routed.task.envelope.priority)
            .min()
            .unwrap_or_default();
        ctx.spawn_detached(async move {
            let result = client.call(&job.model, request, priority).await;
            CallDone { job, result }
        });
    }

    /// Raises `fault` for this task (holding intake) and parks the job
    /// until a probe finds the provider answering again.
    fn hold(&mut self, ctx: &Ctx<'_>, fault: &str, detail: &str, job: Job) {
        self.step.0.health.raise(ctx.task_id(), fault, detail);
        self.faulted.insert(job.model.clone());
        self.parked.push(job);
        self.count_parked();
    }

    pub(super) fn count_parked(&self) {
        let n: usize = self.parked.iter().map(|j| j.items.len()).sum();
        self.metrics().parked.set(n as i64);
    }

    /// Handles a call's outcome.
    pub(super) fn finish(&mut self, ctx: &mut Ctx<'_>, done: CallDone) -> Result<(), ProcessError> {
        let CallDone { mut job, result } = done;
        let was_probe = std::mem::take(&mut job.probe);
        if was_probe {
            self.probing = false;
        }
        let failure = match result {
            Ok(outcome) => {
                if self.step.0.bad_requests.enabled() {
                    self.step.0.bad_requests.answered(&job.model);
                }
                if was_probe || self.faulted.contains(&job.model) {
                    self.recovered(ctx, &job.model);
                }
                return self.answered(ctx, job, outcome);
            }
            Err(failure) => failure,
        };
        match failure.class() {
            ErrorClass::Permanent(kind) => {
                let step = self.step.clone();
                let runs = &step.0.bad_requests;
                let message = failure.error.to_string();
                let attempts = failure.attempts.max(1);
                if kind == PermanentKind::BadRequest && job.batch.is_none() && runs.enabled() {
                    // Not dead-lettered yet: the model's run of refusals
                    // decides (see `trap`).
                    // The same refusal: the same status, code and message.
                    // (A message many tasks share quotes none of them: it
                    // may be shown.)
                    let answer = match failure.error.provider_message() {
                        Some(said) => format!("{message}: {said}"),
                        None => message.clone(),
                    };
                    let (epoch, trapped) = runs.refused(&job.model, &answer);
                    if trapped {
                        let (fault, detail) = runs.fault(&job.model, &answer);
                        self.hold(ctx, &fault, &detail, job);
                        return self.decide_refused(ctx);
                    }
                    if was_probe {
                        self.recovered(ctx, &job.model);
                    }
                    self.refused.push(Refused {
                        job,
                        epoch,
                        since_ms: now_ms(),
                        message,
                        attempts,
                    });
                    return Ok(());
                }
                if kind != PermanentKind::BadRequest && runs.enabled() {
                    // Another refusal ends the run (a batch's 400 neither
                    // counts nor ends it: its tasks are called alone next).
                    runs.answered(&job.model);
                }
                if was_probe {
                    self.recovered(ctx, &job.model);
                }
                if job.batch.is_some() {
                    // Which task the provider refused is unknown: each gets a
                    // call of its own, so only that one fails.
                    self.metrics().batch_fallbacks.inc();
                    let model = job.model.clone();
                    self.call_singly(ctx, job.items, model);
                    return Ok(());
                }
                self.fail_job(ctx, job, kind.dlq_category(), &message, attempts)
            }
            ErrorClass::Config => {
                let fault = format!("provider:{}", job.model);
                self.hold(ctx, &fault, &failure.error.to_string(), job);
                Ok(())
            }
            ErrorClass::CircuitOpen => {
                // Refused without a call: open, or half-open with every probe
                // slot taken. Not the same model again at once (that would spin
                // while the probes run): a fallback, else held for a probe.
                if let Some(job) = self.reroute(ctx, job) {
                    self.spawn_call(ctx, job);
                }
                Ok(())
            }
            ErrorClass::RateLimited { retry_after } => {
                // Rate limiting is never a task failure: the job waits,
                // intake held, until the time the provider gave (a
                // Retry-After longer than a call may wait: Azure's 30-60 s,
                // a daily quota), then a probe tries again.
                let wait = retry_after.map_or(0, |d| d.as_millis() as i64);
                self.probe_not_before_ms = self.probe_not_before_ms.max(now_ms() + wait);
                let fault = format!("rate_limited:{}", job.model);
                let detail = "rate limited by the provider; waiting as told";
                self.hold(ctx, &fault, detail, job);
                Ok(())
            }
            ErrorClass::Transient | ErrorClass::Malformed => {
                if job.items.len() > 1 {
                    if let Some(batch) = &job.batch {
                        // A batch too large to answer in time (or at all):
                        // each half is asked on its own, down to single
                        // tasks, before any task spends an attempt.
                        tracing::debug!(batch = %batch.id, error = %failure.error, items = job.items.len(), "batch call failed; halving it");
                        self.metrics().batch_fallbacks.inc();
                        let id = batch.id.clone();
                        let mut first = job.items;
                        let second = first.split_off(first.len() / 2);
                        self.start(ctx, first, Some(format!("{id}.a")));
                        self.start(ctx, second, Some(format!("{id}.b")));
                        return Ok(());
                    }
                }
                let message = failure.error.to_string();
                let max_attempts = self.step.settings().max_attempts;
                for item in job.items {
                    let held = item.held.clone();
                    let attempt = item.routed.task.envelope.attempt_number;
                    ctx.with_record(&held, |ctx| {
                        if attempt < max_attempts {
                            self.republish(ctx, &item)
                        } else {
                            let why = Failure {
                                category: DlqCategory::Exhausted,
                                message: message.clone(),
                                attempts: attempt - 1 + failure.attempts.max(1),
                                billed: (item.extra, item.extra_cost_micros),
                            };
                            self.fail(ctx, &item.routed, &item.headers, &job.model, why)
                        }
                    })?;
                }
                Ok(())
            }
        }
    }

    /// A successful call: a result per task.
    fn answered(
        &mut self,
        ctx: &mut Ctx<'_>,
        mut job: Job,
        outcome: CallOutcome,
    ) -> Result<(), ProcessError> {
        let response = &outcome.response;
        let usage = response.usage;
        let content = &response.content;
        let Some(batch) = job.batch.take() else {
            let mut items = std::mem::take(&mut job.items);
            let Some(item) = items.pop() else {
                return Ok(());
            };
            let output = if let Some(refusal) = &response.refusal {
                Err((output::REFUSED, format!("the model declined: {refusal}")))
            } else if response.truncated() {
                Err((
                    output::TRUNCATED,
                    "the answer reached the completion token cap".to_string(),
                ))
            } else {
                output::task_output(&item.routed.task.envelope, output::Raw::Text(content))
                    .map_err(|m| (output::INVALID_OUTPUT, m))
            };
            let answer = Answer {
                usage,
                cost_micros: None,
                attempts: outcome.attempts,
                output,
                batch_id: None,
            };
            return self.succeed(ctx, &job.model, item, answer);
        };
        let own = &batch.own_prompt;
        let whole: usize = batch.request.messages.iter().map(|m| m.content.len()).sum();
        let shared = (whole as u64).saturating_sub(own.iter().sum());
        let price = self.price(&job.model);
        // A batch answer cut short or declined cannot be trusted item by
        // item: each task is asked alone.
        let split = if response.truncated() || response.refusal.is_some() {
            Err(BatchSplitError::NotJson)
        } else {
            split_batch_answer(content, &batch.ids)
        };
        match split {
            Ok(outputs) => {
                self.metrics()
                    .batch_calls_saved
                    .inc_by(job.items.len() as u64 - 1);
                // Completion tokens go by each item's answer.
                let answers: Vec<u64> = outputs
                    .iter()
                    .map(|(id, o)| (id.len() + o.to_string().len() + 16) as u64)
                    .collect();
                let shares = apportion_batch_usage(&usage, own, shared, Some(&answers));
                let costs = super::apportion_cost(&price, &shares);
                let items = std::mem::take(&mut job.items);
                for (((item, (_, output)), share), cost) in
                    items.into_iter().zip(outputs).zip(shares).zip(costs)
                {
                    let output =
                        output::task_output(&item.routed.task.envelope, output::Raw::Item(output))
                            .map_err(|m| (output::INVALID_OUTPUT, m));
                    let answer = Answer {
                        usage: share,
                        cost_micros: Some(cost),
                        attempts: outcome.attempts,
                        output,
                        batch_id: Some(batch.id.clone()),
                    };
                    self.succeed(ctx, &job.model, item, answer)?;
                }
                Ok(())
            }
            Err(e) => {
                // The answer cannot be split: a call per task. The tokens of
                // this call were billed all the same; each task carries its
                // share into its result.
                tracing::warn!(batch = %batch.id, error = %e, "batch answer unusable; calling per task");
                self.metrics().batch_fallbacks.inc();
                let shares = apportion_batch_usage(&usage, own, shared, None);
                let costs = super::apportion_cost(&price, &shares);
                let mut again = Vec::with_capacity(job.items.len());
                for ((mut item, share), cost) in job.items.into_iter().zip(shares).zip(costs) {
                    item.extra = add_usage(item.extra, share);
                    item.extra_cost_micros += cost;
                    if self.reserve_spoiled(ctx, &item, share, cost)? {
                        again.push(item);
                    }
                }
                let model = job.model.clone();
                self.call_singly(ctx, again, model);
                Ok(())
            }
        }
    }

    /// The price of `model` (zero when it has none).
    fn price(&self, model: &str) -> super::Price {
        self.step
            .settings()
            .prices
            .get(model)
            .copied()
            .unwrap_or_default()
    }

    /// A task of a hard-quota tenant called again after its batch's answer
    /// was unusable: its reservation grows by its share of the spoiled call
    /// (billed with its result), or, when that no longer fits the quota, it
    /// gets `quota_exceeded` (and the spoiled share is not billed to the
    /// tenant). `false` when refused.
    fn reserve_spoiled(
        &mut self,
        ctx: &mut Ctx<'_>,
        item: &Item,
        share: Usage,
        cost_micros: i64,
    ) -> Result<bool, ProcessError> {
        let env = &item.routed.task.envelope;
        let flight = in_flight_key(
            item.routed.task.tenant(),
            &idempotency_key(&env.task_type, &env.task_id),
        );
        let (Some(gate), Some((tenant, _))) = (
            self.step.quota().cloned(),
            self.reserved.get(&flight).cloned(),
        ) else {
            return Ok(true);
        };
        let grow = Amount {
            tokens: share.prompt_tokens + share.completion_tokens,
            cost_micros,
        };
        let held = item.held.clone();
        ctx.with_record(&held, |ctx| {
            match gate.reserve(ctx, &mut self.reservations, &tenant, grow, now_ms())? {
                Ok(_) => {
                    if let Some((_, a)) = self.reserved.get_mut(&flight) {
                        *a = a.plus(grow);
                    }
                    Ok(true)
                }
                Err(exceeded) => {
                    self.reject(ctx, &item.routed, &item.headers, exceeded.message)?;
                    Ok(false)
                }
            }
        })
    }

    /// Forwards a task's result for an answered call: completed, or failed
    /// when the answer cannot be its output; billed either way.
    fn succeed(
        &mut self,
        ctx: &mut Ctx<'_>,
        model: &str,
        item: Item,
        answer: Answer,
    ) -> Result<(), ProcessError> {
        let usage = add_usage(answer.usage, item.extra);
        let price = self.price(model);
        let own_cost = answer.cost_micros.unwrap_or_else(|| {
            let u = answer.usage;
            super::cost_micros(
                &price,
                u.prompt_tokens,
                u.cached_tokens.min(u.prompt_tokens),
                u.completion_tokens,
            )
        });
        let mut r = self.base_result(&item.routed, model, answer.output.is_ok());
        self.bill(&mut r, usage, own_cost + item.extra_cost_micros);
        r.attempts = item.routed.task.envelope.attempt_number - 1 + answer.attempts;
        match answer.output {
            Ok(output) => r.output = output,
            Err((code, message)) => {
                r.error_code = Some(code.to_string());
                r.error_message = Some(message);
            }
        }
        r.batch_id = answer.batch_id;
        let held = item.held.clone();
        ctx.with_record(&held, |ctx| self.emit_result(ctx, &item.headers, r))
    }

    /// `model` answered again: clear its faults and restart the jobs held
    /// for it or moved away from it (jobs held for other models wait for
    /// their own probe).
    fn recovered(&mut self, ctx: &mut Ctx<'_>, model: &str) {
        let health = &self.step.0.health;
        health.clear(&format!("provider:{model}"));
        health.clear(&format!("breaker:{model}"));
        health.clear(&format!("rate_limited:{model}"));
        health.clear(&trap::fault_name(model));
        self.faulted.remove(model);
        let (resume, keep): (Vec<Job>, Vec<Job>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|j| j.model == model || j.items[0].routed.model == model);
        self.parked = keep;
        self.count_parked();
        for job in resume {
            self.start_call(ctx, job);
        }
        // A hold needs a job here to probe it: with none left, this task's
        // holds go (a fault no task holds is cleared).
        if self.parked.is_empty() && !self.faulted.is_empty() {
            self.step.0.health.release(ctx.task_id());
            self.faulted.clear();
        }
    }

    /// Dead-letters every task of a job refused for good, with a failed
    /// result each.
    fn fail_job(
        &mut self,
        ctx: &mut Ctx<'_>,
        job: Job,
        category: DlqCategory,
        message: &str,
        attempts_used: u32,
    ) -> Result<(), ProcessError> {
        for item in job.items {
            let why = Failure {
                category,
                message: message.to_string(),
                attempts: item.routed.task.envelope.attempt_number - 1 + attempts_used,
                billed: (item.extra, item.extra_cost_micros),
            };
            let held = item.held.clone();
            ctx.with_record(&held, |ctx| {
                self.fail(ctx, &item.routed, &item.headers, &job.model, why)
            })?;
        }
        Ok(())
    }

    /// Settles the jobs refused with a `400` whose model's run decided:
    /// trapped → held with the model's fault; ended by another answer, or
    /// undecided past the wait → dead-lettered as `bad_request`.
    pub(super) fn decide_refused(&mut self, ctx: &mut Ctx<'_>) -> Result<(), ProcessError> {
        if self.refused.is_empty() {
            return Ok(());
        }
        let step = self.step.clone();
        let runs = &step.0.bad_requests;
        let wait = step.settings().bad_request_wait_ms as i64;
        let now = now_ms();
        for r in std::mem::take(&mut self.refused) {
            match runs.verdict(&r.job.model, r.epoch) {
                Verdict::Trapped => {
                    let answer = runs.trapped(&r.job.model).unwrap_or_default();
                    let (fault, detail) = runs.fault(&r.job.model, &answer);
                    self.hold(ctx, &fault, &detail, r.job);
                }
                Verdict::Open if now - r.since_ms < wait => self.refused.push(r),
                Verdict::Open | Verdict::Broken => {
                    let category = DlqCategory::BadRequest;
                    self.fail_job(ctx, r.job, category, &r.message, r.attempts)?;
                }
            }
        }
        Ok(())
    }

    /// Re-publishes a task to its topic with the next attempt number (its
    /// record current).
    fn republish(&mut self, ctx: &mut Ctx<'_>, item: &Item) -> Result<(), ProcessError> {
        let task = &item.routed.task;
        let mut envelope = task.envelope.clone();
        envelope.attempt_number += 1;
        let (base, max) = self.step.settings().retry_backoff;
        let wait = retry_backoff(envelope.attempt_number, base, max);
        envelope.not_before =
            Some(chrono::Utc::now() + chrono::TimeDelta::from_std(wait).unwrap_or_default());
        let value = serde_json::to_vec(&envelope)
            .map_err(|e| ProcessError::Fatal(format!("task encoding: {e}")))?;
        // To its own partition: the task stays with the task that owns its
        // tenant, whatever partitioner its producer used.
        ctx.emit(OutputRecord {
            topic: task.topic.clone(),
            partition: Some(ctx.task_id().partition),
            key: task.key.clone(),
            value: Some(value),
            timestamp: now_ms(),
            headers: item.headers.clone(),
        })?;
        self.metrics().republished.inc();
        // Redeliveries that waited on this attempt finish without a result of
        // their own: the re-published task produces the task's one result.
        let key = idempotency_key(&envelope.task_type, &envelope.task_id);
        self.end_flight(&in_flight_key(task.tenant(), &key));
        Ok(())
    }
}

fn add_usage(a: Usage, b: Usage) -> Usage {
    Usage {
        prompt_tokens: a.prompt_tokens + b.prompt_tokens,
        completion_tokens: a.completion_tokens + b.completion_tokens,
        cached_tokens: a.cached_tokens + b.cached_tokens,
    }
}

/// The backoff of re-published attempt `attempt` (2 for the first re-publish):
/// drawn uniformly from zero to `base × 2^(attempt − 2)`, at most `max` (full
/// jitter: re-published tasks of one failure spread out instead of coming
/// back together).
pub(crate) fn retry_backoff(
    attempt: u32,
    base: std::time::Duration,
    max: std::time::Duration,
) -> std::time::Duration {
    let doublings = attempt.saturating_sub(2).min(30);
    let ceiling = base.saturating_mul(1 << doublings).min(max);
    ceiling.mul_f64(rand::random::<f64>())
}
