//! Fuzzing of every decoder that reads input from outside the process, with
//! proptest (cargo-fuzz needs a nightly toolchain; these run on stable, in
//! `cargo test`). No broker, no network.
//!
//! Each target states one property: decoding any input never panics, and a
//! refused input is refused with the decoder's own classified error (a
//! `PoisonError` reason fit for a header, an `LlmError` whose class says what
//! to do, a `ConfigError` naming a key, …). Inputs come from two sources:
//! arbitrary bytes and strings, and — most of them — mutations of a seed
//! corpus of valid inputs (`tests/fuzz/corpus/<target>/`): byte flips,
//! insertions of dictionary tokens, deletions, truncation, splicing two seeds,
//! and for JSON and TOML seeds, a value swapped for one of another type or
//! range. Random bytes alone rarely get past the first parse.
//!
//! Every file under `tests/fuzz/regressions/<target>/` (inputs that once
//! failed) is decoded by a plain test that always runs.
//!
//! `SLUICE_FUZZ_CASES` sets the cases per target (default 10,000; see
//! `docs/reliability.md` for the long run).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config as RunnerConfig, FileFailurePersistence};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sluice::config::Config;
use sluice::envelope::{decode_task, EnvelopeLimits, PoisonError, TenantRules};
use sluice::http::auth::ApiTokens;
use sluice::llm::ratelimit::{parse_reset_duration, MAX_WAIT};
use sluice::llm::wire::parse_chat_body;
use sluice::llm::{ErrorClass, LlmError, PermanentKind, RateLimitInfo};
use sluice::steps::invoke_llm::prompt::{split_batch_answer, BatchSplitError};
use sluice::trace::TraceParent;
use sluice_state::{decode_window_key, encode_window_key, Checkpoint, LoadedCheckpoint};
use sluice_state::{StateError, StoredValue};

// ---------------------------------------------------------------------------
// Running, corpus and regressions

/// Cases per target: `SLUICE_FUZZ_CASES`, else 10,000.
fn cases() -> u32 {
    std::env::var("SLUICE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

fn runner_config() -> RunnerConfig {
    RunnerConfig {
        cases: cases(),
        // A failure is shrunk to a small input, kept here and tried first on
        // the next run (a crash input also goes to tests/fuzz/regressions).
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/fuzz/proptest-regressions.txt",
        ))),
        max_shrink_iters: 4_096,
        ..RunnerConfig::default()
    }
}

/// `tests/fuzz` of the checkout cargo runs the tests in (the compile-time
/// path may be another checkout's that built into the same target dir).
fn fuzz_dir() -> PathBuf {
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::current_dir().expect("current dir"));
    root.join("tests").join("fuzz")
}

/// The files of `tests/fuzz/<kind>/<target>/`, sorted by name.
fn files(kind: &str, target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = fuzz_dir().join(kind).join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Vec<u8>)> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_file())
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).expect("corpus file"))
        })
        .collect();
    out.sort();
    out
}

/// Seeds of `target`: its corpus files, its regression files, and `extra`.
fn seeds(target: &str, extra: Vec<Vec<u8>>) -> Arc<Vec<Vec<u8>>> {
    let mut seeds: Vec<Vec<u8>> = files("corpus", target)
        .into_iter()
        .chain(files("regressions", target))
        .map(|(_, bytes)| bytes)
        .collect();
    seeds.extend(extra);
    assert!(!seeds.is_empty(), "no seeds for {target}");
    Arc::new(seeds)
}

/// Runs `check` on every regression file of `target`.
fn replay(target: &str, check: impl Fn(&[u8]) -> Result<(), String>) {
    for (name, bytes) in files("regressions", target) {
        if let Err(e) = check(&bytes) {
            panic!("tests/fuzz/regressions/{target}/{name}: {e}");
        }
    }
}

/// Input bytes, printed as text when they are (so a shrunk failure can be
/// saved as a regression file by copying it).
#[derive(Clone)]
struct Input(Vec<u8>);

impl std::fmt::Debug for Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match std::str::from_utf8(&self.0) {
            Ok(s) => write!(f, "{s:?}"),
            Err(_) => write!(f, "bytes {:02x?}", self.0),
        }
    }
}

// ---------------------------------------------------------------------------
// Mutations

/// Tokens inserted by byte-level edits and swapped in for JSON values.
const JSON_TOKENS: &[&str] = &[
    "null",
    "true",
    "false",
    "0",
    "-0",
    "1",
    "-1",
    "0.5",
    "1.5",
    "-0.0001",
    "255",
    "256",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "-9223372036854775809",
    "1e308",
    "1e999",
    "-1e999",
    "1e-400",
    "8.64e15",
    "8640000000000001",
    "\"\"",
    "\" \"",
    "\"x\"",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "\"\\ud83d\\ude00\"",
    "\"é\\n\\t\\\"\"",
    "\"2024-05-01T10:00:00Z\"",
    "\"9999-12-31T23:59:59Z\"",
    "\"+275760-09-13T00:00:00Z\"",
    "\"0000-01-01T00:00:00Z\"",
    "\"2024-02-30T25:61:61Z\"",
    "\"2024-05-01T10:00:00.9999999999Z\"",
    "\"high\"",
    "\"batch\"",
    "\"summarize\"",
    "\"classify\"",
    "\"extract\"",
    "\"acme\"",
    "\"ACME \"",
    "\"<think>\"",
    "\"</think>\"",
    "\"<think>a</think>b\"",
    "\"```json\\n{}\\n```\"",
    "\"text\"",
    "\"output_text\"",
    "\"content_filter\"",
    "\"length\"",
    "\"stop\"",
    "[]",
    "{}",
    "[null]",
    "[{}]",
    "[\"a\",\"a\"]",
    "{\"type\":\"text\",\"text\":\"x\"}",
    "[{\"type\":\"text\",\"text\":\"x\"},{\"text\":\"y\"}]",
    "{\"items\":[]}",
    "{\"id\":\"a1\",\"output\":1}",
    "{\"cached_tokens\":99999999999}",
    "{\"message\":\"maximum context length\",\"code\":\"context_length_exceeded\"}",
];

