//! A submission's body, checked field by field, into a task envelope.

use std::collections::BTreeMap;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::envelope::{Priority, TaskEnvelope, TaskPayload, TenantRules};
use crate::http::auth::Scope;

/// Longest task id a caller may choose.
pub const MAX_TASK_ID: usize = 128;
/// Longest `Idempotency-Key`.
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

/// Why a submission is refused before anything is published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invalid {
    /// 400: a field is missing or wrong (`field` names it).
    Field {
        /// The field's path, e.g. `payload.content` or `tasks[2].taskType`.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// 403: the body names a tenant the token does not submit for.
    Forbidden(String),
    /// 413: the task is larger than `[tasks] max_bytes`.
    TooLarge(String),
}

impl Invalid {
    fn field(field: impl Into<String>, reason: impl Into<String>) -> Invalid {
        Invalid::Field {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The same refusal for the task at `prefix` of a batch.
    pub fn within(self, prefix: &str) -> Invalid {
        match self {
            Invalid::Field { field, reason } => Invalid::Field {
                field: format!("{prefix}.{field}"),
                reason,
            },
            other => other,
        }
    }
}

/// What a submission must satisfy.
#[derive(Clone, Debug)]
pub struct SubmitRules {
    /// The configured task types.
    pub task_types: Vec<String>,
    /// What a tenant id must be.
    pub tenants: TenantRules,
    /// Largest task record, bytes (`[tasks] max_bytes`).
    pub max_task_bytes: usize,
}

/// Where the task id comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IdSource {
    /// Chosen by the caller (`taskId`, or derived from `Idempotency-Key`):
    /// a task of this id may exist already, and is then not published again.
    Caller(String),
    /// Fresh: nobody else has it.
    Fresh(String),
}

impl IdSource {
    /// The id.
    pub fn id(&self) -> &str {
        match self {
            IdSource::Caller(id) | IdSource::Fresh(id) => id,
        }
    }
}

/// A checked submission.
#[derive(Clone, Debug)]
pub struct Submission {
    /// The task as it is published.
    pub envelope: TaskEnvelope,
    /// Its normalised tenant.
    pub tenant: String,
    /// Where its id came from.
    pub id: IdSource,
    /// The record value.
    pub bytes: Vec<u8>,
}

/// The task id an `Idempotency-Key` of `tenant` maps to: the same on every
/// gateway instance, distinct per tenant.
pub fn idempotent_id(tenant: &str, key: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"sluice-idempotency-key\0");
    h.update(tenant.as_bytes());
    h.update(b"\0");
    h.update(key.as_bytes());
    let hex: String = h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("idem-{hex}")
}

/// Checks an `Idempotency-Key` header value.
pub fn check_idempotency_key(key: &str) -> Result<(), Invalid> {
    let ends_visible = key.starts_with(|c: char| c.is_ascii_graphic())
        && key.ends_with(|c: char| c.is_ascii_graphic());
    if key.len() > MAX_IDEMPOTENCY_KEY
        || !ends_visible
        || !key.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
    {
        return Err(Invalid::field(
            "Idempotency-Key",
            format!(
                "must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters, not starting \
                 or ending with a space"
            ),
        ));
    }
    Ok(())
}

fn is_id_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "._:-".contains(c)
}

/// Fields the gateway fills in itself.
const FILLED: [&str; 3] = ["submittedAt", "attemptNumber", "notBefore"];
/// Fields a submission may carry.
const KNOWN: [&str; 7] = [
    "taskType",
    "taskId",
    "priority",
    "payload",
    "metadata",
    "requesterId",
    "tenantId",
];

