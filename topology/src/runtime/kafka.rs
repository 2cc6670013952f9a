//! Kafka clients of the runtime: client configuration, producers with delivery
//! tracking, and sending records.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::{ClientContext, Message, TopicPartitionList};

use super::config::StreamsConfig;
use super::error::RuntimeError;
use super::failpoint::hang_point;
use super::polled::PolledProducer;
use crate::record::Headers;
use crate::TaskId;

/// What a produced record was, so its delivery report can be attributed.
pub(crate) enum DeliveryTag {
    /// An output record of a task.
    Output(TaskId),
    /// A changelog record of a task's store.
    Changelog { task: TaskId, store: usize },
}

/// Delivery outcomes of one producer.
#[derive(Default)]
pub(crate) struct DeliveryState {
    errors: AtomicU64,
    /// The first failed delivery (`topic/partition: error`).
    first_error: Mutex<Option<String>>,
    changelog_next: Mutex<HashMap<(TaskId, usize), i64>>,
    output_next: Mutex<HashMap<TaskId, OutputEnds>>,
}

/// Next offset after delivered outputs, per (topic, partition).
pub(crate) type OutputEnds = HashMap<(String, i32), i64>;

impl DeliveryState {
    /// The deliveries that failed since the last call, if any, naming the
    /// first.
    pub(crate) fn take_error(&self) -> Option<RuntimeError> {
        if self.errors.swap(0, Ordering::AcqRel) == 0 {
            return None;
        }
        Some(RuntimeError::DeliveryFailed {
            first: self.first_error.lock().take(),
        })
    }

    /// Next offsets after the task's delivered outputs, per topic partition.
    pub(crate) fn take_output_next(&self, task: TaskId) -> OutputEnds {
        self.output_next.lock().remove(&task).unwrap_or_default()
    }

    /// Next changelog offsets per store of a task, from delivery reports.
    pub(crate) fn take_changelog_next(&self, task: TaskId) -> HashMap<sluice_state::StoreId, i64> {
        let mut map = self.changelog_next.lock();
        let keys: Vec<(TaskId, usize)> = map.keys().filter(|(t, _)| *t == task).copied().collect();
        keys.into_iter()
            .filter_map(|k| map.remove(&k).map(|v| (sluice_state::StoreId(k.1), v)))
            .collect()
    }
}

/// Producer context recording delivery outcomes.
pub(crate) struct TrackingContext {
    pub(crate) state: Arc<DeliveryState>,
}

impl ClientContext for TrackingContext {}

impl ProducerContext for TrackingContext {
    type DeliveryOpaque = Box<DeliveryTag>;

    fn delivery(&self, result: &DeliveryResult<'_>, tag: Self::DeliveryOpaque) {
        match (result, *tag) {
            (Ok(msg), DeliveryTag::Changelog { task, store }) => {
                let mut map = self.state.changelog_next.lock();
                let next = map.entry((task, store)).or_insert(0);
                *next = (*next).max(msg.offset() + 1);
            }
            (Ok(msg), DeliveryTag::Output(task)) => {
                let mut map = self.state.output_next.lock();
                let ends = map.entry(task).or_default();
                let next = msg.offset() + 1;
                match ends.get_mut(&(msg.topic().to_string(), msg.partition())) {
                    Some(v) => *v = (*v).max(next),
                    None => {
                        ends.insert((msg.topic().to_string(), msg.partition()), next);
                    }
                }
            }
            (Err((e, msg)), _) => {
                self.state.errors.fetch_add(1, Ordering::AcqRel);
                let mut first = self.state.first_error.lock();
                if first.is_none() {
                    *first = Some(format!("{}/{}: {e}", msg.topic(), msg.partition()));
                }
            }
        }
    }
}

/// A producer with delivery tracking.
pub(crate) type TrackedProducer = PolledProducer<TrackingContext>;

/// librdkafka properties every client starts from, before the user's
/// (which may set them back). KIP-714's client metrics push off: with it on
/// (librdkafka's default) a consumer records every poll into a telemetry
/// histogram under a lock, whether or not the cluster subscribes to client
/// metrics — 3 % of the driver thread's time in `make bench-engine`'s
/// exactly-once round, one poll per record.
pub const CLIENT_DEFAULTS: &[(&str, &str)] = &[("enable.metrics.push", "false")];

/// A client config for the cluster at `bootstrap`: [`CLIENT_DEFAULTS`],
/// then the user's `properties`, which win.
pub fn client_base(bootstrap: &str, properties: &crate::redact::Properties) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap);
    for (k, v) in CLIENT_DEFAULTS {
        c.set(*k, *v);
    }
    for (k, v) in properties.iter() {
        c.set(k, v);
    }
    c
}

/// Base client config of the engine: [`client_base`] of its bootstrap
/// servers and client overrides.
pub(crate) fn client_config(cfg: &StreamsConfig) -> ClientConfig {
    client_base(&cfg.bootstrap_servers, &cfg.client_overrides)
}

