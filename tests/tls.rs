//! Sluice against the broker's own TLS listeners (`make test` starts the
//! broker with an `SSL` and a `SASL_SSL` listener, SCRAM-SHA-512): every
//! client it creates (the topic creation, the start-up checks, the engine's)
//! speaks TLS with the configured CA and authenticates with the configured
//! credentials; with a CA that did not sign the broker's certificate, or a
//! wrong password, it stops at start-up saying so, and loses nothing.

mod common;

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
            .collect(),
    }
}

/// The SASL_SSL listener with SCRAM-SHA-512 and the right password.
fn sasl_cluster(l: &Listeners) -> Cluster {
    cluster(
        &l.sasl_ssl,
        &[
            ("security.protocol", "sasl_ssl"),
            ("ssl.ca.location", &l.ca),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", &l.user),
            ("sasl.password", &l.password),
        ],
    )
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
    let sasl = sasl_cluster(&l);
    let p = Pipeline::over(sasl, sim(), UNBATCHED);
    let tasks = classify_tasks(40);
    p.produce(&tasks);

    let wrong = config_with(&p, "wrong-password.toml", &l.password, "not-the-password");
    stops_at_start(&wrong, &l.sasl_ssl, "Authentication failed");
    every_task_answered_once(&p, &tasks, "sasl");
}

/// Where `needle` shows up in what a run left behind: its log, its stdout,
/// its metrics, and every record (key, value, headers) of every topic it
/// wrote, aborted transactions included.
struct Leaks {
    places: Vec<String>,
}

impl Leaks {
    fn scan(haystacks: &[(String, Vec<u8>)], needles: &[&str]) -> Leaks {
        let mut places = Vec::new();
        for (place, bytes) in haystacks {
            for needle in needles {
                if bytes.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                    places.push(format!("{needle:?} in {place}"));
                }
            }
        }
        Leaks { places }
    }
}

/// Every record of every topic whose name contains `prefix`.
fn records_of(cluster: &Cluster, prefix: &str) -> Vec<(String, Vec<u8>)> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    let consumer: BaseConsumer = sluice::kafka::base(cluster.clone())
        .set("group.id", format!("hygiene-{}", uuid::Uuid::new_v4()))
        .create()
        .unwrap();
    let md = consumer
        .fetch_metadata(None, Duration::from_secs(10))
        .unwrap();
    let topics: Vec<String> = md
        .topics()
        .iter()
        .map(|t| t.name().to_string())
        .filter(|t| t.contains(prefix))
        .collect();
    assert!(topics.len() >= 4, "the run's topics: {topics:?}");
    let mut out = Vec::new();
    sluice::kafka::read_existing(
        cluster.clone(),
        &topics,
        sluice::kafka::Start::Beginning,
        false,
        |m| {
            let place = format!("{}[{}]@{}", m.topic(), m.partition(), m.offset());
            let mut bytes = m.key().unwrap_or_default().to_vec();
            bytes.extend_from_slice(m.payload().unwrap_or_default());
            if let Some(h) = m.headers() {
                for header in h.iter() {
                    bytes.extend_from_slice(header.key.as_bytes());
                    bytes.extend_from_slice(header.value.unwrap_or_default());
                }
            }
            out.push((place, bytes));
            sluice::kafka::Flow::Next
        },
    )
    .unwrap();
    out
}

/// The level of a log line of the default format (`<time> <LEVEL> <target>:
/// …`), colour codes removed.
fn level_of(line: &str) -> String {
    let plain = regex::Regex::new("\x1b\\[[0-9;]*m")
        .unwrap()
        .replace_all(line, "");
    plain.split_whitespace().nth(1).unwrap_or("").to_string()
}