/// Checks one task of a submission. `scope` is the caller's token's;
/// `idempotency_key` the request's (with a batch index appended).
pub fn check(
    value: &Value,
    scope: &Scope,
    idempotency_key: Option<&str>,
    rules: &SubmitRules,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<Submission, Invalid> {
    let obj = value
        .as_object()
        .ok_or_else(|| Invalid::field("body", "must be a JSON object"))?;
    for key in obj.keys() {
        if FILLED.contains(&key.as_str()) {
            return Err(Invalid::field(key, "is set by the gateway"));
        }
        if !KNOWN.contains(&key.as_str()) {
            return Err(Invalid::field(key, "unknown field"));
        }
    }
    let task_type =
        string(obj, "taskType")?.ok_or_else(|| Invalid::field("taskType", "is required"))?;
    if !rules.task_types.contains(&task_type) {
        return Err(Invalid::field(
            "taskType",
            format!("must be one of {}", rules.task_types.join(", ")),
        ));
    }
    let tenant = tenant(obj, scope, rules)?;
    let id = match string(obj, "taskId")? {
        Some(id) => {
            // `.` and `..` would be dot segments of its status URL.
            if id.is_empty()
                || id.len() > MAX_TASK_ID
                || !id.chars().all(is_id_char)
                || id == "."
                || id == ".."
            {
                return Err(Invalid::field(
                    "taskId",
                    format!("must be 1 to {MAX_TASK_ID} of A-Z a-z 0-9 . _ : -, not . or .."),
                ));
            }
            IdSource::Caller(id)
        }
        None => match idempotency_key {
            Some(k) => IdSource::Caller(idempotent_id(&tenant, k)),
            // A version-4 id from the thread's CSPRNG (seeded from the
            // system's): `Uuid::new_v4` asks the kernel for every id, a
            // system call per accepted task.
            None => IdSource::Fresh(
                uuid::Builder::from_random_bytes(rand::random())
                    .into_uuid()
                    .to_string(),
            ),
        },
    };
    let priority = match string(obj, "priority")?.as_deref() {
        None | Some("normal") => Priority::Normal,
        Some("high") => Priority::High,
        Some("batch") => Priority::Batch,
        Some(_) => {
            return Err(Invalid::field(
                "priority",
                "must be one of high, normal, batch",
            ))
        }
    };
    let metadata = match obj.get("metadata") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(Invalid::field(format!("metadata.{k}"), "must be a string")),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(Invalid::field("metadata", "must be an object of strings")),
    };
    let requester_id = string(obj, "requesterId")?.unwrap_or_default();
    let payload = payload(obj.get("payload"), &task_type)?;
    let envelope = TaskEnvelope {
        task_id: id.id().to_string(),
        task_type,
        tenant_id: Some(tenant.clone()),
        requester_id,
        priority,
        submitted_at: now,
        attempt_number: 1,
        not_before: None,
        payload,
        metadata,
    };
    let bytes = serde_json::to_vec(&envelope)
        .map_err(|e| Invalid::field("body", format!("cannot be encoded: {e}")))?;
    if bytes.len() > rules.max_task_bytes {
        return Err(Invalid::TooLarge(format!(
            "the task is {} bytes, over the limit of {} ([tasks] max_bytes)",
            bytes.len(),
            rules.max_task_bytes
        )));
    }
    Ok(Submission {
        envelope,
        tenant,
        id,
        bytes,
    })
}

/// An optional string field.
fn string(obj: &Map<String, Value>, field: &str) -> Result<Option<String>, Invalid> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(Invalid::field(field, "must be a string")),
    }
}

/// The task's tenant: the token's, or for an admin token the body's.
fn tenant(obj: &Map<String, Value>, scope: &Scope, rules: &SubmitRules) -> Result<String, Invalid> {
    let named = string(obj, "tenantId")?;
    let tenant = match (scope, named) {
        (Scope::Tenant(own), None) => own.clone(),
        (Scope::Tenant(own), Some(t)) if crate::envelope::normalise_tenant(&t) == *own => {
            own.clone()
        }
        (Scope::Tenant(_), Some(_)) => {
            return Err(Invalid::Forbidden(
                "this token submits tasks of its own tenant only".into(),
            ))
        }
        (Scope::Admin, Some(t)) => t,
        (Scope::Admin, None) => {
            return Err(Invalid::field(
                "tenantId",
                "is required with an admin token (a tenant's token implies it)",
            ))
        }
    };
    rules
        .tenants
        .check(&tenant)
        .map_err(|e| Invalid::field("tenantId", format!("not an accepted tenant ({e})")))
}

