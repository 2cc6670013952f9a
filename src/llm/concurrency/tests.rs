//! Adaptive concurrency through the limiter, on paused tokio time, against model servers:
//! one that queues (N slots, the rest waits in arrival order) and one whose latency does
//! not depend on load. An answer of `t` output tokens takes `100 ms + 2 ms × t` unloaded.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::llm::limiter::{AimdLimiter, LimiterConfig, Outcome};
use crate::llm::Priority;
use crate::llm::RateLimitInfo;

fn service(tokens: u32) -> Duration {
    Duration::from_millis(100 + 2 * u64::from(tokens))
}

/// A model provider.
#[derive(Clone)]
struct Server {
    /// Slots of a queueing server; `None`: latency independent of load.
    slots: Option<Arc<Semaphore>>,
    /// Rate-limit headers sent with every answer.
    headers: RateLimitInfo,
}

impl Server {
    fn queueing(slots: usize) -> Self {
        Self {
            slots: Some(Arc::new(Semaphore::new(slots))),
            headers: RateLimitInfo::default(),
        }
    }

    fn flat() -> Self {
        Self {
            slots: None,
            headers: RateLimitInfo::default(),
        }
    }

    async fn answer(&self, tokens: u32) {
        let _slot = match &self.slots {
            Some(s) => Some(s.acquire().await.expect("open")),
            None => None,
        };
        tokio::time::sleep(service(tokens)).await;
    }
}

#[derive(Debug)]
struct Report {
    answered: u64,
    timeouts: u64,
    max_in_flight: usize,
    /// The limiter's concurrency limit every 500 ms.
    limits: Vec<usize>,
}

/// `callers` callers calling `server` for `length`, each answer of a size drawn from
/// `sizes`, with a per-call `timeout`.
async fn drive(
    limiter: &AimdLimiter,
    server: &Server,
    callers: usize,
    length: Duration,
    sizes: &[u32],
    timeout: Duration,
) -> Report {
    drive_phases(limiter, server, callers, length, &[sizes], timeout).await
}

/// [`drive`] with the sizes drawn from `phases[i]` in the i-th equal part of `length`.
async fn drive_phases(
    limiter: &AimdLimiter,
    server: &Server,
    callers: usize,
    length: Duration,
    phases: &[&[u32]],
    timeout: Duration,
) -> Report {
    let phases: Arc<Vec<Vec<u32>>> = Arc::new(phases.iter().map(|p| p.to_vec()).collect());
    let start = Instant::now();
    let answered = Arc::new(AtomicU64::new(0));
    let timeouts = Arc::new(AtomicU64::new(0));
    let max_in_flight = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for c in 0..callers {
        let (limiter, server, phases) = (limiter.clone(), server.clone(), phases.clone());
        let (answered, timeouts, max_in_flight) =
            (answered.clone(), timeouts.clone(), max_in_flight.clone());
        handles.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(c as u64);
            while start.elapsed() < length {
                let phase = (start.elapsed().as_secs_f64() / length.as_secs_f64()
                    * phases.len() as f64) as usize;
                let sizes = &phases[phase.min(phases.len() - 1)];
                let tokens = sizes[rng.random_range(0..sizes.len())];
                let permit = limiter.acquire(Priority::Normal, 100).await;
                max_in_flight.fetch_max(limiter.in_flight(), Ordering::Relaxed);
                match tokio::time::timeout(timeout, server.answer(tokens)).await {
                    Ok(()) => {
                        answered.fetch_add(1, Ordering::Relaxed);
                        permit.record(Outcome::Success {
                            rate_limit: server.headers,
                            tokens_used: tokens + 50,
                            output_tokens: tokens,
                        });
                    }
                    Err(_) => {
                        timeouts.fetch_add(1, Ordering::Relaxed);
                        permit.record(Outcome::TimedOut);
                    }
                }
            }
        }));
    }
    let mut limits = Vec::new();
    while start.elapsed() < length {
        tokio::time::sleep(Duration::from_millis(500)).await;
        limits.push(limiter.concurrency_limit().unwrap_or(usize::MAX));
    }
    for h in handles {
        h.await.expect("caller");
    }
    Report {
        answered: answered.load(Ordering::Relaxed),
        timeouts: timeouts.load(Ordering::Relaxed),
        max_in_flight: max_in_flight.load(Ordering::Relaxed),
        limits,
    }
}

/// A limiter whose rate never binds (below the ~2,000 admissions/s that tokio's
/// millisecond timers allow a pacer): only concurrency is in question.
fn limiter() -> AimdLimiter {
    AimdLimiter::new(LimiterConfig {
        initial_rps: 1e6,
        max_rps: 1e6,
        ..LimiterConfig::default()
    })
}

