//! Complexity routing: which model answers a task, and why.
//!
//! A task names its model explicitly (`payload.model`), or its task type is
//! pinned to one (`routing.by_task_type`), or it gets a complexity score in
//! `[0, 1]` — the caller's `payload.complexity` when given, else one computed
//! from the task's features — and the first tier whose `max_score` covers the
//! score picks the model. Without tiers every other task goes to the default
//! model. While a model's breaker is open, its fallback chain
//! (`routing.fallbacks`, followed model to model) gives the first model whose
//! breaker is closed. A tenant near its budget can be routed one tier down.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use prometheus::{IntCounterVec, Opts, Registry};
use serde::{Deserialize, Serialize};

use crate::envelope::{Route, TaskEnvelope};
use crate::error::ConfigError;
use crate::steps::source::Task;

/// A task with the model that answers it.
#[derive(Clone, Debug)]
pub struct Routed {
    /// The task.
    pub task: Task,
    /// The model to call.
    pub model: String,
    /// Tier and reason, recorded in the result.
    pub route: Route,
}

/// `[routing]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingSection {
    /// Model for tasks no other rule covers (default: the first model).
    pub default_model: Option<String>,
    /// Model per task type.
    pub by_task_type: BTreeMap<String, String>,
    /// Fallback model per model, used while a model's breaker is open (followed
    /// model to model: a fallback chain).
    pub fallbacks: BTreeMap<String, String>,
    /// Complexity tiers by rising `max_score` (empty: no complexity routing).
    pub tiers: Vec<Tier>,
    /// How the complexity of a task without `payload.complexity` is computed.
    pub features: FeatureWeights,
    /// Whether a task's own `payload.model` and `payload.complexity` are
    /// honoured. Off by default: a producer could otherwise pick the dearest
    /// model for every task.
    pub allow_task_overrides: bool,
}

impl RoutingSection {
    /// Checks of the section's own keys; `known` says whether a name is a
    /// configured model.
    pub fn validate(&self, known: impl Fn(&str) -> bool) -> Result<(), ConfigError> {
        if let Some(m) = &self.default_model {
            if !known(m) {
                return Err(ConfigError::new(
                    "routing.default_model",
                    format!("unknown model {m}"),
                ));
            }
        }
        for (t, m) in &self.by_task_type {
            if !known(m) {
                return Err(ConfigError::new(
                    format!("routing.by_task_type.{t}"),
                    format!("unknown model {m}"),
                ));
            }
        }
        for (from, to) in &self.fallbacks {
            if !known(from) {
                return Err(ConfigError::new(
                    format!("routing.fallbacks.{from}"),
                    format!("unknown model {from}"),
                ));
            }
            if !known(to) {
                return Err(ConfigError::new(
                    format!("routing.fallbacks.{from}"),
                    format!("unknown model {to}"),
                ));
            }
        }
        self.validate_tiers(known)
    }

