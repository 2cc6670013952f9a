//! A producer whose events (delivery reports, errors) a thread of its own
//! serves as they arrive, in place of rdkafka's `ThreadedProducer`.
//!
//! `ThreadedProducer`'s thread polls in rounds of 100 ms, and within a round
//! asks librdkafka to wait for the time left rounded down to whole
//! milliseconds: the last fraction of a millisecond of every round goes by
//! in zero-timeout polls back to back. That costs 0.7 % of a core per
//! producer, idle or busy (twenty idle producers: 1.34 CPU-seconds in 10 s),
//! and an exactly-once instance holds a producer per task. This thread
//! sleeps until librdkafka reports the producer's event queue non-empty,
//! then serves the queue until it is empty again.
//!
//! One of the two modules of the workspace with `unsafe` code (with
//! fetched.rs): librdkafka's "queue became non-empty" callback on a
//! producer's event queue, which rdkafka offers for consumer queues only.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use rdkafka::bindings as rdsys;
use rdkafka::config::{ClientConfig, FromClientConfigAndContext};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::producer::{BaseProducer, Producer, ProducerContext};

/// How long the thread sleeps without a wake-up before it looks at the queue
/// anyway. A safety net only: librdkafka wakes it whenever the queue becomes
/// non-empty, and a wake-up is never lost (the channel keeps one).
const IDLE_LOOK: Duration = Duration::from_secs(1);

/// A producer with a thread serving its events. Dereferences to the
/// producer; dropping it stops and joins the thread, then destroys the
/// producer.
pub struct PolledProducer<C: ProducerContext + 'static> {
    producer: Arc<BaseProducer<C>>,
    stop: Arc<AtomicBool>,
    wake: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl<C: ProducerContext + 'static> PolledProducer<C> {
    /// Creates the producer and starts its thread.
    pub fn new(config: &ClientConfig, context: C) -> KafkaResult<Self> {
        let producer = Arc::new(BaseProducer::from_config_and_context(config, context)?);
        let (wake, woken) = crossbeam_channel::bounded(1);
        let queue = EventQueue::watch(&producer, wake.clone())?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("sluice-producer".into())
            .spawn({
                let (producer, stop) = (producer.clone(), stop.clone());
                move || serve(producer, queue, &woken, &stop)
            })
            .map_err(|e| KafkaError::ClientCreation(format!("producer thread: {e}")))?;
        Ok(PolledProducer {
            producer,
            stop,
            wake,
            thread: Some(thread),
        })
    }
}

/// Serves the producer's events until told to stop. The queue's handle goes
/// before the thread's reference to the producer.
fn serve<C: ProducerContext>(
    producer: Arc<BaseProducer<C>>,
    queue: EventQueue,
    woken: &Receiver<()>,
    stop: &AtomicBool,
) {
    loop {
        // A zero-timeout poll serves one event; librdkafka wakes the thread
        // only when the queue goes from empty to non-empty, so it is served
        // until empty.
        while queue.len() > 0 {
            producer.poll(Duration::ZERO);
        }
        if stop.load(Ordering::Acquire) {
            break;
        }
        let _ = woken.recv_timeout(IDLE_LOOK);
    }
    drop(queue);
    drop(producer);
}

impl<C: ProducerContext + 'static> Deref for PolledProducer<C> {
    type Target = BaseProducer<C>;

    fn deref(&self) -> &BaseProducer<C> {
        &self.producer
    }
}

impl<C: ProducerContext + 'static> Drop for PolledProducer<C> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.try_send(());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A handle on a producer's event queue with librdkafka's non-empty
/// callback set to send on a channel.
struct EventQueue {
    queue: *mut rdsys::rd_kafka_queue_t,
    wake: *mut Sender<()>,
}

// SAFETY: librdkafka's queue handles may be used from any thread; the
// sender is `Send` and is only touched by the callback and by `drop`.
unsafe impl Send for EventQueue {}

impl EventQueue {
    fn watch<C: ProducerContext>(
        producer: &BaseProducer<C>,
        wake: Sender<()>,
    ) -> KafkaResult<EventQueue> {
        // SAFETY: the client pointer is valid while `producer` lives; the
        // handle returned holds its own reference on the queue.
        let queue = unsafe { rdsys::rd_kafka_queue_get_main(producer.client().native_ptr()) };
        if queue.is_null() {
            return Err(KafkaError::ClientCreation(
                "the producer has no event queue".into(),
            ));
        }
        let wake = Box::into_raw(Box::new(wake));
        // SAFETY: `wake` stays allocated until `drop` has unset the
        // callback; librdkafka calls the callback with the queue's lock held
        // and unsets it under the same lock, so no call outlives the unset.
        unsafe { rdsys::rd_kafka_queue_cb_event_enable(queue, Some(on_nonempty), wake.cast()) };
        Ok(EventQueue { queue, wake })
    }

    fn len(&self) -> usize {
        // SAFETY: the handle is valid until `drop`.
        unsafe { rdsys::rd_kafka_queue_length(self.queue) }
    }
}

impl Drop for EventQueue {
    fn drop(&mut self) {
        // SAFETY: see `watch`; after the unset no callback can run, so the
        // sender can be freed, and the handle is released once.
        unsafe {
            rdsys::rd_kafka_queue_cb_event_enable(self.queue, None, std::ptr::null_mut());
            rdsys::rd_kafka_queue_destroy(self.queue);
            drop(Box::from_raw(self.wake));
        }
    }
}

/// librdkafka's callback when the queue becomes non-empty (on one of its
/// threads, with the queue locked): wakes the producer's thread.
unsafe extern "C" fn on_nonempty(_: *mut rdsys::rd_kafka_t, opaque: *mut c_void) {
    // SAFETY: `opaque` is the sender boxed in `EventQueue::watch`, alive
    // while the callback is set.
    let wake = unsafe { &*(opaque as *const Sender<()>) };
    let _ = wake.try_send(());
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::DeliveryResult;
    use rdkafka::producer::BaseRecord;
    use rdkafka::ClientContext;
    use std::sync::atomic::AtomicUsize;

    #[derive(Default)]
    struct Reports(AtomicUsize);

    impl ClientContext for Reports {}

    impl ProducerContext for Reports {
        type DeliveryOpaque = ();

        fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
            // Nothing listens on the bootstrap address: every record fails.
            if result.is_err() {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    #[test]
    fn every_delivery_report_is_served_and_drop_stops_the_thread() {
        // No broker: each record fails once its message timeout passes, and
        // each failure is a delivery report the thread must serve.
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("message.timeout.ms", "200")
            .set("log_level", "0");
        let producer = PolledProducer::new(&config, Reports::default()).unwrap();
        for i in 0..5 {
            let key = format!("k{i}");
            producer
                .send(BaseRecord::<str, str>::to("t").key(&key).payload("v"))
                .unwrap();
        }
        // A report's event leaves the out-queue (`in_flight_count`) only
        // after its callback returned, so the two are waited for together.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while producer.context().0.load(Ordering::SeqCst) < 5 || producer.in_flight_count() > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "reports not served: {} of 5, {} still in the out-queue",
                producer.context().0.load(Ordering::SeqCst),
                producer.in_flight_count()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(producer.context().0.load(Ordering::SeqCst), 5);
        // Joins the thread and destroys the client (a hang fails the test).
        drop(producer);
    }
}
