//! Sluice: a stateful stream processor for LLM workloads on Kafka.
//!
//! The engine lives in the `sluice-topology` and `sluice-state` crates; this crate holds
//! everything specific to LLM workloads, built on their public API, plus the command-line
//! tools.

pub mod accounting;
pub mod app;
pub mod config;
pub mod demo;
pub mod dlq;
pub mod envelope;
pub mod error;
pub mod examples;
#[doc(hidden)]
pub mod fuzzing;
pub mod gateway;
pub mod http;
pub mod kafka;
pub mod llm;
pub mod metrics_catalog;
pub mod operator;
pub mod pipeline;
pub mod route;
pub mod sim;
pub mod trace;
pub mod usage;
pub mod work;
