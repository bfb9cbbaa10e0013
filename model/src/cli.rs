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
use crate::Real;

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
    /// The Explorer's address cannot be listened on (in use, or not this machine's).
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address asked for.
        addr: SocketAddr,
        /// Why binding it failed.
        source: std::io::Error,
    },
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
  prefill-router-model help [check|explore]     (or COMMAND --help)

defaults: the standard configuration (targets {None, A, B}, 4 retargets, 2 failures,
2 requests, shutdown possible, 1 admission change). Mutants: real (default), no-staleness-check,
reuse-for-other-target, keep-retry-on-retarget, second-build-in-flight, retire-on-clear,
retire-as-discard, reuse-retired, no-retry, ignore-admission.";

/// The model options `check` and `explore` share.
const MODEL_OPTIONS: &str = "\
model options (defaults: the standard configuration):
  --retargets N          controller calls, SetTarget or Shutdown (default 4)
  --failures F           build failures the world may inject (default 2)
  --requests R           concurrent requests (default 2)
  --targets T            real targets besides None, 1..=26 (default 2: A, B)
  --admission-changes A  retired bindings whose admission set may empty (default 1)
  --no-shutdown          the controller never shuts the hop down
  --mutant NAME          the machine to check: real (default), no-staleness-check,
                         reuse-for-other-target, keep-retry-on-retarget, second-build-in-flight,
                         retire-on-clear, retire-as-discard, reuse-retired, no-retry,
                         ignore-admission";

/// Usage of `check`.
pub fn check_usage() -> String {
    format!(
        "\
usage: prefill-router-model check [model options] [--threads N] [--dfs]

Checks every property exhaustively and prints one verdict each; a failing property gets its
shortest counterexample. Exit code 0 when every verdict is the expected one, 1 otherwise,
2 on bad arguments.

{MODEL_OPTIONS}
  --threads N            checker threads (default 1)
  --dfs                  depth-first instead of breadth-first"
    )
}

/// Usage of `explore`.
pub fn explore_usage() -> String {
    format!(
        "\
usage: prefill-router-model explore [--addr 127.0.0.1:3000] [model options]

Serves stateright's Explorer on a loopback address until Ctrl-C. Its counterexample links may
run many steps past the violation; the `check` command it prints at start (same options)
prints the shortest counterexample of each property.

  --addr ADDR            where to listen, loopback only (default 127.0.0.1:3000)
{MODEL_OPTIONS}"
    )
}

/// A parsed command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Command {
    /// `check`, `explore` or help.
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
    /// Print the usage of a command (`None`: of the program) and exit 0.
    Help(Option<Topic>),
}

/// A command whose usage `help` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topic {
    /// `check`.
    Check,
    /// `explore`.
    Explore,
}

impl Command {
    /// The usage text for a [`Verb::Help`] command (the program's for any other verb).
    pub fn help_text(&self) -> String {
        match self.verb {
            Verb::Help(Some(Topic::Check)) => check_usage(),
            Verb::Help(Some(Topic::Explore)) => explore_usage(),
            _ => USAGE.to_string(),
        }
    }

    /// The `check` command line for the same model: what prints the shortest counterexample
    /// of each property (only options that differ from the defaults).
    pub fn check_command_line(&self) -> String {
        let mut line = String::from("prefill-router-model check");
        let (c, d) = (&self.config, &Config::STANDARD);
        for (flag, value, default) in [
            ("--retargets", c.retargets, d.retargets),
            ("--failures", c.failures, d.failures),
            ("--requests", c.requests, d.requests),
            ("--targets", c.targets, d.targets),
            (
                "--admission-changes",
                c.admission_changes,
                d.admission_changes,
            ),
        ] {
            if value != default {
                line.push_str(&format!(" {flag} {value}"));
            }
        }
        if !c.shutdown {
            line.push_str(" --no-shutdown");
        }
        if self.subject != Real::NAME {
            line.push_str(&format!(" --mutant {}", self.subject));
        }
        line
    }
}

/// Parses the arguments after the program name.
pub fn parse(args: &[String]) -> Result<Command, CliError> {
    let usage = |m: String| CliError::Usage(m);
    let mut it = args.iter();
    let mut cmd = Command {
        verb: Verb::Help(None),
        config: Config::STANDARD,
        threads: 1,
        dfs: false,
        subject: Real::NAME.to_string(),
        addr: SocketAddr::from(([127, 0, 0, 1], 3000)),
    };
    let (verb, topic) = match it.next().map(String::as_str) {
        Some("check") => (Verb::Check, Topic::Check),
        Some("explore") => (Verb::Explore, Topic::Explore),
        Some("help" | "--help" | "-h") => {
            // `help`, `help check`, `help explore`; anything after the topic is ignored.
            cmd.verb = Verb::Help(match it.next().map(String::as_str) {
                None | Some("--help" | "-h") => None,
                Some("check") => Some(Topic::Check),
                Some("explore") => Some(Topic::Explore),
                Some(other) => return Err(usage(format!("no help on {other:?}"))),
            });
            return Ok(cmd);
        }
        Some(other) => return Err(usage(format!("unknown command {other:?}"))),
        None => return Err(usage("missing command".into())),
    };
    cmd.verb = verb;
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
            // Help wins over whatever else is on the line (and its validation).
            "--help" | "-h" => {
                cmd.verb = Verb::Help(Some(topic));
                return Ok(cmd);
            }
            other => return Err(usage(format!("unknown option {other:?}"))),
        }
    }
    cmd.config.validate().map_err(CliError::Config)?;
    Ok(cmd)
}

