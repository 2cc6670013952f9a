//! The command line without a broker: a bad configuration stops `sluice run`
//! with exit code 2 and a message naming the key; the binary serves the C
//! libraries' allocations with its own allocator.

mod common;

use sluice::config::MINIMAL as VALID;
use std::process::Command;

fn run_with_config(text: &str) -> (Option<i32>, String) {
    sluice_with_config(&["run"], text)
}

/// Runs `sluice <command> --config FILE` with `text` as the file.
fn sluice_with_config(command: &[&str], text: &str) -> (Option<i32>, String) {
    let dir = common::temp_dir();
    let path = dir.path().join("sluice.toml");
    std::fs::write(&path, text).unwrap();
    let out = Command::new(common::sluice_bin())
        .args(command)
        .args(["--config", &path.display().to_string()])
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn kafka_client_settings_reach_the_start_up_checks_and_topic_creation() {
    // A property librdkafka refuses: a client built from the bootstrap
    // address alone would instead try the (unreachable) broker.
    let text = format!("{VALID}\n[kafka.client]\n\"socket.timeout.ms\" = \"soon\"\n");
    for command in [&["run"][..], &["topics", "create"]] {
        let (code, err) = sluice_with_config(command, &text);
        assert_ne!(code, Some(0), "{command:?}: {err}");
        assert!(err.contains("socket.timeout.ms"), "{command:?}: {err}");
    }
}

#[test]
fn unknown_key_exits_2_naming_it() {
    let (code, err) = run_with_config(&format!("{VALID}\n[app]\nguaranty = \"exactly_once\"\n"));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("app") && err.contains("guaranty"), "{err}");
}

#[test]
fn wrong_type_exits_2_naming_the_key() {
    let (code, err) = run_with_config(&format!("{VALID}\n[tasks]\nmax_attempts = \"three\"\n"));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("tasks.max_attempts"), "{err}");
}

#[test]
fn a_bad_partitioner_or_advertised_url_exits_2_naming_the_key() {
    let (code, err) = run_with_config(&format!("{VALID}\n[tasks]\npartitioner = \"fnv1a\"\n"));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("tasks.partitioner"), "{err}");
    let (code, err) = run_with_config(&format!(
        "{VALID}\n[http]\nadvertised_url = \"sluice-0:8080\"\n"
    ));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("http.advertised_url"), "{err}");
}

#[test]
fn usage_without_an_instance_fails_with_the_reason() {
    let out = Command::new(common::sluice_bin())
        .args(["usage", "acme", "--url", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("sluice: "), "{err}");
}

#[test]
fn a_model_without_a_price_exits_2_naming_it() {
    let (code, err) = run_with_config(&format!(
        "{VALID}\n[[llm.models]]\nname = \"large\"\nprovider = \"sim\"\n"
    ));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("prices.large"), "{err}");
}

#[test]
fn dangling_reference_exits_2_naming_the_key() {
    let (code, err) = run_with_config(&format!(
        "{VALID}\n[routing]\nfallbacks = {{ small = \"huge\" }}\n"
    ));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("routing.fallbacks.small"), "{err}");
}

#[test]
fn missing_api_key_exits_2_without_printing_a_secret() {
    let text = VALID.replace(
        "base_url = \"http://127.0.0.1:1/v1\"",
        "base_url = \"http://127.0.0.1:1/v1\"\napi_key_env = \"SLUICE_CLI_TEST_UNSET_KEY\"",
    );
    let (code, err) = run_with_config(&text);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("SLUICE_CLI_TEST_UNSET_KEY"), "{err}");
}

/// The C libraries' allocations (librdkafka's per-message ones, RocksDB's)
/// go to mimalloc too: the binary defines `malloc` and `free` itself
/// (mimalloc's `override`), and the dynamic linker binds the C library's own
/// calls to them (glibc's `LD_DEBUG=bindings` prints each binding).
#[test]
fn the_binary_serves_c_allocations_itself() {
    let bin = common::sluice_bin();
    let out = Command::new(&bin)
        .arg("--help")
        .env("LD_DEBUG", "bindings")
        .output()
        .unwrap();
    assert!(out.status.success());
    let log = String::from_utf8_lossy(&out.stderr);
    let name = bin.file_name().unwrap().to_string_lossy().into_owned();
    for symbol in ["malloc", "free"] {
        let bound_here = log.lines().any(|l| {
            l.contains("binding file /")
                && l.contains("libc.so")
                && l.contains(&format!("{name} [0]: normal symbol `{symbol}'"))
        });
        assert!(
            bound_here,
            "libc's {symbol} is not bound to the binary's own (mimalloc built without `override`?)"
        );
    }
}
