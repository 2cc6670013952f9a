//! The simulated OpenAI-compatible LLM provider (`sluice sim-provider`).
//!
//! A real HTTP server, not a mock: the demo, the integration tests and the benchmarks talk to
//! it over a socket exactly as they would talk to OpenAI, Groq, vLLM or Ollama. It offers:
//!
//! - `POST /v1/chat/completions` with deterministic answers: the output depends only on the
//!   request (the task and micro-batch prompt formats are described in `prompt.rs`), and token usage follows
//!   fixed arithmetic (one token per four characters, four per message), with
//!   `cached_tokens` for system prompts seen before;
//! - `GET /v1/models`;
//! - real rate limits (requests/second with burst, requests/minute, tokens/minute) answered
//!   with 429s and, optionally, the OpenAI `x-ratelimit-*` / `Retry-After` headers;
//! - a queueing mode: a fixed number of slots, further requests waiting in arrival order (how
//!   llama.cpp, vLLM and Ollama behave under load: no 429s, growing latency);
//! - latency distributions (plus generation time per output token) and fault injection
//!   (5xx, hangs, malformed bodies, content-policy rejections, context-length rejections in
//!   OpenAI's, vLLM's or llama.cpp's shape, forced statuses, periodic 429 storms), all
//!   changeable at run time;
//! - answers as real servers give them: `finish_reason = length` at the cap, refusals,
//!   missing usage, `<think>` prefixes, and a reasoning-model mode per model (refuses
//!   `temperature`, spends hidden reasoning tokens of the cap and reports them);
//! - an admin API: `GET /admin/stats`, `GET|PUT /admin/config`, `POST /admin/reset`,
//!   `GET /admin/calls?contains=TEXT`, `GET /healthz`.
//!
//! Start it in process with [`start`], or as a command with [`run`].

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

mod config;
mod limits;
pub(crate) mod prompt;
mod server;
mod stats;

#[cfg(test)]
mod tests;

pub use config::{
    Burst429, ConfigError, ContextErrorStyle, Latency, LimitScope, ModelOverrides, SimConfig,
};
pub use prompt::fnv1a64;
pub use stats::{InjectedCounts, SimStats};

use server::SimState;

/// How long [`SimHandle::shutdown`] waits for in-flight requests before aborting the server.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A running simulated provider. Dropping the handle stops the server (without waiting).
pub struct SimHandle {
    addr: SocketAddr,
    state: Arc<SimState>,
    shutdown: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for SimHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimHandle")
            .field("addr", &self.addr)
            .finish()
    }
}

/// Why the simulator cannot start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Its configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// It cannot listen.
    #[error("simulated provider cannot listen on {addr}: {source}")]
    Listen {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// Binds `addr` and serves the simulator on the current tokio runtime; returns once the
/// socket is listening. Use port 0 to pick a free port ([`SimHandle::local_addr`]).
pub async fn start(config: SimConfig, addr: SocketAddr) -> Result<SimHandle, SimError> {
    config.validate()?;
    let listen = |source| SimError::Listen { addr, source };
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(listen)?;
    let local_addr = listener.local_addr().map_err(listen)?;
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let state = Arc::new(SimState::new(config, shutdown_rx.clone()));
    let app = server::router(state.clone());
    let mut stop = shutdown_rx;
    let task = tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                // Also completes when the handle is dropped (sender gone).
                let _ = stop.wait_for(|stop| *stop).await;
            })
            .await;
        if let Err(error) = served {
            tracing::error!(%error, "simulated provider stopped with an error");
        }
    });
    Ok(SimHandle {
        addr: local_addr,
        state,
        shutdown: shutdown_tx,
        task: Some(task),
    })
}

impl SimHandle {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://HOST:PORT` (a wildcard listen address is reported as loopback).
    pub fn root_url(&self) -> String {
        let ip = match self.addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        format!("http://{}", SocketAddr::new(ip, self.addr.port()))
    }

    /// The OpenAI base URL clients use: `http://HOST:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("{}/v1", self.root_url())
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> SimStats {
        self.state.stats()
    }

    /// Zeroes the counters, the call index and the prompt cache (like `POST /admin/reset`).
    pub fn reset_stats(&self) {
        self.state.reset();
    }

    /// Successful (200) calls whose user message contained `text`.
    pub fn calls_containing(&self, text: &str) -> u64 {
        self.state.calls_containing(text).0
    }

