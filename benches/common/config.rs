//! The configuration the LLM benches start `sluice run` (and `sluice
//! gateway`) with, and the creation of its topics.

use std::path::{Path, PathBuf};

/// A bench's pipeline: application `<prefix>-app` on `bootstrap`, one task
/// type (`classify`) on topics of `partitions` partitions named after
/// `prefix`, the simulator at `sim_url` as provider `sim`.
pub struct BenchPipeline<'a> {
    pub prefix: &'a str,
    pub bootstrap: &'a str,
    pub sim_url: &'a str,
    pub partitions: i32,
    /// Lines added to `[app]`.
    pub app: &'a str,
    /// Lines added to `[kafka]`.
    pub kafka: &'a str,
}

impl BenchPipeline<'_> {
    /// Writes `<dir>/sluice.toml` (state in `<dir>/state`): the pipeline's
    /// tables, then `rest` (models, prices, batching, listeners).
    pub fn write(&self, dir: &Path, rest: &str) -> PathBuf {
        let config = dir.join("sluice.toml");
        let BenchPipeline {
            prefix,
            bootstrap,
            sim_url,
            partitions,
            app,
            kafka,
        } = self;
        std::fs::write(
            &config,
            format!(
                r#"
[app]
id = "{prefix}-app"
state_dir = "{state}"
{app}

[kafka]
bootstrap_servers = "{bootstrap}"
{kafka}

[topics]
task_types = ["classify"]
tasks_prefix = "{prefix}.tasks."
results_completed = "{prefix}.results.completed"
results_failed = "{prefix}.results.failed"
partitions = {partitions}

[[llm.providers]]
name = "sim"
base_url = "{sim_url}"
{rest}"#,
                state = dir.join("state").display(),
            ),
        )
        .unwrap();
        config
    }
}

/// `sluice topics create --config <config>` with the `bin` built for the
/// benches; panics with its error output when it fails.
pub fn create_topics(bin: &str, config: &Path) {
    let out = std::process::Command::new(bin)
        .args([
            "topics",
            "create",
            "--config",
            &config.display().to_string(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "topics create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