    fn validate_tiers(&self, known: impl Fn(&str) -> bool) -> Result<(), ConfigError> {
        let tiers = &self.tiers;
        let mut last = 0.0;
        for (i, t) in tiers.iter().enumerate() {
            let key = |field: &str| format!("routing.tiers[{i}].{field}");
            if t.name.trim().is_empty() || tiers[..i].iter().any(|o| o.name == t.name) {
                return Err(ConfigError::new(key("name"), "empty or repeated tier name"));
            }
            if !known(&t.model) {
                return Err(ConfigError::new(
                    key("model"),
                    format!("unknown model {}", t.model),
                ));
            }
            if !(t.max_score > last && t.max_score <= 1.0) {
                return Err(ConfigError::new(
                    key("max_score"),
                    "must rise from tier to tier, within (0, 1]",
                ));
            }
            last = t.max_score;
        }
        if !tiers.is_empty() && last < 1.0 {
            return Err(ConfigError::new(
                format!("routing.tiers[{}].max_score", tiers.len() - 1),
                "the last tier must reach 1.0",
            ));
        }
        let f = &self.features;
        let unit = |v: f64| (0.0..=1.0).contains(&v);
        for (t, v) in &f.type_complexity {
            if !unit(*v) {
                return Err(ConfigError::new(
                    format!("routing.features.type_complexity.{t}"),
                    "must be within [0, 1]",
                ));
            }
        }
        if !unit(f.default_type_complexity) {
            return Err(ConfigError::new(
                "routing.features.default_type_complexity",
                "must be within [0, 1]",
            ));
        }
        for (name, w) in [
            ("type_weight", f.type_weight),
            ("size_weight", f.size_weight),
            ("structure_weight", f.structure_weight),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(ConfigError::new(
                    format!("routing.features.{name}"),
                    "must be a non-negative number",
                ));
            }
        }
        Ok(())
    }

    /// The routing rules (see [`Router`]); `first_model` answers what no
    /// rule covers unless `default_model` is set.
    pub fn router(&self, first_model: &str) -> Router {
        Router {
            default_model: self
                .default_model
                .clone()
                .unwrap_or_else(|| first_model.to_string()),
            by_task_type: self.by_task_type.clone(),
            tiers: self.tiers.clone(),
            fallbacks: self.fallbacks.clone(),
            features: self.features.clone(),
            allow_task_overrides: self.allow_task_overrides,
        }
    }
}

/// A score range and the model that serves it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tier {
    /// The tier's name, recorded in results (e.g. `small`).
    pub name: String,
    /// The highest score this tier takes (tiers are listed by rising score;
    /// the last one must reach 1.0).
    pub max_score: f64,
    /// The model that answers this tier's tasks.
    pub model: String,
}

/// How the computed score weighs a task's features (each in `[0, 1]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FeatureWeights {
    /// Base complexity per task type; others get `default_type_complexity`.
    pub type_complexity: BTreeMap<String, f64>,
    /// Base complexity of a task type not listed.
    pub default_type_complexity: f64,
    /// Estimated prompt tokens at which the size feature reaches 1 (it grows
    /// with the logarithm of the size).
    pub full_size_tokens: u64,
    /// Weight of the task type's base complexity.
    pub type_weight: f64,
    /// Weight of the size feature.
    pub size_weight: f64,
    /// Weight of the structure feature (schema fields and depth, labels).
    pub structure_weight: f64,
}

impl Default for FeatureWeights {
    fn default() -> Self {
        FeatureWeights {
            type_complexity: BTreeMap::from([
                ("classify".to_string(), 0.2),
                ("summarize".to_string(), 0.4),
                ("extract".to_string(), 0.6),
            ]),
            default_type_complexity: 0.5,
            full_size_tokens: 4_096,
            type_weight: 0.4,
            size_weight: 0.4,
            structure_weight: 0.2,
        }
    }
}

/// Where a task goes: the model, and the tier and reason for its result.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The model to call.
    pub model: String,
    /// The routing record of the result.
    pub route: Route,
}

/// The routing rules of an instance (validated by the config).
#[derive(Debug, Clone, Default)]
pub struct Router {
    /// Model for tasks no other rule covers.
    pub default_model: String,
    /// Model per task type (above the tiers).
    pub by_task_type: BTreeMap<String, String>,
    /// Tiers by rising `max_score`; empty: no complexity routing.
    pub tiers: Vec<Tier>,
    /// Fallback per model while its breaker is open.
    pub fallbacks: BTreeMap<String, String>,
    /// The computed score's weights.
    pub features: FeatureWeights,
    /// Whether a task's `payload.model` and `payload.complexity` are
    /// honoured (`[routing] allow_task_overrides`).
    pub allow_task_overrides: bool,
}

impl Router {
    /// The task's complexity and whether the caller gave it (honoured only
    /// with `allow_task_overrides`).
    pub fn score(&self, task: &TaskEnvelope) -> (f64, bool) {
        match task.payload.complexity {
            Some(c) if c.is_finite() && self.allow_task_overrides => (c.clamp(0.0, 1.0), true),
            _ => (self.feature_score(task), false),
        }
    }