/// Runs a parsed command, writing the report (or the usage, for help) to `out`. Returns the
/// process exit code: 0 when every property has its expected verdict (and for help), 1
/// otherwise. `explore` only returns on error.
pub fn run(cmd: &Command, out: &mut dyn Write) -> Result<i32, CliError> {
    if let Verb::Help(_) = cmd.verb {
        writeln!(out, "{}", cmd.help_text())?;
        return Ok(0);
    }
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
    match cmd.verb {
        Verb::Check => check(RouterModel::<S>::new(cmd.config), cmd, out),
        Verb::Explore => explore::<S>(cmd, out),
        Verb::Help(_) => unreachable!("help is answered before dispatch"),
    }
}

fn explore<S: Subject>(cmd: &Command, out: &mut dyn Write) -> Result<i32, CliError> {
    if !cmd.addr.ip().is_loopback() {
        return Err(CliError::NotLoopback(cmd.addr));
    }
    let addr = probe_listen(cmd.addr)?;
    let command = cmd.check_command_line();
    writeln!(
        out,
        "serving the stateright Explorer for {} ({:?}) on http://{addr}/ (Ctrl-C to stop)\n\
         its counterexample links may run past the violation; the shortest counterexample of \
         each property: {command}",
        S::NAME,
        cmd.config,
    )?;
    out.flush()?;
    // Blocks for good: the Explorer joins its own HTTP thread.
    let _ = RouterModel::<S>::for_explorer(cmd.config, command)
        .checker()
        .serve(addr);
    Ok(0)
}

/// Checks that `addr` can be listened on and returns the address to serve on (port 0 resolved
/// to the port the system picked). stateright's Explorer panics when it cannot bind, so bind
/// once here to refuse with a typed error instead; the listener is dropped at once so the
/// Explorer can bind the same address (a port taken in between still panics there).
pub fn probe_listen(addr: SocketAddr) -> Result<SocketAddr, CliError> {
    let listen = |source| CliError::Listen { addr, source };
    let listener = std::net::TcpListener::bind(addr).map_err(listen)?;
    listener.local_addr().map_err(listen)
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
            write!(out, "{}", checker.model().render(&steps))?;
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
    crate::properties::all::<S, RouterModel<S>>()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn help_of(line: &str) -> String {
        let cmd = parse(&args(line)).unwrap_or_else(|e| panic!("{line}: {e}"));
        assert!(matches!(cmd.verb, Verb::Help(_)), "{line}: {cmd:?}");
        let mut out = Vec::new();
        assert_eq!(run(&cmd, &mut out).expect("help runs"), 0, "{line}");
        String::from_utf8(out).expect("utf-8 usage")
    }

    #[test]
    fn every_subcommand_answers_help_with_its_usage() {
        for line in [
            "check --help",
            "check -h",
            "check --retargets 3 --help",
            "help check",
        ] {
            assert!(
                help_of(line).starts_with("usage: prefill-router-model check"),
                "{line}"
            );
        }
        for line in [
            "explore --help",
            "explore -h",
            "explore --addr 127.0.0.1:0 --help",
            "help explore",
        ] {
            let text = help_of(line);
            assert!(
                text.starts_with("usage: prefill-router-model explore"),
                "{line}"
            );
            assert!(text.contains("--addr"), "{line}");
        }
        for line in ["--help", "-h", "help", "help --help"] {
            let text = help_of(line);
            assert!(text.contains("prefill-router-model check"), "{line}");
            assert!(text.contains("prefill-router-model explore"), "{line}");
        }
    }

    #[test]
    fn help_wins_over_a_configuration_out_of_bounds() {
        // Validation must not stand between a newcomer and the usage.
        assert!(matches!(
            parse(&args("check --retargets 60 --failures 10 --help")),
            Ok(Command {
                verb: Verb::Help(Some(Topic::Check)),
                ..
            })
        ));
    }

    #[test]
    fn help_on_an_unknown_command_is_a_usage_error() {
        assert!(matches!(
            parse(&args("help frobnicate")),
            Err(CliError::Usage(_))
        ));
    }

    #[test]
    fn check_command_line_repeats_only_the_options_that_differ() {
        let cmd = parse(&args("explore")).expect("parses");
        assert_eq!(cmd.check_command_line(), "prefill-router-model check");
        let cmd = parse(&args(
            "explore --addr 127.0.0.1:4000 --retargets 3 --requests 1 --no-shutdown \
             --mutant no-staleness-check",
        ))
        .expect("parses");
        assert_eq!(
            cmd.check_command_line(),
            "prefill-router-model check --retargets 3 --requests 1 --no-shutdown \
             --mutant no-staleness-check"
        );
    }

    #[test]
    fn a_port_in_use_is_a_typed_error_naming_it() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let addr = taken.local_addr().expect("its address");
        let err = probe_listen(addr).expect_err("the port is taken");
        assert!(matches!(err, CliError::Listen { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("cannot listen on {addr}: ")),
            "{text}"
        );
        assert_eq!(text.lines().count(), 1, "{text}");
    }

    #[test]
    fn probing_port_zero_yields_the_port_to_serve_on() {
        let addr = probe_listen(SocketAddr::from(([127, 0, 0, 1], 0))).expect("binds");
        assert_ne!(addr.port(), 0);
    }
}
