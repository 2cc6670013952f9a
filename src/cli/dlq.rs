//! `sluice dlq inspect` and `sluice dlq replay`: what the dead-letter topics
//! hold, and re-publishing dead letters to their task topics once their
//! cause is fixed.
//!
//! Both read the dead-letter topics (`<tasks_prefix><type>.dlq`) of the
//! configured task types, or of the `--type`s given, from the beginning (or
//! from `--since`, looked up by time) up to their end when the command
//! starts, `read_committed`, without a consumer group and without
//! committing anything. Filters select by category, reason and the time a
//! record was dead-lettered (`dlq.sent.at`, else the record's timestamp).
//!
//! Nothing of a task's payload is ever printed: only its envelope's
//! `taskId`, `tenantId` and `attemptNumber` and the dead-letter headers.
//!
//! A replayed task goes to its type's task topic (`<tasks_prefix><type>`,
//! never a repartition topic) with its original key and headers but the
//! `dlq.*` ones, its `attemptNumber` set to 1 (a fresh attempt count; a value
//! that is not a JSON object goes unchanged), and [`HEADER_REPLAY_OF`]
//! naming the dead letter. The LLM operator answers a replayed task whose id
//! already succeeded with nothing, so replaying twice adds no second result.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use chrono::{DateTime, SecondsFormat, Utc};
use rdkafka::message::BorrowedMessage;
use rdkafka::Message;
use serde::Serialize;
use sluice_topology::{dlq_headers, Headers};

use crate::config::{Config, ConfigError};
use crate::envelope::DlqCategory;
pub use crate::envelope::{HEADER_BILLED, HEADER_REPLAY_OF};
use crate::kafka::{Flow, KafkaError, OutRecord, Publisher, Start};

/// `sluice dlq`.
#[derive(clap::Args, Debug)]
pub struct DlqArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: DlqCommand,
}

/// `sluice dlq inspect|replay`.
#[derive(clap::Subcommand, Debug)]
pub enum DlqCommand {
    /// Counts dead letters by topic, category and reason, and prints samples
    /// (envelope fields only, never payloads).
    Inspect(InspectArgs),
    /// Re-publishes dead letters to their task topics with a fresh attempt
    /// count, rate-limited.
    Replay(ReplayArgs),
}

/// Which dead letters a command reads and selects.
#[derive(clap::Args, Debug, Clone)]
pub struct FilterArgs {
    /// The TOML configuration file (SLUICE_<SECTION>__<KEY> variables override it).
    #[arg(long, short)]
    pub config: PathBuf,
    /// Only this task type's dead-letter topic (repeatable; default: every
    /// configured task type).
    #[arg(long = "type", value_name = "TYPE")]
    pub types: Vec<String>,
    /// Only this category (repeatable): poison, bad_request, content_policy,
    /// too_large, exhausted or panic.
    #[arg(long, value_name = "CATEGORY", value_parser = parse_category)]
    pub category: Vec<DlqCategory>,
    /// Only dead letters whose reason contains this text.
    #[arg(long, value_name = "TEXT")]
    pub reason: Option<String>,
    /// Only dead letters sent at or after this time: RFC 3339
    /// (2026-05-01T12:00:00Z) or a duration ago (90s, 30m, 2h, 7d, 1h30m).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub since: Option<DateTime<Utc>>,
    /// Only dead letters sent before this time (same forms as --since).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub until: Option<DateTime<Utc>>,
}

/// `sluice dlq inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Which dead letters.
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Dead letters to print as samples (the first ones read).
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub samples: usize,
    /// Reasons to list, most frequent first.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub top: usize,
    /// Prints the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `sluice dlq replay`.
#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// Which dead letters.
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Records re-published per second, at most.
    #[arg(long, value_name = "R", default_value_t = 50.0, value_parser = parse_rate)]
    pub rate: f64,
    /// Re-publishes at most this many (the first ones read).
    #[arg(long, value_name = "N")]
    pub limit: Option<u64>,
    /// Prints what would be re-published and publishes nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Prints the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Why a `sluice dlq` command failed.