    /// The score computed from the task type, the prompt's estimated size,
    /// and the structure asked for.
    pub fn feature_score(&self, task: &TaskEnvelope) -> f64 {
        let f = &self.features;
        let base = f
            .type_complexity
            .get(&task.task_type)
            .copied()
            .unwrap_or(f.default_type_complexity)
            .clamp(0.0, 1.0);
        let schema_len = task
            .payload
            .schema
            .as_ref()
            .map_or(0, |s| s.to_string().len());
        let tokens =
            crate::llm::wire::estimate_tokens(task.payload.content.len() + schema_len) as f64;
        let full = f.full_size_tokens.max(2) as f64;
        let size = ((1.0 + tokens).ln() / (1.0 + full).ln()).min(1.0);
        let structure = structure(task);
        let total = f.type_weight + f.size_weight + f.structure_weight;
        if total <= 0.0 {
            return base;
        }
        ((f.type_weight * base + f.size_weight * size + f.structure_weight * structure) / total)
            .clamp(0.0, 1.0)
    }

    /// Routes a task; with `downgrade` (its tenant is near its budget) a
    /// tiered task goes one tier down.
    pub fn route(
        &self,
        task: &TaskEnvelope,
        known: impl Fn(&str) -> bool,
        downgrade: bool,
    ) -> Decision {
        let explicit = task.payload.model.as_deref();
        if let Some(m) = explicit.filter(|m| self.allow_task_overrides && known(m)) {
            return decision(m, m, "explicit_model".into());
        }
        if let Some(m) = self.by_task_type.get(&task.task_type) {
            return decision(m, m, format!("task_type:{}", task.task_type));
        }
        if self.tiers.is_empty() {
            return decision(&self.default_model, &self.default_model, "default".into());
        }
        let (score, given) = self.score(task);
        let mut i = self
            .tiers
            .iter()
            .position(|t| score <= t.max_score)
            .unwrap_or(self.tiers.len() - 1);
        let source = if given { "complexity" } else { "features" };
        let mut reason = format!("{source}:{score:.2}");
        if downgrade && i > 0 {
            i -= 1;
            reason = format!("budget_downgrade:{reason}");
        }
        let tier = &self.tiers[i];
        decision(&tier.model, &tier.name, reason)
    }

    /// While `model`'s breaker is open: the first model down its fallback
    /// chain whose breaker is closed, if any.
    pub fn fallback(&self, model: &str, open: impl Fn(&str) -> bool) -> Option<&str> {
        fallback(&self.fallbacks, model, open)
    }
}

/// While `model`'s breaker is open: the first model down its chain in
/// `fallbacks` (model → fallback) whose breaker is closed, if any.
pub fn fallback<'a>(
    fallbacks: &'a BTreeMap<String, String>,
    model: &str,
    open: impl Fn(&str) -> bool,
) -> Option<&'a str> {
    let mut seen: Vec<&str> = vec![model];
    let mut at: &str = model;
    while let Some(next) = fallbacks.get(at).map(String::as_str) {
        if seen.contains(&next) {
            return None;
        }
        if !open(next) {
            return Some(next);
        }
        seen.push(next);
        at = next;
    }
    None
}

/// Whether a task may be routed down a tier (its tenant nears its budget).
pub type DowngradeHook = Arc<dyn Fn(&TaskEnvelope) -> bool + Send + Sync>;

/// The `route` operator's settings: the rules, the models that exist, and
/// its metric (`sluice_route_decisions_total{tier}`).
#[derive(Clone)]
pub struct RouteStep {
    router: Arc<Router>,
    models: Arc<BTreeSet<String>>,
    decisions: IntCounterVec,
    downgrade: Option<DowngradeHook>,
}

