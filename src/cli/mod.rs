//! The `sluice` subcommands, one room each: `run` (the pipeline), `gateway`
//! (the HTTP task gateway), `dlq`, `demo`, `usage`, and `example` (engine
//! example topologies the engine's tests run); `metrics_catalog` lists every
//! metric family they register.

pub mod demo;
pub mod dlq;
pub mod example;
pub mod gateway;
pub mod metrics_catalog;
pub mod run;
pub mod usage;
