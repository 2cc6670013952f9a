//! `docs/configuration.md` documents every key `sluice run --config` accepts.
//!
//! The keys come from the code, not from a list kept by hand: the test
//! serializes a configuration (every non-`Option` key, with its default) and
//! then asks the deserializer itself which keys each table takes. Every
//! section rejects unknown keys, so putting a probe key into a table makes
//! serde answer "unknown field `…`, expected one of `a`, `b`, …": the full
//! list of that struct's fields, `Option`s included. A table that accepts the
//! probe is a free-form map (`prices.<model>`, `kafka.client.<property>`, …);
//! the value type behind it is probed the same way. Keys absent from the
//! serialized config (`None` options) are tried as a table and as an array of
//! tables to find out whether they have keys of their own.
//!
//! Each key's last segment must then appear in `docs/configuration.md`, in
//! the first column of a table row of the section that holds it: the heading
//! naming the longest prefix of the key (`[llm.models.limiter]` for
//! `llm.models[].limiter.initial_rps`), or the key's own heading.

use sluice::config::Config;
use sluice::config::MINIMAL as BASE;
use toml::Value;

const PROBE: &str = "__sluice_doc_probe__";
const ENTRY: &str = "__sluice_doc_entry__";

/// One step of a key path.
#[derive(Clone, Debug, PartialEq)]
enum Seg {
    /// A named key of a struct.
    Key(String),
    /// The first element of an array of tables (`[[…]]`).
    Elem,
    /// Any key of a free-form map.
    Entry,
}

fn display(path: &[Seg]) -> String {
    let mut s = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Seg::Elem => s.push_str("[]"),
            Seg::Entry => s.push_str(".<key>"),
        }
    }
    s
}

/// The named segments of a path (what a section heading names).
fn names(path: &[Seg]) -> Vec<String> {
    path.iter()
        .filter_map(|s| match s {
            Seg::Key(k) => Some(k.clone()),
            _ => None,
        })
        .collect()
}

/// The node at `path`, inserting empty tables for missing keys and map
/// entries (the first element for `Elem`).
fn node_mut<'a>(root: &'a mut Value, path: &[Seg]) -> &'a mut Value {
    let mut cur = root;
    for seg in path {
        cur = match seg {
            Seg::Key(k) => cur
                .as_table_mut()
                .unwrap_or_else(|| panic!("{k}: parent is not a table"))
                .entry(k.clone())
                .or_insert_with(|| Value::Table(Default::default())),
            Seg::Entry => cur
                .as_table_mut()
                .expect("map is not a table")
                .entry(ENTRY.to_string())
                .or_insert_with(|| Value::Table(Default::default())),
            Seg::Elem => {
                let a = cur.as_array_mut().expect("not an array");
                if a.is_empty() {
                    a.push(Value::Table(Default::default()));
                }
                &mut a[0]
            }
        };
    }
    cur
}