impl RouteStep {
    /// A step routing by `router` to `models` (an explicit `payload.model`
    /// outside them is ignored).
    pub fn new(
        router: Router,
        models: impl IntoIterator<Item = String>,
        registry: &Registry,
    ) -> prometheus::Result<Self> {
        let decisions = IntCounterVec::new(
            Opts::new(ROUTE_DECISIONS, "Routing decisions by tier"),
            &["tier"],
        )?;
        registry.register(Box::new(decisions.clone()))?;
        Ok(RouteStep {
            router: Arc::new(router),
            models: Arc::new(models.into_iter().collect()),
            decisions,
            downgrade: None,
        })
    }

    /// Routes a task one tier down when `hook` says its tenant nears its
    /// budget.
    pub fn with_downgrade(mut self, hook: DowngradeHook) -> Self {
        self.downgrade = Some(hook);
        self
    }

    /// The model for a task, and why.
    pub fn route(&self, task: Task) -> Routed {
        let down = self.downgrade.as_ref().is_some_and(|h| h(&task.envelope));
        let d = self
            .router
            .route(&task.envelope, |m| self.models.contains(m), down);
        self.decisions.with_label_values(&[&d.route.tier]).inc();
        Routed {
            task,
            model: d.model,
            route: d.route,
        }
    }
}

/// Routing decisions, by tier.
pub const ROUTE_DECISIONS: &str = "sluice_route_decisions_total";

fn decision(model: &str, tier: &str, reason: String) -> Decision {
    Decision {
        model: model.to_string(),
        route: Route {
            tier: tier.to_string(),
            reason,
        },
    }
}

/// How much structure the answer must have: a schema's fields and nesting,
/// or the number of labels to choose from; in `[0, 1]`.
fn structure(task: &TaskEnvelope) -> f64 {
    if let Some(schema) = &task.payload.schema {
        let (fields, depth) = schema_shape(schema, 0);
        return (fields as f64 / 20.0 + depth.saturating_sub(1) as f64 * 0.25).min(1.0);
    }
    if let Some(labels) = &task.payload.labels {
        return (labels.len() as f64 / 50.0).min(1.0);
    }
    0.0
}

