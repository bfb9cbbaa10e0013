//! The `prefill-router-model` command line: `check` runs the checker and prints a verdict per
//! property (with a readable counterexample trace), `explore` serves stateright's Explorer.

use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use stateright::{Checker, Expectation, Model};

use crate::model::{Config, RouterModel};
use crate::mutants::{
    IgnoreAdmission, KeepRetryOnRetarget, NoRetry, NoStalenessCheck, RetireAsDiscard,
    RetireOnClear, ReuseForOtherTarget, ReuseRetired, SecondBuildInFlight,
};
use crate::subject::Subject;
use crate::{trace, Real};

/// What went wrong on the command line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// The arguments do not parse.
    #[error("{0}\n\n{USAGE}")]
    Usage(String),
    /// The configuration is out of the model's bounds.
    #[error("bad configuration: {0}")]
    Config(String),
    /// The Explorer may only listen on loopback.
    #[error("refusing to serve on {0}: the Explorer listens on loopback addresses only")]
    NotLoopback(SocketAddr),
    /// Writing the report failed.
    #[error("cannot write the report: {0}")]
    Io(#[from] std::io::Error),
}

/// Usage text.
pub const USAGE: &str = "\
usage:
  prefill-router-model check   [--retargets N] [--failures F] [--requests R] [--targets T]
                               [--admission-changes A] [--no-shutdown] [--threads N] [--dfs]
                               [--mutant NAME]
  prefill-router-model explore [--addr 127.0.0.1:3000] [the same model options]

defaults: the standard configuration (targets {None, A, B}, 4 retargets, 2 failures,
2 requests, shutdown possible, 1 admission change). Mutants: real (default), no-staleness-check,
reuse-for-other-target, keep-retry-on-retarget, second-build-in-flight, retire-on-clear,
retire-as-discard, reuse-retired, no-retry, ignore-admission.";

/// A parsed command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Command {
    /// `check` or `explore`.
    pub verb: Verb,
    /// The model bounds.
    pub config: Config,
    /// Checker threads (`check` only).
    pub threads: usize,
    /// Depth-first instead of breadth-first (`check` only).
    pub dfs: bool,
    /// Which machine to check (`real` or a mutant's name).
    pub subject: String,
    /// Where the Explorer listens (`explore` only).
    pub addr: SocketAddr,
}

/// The sub-command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// Exhaustive check with verdicts.
    Check,
    /// Serve the Explorer.
    Explore,
}

/// Parses the arguments after the program name.
pub fn parse(args: &[String]) -> Result<Command, CliError> {
    let usage = |m: String| CliError::Usage(m);
    let mut it = args.iter();
    let verb = match it.next().map(String::as_str) {
        Some("check") => Verb::Check,
        Some("explore") => Verb::Explore,
        Some(other) => return Err(usage(format!("unknown command {other:?}"))),
        None => return Err(usage("missing command".into())),
    };
    let mut cmd = Command {
        verb,
        config: Config::STANDARD,
        threads: 1,
        dfs: false,
        subject: Real::NAME.to_string(),
        addr: SocketAddr::from(([127, 0, 0, 1], 3000)),
    };
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| usage(format!("{flag} needs a value")))
        };
        let small = |v: String| {
            v.parse::<u8>()
                .map_err(|_| usage(format!("{flag}: {v:?} is not a number 0..=255")))
        };
        match flag.as_str() {
            "--retargets" => cmd.config.retargets = small(value()?)?,
            "--failures" => cmd.config.failures = small(value()?)?,
            "--requests" => cmd.config.requests = small(value()?)?,
            "--targets" => cmd.config.targets = small(value()?)?,
            "--admission-changes" => cmd.config.admission_changes = small(value()?)?,
            "--no-shutdown" => cmd.config.shutdown = false,
            "--dfs" => cmd.dfs = true,
            "--threads" => {
                cmd.threads = usize::from(small(value()?)?).max(1);
            }
            "--mutant" => cmd.subject = value()?,
            "--addr" => {
                let v = value()?;
                cmd.addr = v.parse().map_err(|_| {
                    usage(format!(
                        "--addr: {v:?} is not an address like 127.0.0.1:3000"
                    ))
                })?;
            }
            other => return Err(usage(format!("unknown option {other:?}"))),
        }
    }
    cmd.config.validate().map_err(CliError::Config)?;
    Ok(cmd)
}

