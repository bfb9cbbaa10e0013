//! `prefill-router`: the command-line entry point.
//!
//! Subcommands (see `prefill-router help`):
//! - `demo`: a prefill pool appears, rolls to a new generation, loses a worker, vanishes and
//!   returns while traffic flows; then RoundRobin vs KV prefill routing on the same traffic.
//! - `simulate`: the deterministic simulator (`prefill_router_tools::sim`), `--seed N --steps K`.
//! - `replay`: a request trace in virtual time through the router, per routing policy.
//! - `serve`: the OpenAI-compatible HTTP frontend over a `PrefillHop` (`docs/frontend.md`).
//! - `worker`: a mock prefill or decode worker in its own process, registered in discovery.
//! - `register`: a sidecar keeping one engine (vLLM) registered while it answers.
//!
//! Adding a subcommand: a module with `USAGE`, an options struct with `parse(&[String])` and
//! `async fn run(options) -> ExitCode`, and one arm in [`Command`] (`commands.rs`); shared parsing helpers are in `args.rs`.

use std::process::ExitCode;

mod args;
mod commands;
mod demo;
mod events_check;
mod health;
mod register;
mod replay;
mod serve;
mod simulate;
mod static_engines;
mod store;
mod tls;
mod tokenizer_check;
mod worker;

use args::CliError;
use commands::Command;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = match Command::parse(&args) {
        Ok(command) => command,
        Err(CliError::Help(text)) => {
            println!("{text}");
            return ExitCode::SUCCESS;
        }
        Err(CliError::Usage(message)) => {
            eprintln!("error: {message}\n\n{}", commands::USAGE);
            return ExitCode::from(2);
        }
    };
    init_logging();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the tokio runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(command.run())
}

/// Logs to stderr; quiet by default so the demo's own output stays readable (`RUST_LOG=info`
/// shows the router's lifecycle and the resolved configuration at each activation).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
