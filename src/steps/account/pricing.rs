//! Model prices and the cost of a call.
//!
//! Prices are integer micro-dollars per million tokens, costs integer
//! micro-dollars: a call's cost is rounded once, from its whole usage, and a
//! batch's tasks share it by largest remainder, so the results' costs (and
//! the windows that sum them) add up to the calls' costs exactly.

use serde::{Deserialize, Serialize};

use crate::llm::Usage;

/// Price of a model, micro-dollars per million tokens (`[prices.<model>]`).
///
/// `input` and `output` are required: a model is never free by accident.
/// Cached prompt tokens cost `cached`, by default the input price (a cache
/// discount is applied only when it is configured); prompt tokens written
/// to a provider's cache (Anthropic-style cache creation) cost
/// `cache_write`, by default 1.25 × the input price (a five-minute cache
/// write; a one-hour write is 2 ×). Reasoning tokens are output tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Uncached input tokens.
    pub input: u64,
    /// Output tokens (reasoning tokens included).
    pub output: u64,
    /// Input tokens read from the provider's cache (default: `input`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached: Option<u64>,
    /// Input tokens written to the provider's cache (default: 1.25 ×
    /// `input`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write: Option<u64>,
}

impl Price {
    /// A price with the given input and output rates and the default cache
    /// rates.
    pub fn new(input: u64, output: u64) -> Price {
        Price {
            input,
            output,
            cached: None,
            cache_write: None,
        }
    }

    /// The rate of cached prompt tokens.
    pub fn cached_rate(&self) -> u64 {
        self.cached.unwrap_or(self.input)
    }

    /// The rate of prompt tokens written to the cache.
    pub fn cache_write_rate(&self) -> u64 {
        self.cache_write
            .unwrap_or_else(|| self.input.saturating_mul(5) / 4)
    }

    /// The dearest rate a prompt token can cost.
    pub fn dearest_prompt_rate(&self) -> u64 {
        self.input
            .max(self.cached_rate())
            .max(self.cache_write_rate())
    }

    /// The most `prompt` prompt tokens and `completion` completion tokens
    /// can cost, micro-dollars: every prompt token at the dearest prompt
    /// rate (a hard quota's worst case).
    pub fn bound_micros(&self, prompt: u64, completion: u64) -> i64 {
        let dearest = Price::new(self.dearest_prompt_rate(), self.output);
        let usage = Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            cached_tokens: 0,
            cache_write_tokens: 0,
        };
        cost_micros(&dearest, &usage)
    }

    /// Each rate the dearer of `self`'s and `other`'s.
    pub fn dearest(&self, other: &Price) -> Price {
        Price {
            input: self.input.max(other.input),
            output: self.output.max(other.output),
            cached: Some(self.cached_rate().max(other.cached_rate())),
            cache_write: Some(self.cache_write_rate().max(other.cache_write_rate())),
        }
    }

    /// The exact cost of `usage` in millionths of a micro-dollar.
    fn exact(&self, u: &Usage) -> u128 {
        let cached = u.cached_tokens.min(u.prompt_tokens);
        let written = u.cache_write_tokens.min(u.prompt_tokens - cached);
        let plain = u.prompt_tokens - cached - written;
        plain as u128 * self.input as u128
            + cached as u128 * self.cached_rate() as u128
            + written as u128 * self.cache_write_rate() as u128
            + u.completion_tokens as u128 * self.output as u128
    }
}

/// Cost in micro-dollars of a call's usage (rounded half up once; integer so
/// that totals are exact sums).
pub fn cost_micros(price: &Price, usage: &Usage) -> i64 {
    i64::try_from((price.exact(usage) + 500_000) / 1_000_000).unwrap_or(i64::MAX)
}

