//! Tracing across the LLM step: each result carries a span of its own under
//! the task's W3C `traceparent`, so a trace shows Sluice's work between the
//! task and its result.
//!
//! A task whose headers hold a valid `traceparent` gets a child span: the
//! result's `traceparent` keeps the trace id and flags and names the new span
//! (`tracestate` is carried unchanged). The span runs from the task's intake
//! to its result and says which model answered, the tokens, cost, attempts
//! and the outcome. A task without a (valid) trace context stays without one.
//!
//! With `[tracing] otlp_endpoint` set, the spans of sampled traces (flag
//! `01`) are exported over OTLP/HTTP with JSON encoding (`POST
//! <endpoint>/v1/traces`) in batches from a bounded queue: a slow or absent
//! collector never slows processing; spans that do not fit are dropped and
//! counted.

use std::time::Duration;

use prometheus::{IntCounter, Registry};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sluice_topology::Headers;
use tokio::sync::mpsc;

use crate::envelope::TaskResult;
use crate::error::ConfigError;

/// The W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";

/// `[tracing]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingSection {
    /// OTLP/HTTP collector base URL (e.g. `http://otel-collector:4318`);
    /// spans go to `<endpoint>/v1/traces`. Unset: no export (results still
    /// carry their span ids).
    pub otlp_endpoint: Option<String>,
    /// Headers sent with each export (e.g. an API key of a hosted collector).
    pub otlp_headers: sluice_topology::redact::Properties,
    /// `service.name` of the exported spans.
    pub service_name: String,
    /// Spans waiting for export at most; more are dropped (and counted).
    pub max_queue: usize,
    /// Spans per export request at most.
    pub max_batch: usize,
    /// How long a span waits for a fuller batch, ms.
    pub export_interval_ms: u64,
    /// Timeout of one export request, ms.
    pub export_timeout_ms: u64,
}

impl Default for TracingSection {
    fn default() -> Self {
        TracingSection {
            otlp_endpoint: None,
            otlp_headers: Default::default(),
            service_name: "sluice".into(),
            max_queue: 8192,
            max_batch: 512,
            export_interval_ms: 1_000,
            export_timeout_ms: 10_000,
        }
    }
}

impl TracingSection {
    /// Checks what serde cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(url) = &self.otlp_endpoint {
            let ok = reqwest::Url::parse(url)
                .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
            if !ok {
                return Err(ConfigError::new(
                    "tracing.otlp_endpoint",
                    "must be an http(s) URL like http://otel-collector:4318",
                ));
            }
        }
        for (name, value) in &self.otlp_headers {
            if http::HeaderName::try_from(name.as_str()).is_err()
                || http::HeaderValue::try_from(value.as_str()).is_err()
            {
                return Err(ConfigError::new(
                    format!("tracing.otlp_headers.{name}"),
                    "must be a valid HTTP header name and value",
                ));
            }
        }
        for (key, v) in [
            ("tracing.max_queue", self.max_queue as u64),
            ("tracing.max_batch", self.max_batch as u64),
            ("tracing.export_interval_ms", self.export_interval_ms),
            ("tracing.export_timeout_ms", self.export_timeout_ms),
        ] {
            if v == 0 {
                return Err(ConfigError::new(key, "must be at least 1"));
            }
        }
        Ok(())
    }
}

/// A parsed `traceparent`: `00-<trace id>-<parent id>-<flags>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: u128,
    pub span_id: u64,
    pub flags: u8,
}

