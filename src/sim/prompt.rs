//! Deterministic answers: reads the task lines of a prompt (single task or micro-batch) and
//! produces an output that depends only on the prompt, plus the token arithmetic.
//!
//! Prompt format (parsing is tolerant: keys are case-insensitive, unknown lines ignored):
//!
//! ```text
//! system: Task: summarize | classify | extract | <anything: generic>
//!         Max words: N                 (summarize)
//!         Labels: a, b, c              (classify)
//!         Schema: {"type":"object",…}  (extract; may span lines)
//!         Batch: v1                    (micro-batch)
//! user:   the content, or for a batch:
//!         ### item <id>
//!         <content of that item>
//!         ### item <id>
//!         …
//! ```

use serde_json::{json, Map, Value};

/// Words kept by `summarize` when the prompt gives no `Max words` line.
pub(crate) const DEFAULT_MAX_WORDS: usize = 50;

/// Words echoed by the generic task.
const GENERIC_WORDS: usize = 64;

/// Token overhead of each chat message.
pub(crate) const TOKENS_PER_MESSAGE: u64 = 4;

/// 64-bit FNV-1a, the simulator's stable hash (never std's randomized hasher).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET, |hash, b| (hash ^ u64::from(*b)).wrapping_mul(PRIME))
}

/// FNV-1a over several parts, separated so that `("ab","c")` and `("a","bc")` differ.
pub(crate) fn fnv1a64_parts(parts: &[&str]) -> u64 {
    let mut joined = Vec::new();
    for part in parts {
        joined.extend_from_slice(part.as_bytes());
        joined.push(0xff);
    }
    fnv1a64(&joined)
}

/// Maps a hash to a fraction in `[0, 1)`.
pub(crate) fn unit_fraction(hash: u64) -> f64 {
    (hash >> 11) as f64 / (1u64 << 53) as f64
}

/// Tokens of a text: one per four characters, rounded up.
pub(crate) fn tokens_for_text(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4)
}

/// Tokens of one chat message: its text plus a fixed overhead.
pub(crate) fn tokens_for_message(text: &str) -> u64 {
    tokens_for_text(text) + TOKENS_PER_MESSAGE
}

/// What a prompt asks for.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum TaskKind {
    /// First `max_words` words of the content.
    Summarize { max_words: usize },
    /// One of `labels`, chosen by hashing the content.
    Classify { labels: Vec<String> },
    /// A JSON object with one entry per schema property.
    Extract { schema: Value },
    /// Anything else: the first words of the content.
    Generic,
}

/// The task lines of a system prompt.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TaskSpec {
    pub kind: TaskKind,
    /// `Batch: v1` was present.
    pub batch: bool,
}

/// Reads the task lines of the (joined) system messages.
pub(crate) fn parse_spec(system: &str) -> TaskSpec {
    let mut task: Option<String> = None;
    let mut max_words = None;
    let mut labels = None;
    let mut schema = None;
    let mut batch = false;
    let mut offset = 0;
    for line in system.split_inclusive('\n') {
        let line_start = offset;
        offset += line.len();
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let key = key
            .trim()
            .trim_start_matches(['-', '*', '#', ' '])
            .to_ascii_lowercase();
        let value = value.trim();
        // The first occurrence of a key wins: task lines come before free-text instructions.
        match key.as_str() {
            "task" if task.is_none() => task = Some(value.to_ascii_lowercase()),
            "max words" | "max_words" | "maxwords" if max_words.is_none() => {
                max_words = value
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse::<usize>().ok());
            }
            "labels" if labels.is_none() => {
                labels = Some(
                    value
                        .split(',')
                        .map(|l| l.trim().to_owned())
                        .filter(|l| !l.is_empty())
                        .collect::<Vec<_>>(),
                );
            }
            "schema" if schema.is_none() => {
                // The schema may span several lines: read one JSON value from after the colon.
                let colon = line.find(':').map_or(0, |i| i + 1);
                let rest = &system[line_start + colon..];
                schema = serde_json::Deserializer::from_str(rest)
                    .into_iter::<Value>()
                    .next()
                    .and_then(Result::ok);
            }
            "batch" => batch = batch || value.eq_ignore_ascii_case("v1"),
            _ => {}
        }
    }
    let first_word = task
        .as_deref()
        .and_then(|t| t.split_whitespace().next())
        .unwrap_or("");
    let kind = match first_word {
        "summarize" | "summarise" | "summary" => TaskKind::Summarize {
            max_words: max_words.unwrap_or(DEFAULT_MAX_WORDS),
        },
        "classify" | "classification" => TaskKind::Classify {
            labels: labels.unwrap_or_default(),
        },
        "extract" | "extraction" => TaskKind::Extract {
            schema: schema.unwrap_or(Value::Null),
        },
        _ => TaskKind::Generic,
    };
    TaskSpec { kind, batch }
}