#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    /// The configuration is invalid (exit code 2).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A flag does not fit the configuration or another flag (exit code 2).
    #[error("{0}")]
    Usage(String),
    /// Kafka could not be reached or refused a request.
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// Some re-published records were not delivered.
    #[error("{failed} of {sent} re-published records were not delivered (the first: {first}); re-running the same replay re-publishes them (tasks already answered emit nothing)")]
    Undelivered {
        /// Records sent.
        sent: u64,
        /// Records that failed.
        failed: u64,
        /// The first failure.
        first: String,
    },
    /// The output could not be written (e.g. its reader went away).
    #[error("cannot write the output")]
    Output(#[from] std::io::Error),
    /// The blocking reader's thread failed.
    #[error("dead-letter reader")]
    Join(#[from] tokio::task::JoinError),
}

/// Runs `sluice dlq inspect|replay`.
pub async fn run(args: DlqArgs) -> Result<(), DlqError> {
    tokio::task::spawn_blocking(move || match args.command {
        DlqCommand::Inspect(a) => inspect(a),
        DlqCommand::Replay(a) => replay(a),
    })
    .await?
}

/// Writes text to standard output; an error (a closed pipe) is returned,
/// never a panic.
fn out(text: &str) -> Result<(), DlqError> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

/// A category flag's value.
fn parse_category(s: &str) -> Result<DlqCategory, String> {
    DlqCategory::parse(s).ok_or_else(|| {
        let all: Vec<&str> = DlqCategory::ALL.iter().map(|c| c.as_str()).collect();
        format!("unknown category (one of {})", all.join(", "))
    })
}

/// A time flag's value: RFC 3339, or a duration before now.
fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    parse_time_at(s, Utc::now())
}

fn parse_time_at(s: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    parse_ago(s)
        .and_then(|ago| now.checked_sub_signed(ago))
        .ok_or_else(|| {
            "expected an RFC 3339 time (2026-05-01T12:00:00Z) or a duration ago \
             (90s, 30m, 2h, 7d, 1h30m)"
                .to_string()
        })
}

/// `90s`, `30m`, `2h`, `7d`, `1w`, or several of them (`1h30m`).
fn parse_ago(s: &str) -> Option<chrono::TimeDelta> {
    let mut total = chrono::TimeDelta::zero();
    let mut rest = s.trim();
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        if digits == 0 {
            return None;
        }
        let n: i64 = rest[..digits].parse().ok()?;
        let unit = rest[digits..].chars().next()?;
        let secs = match unit {
            's' => 1,
            'm' => 60,
            'h' => 3_600,
            'd' => 86_400,
            'w' => 604_800,
            _ => return None,
        };
        total = total.checked_add(&chrono::TimeDelta::try_seconds(n.checked_mul(secs)?)?)?;
        rest = &rest[digits + unit.len_utf8()..];
    }
    Some(total)
}

/// A rate flag's value: records per second, above zero.
fn parse_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err("expected records per second, above 0 (e.g. 50 or 0.5)".into()),
    }
}

/// A task type's topics.
#[derive(Clone, Debug)]
struct Target {
    dlq_topic: String,
    task_topic: String,
}

/// What selects dead letters, once the flags were checked.
#[derive(Clone, Debug)]
pub struct Filter {
    /// Categories (any, when empty).
    pub categories: Vec<DlqCategory>,
    /// A text the reason contains.
    pub reason: Option<String>,
    /// Sent at or after this time, ms.
    pub since_ms: Option<i64>,
    /// Sent before this time, ms.
    pub until_ms: Option<i64>,
}

impl Filter {
    fn from_args(a: &FilterArgs) -> Result<Filter, DlqError> {
        if let (Some(since), Some(until)) = (a.since, a.until) {
            if since >= until {
                return Err(DlqError::Usage(format!(
                    "--since {} is not before --until {}",
                    rfc3339(since.timestamp_millis()),
                    rfc3339(until.timestamp_millis())
                )));
            }
        }
        Ok(Filter {
            categories: a.category.clone(),
            reason: a.reason.clone(),
            since_ms: a.since.map(|t| t.timestamp_millis()),
            until_ms: a.until.map(|t| t.timestamp_millis()),
        })
    }

