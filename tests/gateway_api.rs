//! The gateway against what it publishes: the answers of a running
//! `sluice gateway` checked by schemathesis against
//! `docs/gateway-openapi.yaml`, and the page it serves at `/` driven by a
//! headless Chromium until the result of the task it submitted arrives.
//!
//! Both tools come from `scripts/setup.sh` (which `make test` runs):
//! schemathesis from a project-local venv (`.tools/schemathesis-venv`),
//! Chromium from Debian's `chromium` package. A missing tool fails these
//! tests with what to run; they never skip.

mod common;

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::gateway::*;
use common::pipeline::*;
use common::{eventually, temp_dir};
use rdkafka::Message;
use serde_json::{json, Value};
use sluice::sim::SimConfig;

/// The tenant both tests submit as.
const TENANT: usize = 1;

/// The schemathesis version `scripts/setup.sh` pins.
const SCHEMATHESIS_VERSION: &str = "4.32.5";

/// schemathesis's seed: the same requests on every run (another one, to
/// explore: `SLUICE_TEST_SCHEMATHESIS_SEED`).
const SEED: u64 = 1;

fn seed() -> u64 {
    std::env::var("SLUICE_TEST_SCHEMATHESIS_SEED")
        .ok()
        .map(|s| {
            s.parse()
                .expect("SLUICE_TEST_SCHEMATHESIS_SEED is a number")
        })
        .unwrap_or(SEED)
}

/// Test cases per operation and phase: enough to walk every operation's
/// examples, boundaries and links (some 730 test cases, 17 s on an idle
/// machine), few enough for well under a minute.
const MAX_EXAMPLES: u32 = 20;

/// How long schemathesis may take before the test stops it and fails.
const SCHEMATHESIS_DEADLINE: Duration = Duration::from_secs(80);

/// The gateway of both tests: keep-alive comments every second (so event
/// streams of pending tasks carry some) and long polls of two seconds at
/// most (so a fuzzed `?wait=` holds no request for long).
const GATEWAY_TOML: &str = "[gateway]\nkeepalive_ms = 1000\nmax_wait_ms = 2000\n";

fn repo() -> PathBuf {
    common::repo_root()
}

/// The schemathesis CLI of `.tools/schemathesis-venv`, checked to run and to
/// be the pinned version.
fn schemathesis() -> PathBuf {
    let st = repo().join(".tools/schemathesis-venv/bin/st");
    let version = Command::new(&st).arg("--version").output();
    match version {
        Ok(out) if out.status.success() => {
            let v = String::from_utf8_lossy(&out.stdout);
            assert!(
                v.contains(SCHEMATHESIS_VERSION),
                "{} is {v:?}, not schemathesis {SCHEMATHESIS_VERSION}: run scripts/setup.sh",
                st.display()
            );
            st
        }
        other => panic!(
            "schemathesis is missing or broken ({}: {other:?}): run scripts/setup.sh, which \
             installs schemathesis=={SCHEMATHESIS_VERSION} into .tools/schemathesis-venv \
             (make test runs it)",
            st.display()
        ),
    }
}

/// Debian's `chromium` on `PATH`.
fn chromium() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("chromium"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "chromium is not on PATH: run scripts/setup.sh, which installs Debian's chromium \
                 package (make test runs it)"
            )
        })
}

/// Submits `task` as [`TENANT`] and waits until it is final; returns its id.
fn submit_and_wait(p: &Pipeline, g: &Gateway, task: &Value) -> String {
    let c = client();
    let token = tenant_token(TENANT);
    let body = serde_json::to_vec(task).unwrap();
    let a =
        p.rt.block_on(post(&c, g.url("/v1/tasks"), Some(&token), &[], body));
    assert_eq!(a.status, 202, "{}", a.body);
    let id = a.json()["taskId"].as_str().unwrap().to_string();
    eventually(Duration::from_secs(60), "the task is final", || {
        let s = p.rt.block_on(get(
            &c,
            g.url(&format!("/v1/tasks/{id}?wait=2s")),
            Some(&token),
        ));
        (s.status == 200 && s.json()["status"] != "pending").then_some(())
    });
    id
}

/// schemathesis's settings besides the command line: dictionaries of real
/// values (the finished tasks' ids, the token's tenant) that half of the
/// generated ids and tenants of the read operations are replaced with, so
/// that those are exercised with answers (statuses with results, event
/// streams, backlogs) and not only with 404 and 403; and any warning (an
/// operation only ever refused, a filter matching nothing) fails the run.
fn schemathesis_config(task_ids: &[String]) -> String {
    format!(
        r#"[warnings]
fail-on = true

[dictionaries.task-ids]
values = {ids}

[dictionaries.tenants]
values = ["tenant-{TENANT}"]

[[operations]]
include-operation-id = ["getTask", "taskEvents"]
parameters = {{ "path.id" = {{ dictionary = "task-ids", probability = 0.5 }} }}

[[operations]]
include-operation-id = "tenantBacklog"
parameters = {{ "path.id" = {{ dictionary = "tenants", probability = 0.5 }} }}
"#,
        ids = serde_json::to_string(task_ids).unwrap()
    )
}