fn first_words(content: &str, n: usize) -> String {
    content
        .split_whitespace()
        .take(n)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Words of the content stripped of surrounding punctuation.
fn clean_words(content: &str) -> Vec<&str> {
    content
        .split_whitespace()
        .map(|w| w.trim_matches(|c: char| !c.is_alphanumeric()))
        .filter(|w| !w.is_empty())
        .collect()
}

/// The output of one task for one content: a JSON string, or an object for `extract`.
/// Surrounding whitespace of the content is ignored, so a task gets the same output alone
/// and inside a micro-batch.
pub(crate) fn task_output(kind: &TaskKind, content: &str) -> Value {
    let content = content.trim();
    match kind {
        TaskKind::Summarize { max_words } => Value::String(first_words(content, *max_words)),
        TaskKind::Classify { labels } => {
            if labels.is_empty() {
                return Value::String("unlabeled".to_owned());
            }
            let index = fnv1a64(content.as_bytes()) % labels.len() as u64;
            Value::String(labels[index as usize].clone())
        }
        TaskKind::Extract { schema } => extract(schema, content),
        TaskKind::Generic => {
            let words = first_words(content, GENERIC_WORDS);
            Value::String(if words.is_empty() {
                "OK".to_owned()
            } else {
                words
            })
        }
    }
}

/// The output as message text: strings as they are, objects as compact JSON.
pub(crate) fn output_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn extract(schema: &Value, content: &str) -> Value {
    let words = clean_words(content);
    let mut out = Map::new();
    let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
        return Value::Object(out);
    };
    for (name, property) in properties {
        let h = fnv1a64_parts(&[name.as_str(), content]);
        if let Some(choices) = property.get("enum").and_then(Value::as_array) {
            if !choices.is_empty() {
                let pick = choices[(h % choices.len() as u64) as usize].clone();
                out.insert(name.clone(), pick);
                continue;
            }
        }
        let value = match property_type(property) {
            Some("string") => Value::String(if words.is_empty() {
                String::new()
            } else {
                words[(h % words.len() as u64) as usize].to_owned()
            }),
            Some("integer") => json!(h % 1000),
            Some("number") => json!((h % 100_000) as f64 / 100.0),
            Some("boolean") => Value::Bool(h & 1 == 1),
            _ => Value::Null,
        };
        out.insert(name.clone(), value);
    }
    Value::Object(out)
}

/// The property's type: a string, or the first non-null entry of a type array.
fn property_type(property: &Value) -> Option<&str> {
    match property.get("type")? {
        Value::String(t) => Some(t.as_str()),
        Value::Array(types) => types
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null"),
        _ => None,
    }
}

/// One item of a micro-batch prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BatchItem {
    pub id: String,
    pub content: String,
}

/// Splits a micro-batch user message into its `### item <id>` sections. A header starts at
/// the beginning of its line (the client escapes look-alike content lines with a leading
/// space). Text before the first item is ignored.
pub(crate) fn parse_batch_items(user: &str) -> Vec<BatchItem> {
    let mut items = Vec::new();
    let mut current: Option<(String, Vec<&str>)> = None;
    for line in user.lines() {
        if let Some(id) = item_header(line) {
            if let Some((id, lines)) = current.take() {
                items.push(finish_item(id, &lines));
            }
            current = Some((id.to_owned(), Vec::new()));
        } else if let Some((_, lines)) = current.as_mut() {
            lines.push(line);
        }
    }
    if let Some((id, lines)) = current {
        items.push(finish_item(id, &lines));
    }
    items
}

fn item_header(line: &str) -> Option<&str> {
    let rest = line.trim_end().strip_prefix("###")?.trim_start();
    let head = rest.get(..4)?;
    if !head.eq_ignore_ascii_case("item") {
        return None;
    }
    let id = &rest[4..];
    // "### items" is not a header; "### item" followed by whitespace or nothing is.
    if id.is_empty() || id.starts_with(char::is_whitespace) {
        Some(id.trim())
    } else {
        None
    }
}

fn finish_item(id: String, lines: &[&str]) -> BatchItem {
    BatchItem {
        id,
        content: lines.join("\n").trim().to_owned(),
    }
}

/// The well-formed answer to a micro-batch: `{"items":[{"id":…,"output":…},…]}`.
pub(crate) fn batch_answer(kind: &TaskKind, items: &[BatchItem]) -> String {
    let items: Vec<Value> = items
        .iter()
        .map(|item| json!({ "id": item.id, "output": task_output(kind, &item.content) }))
        .collect();
    json!({ "items": items }).to_string()
}

/// A well-formed answer to a micro-batch listing its items last to first.
pub(crate) fn reordered_batch_answer(kind: &TaskKind, items: &[BatchItem]) -> String {
    let reversed: Vec<BatchItem> = items.iter().rev().cloned().collect();
    batch_answer(kind, &reversed)
}

/// An answer to a micro-batch that a client cannot split, chosen by `hash`: an item dropped,
/// an item given twice, text that is not JSON, or JSON cut short.
pub(crate) fn malformed_batch_answer(kind: &TaskKind, items: &[BatchItem], hash: u64) -> String {
    match hash % 4 {
        0 if !items.is_empty() => batch_answer(kind, &items[..items.len() - 1]),
        3 if !items.is_empty() => {
            let mut twice = items.to_vec();
            twice.push(items[0].clone());
            batch_answer(kind, &twice)
        }
        1 => {
            let mut text = String::from("Sure! Here are the results:\n");
            for item in items {
                text.push_str(&format!(
                    "- {}: {}\n",
                    item.id,
                    output_text(&task_output(kind, &item.content))
                ));
            }
            text
        }
        _ => {
            let full = batch_answer(kind, items);
            let cut = full.len() / 2;
            let cut = (0..=cut)
                .rev()
                .find(|i| full.is_char_boundary(*i))
                .unwrap_or(0);
            full[..cut].to_owned()
        }
    }
}

/// Cuts `text` to at most `max_tokens` tokens (four characters each).
pub(crate) fn truncate_to_tokens(text: &str, max_tokens: u64) -> String {
    let max_chars = usize::try_from(max_tokens.saturating_mul(4)).unwrap_or(usize::MAX);
    text.chars().take(max_chars).collect()
}