    /// Whether a dead letter is selected.
    pub fn matches(&self, d: &DeadLetter) -> bool {
        if !self.categories.is_empty()
            && !self
                .categories
                .iter()
                .any(|c| d.category() == Some(c.as_str()))
        {
            return false;
        }
        if let Some(text) = &self.reason {
            if !d.reason().is_some_and(|r| r.contains(text.as_str())) {
                return false;
            }
        }
        let sent = d.sent_at_ms();
        if let Some(since) = self.since_ms {
            if sent.is_none_or(|t| t < since) {
                return false;
            }
        }
        if let Some(until) = self.until_ms {
            if sent.is_none_or(|t| t >= until) {
                return false;
            }
        }
        true
    }
}

/// A record read from a dead-letter topic.
#[derive(Clone, Debug)]
pub struct DeadLetter {
    /// The dead-letter topic.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// The original key.
    pub key: Option<Vec<u8>>,
    /// The original value.
    pub value: Option<Vec<u8>>,
    /// The original headers and the `dlq.*` ones.
    pub headers: Headers,
    /// The record's timestamp, ms.
    pub timestamp: Option<i64>,
}

impl DeadLetter {
    fn from_message(m: &BorrowedMessage<'_>) -> DeadLetter {
        DeadLetter {
            topic: m.topic().to_string(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            value: m.payload().map(<[u8]>::to_vec),
            headers: sluice_topology::message_headers(m),
            timestamp: m.timestamp().to_millis(),
        }
    }

    /// A header as text (the last one of that name).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    /// `dlq.category`.
    pub fn category(&self) -> Option<&str> {
        self.header(dlq_headers::CATEGORY)
    }

    /// `dlq.reason`.
    pub fn reason(&self) -> Option<&str> {
        self.header(dlq_headers::REASON)
    }

    /// When it was dead-lettered: `dlq.sent.at`, else the record's timestamp.
    pub fn sent_at_ms(&self) -> Option<i64> {
        self.header(dlq_headers::SENT_AT)
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.timestamp_millis())
            .or(self.timestamp)
    }

    /// `<topic>/<partition>/<offset>`.
    pub fn coordinates(&self) -> String {
        format!("{}/{}/{}", self.topic, self.partition, self.offset)
    }

    /// The envelope fields a report may show (never the payload).
    pub fn envelope(&self) -> EnvelopeFields {
        let v: Option<serde_json::Value> = self
            .value
            .as_deref()
            .and_then(|b| serde_json::from_slice(b).ok());
        let text = |name: &str| {
            v.as_ref()
                .and_then(|v| v.get(name))
                .and_then(serde_json::Value::as_str)
                .map(shown)
        };
        EnvelopeFields {
            task_id: text("taskId"),
            tenant_id: text("tenantId").or_else(|| text("requesterId")),
            attempt_number: v
                .as_ref()
                .and_then(|v| v.get("attemptNumber"))
                .and_then(serde_json::Value::as_u64),
        }
    }

    /// The task to re-publish: the original key, value with `attemptNumber`
    /// 1, and headers without the `dlq.*` ones, an earlier replay's mark and
    /// what earlier attempts were billed (the failed result billed it);
    /// marked as a replay of this dead letter.
    pub fn replay_record(&self, partition: Option<i32>) -> OutRecord {
        let mut headers: Headers = self
            .headers
            .iter()
            .filter(|(k, _)| !k.starts_with("dlq.") && k != HEADER_REPLAY_OF && k != HEADER_BILLED)
            .cloned()
            .collect();
        headers.push((HEADER_REPLAY_OF.into(), self.coordinates().into_bytes()));
        OutRecord {
            key: self.key.clone(),
            value: self.value.as_deref().map(fresh_attempt),
            timestamp: None,
            headers,
            partition,
        }
    }

    /// Where in `task_topic` (of `partitions` partitions) the replay goes:
    /// the partition the task was read from when that was this topic, else
    /// the key's partition by the task producers' partitioner, else any.
    fn replay_partition(
        &self,
        task_topic: &str,
        partitions: i32,
        partitioner: sluice_topology::runtime::KeyPartitioner,
    ) -> Option<i32> {
        let original = self
            .header(dlq_headers::ORIGINAL_PARTITION)
            .and_then(|p| p.parse::<i32>().ok());
        match (self.header(dlq_headers::ORIGINAL_TOPIC), original) {
            (Some(t), Some(p)) if t == task_topic && (0..partitions).contains(&p) => Some(p),
            _ => self
                .key
                .as_deref()
                .map(|k| partitioner.partition(k, partitions)),
        }
    }
}