/// How long librdkafka waits before fetching a partition again once its
/// prefetch is full (overridable by client properties). Its default, a
/// second, leaves a partition's queue empty for most of that second whenever
/// fetching outpaces processing: the engine's rate halved. Checking again
/// every 10 ms keeps the queue filled at no measurable cost.
pub(crate) const FETCH_QUEUE_BACKOFF_MS: &str = "10";

/// The first retry's backoff of a transactional producer (see
/// [`create_producer`]).
const TXN_RETRY_BACKOFF_MS: &str = "20";

/// Creates a producer; `transactional_id` makes it transactional.
pub(crate) fn create_producer(
    cfg: &StreamsConfig,
    transactional_id: Option<&str>,
) -> Result<(Arc<TrackedProducer>, Arc<DeliveryState>), KafkaError> {
    let mut c = client_config(cfg);
    c.set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("batch.num.messages", "10000")
        .set("queue.buffering.max.messages", "500000")
        .set("compression.type", "lz4")
        // Same partitioner as the Java clients, so keyed records land where
        // Java producers (and Kafka Streams) would put them.
        .set("partitioner", "murmur2_random");
    if let Some(id) = transactional_id {
        c.set("transactional.id", id)
            .set(
                "transaction.timeout.ms",
                cfg.transaction_timeout.as_millis().to_string(),
            )
            // A transaction begun right after the previous one committed is
            // refused with CONCURRENT_TRANSACTIONS until the coordinator has
            // written the previous one's markers, a few milliseconds; the
            // client retries after `retry.backoff.ms`, 100 ms by default,
            // which would hold every commit round's first records that long.
            // The Java producer retries this case after 20 ms (KAFKA-5477);
            // later retries back off exponentially up to
            // `retry.backoff.max.ms` as before.
            .set("retry.backoff.ms", TXN_RETRY_BACKOFF_MS);
    }
    for (k, v) in &cfg.producer_overrides {
        c.set(k, v);
    }
    let state = Arc::new(DeliveryState::default());
    let producer = PolledProducer::new(
        &c,
        TrackingContext {
            state: state.clone(),
        },
    )?;
    Ok((Arc::new(producer), state))
}

/// A record's headers as librdkafka takes them; `None` when there are none.
pub(crate) fn owned_headers(headers: &Headers) -> Option<OwnedHeaders> {
    (!headers.is_empty()).then(|| {
        headers.iter().fold(
            OwnedHeaders::new_with_capacity(headers.len()),
            |h, (k, v)| {
                h.insert(Header {
                    key: k,
                    value: Some(v.as_slice()),
                })
            },
        )
    })
}

/// Sends one record, waiting while the local queue is full.
#[allow(clippy::too_many_arguments)]
pub(crate) fn send(
    producer: &TrackedProducer,
    topic: &str,
    partition: Option<i32>,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
    timestamp: Option<i64>,
    headers: &Headers,
    tag: DeliveryTag,
) -> Result<(), KafkaError> {
    let owned_headers = owned_headers(headers);
    let mut record: BaseRecord<'_, [u8], [u8], Box<DeliveryTag>> =
        BaseRecord::with_opaque_to(topic, Box::new(tag));
    if let Some(k) = key {
        record = record.key(k);
    }
    if let Some(v) = value {
        record = record.payload(v);
    }
    if let Some(p) = partition {
        record = record.partition(p);
    }
    if let Some(ts) = timestamp.filter(|t| *t >= 0) {
        record = record.timestamp(ts);
    }
    if let Some(h) = owned_headers {
        record = record.headers(h);
    }
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                record = r;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err((e, _)) => return Err(e),
        }
    }
}

/// Makes a new transactional producer ready, fencing earlier owners of its id.
///
/// librdkafka looks the transaction coordinator up at once, and when no broker
/// connection is up yet it tries again only 500 ms later. Two metadata
/// requests for `topic` come first: the answer to the first replaces the
/// bootstrap connection with the cluster's brokers, and the second waits for a
/// connection to one of them. The producer is then ready within a few round
/// trips.
pub(crate) fn init_transactions(
    producer: &TrackedProducer,
    topic: &str,
    timeout: Duration,
) -> rdkafka::error::KafkaResult<()> {
    // Only a warm-up: init_transactions reports any real failure.
    for _ in 0..2 {
        let _ = producer.client().fetch_metadata(Some(topic), timeout);
    }
    producer.init_transactions(timeout)
}

/// How much longer than the timeout it was given a client call may take
/// before its client is given up on (see [`bounded`]).
const UNANSWERED_GRACE: Duration = Duration::from_secs(10);

/// Runs `call` on a thread of its own and waits for it at most `bound`: for
/// client calls that can block past the timeout they were given. Past the
/// bound the caller gets [`RuntimeError::Unanswered`] and goes on; the thread
/// keeps what `call` holds (a producer) until the call returns, if ever.
pub(crate) fn bounded<T: Send + 'static>(
    what: &str,
    bound: Duration,
    call: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RuntimeError> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name("sluice-client-call".into())
        .spawn(move || {
            let _ = tx.send(call());
        })
        .map_err(|e| RuntimeError::NoThread(format!("a thread for {what}: {e}")))?;
    rx.recv_timeout(bound).map_err(|e| match e {
        crossbeam_channel::RecvTimeoutError::Timeout => {
            RuntimeError::Unanswered(format!("{what} did not return within {bound:?}"))
        }
        crossbeam_channel::RecvTimeoutError::Disconnected => RuntimeError::Panicked(what.into()),
    })
}

