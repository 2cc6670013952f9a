//! `[accounting]`: the account step's configuration section and its checks.

use serde::{Deserialize, Serialize};

use super::{default_windows, Budgets, Quotas, UsageUpdates, WindowSpec};
use crate::error::ConfigError;

/// `[accounting]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccountingSection {
    /// Whether completed results are accounted per tenant.
    pub enabled: bool,
    /// Tumbling window sizes and their retention.
    pub windows: Vec<WindowSpec>,
    /// Cost budgets per window name, micro-dollars (a default and per tenant).
    pub budgets: Budgets,
    /// When window updates go to the usage topic: `on_commit` (the latest
    /// state of each window updated, once per commit) or `on_update` (one
    /// record per result and window).
    pub usage_updates: UsageUpdates,
    /// Fractions of a budget that raise an alert, rising.
    pub thresholds: Vec<f64>,
    /// Token and cost quotas per window (a default and per tenant), hard or
    /// soft.
    pub quotas: Quotas,
    /// Route a tenant's tiered tasks one tier down once its cost passes this
    /// fraction of a budget (off when unset; a soft quota crossed always does).
    pub downgrade_at: Option<f64>,
}

impl Default for AccountingSection {
    fn default() -> Self {
        AccountingSection {
            enabled: true,
            windows: default_windows(),
            budgets: Budgets::default(),
            usage_updates: UsageUpdates::default(),
            thresholds: vec![0.5, 0.8, 1.0],
            quotas: Quotas::default(),
            downgrade_at: None,
        }
    }
}

impl AccountingSection {
    /// Checks of the section's own keys (its windows, budgets, thresholds and quotas).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let windows = &self.windows;
        for (i, w) in windows.iter().enumerate() {
            let key = |field: &str| format!("accounting.windows[{i}].{field}");
            if w.name.is_empty()
                || !w.name.chars().all(|c| c.is_ascii_alphanumeric())
                || windows[..i].iter().any(|o| o.name == w.name)
            {
                return Err(ConfigError::new(
                    key("name"),
                    "must be a unique, non-empty name of letters and digits",
                ));
            }
            match (w.calendar, w.size_ms) {
                (None, s) if s <= 0 => {
                    return Err(ConfigError::new(
                        key("size_ms"),
                        "must be positive (or set calendar = \"month\")",
                    ))
                }
                (Some(_), s) if s != 0 => {
                    return Err(ConfigError::new(
                        key("size_ms"),
                        "must be unset for a calendar window",
                    ))
                }
                _ => {}
            }
            if w.retention_ms < w.longest_ms() {
                return Err(ConfigError::new(
                    key("retention_ms"),
                    "must be at least the window size",
                ));
            }
        }
        let t = &self.thresholds;
        if t.len() > 16
            || t.iter().any(|x| !(x.is_finite() && *x > 0.0))
            || t.windows(2).any(|p| p[0] >= p[1])
        {
            return Err(ConfigError::new(
                "accounting.thresholds",
                "at most 16 positive fractions, rising",
            ));
        }
        let budgets = &self.budgets;
        let named = std::iter::once(("default".to_string(), &budgets.default)).chain(
            budgets
                .tenants
                .iter()
                .map(|(tenant, b)| (format!("tenants.{tenant}"), b)),
        );
        for (at, b) in named {
            for (window, micros) in b {
                let key = format!("accounting.budgets.{at}.{window}");
                if !windows.iter().any(|w| &w.name == window) {
                    return Err(ConfigError::new(key, "not a window in accounting.windows"));
                }
                if *micros <= 0 {
                    return Err(ConfigError::new(key, "must be positive (micro-dollars)"));
                }
            }
        }
        if let Some(f) = self.downgrade_at {
            if !(f.is_finite() && f > 0.0) {
                return Err(ConfigError::new(
                    "accounting.downgrade_at",
                    "must be a positive fraction of a budget",
                ));
            }
        }
        let quotas = &self.quotas;
        let named = quotas
            .default
            .iter()
            .map(|q| ("default".to_string(), q))
            .chain(
                quotas
                    .tenants
                    .iter()
                    .map(|(t, q)| (format!("tenants.{t}"), q)),
            );
        for (at, q) in named {
            let key = |field: &str| format!("accounting.quotas.{at}.{field}");
            if !self.enabled {
                return Err(ConfigError::new(
                    "accounting.enabled",
                    "quotas need accounting (their windows are its windows)",
                ));
            }
            if !windows.iter().any(|w| w.name == q.window) {
                return Err(ConfigError::new(
                    key("window"),
                    "not a window in accounting.windows",
                ));
            }
            if q.tokens.is_none() && q.cost_micros.is_none() {
                return Err(ConfigError::new(
                    key("tokens"),
                    "a quota needs tokens, cost_micros or both",
                ));
            }
            if q.tokens == Some(0) {
                return Err(ConfigError::new(key("tokens"), "must be positive"));
            }
            if q.cost_micros.is_some_and(|c| c <= 0) {
                return Err(ConfigError::new(key("cost_micros"), "must be positive"));
            }
        }
        Ok(())
    }
}
