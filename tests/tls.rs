//! Sluice against a cluster reachable only over TLS (the test broker behind
//! stunnel, started by `make test`): every client it creates (the topic
//! creation, the start-up checks, the engine's) speaks TLS with the
//! configured CA; with a CA that did not sign the broker's certificate it
//! stops at start-up saying so, and loses nothing.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::pipeline::*;
use sluice::kafka::Cluster;
use sluice::sim::SimConfig;

/// The TLS broker `make test` started: bootstrap, its CA, another CA.
fn tls() -> (String, String, String) {
    let v = std::env::var("SLUICE_TEST_TLS").unwrap_or_else(|_| {
        panic!("SLUICE_TEST_TLS is not set: run the tests with `make test`, which starts the TLS broker")
    });
    let mut parts = v.split_whitespace().map(str::to_string);
    let mut next = || {
        parts
            .next()
            .expect("SLUICE_TEST_TLS: BOOTSTRAP CA OTHER_CA")
    };
    (next(), next(), next())
}

fn over_tls(bootstrap: &str, ca: &str) -> Cluster {
    Cluster {
        bootstrap: bootstrap.to_string(),
        client: BTreeMap::from([
            ("security.protocol".to_string(), "ssl".to_string()),
            ("ssl.ca.location".to_string(), ca.to_string()),
        ]),
    }
}

#[test]
fn tasks_flow_over_tls_and_a_wrong_ca_stops_start_up_losing_nothing() {
    let (bootstrap, ca, other_ca) = tls();
    let sim = SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 20 },
    }))
    .unwrap();
    // `sluice topics create` runs over TLS here.
    let p = Pipeline::over(over_tls(&bootstrap, &ca), sim, UNBATCHED);
    let tasks = classify_tasks(40);
    p.produce(&tasks);

    // The wrong CA: start-up fails, naming the failed verification.
    let text = std::fs::read_to_string(&p.config).unwrap();
    assert!(text.contains(&ca));
    let wrong = p.config.with_file_name("wrong-ca.toml");
    std::fs::write(&wrong, text.replace(&ca, &other_ca)).unwrap();
    for command in [&["run"][..], &["topics", "create"]] {
        let mut child = std::process::Command::new(common::sluice_bin())
            .args(command)
            .args(["--config", &wrong.display().to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > Duration::from_secs(90) {
                child.kill().unwrap();
                panic!("{command:?} with the wrong CA did not stop");
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "{command:?}: {err}");
        assert!(
            err.contains("certificate verify failed") && err.contains(&bootstrap),
            "{command:?}: the error says why: {err}"
        );
    }

    // The right CA: every task is answered, exactly once.
    let mut app = p.start("tls");
    let results = p.results(tasks.len(), Duration::from_secs(120));
    assert_each_answered_once(&tasks, &results);
    assert!(results.iter().all(|(r, _)| r.success), "all completed");
    app.proc.stop();
}