/// A task value with `attemptNumber` set to 1 and no `notBefore` (a first
/// attempt has no backoff); anything but a JSON object is returned unchanged.
pub fn fresh_attempt(value: &[u8]) -> Vec<u8> {
    match serde_json::from_slice::<serde_json::Value>(value) {
        Ok(serde_json::Value::Object(mut task)) => {
            task.insert("attemptNumber".into(), 1.into());
            task.remove("notBefore");
            serde_json::to_vec(&task).unwrap_or_else(|_| value.to_vec())
        }
        _ => value.to_vec(),
    }
}

/// Envelope fields of a dead letter, as reports show them.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EnvelopeFields {
    /// `taskId`.
    pub task_id: Option<String>,
    /// `tenantId` (else `requesterId`).
    pub tenant_id: Option<String>,
    /// `attemptNumber`.
    pub attempt_number: Option<u64>,
}

/// Text from a record as a report shows it: control characters escaped,
/// at most 64 characters.
fn shown(s: &str) -> String {
    const MAX: usize = 64;
    let mut out: String = s.chars().take(MAX).flat_map(char::escape_default).collect();
    if s.chars().count() > MAX {
        out.push('…');
    }
    out
}

fn key_text(key: Option<&[u8]>) -> Option<String> {
    key.map(|k| shown(&String::from_utf8_lossy(k)))
}

fn rfc3339(ms: i64) -> String {
    DateTime::from_timestamp_millis(ms)
        .map(|t| t.to_rfc3339_opts(SecondsFormat::Millis, true))
        .unwrap_or_else(|| ms.to_string())
}

/// The config and the topics a command reads, its flags checked.
fn prepare(a: &FilterArgs) -> Result<(Config, Vec<Target>, Filter), DlqError> {
    let config = Config::load(&a.config)?;
    let filter = Filter::from_args(a)?;
    let topics = &config.topics;
    let mut types: Vec<&String> = Vec::new();
    for t in &a.types {
        if !topics.task_types.contains(t) {
            return Err(DlqError::Usage(format!(
                "--type {t}: not a task type of the configuration ({})",
                topics.task_types.join(", ")
            )));
        }
        if !types.contains(&t) {
            types.push(t);
        }
    }
    if types.is_empty() {
        types = topics.task_types.iter().collect();
    }
    let targets = types
        .into_iter()
        .map(|t| Target {
            dlq_topic: topics.dlq_topic(t),
            task_topic: topics.task_topic(t),
        })
        .collect();
    Ok((config, targets, filter))
}

/// Reads the targets' dead-letter topics, up to what they held when the read
/// started, handing every dead letter to `f` with its target.
fn scan(
    config: &Config,
    targets: &[Target],
    filter: &Filter,
    mut f: impl FnMut(DeadLetter, &Target) -> Flow,
) -> Result<u64, DlqError> {
    let by_topic: HashMap<&str, &Target> =
        targets.iter().map(|t| (t.dlq_topic.as_str(), t)).collect();
    let topics: Vec<String> = targets.iter().map(|t| t.dlq_topic.clone()).collect();
    // Dead letters are stamped with the time they were sent, so a look-up
    // by time finds where `--since` starts.
    let start = filter.since_ms.map_or(Start::Beginning, Start::Time);
    let read = crate::kafka::read_existing(config.kafka.cluster(), &topics, start, true, |m| {
        let d = DeadLetter::from_message(m);
        match by_topic.get(d.topic.as_str()) {
            Some(target) => f(d, target),
            None => Flow::Next,
        }
    })?;
    Ok(read)
}

/// What `sluice dlq inspect` found.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InspectReport {
    /// Dead letters read.
    pub read: u64,
    /// Dead letters the filters selected.
    pub matched: u64,
    /// Selected, by dead-letter topic.
    pub by_topic: BTreeMap<String, u64>,
    /// Selected, by category.
    pub by_category: BTreeMap<String, u64>,
    /// Selected, by reason, most frequent first (the top N).
    pub by_reason: Vec<ReasonCount>,
    /// Reasons beyond the top N.
    pub other_reasons: u64,
    /// The earliest `dlq.sent.at` selected (RFC 3339).
    pub first_sent_at: Option<String>,
    /// The latest.
    pub last_sent_at: Option<String>,
    /// The first dead letters selected.
    pub samples: Vec<Sample>,
}

