//! Splitting a micro-batch's token usage back over its tasks.
//!
//! A batch is one provider call; each task's result carries its share of the
//! call's usage. Shares are integers, never negative, and sum exactly to the
//! batch's figures, so per-tenant accounts built from results add up to what
//! the provider billed. The largest-remainder method does this with every
//! share within one token of its proportional value.

use crate::llm::Usage;

/// Splits `total` over items in proportion to `weights`: each item gets the
/// floor of its proportional value, and the tokens left over go one each to
/// the items with the largest remainders (the earlier item on a tie). The
/// shares sum to `total`. With no weight at all, the split is even.
pub fn apportion(total: u64, weights: &[u64]) -> Vec<u64> {
    if weights.is_empty() {
        return Vec::new();
    }
    let even;
    let weights = if weights.iter().all(|w| *w == 0) {
        even = vec![1; weights.len()];
        &even[..]
    } else {
        weights
    };
    let sum: u128 = weights.iter().map(|w| u128::from(*w)).sum();
    let total_wide = u128::from(total);
    let mut shares = Vec::with_capacity(weights.len());
    let mut remainders = Vec::with_capacity(weights.len());
    for (i, w) in weights.iter().enumerate() {
        let exact = total_wide * u128::from(*w);
        // Each share is at most `total`, so it fits back into u64.
        shares.push((exact / sum) as u64);
        remainders.push((exact % sum, i));
    }
    let given: u64 = shares.iter().sum();
    let left = (total - given) as usize;
    // Largest remainder first; the earlier item first on a tie.
    remainders.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for (_, i) in remainders.into_iter().take(left) {
        shares[i] += 1;
    }
    shares
}

