//! Records taken from a partition's fetch queue a batch at a time.
//!
//! rdkafka's `PartitionQueue::poll` hands out one record per call, and each
//! call goes through librdkafka's per-poll bookkeeping (the application's
//! poll interval: two clock reads and the queue's served mark) and rdkafka's
//! event wrapping (a reference-counted event per record). Under the
//! exactly-once windowed count that was ~12 % of the process's samples, a
//! quarter of the feeding thread's. `rd_kafka_consume_batch_queue` takes up
//! to a given number of records in one call, with that bookkeeping once.
//!
//! A second module with `unsafe` code beside polled.rs: rdkafka wraps no
//! batch consumption for partition queues.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::Arc;

use rdkafka::bindings as rdsys;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::Timestamp;

use crate::record::Headers;

/// A second handle to a partition's fetch queue (the one rdkafka's
/// `split_partition_queue` took out of the consumer's queue), for taking its
/// records in batches. Holds the consumer, which must outlive the handle.
pub(crate) struct FetchQueue<C: ConsumerContext + 'static> {
    queue: NonNull<rdsys::rd_kafka_queue_t>,
    _consumer: Arc<BaseConsumer<C>>,
}

// SAFETY: librdkafka's queue operations take the queue's own lock: a queue
// handle may be used from any thread, by several at once.
unsafe impl<C: ConsumerContext + 'static> Send for FetchQueue<C> {}
// SAFETY: as above.
unsafe impl<C: ConsumerContext + 'static> Sync for FetchQueue<C> {}

impl<C: ConsumerContext + 'static> FetchQueue<C> {
    /// The fetch queue of a partition of the consumer's assignment; `None`
    /// when librdkafka knows no such partition.
    pub(crate) fn of(consumer: &Arc<BaseConsumer<C>>, topic: &str, partition: i32) -> Option<Self> {
        let topic = CString::new(topic).ok()?;
        // SAFETY: the client pointer is valid while `consumer` lives, and
        // the handle returned (a new reference to the queue) is destroyed
        // in `drop`, before this struct's reference to the consumer goes.
        let queue = unsafe {
            rdsys::rd_kafka_queue_get_partition(
                consumer.client().native_ptr(),
                topic.as_ptr(),
                partition,
            )
        };
        Some(FetchQueue {
            queue: NonNull::new(queue)?,
            _consumer: consumer.clone(),
        })
    }

    /// Takes up to `max` records without waiting, in order, into `out`
    /// (records and errors, as librdkafka queued them).
    pub(crate) fn take(&self, max: usize, out: &mut Vec<Fetched>) {
        if max == 0 {
            return;
        }
        let mut ptrs: Vec<*mut rdsys::rd_kafka_message_t> = Vec::with_capacity(max);
        // SAFETY: the queue handle is valid (see `of`); librdkafka writes at
        // most `max` message pointers into the buffer, of capacity `max`,
        // and returns how many (or -1 on error, with none written).
        let n = unsafe {
            rdsys::rd_kafka_consume_batch_queue(self.queue.as_ptr(), 0, ptrs.as_mut_ptr(), max)
        };
        let n = usize::try_from(n).unwrap_or(0).min(max);
        // SAFETY: the first `n` entries were written by librdkafka.
        unsafe { ptrs.set_len(n) };
        out.extend(ptrs.into_iter().filter_map(NonNull::new).map(Fetched));
    }
}

impl<C: ConsumerContext + 'static> Drop for FetchQueue<C> {
    fn drop(&mut self) {
        // SAFETY: the handle came from `rd_kafka_queue_get_partition` and is
        // destroyed once, while the consumer is still held.
        unsafe { rdsys::rd_kafka_queue_destroy(self.queue.as_ptr()) }
    }
}

/// One record (or error) taken from a fetch queue; given back to librdkafka
/// when dropped.
pub(crate) struct Fetched(NonNull<rdsys::rd_kafka_message_t>);

// SAFETY: a message taken from a queue is the taker's alone until destroyed;
// librdkafka's destroy may run on any thread.
unsafe impl Send for Fetched {}

impl Fetched {
    fn msg(&self) -> &rdsys::rd_kafka_message_t {
        // SAFETY: valid until `drop` destroys it.
        unsafe { self.0.as_ref() }
    }