/// A reason and how many dead letters gave it.
#[derive(Clone, Debug, Serialize)]
pub struct ReasonCount {
    /// `dlq.reason`.
    pub reason: String,
    /// Dead letters.
    pub count: u64,
}

/// One dead letter in a report: where it is, its envelope fields and why.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Sample {
    /// Dead-letter topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Kafka key (as text).
    pub key: Option<String>,
    /// Envelope fields.
    #[serde(flatten)]
    pub envelope: EnvelopeFields,
    /// `dlq.category`.
    pub category: Option<String>,
    /// `dlq.reason`.
    pub reason: Option<String>,
    /// `dlq.attempts`.
    pub attempts: Option<String>,
    /// When it was dead-lettered (RFC 3339).
    pub sent_at: Option<String>,
}

impl Sample {
    fn of(d: &DeadLetter) -> Sample {
        let header = |name| d.header(name).map(shown);
        Sample {
            topic: d.topic.clone(),
            partition: d.partition,
            offset: d.offset,
            key: key_text(d.key.as_deref()),
            envelope: d.envelope(),
            category: header(dlq_headers::CATEGORY),
            reason: header(dlq_headers::REASON),
            attempts: header(dlq_headers::ATTEMPTS),
            sent_at: d.sent_at_ms().map(rfc3339),
        }
    }

    fn line(&self) -> String {
        let or_dash = |s: &Option<String>| s.clone().unwrap_or_else(|| "-".into());
        format!(
            "{}/{}/{}  key={}  taskId={}  tenantId={}  attemptNumber={}  category={}  reason={}  sentAt={}",
            self.topic,
            self.partition,
            self.offset,
            or_dash(&self.key),
            or_dash(&self.envelope.task_id),
            or_dash(&self.envelope.tenant_id),
            self.envelope
                .attempt_number
                .map_or("-".into(), |n| n.to_string()),
            or_dash(&self.category),
            or_dash(&self.reason),
            or_dash(&self.sent_at),
        )
    }
}

/// Counts dead letters as `inspect` reports them.
#[derive(Default)]
struct Tally {
    report: InspectReport,
    reasons: HashMap<String, u64>,
    first: Option<i64>,
    last: Option<i64>,
}

impl Tally {
    fn add(&mut self, d: &DeadLetter, samples: usize) {
        let r = &mut self.report;
        r.matched += 1;
        *r.by_topic.entry(d.topic.clone()).or_default() += 1;
        *r.by_category
            .entry(d.category().map_or_else(|| "-".into(), shown))
            .or_default() += 1;
        *self
            .reasons
            .entry(d.reason().map_or_else(|| "-".into(), shown))
            .or_default() += 1;
        if let Some(t) = d.sent_at_ms() {
            self.first = Some(self.first.map_or(t, |f| f.min(t)));
            self.last = Some(self.last.map_or(t, |l| l.max(t)));
        }
        if r.samples.len() < samples {
            r.samples.push(Sample::of(d));
        }
    }

    fn finish(mut self, read: u64, top: usize) -> InspectReport {
        let mut reasons: Vec<ReasonCount> = self
            .reasons
            .into_iter()
            .map(|(reason, count)| ReasonCount { reason, count })
            .collect();
        reasons.sort_by(|a, b| b.count.cmp(&a.count).then(a.reason.cmp(&b.reason)));
        let rest = reasons.split_off(top.min(reasons.len()));
        self.report.other_reasons = rest.iter().map(|r| r.count).sum();
        self.report.by_reason = reasons;
        self.report.read = read;
        self.report.first_sent_at = self.first.map(rfc3339);
        self.report.last_sent_at = self.last.map(rfc3339);
        self.report
    }
}

/// `sluice dlq inspect`.
fn inspect(a: InspectArgs) -> Result<(), DlqError> {
    let (config, targets, filter) = prepare(&a.filter)?;
    let mut tally = Tally::default();
    let read = scan(&config, &targets, &filter, |d, _| {
        if filter.matches(&d) {
            tally.add(&d, a.samples);
        }
        Flow::Next
    })?;
    let report = tally.finish(read, a.top);
    match a.json {
        true => out(&format!(
            "{}\n",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        )),
        false => out(&inspect_text(&report, &targets)),
    }
}