/// Splits a micro-batch's usage over its items as it was spent: prompt tokens
/// by each item's own text (`own_prompts`) plus an equal share of the prompt
/// they share (`shared_prompt`, the instructions); completion tokens by each
/// item's answer (`answers`, e.g. its length) when the answer was split, else
/// like the prompt; cached tokens follow the prompt shares. Every figure sums
/// exactly to the batch's.
pub fn apportion_batch_usage(
    usage: &Usage,
    own_prompts: &[u64],
    shared_prompt: u64,
    answers: Option<&[u64]>,
) -> Vec<Usage> {
    let n = own_prompts.len() as u64;
    // n × (own + shared / n), kept in integers.
    let prompt_weights: Vec<u64> = own_prompts
        .iter()
        .map(|own| own.saturating_mul(n).saturating_add(shared_prompt))
        .collect();
    let prompt = apportion(usage.prompt_tokens, &prompt_weights);
    let completion = apportion(usage.completion_tokens, answers.unwrap_or(&prompt_weights));
    let by_prompt = |total: u64| match total {
        0 => vec![0; own_prompts.len()],
        t => apportion(t, &prompt),
    };
    let cached_total = usage.cached_tokens.min(usage.prompt_tokens);
    let cached = by_prompt(cached_total);
    let written = by_prompt(
        usage
            .cache_write_tokens
            .min(usage.prompt_tokens - cached_total),
    );
    prompt
        .into_iter()
        .zip(completion)
        .zip(cached.into_iter().zip(written))
        .map(
            |((prompt_tokens, completion_tokens), (cached_tokens, cache_write_tokens))| Usage {
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                cache_write_tokens,
            },
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    #[test]
    fn splits_by_largest_remainder() {
        assert_eq!(apportion(10, &[1, 1, 1]), vec![4, 3, 3]);
        assert_eq!(apportion(100, &[50, 30, 20]), vec![50, 30, 20]);
        assert_eq!(apportion(7, &[1, 2]), vec![2, 5]);
        assert_eq!(apportion(0, &[3, 4]), vec![0, 0]);
        assert_eq!(apportion(5, &[0, 0]), vec![3, 2]);
        assert_eq!(apportion(5, &[0, 9]), vec![0, 5]);
        assert_eq!(apportion(5, &[]), Vec::<u64>::new());
        let huge = apportion(u64::MAX, &[u64::MAX, u64::MAX]);
        assert_eq!(huge, vec![u64::MAX / 2 + 1, u64::MAX / 2]);
    }

    /// The property: over many random batches, shares sum exactly, are never
    /// negative (unsigned), and each is within one token of proportional.
    #[test]
    fn shares_sum_exactly_and_stay_within_one_token_of_proportional() {
        let mut rng = StdRng::seed_from_u64(0x5eed);
        for case in 0..20_000 {
            let n = rng.random_range(1..=40);
            let big = case % 10 == 0;
            let weights: Vec<u64> = (0..n)
                .map(|_| match rng.random_range(0..10) {
                    0 => 0,
                    _ if big => rng.random_range(0..u64::MAX / 64),
                    _ => rng.random_range(1..5_000),
                })
                .collect();
            let total = if big {
                rng.random_range(0..u64::MAX / 2)
            } else {
                rng.random_range(0..200_000)
            };
            let shares = apportion(total, &weights);
            assert_eq!(shares.len(), n);
            assert_eq!(
                shares.iter().map(|s| u128::from(*s)).sum::<u128>(),
                u128::from(total),
                "{weights:?} {total}"
            );
            let sum: u128 = weights.iter().map(|w| u128::from(*w)).sum();
            for (s, w) in shares.iter().zip(&weights) {
                // |share - total*w/sum| < 1, in integers: |share*sum - total*w| < sum.
                let (scaled, exact) = if sum == 0 {
                    (u128::from(*s) * n as u128, u128::from(total))
                } else {
                    (u128::from(*s) * sum, u128::from(total) * u128::from(*w))
                };
                let bound = if sum == 0 { n as u128 } else { sum };
                assert!(
                    scaled.abs_diff(exact) < bound,
                    "share {s} of {total} for weight {w} in {weights:?}"
                );
            }
        }
    }

    /// Prompt tokens go by each item's own text plus an equal share of the
    /// shared prompt; completion tokens by each item's answer.
    #[test]
    fn batch_usage_follows_own_text_and_answers() {
        let usage = Usage {
            prompt_tokens: 1_000,
            completion_tokens: 90,
            cached_tokens: 0,
            cache_write_tokens: 0,
        };
        // Own texts 100 and 300, 400 shared: 300 and 500 of 800.
        let shares = apportion_batch_usage(&usage, &[100, 300], 400, Some(&[1, 2]));
        assert_eq!(
            shares
                .iter()
                .map(|u| (u.prompt_tokens, u.completion_tokens))
                .collect::<Vec<_>>(),
            vec![(375, 30), (625, 60)]
        );
        let unsplit = apportion_batch_usage(&usage, &[100, 300], 400, None);
        assert_eq!(
            (unsplit[0].completion_tokens, unsplit[1].completion_tokens),
            (34, 56)
        );
    }

    #[test]
    fn usage_shares_sum_to_the_batch_and_cached_never_exceeds_prompt() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..5_000 {
            let n = rng.random_range(1..=20);
            let sizes: Vec<u64> = (0..n).map(|_| rng.random_range(0..2_000)).collect();
            let prompt_tokens = rng.random_range(0..50_000);
            let usage = Usage {
                prompt_tokens,
                completion_tokens: rng.random_range(0..20_000),
                cached_tokens: rng.random_range(0..=prompt_tokens / 2),
                cache_write_tokens: rng.random_range(0..=prompt_tokens / 2),
            };
            let shared = rng.random_range(0..4_000);
            let answers: Vec<u64> = (0..n).map(|_| rng.random_range(0..500)).collect();
            let answers = rng.random_bool(0.5).then_some(&answers[..]);
            let shares = apportion_batch_usage(&usage, &sizes, shared, answers);
            let sum = |f: fn(&Usage) -> u64| shares.iter().map(f).sum::<u64>();
            assert_eq!(sum(|u| u.prompt_tokens), usage.prompt_tokens);
            assert_eq!(sum(|u| u.completion_tokens), usage.completion_tokens);
            assert_eq!(sum(|u| u.cached_tokens), usage.cached_tokens);
            assert_eq!(sum(|u| u.cache_write_tokens), usage.cache_write_tokens);
            for u in &shares {
                assert!(u.cached_tokens <= u.prompt_tokens, "{usage:?} {sizes:?}");
            }
        }
    }
}
