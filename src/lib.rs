//! Sluice: a stateful stream processor for LLM workloads on Kafka.
//!
//! The engine lives in the `sluice-topology` and `sluice-state` crates; this crate holds
//! everything specific to LLM workloads, built on their public API, in wings:
//!
//! - [`steps`]: the pipeline's DSL steps in the order a task takes them (source, route,
//!   delay, batch, invoke_llm, account, results), each with its configuration section;
//! - [`llm`]: the provider client (limiter, breaker, retries, transport);
//! - [`envelope`]: the JSON records on the external topics;
//! - [`http`]: the HTTP listener, its auth, forwarding between instances, usage queries;
//! - [`cli`]: one room per subcommand (`run`, `gateway`, `dlq`, `demo`, `usage`, …);
//! - [`sim`]: the simulated provider;
//!
//! and beside them [`config`] (composes the sections), [`kafka`] (client helpers for the
//! command-line tools), [`trace`] (result spans) and [`error`].

pub mod cli;
pub mod config;
pub mod envelope;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod kafka;
pub mod llm;
pub mod sim;
pub mod steps;
pub mod trace;
