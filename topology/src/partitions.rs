//! Where a keyed record lands: the hashes of the Java clients (murmur2, also
//! the engine's producers' `partitioner=murmur2_random`) and of librdkafka's
//! default (CRC-32), over a topic's partition count.

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
}