/// Bytes that break parsers in interesting ways.
const BYTE_TOKENS: &[&str] = &[
    "{", "}", "[", "]", "\"", "\\", ",", ":", "\n", "\r\n", "\t", " ", "\0", "\u{7f}", "\u{feff}",
    "\u{2028}", "é", "😀", "#", "=", "-", ".", "e", "E", "+", "0", "9", "'", "`", "```", "%",
    "%2F", "/", "..", "?", "&", "ms", "µs", "h", "s", "GMT",
];

/// One edit of an input.
#[derive(Clone, Debug)]
enum Edit {
    /// Flip one bit.
    Flip(Index, u8),
    /// Overwrite one byte.
    Set(Index, u8),
    /// Insert a dictionary token.
    Token(Index, Index),
    /// Insert random bytes.
    Insert(Index, Vec<u8>),
    /// Delete up to n bytes.
    Delete(Index, u8),
    /// Cut the input here.
    Truncate(Index),
    /// Keep the input up to here, then another seed from one of its positions.
    Splice(Index, Index, Index),
    /// Repeat a chunk.
    Repeat(Index, u8, u8),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        // Mostly the low seven bits and ASCII: text targets refuse invalid
        // UTF-8 at their first check, which a flip of bit 7 makes.
        3 => (any::<Index>(), prop_oneof![6 => 0u8..7, 1 => Just(7u8)])
            .prop_map(|(i, b)| Edit::Flip(i, b)),
        2 => (any::<Index>(), prop_oneof![4 => 0x20u8..0x7f, 1 => any::<u8>()])
            .prop_map(|(i, b)| Edit::Set(i, b)),
        4 => (any::<Index>(), any::<Index>()).prop_map(|(i, t)| Edit::Token(i, t)),
        2 => (
            any::<Index>(),
            proptest::collection::vec(prop_oneof![4 => 0x20u8..0x7f, 1 => any::<u8>()], 1..8)
        )
            .prop_map(|(i, b)| Edit::Insert(i, b)),
        3 => (any::<Index>(), 1u8..32).prop_map(|(i, n)| Edit::Delete(i, n)),
        1 => any::<Index>().prop_map(Edit::Truncate),
        1 => (any::<Index>(), any::<Index>(), any::<Index>())
            .prop_map(|(s, f, a)| Edit::Splice(s, f, a)),
        1 => (any::<Index>(), 1u8..16, 2u8..64).prop_map(|(i, l, n)| Edit::Repeat(i, l, n)),
    ]
}

/// A position in `0..=len`.
fn at(i: &Index, len: usize) -> usize {
    i.index(len + 1)
}

fn apply(mut data: Vec<u8>, edits: &[Edit], seeds: &[Vec<u8>], dict: &[&str]) -> Vec<u8> {
    for e in edits {
        let len = data.len();
        match e {
            Edit::Flip(i, bit) if len > 0 => data[i.index(len)] ^= 1 << bit,
            Edit::Set(i, b) if len > 0 => data[i.index(len)] = *b,
            Edit::Token(i, t) => {
                let token = t.get(dict).as_bytes();
                let p = at(i, len);
                data.splice(p..p, token.iter().copied());
            }
            Edit::Insert(i, bytes) => {
                let p = at(i, len);
                data.splice(p..p, bytes.iter().copied());
            }
            Edit::Delete(i, n) => {
                let p = at(i, len);
                let end = (p + *n as usize).min(len);
                data.drain(p..end);
            }
            Edit::Truncate(i) => data.truncate(at(i, len)),
            Edit::Splice(s, from, here) => {
                let other = s.get(seeds);
                let p = at(here, len);
                data.truncate(p);
                data.extend_from_slice(&other[at(from, other.len())..]);
            }
            Edit::Repeat(i, l, n) if len > 0 => {
                let p = i.index(len);
                let chunk = data[p..(p + *l as usize).min(len)].to_vec();
                let insert: Vec<u8> = chunk.repeat(*n as usize);
                data.splice(p..p, insert);
            }
            _ => {}
        }
    }
    data
}

/// One structural edit of a JSON document: the node at an index (in
/// document order) is replaced by a token, removed, or has its key renamed.
#[derive(Clone, Debug)]
struct JsonEdit {
    node: Index,
    kind: u8,
    token: Index,
}

fn json_edit() -> impl Strategy<Value = JsonEdit> {
    (any::<Index>(), 0u8..8, any::<Index>()).prop_map(|(node, kind, token)| JsonEdit {
        node,
        kind,
        token,
    })
}

/// JSON pointers of every node below the root.
fn pointers(v: &Value, here: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                let p = format!("{here}/{}", k.replace('~', "~0").replace('/', "~1"));
                out.push(p.clone());
                pointers(child, p, out);
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                let p = format!("{here}/{i}");
                out.push(p.clone());
                pointers(child, p, out);
            }
        }
        _ => {}
    }
}

const SLOT: &str = "__sluice_fuzz_slot__";

/// Applies structural edits; the text of a seed that is not JSON is kept.
fn apply_json(seed: &[u8], edits: &[JsonEdit]) -> Vec<u8> {
    let Ok(mut v) = serde_json::from_slice::<Value>(seed) else {
        return seed.to_vec();
    };
    let mut raw: Vec<&str> = Vec::new();
    for e in edits {
        let mut ptrs = Vec::new();
        pointers(&v, String::new(), &mut ptrs);
        if ptrs.is_empty() {
            break;
        }
        let ptr = e.node.get(&ptrs).clone();
        let (parent, last) = ptr.rsplit_once('/').expect("pointer has a slash");
        let token = *e.token.get(JSON_TOKENS);
        match (e.kind, v.pointer_mut(parent)) {
            // Remove the node.
            (0, Some(Value::Object(m))) => {
                m.remove(&last.replace("~1", "/").replace("~0", "~"));
            }
            (0, Some(Value::Array(a))) => {
                a.remove(last.parse::<usize>().expect("array index"));
            }
            // Rename the key (an object member) or duplicate the element.
            (1, Some(Value::Object(m))) => {
                let key = last.replace("~1", "/").replace("~0", "~");
                if let Some(child) = m.remove(&key) {
                    let new_key = serde_json::from_str::<String>(token).unwrap_or_default();
                    m.insert(new_key, child);
                }
            }
            (1, Some(Value::Array(a))) => {
                let i = last.parse::<usize>().expect("array index");
                let copy = a[i].clone();
                a.insert(i, copy);
            }
            // Swap the value for a raw token (any type or range).
            _ => {
                if let Some(node) = v.pointer_mut(&ptr) {
                    *node = Value::String(format!("{SLOT}{}", raw.len()));
                    raw.push(token);
                }
            }
        }
    }
    let mut text = if edits.len() % 2 == 0 {
        serde_json::to_string(&v)
    } else {
        serde_json::to_string_pretty(&v)
    }
    .expect("a value serializes");
    for (i, token) in raw.iter().enumerate() {
        text = text.replacen(&format!("\"{SLOT}{i}\""), token, 1);
    }
    text.into_bytes()
}

