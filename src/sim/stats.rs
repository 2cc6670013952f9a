//! Counters of what the simulator answered, the index of successful calls by user content
//! (so tests can prove how many calls a task caused), and the set of system prompts seen
//! (for `cached_tokens`). All bounded in memory.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::prompt::fnv1a64;

/// Distinct user contents whose call counts are kept (oldest forgotten first).
pub(crate) const MAX_COUNTED_CONTENTS: usize = 1_000_000;
/// Distinct user contents whose text is kept for `contains` look-ups.
pub(crate) const MAX_STORED_CONTENTS: usize = 200_000;
/// Total bytes of stored user contents.
pub(crate) const MAX_STORED_BYTES: usize = 256 * 1024 * 1024;
/// Distinct model names counted separately in [`SimStats::by_model`]; others are counted
/// under [`OTHER_MODELS`].
const MAX_MODEL_NAMES: usize = 1000;
/// Bucket for model names beyond [`MAX_MODEL_NAMES`].
pub const OTHER_MODELS: &str = "<other>";

/// A snapshot of the simulator's counters (`GET /admin/stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SimStats {
    /// Chat completion requests received (every request, whatever its answer).
    pub requests_total: u64,
    /// Chat completion requests answered 200 (including injected malformed bodies).
    pub served_ok: u64,
    /// Answers by HTTP status code.
    pub by_status: BTreeMap<u16, u64>,
    /// 200 answers by requested model.
    pub by_model: BTreeMap<String, u64>,
    /// Prompt tokens reported in `usage` of 200 answers.
    pub prompt_tokens: u64,
    /// Completion tokens reported in `usage` of 200 answers.
    pub completion_tokens: u64,
    /// Cached prompt tokens reported in `usage` of 200 answers.
    pub cached_tokens: u64,
    /// Micro-batch requests answered 200.
    pub batch_requests: u64,
    /// Items in micro-batch requests answered 200.
    pub batch_items: u64,
    /// Requests that waited for a slot (queueing mode, `slots`).
    pub queued: u64,
    /// Requests whose client went away (e.g. timed out) before they were answered.
    pub abandoned: u64,
    /// Chat completion requests received and not yet answered nor abandoned.
    pub in_flight: u64,
    /// The most requests in flight at once since the counters were last zeroed.
    pub peak_in_flight: u64,
    /// Chat completion requests that came over HTTP/2.
    pub http2_requests: u64,
    /// Faults the simulator injected or limits it enforced.
    pub injected: InjectedCounts,
    /// Distinct user contents currently counted by the call index.
    pub distinct_user_contents: u64,
}

impl SimStats {
    /// Number of answers with this status.
    pub fn status(&self, code: u16) -> u64 {
        self.by_status.get(&code).copied().unwrap_or(0)
    }
}

/// Counts of each kind of injected fault or enforced limit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct InjectedCounts {
    /// Answers forced by `status_override`.
    pub status_override: u64,
    /// 429s from the rps/rpm/tpm buckets.
    pub rate_limited: u64,
    /// 429s from a `burst_429` storm.
    pub burst_429: u64,
    /// 5xx answers from `error_rate`.
    pub server_errors: u64,
    /// Requests held by `hang_rate`.
    pub hangs: u64,
    /// 200 answers with a malformed body from `malformed_rate`.
    pub malformed: u64,
    /// 200 answers cut mid-body by `reset_rate`.
    pub resets: u64,
    /// Micro-batch answers made unsplittable by `batch_malformed_rate`.
    pub batch_malformed: u64,
    /// 400 `content_policy_violation` answers.
    pub content_policy: u64,
    /// 400 `context_length_exceeded` answers.
    pub context_length: u64,
}

impl SimStats {
    /// Counts a 200 answer for `model`.
    pub(crate) fn count_model(&mut self, model: &str) {
        if let Some(n) = self.by_model.get_mut(model) {
            *n += 1;
        } else if self.by_model.len() < MAX_MODEL_NAMES {
            self.by_model.insert(model.to_owned(), 1);
        } else {
            *self.by_model.entry(OTHER_MODELS.to_owned()).or_default() += 1;
        }
    }
}

/// Successful calls by user content.
#[derive(Debug, Default)]
pub(crate) struct CallIndex {
    counts: HashMap<u64, u64>,
    order: VecDeque<u64>,
    contents: HashMap<u64, String>,
    content_order: VecDeque<u64>,
    content_bytes: usize,
}

impl CallIndex {
    /// Records one successful call whose user content was `content`.
    pub(crate) fn record(&mut self, content: &str) {
        let hash = fnv1a64(content.as_bytes());
        if let Some(n) = self.counts.get_mut(&hash) {
            *n += 1;
            return;
        }
        if self.counts.len() >= MAX_COUNTED_CONTENTS {
            if let Some(old) = self.order.pop_front() {
                self.counts.remove(&old);
                if let Some(text) = self.contents.remove(&old) {
                    self.content_bytes -= text.len();
                }
            }
        }
        self.counts.insert(hash, 1);
        self.order.push_back(hash);
        self.contents.insert(hash, content.to_owned());
        self.content_order.push_back(hash);
        self.content_bytes += content.len();
        while self.content_order.len() > MAX_STORED_CONTENTS
            || self.content_bytes > MAX_STORED_BYTES
        {
            let Some(old) = self.content_order.pop_front() else {
                break;
            };
            if let Some(text) = self.contents.remove(&old) {
                self.content_bytes -= text.len();
            }
        }
    }

    /// Successful calls whose user content contains `needle` (among stored contents).
    pub(crate) fn count_containing(&self, needle: &str) -> (u64, u64) {
        let mut calls = 0;
        let mut matched = 0;
        for (hash, text) in &self.contents {
            if text.contains(needle) {
                matched += 1;
                calls += self.counts.get(hash).copied().unwrap_or(0);
            }
        }
        (calls, matched)
    }

    /// Distinct contents counted.
    pub(crate) fn len(&self) -> usize {
        self.counts.len()
    }
}

/// System prompts already seen, for `cached_tokens`.
#[derive(Debug, Default)]
pub(crate) struct PromptCache {
    seen: HashSet<u64>,
    order: VecDeque<u64>,
}

impl PromptCache {
    /// Whether `hash` was seen before; remembers it (keeping at most `capacity`).
    pub(crate) fn check_and_insert(&mut self, hash: u64, capacity: usize) -> bool {
        if self.seen.contains(&hash) {
            return true;
        }
        while self.order.len() >= capacity.max(1) {
            match self.order.pop_front() {
                Some(old) => {
                    self.seen.remove(&old);
                }
                None => break,
            }
        }
        self.seen.insert(hash);
        self.order.push_back(hash);
        false
    }
}
