//! `sluice usage TENANT --url URL`: asks any running instance for a
//! tenant's current usage windows (it forwards to the instance holding the
//! tenant) and prints them as a table or as the JSON answer.

use std::time::Duration;

use crate::http::forward::ErrorBody;
use crate::http::usage::{usage_url, TenantUsageReport, FORWARD_TIMEOUT};

/// `sluice usage TENANT --url URL`.
#[derive(clap::Args, Debug)]
pub struct UsageArgs {
    /// The tenant id.
    pub tenant: String,
    /// Any instance's HTTP listener, e.g. http://localhost:8080.
    #[arg(long, env = "SLUICE_URL")]
    pub url: String,
    /// Only this window size (e.g. 1h).
    #[arg(long)]
    pub window: Option<String>,
    /// Prints the JSON answer instead of a table.
    #[arg(long)]
    pub json: bool,
    /// A bearer token of the query API (an admin token, or the tenant's).
    #[arg(long, env = "SLUICE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// Why `sluice usage` failed.
#[derive(Debug, thiserror::Error)]
pub enum UsageCliError {
    /// The URL is not usable.
    #[error("--url {0}")]
    BadUrl(String),
    /// The instance could not be reached.
    #[error("{0}")]
    Http(#[from] reqwest::Error),
    /// The instance answered with an error.
    #[error("{status}: {reason}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The instance's reason.
        reason: String,
    },
    /// The answer was not a usage report.
    #[error("unexpected answer: {0}")]
    Malformed(String),
}

/// Queries an instance and prints the tenant's current windows.
pub async fn run_cli(args: UsageArgs) -> Result<(), UsageCliError> {
    let url = usage_url(&args.url, &args.tenant, args.window.as_deref())
        .map_err(UsageCliError::BadUrl)?;
    let mut request = reqwest::Client::new()
        .get(url)
        .timeout(FORWARD_TIMEOUT + Duration::from_secs(5));
    if let Some(token) = &args.token {
        request = request.bearer_auth(token);
    }
    let resp = request.send().await?;
    let status = resp.status().as_u16();
    let body = resp.bytes().await?;
    if !(200..300).contains(&status) {
        let reason = serde_json::from_slice::<ErrorBody>(&body)
            .map(|e| e.reason)
            .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned());
        return Err(UsageCliError::Refused { status, reason });
    }
    let report: TenantUsageReport =
        serde_json::from_slice(&body).map_err(|e| UsageCliError::Malformed(e.to_string()))?;
    if args.json {
        println!("{}", String::from_utf8_lossy(&body));
    } else {
        print!("{}", table(&report));
    }
    Ok(())
}

/// A report as a table: a heading line, then one line per window.
pub fn table(report: &TenantUsageReport) -> String {
    let mut out = format!(
        "tenant {} (served by {})\n{:<6} {:<20} {:>9} {:>12} {:>12} {:>12} {:>14}\n",
        report.tenant_id,
        report.served_by,
        "WINDOW",
        "START (UTC)",
        "REQUESTS",
        "TOKENS IN",
        "TOKENS OUT",
        "CACHED",
        "COST"
    );
    for w in &report.windows {
        let start = chrono::DateTime::from_timestamp_millis(w.window_start)
            .map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
            .unwrap_or_else(|| w.window_start.to_string());
        out.push_str(&format!(
            "{:<6} {:<20} {:>9} {:>12} {:>12} {:>12} {:>14}\n",
            w.window,
            start,
            w.requests,
            w.input_tokens,
            w.output_tokens,
            w.cached_tokens,
            dollars(w.cost_micros)
        ));
    }
    out
}

/// Micro-dollars as dollars, exactly (`$1.234567`).
pub fn dollars(micros: i64) -> String {
    let sign = if micros < 0 { "-" } else { "" };
    let m = micros.unsigned_abs();
    format!("{sign}${}.{:06}", m / 1_000_000, m % 1_000_000)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::http::usage::WindowUsage;

    #[test]
    fn costs_print_as_exact_dollars_and_windows_as_lines() {
        assert_eq!(dollars(0), "$0.000000");
        assert_eq!(dollars(1_234_567), "$1.234567");
        assert_eq!(dollars(-5), "-$0.000005");
        let report = TenantUsageReport {
            tenant_id: "acme".into(),
            served_by: "http://a".into(),
            windows: vec![WindowUsage {
                window: "1h".into(),
                window_start: 3_600_000,
                window_end: 7_200_000,
                requests: 3,
                input_tokens: 120,
                output_tokens: 30,
                cached_tokens: 10,
                cost_micros: 42,
                by_model: BTreeMap::new(),
            }],
        };
        let text = table(&report);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].contains("acme") && lines[0].contains("http://a"));
        let cols: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "1h",
                "1970-01-01T01:00:00Z",
                "3",
                "120",
                "30",
                "10",
                "$0.000042"
            ]
        );
    }
}
