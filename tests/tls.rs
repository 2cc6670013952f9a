//! Sluice against the broker's own TLS listeners (`make test` starts the
//! broker with an `SSL` and a `SASL_SSL` listener, SCRAM-SHA-512): every
//! client it creates (the topic creation, the start-up checks, the engine's)
//! speaks TLS with the configured CA and authenticates with the configured
//! credentials; with a CA that did not sign the broker's certificate, or a
//! wrong password, it stops at start-up saying so, and loses nothing.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::pipeline::*;
use sluice::kafka::Cluster;
use sluice::sim::SimConfig;

/// The TLS listeners of the broker `make test` started.
struct Listeners {
    ssl: String,
    sasl_ssl: String,
    ca: String,
    other_ca: String,
    user: String,
    password: String,
}

fn listeners() -> Listeners {
    let v = std::env::var("SLUICE_TEST_TLS").unwrap_or_else(|_| {
        panic!(
            "SLUICE_TEST_TLS is not set: run the tests with `make test`, which starts the broker"
        )
    });
    let parts: Vec<String> = v.split_whitespace().map(str::to_string).collect();
    let [ssl, sasl_ssl, ca, other_ca, user, password] = <[String; 6]>::try_from(parts)
        .expect("SLUICE_TEST_TLS: SSL_BOOTSTRAP SASL_SSL_BOOTSTRAP CA OTHER_CA USER PASSWORD");
    Listeners {
        ssl,
        sasl_ssl,
        ca,
        other_ca,
        user,
        password,
    }
}

fn cluster(bootstrap: &str, props: &[(&str, &str)]) -> Cluster {
    Cluster {
        bootstrap: bootstrap.to_string(),
        client: props
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>(),
    }
}

fn sim() -> SimConfig {
    SimConfig::from_json_value(serde_json::json!({
        "latency": { "kind": "uniform", "min_ms": 5, "max_ms": 20 },
    }))
    .unwrap()
}

/// `sluice run` and `sluice topics create` with `config` stop at start-up,
/// and what they print names the broker and contains `cause`.
fn stops_at_start(config: &Path, bootstrap: &str, cause: &str) {
    for command in [&["run"][..], &["topics", "create"]] {
        let mut child = std::process::Command::new(common::sluice_bin())
            .args(command)
            .args(["--config", &config.display().to_string()])
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
                panic!("{command:?} with {} did not stop", config.display());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "{command:?}: {err}");
        assert!(
            err.contains(cause) && err.contains(bootstrap),
            "{command:?}: the error says why ({cause}) and where: {err}"
        );
    }
}

/// Writes a copy of the pipeline's config with `from` replaced by `to`.
fn config_with(p: &Pipeline, name: &str, from: &str, to: &str) -> std::path::PathBuf {
    let text = std::fs::read_to_string(&p.config).unwrap();
    assert!(text.contains(from), "the config holds {from}");
    let path = p.config.with_file_name(name);
    std::fs::write(&path, text.replace(from, to)).unwrap();
    path
}

/// Tasks produced before the failed starts are all answered, once each,
/// by an instance with the right settings.
fn every_task_answered_once(p: &Pipeline, tasks: &[Task], name: &str) {
    let mut app = p.start(name);
    let results = p.results(tasks.len(), Duration::from_secs(120));
    assert_each_answered_once(tasks, &results);
    assert!(results.iter().all(|(r, _)| r.success), "all completed");
    app.proc.stop();
}

#[test]
fn tasks_flow_over_tls_and_a_wrong_ca_stops_start_up_losing_nothing() {
    let l = listeners();
    let tls = cluster(
        &l.ssl,
        &[("security.protocol", "ssl"), ("ssl.ca.location", &l.ca)],
    );
    // `sluice topics create` runs over TLS here.
    let p = Pipeline::over(tls, sim(), UNBATCHED);
    let tasks = classify_tasks(40);
    p.produce(&tasks);

    let wrong = config_with(&p, "wrong-ca.toml", &l.ca, &l.other_ca);
    stops_at_start(&wrong, &l.ssl, "certificate verify failed");
    every_task_answered_once(&p, &tasks, "tls");
}

#[test]
fn tasks_flow_over_sasl_scram_and_a_wrong_password_stops_start_up_losing_nothing() {
    let l = listeners();
    let sasl = cluster(
        &l.sasl_ssl,
        &[
            ("security.protocol", "sasl_ssl"),
            ("ssl.ca.location", &l.ca),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", &l.user),
            ("sasl.password", &l.password),
        ],
    );
    let p = Pipeline::over(sasl, sim(), UNBATCHED);
    let tasks = classify_tasks(40);
    p.produce(&tasks);

    let wrong = config_with(&p, "wrong-password.toml", &l.password, "not-the-password");
    stops_at_start(&wrong, &l.sasl_ssl, "Authentication failed");
    every_task_answered_once(&p, &tasks, "sasl");
}
