//! The command table: one enum arm per subcommand, the top-level usage and `help`.

use std::process::ExitCode;

use crate::args::CliError;
use crate::{demo, register, replay, serve, simulate, worker};

/// Top-level usage.
pub const USAGE: &str = "\
usage: prefill-router <command> [options]

commands:
  demo     run the prefill-router story on loopback workers (see `prefill-router demo --help`)
  simulate run the deterministic simulator (see `prefill-router simulate --help`)
  replay   replay a request trace in virtual time, per routing policy (see `prefill-router replay --help`)
  serve    the OpenAI-compatible HTTP frontend (see `prefill-router serve --help`)
  worker   a mock prefill or decode worker process (see `prefill-router worker --help`)
  register a sidecar keeping one engine (vLLM) registered while it answers (see `prefill-router register --help`)
  help     show this text, or `help COMMAND` that command's (as `COMMAND --help` does)";

/// A parsed command line.
pub enum Command {
    /// `prefill-router demo`.
    Demo(demo::DemoOptions),
    /// `prefill-router simulate`.
    Simulate(simulate::SimulateOptions),
    /// `prefill-router replay`.
    Replay(replay::ReplayOptions),
    /// `prefill-router serve` (boxed: its options are the largest by far).
    Serve(Box<serve::ServeOptions>),
    /// `prefill-router worker`.
    Worker(worker::WorkerOptions),
    /// `prefill-router register`.
    Register(register::RegisterOptions),
}

impl Command {
    /// Parse the arguments after the program name.
    pub fn parse(args: &[String]) -> Result<Self, CliError> {
        let Some((name, rest)) = args.split_first() else {
            return Err(CliError::Help(USAGE.to_owned()));
        };
        match name.as_str() {
            "demo" => demo::DemoOptions::parse(rest).map(Command::Demo),
            "simulate" => simulate::SimulateOptions::parse(rest).map(Command::Simulate),
            "replay" => replay::ReplayOptions::parse(rest).map(Command::Replay),
            "serve" => serve::ServeOptions::parse(rest).map(|o| Command::Serve(Box::new(o))),
            "worker" => worker::WorkerOptions::parse(rest).map(Command::Worker),
            "register" => register::RegisterOptions::parse(rest).map(Command::Register),
            "help" | "--help" | "-h" => Err(CliError::Help(help_on(rest.first())?.to_owned())),
            other => Err(CliError::Usage(format!("unknown command `{other}`"))),
        }
    }

    /// Run it.
    pub async fn run(self) -> ExitCode {
        match self {
            Command::Demo(options) => demo::run(options).await,
            Command::Simulate(options) => simulate::run(options).await,
            Command::Replay(options) => replay::run(options).await,
            Command::Serve(options) => serve::run(*options).await,
            Command::Worker(options) => worker::run(options).await,
            Command::Register(options) => register::run(options).await,
        }
    }
}

/// The usage `help [COMMAND]` prints: the program's, or that command's.
fn help_on(topic: Option<&String>) -> Result<&'static str, CliError> {
    match topic.map(String::as_str) {
        None | Some("help" | "--help" | "-h") => Ok(USAGE),
        Some("demo") => Ok(demo::USAGE),
        Some("simulate") => Ok(simulate::USAGE),
        Some("replay") => Ok(replay::USAGE),
        Some("serve") => Ok(serve::USAGE),
        Some("worker") => Ok(worker::USAGE),
        Some("register") => Ok(register::USAGE),
        Some(other) => Err(CliError::Usage(format!("no help on `{other}`"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn help(line: &str) -> String {
        let args: Vec<String> = line.split_whitespace().map(String::from).collect();
        match Command::parse(&args) {
            Err(CliError::Help(text)) => text,
            Err(CliError::Usage(message)) => panic!("{line}: usage error {message}"),
            Ok(_) => panic!("{line}: parsed as a command to run"),
        }
    }

    #[test]
    fn every_subcommand_answers_help_with_its_usage() {
        for line in ["demo --help", "demo -h", "demo --quick --help", "help demo"] {
            assert!(
                help(line).starts_with("usage: prefill-router demo"),
                "{line}"
            );
        }
        for line in [
            "simulate --help",
            "simulate -h",
            "simulate --seed 3 --help",
            "help simulate",
        ] {
            assert!(
                help(line).starts_with("usage: prefill-router simulate"),
                "{line}"
            );
        }
        for line in ["replay --help", "replay -h", "help replay"] {
            assert!(
                help(line).starts_with("usage: prefill-router replay"),
                "{line}"
            );
        }
        for line in ["serve --help", "help serve"] {
            assert!(
                help(line).starts_with("usage: prefill-router serve"),
                "{line}"
            );
        }
        for line in ["worker --help", "help worker", "worker --role prefill -h"] {
            assert!(
                help(line).starts_with("usage: prefill-router worker"),
                "{line}"
            );
        }
        for line in [
            "register --help",
            "help register",
            "register --engine vllm -h",
        ] {
            assert!(
                help(line).starts_with("usage: prefill-router register"),
                "{line}"
            );
        }
        for line in ["", "help", "--help", "-h", "help --help", "help help"] {
            assert_eq!(help(line), USAGE, "{line:?}");
        }
    }

    #[test]
    fn help_on_an_unknown_command_is_a_usage_error() {
        let args = ["help".to_string(), "frobnicate".to_string()];
        assert!(matches!(Command::parse(&args), Err(CliError::Usage(_))));
    }
}
