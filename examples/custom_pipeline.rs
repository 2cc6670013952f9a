//! A pipeline of one's own, built with the library.
//!
//! Before the LLM step: a filter (tasks marked `metadata.dryRun = "true"`
//! are not sent to a provider) and an enrichment (each task gets its
//! tenant's region in its metadata, which its result carries). After it: a
//! sink of one's own, compact answer records on a topic of one's choice.
//! The configured steps (task topics, routing, batching, the provider call)
//! come from a `sluice run` config file.
//!
//! ```sh
//! cargo run --release --example custom_pipeline -- sluice.toml answers.topic
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sluice::steps::prelude::*;
use sluice::steps::Steps;
use sluice_topology::{JsonCodec, StringCodec, Topology, TopologyError};

/// What the custom sink writes per task.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Answer {
    /// The task.
    pub task_id: String,
    /// Its tenant.
    pub tenant_id: String,
    /// The region the enrichment gave it.
    pub region: String,
    /// Whether the provider answered.
    pub ok: bool,
    /// The answer (or the error code).
    pub answer: serde_json::Value,
    /// Tokens billed for it.
    pub tokens: u64,
}

/// Metadata key a task is marked with to skip the provider.
pub const DRY_RUN: &str = "dryRun";
/// Metadata key the enrichment writes.
pub const REGION: &str = "region";

/// The pipeline: tasks → filter → enrich → route → micro-batch → LLM → answers.
pub fn topology(
    steps: &Steps,
    answers_topic: &str,
    regions: BTreeMap<String, String>,
) -> Result<Topology, TopologyError> {
    let regions = Arc::new(regions);
    let b = StreamBuilder::new();
    tasks(&b, &steps.source)?
        .filter(|r| r.value.envelope.metadata.get(DRY_RUN).map(String::as_str) != Some("true"))
        .map_values(move |_, mut task| {
            let region = regions
                .get(task.tenant())
                .cloned()
                .unwrap_or_else(|| "unknown".into());
            task.envelope.metadata.insert(REGION.into(), region);
            task
        })
        .route(&steps.route)
        .micro_batch(&steps.batching)
        .invoke_llm(&steps.llm)
        .map_values(|_, r| Answer {
            region: r.metadata.get(REGION).cloned().unwrap_or_default(),
            ok: r.success,
            answer: if r.success {
                r.output.clone()
            } else {
                serde_json::Value::from(r.error_code.clone().unwrap_or_default())
            },
            tokens: r.input_tokens + r.output_tokens,
            task_id: r.task_id,
            tenant_id: r.tenant_id,
        })
        .to(answers_topic, StringCodec, JsonCodec::<Answer>::default());
    b.build()
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(config), Some(answers)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: custom_pipeline CONFIG ANSWERS_TOPIC");
    };
    let config = sluice::config::Config::load(config.as_ref())?;
    let regions = BTreeMap::from([("acme".to_string(), "eu-west".to_string())]);
    sluice::cli::run::run_pipeline(
        config,
        |steps| topology(steps, &answers, regions),
        sluice::cli::run::signals(),
    )
    .await?;
    Ok(())
}