/// Adds a transaction's consumed offsets, giving the producer up when the
/// call does not return.
///
/// librdkafka (2.12) may never return from `send_offsets_to_transaction`,
/// whatever its timeout: the request to the group coordinator waits for the
/// cached coordinator's connection to change state, and a coordinator whose
/// broker left the cluster's metadata and came back may never change again
/// (upstream issues 5456 and 5511; met here with a broker killed, restarted,
/// then stalled: the commit thread blocked for good, and with it every task).
/// So the call runs [`bounded`], for its timeout and [`UNANSWERED_GRACE`];
/// past that the error closes the task dirty, with no further call on this
/// producer (one is still in progress), and the producer of the task's next
/// incarnation fences it: the broker aborts its transaction.
pub(crate) fn send_offsets_to_transaction(
    producer: &Arc<TrackedProducer>,
    offsets: &TopicPartitionList,
    meta: &Arc<ConsumerGroupMetadata>,
    timeout: Duration,
) -> Result<(), RuntimeError> {
    let (p, offsets, meta) = (producer.clone(), offsets.clone(), meta.clone());
    bounded(
        "adding offsets to a transaction",
        timeout + UNANSWERED_GRACE,
        move || {
            hang_point("eos_offsets_unanswered");
            p.send_offsets_to_transaction(&offsets, &meta, timeout)
        },
    )?
    .map_err(RuntimeError::from)
}

/// Calls `f` until it succeeds or fails for good: after a retriable failure
/// (reported to `retrying`) it is called again, unless `cancel` was set.
pub(crate) fn until_done<T>(
    cancel: &std::sync::atomic::AtomicBool,
    mut f: impl FnMut() -> rdkafka::error::KafkaResult<T>,
    retrying: impl Fn(&RuntimeError),
) -> Result<T, RuntimeError> {
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) => {
                let e = RuntimeError::from(e);
                if !e.retriable() {
                    return Err(e);
                }
                if cancel.load(Ordering::Relaxed) {
                    return Err(RuntimeError::Cancelled);
                }
                retrying(&e);
            }
        }
    }
}

/// Drops a Kafka client on a thread of its own: closing one waits for its
/// threads (about a tenth of a second), which a caller need not do.
pub fn close_in_background<C: Send + 'static>(client: C) {
    // Should the thread not start, the client is dropped here instead.
    let _ = std::thread::Builder::new()
        .name("sluice-client-close".into())
        .spawn(move || drop(client));
}

/// Waits until every record sent was acknowledged and its delivery report
/// handled, then reports the first delivery error.
///
/// `Producer::flush` with a timeout sleeps in 100 ms polls between checks;
/// zero-timeout flushes (which also wake the broker threads) in a short loop
/// keep a commit at the broker's round-trip time.
pub(crate) fn flush(
    producer: &TrackedProducer,
    state: &DeliveryState,
    timeout: Duration,
) -> Result<(), RuntimeError> {
    let deadline = std::time::Instant::now() + timeout;
    while producer.in_flight_count() > 0 {
        if std::time::Instant::now() > deadline {
            return Err(RuntimeError::FlushTimedOut {
                unacknowledged: producer.in_flight_count(),
            });
        }
        let _ = producer.flush(Duration::ZERO);
        std::thread::sleep(Duration::from_micros(200));
    }
    match state.take_error() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_past_its_bound_is_given_up_and_the_caller_goes_on() {
        // The call would return after a minute: within the bound the caller
        // would get its (timed-out) result instead of the error.
        let (_held, never) = crossbeam_channel::bounded::<()>(0);
        let e = bounded(
            "a call that does not return",
            Duration::from_millis(100),
            move || never.recv_timeout(Duration::from_secs(60)),
        )
        .unwrap_err();
        assert!(e.unanswered(), "{e}");
        assert!(!e.retriable(), "a producer given up on is not called again");
        assert_eq!(
            e.to_string(),
            "a call that does not return did not return within 100ms; its client is given up"
        );
        assert_eq!(bounded("a call", Duration::from_secs(60), || 7).unwrap(), 7);
        let e = bounded("a call that panics", Duration::from_secs(60), || -> u8 {
            panic!("boom")
        })
        .unwrap_err();
        assert!(!e.unanswered(), "{e}");
    }

    #[test]
    fn clients_start_without_metrics_push_and_the_user_may_turn_it_on() {
        let mut cfg = StreamsConfig::new("app", "127.0.0.1:1", std::path::Path::new("/tmp"));
        assert_eq!(
            client_config(&cfg).get("enable.metrics.push"),
            Some("false")
        );
        cfg.client_overrides
            .insert("enable.metrics.push".into(), "true".into());
        assert_eq!(client_config(&cfg).get("enable.metrics.push"), Some("true"));
    }
}
