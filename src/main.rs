//! The `sluice` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// A stateful stream processor for LLM workloads on Kafka.
#[derive(Parser, Debug)]
#[command(name = "sluice", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs the LLM task pipeline.
    Run(ConfigArg),
    /// Runs the HTTP task gateway: tasks submitted over HTTP, their status
    /// and results read back (its own stream application, beside `run`).
    Gateway(ConfigArg),
    /// Prints the hashed form of an API token (`sha256:<hex>`) for a tokens
    /// file, which then holds no token in clear; the token is read from
    /// standard input.
    TokenHash,
    /// Manages the topics a configuration uses.
    Topics {
        #[command(subcommand)]
        command: TopicsCommand,
    },
    /// Prints a tenant's current usage windows, asked of any running
    /// instance (it forwards to the one holding the tenant).
    Usage(sluice::cli::usage::UsageArgs),
    /// Inspects and replays dead letters.
    Dlq(sluice::cli::dlq::DlqArgs),
    /// Runs the demo on a local broker with the simulated provider.
    Demo(sluice::cli::demo::DemoArgs),
    /// Runs the simulated OpenAI-compatible provider.
    SimProvider(sluice::sim::SimArgs),
    /// Runs an engine example topology (used by the engine's tests).
    #[command(hide = true)]
    Example(sluice::cli::example::ExampleArgs),
}

#[derive(Subcommand, Debug)]
enum TopicsCommand {
    /// Creates the task, dead-letter and results topics.
    Create(ConfigArg),
}

#[derive(Args, Debug)]
struct ConfigArg {
    /// The TOML configuration file (SLUICE_<SECTION>__<KEY> variables override it).
    #[arg(long, short)]
    config: PathBuf,
}

/// The allocator: record processing allocates many small, short-lived
/// buffers, which mimalloc serves several times faster than the system's.
/// It replaces `malloc` process-wide (`override`), so librdkafka's
/// per-message allocations (a consumed message, its header list, a produced
/// record) and RocksDB's are served by it too: the same exactly-once runs
/// took a fifth to a third less CPU (docs/benchmarks.md, 2026-12-05;
/// tests/cli.rs checks libc's `malloc` and `free` bind to it). Built without
/// transparent huge pages (`no_thp`): with them, the first touch of any of
/// its memory zeroed 2 MiB, 15 % of the operator's CPU.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit code for an invalid configuration.
const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG").unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,sluice=info,sluice_topology=info")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sluice: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result: Result<(), (u8, String)> = runtime.block_on(async move {
        let fail = |e: anyhow::Error| (1, format!("{e:#}"));
        match cli.command {
            Command::Run(a) => sluice::cli::run::run(&a.config).await.map_err(|e| match e {
                sluice::cli::run::RunError::Config(c) => (EXIT_CONFIG, c.to_string()),
                other => fail(other.into()),
            }),
            Command::Gateway(a) => {
                sluice::cli::gateway::run(&a.config)
                    .await
                    .map_err(|e| match e {
                        sluice::cli::run::RunError::Config(c) => (EXIT_CONFIG, c.to_string()),
                        other => fail(other.into()),
                    })
            }
            Command::TokenHash => {
                let mut token = String::new();
                std::io::stdin()
                    .read_line(&mut token)
                    .map_err(|e| fail(e.into()))?;
                let token = token.trim();
                if token.len() < 16 {
                    return Err((EXIT_CONFIG, "a token needs at least 16 characters".into()));
                }
                println!("{}", sluice::http::auth::hashed(token));
                Ok(())
            }
            Command::Topics {
                command: TopicsCommand::Create(a),
            } => {
                let cfg = sluice::config::Config::load(&a.config)
                    .map_err(|c| (EXIT_CONFIG, c.to_string()))?;
                let created =
                    tokio::task::spawn_blocking(move || sluice::cli::run::create_topics(&cfg))
                        .await
                        .map_err(|e| fail(e.into()))?
                        .map_err(|e| fail(e.into()))?;
                for t in created {
                    println!("{t}");
                }
                Ok(())
            }
            Command::Usage(args) => sluice::cli::usage::run_cli(args)
                .await
                .map_err(|e| fail(e.into())),
            Command::Dlq(args) => sluice::cli::dlq::run(args).await.map_err(|e| match e {
                sluice::cli::dlq::DlqError::Config(c) => (EXIT_CONFIG, c.to_string()),
                sluice::cli::dlq::DlqError::Usage(u) => (EXIT_CONFIG, u),
                other => fail(other.into()),
            }),
            Command::Demo(args) => sluice::cli::demo::run(args).await.map_err(fail),
            Command::SimProvider(args) => sluice::sim::run(args).await.map_err(|e| match e {
                sluice::sim::SimError::Config(c) => (EXIT_CONFIG, c.to_string()),
                other => fail(other.into()),
            }),
            Command::Example(args) => sluice::cli::example::run_example(args).await.map_err(fail),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, message)) => {
            eprintln!("sluice: {message}");
            ExitCode::from(code)
        }
    }
}
