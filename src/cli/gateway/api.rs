//! The gateway's HTTP API (see `docs/gateway-openapi.yaml`).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{MatchedPath, Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus::{Encoder, TextEncoder};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sluice_topology::runtime::AppState;

use super::submit::{self, Invalid, Submission};
use super::{retry_after, Gateway, Refusal, NO_GRACE_HEADER, UNKNOWN_GRACE};
use crate::envelope::normalise_tenant;
use crate::http::auth::{Denied, Scope};

/// The page that submits a task and shows its result as it arrives.
const UI: &str = include_str!("ui.html");
/// What a path segment percent-encodes (as the URL standard's path
/// segment set does, and `?` and `#`).
const PATH_SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'`')
    .add(b'{')
    .add(b'}')
    .add(b'/')
    .add(b'%');

/// The router of one gateway instance.
pub(super) fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/", get(ui))
        .route("/v1/tasks", post(submit_one))
        .route("/v1/tasks:batch", post(submit_batch))
        .route("/v1/tasks:accepted", post(tasks_accepted))
        .route("/v1/tasks/{id}", get(task_status))
        .route("/v1/tasks/{id}/events", get(task_events))
        .route("/v1/tenants/{id}/backlog", get(tenant_backlog))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .layer(middleware::from_fn_with_state(gw.clone(), count))
        .layer(middleware::from_fn(crate::http::unread::close_if_unread))
        .with_state(gw)
}

/// The body of a refusal.
#[derive(Serialize)]
struct ErrorBody<'a> {
    reason: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let body = Json(ErrorBody {
            reason: &self.reason,
            field: self.field.as_deref(),
        });
        let mut resp = (self.status, body).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, retry_after(s));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

impl From<Denied> for Refusal {
    fn from(d: Denied) -> Self {
        Refusal::new(d.status, d.reason)
    }
}

fn bad(field: &str, reason: impl Into<String>) -> Refusal {
    Refusal {
        field: Some(field.to_string()),
        ..Refusal::new(StatusCode::BAD_REQUEST, reason)
    }
}

impl From<Invalid> for Refusal {
    fn from(i: Invalid) -> Self {
        match i {
            Invalid::Field { field, reason } => bad(&field, reason),
            Invalid::Forbidden(reason) => Refusal::new(StatusCode::FORBIDDEN, reason),
            Invalid::TooLarge(reason) => Refusal::new(StatusCode::PAYLOAD_TOO_LARGE, reason),
        }
    }
}

/// Counts every answer by route and status.
async fn count(
    State(gw): State<Arc<Gateway>>,
    matched: Option<MatchedPath>,
    req: Request,
    next: Next,
) -> Response {
    let endpoint = matched
        .as_ref()
        .map(MatchedPath::as_str)
        .unwrap_or("other")
        .to_string();
    let resp = next.run(req).await;
    gw.metrics.request(&endpoint, resp.status().as_u16());
    resp
}

async fn ui() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'",
            ),
        ],
        UI,
    )
        .into_response()
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    let mut buf = Vec::new();
    match TextEncoder::new().encode(&gw.registry.gather(), &mut buf) {
        Ok(()) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], buf).into_response(),
        Err(e) => Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn healthz(State(gw): State<Arc<Gateway>>) -> Response {
    match gw.status.state() {
        AppState::Failed(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason).into_response(),
        _ => (StatusCode::OK, "ok").into_response(),
    }
}

async fn readyz(State(gw): State<Arc<Gateway>>) -> Response {
    let state = gw.status.state();
    // Running, and the cluster answers (a submission needs the broker).
    let ready = gw.status.is_ready();
    let body = Json(serde_json::json!({
        "ready": ready,
        "state": format!("{state:?}"),
        "broker": gw.status.broker_fault().unwrap_or_else(|| "answers".into()),
        "tasks": gw.status.tasks().iter().map(|t| t.to_string()).collect::<Vec<_>>(),
    }));
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, body).into_response()
}

/// A task accepted.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Accepted {
    /// The task's id.
    pub task_id: String,
    /// Where its status is read.
    pub status_url: String,
    /// Where its result is pushed.
    pub events_url: String,
}

impl Accepted {
    fn of(task_id: &str) -> Accepted {
        let id = percent_encoding::utf8_percent_encode(task_id, PATH_SEGMENT);
        Accepted {
            task_id: task_id.to_string(),
            status_url: format!("/v1/tasks/{id}"),
            events_url: format!("/v1/tasks/{id}/events"),
        }
    }
}