    /// The error librdkafka queued in place of a record, if it is one.
    /// As rdkafka's `poll` reports it: the end of a partition (with
    /// `enable.partition.eof`) as `PartitionEOF`.
    pub(crate) fn error(&self) -> Option<KafkaError> {
        use rdsys::rd_kafka_resp_err_t as E;
        match self.msg().err {
            E::RD_KAFKA_RESP_ERR_NO_ERROR => None,
            E::RD_KAFKA_RESP_ERR__PARTITION_EOF => {
                Some(KafkaError::PartitionEOF(self.msg().partition))
            }
            err => Some(KafkaError::MessageConsumption(RDKafkaErrorCode::from(err))),
        }
    }

    pub(crate) fn offset(&self) -> i64 {
        self.msg().offset
    }

    pub(crate) fn key(&self) -> Option<&[u8]> {
        let m = self.msg();
        // SAFETY: librdkafka's key pointer and length, valid with the message.
        unsafe { slice(m.key.cast(), m.key_len) }
    }

    pub(crate) fn payload(&self) -> Option<&[u8]> {
        let m = self.msg();
        // SAFETY: librdkafka's payload pointer and length, valid with the message.
        unsafe { slice(m.payload.cast(), m.len) }
    }

    /// The record's timestamp, as rdkafka's `Message::timestamp` gives it.
    pub(crate) fn timestamp(&self) -> Timestamp {
        let mut kind = rdsys::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
        // SAFETY: a valid message; librdkafka writes the type it reports.
        let ms = unsafe { rdsys::rd_kafka_message_timestamp(self.0.as_ptr(), &mut kind) };
        match kind {
            _ if ms == -1 => Timestamp::NotAvailable,
            rdsys::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_CREATE_TIME => {
                Timestamp::CreateTime(ms)
            }
            rdsys::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_LOG_APPEND_TIME => {
                Timestamp::LogAppendTime(ms)
            }
            _ => Timestamp::NotAvailable,
        }
    }

    /// The record's headers (absent values as empty), as
    /// [`crate::record::message_headers`] reads them.
    pub(crate) fn headers(&self) -> Headers {
        let mut hdrs: *mut rdsys::rd_kafka_headers_t = std::ptr::null_mut();
        // SAFETY: a valid message; the headers librdkafka parses stay owned
        // by the message, and are read here before it is destroyed.
        let err = unsafe { rdsys::rd_kafka_message_headers(self.0.as_ptr(), &mut hdrs) };
        if err != rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || hdrs.is_null() {
            return Headers::new();
        }
        // SAFETY: `hdrs` is the message's parsed headers.
        let count = unsafe { rdsys::rd_kafka_header_cnt(hdrs) };
        let mut out = Headers::with_capacity(count);
        for idx in 0..count {
            let mut name: *const std::ffi::c_char = std::ptr::null();
            let mut value: *const std::ffi::c_void = std::ptr::null();
            let mut len = 0usize;
            // SAFETY: `idx` is below the count; librdkafka points `name` at
            // a NUL-terminated name and `value` at `len` bytes (or NULL),
            // both owned by the headers.
            let err = unsafe {
                rdsys::rd_kafka_header_get_all(hdrs, idx, &mut name, &mut value, &mut len)
            };
            if err != rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
                break;
            }
            // SAFETY: as above.
            let name = unsafe { std::ffi::CStr::from_ptr(name) };
            // SAFETY: as above.
            let value = unsafe { slice(value.cast(), len) }.unwrap_or_default();
            out.push((name.to_string_lossy().into_owned(), value.to_vec()));
        }
        out
    }
}

impl Drop for Fetched {
    fn drop(&mut self) {
        // SAFETY: a message from `rd_kafka_consume_batch_queue`, destroyed
        // once.
        unsafe { rdsys::rd_kafka_message_destroy(self.0.as_ptr()) }
    }
}

/// A byte slice of librdkafka's, `None` for a NULL pointer.
///
/// # Safety
/// `ptr` is NULL or points to `len` bytes valid for the returned lifetime.
unsafe fn slice<'a>(ptr: *const u8, len: usize) -> Option<&'a [u8]> {
    if ptr.is_null() {
        None
    } else if len == 0 {
        Some(&[])
    } else {
        // SAFETY: per the function's contract.
        Some(unsafe { std::slice::from_raw_parts(ptr, len) })
    }
}