/// Deserializes `root` as a `Config` (no validation): the error text, if any.
fn deserialize(root: &Value) -> Result<(), String> {
    root.clone()
        .try_into::<Config>()
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// `root` with `value` at `path`.
fn with(root: &Value, path: &[Seg], value: Value) -> Value {
    let mut copy = root.clone();
    *node_mut(&mut copy, path) = value;
    copy
}

/// Whether the value at `path` takes a table: accepted, or refused for
/// something other than its type (a missing field of a struct).
fn takes_table(root: &Value, path: &[Seg]) -> bool {
    match deserialize(&with(root, path, Value::Table(Default::default()))) {
        Ok(()) => true,
        Err(e) => !(e.contains("invalid type") || e.contains("unknown variant")),
    }
}

/// Whether the value at `path` takes an array of tables.
fn takes_array_of_tables(root: &Value, path: &[Seg]) -> bool {
    let one = Value::Array(vec![Value::Table(Default::default())]);
    match deserialize(&with(root, path, one.clone())) {
        Ok(()) => true,
        Err(e) if e.contains("invalid type") || e.contains("unknown variant") => false,
        // A struct element: a probe key in it is refused by name.
        Err(_) => true,
    }
}

/// The fields of the struct at `path` (a table in `root`), or `None` when
/// the table is a free-form map.
fn struct_fields(root: &Value, path: &[Seg]) -> Option<Vec<String>> {
    let mut probe = root.clone();
    node_mut(&mut probe, path)
        .as_table_mut()
        .expect("probed node is not a table")
        .insert(PROBE.into(), Value::Integer(0));
    let err = deserialize(&probe).err()?;
    let at = err.find(&format!("unknown field `{PROBE}`"))?;
    let expected = &err[at..];
    let expected = &expected[expected.find("expected")?..];
    let expected = expected.lines().next().unwrap_or("");
    let fields: Vec<String> = expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    assert!(
        !fields.is_empty(),
        "cannot read the fields of {} from: {err}",
        display(path)
    );
    Some(fields)
}

/// Every key path under the table at `path` of `root`.
fn explore(root: &Value, path: &[Seg], out: &mut Vec<Vec<Seg>>) {
    match struct_fields(root, path) {
        Some(fields) => {
            for f in fields {
                let mut p = path.to_vec();
                p.push(Seg::Key(f.clone()));
                out.push(p.clone());
                let present = {
                    let mut copy = root.clone();
                    node_mut(&mut copy, path)
                        .as_table()
                        .and_then(|t| t.get(&f))
                        .cloned()
                };
                child(root, p, present, out);
            }
        }
        None => {
            // A map: what its values are.
            let mut p = path.to_vec();
            p.push(Seg::Entry);
            let present = {
                let mut copy = root.clone();
                node_mut(&mut copy, path)
                    .as_table()
                    .and_then(|t| t.values().next())
                    .cloned()
            };
            child(root, p, present, out);
        }
    }
}

/// Goes on below the key at `p`, whose value in `root` is `present`.
fn child(root: &Value, p: Vec<Seg>, present: Option<Value>, out: &mut Vec<Vec<Seg>>) {
    match present {
        Some(Value::Table(t)) => {
            let r = with(root, &p, Value::Table(t));
            explore(&r, &p, out);
        }
        Some(Value::Array(a)) if a.first().is_some_and(Value::is_table) => {
            let r = with(root, &p, Value::Array(vec![a[0].clone()]));
            let mut e = p.clone();
            e.push(Seg::Elem);
            explore(&r, &e, out);
        }
        Some(Value::Array(a)) if a.is_empty() => array_or_leaf(root, p, out),
        Some(_) => {}
        None => {
            if takes_table(root, &p) {
                let r = with(root, &p, Value::Table(Default::default()));
                explore(&r, &p, out);
            } else {
                array_or_leaf(root, p, out);
            }
        }
    }
}

fn array_or_leaf(root: &Value, p: Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
    if takes_array_of_tables(root, &p) {
        let r = with(
            root,
            &p,
            Value::Array(vec![Value::Table(Default::default())]),
        );
        let mut e = p;
        e.push(Seg::Elem);
        explore(&r, &e, out);
    }
}

/// Every key the configuration accepts.
fn config_keys() -> Vec<Vec<Seg>> {
    let config = Config::from_toml_with_env(BASE, std::iter::empty()).expect("base config");
    let root = Value::try_from(&config).expect("config serializes to TOML");
    deserialize(&root).expect("the serialized config reads back");
    let mut keys = Vec::new();
    explore(&root, &[], &mut keys);
    keys
}

/// A `#` heading naming a section: the key path of its first code span in
/// brackets (`[llm.models.limiter]`, `[[llm.providers]]`,
/// `[prices.<model>]` → `prices`).
fn heading_section(line: &str) -> Option<Vec<String>> {
    if !line.starts_with('#') {
        return None;
    }
    let span = line
        .split('`')
        .skip(1)
        .step_by(2)
        .find(|s| s.starts_with('['))?;
    Some(
        span.trim_matches(|c| c == '[' || c == ']')
            .split('.')
            .filter(|s| !s.starts_with('<'))
            .map(str::to_string)
            .collect(),
    )
}

/// The identifier tokens of the code spans in the first cell of each table
/// row of `text`.
fn row_keys(text: &str) -> Vec<String> {
    let mut keys = Vec::new();
    for line in text.lines() {
        let Some(row) = line.trim().strip_prefix('|') else {
            continue;
        };
        let first = row.split('|').next().unwrap_or("");
        for span in first.split('`').skip(1).step_by(2) {
            keys.extend(
                span.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|t| !t.is_empty())
                    .map(str::to_string),
            );
        }
    }
    keys
}