/// Runs a parsed command, writing the report to `out`. Returns the process exit code: 0 when
/// every property has its expected verdict, 1 otherwise. `explore` only returns on error.
pub fn run(cmd: &Command, out: &mut dyn Write) -> Result<i32, CliError> {
    macro_rules! dispatch {
        ($($ty:ty),*) => {
            $(if cmd.subject == <$ty as Subject>::NAME { return go::<$ty>(cmd, out); })*
        };
    }
    dispatch!(
        Real,
        NoStalenessCheck,
        ReuseForOtherTarget,
        KeepRetryOnRetarget,
        SecondBuildInFlight,
        RetireOnClear,
        RetireAsDiscard,
        ReuseRetired,
        NoRetry,
        IgnoreAdmission
    );
    Err(CliError::Usage(format!("unknown mutant {:?}", cmd.subject)))
}

fn go<S: Subject>(cmd: &Command, out: &mut dyn Write) -> Result<i32, CliError> {
    let model = RouterModel::<S>::new(cmd.config);
    match cmd.verb {
        Verb::Check => check(model, cmd, out),
        Verb::Explore => {
            if !cmd.addr.ip().is_loopback() {
                return Err(CliError::NotLoopback(cmd.addr));
            }
            writeln!(
                out,
                "serving the stateright Explorer for {} ({:?}) on http://{}/ (Ctrl-C to stop)",
                S::NAME,
                cmd.config,
                cmd.addr
            )?;
            out.flush()?;
            // Blocks for good: the Explorer joins its own HTTP thread.
            let _ = model.checker().serve(cmd.addr);
            Ok(0)
        }
    }
}

fn check<S: Subject>(
    model: RouterModel<S>,
    cmd: &Command,
    out: &mut dyn Write,
) -> Result<i32, CliError> {
    writeln!(out, "checking {} with {:?}", S::NAME, cmd.config)?;
    let started = Instant::now();
    let builder = model.checker().threads(cmd.threads);
    let checker = if cmd.dfs {
        Box::new(builder.spawn_dfs()) as Box<dyn Checker<RouterModel<S>>>
    } else {
        Box::new(builder.spawn_bfs())
    };
    // Progress on stderr (the report on `out` stays clean for scripts).
    let mut last_print = Instant::now();
    while !checker.is_done() {
        std::thread::sleep(Duration::from_millis(50));
        if last_print.elapsed() >= Duration::from_secs(1) {
            last_print = Instant::now();
            eprintln!("  {}", progress(&*checker, started.elapsed()));
        }
    }
    let mut checker = checker;
    for h in checker.handles() {
        // A panicking checker thread is a bug in the model: report it, do not hide it.
        if h.join().is_err() {
            writeln!(out, "a checker thread panicked")?;
            return Ok(1);
        }
    }
    let elapsed = started.elapsed();
    writeln!(out, "done: {}", progress(&*checker, elapsed))?;

    let mut failures = 0;
    for property in model_properties::<S>() {
        let discovery = checker.discovery(property.name);
        let (verdict, show) = match (&property.expectation, &discovery) {
            (Expectation::Always | Expectation::Eventually, None) => ("holds", false),
            (Expectation::Always | Expectation::Eventually, Some(_)) => {
                ("FAILS, counterexample:", true)
            }
            (Expectation::Sometimes, Some(_)) => ("reached (example found)", false),
            (Expectation::Sometimes, None) => ("NEVER REACHED (vacuous?)", false),
        };
        if verdict.starts_with("FAILS") || verdict.starts_with("NEVER") {
            failures += 1;
        }
        writeln!(
            out,
            "{:<11} {}: {verdict}",
            kind(&property.expectation),
            property.name
        )?;
        if let (true, Some(path)) = (show, discovery) {
            let found = path.into_actions();
            // Re-run for the shortest trace: a person reads it, so fewer steps matter.
            let steps = checker
                .model()
                .shortest_discovery(property.name, found.len())
                .unwrap_or(found);
            write!(out, "{}", trace::render(checker.model(), &steps))?;
        }
    }
    writeln!(
        out,
        "{} of {} properties as expected",
        model_properties::<S>().len() - failures,
        model_properties::<S>().len()
    )?;
    Ok(if failures == 0 { 0 } else { 1 })
}

fn model_properties<S: Subject>() -> Vec<stateright::Property<RouterModel<S>>> {
    crate::properties::all::<S>()
}

fn kind(e: &Expectation) -> &'static str {
    match e {
        Expectation::Always => "always",
        Expectation::Eventually => "eventually",
        Expectation::Sometimes => "sometimes",
    }
}

fn progress<M: Model>(c: &dyn Checker<M>, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64().max(1e-9);
    format!(
        "states={} unique={} ({:.0} unique states/s) depth={} in {:.2} s",
        c.state_count(),
        c.unique_state_count(),
        c.unique_state_count() as f64 / secs,
        c.max_depth(),
        secs
    )
}