/// An inspect report as text.
fn inspect_text(r: &InspectReport, targets: &[Target]) -> String {
    let mut out = format!("dead letters: {} matched of {} read\n", r.matched, r.read);
    out.push_str("by topic:\n");
    for t in targets {
        let n = r.by_topic.get(&t.dlq_topic).copied().unwrap_or(0);
        out.push_str(&format!("  {:<48} {n:>9}\n", t.dlq_topic));
    }
    out.push_str("by category:\n");
    for (c, n) in &r.by_category {
        out.push_str(&format!("  {c:<48} {n:>9}\n"));
    }
    out.push_str("by reason:\n");
    for rc in &r.by_reason {
        out.push_str(&format!("  {:<48} {:>9}\n", rc.reason, rc.count));
    }
    if r.other_reasons > 0 {
        out.push_str(&format!("  {:<48} {:>9}\n", "(other)", r.other_reasons));
    }
    let or_dash = |s: &Option<String>| s.clone().unwrap_or_else(|| "-".into());
    out.push_str(&format!(
        "first sent at: {}\nlast sent at:  {}\n",
        or_dash(&r.first_sent_at),
        or_dash(&r.last_sent_at)
    ));
    if !r.samples.is_empty() {
        out.push_str("samples:\n");
        for s in &r.samples {
            out.push_str(&format!("  {}\n", s.line()));
        }
    }
    out
}

/// What `sluice dlq replay` did.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplaySummary {
    /// Whether it only printed what it would do.
    pub dry_run: bool,
    /// Dead letters read.
    pub read: u64,
    /// Dead letters the filters selected (up to `--limit`).
    pub matched: u64,
    /// Re-published and acknowledged by the broker.
    pub replayed: u64,
    /// Re-published but not delivered.
    pub failed: u64,
    /// Selected, by task topic.
    pub by_task_topic: BTreeMap<String, u64>,
}

