//! Task and result envelopes: the JSON wire types on the external topics, the
//! dead-letter categories and header names, and validated decoding of incoming tasks.
//!
//! Decoding never echoes prompt text: a [`PoisonError`] carries only a short machine-readable
//! reason (`missing_field:taskId`, `unknown_task_type:translate`, …) fit for a DLQ header.

mod decode;

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub use crate::llm::Priority;
pub use decode::{
    decode_task, normalise_tenant, EnvelopeLimits, PoisonError, TenantRules, DEFAULT_TENANT_PATTERN,
};

fn default_attempt() -> u32 {
    1
}

/// A task as published on `ai.tasks.<type>` (camelCase JSON, keyed by tenant id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskEnvelope {
    /// Idempotency key of the task.
    pub task_id: String,
    /// Task type, e.g. `summarize`; selects the prompt template.
    pub task_type: String,
    /// Owning tenant; when absent the requester is the tenant (see [`TaskEnvelope::tenant`]).
    /// [`decode_task`] fills it in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    /// The service or user that submitted the task.
    #[serde(default)]
    pub requester_id: String,
    /// Scheduling priority.
    #[serde(default)]
    pub priority: Priority,
    /// When the task was submitted: RFC 3339, or epoch milliseconds (what
    /// Jackson writes for an `Instant` without its ISO setting). Written back
    /// as RFC 3339.
    #[serde(deserialize_with = "submitted_at::deserialize")]
    pub submitted_at: DateTime<Utc>,
    /// 1-based attempt counter, incremented each time the task is re-published.
    #[serde(default = "default_attempt")]
    pub attempt_number: u32,
    /// A re-published attempt is not called before this time (its backoff);
    /// absent for a first attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<DateTime<Utc>>,
    /// Task-specific input.
    pub payload: TaskPayload,
    /// Free string map: trace context, correlation ids.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// `submittedAt` as either wire form.
mod submitted_at {
    use chrono::{DateTime, Utc};
    use serde::de::{self, Deserializer, Visitor};

    struct Either;

    impl Visitor<'_> for Either {
        type Value = DateTime<Utc>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an RFC 3339 timestamp or epoch milliseconds")
        }

        fn visit_i64<E: de::Error>(self, ms: i64) -> Result<Self::Value, E> {
            // Only the years RFC 3339 can write (0000 to 9999): the task is
            // written back in it when re-published, and must decode again
            // (tests/fuzz/regressions/task/epoch-ms-past-year-9999.json).
            const RFC3339_MS: std::ops::RangeInclusive<i64> =
                -62_167_219_200_000..=253_402_300_799_999;
            RFC3339_MS
                .contains(&ms)
                .then(|| DateTime::from_timestamp_millis(ms))
                .flatten()
                .ok_or_else(|| E::custom("epoch milliseconds out of range"))
        }

        fn visit_u64<E: de::Error>(self, ms: u64) -> Result<Self::Value, E> {
            let ms = i64::try_from(ms).map_err(|_| E::custom("epoch milliseconds out of range"))?;
            self.visit_i64(ms)
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
            DateTime::parse_from_rfc3339(s)
                .map(|t| t.with_timezone(&Utc))
                .map_err(E::custom)
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        d.deserialize_any(Either)
    }
}

/// `completedAt`: RFC 3339 read by chrono's strict parser first (the form
/// Sluice writes; several times faster than the relaxed one, which matters
/// where results are read back in bulk, as accounting does), then by the
/// relaxed parser `DateTime`'s own `Deserialize` uses, so every timestamp it
/// accepts still is.
mod completed_at {
    use chrono::{DateTime, FixedOffset, Utc};
    use serde::de::{self, Deserializer, Visitor};

    struct Rfc3339;

    impl Visitor<'_> for Rfc3339 {
        type Value = DateTime<Utc>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an RFC 3339 timestamp")
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
            DateTime::parse_from_rfc3339(s)
                .or_else(|_| s.parse::<DateTime<FixedOffset>>())
                .map(|t| t.with_timezone(&Utc))
                .map_err(E::custom)
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        d.deserialize_str(Rfc3339)
    }
}

