//! Shared helpers for the integration tests: the broker the test command
//! started, unique names, and fixture processes of the `sluice` binary.
#![allow(dead_code)]

pub mod engine;
pub mod gateway;
pub mod pipeline;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The bootstrap address of the test broker. `make test` starts one; running
/// `cargo test` alone fails here with instructions.
pub fn bootstrap() -> String {
    std::env::var("SLUICE_TEST_BOOTSTRAP").unwrap_or_else(|_| {
        panic!("SLUICE_TEST_BOOTSTRAP is not set: run the tests with `make test`, which installs and starts the broker")
    })
}

/// A unique name for topics, groups and transactional ids.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// A fresh temporary directory (removed on drop).
pub fn temp_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

/// The repository: where cargo runs the tests from (its environment names it
/// at run time; the compile-time path may be that of another checkout that
/// built into the same target directory).
pub fn repo_root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The `sluice` binary built for these tests.
pub fn sluice_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sluice"))
}

/// A running `sluice` process whose stdout lines (and, when asked,
/// stderr lines: its log) are collected.
pub struct Proc {
    pub child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    log: Option<Arc<Mutex<Vec<String>>>>,
    pub name: String,
}

impl Proc {
    /// Starts `sluice <args>`.
    pub fn spawn(name: &str, args: &[String]) -> Proc {
        Self::spawn_env(name, args, &[])
    }

    /// Starts `sluice <args>` with extra environment variables.
    pub fn spawn_env(name: &str, args: &[String], env: &[(&str, &str)]) -> Proc {
        Self::spawn_logged(name, args, env, false)
    }

    /// Starts `sluice <args>` with extra environment variables, keeping its
    /// log lines when `keep_log` (see [`Proc::log`]).
    pub fn spawn_logged(name: &str, args: &[String], env: &[(&str, &str)], keep_log: bool) -> Proc {
        let mut child = Command::new(sluice_bin())
            .args(args)
            .env(
                "SLUICE_LOG",
                std::env::var("SLUICE_LOG").unwrap_or_else(|_| "warn,sluice_topology=info".into()),
            )
            // The caller's own (a log level too) win.
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn sluice");
        // Its log, tagged, in the test's own output (shown when it fails).
        let err = child.stderr.take().expect("stderr piped");
        let tag = name.to_string();
        let log = keep_log.then(|| Arc::new(Mutex::new(Vec::new())));
        let log_sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                match &log_sink {
                    Some(sink) => sink.lock().unwrap().push(line),
                    None => eprintln!("[{tag}] {line}"),
                }
            }
        });
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().expect("stdout piped");
        let sink = lines.clone();
        let tag = name.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                eprintln!("[{tag}] {line}");
                sink.lock().unwrap().push(line);
            }
        });
        Proc {
            child,
            lines,
            log,
            name: name.to_string(),
        }
    }

    /// Its log lines so far (stderr; kept only when started with
    /// `keep_log`, which does not echo them).
    pub fn log(&self) -> Vec<String> {
        self.log
            .as_ref()
            .map(|l| l.lock().unwrap().clone())
            .unwrap_or_default()
    }

    /// Lines printed so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits until a printed line satisfies `pred`.
    pub fn wait_line(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(l) = self.lines().into_iter().find(|l| pred(l)) {
                return Some(l);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// The tasks of the last `TASKS` line.
    pub fn tasks(&self) -> Vec<String> {
        self.lines()
            .iter()
            .rev()
            .find(|l| l.starts_with("TASKS "))
            .map(|l| {
                l["TASKS ".len()..]
                    .split_whitespace()
                    .next()
                    .unwrap_or("")
                    .split(',')
                    .filter(|s| !s.is_empty() && !s.starts_with("ready="))
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// True once the last `TASKS` line says ready.
    pub fn ready(&self) -> bool {
        self.lines()
            .iter()
            .rev()
            .find(|l| l.starts_with("TASKS "))
            .is_some_and(|l| l.ends_with("ready=true"))
    }

    /// Kills the process with SIGKILL.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM without waiting (see [`Proc::stop`]).
    pub fn terminate(&self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
    }

    /// Sends SIGTERM and waits; returns the parsed `STATS` line.
    pub fn stop(&mut self) -> serde_json::Value {
        self.terminate();
        let deadline = Instant::now() + Duration::from_secs(90);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::thread::sleep(Duration::from_millis(200));
        self.lines()
            .iter()
            .rev()
            .find_map(|l| {
                l.strip_prefix("STATS ")
                    .map(|j| serde_json::from_str(j).expect("stats json"))
            })
            .unwrap_or(serde_json::Value::Null)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` until it returns `Some`, or panics after `timeout` with `what`.
pub fn eventually<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A broker of this test's own, stopped (and its log directory removed)
/// when dropped; with `SLUICE_KEEP_BROKER` set it is left running (resumed if
/// stalled), its name and address printed, to inspect what a failing test
/// left on it (`scripts/broker.sh stop <name>` ends it).
pub struct OwnBroker {
    pub name: String,
    pub bootstrap: String,
}

fn broker_script() -> PathBuf {
    repo_root().join("scripts/broker.sh")
}

impl OwnBroker {
    pub fn start() -> OwnBroker {
        let name = unique("faults");
        let out = Command::new(broker_script())
            .args(["start", &name])
            .output()
            .expect("scripts/broker.sh runs");
        assert!(
            out.status.success(),
            "broker start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let bootstrap = String::from_utf8(out.stdout).unwrap().trim().to_string();
        OwnBroker { name, bootstrap }
    }

    /// Sends `signal` to the broker's process: whether it was delivered.
    fn try_signal(&self, signal: &str) -> bool {
        let pid_file = repo_root().join(".tools/run").join(&self.name).join("pid");
        let Ok(pid) = std::fs::read_to_string(pid_file) else {
            return false;
        };
        Command::new("kill")
            .args([signal, pid.trim()])
            .status()
            .is_ok_and(|s| s.success())
    }

    fn signal(&self, signal: &str) {
        assert!(
            self.try_signal(signal),
            "kill {signal} of broker {}",
            self.name
        );
    }

    /// SIGKILL: the broker dies without closing anything.
    pub fn kill(&self) {
        self.signal("-KILL");
    }

    /// SIGSTOP: the broker stalls, its connections open, answering nothing.
    pub fn stall(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT: a stalled broker goes on.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Starts it again on the same ports and log directory.
    pub fn restart(&self) {
        let out = Command::new(broker_script())
            .args(["restart", &self.name])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "broker restart: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        // A stalled broker would not stop.
        self.try_signal("-CONT");
        if std::env::var("SLUICE_KEEP_BROKER").is_ok() {
            eprintln!("KEPT BROKER {} {}", self.name, self.bootstrap);
            return;
        }
        let _ = Command::new(broker_script())
            .args(["stop", &self.name])
            .status();
    }
}