    /// The configuration in force.
    pub fn config(&self) -> SimConfig {
        (*self.state.config()).clone()
    }

    /// Replaces the configuration; it applies to the next request.
    pub fn set_config(&self, config: SimConfig) -> Result<(), ConfigError> {
        self.state.set_config(config)
    }

    /// Changes the configuration in place, e.g. `sim.update(|c| c.rps = Some(25.0))`.
    pub fn update(&self, change: impl FnOnce(&mut SimConfig)) -> Result<(), ConfigError> {
        let mut config = self.config();
        change(&mut config);
        self.set_config(config)
    }

    /// Stops accepting requests, releases held (hanging) requests, and waits for the server
    /// to finish (aborting it after a grace period).
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        if let Some(mut task) = self.task.take() {
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut task)
                .await
                .is_err()
            {
                task.abort();
            }
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

/// Command-line options of `sluice sim-provider`. Flags override the `--config` file.
#[derive(Clone, Debug, clap::Args)]
pub struct SimArgs {
    /// Address to listen on.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8089")]
    pub listen: SocketAddr,

    /// TOML file with the simulator configuration (see `SimConfig`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Fixed latency of every answer, in milliseconds.
    #[arg(long, value_name = "MS")]
    pub latency_ms: Option<u64>,

    /// Queueing mode: serve this many requests at once, the others wait in arrival order
    /// (like llama.cpp's slots).
    #[arg(long)]
    pub slots: Option<u32>,

    /// Requests per second (per model unless the config says `limit_scope = "global"`).
    #[arg(long)]
    pub rps: Option<f64>,

    /// Burst size of the per-second limit.
    #[arg(long)]
    pub burst: Option<u32>,

    /// Requests per minute.
    #[arg(long)]
    pub rpm: Option<u32>,

    /// Tokens per minute.
    #[arg(long)]
    pub tpm: Option<u64>,

    /// Fraction (0..=1) of requests answered with a 5xx error.
    #[arg(long, value_name = "FRACTION")]
    pub error_rate: Option<f64>,

    /// Do not send `x-ratelimit-*` and `Retry-After` headers (like vLLM or Ollama).
    #[arg(long)]
    pub no_rate_limit_headers: bool,

    /// Comma-separated models to serve; others get 404 (default: any model).
    #[arg(long, value_delimiter = ',')]
    pub models: Option<Vec<String>>,

    /// An accepted API key (repeatable; default: any key). Prefer `api_keys` in the config
    /// file, which stays out of process listings.
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_keys: Vec<String>,

    /// Seed of the latency sampler.
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SimArgs {
    /// The configuration these options describe: the file (or defaults), then the flags.
    pub fn to_config(&self) -> Result<SimConfig, ConfigError> {
        let mut config = match &self.config {
            Some(path) => SimConfig::from_toml_file(path)?,
            None => SimConfig::default(),
        };
        if let Some(ms) = self.latency_ms {
            config.latency = Latency::Fixed { ms };
        }
        if self.slots.is_some() {
            config.slots = self.slots;
        }
        if self.rps.is_some() {
            config.rps = self.rps;
        }
        if self.burst.is_some() {
            config.burst = self.burst;
        }
        if self.rpm.is_some() {
            config.rpm = self.rpm;
        }
        if self.tpm.is_some() {
            config.tpm = self.tpm;
        }
        if let Some(rate) = self.error_rate {
            config.error_rate = rate;
        }
        if self.no_rate_limit_headers {
            config.rate_limit_headers = false;
        }
        if self.models.is_some() {
            config.models.clone_from(&self.models);
        }
        if !self.api_keys.is_empty() {
            config.api_keys.clone_from(&self.api_keys);
        }
        if let Some(seed) = self.seed {
            config.seed = seed;
        }
        config.validate()?;
        Ok(config)
    }
}

/// Runs `sluice sim-provider`: serves until Ctrl-C (or SIGTERM).
pub async fn run(args: SimArgs) -> Result<(), SimError> {
    let config = args.to_config()?;
    let handle = start(config, args.listen).await?;
    tracing::info!(base_url = %handle.base_url(), "simulated provider listening");
    wait_for_stop_signal().await;
    tracing::info!("simulated provider stopping");
    handle.shutdown().await;
    Ok(())
}

async fn wait_for_stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