/// The doc's sections: heading key path and the row keys below it (up to
/// the next heading).
fn doc_sections(doc: &str) -> Vec<(Vec<String>, Vec<String>)> {
    let mut sections: Vec<(Vec<String>, String)> = Vec::new();
    let mut current: Option<(Vec<String>, String)> = None;
    for line in doc.lines() {
        if line.starts_with('#') {
            if let Some(s) = current.take() {
                sections.push(s);
            }
            current = heading_section(line).map(|p| (p, String::new()));
        } else if let Some((_, text)) = current.as_mut() {
            text.push_str(line);
            text.push('\n');
        }
    }
    sections.extend(current);
    sections
        .into_iter()
        .map(|(p, text)| (p, row_keys(&text)))
        .collect()
}

/// The keys of `keys` that `doc` does not document, with why.
fn undocumented(keys: &[Vec<Seg>], doc: &str) -> Vec<String> {
    let sections = doc_sections(doc);
    let mut missing = Vec::new();
    for key in keys {
        let n = names(key);
        let leaf = n.last().expect("a key has a name");
        if sections.iter().any(|(s, _)| *s == n) {
            continue;
        }
        let holder = sections
            .iter()
            .filter(|(s, _)| s.len() < n.len() && n.starts_with(s))
            .max_by_key(|(s, _)| s.len());
        match holder {
            None => missing.push(format!(
                "{}: no section heading names [{}]",
                display(key),
                n[..n.len() - 1].join(".")
            )),
            Some((s, rows)) if !rows.contains(leaf) => missing.push(format!(
                "{}: no row for `{leaf}` in section [{}]",
                display(key),
                s.join(".")
            )),
            Some(_) => {}
        }
    }
    missing
}

fn doc() -> String {
    // Where cargo runs the tests from (the compile-time path may be another
    // checkout's that built into the same target directory).
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    let path = root.join("docs/configuration.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_config_key_is_documented() {
    let keys = config_keys();
    let missing = undocumented(&keys, &doc());
    assert!(
        missing.is_empty(),
        "docs/configuration.md misses {} config key(s):\n  {}",
        missing.len(),
        missing.join("\n  ")
    );
}

/// The key discovery itself works: it finds keys of every kind, so the test
/// above cannot pass by finding nothing.
#[test]
fn key_discovery_finds_every_kind_of_key() {
    let keys: Vec<String> = config_keys().iter().map(|k| display(k)).collect();
    for expected in [
        // plain, with a default
        "app.id",
        "kafka.session_timeout_ms",
        // an Option that is None by default
        "app.commit_interval_ms",
        "http.advertised_url",
        // free-form map
        "kafka.client",
        // array of tables, and a None option in it
        "llm.providers[].name",
        "llm.providers[].api_key_file",
        // nested struct in an array element
        "llm.models[].limiter.initial_tpm",
        "llm.models[].breaker.open_ms",
        // struct values of a map
        "prices.<key>.cached",
        "prompts.templates.<key>.max_tokens",
        // an empty array of tables
        "routing.tiers[].max_score",
        // a None option holding a struct
        "accounting.quotas.default.cost_micros",
        "accounting.quotas.tenants.<key>.mode",
        "accounting.windows[].retention_ms",
    ] {
        assert!(
            keys.iter().any(|k| k == expected),
            "{expected} not found among {keys:#?}"
        );
    }
}

/// The check catches a key whose row is gone.
#[test]
fn a_missing_row_is_reported() {
    let doc = doc();
    let keys = config_keys();
    let row = doc
        .lines()
        .find(|l| l.starts_with("| `drain_timeout_ms`"))
        .expect("the doc has a drain_timeout_ms row");
    let without = doc.replace(&format!("{row}\n"), "");
    let missing = undocumented(&keys, &without);
    assert_eq!(
        missing,
        vec!["app.drain_timeout_ms: no row for `drain_timeout_ms` in section [app]".to_string()]
    );
}
