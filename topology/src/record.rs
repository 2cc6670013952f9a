//! Records flowing through a topology, and their encoded form.

/// Record headers: name and raw bytes, in order.
pub type Headers = Vec<(String, Vec<u8>)>;

/// A typed record inside a topology.
#[derive(Clone, Debug, PartialEq)]
pub struct Record<K, V> {
    /// The record key.
    pub key: K,
    /// The record value.
    pub value: V,
    /// Event time, ms since the epoch (the Kafka record timestamp at the source).
    pub timestamp: i64,
    /// Headers, carried from input to output (trace context and the like).
    pub headers: Headers,
}

impl<K, V> Record<K, V> {
    /// A record without headers.
    pub fn new(key: K, value: V, timestamp: i64) -> Self {
        Record {
            key,
            value,
            timestamp,
            headers: Vec::new(),
        }
    }

    /// Replaces key and value, keeping timestamp and headers.
    pub fn with<K2, V2>(self, key: K2, value: V2) -> Record<K2, V2> {
        Record {
            key,
            value,
            timestamp: self.timestamp,
            headers: self.headers,
        }
    }

    /// The first header with this name.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        header(&self.headers, name)
    }
}

/// The first header with this name in a header list.
pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a [u8]> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_slice())
}

/// The headers of a Kafka message (absent values as empty).
pub fn message_headers(msg: &impl rdkafka::Message) -> Headers {
    use rdkafka::message::Headers as _;
    msg.headers()
        .map(|h| {
            h.iter()
                .map(|h| {
                    (
                        h.key.to_string(),
                        h.value.map(<[u8]>::to_vec).unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A record as read from Kafka, before decoding.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RawRecord {
    /// Source topic.
    pub topic: String,
    /// Source partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Key bytes, if any.
    pub key: Option<Vec<u8>>,
    /// Value bytes, if any.
    pub value: Option<Vec<u8>>,
    /// Timestamp, ms.
    pub timestamp: i64,
    /// Headers.
    pub headers: Headers,
}

/// A record a task emits: where it goes and its encoded bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputRecord {
    /// Destination topic (full name).
    pub topic: String,
    /// Explicit partition, or `None` to partition by key.
    pub partition: Option<i32>,
    /// Key bytes.
    pub key: Option<Vec<u8>>,
    /// Value bytes.
    pub value: Option<Vec<u8>>,
    /// Timestamp, ms.
    pub timestamp: i64,
    /// Headers.
    pub headers: Headers,
}