/// Inputs for a target: arbitrary bytes and text, and mutated seeds (with
/// structural JSON edits when `json`).
fn inputs(
    seeds: Arc<Vec<Vec<u8>>>,
    dict: &'static [&'static str],
    json: bool,
) -> BoxedStrategy<Input> {
    let mutated = {
        let seeds = seeds.clone();
        (
            any::<Index>(),
            proptest::collection::vec(json_edit(), 0..if json { 4 } else { 1 }),
            proptest::collection::vec(edit(), 0..6),
        )
            .prop_map(move |(seed, json_edits, edits)| {
                let seed = seed.get::<Vec<u8>>(&seeds);
                let data = if json_edits.is_empty() {
                    seed.clone()
                } else {
                    apply_json(seed, &json_edits)
                };
                Input(apply(data, &edits, &seeds, dict))
            })
    };
    prop_oneof![
        1 => proptest::collection::vec(any::<u8>(), 0..256).prop_map(Input),
        1 => any::<String>().prop_map(|s| Input(s.into_bytes())),
        8 => mutated,
    ]
    .boxed()
}

fn dictionary() -> &'static [&'static str] {
    static DICT: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    DICT.get_or_init(|| JSON_TOKENS.iter().chain(BYTE_TOKENS).copied().collect())
}

// ---------------------------------------------------------------------------
// Target: task decoder (`decode_task`, and the `traceparent` header)

const TASK_TYPES: [&str; 3] = ["summarize", "classify", "extract"];

/// A refusal reason is a short header-safe token (`missing_field:taskId`).
fn header_safe_reason(e: &PoisonError) -> Result<(), String> {
    let reason = e.reason();
    let ok = !reason.is_empty()
        && reason.len() <= 100
        && reason
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.:[]".contains(c));
    if ok {
        Ok(())
    } else {
        Err(format!("reason not header-safe: {reason:?}"))
    }
}