impl TaskEnvelope {
    /// The tenant the task is accounted to: `tenantId`, else `requesterId`; `None` when both
    /// are empty.
    pub fn tenant(&self) -> Option<&str> {
        match self.tenant_id.as_deref() {
            Some(t) if !t.trim().is_empty() => Some(t),
            _ if !self.requester_id.trim().is_empty() => Some(&self.requester_id),
            _ => None,
        }
    }
}

/// The task-specific part of a [`TaskEnvelope`].
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskPayload {
    /// The text to work on (the user message).
    pub content: String,
    /// `summarize`: the word budget of the summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_words: Option<u32>,
    /// `classify`: the allowed labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<Vec<String>>,
    /// `extract`: the JSON schema of the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<serde_json::Value>,
    /// Caller's complexity hint in `0..=1`, used by the router.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub complexity: Option<f64>,
    /// Explicit model request, overriding routing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Any other payload fields, kept so nothing is lost on re-publish.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// The routing decision recorded in a result.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Route {
    /// The tier chosen (e.g. `small`, `large`, `fallback`).
    pub tier: String,
    /// Why (e.g. `complexity:0.82`, `explicit_model`, `budget_downgrade`).
    pub reason: String,
}

/// A task outcome on `ai.results.completed` / `ai.results.failed` (keyed by task id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskResult {
    /// The task's idempotency key.
    pub task_id: String,
    /// The task's type.
    pub task_type: String,
    /// The tenant the task was accounted to.
    pub tenant_id: String,
    /// Whether `output` holds an answer.
    pub success: bool,
    /// When processing finished.
    #[serde(deserialize_with = "completed_at::deserialize")]
    pub completed_at: DateTime<Utc>,
    /// Wall time spent processing, in milliseconds.
    pub processing_ms: u64,
    /// The model that answered (or was last tried).
    pub model: String,
    /// The routing decision.
    pub route: Route,
    /// Prompt tokens billed.
    pub input_tokens: u64,
    /// Completion tokens billed.
    pub output_tokens: u64,
    /// Prompt tokens served from the provider's cache (a subset of `input_tokens`).
    pub cached_tokens: u64,
    /// Cost in micro-dollars.
    pub cost_micros: i64,
    /// Provider calls made for this task, across re-publishes.
    pub attempts: u32,
    /// Set when the task was answered as part of a micro-batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<String>,
    /// The answer; `null` when failed.
    #[serde(default)]
    pub output: serde_json::Value,
    /// Machine-readable failure code (e.g. `quota_exceeded`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    /// Human-readable failure description (never the prompt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
    /// The task's `metadata` (correlation ids, trace context), carried over.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

impl TaskResult {
    /// Whether the result counts in its tenant's accounts: it was answered,
    /// or its calls were billed (a failed result carries what they were).
    pub fn accounted(&self) -> bool {
        self.success || self.input_tokens + self.output_tokens > 0 || self.cost_micros > 0
    }
}

/// Why a record went to the dead-letter topic (`dlq.category` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DlqCategory {
    /// Undecodable or invalid input.
    Poison,
    /// The provider rejected the request as malformed.
    BadRequest,
    /// The provider refused the content.
    ContentPolicy,
    /// The input exceeds the model's context.
    TooLarge,
    /// Transient failures outlasted every retry.
    Exhausted,
    /// The task's async call panicked (the engine dead-letters the records
    /// of such a call under this category).
    Panic,
}

impl DlqCategory {
    /// Every category.
    pub const ALL: [DlqCategory; 6] = [
        DlqCategory::Poison,
        DlqCategory::BadRequest,
        DlqCategory::ContentPolicy,
        DlqCategory::TooLarge,
        DlqCategory::Exhausted,
        DlqCategory::Panic,
    ];

    /// The header value and metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            DlqCategory::Poison => "poison",
            DlqCategory::BadRequest => "bad_request",
            DlqCategory::ContentPolicy => "content_policy",
            DlqCategory::TooLarge => "too_large",
            DlqCategory::Exhausted => "exhausted",
            DlqCategory::Panic => "panic",
        }
    }

    /// Parses a header value.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl std::fmt::Display for DlqCategory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Result header on a result given again to a redelivered task: the task's
