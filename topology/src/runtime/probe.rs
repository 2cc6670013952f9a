//! Whether the cluster answers: a thread asks for the metadata of one of
//! the application's source topics every [`PROBE_INTERVAL`], on a client of
//! its own, and records in [`AppStatus`] whether the last request was
//! answered within [`PROBE_TIMEOUT`]. A broker that is down (refused
//! connections) and one that stalls (connections open, nothing answered)
//! both fail the probe; the instance then reports itself not ready (and
//! says why) until a request is answered again. It never stops or restarts
//! anything: the engine's clients retry on their own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};

use super::config::StreamsConfig;
use super::kafka::{client_config, close_in_background};
use super::status::AppStatus;
use crate::error::TopologyError;

/// How often the cluster is asked.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(2);
/// How long an answer may take before the cluster counts as unreachable.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The probing thread; stopped (and joined) on drop.
pub(crate) struct ProbeThread {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ProbeThread {
    /// Starts probing for the metadata of `topic`.
    pub(crate) fn start(
        cfg: &StreamsConfig,
        topic: String,
        status: Arc<AppStatus>,
    ) -> Result<ProbeThread, TopologyError> {
        let consumer: BaseConsumer = client_config(cfg)
            // Failures are what this client is for: not worth a log line each.
            .set("log_level", "3")
            .create()
            .map_err(|e| TopologyError::Invalid(format!("cannot create the probe client: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let bootstrap = cfg.bootstrap_servers.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-probe".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    let asked = Instant::now();
                    match consumer.fetch_metadata(Some(&topic), PROBE_TIMEOUT) {
                        Ok(_) => {
                            if status.broker_fault().is_some() {
                                tracing::info!(%bootstrap, "the cluster answers again");
                            }
                            status.set_broker_fault(None);
                        }
                        Err(e) => {
                            if status.broker_fault().is_none() {
                                tracing::warn!(%bootstrap, error = %e, "the cluster does not answer");
                            }
                            status.set_broker_fault(Some(format!(
                                "the cluster at {bootstrap} did not answer a metadata request \
                                 within {} s: {e}",
                                PROBE_TIMEOUT.as_secs()
                            )));
                        }
                    }
                    let next = asked + PROBE_INTERVAL;
                    while !stopped.load(Ordering::Relaxed) && Instant::now() < next {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
                close_in_background(consumer);
            })
            .map_err(|e| TopologyError::Invalid(format!("cannot start the probe thread: {e}")))?;
        Ok(ProbeThread {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for ProbeThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