fn check_task(bytes: &[u8]) -> Result<(), String> {
    let limits = EnvelopeLimits::default();
    let tight = EnvelopeLimits {
        max_bytes: 256,
        max_task_id_len: 4,
        tenants: TenantRules::new("^[a-z]+$", &["acme".into(), "Initech ".into()])
            .expect("pattern"),
    };
    for limits in [&limits, &tight] {
        match decode_task(bytes, limits, &TASK_TYPES) {
            Err(e) => header_safe_reason(&e)?,
            Ok(task) => {
                let tenant = task.tenant_id.as_deref().ok_or("accepted without tenant")?;
                if limits.tenants.check(tenant).as_deref() != Ok(tenant) {
                    return Err(format!("accepted tenant {tenant:?} is not normalised"));
                }
                if task.attempt_number == 0 || task.task_id.trim().is_empty() {
                    return Err("accepted an invalid attempt number or task id".into());
                }
                // What Sluice writes back (a re-published attempt, a DLQ
                // replay) decodes to the same task.
                let again = serde_json::to_vec(&task).map_err(|e| e.to_string())?;
                let big = EnvelopeLimits {
                    max_bytes: usize::MAX,
                    ..limits.clone()
                };
                match decode_task(&again, &big, &TASK_TYPES) {
                    Ok(back) if back == task => {}
                    other => return Err(format!("re-encoded task decodes to {other:?}")),
                }
            }
        }
    }
    // The trace context header is read from any task's headers.
    let text = String::from_utf8_lossy(bytes);
    for candidate in [text.as_ref(), text.trim_matches('"')] {
        if let Some(tp) = TraceParent::parse(candidate) {
            if TraceParent::parse(&tp.header()) != Some(tp) {
                return Err(format!("traceparent {tp:?} does not round-trip"));
            }
            let child = tp.child();
            if child.trace_id != tp.trace_id || child.span_id == 0 {
                return Err("child span lost its trace".into());
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(runner_config())]

    #[test]
    fn task_decoder(input in inputs(seeds("task", Vec::new()), dictionary(), true)) {
        let r = check_task(&input.0);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn task_decoder_regressions() {
    replay("task", check_task);
}

// ---------------------------------------------------------------------------
// Target: batch-answer splitter (`split_batch_answer`)

/// A batch answer file: `ids: a,b,c` on the first line, the answer after.
fn batch_case(bytes: &[u8]) -> (Vec<String>, String) {
    let text = String::from_utf8_lossy(bytes);
    match text.split_once('\n') {
        Some((first, rest)) if first.starts_with("ids:") => (
            first["ids:".len()..]
                .split(',')
                .map(|s| s.trim().to_string())
                .collect(),
            rest.to_string(),
        ),
        _ => (vec!["a1".into(), "a2".into()], text.into_owned()),
    }
}

fn check_batch(bytes: &[u8]) -> Result<(), String> {
    let (ids, answer) = batch_case(bytes);
    match split_batch_answer(&answer, &ids) {
        Ok(split) => {
            let got: Vec<&String> = split.iter().map(|(id, _)| id).collect();
            let want: Vec<&String> = ids.iter().collect();
            if got != want {
                return Err(format!("split {got:?} for ids {want:?}"));
            }
        }
        Err(
            BatchSplitError::NotJson
            | BatchSplitError::IncompleteItem
            | BatchSplitError::MissingId(_)
            | BatchSplitError::DuplicateId(_)
            | BatchSplitError::UnknownId(_),
        ) => {}
    }
    Ok(())
}

/// Mutates the answer of a batch file, keeping (or mutating) its ids line.
fn batch_inputs() -> BoxedStrategy<Input> {
    let seeds = seeds("batch_answer", Vec::new());
    let answers: Arc<Vec<Vec<u8>>> = Arc::new(
        seeds
            .iter()
            .map(|s| {
                batch_case(s)
                    .1
                    .trim()
                    .trim_matches('`')
                    .trim_start_matches("json")
                    .as_bytes()
                    .to_vec()
            })
            .collect(),
    );
    let whole = inputs(seeds.clone(), dictionary(), false);
    let structured = (
        any::<Index>(),
        proptest::collection::vec(json_edit(), 0..4),
        proptest::collection::vec(edit(), 0..4),
        any::<bool>(),
    )
        .prop_map(move |(seed, json_edits, edits, fence)| {
            let (ids, _) = batch_case(seed.get::<Vec<u8>>(&seeds));
            let answer = apply_json(seed.get::<Vec<u8>>(&answers), &json_edits);
            let mut answer = apply(answer, &edits, &answers, dictionary());
            if fence {
                answer = [b"```json\n".as_slice(), &answer, b"\n```"].concat();
            }
            Input([format!("ids: {}\n", ids.join(",")).into_bytes(), answer].concat())
        });
    prop_oneof![1 => whole, 3 => structured].boxed()
}

proptest! {
    #![proptest_config(runner_config())]

    #[test]
    fn batch_answer_splitter(input in batch_inputs()) {
        let r = check_batch(&input.0);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn batch_answer_splitter_regressions() {
    replay("batch_answer", check_batch);
}

// ---------------------------------------------------------------------------
// Target: provider answers (`parse_chat_body`, `parse_error_body`, the
// status classification) and rate-limit headers (`RateLimitInfo`)

/// Header lines `name: value`; lines that are not a valid header are
/// skipped (the HTTP client would not have delivered them).
fn header_map(text: &[u8]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for line in text.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        let value = value.strip_prefix(b" ").unwrap_or(value);
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
            map.append(n, v);
        }
    }
    map
}

fn check_rate_limit(info: &RateLimitInfo) -> Result<(), String> {
    for d in [info.reset_requests, info.reset_tokens, info.retry_after]
        .into_iter()
        .flatten()
    {
        if d > MAX_WAIT {
            return Err(format!("a wait of {d:?} above {MAX_WAIT:?}"));
        }
    }
    Ok(())
}

fn check_headers(bytes: &[u8]) -> Result<(), String> {
    let info = RateLimitInfo::from_headers(&header_map(bytes));
    check_rate_limit(&info)?;
    for line in String::from_utf8_lossy(bytes).lines() {
        let value = line.split_once(':').map_or(line, |(_, v)| v);
        if let Some(d) = parse_reset_duration(value) {
            if d > MAX_WAIT {
                return Err(format!("reset {value:?} read as {d:?}"));
            }
        }
    }
    Ok(())
}

/// A provider answer file: `HTTP <status>`, header lines, a blank line, the body.
fn response_case(bytes: &[u8]) -> (u16, HeaderMap, Vec<u8>) {
    let split = bytes
        .windows(2)
        .position(|w| w == b"\n\n")
        .map_or((bytes, &[][..]), |p| (&bytes[..p], &bytes[p + 2..]));
    let (head, body) = split;
    let first = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let status = String::from_utf8_lossy(first)
        .trim()
        .strip_prefix("HTTP ")
        .and_then(|s| s.trim().parse::<u16>().ok());
    match status {
        Some(status) => (status, header_map(head), body.to_vec()),
        None => (200, HeaderMap::new(), bytes.to_vec()),
    }
}

fn check_response(bytes: &[u8]) -> Result<(), String> {
    let (status, headers, body) = response_case(bytes);
    let info = RateLimitInfo::from_headers(&headers);
    check_rate_limit(&info)?;
    // What `HttpProvider::chat` does with an answer.
    let result = if (200..300).contains(&status) {
        parse_chat_body(&body, info)
    } else {
        let (code, kind, message) = sluice::fuzzing::parse_error_body(&body);
        if message.len() > 300 {
            return Err(format!("error message of {} bytes kept", message.len()));
        }
        if let Some(long) = [&code, &kind].into_iter().flatten().find(|s| s.len() > 64) {
            return Err(format!("error code or type of {} bytes kept", long.len()));
        }
        Err(LlmError::Status {
            status,
            code,
            kind,
            message,
            rate_limit: Box::new(info),
        })
    };
    match result {
        Ok(r) => {
            let u = r.usage;
            if u.cached_tokens + u.cache_write_tokens > u.prompt_tokens {
                return Err(format!("cache counts above the prompt: {u:?}"));
            }
            let _ = r.truncated();
        }
        Err(e) => {
            let class = e.class();
            let _ = (e.code(), e.to_string(), e.billed(), class.is_retryable());
            let expected = match (&e, status) {
                (LlmError::Malformed(_), 200..=299) => class == ErrorClass::Malformed,
                (LlmError::ContentFiltered(_), 200..=299) => {
                    class == ErrorClass::Permanent(PermanentKind::ContentPolicy)
                }
                (LlmError::Status { .. }, 429) => matches!(class, ErrorClass::RateLimited { .. }),
                (LlmError::Status { .. }, 500..=599) => {
                    matches!(class, ErrorClass::Transient | ErrorClass::Config)
                }
                (LlmError::Status { .. }, s) => !(200..300).contains(&s),
                _ => false,
            };
            if !expected {
                return Err(format!("HTTP {status} gave {e:?} of class {class:?}"));
            }
            // Display never carries the provider's message (it may quote
            // the prompt). (It does carry `error.code` and `error.type`
            // whole, however long: see docs/reliability.md.)
            if let LlmError::Status {
                message,
                code,
                kind,
                ..
            } = &e
            {
                let in_ids = [code, kind].iter().any(|id| {
                    id.as_deref()
                        .is_some_and(|id| id.contains(message.as_str()))
                });
                if message.len() >= 8 && !in_ids && e.to_string().contains(message.as_str()) {
                    return Err("an error's Display carries the provider's message".into());
                }
            }
        }
    }
    Ok(())
}

const STATUSES: &[u16] = &[
    100, 200, 201, 204, 299, 301, 400, 401, 403, 404, 408, 409, 413, 422, 425, 429, 499, 500, 502,
    503, 504, 529, 599, 600, 999,
];

fn response_inputs() -> BoxedStrategy<Input> {
    let provider = seeds_of("provider_response");
    let whole = inputs(provider.clone(), dictionary(), false);
    // Heads (header lines) and bodies are mutated apart, under any status.
    let bodies: Arc<Vec<Vec<u8>>> = Arc::new(provider.iter().map(|s| response_case(s).2).collect());
    let heads: Arc<Vec<Vec<u8>>> = Arc::new(
        provider
            .iter()
            .map(|s| {
                let body_len = response_case(s).2.len();
                let head = &s[..s.len() - body_len];
                let first_line = head.iter().position(|b| *b == b'\n').map_or(0, |p| p + 1);
                head[first_line..].to_vec()
            })
            .collect(),
    );
    let structured = (
        prop_oneof![3 => proptest::sample::select(STATUSES), 1 => any::<u16>()],
        any::<Index>(),
        proptest::collection::vec(edit(), 0..3),
        any::<Index>(),
        proptest::collection::vec(json_edit(), 0..4),
        proptest::collection::vec(edit(), 0..4),
    )
        .prop_map(
            move |(status, head, head_edits, body, json_edits, body_edits)| {
                let head = apply(
                    head.get::<Vec<u8>>(&heads).clone(),
                    &head_edits,
                    &heads,
                    dictionary(),
                );
                let body = apply_json(body.get::<Vec<u8>>(&bodies), &json_edits);
                let body = apply(body, &body_edits, &bodies, dictionary());
                let mut out = format!("HTTP {status}\n").into_bytes();
                out.extend(head);
                if !out.ends_with(b"\n\n") {
                    out.extend_from_slice(b"\n\n");
                }
                out.extend(body);
                Input(out)
            },
        );
    prop_oneof![1 => whole, 3 => structured].boxed()
}

/// The seeds of a target's corpus and regressions.
fn seeds_of(target: &str) -> Arc<Vec<Vec<u8>>> {
    seeds(target, Vec::new())
}

proptest! {
    #![proptest_config(runner_config())]

    #[test]
    fn provider_response(input in response_inputs()) {
        let r = check_response(&input.0);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn rate_limit_headers(input in inputs(seeds_of("rate_limit_headers"), dictionary(), false)) {
        let r = check_headers(&input.0);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn provider_response_regressions() {
    replay("provider_response", check_response);
}

#[test]
fn rate_limit_headers_regressions() {
    replay("rate_limit_headers", check_headers);
}

// ---------------------------------------------------------------------------
// Target: the billed header of re-published attempts (`sluice.billed`)

/// What the operator reads from a task's billed header: every figure within
/// its bound, and what it writes back reads the same.
fn check_billed(bytes: &[u8]) -> Result<(), String> {
    let headers = vec![("sluice.billed".to_string(), bytes.to_vec())];
    let billed = sluice::fuzzing::billed_before(&headers);
    let (input, output, cached, cache_write, cost) = billed;
    let bound = 1u64 << 40;
    if [input, output, cached, cache_write]
        .iter()
        .any(|n| *n > bound)
        || !(0..=bound as i64).contains(&cost)
    {
        return Err(format!("{billed:?} read past the bound"));
    }
    let again = sluice::fuzzing::billed_before(&sluice::fuzzing::with_billed(&headers, billed));
    if again != billed {
        return Err(format!("{billed:?} written back reads {again:?}"));
    }
    Ok(())
}

proptest! {
    #![proptest_config(runner_config())]

    #[test]
    fn billed_header(input in inputs(seeds_of("billed_header"), dictionary(), false)) {
        let r = check_billed(&input.0);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn billed_header_regressions() {
    replay("billed_header", check_billed);
}

// ---------------------------------------------------------------------------
// Target: config loader (`Config::from_toml_with_env`)

/// Values swapped into `key = value` lines.
const TOML_TOKENS: &[&str] = &[
    "0",
    "-1",
    "1",
    "7",
    "10001",
    "4294967296",
    "9223372036854775807",
    "-9223372036854775808",
    "18446744073709551615",
    "0.0",
    "-0.5",
    "1.5",
    "1e308",
    "nan",
    "inf",
    "-inf",
    "true",
    "false",
    "\"\"",
    "\" \"",
    "\"x\"",
    "\"at_least_once\"",
    "\"exactly_once\"",
    "\"1d\"",
    "\"1m\"",
    "\"sim\"",
    "\"small\"",
    "\"http://\"",
    "\"not a url\"",
    "\"/nonexistent/sluice-fuzz\"",
    "\"^[\"",
    "[]",
    "[\"\"]",
    "[0]",
    "[[]]",
    "{}",
    "{ a = 1 }",
    "{ \"1d\" = -5 }",
    "[{ name = \"\", size_ms = 0, retention_ms = 0 }]",
    "1979-05-27T07:32:00Z",
    "07:32:00",
    "'''\nx'''",
];

const ENV_KEYS: &[&str] = &[
    "SLUICE_APP__ID",
    "SLUICE_APP__GUARANTEE",
    "SLUICE_APP__MAX_IN_FLIGHT_PER_PARTITION",
    "SLUICE_KAFKA__BOOTSTRAP_SERVERS",
    "SLUICE_KAFKA__CLIENT__SASL.PASSWORD",
    "SLUICE_LLM__MODELS__0__NAME",
    "SLUICE_LLM__PROVIDERS",
    "SLUICE_ACCOUNTING__BUDGETS__DEFAULT__1D",
    "SLUICE_PRICES__SMALL__INPUT",
    "SLUICE_BATCHING__ENABLED",
    "SLUICE_TASKS__TENANT_PATTERN",
    "SLUICE___",
    "SLUICE_A____B",
    "SLUICE_KAFKA",
    "SLUICE_LOG",
];

/// `#env NAME=VALUE` comment lines of a config file are its environment.
fn config_case(bytes: &[u8]) -> (String, Vec<(String, String)>) {
    let text = String::from_utf8_lossy(bytes).into_owned();
    let env = text
        .lines()
        .filter_map(|l| l.strip_prefix("#env "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    (text, env)
}

fn check_config(bytes: &[u8]) -> Result<(), String> {
    let (text, env) = config_case(bytes);
    match Config::from_toml_with_env(&text, env.clone()) {
        Err(e) => {
            if e.key.trim().is_empty() {
                return Err(format!("error names no key: {e}"));
            }
        }
        Ok(config) => {
            config
                .validate()
                .map_err(|e| format!("loaded, then invalid: {e}"))?;
            // What a loaded config derives for the engine and the router.
            let _ = (config.streams(), config.router(), config.kafka.cluster());
        }
    }
    Ok(())
}

/// One line edit of a TOML file.
#[derive(Clone, Debug)]
struct LineEdit {
    line: Index,
    kind: u8,
    token: Index,
}

fn config_inputs() -> BoxedStrategy<Input> {
    let full = {
        let corpus = files("corpus", "config");
        let (_, minimal) = corpus
            .iter()
            .find(|(name, _)| name == "minimal.toml")
            .expect("minimal.toml");
        let (minimal, _) = config_case(minimal);
        let config = Config::from_toml_with_env(&minimal, Vec::new()).expect("minimal config");
        let text = toml::to_string(&config).expect("config serializes");
        vec![text.into_bytes()]
    };
    let seeds = seeds("config", full);
    let lines: Arc<Vec<String>> = Arc::new(
        seeds
            .iter()
            .flat_map(|s| {
                String::from_utf8_lossy(s)
                    .lines()
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect(),
    );
    let whole = inputs(seeds.clone(), dictionary(), false);
    let line_edit = (any::<Index>(), 0u8..6, any::<Index>())
        .prop_map(|(line, kind, token)| LineEdit { line, kind, token });
    let env = proptest::collection::vec(
        (
            proptest::sample::select(ENV_KEYS),
            prop_oneof![
                3 => proptest::sample::select(TOML_TOKENS).prop_map(str::to_string),
                1 => any::<String>(),
            ],
        ),
        0..3,
    );
    let structured = (
        any::<Index>(),
        proptest::collection::vec(line_edit, 1..6),
        env,
        proptest::collection::vec(edit(), 0..2),
    )
        .prop_map(move |(seed, edits, env, byte_edits)| {
            let text = String::from_utf8_lossy(seed.get::<Vec<u8>>(&seeds)).into_owned();
            let mut out: Vec<String> = text.lines().map(str::to_string).collect();
            for e in edits {
                let token = *e.token.get(TOML_TOKENS);
                if out.is_empty() {
                    out.push(e.token.get(lines.as_slice()).clone());
                    continue;
                }
                let i = e.line.index(out.len());
                match e.kind {
                    0 | 1 => {
                        if let Some((key, _)) = out[i].split_once('=') {
                            out[i] = format!("{key}= {token}");
                        }
                    }
                    2 => {
                        out.remove(i);
                    }
                    3 => {
                        let copy = out[i].clone();
                        out.insert(i, copy);
                    }
                    _ => out.insert(i, e.token.get(lines.as_slice()).clone()),
                }
            }
            let mut text = String::new();
            for (k, v) in env {
                text.push_str(&format!("#env {k}={}\n", v.replace('\n', " ")));
            }
            text.push_str(&out.join("\n"));
            Input(apply(text.into_bytes(), &byte_edits, &seeds, dictionary()))
        });
    prop_oneof![1 => whole, 4 => structured].boxed()
}

proptest! {
    #![proptest_config(runner_config())]

    #[test]
    fn config_loader(input in config_inputs()) {
        let r = check_config(&input.0);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn config_loader_regressions() {
    replay("config", check_config);
}

// ---------------------------------------------------------------------------
// Target: changelog and progress records (`StoredValue::decode`,
// `decode_window_key`, `Checkpoint::load`, the progress record, derived
// records)

fn check_stored_value(bytes: &[u8]) -> Result<(), String> {
    match StoredValue::decode("store", bytes) {
        Ok(v) => {
            if !bytes.ends_with(&v.value) {
                return Err("decoded value is not the record's tail".into());
            }
            let again = StoredValue::decode("store", &v.encode()).map_err(|e| e.to_string())?;
            if again != v {
                return Err("re-encoded value differs".into());
            }
        }
        Err(StateError::Corrupt { .. }) => {}
        Err(e) => return Err(format!("unclassified error {e:?}")),
    }
    if let Some((start, key)) = decode_window_key(bytes) {
        if encode_window_key(start, key) != bytes {
            return Err("window key does not round-trip".into());
        }
    }
    Ok(())
}

fn check_checkpoint(bytes: &[u8]) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    std::fs::write(dir.path().join("checkpoint.json"), bytes).map_err(|e| e.to_string())?;
    match Checkpoint::load(dir.path()) {
        LoadedCheckpoint::Found(cp) => {
            cp.store(dir.path()).map_err(|e| e.to_string())?;
            if Checkpoint::load(dir.path()) != LoadedCheckpoint::Found(cp) {
                return Err("stored checkpoint reads back differently".into());
            }
        }
        LoadedCheckpoint::Unreadable(_) => {}
        LoadedCheckpoint::Missing => return Err("a present file read as missing".into()),
    }
    Ok(())
}

/// The progress record's current format (`TaskProgressWire` in
/// topology/src/offsets.rs), to write seeds with the engine's own encoder.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct ProgressWire {
    stream_time: i64,
    slots: Vec<SlotWire>,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
struct SlotWire {
    source: u32,
    committed: i64,
    previous: i64,
    span: u64,
    runs: Vec<(u64, u64)>,
    /// Arrival stream times: the first from the record's stream time, each
    /// next from the one before.
    arrived: Vec<i64>,
}

/// The second format (`0xF2`): no arrival times.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct SlotWireV2 {
    source: u32,
    committed: i64,
    previous: i64,
    span: u64,
    runs: Vec<(u64, u64)>,
}

/// The first format (`SlotProgressV1`).
#[derive(Serialize, Deserialize, Debug, Clone)]
struct SlotV1 {
    source: u32,
    committed: i64,
    end: i64,
    unfinished: Vec<i64>,
}

const PROGRESS_FORMAT: u8 = 0xF3;

fn progress_bytes(p: &ProgressWire) -> Vec<u8> {
    [vec![PROGRESS_FORMAT], sluice_topology::to_bincode(p)].concat()
}

fn progress_seeds() -> Vec<Vec<u8>> {
    let slot = |source, committed, span, runs: &[(u64, u64)]| SlotWire {
        source,
        committed,
        previous: committed - 3,
        span,
        runs: runs.to_vec(),
        arrived: runs
            .iter()
            .flat_map(|(_, len)| 0..*len as i64)
            .map(|i| i % 7)
            .collect(),
    };
    vec![
        progress_bytes(&ProgressWire {
            stream_time: 1_714_557_600_000,
            slots: vec![slot(7, 40, 20, &[(5, 1), (3, 2)]), slot(9, 0, 0, &[])],
        }),
        progress_bytes(&ProgressWire {
            stream_time: i64::MIN,
            slots: vec![slot(1, 1_000_000, 10_000, &[(0, 1_000), (8_000, 999)])],
        }),
        [
            vec![0xF2],
            sluice_topology::to_bincode(&(
                1_714_557_600_000i64,
                vec![SlotWireV2 {
                    source: 7,
                    committed: 40,
                    previous: 37,
                    span: 20,
                    runs: vec![(5, 1), (3, 2)],
                }],
            )),
        ]
        .concat(),
        sluice_topology::to_bincode(&vec![SlotV1 {
            source: 3,
            committed: 10,
            end: 20,
            unfinished: vec![12, 15],
        }]),
    ]
}

fn check_progress(bytes: &[u8]) -> Result<(), String> {
    use sluice_topology::fuzzing::decode_progress;
    match decode_progress(bytes) {
        Ok(encoded) if bytes.first() == Some(&PROGRESS_FORMAT) => {
            // A current-format record reads back as itself.
            let again = decode_progress(&encoded)?;
            if again != encoded {
                return Err("progress record does not round-trip".into());
            }
        }
        Ok(_) => {}
        Err(reason) if reason.starts_with("corrupt progress record") => {}
        Err(reason) => return Err(format!("unclassified error {reason:?}")),
    }
    Ok(())
}

fn progress_inputs() -> BoxedStrategy<Input> {
    let seeds = seeds("progress", progress_seeds());
    let whole = inputs(seeds, dictionary(), false);
    // Records with arbitrary fields, as a corrupt or hostile store holds them.
    let slot = (
        any::<u32>(),
        prop_oneof![any::<i64>(), -2i64..1_000],
        any::<i64>(),
        prop_oneof![any::<u64>(), 0u64..100_000],
        proptest::collection::vec(
            (
                prop_oneof![any::<u64>(), 0u64..100],
                prop_oneof![any::<u64>(), 0u64..100_000],
            ),
            0..4,
        ),
    )
        .prop_map(|(source, committed, previous, span, runs)| {
            // As many arrival times as offsets when that is few (a record
            // that reads), else a handful (a corrupt one).
            let n: u64 = runs
                .iter()
                .map(|(_, len)| *len)
                .fold(0, u64::saturating_add);
            let arrived = (0..n.min(1_000) as i64).map(|i| i * 31 - 500).collect();
            SlotWire {
                source,
                committed,
                previous,
                span,
                runs,
                arrived,
            }
        });
    let fields =
        (any::<i64>(), proptest::collection::vec(slot, 0..3)).prop_map(|(stream_time, slots)| {
            Input(progress_bytes(&ProgressWire { stream_time, slots }))
        });
    prop_oneof![2 => whole, 1 => fields].boxed()
}

proptest! {
    #![proptest_config(runner_config())]

    #[test]
    fn stored_value_and_window_key(input in inputs(
        seeds("stored_value", vec![
            StoredValue::new(b"{\"requests\":3}".to_vec()).encode(),
            [vec![1u8], 7u32.to_be_bytes().to_vec(), 99i64.to_be_bytes().to_vec(), b"v1".to_vec()].concat(),
            [vec![2u8], vec![0; 20], b"v2".to_vec()].concat(),
            encode_window_key(1_714_557_600_000, b"acme"),
            encode_window_key(-1, b""),
        ]),
        dictionary(),
        false,
    )) {
        let r = check_stored_value(&input.0);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn checkpoint_file(input in inputs(seeds_of("checkpoint"), dictionary(), true)) {
        let r = check_checkpoint(&input.0);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn progress_record(input in progress_inputs()) {
        let r = check_progress(&input.0);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn stored_value_regressions() {
    replay("stored_value", check_stored_value);
}

#[test]
fn checkpoint_regressions() {
    replay("checkpoint", check_checkpoint);
}

#[test]
fn progress_regressions() {
    replay("progress", check_progress);
}

// ---------------------------------------------------------------------------
// Target: the usage query path (`usage_url`, the tokens file and the
// bearer-token check of `/v1/tenants/{id}/usage`)

#[derive(Deserialize, Debug)]
struct UsageCase {
    base: String,
    tenant: String,
    window: Option<String>,
}

const TOKENS: &str = "0123456789abcdef-admin admin\n\
    0123456789abcdef-acme tenant:acme\n\
    sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 tenant:Initech\n";

fn check_usage(bytes: &[u8]) -> Result<(), String> {
    let case: UsageCase = match serde_json::from_slice(bytes) {
        Ok(c) => c,
        // Not a case: its text is the tenant (and a tokens file).
        Err(_) => {
            let text = String::from_utf8_lossy(bytes).into_owned();
            let _ = ApiTokens::parse(&text);
            UsageCase {
                base: "http://localhost:8080".into(),
                tenant: text,
                window: Some("1h".into()),
            }
        }
    };
    if let Ok(url) =
        sluice::http::usage::usage_url(&case.base, &case.tenant, case.window.as_deref())
    {
        // The tenant stays one path segment: no `/`, `..` or `?` in it
        // reaches another endpoint.
        let segments: Vec<String> = url
            .path_segments()
            .ok_or("usage URL has no path")?
            .map(|s| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8_lossy()
                    .into_owned()
            })
            .collect();
        let n = segments.len();
        let tail: Vec<&str> = segments[n.saturating_sub(4)..]
            .iter()
            .map(String::as_str)
            .collect();
        if tail != ["v1", "tenants", case.tenant.as_str(), "usage"] {
            return Err(format!(
                "tenant {:?} gave the path {:?}",
                case.tenant,
                url.path()
            ));
        }
        let window: Option<String> = url
            .query_pairs()
            .find(|(k, _)| k == "window")
            .map(|(_, v)| v.into_owned());
        if window != case.window {
            return Err(format!("window {:?} read back as {window:?}", case.window));
        }
    }
    let tokens = ApiTokens::parse(TOKENS).expect("tokens file");
    for auth in [
        format!("Bearer {}", case.tenant),
        case.tenant.clone(),
        "Bearer 0123456789abcdef-acme".to_string(),
    ] {
        let mut headers = HeaderMap::new();
        if let Ok(v) = HeaderValue::from_str(&auth) {
            headers.insert(http::header::AUTHORIZATION, v);
        }
        if let Err(denied) = tokens.authorize(&headers, &case.tenant) {
            let status = denied.status.as_u16();
            if status != 401 && status != 403 {
                return Err(format!("refused with {status}"));
            }
        }
    }
    Ok(())
}

fn usage_inputs() -> BoxedStrategy<Input> {
    let seeds = seeds_of("usage_query");
    let whole = inputs(seeds.clone(), dictionary(), true);
    let piece = || {
        prop_oneof![
            2 => any::<String>(),
            2 => "[a-zA-Z0-9./%?#&= _-]{0,12}",
            1 => proptest::sample::select(&["", ".", "..", "/", "%2e%2e", "a/../b", "?x", "#", "\u{0}", "é"][..])
                .prop_map(str::to_string),
        ]
    };
    let fields = (
        proptest::sample::select(
            &[
                "http://localhost:8080",
                "https://sluice-1.sluice.svc:8443/",
                "http://10.0.0.7:8080/prefix/",
                "http://[::1]:8080",
                "unix:/run/sluice.sock",
                "mailto:a@b",
                "data:text/plain,x",
                "",
            ][..],
        ),
        piece(),
        proptest::option::of(piece()),
    )
        .prop_map(|(base, tenant, window)| {
            let case = serde_json::json!({"base": base, "tenant": tenant, "window": window});
            Input(case.to_string().into_bytes())
        });
    prop_oneof![1 => whole, 2 => fields].boxed()
}

proptest! {
    #![proptest_config(runner_config())]

    #[test]
    fn usage_query(input in usage_inputs()) {
        let r = check_usage(&input.0);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn usage_query_regressions() {
    replay("usage_query", check_usage);
}

/// The seed corpus itself decodes as its files say: valid seeds are
/// accepted (a corpus of refused inputs would fuzz only the first check).
#[test]
fn seeds_are_mostly_valid() {
    let ok = |target: &str, f: &dyn Fn(&[u8]) -> bool| -> BTreeMap<String, bool> {
        files("corpus", target)
            .into_iter()
            .map(|(name, bytes)| (name, f(&bytes)))
            .collect()
    };
    let tasks = ok("task", &|b| {
        decode_task(b, &EnvelopeLimits::default(), &TASK_TYPES).is_ok()
            || TraceParent::parse(&String::from_utf8_lossy(b)).is_some()
    });
    assert!(tasks.values().all(|v| *v), "{tasks:?}");
    for (name, bytes) in files("corpus", "config") {
        let (text, env) = config_case(&bytes);
        match Config::from_toml_with_env(&text, env) {
            Ok(_) => {}
            // Its secret file is absent on purpose (the loader reads it last).
            Err(e) if e.key.contains("sasl.password_file") => {}
            Err(e) => panic!("{name}: {e}"),
        }
    }
    let answers = ok("provider_response", &|b| {
        let (status, _, body) = response_case(b);
        !(200..300).contains(&status) || parse_chat_body(&body, RateLimitInfo::default()).is_ok()
    });
    assert_eq!(answers.values().filter(|v| !**v).count(), 1, "{answers:?}");
    for seed in progress_seeds() {
        sluice_topology::fuzzing::decode_progress(&seed).expect("progress seed");
    }
}

/// How deep the generated inputs get: per target, the share of inputs each
/// outcome takes (`cargo test --release --test fuzz outcome_mix -- --ignored
/// --nocapture`). Figures in docs/reliability.md.
#[test]
#[ignore]
fn outcome_mix() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    fn mix(name: &str, strategy: BoxedStrategy<Input>, outcome: impl Fn(&[u8]) -> String) {
        let mut runner = TestRunner::deterministic();
        let n = 20_000;
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for _ in 0..n {
            let input = strategy.new_tree(&mut runner).expect("input").current();
            *counts.entry(outcome(&input.0)).or_default() += 1;
        }
        let mut shares: Vec<(usize, String)> = counts.into_iter().map(|(k, v)| (v, k)).collect();
        shares.sort_by(|a, b| b.cmp(a));
        let top: Vec<String> = shares
            .iter()
            .take(8)
            .map(|(v, k)| format!("{k} {:.1}%", *v as f64 * 100.0 / n as f64))
            .collect();
        println!("{name}: {}", top.join(", "));
    }
    let limits = EnvelopeLimits::default();
    mix(
        "task",
        inputs(seeds_of("task"), dictionary(), true),
        |b| match decode_task(b, &limits, &TASK_TYPES) {
            Ok(_) => "accepted".into(),
            Err(e) => e.reason().split(':').next().unwrap_or_default().to_string(),
        },
    );
    mix("batch_answer", batch_inputs(), |b| {
        let (ids, answer) = batch_case(b);
        match split_batch_answer(&answer, &ids) {
            Ok(_) => "split".into(),
            Err(e) => format!("{e:?}")
                .split('(')
                .next()
                .unwrap_or_default()
                .to_string(),
        }
    });
    mix("provider_response", response_inputs(), |b| {
        let (status, _, body) = response_case(b);
        if !(200..300).contains(&status) {
            let (code, kind, message) = sluice::fuzzing::parse_error_body(&body);
            return if code.is_some() || kind.is_some() || !message.is_empty() {
                "error body read".into()
            } else {
                "error body unread".into()
            };
        }
        match parse_chat_body(&body, RateLimitInfo::default()) {
            Ok(_) => "answer".into(),
            Err(e) => e.code().to_string(),
        }
    });
    mix("config", config_inputs(), |b| {
        let (text, env) = config_case(b);
        match Config::from_toml_with_env(&text, env) {
            Ok(_) => "loaded".into(),
            Err(e) if e.key.starts_with("byte ") => "toml syntax".into(),
            Err(e) => format!("key {}", e.key.split(['.', '[']).next().unwrap_or_default()),
        }
    });
    mix(
        "progress",
        progress_inputs(),
        |b| match sluice_topology::fuzzing::decode_progress(b) {
            Ok(_) => "decoded".into(),
            Err(e) => e.chars().take(40).collect(),
        },
    );
}
