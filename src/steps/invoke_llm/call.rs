//! Provider calls of `invoke_llm`: starting them (alone or as a batch),
//! routing around open breakers, holding jobs while the provider cannot
//! answer, and turning outcomes into results.

use std::collections::HashMap;

use sluice_topology::{OutputRecord, ProcessError};

use super::output;
use super::policy::{self, Action};
use super::trap::Verdict;
use super::{idempotency_key, in_flight_key, now_ms, Ctx, Failure, Item, LlmProcessor};
use crate::envelope::DlqCategory;
use crate::llm::{
    CallFailure, CallOutcome, ChatRequest, ErrorClass, PermanentKind, ResponseFormat, Usage,
};
use crate::steps::account::{Amount, QuotaDecision};
use crate::steps::invoke_llm::apportion::apportion_batch_usage;
use crate::steps::invoke_llm::prompt::{self, split_batch_answer, BatchSplitError};

/// One provider call: a task, or a micro-batch of tasks.
pub(super) struct Job {
    items: Vec<Item>,
    /// The model called (a fallback replaces the routed one).
    model: String,
    batch: Option<BatchCall>,
    /// On a call that probes a held model: that model.
    pub(super) probe: Option<String>,
    /// Refused with a `400` before: its refusal again, with the same
    /// message, is no new evidence that the model refuses every task.
    refused_before: bool,
}

/// The jobs this task holds back while their model cannot answer: parked
/// under a fault of their model (probed now and then), or refused with a
/// `400` and waiting for their model's run to decide (see [`super::trap`]).
#[derive(Default)]
pub(super) struct Holds {
    /// Jobs parked while their model is held.
    parked: Vec<Job>,
    /// Jobs refused with a `400`, waiting for their model's run to decide.
    refused: Vec<Refused>,
    /// Models this task holds jobs for (it raised or joined their faults),
    /// each probed on its own.
    held: HashMap<String, ModelHold>,
    /// Jobs parked, as last counted in the shared gauge.
    pub(super) parked_counted: i64,
}

impl Holds {
    /// Parks `job` under its model's hold.
    fn park(&mut self, job: Job) {
        self.held.entry(job.model.clone()).or_default();
        self.parked.push(job);
    }

    /// How the count of parked tasks changed since it was last taken (for
    /// the gauge every task shares).
    fn recount(&mut self) -> i64 {
        let n = self.parked.iter().map(|j| j.items.len()).sum::<usize>() as i64;
        let change = n - self.parked_counted;
        self.parked_counted = n;
        change
    }

    /// Takes the parked jobs held for `model` or moved away from it.
    fn take_jobs_of(&mut self, model: &str) -> Vec<Job> {
        let (taken, keep): (Vec<Job>, Vec<Job>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|j| j.model == model || j.items[0].routed.model == model);
        self.parked = keep;
        taken
    }

    /// The parked job to probe `model` with: one not refused yet when there
    /// is one (a second task refused alike confirms the fault, an answer
    /// ends it).
    fn take_probe(&mut self, model: &str) -> Option<Job> {
        let of_model = |j: &&Job| j.model == model;
        let fresh = self
            .parked
            .iter()
            .position(|j| of_model(&j) && !j.refused_before);
        let i = fresh.or_else(|| self.parked.iter().position(|j| of_model(&j)))?;
        Some(self.parked.remove(i))
    }

    /// Drops the holds of models this task holds no job of (parked or
    /// probing) and returns those models.
    fn drop_empty(&mut self) -> Vec<String> {
        let parked = &self.parked;
        let mut dropped = Vec::new();
        self.held.retain(|model, hold| {
            let keep = hold.probing || parked.iter().any(|j| j.model == *model);
            if !keep {
                dropped.push(model.clone());
            }
            keep
        });
        dropped
    }
}

/// A model this task holds jobs for, probed now and then.
#[derive(Debug, Default)]
pub(super) struct ModelHold {
    /// A probe of it is under way.
    probing: bool,
    last_probe_ms: i64,
}

/// A job refused with a `400`, waiting for its model's run of refusals to
/// decide (see [`super::trap`]).
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
    /// Completion tokens the answer is expected to take: the call's timeout
    /// grows by the time the model needs to write them.
    expected_output: u32,
}