/// Runs `cmd` (its output to `log`) until it exits or `deadline` passes;
/// returns its exit code, `None` when it was stopped at the deadline.
fn run_until(mut cmd: Command, log: &Path, deadline: Duration) -> Option<i32> {
    let out = File::create(log).unwrap();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let end = Instant::now() + deadline;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status.code().unwrap_or(-1));
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every operation of the OpenAPI document, with the checks schemathesis
/// has (status codes, headers, content types and bodies as documented,
/// schema-valid requests accepted, invalid ones refused, undeclared methods
/// refused, authentication required, links followed), against a gateway in
/// front of a running pipeline: schemathesis finds nothing.
#[test]
fn the_gateway_answers_as_its_openapi_document_says() {
    let st = schemathesis();
    let seed = seed();
    let p = Pipeline::new(SimConfig::default(), GATEWAY_TOML);
    let _run = p.start("run");
    let state = temp_dir();
    let g = start_gateway(&p, "gw", state.path());
    wait_ready(&p, &g);

    // Finished tasks of each type, whose ids the read operations are given.
    let ids: Vec<String> = ["summarize", "classify", "extract"]
        .iter()
        .map(|t| submit_and_wait(&p, &g, &submission_of(t, "The quick brown fox jumps.")))
        .collect();

    let work = temp_dir();
    let config = work.path().join("schemathesis.toml");
    std::fs::write(&config, schemathesis_config(&ids)).unwrap();
    let spec = repo().join("docs/gateway-openapi.yaml");
    let mut cmd = Command::new(&st);
    cmd.current_dir(work.path())
        .env("NO_COLOR", "1")
        .env("COLUMNS", "120")
        .arg("--config-file")
        .arg(&config)
        .arg("run")
        .arg(&spec)
        .args(["--url", &format!("http://{}", g.addr)])
        .args(["--checks", "all"])
        .args([
            "--header",
            &format!("Authorization: Bearer {}", tenant_token(TENANT)),
        ])
        .args(["--max-examples", &MAX_EXAMPLES.to_string()])
        .args(["--seed", &seed.to_string()])
        .args(["--workers", "8"])
        // Between two reads of an answer (a long poll is held two seconds
        // at most, an event stream writes a keep-alive every second until
        // its task is final) far less than this passes.
        .args(["--request-timeout", "10"])
        .args(["--generation-database", "none"])
        // A loaded machine generating slowly is no finding.
        .args(["--suppress-health-check", "too_slow"])
        .arg("--no-color");
    let log = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gateway-schemathesis.log");
    let started = Instant::now();
    let code = run_until(cmd, &log, SCHEMATHESIS_DEADLINE);
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let took = started.elapsed();
    match code {
        Some(0) => {
            let summary: Vec<&str> = output.lines().rev().take(20).collect();
            eprintln!(
                "schemathesis passed in {took:.1?} (its output: {}):\n{}",
                log.display(),
                summary.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        Some(code) => panic!(
            "schemathesis found the gateway answering otherwise than docs/gateway-openapi.yaml \
             says (exit code {code}, after {took:.1?}, seed {seed}; output also in {}):\n{output}",
            log.display()
        ),
        None => panic!(
            "schemathesis did not finish in {SCHEMATHESIS_DEADLINE:?} (seed {seed}); its \
             output so far:\n{output}"
        ),
    }
}

/// A headless Chromium driven over the DevTools protocol on a pipe
/// (`--remote-debugging-pipe`: its fd 3 reads commands, fd 4 writes
/// answers and events, each a JSON message ended by a NUL byte).
///
/// Not `--dump-dom` with `--virtual-time-budget`: virtual time does not
/// wait for the event stream, so (whatever the budget) the DOM is dumped
/// within a second or two, the state still `submitting` or `pending`.
struct Browser {
    child: Child,
    commands: File,
    messages: Receiver<Value>,
    next_id: u64,
    /// Console messages and uncaught exceptions of the page.
    log: Vec<String>,
    stderr: PathBuf,
    _dir: tempfile::TempDir,
}

impl Browser {
    fn start() -> Browser {
        let chromium = chromium();
        let dir = temp_dir();
        let (to, from) = (dir.path().join("cdp-in"), dir.path().join("cdp-out"));
        for fifo in [&to, &from] {
            let ok = Command::new("mkfifo").arg(fifo).status().unwrap();
            assert!(ok.success(), "mkfifo {}", fifo.display());
        }
        let stderr = dir.path().join("chromium.log");
        let child = Command::new("sh")
            .arg("-c")
            .arg(r#"exec "$0" "$@" 3<"$CDP_IN" 4>"$CDP_OUT""#)
            .arg(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                "--window-size=1000,900",
                "--remote-debugging-pipe",
            ])
            .arg(format!(
                "--user-data-dir={}",
                dir.path().join("profile").display()
            ))
            .arg("about:blank")
            .env("CDP_IN", &to)
            .env("CDP_OUT", &from)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&stderr).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", chromium.display()));
        // Read and write: opening the command pipe does not wait for the
        // browser to open its end.
        let commands = File::options().read(true).write(true).open(&to).unwrap();
        let (tx, messages) = mpsc::channel();
        std::thread::spawn(move || {
            // Opened for reading only: its end is the browser's exit.
            let Ok(out) = File::open(&from) else { return };
            let mut out = BufReader::new(out);
            let mut buf = Vec::new();
            while out.read_until(0, &mut buf).is_ok_and(|n| n > 0) {
                if buf.last() == Some(&0) {
                    buf.pop();
                }
                if let Ok(v) = serde_json::from_slice::<Value>(&buf) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
                buf.clear();
            }
        });
        Browser {
            child,
            commands,
            messages,
            next_id: 0,
            log: Vec::new(),
            stderr,
            _dir: dir,
        }
    }

    /// What the browser printed, for failure messages.
    fn diagnostics(&self) -> String {
        let stderr = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        format!("page log: {:#?}\nchromium's stderr:\n{stderr}", self.log)
    }

    /// Sends a command (to the page's `session`, else to the browser) and
    /// returns its result.
    fn call(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        self.try_call(session, method, params)
            .unwrap_or_else(|e| panic!("{method}: {e}\n{}", self.diagnostics()))
    }

    /// [`Browser::call`], with the error the browser answered, if any.
    fn try_call(
        &mut self,
        session: Option<&str>,
        method: &str,
        params: Value,
    ) -> Result<Value, String> {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = s.into();
        }
        let mut bytes = serde_json::to_vec(&msg).unwrap();
        bytes.push(0);
        self.commands.write_all(&bytes).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let m = match self.messages.recv_timeout(left) {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => {
                    panic!(
                        "chromium did not answer {method} in 30 s\n{}",
                        self.diagnostics()
                    )
                }
                Err(RecvTimeoutError::Disconnected) => panic!(
                    "chromium exited ({:?}) before answering {method}\n{}",
                    self.child.try_wait(),
                    self.diagnostics()
                ),
            };
            if m["id"] == id {
                return match m.get("error") {
                    Some(e) => Err(e.to_string()),
                    None => Ok(m["result"].clone()),
                };
            }
            match m["method"].as_str() {
                Some("Runtime.consoleAPICalled") => self.log.push(format!(
                    "console.{}: {}",
                    m["params"]["type"].as_str().unwrap_or("?"),
                    m["params"]["args"]
                )),
                Some("Runtime.exceptionThrown") => self
                    .log
                    .push(format!("exception: {}", m["params"]["exceptionDetails"])),
                _ => {}
            }
        }
    }

    /// Evaluates `expression` in the page; returns its value.
    fn eval(&mut self, session: &str, expression: &str) -> Value {
        self.try_eval(session, expression)
            .unwrap_or_else(|e| panic!("{expression}: {e}\n{}", self.diagnostics()))
    }

    /// [`Browser::eval`], with why it failed (e.g. while the page loads,
    /// its context not there yet or gone).
    fn try_eval(&mut self, session: &str, expression: &str) -> Result<Value, String> {
        let r = self.try_call(
            Some(session),
            "Runtime.evaluate",
            json!({ "expression": expression, "returnByValue": true }),
        )?;
        match r.get("exceptionDetails") {
            Some(e) => Err(e.to_string()),
            None => Ok(r["result"]["value"].clone()),
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the page shows once it is done.
const READ_PAGE: &str = r#"JSON.stringify({
  taskId: document.getElementById("task-id").textContent,
  state: document.getElementById("state").textContent,
  error: document.getElementById("error").textContent,
  result: document.getElementById("result").textContent,
  resultHidden: document.getElementById("result").hidden,
  done: document.body.dataset.done || null
})"#;

