//! The HTTP listener: `/metrics` (Prometheus text), `/healthz`, `/readyz`,
//! and the interactive query `/v1/tenants/{id}/usage` (see [`crate::http::usage`]),
//! behind bearer tokens (see [`auth`]).

pub mod auth;
pub mod config;
pub mod forward;
pub mod unread;
pub mod usage;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use prometheus::{Encoder, Registry, TextEncoder};
use sluice_topology::runtime::{AppState, AppStatus};

use crate::http::forward::ErrorBody;
use crate::http::usage::{Lookup, UsageError, UsageQueries};
use crate::steps::health::Health;

/// What the endpoints read.
#[derive(Clone)]
pub struct HttpState {
    /// Metrics to export.
    pub registry: Registry,
    /// The stream application's status.
    pub status: Arc<AppStatus>,
    /// Operator faults.
    pub health: Health,
    /// Tenant usage queries (none when accounting is off).
    pub usage: Option<UsageQueries>,
    /// Who may query.
    pub tokens: Arc<auth::ApiTokens>,
}

/// The router.
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/tenants/{id}/usage", get(tenant_usage))
        .with_state(state)
}

/// Binds the listener (before the stream application starts, which needs
/// the address it advertises).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// Serves on a bound listener until the returned task is aborted.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: HttpState,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let local = listener.local_addr()?;
    let app = router(state);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "http listener stopped");
        }
    });
    Ok((local, task))
}

async fn metrics(State(s): State<HttpState>) -> Response {
    let mut buf = Vec::new();
    match TextEncoder::new().encode(&s.registry.gather(), &mut buf) {
        Ok(()) => ([("content-type", "text/plain; version=0.0.4")], buf).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn healthz(State(s): State<HttpState>) -> Response {
    match s.status.state() {
        AppState::Failed(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason).into_response(),
        _ => (StatusCode::OK, "ok").into_response(),
    }
}

async fn readyz(State(s): State<HttpState>) -> Response {
    let state = s.status.state();
    // Ready while the cluster answers and some model serves: a held
    // model's tasks wait, the others flow; the body names the held models
    // and their faults.
    let ready = s.status.is_ready() && s.health.serving();
    let body = Json(serde_json::json!({
        "ready": ready,
        "state": format!("{state:?}"),
        "broker": s.status.broker_fault().unwrap_or_else(|| "answers".into()),
        "tasks": s.status.tasks().iter().map(|t| t.to_string()).collect::<Vec<_>>(),
        "held_models": s.health.held_models(),
        "faults": s.health.faults(),
        "warnings": s.health.warnings(),
    }));
    if ready {
        (StatusCode::OK, body).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}

/// Query parameters of `/v1/tenants/{id}/usage`.
#[derive(Debug, serde::Deserialize)]
struct UsageParams {
    /// Only this window size.
    window: Option<String>,
}

fn refuse(status: StatusCode, reason: String) -> Response {
    let mut resp = (status, Json(ErrorBody { reason })).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        resp.headers_mut()
            .insert("retry-after", axum::http::HeaderValue::from_static("1"));
    }
    resp
}

/// A tenant's current windows: read here when this instance holds the
/// tenant, else forwarded (once) to the instance that does.
async fn tenant_usage(
    State(s): State<HttpState>,
    Path(tenant): Path<String>,
    Query(params): Query<UsageParams>,
    headers: HeaderMap,
) -> Response {
    if let Err(denied) = s.tokens.authorize(&headers, &tenant) {
        let mut resp = refuse(denied.status, denied.reason);
        if denied.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(
                "www-authenticate",
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        return resp;
    }
    let Some(usage) = &s.usage else {
        return refuse(StatusCode::NOT_FOUND, "accounting is disabled".into());
    };
    let window = params.window.as_deref();
    let now = chrono::Utc::now().timestamp_millis();
    match usage.lookup(&tenant, window, now, forward::is_forwarded(&headers)) {
        Ok(Lookup::Local(report)) => (StatusCode::OK, Json(report)).into_response(),
        Ok(Lookup::Remote(host)) => match usage.forward(&host, &tenant, window, &headers).await {
            Ok((status, body)) => (
                StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
                [("content-type", "application/json")],
                body,
            )
                .into_response(),
            Err(reason) => refuse(StatusCode::SERVICE_UNAVAILABLE, reason),
        },
        Ok(Lookup::Unavailable(reason)) => refuse(StatusCode::SERVICE_UNAVAILABLE, reason),
        Ok(Lookup::Unknown(reason)) => refuse(StatusCode::NOT_FOUND, reason),
        Err(e @ UsageError::UnknownWindow(_)) => refuse(StatusCode::NOT_FOUND, e.to_string()),
        Err(e) => refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}
