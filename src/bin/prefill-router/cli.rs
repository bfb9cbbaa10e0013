//! Hand-rolled argument parsing: one enum arm per subcommand.

use std::process::ExitCode;

use crate::{demo, replay, simulate};

/// Top-level usage.
pub const USAGE: &str = "\
usage: prefill-router <command> [options]

commands:
  demo     run the prefill-router story on loopback workers (see `prefill-router demo --help`)
  simulate run the deterministic simulator (see `prefill-router simulate --help`)
  replay   replay a request trace in virtual time, per routing policy (see `prefill-router replay --help`)
  help     show this text";

/// Why parsing stopped.
pub enum CliError {
    /// Help was asked for: print this and exit 0.
    Help(String),
    /// Bad arguments: print this with the usage and exit 2.
    Usage(String),
}

/// A parsed command line.
pub enum Command {
    /// `prefill-router demo`.
    Demo(demo::DemoOptions),
    /// `prefill-router simulate`.
    Simulate(simulate::SimulateOptions),
    /// `prefill-router replay`.
    Replay(replay::ReplayOptions),
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
            "help" | "--help" | "-h" => Err(CliError::Help(USAGE.to_owned())),
            other => Err(CliError::Usage(format!("unknown command `{other}`"))),
        }
    }

    /// Run it.
    pub async fn run(self) -> ExitCode {
        match self {
            Command::Demo(options) => demo::run(options).await,
            Command::Simulate(options) => simulate::run(options).await,
            Command::Replay(options) => replay::run(options).await,
        }
    }
}

/// Options common to the subcommands' parsers: iterate `--flag [value]` pairs.
pub struct Flags<'a> {
    args: std::slice::Iter<'a, String>,
}

impl<'a> Flags<'a> {
    /// Over `args`.
    pub fn new(args: &'a [String]) -> Self {
        Flags { args: args.iter() }
    }

    /// The next flag, if any.
    pub fn next_flag(&mut self) -> Option<&'a str> {
        self.args.next().map(String::as_str)
    }

    /// The value of `flag`.
    pub fn value(&mut self, flag: &str) -> Result<&'a str, CliError> {
        self.args
            .next()
            .map(String::as_str)
            .ok_or_else(|| CliError::Usage(format!("{flag} needs a value")))
    }

    /// The value of `flag`, parsed.
    pub fn parsed<T: std::str::FromStr>(&mut self, flag: &str) -> Result<T, CliError> {
        let raw = self.value(flag)?;
        raw.parse()
            .map_err(|_| CliError::Usage(format!("invalid value `{raw}` for {flag}")))
    }
}