/// Percent-encodes a URL fragment's value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The page at `/`, opened with a tenant's token and a task in its URL's
/// fragment and `autosubmit=1`, submits the task and shows its result as it
/// arrives over the event stream: the state `completed`, the task's id, and
/// the status with the result exactly as on the results topic.
#[test]
fn the_page_submits_a_task_and_watches_its_result_arrive() {
    let mut browser = Browser::start();
    let p = Pipeline::new(SimConfig::default(), GATEWAY_TOML);
    let _run = p.start("run");
    let state = temp_dir();
    let g = start_gateway(&p, "gw", state.path());
    wait_ready(&p, &g);

    let content = "Quarterly results: revenue grew 12 % & margins held <steady>.";
    let url = format!(
        "{}#token={}&type=summarize&content={}&autosubmit=1",
        g.url("/"),
        encode(&tenant_token(TENANT)),
        encode(content)
    );
    let target = browser.call(None, "Target.createTarget", json!({ "url": "about:blank" }));
    let attached = browser.call(
        None,
        "Target.attachToTarget",
        json!({ "targetId": target["targetId"], "flatten": true }),
    );
    let session = attached["sessionId"].as_str().unwrap().to_string();
    browser.call(Some(&session), "Runtime.enable", json!({}));
    let started = Instant::now();
    browser.call(Some(&session), "Page.navigate", json!({ "url": url }));
    let deadline = started + Duration::from_secs(60);
    let done = "document.body?.dataset.done === '1'";
    while browser.try_eval(&session, done) != Ok(Value::Bool(true)) {
        if Instant::now() > deadline {
            let shown = browser.try_eval(&session, READ_PAGE);
            panic!(
                "the page is not done after 60 s: {shown:?}\n{}",
                browser.diagnostics()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "the page was done {:.1?} after it was opened",
        started.elapsed()
    );
    let shown: Value =
        serde_json::from_str(browser.eval(&session, READ_PAGE).as_str().unwrap()).unwrap();
    let diagnostics = browser.diagnostics();
    assert_eq!(shown["done"], "1", "{shown}");
    assert_eq!(
        shown["error"], "",
        "the page shows an error: {shown}\n{diagnostics}"
    );
    assert_eq!(shown["state"], "completed", "{shown}\n{diagnostics}");
    assert_eq!(shown["resultHidden"], false, "{shown}");
    let task_id = shown["taskId"].as_str().unwrap().to_string();
    assert!(!task_id.is_empty(), "#task-id shows the task's id: {shown}");
    let status: Value = serde_json::from_str(shown["result"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("the result <pre> holds JSON ({e}): {shown}"));
    assert_eq!(status["taskId"], task_id, "{status}");
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(status["tenantId"], format!("tenant-{TENANT}"), "{status}");
    assert_eq!(status["taskType"], "summarize", "{status}");
    assert_eq!(status["result"]["taskId"], task_id, "{status}");
    // It came over the event stream, not a status read (the page's fallback).
    let requests = |endpoint: &str| {
        metric(
            &p,
            &g,
            &format!("sluice_gateway_requests_total{{endpoint=\"{endpoint}\",status=\"200\"}}"),
        )
    };
    assert_eq!(
        requests("/v1/tasks/{id}/events"),
        1.0,
        "one event stream read"
    );
    assert_eq!(requests("/v1/tasks/{id}"), 0.0, "no status read");

    // A picture of the page as it ended, whole.
    let metrics = browser.call(Some(&session), "Page.getLayoutMetrics", json!({}));
    let size = &metrics["cssContentSize"];
    let shot = browser.call(
        Some(&session),
        "Page.captureScreenshot",
        json!({
            "format": "png",
            "captureBeyondViewport": true,
            "clip": { "x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1 },
        }),
    );
    // The DevTools protocol's binary data is standard base64.
    let png = base64::engine::general_purpose::STANDARD
        .decode(shot["data"].as_str().expect("screenshot data"))
        .expect("base64 screenshot");
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gateway-page.png");
    std::fs::write(&path, &png).unwrap();
    eprintln!("screenshot of the page: {}", path.display());
    let _ = browser.call(None, "Browser.close", json!({}));
    let written = std::fs::read(&path).unwrap();
    assert!(
        written.len() > 1000 && written.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is a PNG image ({} bytes)",
        path.display(),
        written.len()
    );
    let (width, height) = (
        u32::from_be_bytes(written[16..20].try_into().unwrap()),
        u32::from_be_bytes(written[20..24].try_into().unwrap()),
    );
    assert!(
        width >= 500 && height >= 500,
        "a page-sized image: {width}x{height}"
    );

    // The page shows the result as the pipeline wrote it.
    let on_topic: HashMap<String, Value> = p
        .results(1, Duration::from_secs(60))
        .into_iter()
        .map(|(r, m)| {
            (
                r.task_id,
                serde_json::from_slice(m.payload().unwrap()).unwrap(),
            )
        })
        .collect();
    let result = on_topic
        .get(&task_id)
        .unwrap_or_else(|| panic!("no result of {task_id} on the results topics: {on_topic:?}"));
    assert_eq!(result["taskId"], task_id);
    assert_eq!(
        status["result"]["output"], result["output"],
        "the output shown"
    );
    assert_eq!(
        &status["result"], result,
        "the page shows the result record as written"
    );
    assert_eq!(result["success"], true, "{result}");
}
