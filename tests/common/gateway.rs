//! The gateway's test fixture: `sluice gateway` instances on a
//! [`Pipeline`]'s config, and an HTTP client for them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use super::pipeline::Pipeline;
use super::{eventually, Proc};

/// A running gateway.
pub struct Gateway {
    pub proc: Proc,
    pub addr: SocketAddr,
}

impl Gateway {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// Starts `sluice gateway` with its state in `state`; waits until it listens.
pub fn start_gateway(p: &Pipeline, name: &str, state: &Path) -> Gateway {
    let args = [
        "gateway".into(),
        "--config".into(),
        p.config.display().to_string(),
    ];
    let state = state.display().to_string();
    let proc = Proc::spawn_env(
        name,
        &args,
        &[
            ("SLUICE_GATEWAY__LISTEN", "127.0.0.1:0"),
            ("SLUICE_GATEWAY__STATE_DIR", state.as_str()),
        ],
    );
    let line = proc
        .wait_line(Duration::from_secs(60), |l| l.starts_with("LISTENING "))
        .expect("sluice gateway listens");
    let addr = line["LISTENING ".len()..].trim().parse().unwrap();
    Gateway { proc, addr }
}

/// An HTTP answer: status, headers (lower-case names), body.
pub struct Answer {
    pub status: u16,
    pub headers: HashMap<String, String>,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: not JSON: {}", self.body))
    }
}

async fn answer(resp: reqwest::Response) -> Answer {
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    Answer {
        status,
        headers,
        body: resp.text().await.unwrap_or_default(),
    }
}

pub async fn post(
    client: &reqwest::Client,
    url: String,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Answer {
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    answer(req.send().await.expect("POST")).await
}

pub async fn get(client: &reqwest::Client, url: String, token: Option<&str>) -> Answer {
    let mut req = client.get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    answer(req.send().await.expect("GET")).await
}

/// One server-sent event.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sse {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

/// Reads an event stream to its end: its status, events and how many
/// keep-alive comments came.
pub async fn events(
    client: &reqwest::Client,
    url: String,
    token: &str,
    last_event_id: Option<&str>,
) -> (u16, Vec<Sse>, usize) {
    let mut req = client.get(url).bearer_auth(token);
    if let Some(id) = last_event_id {
        req = req.header("last-event-id", id);
    }
    let mut resp = req.send().await.expect("GET events");
    let status = resp.status().as_u16();
    let mut text = String::new();
    while let Some(chunk) = resp.chunk().await.expect("event stream chunk") {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let (mut out, mut comments) = (Vec::new(), 0);
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut ev = Sse::default();
        let mut fields = 0;
        for line in block.lines() {
            if line.starts_with(':') {
                comments += 1;
            } else if let Some(v) = line.strip_prefix("id:") {
                ev.id = Some(v.trim().to_string());
                fields += 1;
            } else if let Some(v) = line.strip_prefix("event:") {
                ev.event = Some(v.trim().to_string());
                fields += 1;
            } else if let Some(v) = line.strip_prefix("data:") {
                ev.data.push_str(v.trim_start());
                fields += 1;
            }
        }
        if fields > 0 {
            out.push(ev);
        }
    }
    (status, out, comments)
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .unwrap()
}

/// Waits until `g` is ready.
pub fn wait_ready(p: &Pipeline, g: &Gateway) {
    let c = client();
    eventually(Duration::from_secs(120), "gateway ready", || {
        (p.rt.block_on(get(&c, g.url("/readyz"), None)).status == 200).then_some(())
    });
}

/// The value of a metric of `g` (summed over its series).
pub fn metric(p: &Pipeline, g: &Gateway, name: &str) -> f64 {
    let a = p.rt.block_on(get(&client(), g.url("/metrics"), None));
    a.body
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A submission of `task_type` with `content` (as the seeds' services would
/// send it).
pub fn submission_of(task_type: &str, content: &str) -> Value {
    let mut payload = serde_json::json!({ "content": content });
    match task_type {
        "summarize" => payload["maxWords"] = 8.into(),
        "classify" => payload["labels"] = serde_json::json!(["news", "sports", "tech"]),
        _ => {
            payload["schema"] =
                serde_json::json!({"type": "object", "properties": {"topic": {"type": "string"}}})
        }
    }
    serde_json::json!({ "taskType": task_type, "payload": payload })
}

/// Submission `i` of `task_type`, with a correlation id.
pub fn submission(i: usize, task_type: &str) -> Value {
    let mut v = submission_of(
        task_type,
        &format!("Document {i}: the quick brown fox jumps over the lazy dog."),
    );
    v["metadata"] = serde_json::json!({ "correlationId": format!("c-{i}") });
    v
}
