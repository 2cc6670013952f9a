//! The Grafana dashboard (`helm/sluice/files/dashboard.json`) and the metrics
//! reference (`docs/metrics.md`) name only metrics Sluice exports, and the
//! reference names every one of them. The exported names come from the
//! code: `sluice::cli::metrics_catalog::register_all` registers the app's metric
//! families into a fresh registry and reads their names back. No broker.

use std::collections::BTreeSet;

use prometheus::Registry;

/// Series suffixes of a histogram family.
const HISTOGRAM_SUFFIXES: [&str; 3] = ["_bucket", "_sum", "_count"];

fn exported() -> BTreeSet<String> {
    let names = sluice::cli::metrics_catalog::register_all(&Registry::new())
        .expect("the app's metrics register into a fresh registry");
    assert!(
        names.len() > 30,
        "suspiciously few metric families: {names:?}"
    );
    names.into_iter().collect()
}

fn read(relative: &str) -> String {
    // Where cargo runs the tests from (the compile-time path may be another
    // checkout's that built into the same target directory).
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    let path = root.join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `sluice_…` metric name in a text (a name is `[a-z0-9_]` after the
/// prefix, and the prefix starts a word).
fn names_in(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("sluice_") {
        let start = i + at;
        let word_start = start == 0 || {
            let b = bytes[start - 1];
            !(b.is_ascii_alphanumeric() || b == b'_')
        };
        let mut end = start + "sluice_".len();
        while end < bytes.len()
            && (bytes[end].is_ascii_lowercase()
                || bytes[end].is_ascii_digit()
                || bytes[end] == b'_')
        {
            end += 1;
        }
        if word_start && end > start + "sluice_".len() {
            out.insert(text[start..end].trim_end_matches('_').to_string());
        }
        i = end;
    }
    out
}

/// The family a series name belongs to: itself when exported, else without
/// a histogram suffix.
fn family<'a>(series: &'a str, exported: &BTreeSet<String>) -> &'a str {
    if exported.contains(series) {
        return series;
    }
    HISTOGRAM_SUFFIXES
        .iter()
        .find_map(|s| series.strip_suffix(s))
        .unwrap_or(series)
}

/// Names in `text` that are no exported family.
fn unknown(text: &str, exported: &BTreeSet<String>) -> Vec<String> {
    names_in(text)
        .iter()
        .filter(|n| !exported.contains(family(n, exported)))
        .cloned()
        .collect()
}

/// Problems of a dashboard: not a Grafana dashboard, or a query naming a
/// metric Sluice does not export.
fn dashboard_problems(json: &str, exported: &BTreeSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    let v: serde_json::Value = match serde_json::from_str(json) {
        Ok(v) => v,
        Err(e) => return vec![format!("not JSON: {e}")],
    };
    let panels = v["panels"].as_array().map(Vec::len).unwrap_or(0);
    if panels == 0 {
        problems.push("no panels".into());
    }
    if v["title"].as_str().is_none_or(str::is_empty) {
        problems.push("no title".into());
    }
    let datasource_var = v["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| {
            t["type"] == "datasource" && t["query"] == "prometheus" && t["name"] == "datasource"
        });
    if !datasource_var {
        problems.push("no templated Prometheus datasource variable `datasource`".into());
    }
    for name in unknown(json, exported) {
        problems.push(format!("names `{name}`, which Sluice does not export"));
    }
    problems
}

/// Problems of the metrics reference: a table row per exported family, and
/// no name of a metric that does not exist (in the tables or the prose).
fn docs_problems(markdown: &str, exported: &BTreeSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut rows = BTreeSet::new();
    for line in markdown.lines() {
        let line = line.trim();
        if !line.starts_with('|') {
            continue;
        }
        let first = line.trim_start_matches('|').split('|').next().unwrap_or("");
        for name in names_in(first) {
            if !rows.insert(name.clone()) {
                problems.push(format!("`{name}` has more than one row"));
            }
        }
    }
    for name in exported.difference(&rows) {
        problems.push(format!("no row for the exported metric `{name}`"));
    }
    for name in unknown(markdown, exported) {
        problems.push(format!("names `{name}`, which Sluice does not export"));
    }
    problems
}

#[test]
fn the_dashboard_names_only_exported_metrics() {
    let exported = exported();
    let problems = dashboard_problems(&read("helm/sluice/files/dashboard.json"), &exported);
    assert!(
        problems.is_empty(),
        "helm/sluice/files/dashboard.json:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_alert_rules_name_only_exported_metrics() {
    let exported = exported();
    let rules = read("helm/sluice/templates/prometheusrule.yaml");
    let named = names_in(&rules);
    assert!(
        named.len() >= 7,
        "the alert rules name too few metrics: {named:?}"
    );
    let problems = unknown(&rules, &exported);
    assert!(
        problems.is_empty(),
        "helm/sluice/templates/prometheusrule.yaml names metrics Sluice does not export: {problems:?}"
    );
}

#[test]
fn the_reference_lists_every_exported_metric_and_no_other() {
    let exported = exported();
    let problems = docs_problems(&read("docs/metrics.md"), &exported);
    assert!(
        problems.is_empty(),
        "docs/metrics.md:\n  {}",
        problems.join("\n  ")
    );
}

/// The checks themselves catch what they are for.
#[test]
fn the_checks_catch_bogus_and_missing_names() {
    let exported = exported();
    let dashboard = read("helm/sluice/files/dashboard.json");
    let bogus = dashboard.replacen("sluice_records_in_total", "sluice_records_inn_total", 1);
    assert_ne!(bogus, dashboard, "the dashboard shows records in");
    let problems = dashboard_problems(&bogus, &exported);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("sluice_records_inn_total")),
        "{problems:?}"
    );
    // A histogram's series are its family's; a suffix does not make a name real.
    assert!(unknown("rate(sluice_llm_latency_seconds_bucket[5m])", &exported).is_empty());
    assert_eq!(
        unknown("rate(sluice_made_up_seconds_bucket[5m])", &exported),
        vec!["sluice_made_up_seconds_bucket".to_string()]
    );

    let docs = read("docs/metrics.md");
    let missing: String = docs
        .lines()
        .filter(|l| !l.trim_start().starts_with("| `sluice_consumer_lag`"))
        .collect::<Vec<_>>()
        .join("\n");
    assert_ne!(
        missing.len(),
        docs.len(),
        "docs/metrics.md has a consumer lag row"
    );
    assert!(docs_problems(&missing, &exported)
        .iter()
        .any(|p| p.contains("no row for the exported metric `sluice_consumer_lag`")));
    let extra = format!("{docs}\n| `sluice_made_up_total` | counter | | | |\n");
    assert!(docs_problems(&extra, &exported)
        .iter()
        .any(|p| p.contains("sluice_made_up_total")));
}
