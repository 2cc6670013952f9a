//! Limiter tests, all on paused tokio time.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicU64, Ordering};

fn ok() -> Outcome {
    Outcome::Success {
        rate_limit: RateLimitInfo::default(),
        tokens_used: 100,
        output_tokens: 20,
    }
}

fn limited(retry_after: Option<Duration>) -> Outcome {
    Outcome::RateLimited {
        retry_after,
        rate_limit: RateLimitInfo::default(),
    }
}

fn fixed(rps: f64) -> LimiterConfig {
    LimiterConfig {
        initial_rps: rps,
        max_rps: rps,
        ..Default::default()
    }
}

/// Spawns `n` callers that each take `count` permits and record `ok()` immediately.
async fn grants_within(limiter: &AimdLimiter, n: usize, horizon: Duration) -> u64 {
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut handles = vec![];
    for _ in 0..n {
        let l = limiter.clone();
        let done = done.clone();
        handles.push(tokio::spawn(async move {
            loop {
                let p = l.acquire(Priority::Normal, 10).await;
                if start.elapsed() >= horizon {
                    drop(p);
                    break;
                }
                done.fetch_add(1, Ordering::Relaxed);
                p.record(ok());
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    done.load(Ordering::Relaxed)
}

#[tokio::test(start_paused = true)]
async fn paces_at_the_rate_without_spinning() {
    let limiter = AimdLimiter::new(fixed(20.0));
    let n = grants_within(&limiter, 10, Duration::from_secs(5)).await;
    // 20/s for 5 s, plus the one-interval GCRA tolerance.
    assert!((100..=102).contains(&n), "{n}");
    assert_eq!(limiter.waiting(), 0);
    assert_eq!(limiter.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn grows_only_while_it_is_the_bottleneck() {
    let limiter = AimdLimiter::new(LimiterConfig {
        initial_rps: 10.0,
        ..Default::default()
    });
    // Idle: no growth however long we wait.
    tokio::time::advance(Duration::from_secs(10)).await;
    limiter.acquire(Priority::Normal, 1).await.record(ok());
    assert!((limiter.current_rps() - 10.0).abs() < 1e-9);
    // Saturated: slow start doubles it every second.
    grants_within(&limiter, 4, Duration::from_secs(2)).await;
    let r = limiter.current_rps();
    assert!((35.0..=45.0).contains(&r), "{r}");
}

/// Saturates the limiter at its rate for `secs`, recording successes, then returns a permit
/// admitted afterwards (a new congestion epoch).
async fn warm_up(limiter: &AimdLimiter, secs: u64) {
    grants_within(limiter, 4, Duration::from_secs(secs)).await;
}

#[tokio::test(start_paused = true)]
async fn a_429_cuts_to_a_fraction_of_the_accepted_rate_once_per_event() {
    let limiter = AimdLimiter::new(fixed(40.0));
    // Three seconds of successes at 40/s.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        limiter.acquire(Priority::Normal, 10).await.record(ok());
    }
    // Three permits out at once; all get 429: one congestion event.
    let a = limiter.acquire(Priority::Normal, 10).await;
    let b = limiter.acquire(Priority::Normal, 10).await;
    let c = limiter.acquire(Priority::Normal, 10).await;
    a.record(limited(None));
    let after_first = limiter.current_rps();
    // Without headers: 0.95 × the ~38-40/s accepted over the last second of admissions.
    assert!((35.0..=38.5).contains(&after_first), "{after_first}");
    b.record(limited(None));
    c.record(limited(None));
    assert_eq!(
        limiter.current_rps(),
        after_first,
        "same event must cut once"
    );
    assert_eq!(limiter.rate_limited_total(), 3);
    // A request admitted after the cut that is refused again is a new event.
    let d = limiter.acquire(Priority::Normal, 10).await;
    d.record(limited(None));
    assert!(limiter.current_rps() < after_first);
}

#[tokio::test(start_paused = true)]
async fn after_a_cut_growth_is_slow_near_the_ceiling_and_accelerates_past_it() {
    let limiter = AimdLimiter::new(LimiterConfig {
        initial_rps: 40.0,
        ..Default::default()
    });
    {
        // Pin the ceiling at 40 with a synthetic event.
        let mut st = limiter.shared.state.lock();
        let now = Instant::now();
        st.req.cut(36.0, 40.0, 0, now);
    }
    grants_within(&limiter, 4, Duration::from_secs(4)).await;
    let r = limiter.current_rps();
    // 1.5 % of the ceiling per second: 36 + 4 × 0.6 = 38.4.
    assert!((38.0..=38.8).contains(&r), "{r}");
    grants_within(&limiter, 4, Duration::from_secs(10)).await;
    let r2 = limiter.current_rps();
    // Past the ceiling the step grows: well beyond the linear 38.4 + 6 = 44.4.
    assert!(r2 > 46.0, "{r2}");
}

#[tokio::test(start_paused = true)]
async fn retry_after_pauses_all_admissions() {
    let limiter = AimdLimiter::new(fixed(100.0));
    let p = limiter.acquire(Priority::Normal, 1).await;
    let t0 = Instant::now();
    p.record(limited(Some(Duration::from_millis(1500))));
    let q = limiter.acquire(Priority::High, 1).await;
    assert!(
        t0.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        t0.elapsed()
    );
    q.record(ok());
    // Retry-After via the header field works the same way.
    let p = limiter.acquire(Priority::Normal, 1).await;
    let t1 = Instant::now();
    p.record(Outcome::RateLimited {
        retry_after: None,
        rate_limit: RateLimitInfo {
            retry_after: Some(Duration::from_millis(700)),
            ..Default::default()
        },
    });
    limiter.acquire(Priority::Normal, 1).await.record(ok());
    assert!(t1.elapsed() >= Duration::from_millis(700));
}

#[tokio::test(start_paused = true)]
async fn headers_warn_before_any_429() {
    let limiter = AimdLimiter::new(fixed(50.0));
    // The provider refills 45/s into a bucket of 10; we send 50/s: remaining drains.
    let (supply, bucket) = (45.0, 10.0);
    let mut tokens = bucket;
    let mut last = Instant::now();
    let mut refused = 0;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        let p = limiter.acquire(Priority::Normal, 1).await;
        let now = Instant::now();
        tokens = (tokens + supply * (now - last).as_secs_f64()).min(bucket);
        last = now;
        let admitted = tokens >= 1.0;
        if admitted {
            tokens -= 1.0;
        }
        let rate_limit = RateLimitInfo {
            remaining_requests: Some(tokens.floor() as u64),
            reset_requests: Some(Duration::from_secs_f64((bucket - tokens) / supply)),
            ..Default::default()
        };
        if admitted {
            p.record(Outcome::Success {
                rate_limit,
                tokens_used: 1,
                output_tokens: 1,
            });
        } else {
            refused += 1;
            p.record(Outcome::RateLimited {
                retry_after: None,
                rate_limit,
            });
        }
    }
    assert_eq!(refused, 0);
    let r = limiter.current_rps();
    // Cut below the supplied 45/s (measured from admissions and Δremaining) in time.
    assert!((42.0..=45.5).contains(&r), "{r}");
}

#[tokio::test(start_paused = true)]
async fn priority_order_and_batch_still_progresses() {
    let limiter = AimdLimiter::new(fixed(10.0));
    // Take the initial tolerance so that everyone below has to queue.
    limiter.acquire(Priority::Normal, 1).await.record(ok());
    limiter.acquire(Priority::Normal, 1).await.record(ok());
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut handles = vec![];
    for (p, n) in [
        (Priority::Batch, 20),
        (Priority::Normal, 40),
        (Priority::High, 80),
    ] {
        for _ in 0..n {
            let l = limiter.clone();
            let order = order.clone();
            handles.push(tokio::spawn(async move {
                let permit = l.acquire(p, 1).await;
                order.lock().push(p);
                permit.record(ok());
            }));
        }
    }
    // Let all of them enqueue before the first admission.
    tokio::task::yield_now().await;
    for h in handles {
        h.await.unwrap();
    }
    let order = order.lock().clone();
    assert_eq!(order.len(), 140);
    // High goes first.
    assert_eq!(order[0], Priority::High);
    // While all three are backlogged (first 65 admissions), shares follow 8/4/1 (±1 for
    // the phase left by the two earlier normal admissions).
    let head = &order[..65];
    let count = |p| head.iter().filter(|x| **x == p).count();
    assert!((39..=41).contains(&count(Priority::High)));
    assert!((19..=21).contains(&count(Priority::Normal)));
    assert!((4..=6).contains(&count(Priority::Batch)));
    // Batch is not starved: its first admission comes within the first 13.
    assert!(order[..13].contains(&Priority::Batch));
    assert_eq!(limiter.served(Priority::High), 80);
    assert_eq!(limiter.served(Priority::Batch), 20);
    assert_eq!(limiter.served(Priority::Normal), 42);
}

#[tokio::test(start_paused = true)]
async fn concurrency_cap_and_cancelled_waiters() {
    let limiter = AimdLimiter::new(LimiterConfig {
        initial_rps: 1000.0,
        max_rps: 1000.0,
        max_concurrency: Some(2),
        ..Default::default()
    });
    let a = limiter.acquire(Priority::Normal, 1).await;
    let _b = limiter.acquire(Priority::Normal, 1).await;
    // A third caller waits; give up on it after a while (cancellation).
    let r = tokio::time::timeout(Duration::from_secs(1), limiter.acquire(Priority::High, 1)).await;
    assert!(r.is_err());
    assert_eq!(limiter.waiting(), 0);
    let l = limiter.clone();
    let waiter = tokio::spawn(async move { l.acquire(Priority::Batch, 1).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(!waiter.is_finished());
    a.record(ok());
    let c = waiter.await.unwrap();
    assert_eq!(limiter.in_flight(), 2);
    drop(c); // unreported permits release their slot too
    assert_eq!(limiter.in_flight(), 1);
}

#[tokio::test(start_paused = true)]
async fn freed_slots_are_granted_at_once_and_unclaimed_grants_come_back() {
    // Unpaced requests: only the concurrency bound holds callers back.
    let limiter = AimdLimiter::new(LimiterConfig {
        initial_rps: f64::INFINITY,
        max_rps: f64::INFINITY,
        max_concurrency: Some(3),
        ..Default::default()
    });
    let held: Vec<Permit> = vec![
        limiter.acquire(Priority::Normal, 1).await,
        limiter.acquire(Priority::Normal, 1).await,
        limiter.acquire(Priority::Normal, 1).await,
    ];
    let mut waiters = vec![];
    for _ in 0..3 {
        let l = limiter.clone();
        waiters.push(tokio::spawn(
            async move { l.acquire(Priority::Normal, 1).await },
        ));
    }
    tokio::task::yield_now().await;
    assert_eq!(limiter.waiting(), 3);
    // Freeing every slot admits every waiter there and then, before any of them runs.
    for p in held {
        p.record(ok());
    }
    assert_eq!(limiter.waiting(), 0);
    assert_eq!(limiter.in_flight(), 3);
    // A waiter cancelled before it picked up its grant gives the slot back.
    let last = waiters.pop().unwrap();
    last.abort();
    assert!(last.await.unwrap_err().is_cancelled());
    assert_eq!(limiter.in_flight(), 2);
    for w in waiters {
        w.await.unwrap().record(ok());
    }
    assert_eq!(limiter.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn token_limit_is_learned_from_429s_and_paces_tokens() {
    let limiter = AimdLimiter::new(LimiterConfig {
        initial_rps: 100.0,
        max_rps: 100.0,
        ..Default::default()
    });
    assert_eq!(limiter.current_tpm(), None);
    warm_up(&limiter, 2).await;
    let p = limiter.acquire(Priority::Normal, 1000).await;
    p.record(Outcome::RateLimited {
        retry_after: None,
        rate_limit: RateLimitInfo {
            remaining_requests: Some(50),
            remaining_tokens: Some(10),
            ..Default::default()
        },
    });
    // Requests untouched; tokens now paced at 0.9 × the accepted 100 × 100 tokens/s.
    assert_eq!(limiter.current_rps(), 100.0);
    let tpm = limiter.current_tpm().unwrap();
    assert!((500_000.0..=560_000.0).contains(&tpm), "{tpm}");
}

fn group(rps: f64) -> LimiterConfig {
    LimiterConfig {
        // Far above the group limit: only the cap holds the rate back.
        initial_rps: 100.0,
        group_rps: Some(rps),
        ..Default::default()
    }
}

#[tokio::test(start_paused = true)]
async fn the_group_cap_holds_the_rate_to_the_share_and_follows_it_both_ways() {
    let limiter = AimdLimiter::new(group(20.0));
    // Until told its share, an instance may take the whole group limit.
    assert_eq!(limiter.current_rps(), 20.0);
    limiter.set_group_share(0.25);
    assert_eq!(limiter.group_share(), 0.25);
    assert_eq!(limiter.current_rps(), 5.0);
    // Saturated for 4 s: slow start would double the rate every second; the cap holds it.
    let n = grants_within(&limiter, 4, Duration::from_secs(4)).await;
    assert!((19..=23).contains(&n), "{n}");
    assert_eq!(limiter.current_rps(), 5.0);
    // The share grows: so does the cap, and the rate with it at once.
    limiter.set_group_share(0.5);
    assert_eq!(limiter.current_rps(), 10.0);
    let n = grants_within(&limiter, 4, Duration::from_secs(4)).await;
    assert!((39..=43).contains(&n), "{n}");
    // The share shrinks: the rate drops at once, before any 429.
    limiter.set_group_share(0.25);
    assert_eq!(limiter.current_rps(), 5.0);
    let n = grants_within(&limiter, 4, Duration::from_secs(4)).await;
    assert!((19..=23).contains(&n), "{n}");
    assert_eq!(limiter.rate_limited_total(), 0);
}

#[tokio::test(start_paused = true)]
async fn below_the_cap_the_rate_still_adapts_and_grows_back_to_a_raised_cap() {
    let limiter = AimdLimiter::new(group(20.0));
    limiter.set_group_share(0.5);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        limiter.acquire(Priority::Normal, 10).await.record(ok());
    }
    // A 429 below the cap (another client uses the quota too): cut below the cap.
    limiter
        .acquire(Priority::Normal, 10)
        .await
        .record(limited(None));
    let cut = limiter.current_rps();
    assert!((8.5..=9.8).contains(&cut), "{cut}");
    // The share doubles: the rate follows by the same ratio, below the new cap...
    limiter.set_group_share(1.0);
    let raised = limiter.current_rps();
    assert!((raised - 2.0 * cut).abs() < 1e-9, "{raised} vs {cut}");
    // ...and, without further 429s, grows to the new cap and no further.
    let mut highest: f64 = 0.0;
    for _ in 0..12 {
        grants_within(&limiter, 4, Duration::from_secs(1)).await;
        highest = highest.max(limiter.current_rps());
    }
    assert_eq!(highest, 20.0);
    assert_eq!(limiter.current_rps(), 20.0);
    let n = grants_within(&limiter, 4, Duration::from_secs(4)).await;
    assert!((79..=83).contains(&n), "{n}");
}

#[tokio::test(start_paused = true)]
async fn without_a_share_nothing_is_admitted_and_the_rate_comes_back_with_it() {
    let limiter = AimdLimiter::new(group(20.0));
    limiter.set_group_share(0.5);
    warm_up(&limiter, 2).await;
    // A rebalance: every partition revoked, then assigned again.
    limiter.set_group_share(0.0);
    assert_eq!(limiter.group_share(), MIN_GROUP_SHARE);
    assert!(limiter.current_rps() <= 20.0 * MIN_GROUP_SHARE);
    let waiting = tokio::time::timeout(
        Duration::from_secs(60),
        limiter.acquire(Priority::Normal, 10),
    )
    .await;
    assert!(waiting.is_err(), "no call without partitions");
    let l = limiter.clone();
    let admitted = tokio::spawn(async move {
        let start = Instant::now();
        l.acquire(Priority::Normal, 10).await.record(ok());
        start.elapsed()
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    limiter.set_group_share(0.5);
    let waited = admitted.await.unwrap();
    assert!(
        waited >= Duration::from_secs(5) && waited < Duration::from_millis(5_200),
        "{waited:?}"
    );
    // The round trip gives back the rate (nothing was learned in between).
    assert!((limiter.current_rps() - 10.0).abs() < 1e-6);
    let n = grants_within(&limiter, 4, Duration::from_secs(4)).await;
    assert!((39..=43).contains(&n), "{n}");
}

#[tokio::test(start_paused = true)]
async fn a_group_token_limit_paces_tokens_from_the_start_within_the_share() {
    let limiter = AimdLimiter::new(LimiterConfig {
        group_tpm: Some(60_000.0),
        ..Default::default()
    });
    assert_eq!(limiter.current_tpm(), Some(60_000.0));
    limiter.set_group_share(0.5);
    assert_eq!(limiter.current_tpm(), Some(30_000.0));
    // 500 tokens/s at 100 tokens a call: 5 calls/s (plus a second's token tolerance).
    let calls = grants_within(&limiter, 4, Duration::from_secs(4)).await;
    assert!((20..=27).contains(&calls), "{calls}");
    let unlimited = AimdLimiter::new(LimiterConfig::default());
    unlimited.set_group_share(0.5);
    assert_eq!(unlimited.current_tpm(), None, "no group limit, no pacing");
}

// --- Simulation: a token-bucket provider (50/s, burst 5, 25/s from 30 s on) ---------------
//
// A backlog of 200 callers drives one limiter against a fake provider on paused time; the
// provider admits at send time, answers successes after a random latency and 429s after a
// quarter of it. Its headers go through `RateLimitInfo::from_headers`, as on the wire.

#[derive(Debug, Clone, Copy, PartialEq)]
enum HeaderStyle {
    /// vLLM / llama.cpp / Ollama: a bare 429.
    None,
    /// As `sluice sim-provider` sends them (OpenAI style): limit = bucket size, remaining,
    /// reset = time until the bucket is full; `retry-after-ms` and whole-second
    /// `Retry-After` (at least 1) on 429.
    OpenAi,
    /// Like `OpenAi` but the limit is the rate itself, so it changes with the quota.
    OpenAiRateLimit,
    /// reset = time until the next request is allowed; no limit header; whole-second
    /// `Retry-After` only.
    ResetToNext,
}

/// Latency of successful answers.
#[derive(Debug, Clone, Copy)]
enum Latency {
    /// Uniform in `[min, max]` ms.
    Uniform(u64, u64),
    /// Log-normal with this median and 99th percentile, ms (capped at 10 × p99).
    LogNormal(f64, f64),
}

impl Latency {
    fn sample(self, rng: &mut StdRng) -> Duration {
        match self {
            Latency::Uniform(lo, hi) => Duration::from_millis(rng.random_range(lo..=hi)),
            Latency::LogNormal(median, p99) => {
                let sigma = (p99 / median).ln() / 2.326;
                // Box-Muller.
                let (u1, u2): (f64, f64) = (rng.random_range(1e-12..1.0), rng.random());
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                let ms = (median * (sigma * z).exp()).min(10.0 * p99);
                Duration::from_secs_f64(ms / 1000.0)
            }
        }
    }
}

/// One simulated run.
#[derive(Debug, Clone, Copy)]
struct Scenario {
    style: HeaderStyle,
    seed: u64,
    latency: Latency,
    /// Provider bucket size, requests.
    burst: f64,
}

/// Seeds and latencies every style is run with.
const RUNS: [(u64, Latency); 8] = [
    (1, Latency::Uniform(50, 250)),
    (2, Latency::Uniform(100, 600)),
    (3, Latency::Uniform(20, 100)),
    (4, Latency::Uniform(300, 1200)),
    (5, Latency::LogNormal(300.0, 2000.0)),
    (6, Latency::LogNormal(100.0, 500.0)),
    (7, Latency::Uniform(50, 250)),
    (8, Latency::LogNormal(300.0, 2000.0)),
];
const RUN_SECS: usize = 60;
const CALLERS: u64 = 200;

struct FakeProvider {
    start: Instant,
    tokens: f64,
    last: Instant,
    style: HeaderStyle,
    burst: f64,
}

impl FakeProvider {
    fn limit(&self, now: Instant) -> f64 {
        if now.duration_since(self.start) >= Duration::from_secs(30) {
            25.0
        } else {
            50.0
        }
    }

    fn admit(&mut self, now: Instant) -> (bool, RateLimitInfo) {
        let rate = self.limit(now);
        self.tokens = (self.tokens + rate * (now - self.last).as_secs_f64()).min(self.burst);
        self.last = now;
        let admitted = self.tokens >= 1.0;
        if admitted {
            self.tokens -= 1.0;
        }
        let wait = ((1.0 - self.tokens) / rate).max(0.0);
        let remaining = (self.tokens.floor() as u64).to_string();
        let mut h = reqwest::header::HeaderMap::new();
        let mut set = |k: &'static str, v: String| {
            h.insert(k, v.parse().unwrap());
        };
        match self.style {
            HeaderStyle::None => {}
            HeaderStyle::OpenAi | HeaderStyle::OpenAiRateLimit => {
                let limit = if self.style == HeaderStyle::OpenAi {
                    self.burst
                } else {
                    rate
                };
                set("x-ratelimit-limit-requests", format!("{}", limit as u64));
                set("x-ratelimit-remaining-requests", remaining);
                let full = (self.burst - self.tokens) / rate;
                set(
                    "x-ratelimit-reset-requests",
                    format!("{}ms", (full * 1000.0).ceil()),
                );
                if !admitted {
                    let ms = (wait * 1000.0).ceil().max(1.0);
                    set("retry-after-ms", format!("{ms}"));
                    set("retry-after", format!("{}", (ms / 1000.0).ceil().max(1.0)));
                }
            }
            HeaderStyle::ResetToNext => {
                set("x-ratelimit-remaining-requests", remaining);
                set(
                    "x-ratelimit-reset-requests",
                    format!("{}ms", (wait * 1000.0).ceil()),
                );
                if !admitted {
                    set("retry-after", format!("{}", wait.ceil()));
                }
            }
        }
        (admitted, RateLimitInfo::from_headers(&h))
    }
}

#[derive(Debug)]
struct SimReport {
    /// Accepted / limit over 10–30 s.
    util_first: f64,
    /// Accepted / limit over 40–60 s.
    util_second: f64,
    /// 429 answers / calls over the whole run.
    share_429: f64,
    /// Seconds after the change until every later 5-second average of accepted calls is
    /// at least 90 % of the new limit.
    reconverged_after: f64,
}

async fn simulate(sc: Scenario) -> SimReport {
    let start = Instant::now();
    let limiter = AimdLimiter::new(LimiterConfig::default());
    let provider = Arc::new(Mutex::new(FakeProvider {
        start,
        tokens: sc.burst,
        last: start,
        style: sc.style,
        burst: sc.burst,
    }));
    let accepted = Arc::new(Mutex::new(vec![0u32; RUN_SECS]));
    let refused = Arc::new(Mutex::new(vec![0u32; RUN_SECS]));
    let horizon = Duration::from_secs(RUN_SECS as u64);
    let mut handles = vec![];
    for caller in 0..CALLERS {
        let (limiter, provider) = (limiter.clone(), provider.clone());
        let (accepted, refused) = (accepted.clone(), refused.clone());
        handles.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(sc.seed * 1000 + caller);
            loop {
                let permit = limiter.acquire(Priority::Normal, 200).await;
                let now = Instant::now();
                if now.duration_since(start) >= horizon {
                    drop(permit);
                    break;
                }
                let second = now.duration_since(start).as_secs() as usize;
                let (admitted, info) = provider.lock().admit(now);
                let latency = sc.latency.sample(&mut rng);
                let after = if admitted { latency } else { latency / 4 };
                tokio::time::sleep(after).await;
                if admitted {
                    accepted.lock()[second] += 1;
                    permit.record(Outcome::Success {
                        rate_limit: info,
                        tokens_used: 150,
                        output_tokens: 50,
                    });
                } else {
                    refused.lock()[second] += 1;
                    permit.record(Outcome::RateLimited {
                        retry_after: info.retry_after,
                        rate_limit: info,
                    });
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let accepted = accepted.lock().clone();
    let refused = refused.lock().clone();
    let sum = |v: &[u32]| v.iter().map(|x| f64::from(*x)).sum::<f64>();
    let mut reconverged = RUN_SECS;
    for s in (30..=RUN_SECS - 5).rev() {
        if sum(&accepted[s..s + 5]) / 5.0 >= 0.9 * 25.0 {
            reconverged = s;
        } else {
            break;
        }
    }
    SimReport {
        util_first: sum(&accepted[10..30]) / (50.0 * 20.0),
        util_second: sum(&accepted[40..60]) / (25.0 * 20.0),
        share_429: sum(&refused) / (sum(&accepted) + sum(&refused)),
        reconverged_after: reconverged as f64 - 30.0,
    }
}

/// Runs every seed of `style` with `burst` and checks the targets on each.
async fn check(style: HeaderStyle, burst: f64, runs: &[(u64, Latency)]) {
    let (min_util, max_429) = match style {
        HeaderStyle::None => (0.90, 0.03),
        _ => (0.95, 0.01),
    };
    let mut failures = vec![];
    for &(seed, latency) in runs {
        let sc = Scenario {
            style,
            seed,
            latency,
            burst,
        };
        let r = simulate(sc).await;
        println!("{sc:?}: {r:?}");
        if r.util_first < min_util
            || r.util_second < min_util
            || r.share_429 > max_429
            || r.reconverged_after > 10.0
        {
            failures.push((sc, r));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[tokio::test(start_paused = true)]
async fn simulation_with_openai_headers() {
    check(HeaderStyle::OpenAi, 5.0, &RUNS).await;
}

#[tokio::test(start_paused = true)]
async fn simulation_with_a_limit_header_that_follows_the_quota() {
    check(HeaderStyle::OpenAiRateLimit, 5.0, &RUNS).await;
}

#[tokio::test(start_paused = true)]
async fn simulation_with_next_token_reset_headers() {
    check(HeaderStyle::ResetToNext, 5.0, &RUNS).await;
}

#[tokio::test(start_paused = true)]
async fn simulation_without_headers() {
    check(HeaderStyle::None, 5.0, &RUNS).await;
}

#[tokio::test(start_paused = true)]
async fn simulation_with_other_burst_sizes() {
    // 50 is the simulator's default burst (one second of quota).
    for burst in [2.0, 10.0, 50.0] {
        check(HeaderStyle::OpenAi, burst, &RUNS[..5]).await;
    }
    for burst in [2.0, 10.0] {
        check(HeaderStyle::None, burst, &RUNS[..5]).await;
    }
}
