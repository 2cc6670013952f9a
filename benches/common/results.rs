//! bench-usage's dataset, which bench-peer's accounting job reads too.

use std::collections::BTreeMap;

use chrono::TimeZone;
use sluice::envelope::{Route, TaskResult};

/// bench-usage's dataset: `n` results of `tenants` tenants (two models,
/// cached tokens), completed over the last ten minutes, keyed by tenant.
pub fn task_results(n: usize, tenants: usize, now: i64) -> impl Iterator<Item = TaskResult> {
    (0..n).map(move |i| {
        let tokens = 100 + (i % 900) as u64;
        let at = now - 600_000 + (i as i64 * 600_000) / n as i64;
        TaskResult {
            task_id: format!("task-{i}"),
            task_type: "classify".into(),
            tenant_id: format!("tenant-{}", (i * 7919) % tenants),
            success: true,
            completed_at: chrono::Utc.timestamp_millis_opt(at).unwrap(),
            processing_ms: 40,
            model: if i % 5 == 0 { "large" } else { "small" }.into(),
            route: Route::default(),
            input_tokens: tokens,
            output_tokens: tokens / 3,
            cached_tokens: tokens / 4,
            cost_micros: tokens as i64 * 7,
            attempts: 1,
            batch_id: None,
            output: serde_json::json!({ "label": "news" }),
            error_code: None,
            error_message: None,
            metadata: BTreeMap::new(),
        }
    })
}
