//! The `sluice` command line.

use clap::{Parser, Subcommand};

/// A stateful stream processor for LLM workloads on Kafka.
#[derive(Parser, Debug)]
#[command(name = "sluice", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs the demo on a local broker with the simulated provider.
    Demo(sluice::demo::DemoArgs),
    /// Runs the simulated OpenAI-compatible provider.
    SimProvider(sluice::sim::SimArgs),
    /// Runs an engine example topology (used by the engine's tests).
    #[command(hide = true)]
    Example(sluice::examples::ExampleArgs),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,sluice=info,sluice_topology=info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sluice: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Demo(args) => sluice::demo::run(args).await,
            Command::SimProvider(args) => sluice::sim::run(args).await,
            Command::Example(args) => sluice::examples::run_example(args).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
