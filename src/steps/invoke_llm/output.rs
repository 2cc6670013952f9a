//! One output contract per task type, the same whether the task was answered alone or in a
//! batch: `summarize` and other free-text types give a non-empty string; `classify` gives
//! one of the task's labels (as the task spelled it); `extract` gives a JSON object with
//! every property the schema requires. An answer that does not fit is `invalid_output`, a
//! failed result (the call's tokens are billed all the same), never a success.

use serde_json::Value;

use crate::envelope::TaskEnvelope;
use crate::steps::invoke_llm::prompt::{strip_fence, task_types};

/// A result's `errorCode` for an answer outside the task's contract.
pub(crate) const INVALID_OUTPUT: &str = "invalid_output";
/// A result's `errorCode` for an answer cut at the completion token cap.
pub(crate) const TRUNCATED: &str = "truncated";
/// A result's `errorCode` for a model that declined to answer.
pub(crate) const REFUSED: &str = "refused";

/// What the model answered for one task: a whole message, or its item of a batch answer.
pub(crate) enum Raw<'a> {
    /// The message text of a call for this task alone.
    Text(&'a str),
    /// The task's `output` in a batch answer (any JSON).
    Item(Value),
}

/// The task's output under its type's contract, or why the answer does not fit it.
pub(crate) fn task_output(task: &TaskEnvelope, raw: Raw<'_>) -> Result<Value, String> {
    match task.task_type.as_str() {
        task_types::CLASSIFY => {
            let text = text_of(raw).ok_or("the answer is not a label")?;
            let said = text
                .trim()
                .trim_matches(|c: char| c == '"' || c == '\'' || c == '.' || c == '`')
                .trim();
            let labels = task.payload.labels.as_deref().unwrap_or_default();
            labels
                .iter()
                .find(|l| l.trim().eq_ignore_ascii_case(said))
                .map(|l| Value::String(l.clone()))
                .ok_or_else(|| format!("the answer is not one of the {} labels", labels.len()))
        }
        task_types::EXTRACT => {
            let value = match raw {
                Raw::Item(Value::String(s)) => parse_object(&s)?,
                Raw::Item(v) => v,
                Raw::Text(t) => parse_object(t)?,
            };
            let Value::Object(fields) = &value else {
                return Err("the answer is not a JSON object".into());
            };
            let required = task
                .payload
                .schema
                .as_ref()
                .and_then(|s| s.get("required"))
                .and_then(Value::as_array);
            if let Some(missing) = required
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .find(|k| !fields.contains_key(*k))
            {
                return Err(format!(
                    "the answer lacks the required property {missing:?}"
                ));
            }
            Ok(value)
        }
        _ => {
            let text = match raw {
                Raw::Text(t) => t.trim().to_string(),
                Raw::Item(Value::String(s)) => s.trim().to_string(),
                Raw::Item(Value::Null) => String::new(),
                Raw::Item(other) => other.to_string(),
            };
            if text.is_empty() {
                return Err("the answer is empty".into());
            }
            Ok(Value::String(text))
        }
    }
}

fn text_of(raw: Raw<'_>) -> Option<String> {
    match raw {
        Raw::Text(t) => Some(t.to_string()),
        Raw::Item(Value::String(s)) => Some(s),
        Raw::Item(_) => None,
    }
}

fn parse_object(text: &str) -> Result<Value, String> {
    serde_json::from_str(strip_fence(text)).map_err(|_| "the answer is not JSON".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{test_task as task, TaskPayload};
    use serde_json::json;

    #[test]
    fn classify_answers_one_of_its_labels_alone_or_batched() {
        let t = task(
            "classify",
            TaskPayload {
                labels: Some(vec!["News".into(), "sports".into()]),
                ..Default::default()
            },
        );
        for raw in [
            Raw::Text(" news.\n"),
            Raw::Text("\"NEWS\""),
            Raw::Item(json!("news")),
        ] {
            assert_eq!(task_output(&t, raw), Ok(json!("News")));
        }
        for raw in [
            Raw::Text(""),
            Raw::Text("weather"),
            Raw::Item(json!({"label": "news"})),
            Raw::Item(Value::Null),
            Raw::Item(json!(["news"])),
        ] {
            assert!(task_output(&t, raw).is_err());
        }
    }

    #[test]
    fn extract_answers_an_object_with_its_required_properties() {
        let t = task(
            "extract",
            TaskPayload {
                schema: Some(json!({"type": "object", "required": ["company"]})),
                ..Default::default()
            },
        );
        let object = json!({"company": "Acme", "amount": 120});
        for raw in [
            Raw::Text(r#"{"company": "Acme", "amount": 120}"#),
            Raw::Text("```json\n{\"company\": \"Acme\", \"amount\": 120}\n```"),
            Raw::Item(object.clone()),
            Raw::Item(json!("{\"company\": \"Acme\", \"amount\": 120}")),
        ] {
            assert_eq!(task_output(&t, raw), Ok(object.clone()));
        }
        for raw in [
            Raw::Text(r#"{"company": "Ac"#),
            Raw::Text("Acme"),
            Raw::Text(r#"{"amount": 1}"#),
            Raw::Item(json!(["Acme"])),
        ] {
            assert!(task_output(&t, raw).is_err());
        }
    }

    #[test]
    fn summaries_are_non_empty_strings_alone_or_batched() {
        let t = task("summarize", TaskPayload::default());
        assert_eq!(task_output(&t, Raw::Text(" short. ")), Ok(json!("short.")));
        assert_eq!(
            task_output(&t, Raw::Item(json!("short."))),
            Ok(json!("short."))
        );
        assert!(task_output(&t, Raw::Text("  ")).is_err());
        assert!(task_output(&t, Raw::Item(Value::Null)).is_err());
    }
}