/// The answer of `GET /v1/tenants/{id}/backlog`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BacklogBody {
    /// The tenant.
    pub tenant_id: String,
    /// Its tasks accepted and not answered.
    pub pending: u64,
    /// Until when its hard quota's window counts as used up (RFC 3339): the
    /// pipeline refused one of its tasks `quota_exceeded` in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota_exhausted_until: Option<String>,
    /// The instance that read it.
    pub served_by: String,
}

/// The query parameters of a URL, decoded; one given twice is refused.
fn params(raw: Option<String>) -> Result<BTreeMap<String, String>, Refusal> {
    let raw = raw.unwrap_or_default();
    let mut out = BTreeMap::new();
    let Ok(url) = reqwest::Url::parse(&format!("http://q/?{raw}")) else {
        return Ok(out);
    };
    for (k, v) in url.query_pairs().into_owned() {
        if out.contains_key(&k) {
            return Err(bad(&k, "is given more than once"));
        }
        out.insert(k, v);
    }
    Ok(out)
}

/// The tenant a read is for: the token's, or the `tenant` parameter with an
/// admin token.
fn reader(
    gw: &Gateway,
    headers: &HeaderMap,
    params: &BTreeMap<String, String>,
) -> Result<String, Refusal> {
    match gw.tokens.scope(headers)? {
        Scope::Tenant(own) => match params.get("tenant") {
            Some(t) if normalise_tenant(t) != own => Err(Refusal::new(
                StatusCode::FORBIDDEN,
                "this token reads its own tenant's tasks only",
            )),
            _ => Ok(own),
        },
        Scope::Admin => params
            .get("tenant")
            .map(|t| normalise_tenant(t))
            .filter(|t| !t.is_empty())
            .ok_or_else(|| bad("tenant", "is required with an admin token")),
    }
}

/// `wait`: `30s`, `500ms` or a whole number of seconds (up to nine
/// digits), at most `max`.
fn wait_param(params: &BTreeMap<String, String>, max: Duration) -> Result<Duration, Refusal> {
    let Some(w) = params.get("wait") else {
        return Ok(Duration::ZERO);
    };
    let (digits, unit_ms) = match w.strip_suffix("ms") {
        Some(d) => (d, 1),
        None => (w.strip_suffix('s').unwrap_or(w), 1000),
    };
    let parsed = ((1..=9).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse::<u64>().ok())
        .flatten()
        .map(|n| Duration::from_millis(n.saturating_mul(unit_ms)));
    parsed
        .map(|d| d.min(max))
        .ok_or_else(|| bad("wait", "must be a duration like 30s or 500ms"))
}

fn unknown_task() -> Refusal {
    Refusal::new(StatusCode::NOT_FOUND, "no such task")
}

async fn task_status(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let params = params(raw)?;
    let tenant = reader(&gw, &headers, &params)?;
    let wait = wait_param(&params, Duration::from_millis(gw.config.max_wait_ms))?;
    let grace = match headers.contains_key(NO_GRACE_HEADER) {
        true => Duration::ZERO,
        false => UNKNOWN_GRACE,
    };
    match gw.status_of(&tenant, &id, wait, grace, &headers).await? {
        Some(view) => Ok(Json(view).into_response()),
        None => Err(unknown_task()),
    }
}

/// Keeps the open event streams' gauge.
struct StreamOpen(prometheus::IntGauge);

impl Drop for StreamOpen {
    fn drop(&mut self) {
        self.0.dec();
    }
}