impl TraceParent {
    /// Parses a header value; `None` when it is not a valid trace context
    /// (a future version's longer value is read by its first four fields).
    pub fn parse(value: &str) -> Option<TraceParent> {
        let mut parts = value.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len: usize| {
            s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        if !hex(version, 2) || version == "ff" || !hex(trace, 32) || !hex(span, 16) {
            return None;
        }
        if !hex(flags, 2) || (version == "00" && parts.next().is_some()) {
            return None;
        }
        let p = TraceParent {
            trace_id: u128::from_str_radix(trace, 16).ok()?,
            span_id: u64::from_str_radix(span, 16).ok()?,
            flags: u8::from_str_radix(flags, 16).ok()?,
        };
        (p.trace_id != 0 && p.span_id != 0).then_some(p)
    }

    /// A new span under this one.
    pub fn child(&self) -> TraceParent {
        let mut span_id = 0;
        while span_id == 0 {
            span_id = rand::random::<u64>();
        }
        TraceParent { span_id, ..*self }
    }

    /// Whether the caller records this trace.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The header value.
    pub fn header(&self) -> String {
        format!(
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }
}

/// A finished span, ready for export.
#[derive(Debug, Clone)]
struct Span {
    span: TraceParent,
    parent_span_id: u64,
    name: String,
    start_unix_nano: i64,
    end_unix_nano: i64,
    attributes: Vec<(&'static str, Value)>,
    error: Option<String>,
}

impl Span {
    fn otlp(&self) -> Value {
        let attributes: Vec<Value> = self
            .attributes
            .iter()
            .map(|(k, v)| json!({ "key": k, "value": any_value(v) }))
            .collect();
        let status = match &self.error {
            Some(m) => json!({ "code": 2, "message": m }),
            None => json!({ "code": 1 }),
        };
        json!({
            "traceId": format!("{:032x}", self.span.trace_id),
            "spanId": format!("{:016x}", self.span.span_id),
            "parentSpanId": format!("{:016x}", self.parent_span_id),
            "flags": self.span.flags as u32,
            "name": self.name,
            // SPAN_KIND_CONSUMER: work on a record taken from a topic.
            "kind": 5,
            "startTimeUnixNano": self.start_unix_nano.to_string(),
            "endTimeUnixNano": self.end_unix_nano.to_string(),
            "attributes": attributes,
            "status": status,
        })
    }
}

/// An OTLP `AnyValue`.
fn any_value(v: &Value) -> Value {
    match v {
        Value::Bool(b) => json!({ "boolValue": b }),
        Value::Number(n) if n.is_i64() || n.is_u64() => json!({ "intValue": n.to_string() }),
        Value::Number(n) => json!({ "doubleValue": n.as_f64() }),
        Value::String(s) => json!({ "stringValue": s }),
        other => json!({ "stringValue": other.to_string() }),
    }
}

/// Export counters.
#[derive(Clone)]
struct TraceMetrics {
    exported: IntCounter,
    dropped: IntCounter,
}

/// Metric names.
pub mod names {
    pub const SPANS_EXPORTED: &str = "sluice_trace_spans_exported_total";
    pub const SPANS_DROPPED: &str = "sluice_trace_spans_dropped_total";
}

/// Makes each result's span and exports it when configured; shared by every
/// task of an instance.
#[derive(Clone)]
pub struct Tracer {
    export: Option<mpsc::Sender<Span>>,
    metrics: TraceMetrics,
}

impl Tracer {
    /// A tracer exporting per `config` (spawned on the current Tokio
    /// runtime), its counters registered in `registry`.
    pub fn start(config: &TracingSection, registry: &Registry) -> prometheus::Result<Tracer> {
        let metrics = TraceMetrics {
            exported: IntCounter::new(
                names::SPANS_EXPORTED,
                "Spans exported to the OTLP collector",
            )?,
            dropped: IntCounter::new(
                names::SPANS_DROPPED,
                "Spans dropped: export queue full or the collector failed",
            )?,
        };
        registry.register(Box::new(metrics.exported.clone()))?;
        registry.register(Box::new(metrics.dropped.clone()))?;
        let export = match &config.otlp_endpoint {
            None => None,
            Some(endpoint) => {
                let (tx, rx) = mpsc::channel(config.max_queue);
                let exporter = Exporter::new(endpoint, config, metrics.clone())
                    .map_err(|e| prometheus::Error::Msg(format!("span exporter: {e}")))?;
                tokio::spawn(exporter.run(rx));
                Some(tx)
            }
        };
        Ok(Tracer { export, metrics })
    }

    /// A tracer that exports nothing (results still get their span ids).
    pub fn local() -> Tracer {
        Tracer {
            export: None,
            metrics: TraceMetrics {
                exported: IntCounter::new("unregistered_exported", "-").expect("valid name"),
                dropped: IntCounter::new("unregistered_dropped", "-").expect("valid name"),
            },
        }
    }

    /// The trace headers of `result`, made from the task's `trace_from`: a
    /// child span's `traceparent` (recorded for export), the `tracestate`
    /// carried; nothing when the task had no valid trace context.
    pub fn result_headers(
        &self,
        trace_from: &Headers,
        result: &TaskResult,
        duplicate: bool,
    ) -> Headers {
        let mut out = Headers::new();
        let parent = trace_from
            .iter()
            .find(|(k, _)| k == TRACEPARENT)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .and_then(TraceParent::parse);
        if let Some(parent) = parent {
            let span = parent.child();
            out.push((TRACEPARENT.into(), span.header().into_bytes()));
            if let Some((k, v)) = trace_from.iter().find(|(k, _)| k == "tracestate") {
                out.push((k.clone(), v.clone()));
            }
            if span.sampled() {
                self.record(span, parent.span_id, result, duplicate);
            }
        }
        out
    }

    fn record(&self, span: TraceParent, parent_span_id: u64, r: &TaskResult, duplicate: bool) {
        let Some(tx) = &self.export else { return };
        let end = r.completed_at.timestamp_nanos_opt().unwrap_or_default();
        let start = end - (r.processing_ms as i64).saturating_mul(1_000_000);
        let mut attributes: Vec<(&'static str, Value)> = vec![
            ("sluice.task.id", json!(r.task_id)),
            ("sluice.task.type", json!(r.task_type)),
            ("sluice.tenant.id", json!(r.tenant_id)),
            ("sluice.route.tier", json!(r.route.tier)),
            ("gen_ai.request.model", json!(r.model)),
            ("gen_ai.usage.input_tokens", json!(r.input_tokens)),
            ("gen_ai.usage.output_tokens", json!(r.output_tokens)),
            ("sluice.cached_tokens", json!(r.cached_tokens)),
            ("sluice.cost_micros", json!(r.cost_micros)),
            ("sluice.attempts", json!(r.attempts)),
            ("sluice.success", json!(r.success)),
            ("sluice.duplicate", json!(duplicate)),
        ];
        if let Some(b) = &r.batch_id {
            attributes.push(("sluice.batch.id", json!(b)));
        }
        if let Some(code) = &r.error_code {
            attributes.push(("sluice.error.code", json!(code)));
        }
        let s = Span {
            span,
            parent_span_id,
            name: format!("sluice {}", r.task_type),
            start_unix_nano: start,
            end_unix_nano: end,
            attributes,
            // The code only: an error message may quote the task's input.
            error: r.error_code.clone(),
        };
        if tx.try_send(s).is_err() {
            self.metrics.dropped.inc();
        }
    }
}

/// Sends batches of spans to the collector.
struct Exporter {
    url: String,
    headers: reqwest::header::HeaderMap,
    http: reqwest::Client,
    service_name: String,
    max_batch: usize,
    interval: Duration,
    metrics: TraceMetrics,
}

impl Exporter {
    fn new(endpoint: &str, config: &TracingSection, metrics: TraceMetrics) -> anyhow::Result<Self> {
        let mut headers = reqwest::header::HeaderMap::new();
        for (k, v) in &config.otlp_headers {
            let mut value = reqwest::header::HeaderValue::try_from(v.as_str())?;
            value.set_sensitive(true);
            headers.insert(reqwest::header::HeaderName::try_from(k.as_str())?, value);
        }
        Ok(Exporter {
            url: format!("{}/v1/traces", endpoint.trim_end_matches('/')),
            headers,
            http: reqwest::Client::builder()
                .timeout(Duration::from_millis(config.export_timeout_ms))
                .build()?,
            service_name: config.service_name.clone(),
            max_batch: config.max_batch,
            interval: Duration::from_millis(config.export_interval_ms),
            metrics,
        })
    }

    async fn run(self, mut rx: mpsc::Receiver<Span>) {
        let mut batch = Vec::with_capacity(self.max_batch);
        loop {
            let Some(first) = rx.recv().await else { return };
            batch.push(first);
            let deadline = tokio::time::Instant::now() + self.interval;
            while batch.len() < self.max_batch {
                match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(s)) => batch.push(s),
                    Ok(None) | Err(_) => break,
                }
            }
            self.send(std::mem::take(&mut batch)).await;
        }
    }

    async fn send(&self, spans: Vec<Span>) {
        let n = spans.len() as u64;
        let body = json!({
            "resourceSpans": [{
                "resource": { "attributes": [
                    { "key": "service.name", "value": { "stringValue": self.service_name } },
                ]},
                "scopeSpans": [{
                    "scope": { "name": "sluice", "version": env!("CARGO_PKG_VERSION") },
                    "spans": spans.iter().map(Span::otlp).collect::<Vec<_>>(),
                }],
            }],
        });
        let sent = self
            .http
            .post(&self.url)
            .headers(self.headers.clone())
            .json(&body)
            .send()
            .await
            .and_then(|r| r.error_for_status());
        match sent {
            Ok(_) => self.metrics.exported.inc_by(n),
            Err(e) => {
                // Spans are telemetry: dropped, not retried into a backlog.
                tracing::warn!(error = %e, spans = n, "span export failed");
                self.metrics.dropped.inc_by(n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_makes_children() {
        let h = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let p = TraceParent::parse(h).unwrap();
        assert_eq!(p.header(), h);
        assert!(p.sampled());
        let c = p.child();
        assert_eq!(c.trace_id, p.trace_id);
        assert_eq!(c.flags, p.flags);
        assert_ne!(c.span_id, p.span_id);
        assert_eq!(TraceParent::parse(&c.header()), Some(c));
    }

    #[test]
    fn rejects_invalid_contexts() {
        for bad in [
            "",
            "00-abc-def-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad}");
        }
        // A later version may append fields.
        assert!(TraceParent::parse(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"
        )
        .is_some());
    }
}