/// `sluice dlq replay`.
fn replay(a: ReplayArgs) -> Result<(), DlqError> {
    let (config, targets, filter) = prepare(&a.filter)?;
    let cluster = config.kafka.cluster();
    let task_topics: Vec<String> = targets.iter().map(|t| t.task_topic.clone()).collect();
    let partitions = crate::kafka::partition_counts(&cluster, &task_topics)?;
    if let Some(missing) = task_topics.iter().find(|t| !partitions.contains_key(*t)) {
        return Err(DlqError::Usage(format!(
            "task topic {missing} does not exist (sluice topics create makes it)"
        )));
    }
    let publisher = match a.dry_run {
        true => None,
        false => Some(Publisher::new(&cluster)?),
    };
    let mut summary = ReplaySummary {
        dry_run: a.dry_run,
        ..Default::default()
    };
    // What stopped the replay early: a record the client refused, or the
    // output gone.
    let mut failure: Option<DlqError> = None;
    let pace = Duration::from_secs_f64(1.0 / a.rate);
    let began = Instant::now();
    let read = scan(&config, &targets, &filter, |d, target| {
        if a.limit.is_some_and(|n| summary.matched >= n) {
            return Flow::Stop;
        }
        if !filter.matches(&d) {
            return Flow::Next;
        }
        let partition = d.replay_partition(
            &target.task_topic,
            partitions[&target.task_topic],
            config.tasks.partitioner,
        );
        summary.matched += 1;
        *summary
            .by_task_topic
            .entry(target.task_topic.clone())
            .or_default() += 1;
        let Some(publisher) = &publisher else {
            if a.json {
                return Flow::Next;
            }
            let line = format!(
                "would replay {} to {}{}\n",
                Sample::of(&d).line(),
                target.task_topic,
                partition.map_or(String::new(), |p| format!("/{p}"))
            );
            return match out(&line) {
                Ok(()) => Flow::Next,
                Err(e) => {
                    failure = Some(e);
                    Flow::Stop
                }
            };
        };
        // At most `rate` per second, evenly.
        let due = began + pace.mul_f64((summary.matched - 1) as f64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        match publisher.send(&target.task_topic, &d.replay_record(partition)) {
            Ok(()) => Flow::Next,
            Err(e) => {
                failure = Some(e.into());
                Flow::Stop
            }
        }
    })?;
    summary.read = read;
    let Some(publisher) = publisher else {
        if let Some(e) = failure {
            return Err(e);
        }
        return out(&replay_text(&summary, a.json));
    };
    // Whatever stopped the replay, what was sent is flushed and reported.
    let delivered = publisher.finish(Duration::from_secs(120))?;
    summary.replayed = delivered.acked;
    summary.failed = delivered.failed + u64::from(matches!(failure, Some(DlqError::Kafka(_))));
    let printed = out(&replay_text(&summary, a.json));
    if let Some(e) = failure {
        return Err(e);
    }
    if delivered.failed > 0 {
        return Err(DlqError::Undelivered {
            sent: delivered.acked + delivered.failed,
            failed: delivered.failed,
            first: delivered.first_error.unwrap_or_default(),
        });
    }
    printed
}

/// A replay's summary as text (or JSON).
fn replay_text(s: &ReplaySummary, json: bool) -> String {
    if json {
        return format!("{}\n", serde_json::to_string_pretty(s).unwrap_or_default());
    }
    let mut text = match s.dry_run {
        true => format!(
            "dry run: would replay {} dead letters (of {} read); nothing published\n",
            s.matched, s.read
        ),
        false => format!(
            "replayed {} of {} matching dead letters (of {} read); {} failed\n",
            s.replayed, s.matched, s.read, s.failed
        ),
    };
    for (topic, n) in &s.by_task_topic {
        text.push_str(&format!("  {topic:<48} {n:>9}\n"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(value: &[u8], headers: &[(&str, &str)]) -> DeadLetter {
        DeadLetter {
            topic: "ai.tasks.summarize.dlq".into(),
            partition: 1,
            offset: 7,
            key: Some(b"acme".to_vec()),
            value: Some(value.to_vec()),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
                .collect(),
            timestamp: Some(1_000),
        }
    }

    #[test]
    fn times_are_rfc3339_or_a_duration_ago() {
        let now = DateTime::parse_from_rfc3339("2026-05-01T12:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let at = |s| parse_time_at(s, now).map(|t| t.to_rfc3339());
        assert_eq!(at("2h").unwrap(), "2026-05-01T10:00:00+00:00");
        assert_eq!(at("30m").unwrap(), "2026-05-01T11:30:00+00:00");
        assert_eq!(at("7d").unwrap(), "2026-04-24T12:00:00+00:00");
        assert_eq!(at("1h30m").unwrap(), "2026-05-01T10:30:00+00:00");
        assert_eq!(
            at("2026-04-30T08:00:00+02:00").unwrap(),
            "2026-04-30T06:00:00+00:00"
        );
        for bad in [
            "",
            "yesterday",
            "2",
            "h",
            "5x",
            "2h-",
            "-2h",
            "99999999999999999d",
        ] {
            assert!(at(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn categories_and_rates_are_checked() {
        assert_eq!(parse_category("exhausted"), Ok(DlqCategory::Exhausted));
        let e = parse_category("exausted").unwrap_err();
        assert!(e.contains("poison, bad_request"), "{e}");
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("-1").is_err());
        assert!(parse_rate("inf").is_err());
        assert_eq!(parse_rate("2.5"), Ok(2.5));
    }

    #[test]
    fn a_replay_has_a_fresh_attempt_count_and_no_dlq_headers() {
        let d = letter(
            br#"{"taskId":"t1","attemptNumber":5,"payload":{"content":"x"},"metadata":{"a":"b"}}"#,
            &[
                ("traceparent", "00-abc-01"),
                ("sluice.replay.of", "old/0/1"),
                ("sluice.billed", "10,2,0,7"),
                ("dlq.reason", "exhausted"),
                ("dlq.category", "exhausted"),
                ("dlq.original.topic", "ai.tasks.summarize"),
            ],
        );
        let r = d.replay_record(Some(1));
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"taskId":"t1","attemptNumber":1,"payload":{"content":"x"},"metadata":{"a":"b"}})
        );
        let names: Vec<(&str, &[u8])> = r
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        assert_eq!(
            names,
            [
                ("traceparent", &b"00-abc-01"[..]),
                ("sluice.replay.of", b"ai.tasks.summarize.dlq/1/7"),
            ]
        );
        assert_eq!(r.key.as_deref(), Some(&b"acme"[..]));
        assert_eq!(r.partition, Some(1));
        // Not a JSON object: unchanged.
        for raw in [&b"{oops"[..], b"[1,2]", b"\"text\""] {
            assert_eq!(fresh_attempt(raw), raw);
        }
        // No attemptNumber yet: one is set.
        assert_eq!(
            fresh_attempt(br#"{"taskId":"t"}"#),
            br#"{"attemptNumber":1,"taskId":"t"}"#
        );
    }

    #[test]
    fn a_replay_goes_to_the_original_partition_else_the_keys() {
        use sluice_topology::runtime::KeyPartitioner;
        let d = letter(
            b"{}",
            &[
                ("dlq.original.topic", "ai.tasks.summarize"),
                ("dlq.original.partition", "3"),
            ],
        );
        let p = |topic, n| d.replay_partition(topic, n, KeyPartitioner::Murmur2);
        assert_eq!(p("ai.tasks.summarize", 6), Some(3));
        let by_key = KeyPartitioner::Murmur2.partition(b"acme", 2);
        assert_eq!(p("ai.tasks.summarize", 2), Some(by_key));
        assert_eq!(
            p("other", 6),
            Some(KeyPartitioner::Murmur2.partition(b"acme", 6))
        );
    }

    #[test]
    fn filters_select_by_category_reason_and_sent_time() {
        let d = letter(
            b"{}",
            &[
                ("dlq.category", "exhausted"),
                ("dlq.reason", "exhausted"),
                ("dlq.sent.at", "2026-05-01T12:00:00.000Z"),
            ],
        );
        let at = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().timestamp_millis();
        let all = Filter {
            categories: vec![],
            reason: None,
            since_ms: None,
            until_ms: None,
        };
        assert!(all.matches(&d));
        let f = |change: fn(&mut Filter)| {
            let mut f = all.clone();
            change(&mut f);
            f.matches(&d)
        };
        assert!(f(
            |f| f.categories = vec![DlqCategory::Poison, DlqCategory::Exhausted]
        ));
        assert!(!f(|f| f.categories = vec![DlqCategory::Poison]));
        assert!(f(|f| f.reason = Some("haust".into())));
        assert!(!f(|f| f.reason = Some("policy".into())));
        let mut g = all.clone();
        g.since_ms = Some(at("2026-05-01T12:00:00Z"));
        assert!(g.matches(&d), "since is inclusive");
        g.until_ms = Some(at("2026-05-01T12:00:00Z") + 1);
        assert!(g.matches(&d));
        g.until_ms = Some(at("2026-05-01T12:00:00Z"));
        assert!(!g.matches(&d), "until is exclusive");
        // Without dlq.sent.at, the record's timestamp (1 s after the epoch).
        let old = letter(b"{}", &[]);
        let mut h = all.clone();
        h.since_ms = Some(1_000);
        assert!(h.matches(&old));
        h.since_ms = Some(1_001);
        assert!(!h.matches(&old));
    }

    #[test]
    fn samples_show_envelope_fields_and_never_the_payload() {
        let d = letter(
            br#"{"taskId":"t1","requesterId":"svc","attemptNumber":3,"payload":{"content":"SECRET PROMPT"}}"#,
            &[("dlq.category", "exhausted"), ("dlq.reason", "exhausted")],
        );
        let line = Sample::of(&d).line();
        assert!(line.contains("taskId=t1"), "{line}");
        assert!(line.contains("tenantId=svc"), "{line}");
        assert!(line.contains("attemptNumber=3"), "{line}");
        assert!(!line.contains("SECRET"), "{line}");
        let poison = letter(b"\xff\x00not json", &[("dlq.category", "poison")]);
        let line = Sample::of(&poison).line();
        assert!(
            line.contains("taskId=-") && !line.contains("not json"),
            "{line}"
        );
        assert_eq!(shown("a\nb"), "a\\nb");
        assert_eq!(shown(&"x".repeat(70)).chars().count(), 65);
    }
}
