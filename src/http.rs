//! The HTTP listener: `/metrics` (Prometheus text), `/healthz`, `/readyz`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use prometheus::{Encoder, Registry, TextEncoder};
use sluice_topology::runtime::{AppState, AppStatus};

use crate::operator::Health;

/// What the endpoints read.
#[derive(Clone)]
pub struct HttpState {
    /// Metrics to export.
    pub registry: Registry,
    /// The stream application's status.
    pub status: Arc<AppStatus>,
    /// Operator faults.
    pub health: Health,
}

/// The router.
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// Binds and serves until the returned task is aborted.
pub async fn serve(
    addr: SocketAddr,
    state: HttpState,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
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
    let faults = s.health.faults();
    let ready = state == AppState::Running && faults.is_empty();
    let body = Json(serde_json::json!({
        "ready": ready,
        "state": format!("{state:?}"),
        "tasks": s.status.tasks().iter().map(|t| t.to_string()).collect::<Vec<_>>(),
        "faults": faults,
    }));
    if ready {
        (StatusCode::OK, body).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}
