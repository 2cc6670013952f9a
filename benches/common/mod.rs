//! What the benchmarks share: the partition count of their topics, knobs
//! from the environment, CPU time from `/proc`, and the plain consumer every
//! ratio is taken against.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// Partitions of the benchmarks' topics.
pub const PARTITIONS: i32 = 4;

/// A number from the environment, or `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU time (user and system, seconds) of a process, from `/proc/<pid>/stat`.
pub fn cpu_secs(pid: u32) -> Option<f64> {
    stat_secs(&format!("/proc/{pid}/stat"), 11)
}

/// This process's CPU time (seconds; NaN where `/proc` cannot tell).
pub fn own_cpu_secs() -> f64 {
    cpu_secs(std::process::id()).unwrap_or(f64::NAN)
}

/// Two clock-tick counts of a `/proc/*/stat` file summed in seconds: the
/// one at `first` (counted from the field after the command name, which
/// may hold spaces: utime is 11, cutime 13) and the next.
pub fn stat_secs(path: &str, first: usize) -> Option<f64> {
    let stat = std::fs::read_to_string(path).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 =
        fields.get(first)?.parse::<u64>().ok()? + fields.get(first + 1)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// The broker's pid, as `make bench-*` passes it (`SLUICE_BENCH_BROKER_PID`).
pub fn broker_pid() -> Option<u32> {
    std::env::var("SLUICE_BENCH_BROKER_PID").ok()?.parse().ok()
}

/// A plain consumer reading every partition, either through the consumer's
/// queue or (`split`) through one queue per partition, as the engine does.
pub fn raw_read(bootstrap: &str, topic: &str, n: usize, split: bool) -> f64 {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("bench-raw-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        // As the engine's consumer: fetched again 10 ms after its queue was
        // full, not librdkafka's default second (which leaves the queues
        // empty for most of it once fetching outpaces reading).
        .set("fetch.queue.backoff.ms", "10")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    // Connected, with the topic's metadata, before the clock starts: an
    // engine's consumer is too when its clock starts (at its assignment, after
    // joining the group), so neither side counts connection set-up.
    consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let consumer = std::sync::Arc::new(consumer);
    consumer.assign(&tpl).unwrap();
    let queues: Vec<_> = if split {
        (0..PARTITIONS)
            .map(|p| consumer.split_partition_queue(topic, p).expect("split"))
            .collect()
    } else {
        Vec::new()
    };
    let (mut seen, mut bytes) = (0usize, 0usize);
    let count = |m: &rdkafka::message::BorrowedMessage<'_>, seen: &mut usize, bytes: &mut usize| {
        use rdkafka::Message;
        *bytes += m.payload_len() + m.key().map_or(0, <[u8]>::len);
        *seen += 1;
    };
    let start = Instant::now();
    let mut first = None;
    if split {
        let mut idle = false;
        loop {
            // Events only: with split queues no record arrives here.
            let _ = consumer.poll(Duration::from_millis(if idle { 1 } else { 0 }));
            idle = true;
            for q in &queues {
                while let Some(Ok(m)) = q.poll(Duration::ZERO) {
                    count(&m, &mut seen, &mut bytes);
                    first.get_or_insert_with(|| start.elapsed());
                    idle = false;
                }
            }
            if seen >= n {
                break;
            }
        }
    } else {
        while seen < n {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                count(&m, &mut seen, &mut bytes);
                first.get_or_insert_with(|| start.elapsed());
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let how = if split {
        "partition queues"
    } else {
        "consumer queue"
    };
    let first = first.unwrap_or_default().as_secs_f64();
    eprintln!(
        "raw ({how}): {seen} records ({bytes} bytes) in {secs:.2}s (first after {first:.2}s)"
    );
    seen as f64 / secs
}
