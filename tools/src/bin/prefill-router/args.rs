//! What every subcommand's parser and runner share: the parse error, the flag iterator, and
//! the blocking-thread wrapper. A leaf module: it names no subcommand, so the subcommands
//! depend on it and [`commands`](crate::commands) depends on them, without a cycle.

use std::process::ExitCode;

/// Why parsing stopped.
pub enum CliError {
    /// Help was asked for: print this and exit 0.
    Help(String),
    /// Bad arguments: print this with the usage and exit 2.
    Usage(String),
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

/// Runs `job` on a blocking thread: the simulator and the replay build their own paused
/// runtimes, which cannot nest inside the CLI's.
pub async fn off_runtime(what: &str, job: impl FnOnce() -> ExitCode + Send + 'static) -> ExitCode {
    match tokio::task::spawn_blocking(job).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {what} task failed: {error}");
            ExitCode::FAILURE
        }
    }
}
