//! Where a keyed output record lands, decided by the engine before it is
//! sent: the same murmur2 hash the Java clients (and the engine's producers,
//! `partitioner=murmur2_random`) use, over the topic's partition count. A
//! commit knows from it which partitions each task's transaction writes, so
//! tasks whose transactions share no partition can overlap their commits.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use parking_lot::Mutex;
use rdkafka::producer::Producer;

use super::kafka::TrackedProducer;
use crate::record::OutputRecord;

/// Kafka's murmur2 hash (`org.apache.kafka.common.utils.Utils.murmur2`).
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = SEED ^ len as u32;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition the Java clients' default partitioner picks for a key.
pub fn key_partition(key: &[u8], partitions: i32) -> i32 {
    (murmur2(key) & 0x7fff_ffff) % partitions.max(1)
}

/// CRC-32 (IEEE 802.3, as zlib computes it): librdkafka's `consistent`
/// partitioners hash keys with it.
pub fn crc32(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut bit = 0;
            while bit < 8 {
                c = if c & 1 == 1 {
                    0xedb8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
                bit += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !data.iter().fold(!0u32, |c, b| {
        TABLE[((c ^ u32::from(*b)) & 0xff) as usize] ^ (c >> 8)
    })
}

/// How the producers of a topic chose a keyed record's partition. The engine
/// must know it to tell which task (and so which instance) holds a key's
/// state: producers that disagree put the same key in different partitions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyPartitioner {
    /// murmur2 of the key, made positive, modulo the partition count: the
    /// Java clients' default (and so Kafka Streams'), librdkafka's
    /// `murmur2_random`, and what the engine's own producers use.
    #[default]
    Murmur2,
    /// CRC-32 of the key modulo the partition count: librdkafka's default
    /// (`consistent_random`), so most non-Java clients' (Python, Go, .NET,
    /// Node).
    Crc32,
}

impl KeyPartitioner {
    /// The partition of `key` among `partitions`.
    pub fn partition(self, key: &[u8], partitions: i32) -> i32 {
        let n = partitions.max(1);
        match self {
            KeyPartitioner::Murmur2 => key_partition(key, n),
            KeyPartitioner::Crc32 => (crc32(key) % n as u32) as i32,
        }
    }
}

/// Partition counts of the topics tasks write to, looked up once per topic.
#[derive(Default)]
pub(crate) struct PartitionCounts {
    counts: Mutex<HashMap<String, Option<i32>>>,
}

impl PartitionCounts {
    /// The topic's partition count (`None` when the broker would not say).
    fn count(&self, topic: &str, producer: &TrackedProducer) -> Option<i32> {
        if let Some(c) = self.counts.lock().get(topic) {
            return *c;
        }
        let count = producer
            .client()
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .ok()
            .and_then(|md| {
                md.topics()
                    .iter()
                    .find(|t| t.name() == topic && t.error().is_none())
                    .map(|t| t.partitions().len() as i32)
            })
            .filter(|n| *n > 0);
        // A failed lookup is not remembered: the next commit asks again.
        if count.is_some() {
            self.counts.lock().insert(topic.to_string(), count);
        }
        count
    }

    /// Gives each keyed record without a partition the partition its key
    /// hashes to, and returns every partition the records write (`None`: any
    /// partition of the topic, for a record whose partition is not known
    /// before it is sent).
    pub(crate) fn place(
        &self,
        records: &mut [OutputRecord],
        producer: &TrackedProducer,
    ) -> Written {
        let mut written = Written::new();
        for r in records.iter_mut() {
            if r.partition.is_none() {
                if let Some(key) = &r.key {
                    if let Some(n) = self.count(&r.topic, producer) {
                        r.partition = Some(key_partition(key, n));
                    }
                }
            }
            match written.get_mut(&r.topic) {
                Some(ps) => {
                    ps.insert(r.partition);
                }
                None => {
                    written.insert(r.topic.clone(), HashSet::from([r.partition]));
                }
            }
        }
        written
    }
}

/// The partitions a transaction writes, by topic (`None`: any partition).
pub(crate) type Written = HashMap<String, HashSet<Option<i32>>>;

/// Whether two transactions write a partition in common.
pub(crate) fn overlap(a: &Written, b: &Written) -> bool {
    a.iter().any(|(topic, ps)| {
        b.get(topic).is_some_and(|qs| {
            ps.contains(&None) || qs.contains(&None) || ps.iter().any(|p| qs.contains(p))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_matches_the_java_clients() {
        // Kafka's own test vectors (UtilsTest.testMurmur2).
        let cases: [(&[u8], i32); 6] = [
            (b"21", -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (
                b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            (b"abc", 479_470_107),
        ];
        for (data, want) in cases {
            assert_eq!(murmur2(data), want, "{}", String::from_utf8_lossy(data));
        }
    }

    /// librdkafka's partitioner test (tests/0048-partitioner.c): the keys
    /// and the hashes it expects from its `consistent` (CRC-32) and `murmur2`
    /// partitioners.
    const LIBRDKAFKA_KEYS: [(&[u8], u32, u32); 4] = [
        (b"", 0x0, 0x106e_08d9),
        (b"23456", 0xb1b4_51d7, 0x058d_780f),
        (
            b"this is another string with more length to it perhaps",
            0xb015_0df7,
            0x4f77_03da,
        ),
        (b"hejsan", 0xd077_037e, 0x5ec1_9395),
    ];

    #[test]
    fn crc32_matches_librdkafka_and_zlib() {
        for (key, crc, _) in LIBRDKAFKA_KEYS {
            assert_eq!(crc32(key), crc, "{}", String::from_utf8_lossy(key));
        }
        // The standard check value of CRC-32/ISO-HDLC.
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
    }

    #[test]
    fn partitioners_pick_what_the_clients_pick() {
        for parts in [7, 17] {
            for (key, crc, murmur) in LIBRDKAFKA_KEYS {
                let name = String::from_utf8_lossy(key);
                assert_eq!(
                    KeyPartitioner::Crc32.partition(key, parts),
                    (crc % parts as u32) as i32,
                    "crc32 {name} over {parts}"
                );
                assert_eq!(
                    KeyPartitioner::Murmur2.partition(key, parts),
                    (murmur % parts as u32) as i32,
                    "murmur2 {name} over {parts}"
                );
            }
        }
        // Kafka's UtilsTest: murmur2("21") is negative; the partitioner
        // masks the sign bit (Utils.toPositive) before the modulo.
        assert_eq!(murmur2(b"21"), -973_932_308);
        assert_eq!(
            KeyPartitioner::Murmur2.partition(b"21", 1000),
            (-973_932_308i32 & 0x7fff_ffff) % 1000
        );
        assert_eq!(
            KeyPartitioner::Crc32.partition(b"x", 0),
            0,
            "no division by zero"
        );
    }

    #[test]
    fn overlap_treats_an_unknown_partition_as_any() {
        let set = |v: &[(&str, Option<i32>)]| -> Written {
            let mut w = Written::new();
            for (t, p) in v {
                w.entry(t.to_string()).or_default().insert(*p);
            }
            w
        };
        let a = set(&[("out", Some(0)), ("log", Some(0))]);
        assert!(!overlap(&a, &set(&[("out", Some(1)), ("log", Some(1))])));
        assert!(overlap(&a, &set(&[("out", Some(0))])));
        assert!(overlap(&a, &set(&[("out", None)])));
        assert!(!overlap(&a, &set(&[("other", None)])));
    }
}