async fn task_events(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let params = params(raw)?;
    let tenant = reader(&gw, &headers, &params)?;
    let first = gw
        .status_of(&tenant, &id, Duration::ZERO, UNKNOWN_GRACE, &headers)
        .await?
        .ok_or_else(unknown_task)?;
    // The only event a stream sends is its last: whoever saw it is done.
    if headers
        .get("last-event-id")
        .is_some_and(|v| v.as_bytes() == b"final")
    {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    gw.metrics.event_streams.inc();
    let open = StreamOpen(gw.metrics.event_streams.clone());
    let max_wait = Duration::from_millis(gw.config.max_wait_ms);
    let keepalive = Duration::from_millis(gw.config.keepalive_ms);
    let event = async move {
        let _open = open;
        let mut view = first;
        loop {
            if view.status.is_final() {
                let event = Event::default()
                    .id("final")
                    .event(view.status.as_str())
                    .json_data(&view)
                    .unwrap_or_else(|_| Event::default().event("error").data("encoding"));
                return Ok::<Event, Infallible>(event);
            }
            match gw
                .status_of(&tenant, &id, max_wait, UNKNOWN_GRACE, &headers)
                .await
            {
                Ok(Some(v)) => view = v,
                Ok(None) => {
                    return Ok(Event::default()
                        .event("error")
                        .data(r#"{"reason":"the task's status expired"}"#))
                }
                // A rebalance or an instance going away: ask again shortly.
                Err(e) => {
                    tracing::debug!(reason = %e.reason, "event stream: status unavailable");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    };
    let stream = futures::stream::once(event);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(keepalive).text("keep-alive"))
        .into_response())
}

/// Internal: another instance accepted tasks of a tenant held here.
async fn tasks_accepted(
    State(gw): State<Arc<Gateway>>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refusal> {
    if !crate::http::forward::is_forwarded(&headers) {
        return Err(Refusal::new(StatusCode::NOT_FOUND, "not found"));
    }
    let params = params(raw)?;
    let tenant = reader(&gw, &headers, &params)?;
    let value = json_body(body, &headers, gw.config.max_body_bytes).await?;
    let body: super::ExpectedBody =
        serde_json::from_value(value).map_err(|e| bad("tasks", e.to_string()))?;
    gw.expect(&tenant, &body.tasks);
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn tenant_backlog(
    State(gw): State<Arc<Gateway>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    gw.tokens.authorize(&headers, &tenant)?;
    let tenant = normalise_tenant(&tenant);
    let admission = gw.admission_of(&tenant, &headers).await?;
    Ok(Json(BacklogBody {
        tenant_id: tenant,
        pending: admission.pending,
        quota_exhausted_until: admission.quota_until_ms.and_then(|ms| {
            chrono::DateTime::from_timestamp_millis(ms)
                .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        }),
        served_by: gw.served_by.clone(),
    })
    .into_response())
}

/// Reads a body of at most `limit` bytes as JSON.
async fn json_body(body: Body, headers: &HeaderMap, limit: usize) -> Result<Value, Refusal> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let too_large = || {
        Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is over {limit} bytes ([gateway] max_body_bytes)"),
        )
    };
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let bytes = axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| too_large())?;
    serde_json::from_slice(&bytes).map_err(|e| bad("body", format!("not JSON: {e}")))
}

/// The reason label of a refusal.
fn reason_of(r: &Refusal) -> &'static str {
    match r.status {
        StatusCode::BAD_REQUEST => "bad_request",
        StatusCode::PAYLOAD_TOO_LARGE => "too_large",
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::FORBIDDEN => "forbidden",
        _ => "unavailable",
    }
}

/// What a submission's request carries before its body is read: the
/// caller's scope and `Idempotency-Key`.
fn caller(gw: &Gateway, headers: &HeaderMap) -> Result<(Scope, Option<String>), Refusal> {
    let scope = gw.tokens.scope(headers)?;
    let key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => {
            let k = v
                .to_str()
                .map_err(|_| bad("Idempotency-Key", "must be visible ASCII"))?;
            submit::check_idempotency_key(k)?;
            Some(k.to_string())
        }
    };
    Ok((scope, key))
}

/// Runs a submission, counting its refusals and timing its answer.
async fn submission(
    gw: &Gateway,
    tasks: u64,
    work: impl std::future::Future<Output = Result<Response, Refusal>>,
) -> Result<Response, Refusal> {
    let started = Instant::now();
    let r = work.await;
    match &r {
        Ok(_) => gw
            .metrics
            .accept_seconds
            .observe(started.elapsed().as_secs_f64()),
        // Backlog and quota refusals are counted where they are decided.
        Err(e) if e.status != StatusCode::TOO_MANY_REQUESTS => {
            gw.metrics.rejected(reason_of(e), tasks)
        }
        Err(_) => {}
    }
    r
}

fn accepted_response(body: impl Serialize, location: Option<&str>, replayed: bool) -> Response {
    let mut resp = (StatusCode::ACCEPTED, Json(body)).into_response();
    if let Some(loc) = location.and_then(|l| HeaderValue::from_str(l).ok()) {
        resp.headers_mut().insert(header::LOCATION, loc);
    }
    if replayed {
        resp.headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    resp
}

async fn submit_one(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refusal> {
    submission(&gw, 1, async {
        let (scope, key) = caller(&gw, &headers)?;
        let value = json_body(body, &headers, gw.config.max_body_bytes).await?;
        let sub = submit::check(
            &value,
            &scope,
            key.as_deref(),
            &gw.rules,
            chrono::Utc::now(),
        )?;
        let replayed = gw.publish(std::slice::from_ref(&sub), &headers).await?;
        let accepted = Accepted::of(sub.id.id());
        let location = accepted.status_url.clone();
        Ok(accepted_response(accepted, Some(&location), replayed[0]))
    })
    .await
}

/// The body of `POST /v1/tasks:batch`'s answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchAccepted {
    /// One entry per task, in order.
    pub tasks: Vec<Accepted>,
}

async fn submit_batch(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refusal> {
    submission(&gw, 1, async {
        let (scope, key) = caller(&gw, &headers)?;
        let value = json_body(body, &headers, gw.config.max_body_bytes).await?;
        let max = gw.config.max_batch;
        let tasks = match value.get("tasks") {
            Some(Value::Array(t)) if !t.is_empty() && t.len() <= max => t,
            _ => {
                return Err(bad(
                    "tasks",
                    format!("must be an array of 1 to {max} tasks ([gateway] max_batch)"),
                ))
            }
        };
        if let Some(extra) = value
            .as_object()
            .and_then(|o| o.keys().find(|k| *k != "tasks"))
        {
            return Err(bad(extra, "unknown field"));
        }
        let now = chrono::Utc::now();
        let subs: Vec<Submission> = tasks
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let key = key.as_ref().map(|k| format!("{k}#{i}"));
                submit::check(t, &scope, key.as_deref(), &gw.rules, now)
                    .map_err(|e| e.within(&format!("tasks[{i}]")))
            })
            .collect::<Result<_, _>>()?;
        // Published tenant by tenant (an admin token may submit for several).
        let mut replayed = vec![false; subs.len()];
        let mut tenants: Vec<&str> = subs.iter().map(|s| s.tenant.as_str()).collect();
        tenants.sort_unstable();
        tenants.dedup();
        for tenant in tenants {
            let (idx, group): (Vec<usize>, Vec<Submission>) = subs
                .iter()
                .enumerate()
                .filter(|(_, s)| s.tenant == tenant)
                .map(|(i, s)| (i, s.clone()))
                .unzip();
            for (i, r) in idx.into_iter().zip(gw.publish(&group, &headers).await?) {
                replayed[i] = r;
            }
        }
        let body = BatchAccepted {
            tasks: subs.iter().map(|s| Accepted::of(s.id.id())).collect(),
        };
        Ok(accepted_response(body, None, replayed.iter().all(|r| *r)))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_urls_encode_the_task_id_as_one_segment() {
        let a = Accepted::of("a b/c?d#e%f:g~h.ü");
        assert_eq!(a.status_url, "/v1/tasks/a%20b%2Fc%3Fd%23e%25f:g~h.%C3%BC");
        assert_eq!(a.events_url, format!("{}/events", a.status_url));
    }

    #[test]
    fn a_parameter_given_twice_is_refused() {
        let twice = params(Some("wait=x&wait=5s".into())).unwrap_err();
        assert_eq!(twice.field.as_deref(), Some("wait"));
        let once = params(Some("wait=5s&tenant=a%2Db".into())).unwrap();
        assert_eq!(once["tenant"], "a-b");
    }

    #[test]
    fn wait_takes_seconds_or_milliseconds_up_to_the_cap() {
        let max = Duration::from_secs(30);
        let w = |v: &str| {
            let p = BTreeMap::from([("wait".to_string(), v.to_string())]);
            wait_param(&p, max).map_err(|r| r.field)
        };
        assert_eq!(w("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(w("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(w("7"), Ok(Duration::from_secs(7)));
        assert_eq!(w("600s"), Ok(max));
        for bad in [
            "",
            "s",
            "ms",
            "1.5s",
            "-1",
            "+5",
            " 5",
            "1e3",
            "5m",
            "1234567890",
        ] {
            assert_eq!(w(bad), Err(Some("wait".to_string())), "{bad:?}");
        }
        assert_eq!(wait_param(&BTreeMap::new(), max).unwrap(), Duration::ZERO);
    }
}