/// Properties counted over every level of a JSON schema, and its depth.
fn schema_shape(v: &serde_json::Value, level: usize) -> (usize, usize) {
    let Some(props) = v.get("properties").and_then(|p| p.as_object()) else {
        return match v.get("items") {
            Some(items) => schema_shape(items, level),
            None => (0, level),
        };
    };
    let mut fields = props.len();
    let mut depth = level + 1;
    for p in props.values() {
        let (f, d) = schema_shape(p, level + 1);
        fields += f;
        depth = depth.max(d);
    }
    (fields, depth)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::envelope::TaskPayload;

    fn task(task_type: &str, content: &str) -> TaskEnvelope {
        crate::envelope::test_task(
            task_type,
            TaskPayload {
                content: content.into(),
                ..Default::default()
            },
        )
    }

    fn tiered() -> Router {
        Router {
            default_model: "small".into(),
            allow_task_overrides: true,
            tiers: vec![
                Tier {
                    name: "cheap".into(),
                    max_score: 0.5,
                    model: "small".into(),
                },
                Tier {
                    name: "strong".into(),
                    max_score: 1.0,
                    model: "large".into(),
                },
            ],
            fallbacks: BTreeMap::from([
                ("large".into(), "medium".into()),
                ("medium".into(), "small".into()),
            ]),
            ..Default::default()
        }
    }

    #[test]
    fn given_complexity_picks_the_tier() {
        let r = tiered();
        let mut t = task("summarize", "text");
        t.payload.complexity = Some(0.2);
        let d = r.route(&t, |_| true, false);
        assert_eq!(
            (d.model.as_str(), d.route.tier.as_str()),
            ("small", "cheap")
        );
        assert_eq!(d.route.reason, "complexity:0.20");
        t.payload.complexity = Some(0.9);
        let d = r.route(&t, |_| true, false);
        assert_eq!(
            (d.model.as_str(), d.route.tier.as_str()),
            ("large", "strong")
        );
        assert_eq!(d.route.reason, "complexity:0.90");
        // A tenant near its budget goes one tier down.
        let d = r.route(&t, |_| true, true);
        assert_eq!(d.model, "small");
        assert_eq!(d.route.reason, "budget_downgrade:complexity:0.90");
    }

    /// Without `allow_task_overrides` a task's own model and complexity are
    /// ignored: the producer cannot pick the strong model.
    #[test]
    fn a_tasks_own_model_and_complexity_need_allow_task_overrides() {
        let mut r = tiered();
        r.allow_task_overrides = false;
        let mut t = task("summarize", "text");
        t.payload.complexity = Some(0.99);
        t.payload.model = Some("large".into());
        let d = r.route(&t, |_| true, false);
        assert_eq!(d.model, "small");
        assert!(d.route.reason.starts_with("features:"), "{:?}", d.route);
        r.allow_task_overrides = true;
        assert_eq!(r.route(&t, |_| true, false).model, "large");
    }

    #[test]
    fn explicit_model_and_task_type_come_before_the_score() {
        let mut r = tiered();
        r.by_task_type.insert("classify".into(), "medium".into());
        let mut t = task("classify", "text");
        t.payload.complexity = Some(0.9);
        let d = r.route(&t, |_| true, false);
        assert_eq!(d.model, "medium");
        assert_eq!(d.route.reason, "task_type:classify");
        t.payload.model = Some("large".into());
        assert_eq!(
            r.route(&t, |m| m == "large", false).route.reason,
            "explicit_model"
        );
        // An unknown explicit model is ignored.
        assert_eq!(r.route(&t, |_| false, false).model, "medium");
    }

    #[test]
    fn computed_scores_grow_with_size_structure_and_type() {
        let r = tiered();
        let short = r.feature_score(&task("classify", "Is this spam?"));
        let long = r.feature_score(&task("classify", &"word ".repeat(4_000)));
        assert!(short < long, "{short} < {long}");
        let summary = r.feature_score(&task("summarize", "Is this spam?"));
        assert!(short < summary);
        let mut flat = task("extract", "invoice text");
        flat.payload.schema =
            Some(json!({"type": "object", "properties": {"total": {"type": "number"}}}));
        let mut nested = flat.clone();
        nested.payload.schema = Some(json!({"type": "object", "properties": {
            "lines": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {}, "qty": {}, "price": {}, "tax": {"type": "object", "properties": {"rate": {}, "amount": {}}}
            }}},
            "total": {}, "currency": {}, "vendor": {}
        }}));
        assert!(r.feature_score(&flat) < r.feature_score(&nested));
        for s in [short, long, summary] {
            assert!((0.0..=1.0).contains(&s));
        }
        // A short classification goes to the cheap tier, a long nested
        // extraction to the strong one.
        assert_eq!(
            r.route(&task("classify", "Is this spam?"), |_| true, false)
                .model,
            "small"
        );
        let mut big = nested.clone();
        big.payload.content = "line item ".repeat(3_000);
        let d = r.route(&big, |_| true, false);
        assert_eq!(d.model, "large", "{:?}", d.route);
        assert!(d.route.reason.starts_with("features:"));
    }

    #[test]
    fn without_tiers_the_default_model_answers() {
        let r = Router {
            default_model: "small".into(),
            ..Default::default()
        };
        let d = r.route(&task("summarize", "text"), |_| true, false);
        assert_eq!(d.model, "small");
        assert_eq!(d.route.reason, "default");
    }

    #[test]
    fn the_fallback_chain_skips_open_breakers_and_stops_at_a_cycle() {
        let mut r = tiered();
        assert_eq!(r.fallback("large", |_| false), Some("medium"));
        assert_eq!(r.fallback("large", |m| m == "medium"), Some("small"));
        assert_eq!(r.fallback("large", |_| true), None);
        assert_eq!(r.fallback("small", |_| false), None);
        r.fallbacks.insert("small".into(), "large".into());
        assert_eq!(r.fallback("large", |_| true), None);
    }
}