/// one call was answered (and accounted) before.
pub const HEADER_DUPLICATE: &str = "sluice.duplicate";
/// Task header on a dead letter re-published by `sluice dlq replay`:
/// `<dead-letter topic>/<partition>/<offset>`. A replayed task whose id
/// already succeeded emits nothing (its result is out already), so
/// replaying twice never adds a second result.
pub const HEADER_REPLAY_OF: &str = "sluice.replay.of";
/// Task header on a re-published attempt whose earlier calls the provider
/// billed without an answer it could use (its shares of spoiled batches, a
/// withheld answer): `<prompt>,<completion>,<cached>,<cost micros>` and, when
/// there were some, `,<cache writes>`. The
/// attempt carries them into its result; `sluice dlq replay` drops it (the
/// dead letter's failed result billed them).
pub const HEADER_BILLED: &str = "sluice.billed";

/// `errorCode` of a task a hard quota refused.
pub const QUOTA_EXCEEDED: &str = "quota_exceeded";

/// Dead-letter header names; the engine writes them. Values never
/// contain prompt text or secrets.
pub use sluice_topology::dlq_headers;

/// A first-attempt task of `acme` for unit tests.
#[cfg(test)]
pub(crate) fn test_task(task_type: &str, payload: TaskPayload) -> TaskEnvelope {
    TaskEnvelope {
        task_id: "t1".into(),
        task_type: task_type.into(),
        tenant_id: Some("acme".into()),
        requester_id: "svc".into(),
        priority: Priority::Normal,
        submitted_at: "2024-05-01T10:00:00Z".parse().unwrap(),
        attempt_number: 1,
        not_before: None,
        payload,
        metadata: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_serializes_camel_case_and_skips_absent_batch() {
        let r = TaskResult {
            task_type: "summarize".into(),
            success: false,
            completed_at: "2024-05-01T10:00:00Z".parse().unwrap(),
            route: Route {
                tier: "small".into(),
                reason: "complexity:0.10".into(),
            },
            output_tokens: 0,
            attempts: 2,
            output: serde_json::Value::Null,
            error_code: Some("exhausted".into()),
            metadata: BTreeMap::from([("correlationId".into(), "c-7".into())]),
            ..result_fixture()
        };
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["metadata"]["correlationId"], "c-7");
        assert_eq!(v["taskId"], "t1");
        assert_eq!(v["costMicros"], 3);
        assert_eq!(v["route"]["tier"], "small");
        assert!(v["output"].is_null());
        assert!(v.get("batchId").is_none());
        assert_eq!(v["errorCode"], "exhausted");
        let back: TaskResult = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn result_completed_at_reads_every_form_the_relaxed_parser_accepts() {
        let at = |s: &str| {
            let mut v = serde_json::to_value(result_fixture()).unwrap();
            v["completedAt"] = s.into();
            serde_json::from_value::<TaskResult>(v).map(|r| r.completed_at)
        };
        let want: DateTime<Utc> = "2024-05-01T10:00:00.250Z".parse().unwrap();
        for form in [
            "2024-05-01T10:00:00.250Z",
            "2024-05-01T12:00:00.250+02:00",
            "2024-05-01 10:00:00.250Z",
            "2024-05-01t10:00:00.250z",
        ] {
            assert_eq!(at(form).unwrap(), want, "{form}");
        }
        assert!(at("2024-05-01").is_err());
        assert!(at("yesterday").is_err());
    }

    fn result_fixture() -> TaskResult {
        TaskResult {
            task_id: "t1".into(),
            task_type: "classify".into(),
            tenant_id: "acme".into(),
            success: true,
            completed_at: "2024-05-01T10:00:00.250Z".parse().unwrap(),
            processing_ms: 12,
            model: "small".into(),
            route: Route::default(),
            input_tokens: 10,
            output_tokens: 2,
            cached_tokens: 0,
            cost_micros: 3,
            attempts: 1,
            batch_id: None,
            output: serde_json::json!({ "label": "news" }),
            error_code: None,
            error_message: None,
            metadata: BTreeMap::new(),
        }
    }

    #[test]
    fn dlq_category_round_trips() {
        for c in DlqCategory::ALL {
            assert_eq!(DlqCategory::parse(c.as_str()), Some(c));
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
        assert_eq!(DlqCategory::parse("nope"), None);
    }

    #[test]
    fn priority_wire_names() {
        for p in Priority::ALL {
            assert_eq!(serde_json::to_value(p).unwrap(), p.as_str());
        }
        assert_eq!(Priority::default(), Priority::Normal);
    }
}