impl BatchCall {
    /// The items' shares of the call's usage: prompt tokens by each item's
    /// own text and an equal part of the shared instructions; completion
    /// tokens by each item's answer (`answers`, their lengths) when there
    /// are answers, else as the prompt.
    fn shares(&self, usage: &Usage, answers: Option<&[u64]>) -> Vec<Usage> {
        let whole: usize = self.request.messages.iter().map(|m| m.content.len()).sum();
        let shared = (whole as u64).saturating_sub(self.own_prompt.iter().sum());
        apportion_batch_usage(usage, &self.own_prompt, shared, answers)
    }
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
                    probe: None,
                    refused_before: false,
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
            expected_output: items
                .iter()
                .map(|i| prompts.expected_item_output(&i.routed.task.envelope))
                .fold(0u32, u32::saturating_add),
        })
    }

    /// A call per task.
    fn call_singly(&mut self, ctx: &mut Ctx<'_>, items: Vec<Item>, model: String) {
        for item in items {
            let job = Job {
                items: vec![item],
                model: model.clone(),
                batch: None,
                probe: None,
                refused_before: false,
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
        if job.probe.is_none() && client.is_open(&job.model) {
            match self.reroute(ctx, job) {
                Some(j) => job = j,
                None => return,
            }
        }
        if job.probe.is_none() {
            let runs = &self.step.0.bad_requests;
            if let Some(message) = runs.trapped(&job.model) {
                let (fault, detail) = runs.fault(&job.model, &message);
                self.hold(ctx, &fault, &detail, job);
                return;
            }
            // Held by a fault (met here or by another task): parked without
            // a call until a probe finds the model answering.
            if let Some((fault, detail)) = self.step.0.health.holding(&job.model) {
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
        let Some(fallback) =
            crate::steps::route::fallback(fallbacks, &job.model, |m| client.is_open(m))
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
        let (request, expected) = match &job.batch {
            Some(b) => (b.request.clone(), b.expected_output),
            None => (job.items[0].request.clone(), 0),
        };
        let priority = job
            .items
            .iter()
            .map(|i| i.routed.task.envelope.priority)
            .min()
            .unwrap_or_default();
        ctx.spawn_detached(async move {
            let result = client
                .call_expecting(&job.model, request, priority, expected)
                .await;
            CallDone { job, result }
        });
    }

    /// Raises `fault` of the job's model for this task and parks the job
    /// (its records stay in flight) until a probe finds the model answering
    /// again. Only the model's jobs wait: the others go on.
    fn hold(&mut self, ctx: &Ctx<'_>, fault: &str, detail: &str, job: Job) {
        self.step
            .0
            .health
            .raise(ctx.task_id(), &job.model, fault, detail);
        self.holds.park(job);
        self.count_parked();
    }

    /// Counts this task's parked tasks into the gauge every task shares.
    fn count_parked(&mut self) {
        let change = self.holds.recount();
        self.metrics().parked.add(change);
    }

    /// Per held model: resumes its jobs when another task's probe cleared
    /// its fault, else probes it with one of its parked jobs, each model on
    /// its own schedule; lets go of models with no job left here.
    pub(super) fn probe_held(&mut self, ctx: &mut Ctx<'_>, now: i64) {
        let every = self.step.settings().probe_interval_ms as i64;
        let models: Vec<String> = self.holds.held.keys().cloned().collect();
        for model in models {
            let health = &self.step.0.health;
            if health.holding(&model).is_none()
                && self.step.0.bad_requests.trapped(&model).is_none()
            {
                self.resume(ctx, &model);
                continue;
            }
            let not_before = health.not_before(&model);
            let due = self.holds.held.get(&model).is_some_and(|hold| {
                !hold.probing && now - hold.last_probe_ms >= every && now >= not_before
            });
            if !due {
                continue;
            }
            let Some(mut job) = self.holds.take_probe(&model) else {
                continue;
            };
            if let Some(hold) = self.holds.held.get_mut(&model) {
                hold.last_probe_ms = now;
                hold.probing = true;
            }
            job.probe = Some(model);
            self.count_parked();
            self.start_call(ctx, job);
        }
        self.let_go_of_empty_holds(ctx);
    }

    /// Models this task holds no job of (parked or probing): their faults no
    /// longer count this task among their holders.
    fn let_go_of_empty_holds(&mut self, ctx: &Ctx<'_>) {
        for model in self.holds.drop_empty() {
            self.step.0.health.release_model(ctx.task_id(), &model);
        }
    }

    /// Handles a call's outcome.
    pub(super) fn finish(&mut self, ctx: &mut Ctx<'_>, done: CallDone) -> Result<(), ProcessError> {
        let CallDone { mut job, result } = done;
        let probed = job.probe.take();
        if let Some(hold) = probed.as_ref().and_then(|m| self.holds.held.get_mut(m)) {
            hold.probing = false;
        }
        let was_probe = probed.is_some();
        let failure = match result {
            Ok(outcome) => {
                if self.step.0.bad_requests.enabled() {
                    self.step.0.bad_requests.answered(&job.model);
                }
                if was_probe || self.holds.held.contains_key(&job.model) {
                    self.recovered(ctx, &job.model);
                }
                return self.answered(ctx, job, outcome);
            }
            Err(failure) => failure,
        };
        // An answer withheld by the provider's filter was billed: its tasks
        // carry the usage into their results, whatever comes next.
        if let Some(usage) = failure.error.billed() {
            let model = job.model.clone();
            job.items = self.carry_spoiled(ctx, job.items, &job.batch, &model, usage)?;
            if job.items.is_empty() {
                return Ok(());
            }
        }
        let runs = &self.step.0.bad_requests;
        let class = failure.class();
        let act = policy::action(class, job.batch.is_some(), runs.enabled());
        if let ErrorClass::Permanent(kind) = class {
            if act != Action::AwaitRun && kind != PermanentKind::BadRequest && runs.enabled() {
                // Another refusal ends the model's run of `400`s (a batch's
                // `400` neither counts nor ends it: its tasks are called
                // alone next).
                runs.answered(&job.model);
            }
            if act != Action::AwaitRun && was_probe {
                // The model answered (with the task's own refusal).
                self.recovered(ctx, &job.model);
            }
        }
        let message = failure.error.to_string();
        let attempts = failure.attempts.max(1);
        match act {
            Action::AwaitRun => {
                let said = failure.error.provider_message();
                self.await_run(ctx, job, (message, said, attempts), was_probe)
            }
            Action::CallEachAlone => {
                // Only the task the provider refused fails.
                self.metrics().batch_fallbacks.inc();
                let model = job.model.clone();
                self.call_singly(ctx, job.items, model);
                Ok(())
            }
            Action::DeadLetter(category) => self.fail_job(ctx, job, category, &message, attempts),
            Action::HoldModel { fault, not_before } => {
                // Never a task failure: the model's jobs wait (a rejected
                // key until fixed; a Retry-After longer than a call may wait,
                // Azure's 30-60 s or a daily quota, as long as told), then a
                // probe tries again.
                let fault = format!("{fault}:{}", job.model);
                let detail = match not_before {
                    Some(wait) => {
                        let until = now_ms() + wait.as_millis() as i64;
                        self.step.0.health.defer(&fault, &job.model, until);
                        "rate limited by the provider; waiting as told".to_string()
                    }
                    None => message,
                };
                self.hold(ctx, &fault, &detail, job);
                Ok(())
            }
            Action::Reroute => {
                // Refused without a call: open, or half-open with every probe
                // slot taken. Not the same model again at once (that would spin
                // while the probes run): a fallback, else held for a probe.
                if let Some(job) = self.reroute(ctx, job) {
                    self.spawn_call(ctx, job);
                }
                Ok(())
            }
            Action::Halve => {
                // A batch too large to answer in time (or at all): each half
                // is asked on its own, down to single tasks, before any task
                // spends an attempt.
                let id = job.batch.as_ref().map(|b| b.id.clone()).unwrap_or_default();
                tracing::debug!(batch = %id, error = %failure.error, items = job.items.len(), "batch call failed; halving it");
                self.metrics().batch_fallbacks.inc();
                let mut first = job.items;
                let second = first.split_off(first.len() / 2);
                self.start(ctx, first, Some(format!("{id}.a")));
                self.start(ctx, second, Some(format!("{id}.b")));
                Ok(())
            }
            Action::Republish => {
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
                                attempts: attempt - 1 + attempts,
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

    /// A task refused with a `400`: not dead-lettered yet, its model's run
    /// of refusals decides (see [`super::trap`]). The same refusal: the same status,
    /// code and message (a message many tasks share quotes none of them: it
    /// may be shown).
    fn await_run(
        &mut self,
        ctx: &mut Ctx<'_>,
        mut job: Job,
        (message, said, attempts): (String, Option<&str>, u32),
        was_probe: bool,
    ) -> Result<(), ProcessError> {
        let step = self.step.clone();
        let runs = &step.0.bad_requests;
        let answer = match said {
            Some(said) => format!("{message}: {said}"),
            None => message.clone(),
        };
        let refused = |job, epoch| Refused {
            job,
            epoch,
            since_ms: now_ms(),
            message: message.clone(),
            attempts,
        };
        if job.refused_before && runs.is_run_of(&job.model, &answer) {
            // The same task refused alike again: not counted (a model's bad
            // tasks would trap it again each time it recovered). The run
            // decides: the model answered another task since → its own
            // `400`, dead-lettered.
            let epoch = runs.epoch(&job.model);
            self.holds.refused.push(refused(job, epoch));
            return self.decide_refused(ctx);
        }
        job.refused_before = true;
        let (epoch, trapped) = runs.refused(&job.model, &answer);
        if trapped {
            let (fault, detail) = runs.fault(&job.model, &answer);
            self.hold(ctx, &fault, &detail, job);
            return self.decide_refused(ctx);
        }
        if was_probe {
            self.recovered(ctx, &job.model);
        }
        self.holds.refused.push(refused(job, epoch));
        Ok(())
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
            let prompts = &self.step.0.prompts;
            let env = &item.routed.task.envelope;
            if response.truncated() && response.refusal.is_none() {
                if let Some(larger) = prompts.retry_cap(&env.task_type, item.request.max_tokens) {
                    // Cut at the cap: asked once more with the template's
                    // larger cap; this call's tokens go on its result.
                    let model = job.model.clone();
                    let mut again = self.carry_spoiled(ctx, vec![item], &None, &model, usage)?;
                    if let Some(item) = again.first_mut() {
                        item.request.max_tokens = Some(larger);
                    }
                    self.metrics().truncation_retries.inc();
                    self.call_singly(ctx, again, model);
                    return Ok(());
                }
            }
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
                let shares = batch.shares(&usage, Some(&answers));
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
                let model = job.model.clone();
                let batch = Some(batch);
                let again = self.carry_spoiled(ctx, job.items, &batch, &model, usage)?;
                self.call_singly(ctx, again, model);
                Ok(())
            }
        }
    }

    /// The usage of a call whose answer none of its tasks can use (a batch's
    /// unsplittable answer, a withheld answer), billed to them: each task's
    /// share (a batch's prompt by each item's own text, the rest evenly) and
    /// its cost go with it into its result. Returns the tasks that go on (a
    /// hard-quota tenant's task whose share no longer fits its quota gets
    /// `quota_exceeded`).
    fn carry_spoiled(
        &mut self,
        ctx: &mut Ctx<'_>,
        items: Vec<Item>,
        batch: &Option<BatchCall>,
        model: &str,
        usage: Usage,
    ) -> Result<Vec<Item>, ProcessError> {
        let shares = match batch {
            Some(b) => b.shares(&usage, None),
            None => vec![usage],
        };
        let costs = super::apportion_cost(&self.price(model), &shares);
        let mut again = Vec::with_capacity(items.len());
        for ((mut item, share), cost) in items.into_iter().zip(shares).zip(costs) {
            item.extra = add_usage(item.extra, share);
            item.extra_cost_micros += cost;
            if self.reserve_spoiled(ctx, &item, share, cost)? {
                again.push(item);
            }
        }
        Ok(again)
    }

    /// The price of `model` (every model has one: the configuration
    /// requires it).
    fn price(&self, model: &str) -> super::Price {
        self.step
            .settings()
            .prices
            .get(model)
            .copied()
            .unwrap_or(super::Price::new(0, 0))
    }

    /// A task of a hard-quota tenant called again after its batch's answer
    /// was unusable: its reservation grows by its share of the spoiled call
    /// (billed with its result), or, when that no longer fits the quota, it
    /// gets `quota_exceeded`, carrying the shares it was billed (spent
    /// already, within the reservation of the call that spent them).
    /// `false` when refused.
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
            self.admission.reserved.get(&flight).cloned(),
        ) else {
            return Ok(true);
        };
        let grow = Amount {
            tokens: share.prompt_tokens + share.completion_tokens,
            cost_micros,
        };
        let held = item.held.clone();
        ctx.with_record(&held, |ctx| {
            match gate.reserve(ctx, &mut self.admission.reservations, &tenant, grow, now_ms())? {
                QuotaDecision::Reserved | QuotaDecision::Unlimited => {
                    if let Some((_, a)) = self.admission.reserved.get_mut(&flight) {
                        *a = a.plus(grow);
                    }
                    Ok(true)
                }
                // Spent already: growing it must fit now, not later.
                QuotaDecision::Wait => {
                    let message = "hard quota: the task's share of a spoiled batch call does not fit beside the reservations out".to_string();
                    let billed = (item.extra, item.extra_cost_micros);
                    self.reject(ctx, &item.routed, &item.headers, message, billed)?;
                    Ok(false)
                }
                QuotaDecision::Exceeded(exceeded) => {
                    let billed = (item.extra, item.extra_cost_micros);
                    self.reject(ctx, &item.routed, &item.headers, exceeded.message, billed)?;
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
            super::cost_micros(&price, &u)
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
        let submitted_at = item.routed.task.envelope.submitted_at;
        ctx.with_record(&held, |ctx| {
            self.emit_result(ctx, &item.headers, r, submitted_at)
        })
    }

    /// `model` answered again: clear its faults and restart the jobs held
    /// for it or moved away from it (jobs held for other models wait for
    /// their own probe).
    fn recovered(&mut self, ctx: &mut Ctx<'_>, model: &str) {
        self.step.0.health.clear_model(model);
        self.resume(ctx, model);
    }

    /// Restarts the jobs held for `model` or moved away from it (a job whose
    /// model is still held is parked again); a hold needs a job here to probe
    /// it, so the holds left without one go (a fault no task holds is
    /// cleared).
    fn resume(&mut self, ctx: &mut Ctx<'_>, model: &str) {
        let resume = self.holds.take_jobs_of(model);
        self.count_parked();
        for job in resume {
            self.start_call(ctx, job);
        }
        self.let_go_of_empty_holds(ctx);
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
        if self.holds.refused.is_empty() {
            return Ok(());
        }
        let step = self.step.clone();
        let runs = &step.0.bad_requests;
        let wait = step.settings().bad_request_wait_ms as i64;
        let now = now_ms();
        for r in std::mem::take(&mut self.holds.refused) {
            match runs.verdict(&r.job.model, r.epoch) {
                Verdict::Trapped => {
                    let answer = runs.trapped(&r.job.model).unwrap_or_default();
                    let (fault, detail) = runs.fault(&r.job.model, &answer);
                    self.hold(ctx, &fault, &detail, r.job);
                }
                Verdict::Open if now - r.since_ms < wait => self.holds.refused.push(r),
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
            // What the provider billed so far goes with the attempt.
            headers: super::with_billed(&item.headers, item.extra, item.extra_cost_micros),
        })?;
        self.metrics().republished.inc();
        // Redeliveries that waited on this attempt finish without a result of
        // their own: the re-published task produces the task's one result.
        let key = idempotency_key(&envelope.task_type, &envelope.task_id);
        self.end_flight(&in_flight_key(task.tenant(), &key));
        Ok(())
    }
}

fn add_usage(mut a: Usage, b: Usage) -> Usage {
    a.add(&b);
    a
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