/// Splits a call's cost over the usage shares of its tasks: the call's cost
/// is rounded once (from its whole usage) and given out in proportion to
/// each share's exact cost by largest remainder, so the tasks' costs sum to
/// the call's cost exactly.
pub fn apportion_cost(price: &Price, shares: &[Usage]) -> Vec<i64> {
    let mut whole = Usage::default();
    let weights: Vec<u64> = shares
        .iter()
        .map(|s| {
            whole.add(s);
            u64::try_from(price.exact(s)).unwrap_or(u64::MAX)
        })
        .collect();
    let total = cost_micros(price, &whole).max(0) as u64;
    crate::steps::invoke_llm::apportion::apportion(total, &weights)
        .into_iter()
        .map(|c| c as i64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(prompt: u64, cached: u64, written: u64, completion: u64) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            cached_tokens: cached,
            cache_write_tokens: written,
        }
    }

    /// Over 10,000 random batches, the tasks' costs sum to the call's cost
    /// to the micro-dollar, and each is within a micro-dollar of its exact
    /// share.
    #[test]
    fn batch_costs_sum_to_the_calls_cost_exactly() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xc057);
        for _ in 0..10_000 {
            let price = Price {
                input: rng.random_range(0..20_000_000),
                output: rng.random_range(0..80_000_000),
                cached: Some(rng.random_range(0..10_000_000)),
                cache_write: None,
            };
            let shares: Vec<Usage> = (0..rng.random_range(1..=32))
                .map(|_| {
                    let prompt = rng.random_range(0..3_000);
                    let cached = rng.random_range(0..=prompt);
                    let written = rng.random_range(0..=prompt - cached);
                    usage(prompt, cached, written, rng.random_range(0..2_000))
                })
                .collect();
            let costs = apportion_cost(&price, &shares);
            let mut whole = Usage::default();
            shares.iter().for_each(|s| whole.add(s));
            let call = cost_micros(&price, &whole);
            assert_eq!(costs.iter().sum::<i64>(), call, "{price:?} {shares:?}");
            for (share, cost) in shares.iter().zip(&costs) {
                let exact = price.exact(share) as f64 / 1e6;
                assert!(
                    (*cost as f64 - exact).abs() <= 1.0 + 1e-9,
                    "{cost} vs {exact}"
                );
            }
        }
    }

    #[test]
    fn cost_is_integer_micros_with_cached_rate() {
        let p = Price {
            cached: Some(75_000),
            ..Price::new(150_000, 600_000)
        };
        // 1000 input (200 cached), 500 output:
        // 800*0.15 + 200*0.075 + 500*0.6 = 120 + 15 + 300 = 435 micros
        assert_eq!(cost_micros(&p, &usage(1000, 200, 0, 500)), 435);
        assert_eq!(cost_micros(&p, &usage(3, 0, 0, 0)), 0); // 0.45 rounds down
        assert_eq!(cost_micros(&p, &usage(4, 0, 0, 0)), 1); // 0.6 rounds up
    }

    /// Cached tokens cost the input price unless a cached price is set;
    /// cache writes cost 1.25 × input unless set.
    #[test]
    fn cache_rates_default_to_the_input_price_never_to_zero() {
        let p = Price::new(3_000_000, 15_000_000);
        // 1,000 prompt tokens: 400 read from the cache, 200 written to it.
        // 400 × 3 + 400 × 3 + 200 × 3.75 = 3,150 micro-dollars.
        assert_eq!(cost_micros(&p, &usage(1000, 400, 200, 0)), 3_150);
        let set = Price {
            cached: Some(300_000),
            cache_write: Some(6_000_000),
            ..p
        };
        // 400 × 3 + 400 × 0.3 + 200 × 6 = 2,520.
        assert_eq!(cost_micros(&set, &usage(1000, 400, 200, 0)), 2_520);
        assert_eq!(p.dearest_prompt_rate(), 3_750_000);
    }

    /// A hand-computed invoice at $0.10 / $0.40 per million tokens: three
    /// calls' costs, rounded once each, and their tasks' shares summing to
    /// them.
    #[test]
    fn nano_prices_bill_the_invoice_to_the_micro_dollar() {
        let p = Price::new(100_000, 400_000);
        // A 4-task batch: 30 prompt tokens each, completions 3, 3, 2, 1.
        // Call: 120 × 0.1 + 9 × 0.4 = 12 + 3.6 = 15.6 → 16 micro-dollars.
        let batch = [
            usage(30, 0, 0, 3),
            usage(30, 0, 0, 3),
            usage(30, 0, 0, 2),
            usage(30, 0, 0, 1),
        ];
        let shares = apportion_cost(&p, &batch);
        // Exact shares 4.2, 4.2, 3.8, 3.4 (sum 15.6): floors 4, 4, 3, 3 = 14;
        // the two micro-dollars left go to the largest remainders (0.8, 0.4).
        assert_eq!(shares, vec![4, 4, 4, 4]);
        assert_eq!(shares.iter().sum::<i64>(), 16);
        // A 3-token call costs 0.3 micro-dollars: 0 (rounded once, not per
        // task); a 44-token one 4.4 → 4; 11 output tokens 4.4 → 4.
        assert_eq!(cost_micros(&p, &usage(3, 0, 0, 0)), 0);
        assert_eq!(cost_micros(&p, &usage(44, 0, 0, 0)), 4);
        assert_eq!(cost_micros(&p, &usage(0, 0, 0, 11)), 4);
        // Two shares of a 4.4 µ$ call: 2.2 each → 2 + 2 = 4 = the call.
        assert_eq!(
            apportion_cost(&p, &[usage(22, 0, 0, 0), usage(22, 0, 0, 0)]),
            vec![2, 2]
        );
    }
}