#[tokio::test(start_paused = true)]
async fn settles_just_above_the_slots_of_a_queueing_server() {
    for slots in [1usize, 4, 16] {
        let limiter = limiter();
        let server = Server::queueing(slots);
        let length = Duration::from_secs(120);
        let r = drive(
            &limiter,
            &server,
            200,
            length,
            &[50],
            Duration::from_secs(5),
        )
        .await;
        // Past the first 10 s the limit stays within a small queue above the slots.
        let settled = &r.limits[20..];
        let (lo, hi) = (
            *settled.iter().min().expect("samples"),
            *settled.iter().max().expect("samples"),
        );
        assert!(
            lo >= slots && hi <= slots + 10,
            "{slots} slots: limit between {lo} and {hi}: {:?}",
            r.limits
        );
        assert_eq!(r.timeouts, 0, "{slots} slots: {r:?}");
        // The slots stay busy: at least 90 % of the server's capacity (200 ms per call).
        let capacity = slots as f64 * length.as_secs_f64() / 0.2;
        assert!(
            r.answered as f64 >= 0.9 * capacity,
            "{slots} slots: {} of {capacity}",
            r.answered
        );
    }
}

#[tokio::test(start_paused = true)]
async fn does_not_shrink_for_a_flat_server_with_mixed_answer_sizes() {
    // Latency independent of load; first short answers only (5 tokens, 110 ms), then a mix
    // with long ones (400 tokens, 900 ms): longer answers are not a queue.
    let limiter = limiter();
    let r = drive_phases(
        &limiter,
        &Server::flat(),
        150,
        Duration::from_secs(60),
        // The mix changes at 20 s, between two reference probes.
        &[
            &[5],
            &[5],
            &[5, 400, 120, 5],
            &[5, 400, 120, 5],
            &[5, 400, 120, 5],
            &[5, 400, 120, 5],
        ],
        Duration::from_secs(5),
    )
    .await;
    assert!(
        r.limits.windows(2).all(|w| w[1] >= w[0]),
        "the limit never drops: {:?}",
        r.limits
    );
    assert_eq!(r.max_in_flight, 150, "{r:?}");
    assert!(*r.limits.last().expect("samples") >= 150, "{r:?}");
}

#[tokio::test(start_paused = true)]
async fn grows_back_when_the_server_gains_slots() {
    let limiter = limiter();
    let server = Server::queueing(2);
    let timeout = Duration::from_secs(5);
    let r = drive(
        &limiter,
        &server,
        100,
        Duration::from_secs(40),
        &[50],
        timeout,
    )
    .await;
    let before = *r.limits.last().expect("samples");
    assert!(before <= 2 + 8, "{r:?}");
    // The server now has 24 slots: latency drops, the limit climbs to them.
    server.slots.as_ref().expect("queueing").add_permits(22);
    let r = drive(
        &limiter,
        &server,
        100,
        Duration::from_secs(40),
        &[50],
        timeout,
    )
    .await;
    let after = *r.limits.last().expect("samples");
    assert!((24..=24 + 10).contains(&after), "from {before}: {r:?}");
    assert_eq!(r.timeouts, 0);
}

#[tokio::test(start_paused = true)]
async fn timeouts_halve_the_limit_once_per_event() {
    let limiter = AimdLimiter::new(LimiterConfig {
        initial_rps: 1e6,
        max_rps: 1e6,
        concurrency: crate::llm::ConcurrencyConfig {
            initial_limit: 16,
            ..Default::default()
        },
        ..LimiterConfig::default()
    });
    // Sixteen calls out at once, all timing out: one event, one cut.
    let permits: Vec<_> =
        futures::future::join_all((0..16).map(|_| limiter.acquire(Priority::Normal, 10))).await;
    for p in permits {
        p.record(Outcome::TimedOut);
    }
    assert_eq!(limiter.concurrency_limit(), Some(8));
    // A call sent after the cut that times out again is a new event.
    limiter
        .acquire(Priority::Normal, 10)
        .await
        .record(Outcome::TimedOut);
    assert_eq!(limiter.concurrency_limit(), Some(4));
}

#[tokio::test(start_paused = true)]
async fn a_provider_sending_rate_limit_headers_leaves_the_pacers_in_charge() {
    // One slot, so latency grows with every call in flight, but the provider sends rate-limit
    // headers: the concurrency limit must not hold callers back.
    let limiter = limiter();
    let server = Server {
        headers: RateLimitInfo {
            limit_requests: Some(10_000),
            remaining_requests: Some(9_999),
            reset_requests: Some(Duration::from_millis(6)),
            ..Default::default()
        },
        ..Server::queueing(1)
    };
    let r = drive(
        &limiter,
        &server,
        40,
        Duration::from_secs(60),
        &[50],
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(r.max_in_flight, 40, "{r:?}");
    assert!(*r.limits.last().expect("samples") >= 40, "{r:?}");
}

#[test]
fn bad_bounds_are_refused_naming_the_key() {
    use crate::llm::ConcurrencyConfig;
    let ok = ConcurrencyConfig::default();
    assert!(ok.validate().is_ok());
    let bad = ConcurrencyConfig {
        min_limit: 0,
        ..ok.clone()
    };
    assert_eq!(bad.validate().unwrap_err().0, "min_limit");
    let bad = ConcurrencyConfig {
        min_queue: f64::NAN,
        ..ok
    };
    assert_eq!(bad.validate().unwrap_err().0, "min_queue");
}