/// The provider key (from the environment) and the Kafka password (from a
/// file) reach the provider and the broker, and nowhere else: not the log
/// at trace level, not stdout, metrics, results, dead letters (their
/// headers included), usage, alerts, changelogs or any other record the run
/// wrote. Prompt text appears in the log only at debug and trace.
#[test]
fn secrets_reach_only_their_servers_and_prompts_stay_below_info() {
    let l = listeners();
    let provider_key = format!("sk-hygiene-{}", uuid::Uuid::new_v4().simple());
    let sasl = sasl_cluster(&l);
    // The provider takes only this key, refuses some contents (failed
    // results, dead letters) and fails some calls (retries).
    let sim = SimConfig::from_json_value(serde_json::json!({
        "api_keys": [provider_key],
        "error_rate": 0.2,
        "content_policy_marker": "FORBIDDEN",
    }))
    .unwrap();
    let p = Pipeline::over(sasl.clone(), sim, UNBATCHED);
    let password_file = p.config.with_file_name("kafka-password");
    std::fs::write(&password_file, format!("{}\n", l.password)).unwrap();
    p.edit_config(&[
        (
            &format!("\"sasl.password\" = {:?}", l.password),
            &format!(
                "\"sasl.password_file\" = {:?}",
                password_file.display().to_string()
            ),
        ),
        (
            "name = \"sim\"\n",
            "name = \"sim\"\napi_key_env = \"SLUICE_TEST_PROVIDER_KEY\"\n",
        ),
    ]);

    let marker = format!("PROMPT-{}", uuid::Uuid::new_v4().simple());
    let mut tasks = classify_tasks(30);
    for (i, t) in tasks.iter_mut().enumerate() {
        t.content = format!(
            "{marker} {i} {}",
            if i % 10 == 0 { "FORBIDDEN" } else { "" }
        );
    }
    p.produce(&tasks);
    let poison = sluice::kafka::OutRecord {
        key: Some(b"acme".to_vec()),
        value: Some(
            format!(
                "{{\"taskId\": \"poison-1\", \"payload\": {{\"content\": \"{marker}\"}}, not json"
            )
            .into_bytes(),
        ),
        ..Default::default()
    };
    sluice::kafka::produce(sasl.clone(), &p.topic("classify"), vec![poison]).unwrap();

    let mut app = p.start_logged(
        "hygiene",
        &p.config,
        &[
            ("SLUICE_TEST_PROVIDER_KEY", &provider_key),
            ("SLUICE_LOG", "trace"),
        ],
        false,
        true,
    );
    let results = p.results(tasks.len(), Duration::from_secs(120));
    assert_each_answered_once(&tasks, &results);
    assert!(
        results.iter().any(|(r, _)| !r.success),
        "some tasks were refused"
    );
    assert!(results.iter().any(|(r, _)| r.success), "some answered");
    let (_, metrics) = p.http(&app, "/metrics");
    let (_, usage) = p.http(&app, "/v1/tenants/acme/usage");
    app.proc.stop();

    let log = app.proc.log();
    assert!(
        log.len() > 100 && log.iter().any(|l| level_of(l) == "TRACE"),
        "a trace-level log was written ({} lines)",
        log.len()
    );
    let mut haystacks: Vec<(String, Vec<u8>)> = log
        .iter()
        .enumerate()
        .map(|(i, l)| (format!("log line {i}: {l}"), l.clone().into_bytes()))
        .collect();
    haystacks.push(("stdout".into(), app.proc.lines().join("\n").into_bytes()));
    haystacks.push(("/metrics".into(), metrics.into_bytes()));
    haystacks.push(("usage".into(), usage.into_bytes()));
    let records = records_of(&sasl, &p.prefix);
    assert!(
        records.len() > tasks.len(),
        "the run's records: {}",
        records.len()
    );
    haystacks.extend(records);
    let leaks = Leaks::scan(&haystacks, &[&provider_key, &l.password]);
    assert!(
        leaks.places.is_empty(),
        "secrets written: {:#?}",
        leaks.places
    );

    // Prompts: in the log only at debug or trace (and the test's marker
    // shows it looked where prompts would be).
    let prompt_lines: Vec<&String> = log.iter().filter(|l| l.contains(&marker)).collect();
    let loud: Vec<&&String> = prompt_lines
        .iter()
        .filter(|l| !matches!(level_of(l).as_str(), "DEBUG" | "TRACE"))
        .collect();
    assert!(loud.is_empty(), "prompt text logged above debug: {loud:#?}");
}