/// The payload, checked for its task type's shape.
fn payload(value: Option<&Value>, task_type: &str) -> Result<TaskPayload, Invalid> {
    let obj = match value {
        Some(Value::Object(o)) => o,
        None | Some(Value::Null) => return Err(Invalid::field("payload", "is required")),
        Some(_) => return Err(Invalid::field("payload", "must be an object")),
    };
    match obj.get("content") {
        Some(Value::String(s)) if !s.trim().is_empty() => {}
        Some(Value::String(_)) => {
            return Err(Invalid::field("payload.content", "must not be empty"))
        }
        None | Some(Value::Null) => return Err(Invalid::field("payload.content", "is required")),
        Some(_) => return Err(Invalid::field("payload.content", "must be a string")),
    }
    if let Some(v) = obj.get("maxWords").filter(|v| !v.is_null()) {
        if !v
            .as_u64()
            .is_some_and(|n| (1..=u64::from(u32::MAX)).contains(&n))
        {
            return Err(Invalid::field(
                "payload.maxWords",
                "must be a positive integer",
            ));
        }
    }
    if let Some(v) = obj.get("complexity").filter(|v| !v.is_null()) {
        if !v.as_f64().is_some_and(|c| (0.0..=1.0).contains(&c)) {
            return Err(Invalid::field(
                "payload.complexity",
                "must be a number from 0 to 1",
            ));
        }
    }
    if let Some(v) = obj.get("model").filter(|v| !v.is_null()) {
        if !v.is_string() {
            return Err(Invalid::field("payload.model", "must be a string"));
        }
    }
    match obj.get("labels").filter(|v| !v.is_null()) {
        Some(Value::Array(labels))
            if !labels.is_empty()
                && labels
                    .iter()
                    .all(|l| l.as_str().is_some_and(|s| !s.trim().is_empty())) => {}
        Some(_) => {
            return Err(Invalid::field(
                "payload.labels",
                "must be a non-empty array of non-empty strings",
            ))
        }
        None if task_type == "classify" => {
            return Err(Invalid::field("payload.labels", "is required for classify"))
        }
        None => {}
    }
    match obj.get("schema").filter(|v| !v.is_null()) {
        Some(Value::Object(_)) => {}
        Some(_) => return Err(Invalid::field("payload.schema", "must be an object")),
        None if task_type == "extract" => {
            return Err(Invalid::field("payload.schema", "is required for extract"))
        }
        None => {}
    }
    serde_path_to_error::deserialize(Value::Object(obj.clone()))
        .map_err(|e| Invalid::field(format!("payload.{}", e.path()), e.inner().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rules() -> SubmitRules {
        SubmitRules {
            task_types: vec!["summarize".into(), "classify".into(), "extract".into()],
            tenants: TenantRules::default(),
            max_task_bytes: 2048,
        }
    }

    fn tenant(t: &str) -> Scope {
        Scope::Tenant(t.into())
    }

    fn field_of(r: Result<Submission, Invalid>) -> String {
        match r {
            Err(Invalid::Field { field, .. }) => field,
            other => panic!("expected a field error, got {other:?}"),
        }
    }

    #[test]
    fn a_good_task_gets_the_tokens_tenant_and_what_the_gateway_fills() {
        let now = chrono::Utc::now();
        let s = check(
            &json!({"taskType": "summarize", "payload": {"content": "hello", "maxWords": 20},
                    "metadata": {"trace": "t1"}}),
            &tenant("acme"),
            None,
            &rules(),
            now,
        )
        .unwrap();
        assert_eq!(s.tenant, "acme");
        assert_eq!(s.envelope.tenant_id.as_deref(), Some("acme"));
        assert_eq!(s.envelope.attempt_number, 1);
        assert_eq!(s.envelope.submitted_at, now);
        let IdSource::Fresh(id) = &s.id else {
            panic!("a fresh id: {:?}", s.id);
        };
        let uuid = uuid::Uuid::parse_str(id).unwrap();
        assert_eq!(
            (uuid.get_version(), uuid.get_variant()),
            (Some(uuid::Version::Random), uuid::Variant::RFC4122),
            "{id}"
        );
        let again = check(
            &json!({"taskType": "summarize", "payload": {"content": "hello"}}),
            &tenant("acme"),
            None,
            &rules(),
            now,
        )
        .unwrap();
        assert_ne!(again.id.id(), id, "each task its own id");
        let decoded = crate::envelope::decode_task(
            &s.bytes,
            &crate::envelope::EnvelopeLimits::default(),
            &rules().task_types,
        )
        .unwrap();
        assert_eq!(decoded, s.envelope, "the pipeline reads what was checked");
    }

    #[test]
    fn each_bad_field_is_named() {
        let r = rules();
        let t = tenant("acme");
        let at = chrono::Utc::now();
        let f = |v: Value| field_of(check(&v, &t, None, &r, at));
        assert_eq!(f(json!([])), "body");
        assert_eq!(f(json!({"payload": {"content": "x"}})), "taskType");
        assert_eq!(
            f(json!({"taskType": "poem", "payload": {"content": "x"}})),
            "taskType"
        );
        assert_eq!(f(json!({"taskType": "summarize"})), "payload");
        assert_eq!(
            f(json!({"taskType": "summarize", "payload": {}})),
            "payload.content"
        );
        assert_eq!(
            f(json!({"taskType": "summarize", "payload": {"content": 3}})),
            "payload.content"
        );
        assert_eq!(
            f(json!({"taskType": "summarize", "payload": {"content": "x", "maxWords": -1}})),
            "payload.maxWords"
        );
        assert_eq!(
            f(json!({"taskType": "classify", "payload": {"content": "x"}})),
            "payload.labels"
        );
        assert_eq!(
            f(json!({"taskType": "extract", "payload": {"content": "x", "schema": "s"}})),
            "payload.schema"
        );
        assert_eq!(
            f(json!({"taskType": "summarize", "priority": "urgent", "payload": {"content": "x"}})),
            "priority"
        );
        for bad in ["a b", ".", ".."] {
            assert_eq!(
                f(json!({"taskType": "summarize", "taskId": bad, "payload": {"content": "x"}})),
                "taskId"
            );
        }
        assert_eq!(
            f(json!({"taskType": "summarize", "attemptNumber": 3, "payload": {"content": "x"}})),
            "attemptNumber"
        );
        assert_eq!(
            f(json!({"taskType": "summarize", "metadata": {"a": 1}, "payload": {"content": "x"}})),
            "metadata.a"
        );
        assert_eq!(
            f(json!({"taskType": "summarize", "colour": 1, "payload": {"content": "x"}})),
            "colour"
        );
        let admin = check(
            &json!({"taskType": "summarize", "payload": {"content": "x"}}),
            &Scope::Admin,
            None,
            &r,
            at,
        );
        assert_eq!(field_of(admin), "tenantId");
    }

    #[test]
    fn a_tenant_token_submits_only_for_its_tenant() {
        let r = check(
            &json!({"taskType": "summarize", "tenantId": "globex", "payload": {"content": "x"}}),
            &tenant("acme"),
            None,
            &rules(),
            chrono::Utc::now(),
        );
        assert!(matches!(r, Err(Invalid::Forbidden(_))), "{r:?}");
        let own = check(
            &json!({"taskType": "summarize", "tenantId": " ACME", "payload": {"content": "x"}}),
            &tenant("acme"),
            None,
            &rules(),
            chrono::Utc::now(),
        );
        assert_eq!(own.unwrap().tenant, "acme");
    }

    #[test]
    fn an_oversized_task_is_too_large() {
        let r = check(
            &json!({"taskType": "summarize", "payload": {"content": "x".repeat(4096)}}),
            &tenant("acme"),
            None,
            &rules(),
            chrono::Utc::now(),
        );
        assert!(matches!(r, Err(Invalid::TooLarge(_))), "{r:?}");
    }

    #[test]
    fn an_idempotency_key_names_one_task_per_tenant() {
        let sub = |t: &str, key: &str| {
            check(
                &json!({"taskType": "summarize", "payload": {"content": "x"}}),
                &tenant(t),
                Some(key),
                &rules(),
                chrono::Utc::now(),
            )
            .unwrap()
            .id
        };
        assert_eq!(sub("acme", "k1"), sub("acme", "k1"));
        assert_ne!(sub("acme", "k1"), sub("acme", "k2"));
        assert_ne!(sub("acme", "k1"), sub("globex", "k1"));
        assert!(matches!(sub("acme", "k1"), IdSource::Caller(_)));
        assert!(check_idempotency_key("").is_err());
        assert!(check_idempotency_key("ok-key_1").is_ok());
        assert!(check_idempotency_key("bad\u{7f}").is_err());
        assert!(check_idempotency_key(" lead").is_err());
        assert!(check_idempotency_key("order 42").is_ok());
    }
}
