//! A Kafka Streams-style stream processing engine: a DSL to describe topologies
//! ([`StreamBuilder`]), a processor API for custom (also async) operators, an
//! in-process [`TopologyTestDriver`], and a Kafka runtime ([`runtime::StreamsApp`])
//! with at-least-once and exactly-once processing over RocksDB state stores
//! backed by changelog topics.
//!
//! The engine knows nothing about what its operators do; applications build on
//! its public API.

mod codec;
mod commit;
mod context;
mod derived;
mod dsl;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod guarantee;
mod node;
mod offsets;
mod partitions;
mod processor;
mod record;
pub mod redact;
pub mod runtime;
mod task;
mod test_driver;
mod topology;
mod window;

pub use codec::{
    from_bincode, to_bincode, BincodeCodec, BytesCodec, Codec, CodecError, JsonCodec, StringCodec,
    UnitCodec,
};
pub use context::{TaskCounters, TaskId};
pub use dsl::{KGroupedStream, KStream, KTable, SourceOptions, StreamBuilder, TimeWindowedKStream};
pub use error::{ProcessError, TopologyError};
pub use guarantee::Guarantee;
pub use node::{Data, Punctuation};
pub use offsets::{InFlight, OffsetTracker, MAX_IN_FLIGHT_PER_PARTITION};
pub use partitions::{crc32, key_partition, murmur2, KeyPartitioner};
pub use processor::{KvStore, Processor, ProcessorContext, WindowStore};
pub use record::{header, message_headers, Headers, OutputRecord, RawRecord, Record};
pub use sluice_state::{Position, RocksSettings};
pub use task::{dlq_headers, origin_headers};
pub use test_driver::{CommitStep, TopologyTestDriver};
pub use topology::source_id;
pub use topology::{SubTopology, Topology};
pub use window::{EmitMode, TimeWindows, Window, Windowed};
