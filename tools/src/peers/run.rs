//! One head-to-head: each router in turn in front of the same pool, the same request stream,
//! the caches cleared between routers; what each request saw and what each router cost.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client::{complete, Outcome};
use super::pool::{free_port, Pool};
use super::procs::{adopt, kill_tree, release, tree_usage};
use super::report::Row;
use super::routers::{Binaries, RouterSpec};
use super::workload::PeerRequest;

/// How requests are sent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LoopMode {
    /// Each request at its arrival time, whatever the answers.
    Open,
    /// `users` users each sending the next request `think` after their previous one ended.
    Closed {
        /// Users at once.
        users: usize,
        /// Pause between a user's requests.
        think: Duration,
    },
}

impl LoopMode {
    /// The mode's name in reports.
    pub fn name(self) -> String {
        match self {
            LoopMode::Open => "open".into(),
            LoopMode::Closed { users, think } => format!("closed {users}u/{}ms", think.as_millis()),
        }
    }
}

/// Why a router could not be run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Its process did not start.
    #[error("cannot start {0}: {1}")]
    Spawn(String, std::io::Error),
    /// It never served a probe request.
    #[error("{0} never served a probe request within {1:?} (log: {2})")]
    NotReady(String, Duration, String),
}

/// A router process, stopped (its whole tree) on drop.
struct Running {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Drop for Running {
    fn drop(&mut self) {
        kill_tree(self.child.id());
        let _ = self.child.wait();
        release(self.child.id());
    }
}

/// Start `spec` in front of `pool` and wait until it serves a probe completion.
async fn start(
    binaries: &Binaries,
    spec: RouterSpec,
    pool: &Pool,
    model: &str,
    logs: &std::path::Path,
) -> Result<Running, RunError> {
    let port = free_port();
    let (program, args) = binaries.command(spec, &pool.addrs, port, free_port());
    let log = logs.join(format!("{}.log", spec.label().replace('/', "-")));
    let file = std::fs::File::create(&log).map_err(|e| RunError::Spawn(spec.label(), e))?;
    let err = file
        .try_clone()
        .map_err(|e| RunError::Spawn(spec.label(), e))?;
    tracing::info!(router = %spec.label(), program = %program.display(), args = ?args, "starting");
    let child = Command::new(&program)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .spawn()
        .map_err(|e| RunError::Spawn(format!("{} ({})", spec.label(), program.display()), e))?;
    adopt(child.id());
    let running = Running {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        log,
    };
    let within = Duration::from_secs(120);
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let probe = complete(
            running.addr,
            model,
            "ready probe",
            2,
            Duration::from_secs(10),
        )
        .await;
        if probe.ok() {
            return Ok(running);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(RunError::NotReady(
        spec.label(),
        within,
        running.log.display().to_string(),
    ))
}

/// Send `requests` per `mode` to `addr`: each request's outcome, in request order, and the
/// time from the first send to the last answer.
pub async fn drive(
    addr: SocketAddr,
    model: &str,
    requests: &[PeerRequest],
    mode: LoopMode,
    timeout: Duration,
) -> (Vec<Outcome>, Duration) {
    let start = tokio::time::Instant::now();
    let requests: Arc<[PeerRequest]> = requests.into();
    let model: Arc<str> = model.into();
    let mut outcomes: Vec<Option<Outcome>> = vec![None; requests.len()];
    match mode {
        LoopMode::Open => {
            let mut tasks = Vec::with_capacity(requests.len());
            for (i, request) in requests.iter().enumerate() {
                let (at, prompt, max_tokens) = (
                    start + request.at,
                    request.prompt.clone(),
                    request.max_tokens,
                );
                let model = model.clone();
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep_until(at).await;
                    (
                        i,
                        complete(addr, &model, &prompt, max_tokens, timeout).await,
                    )
                }));
            }
            for task in tasks {
                if let Ok((i, outcome)) = task.await {
                    outcomes[i] = Some(outcome);
                }
            }
        }
        LoopMode::Closed { users, think } => {
            let next = Arc::new(AtomicUsize::new(0));
            let mut tasks = Vec::with_capacity(users);
            for _ in 0..users.max(1) {
                let (next, requests, model) = (next.clone(), requests.clone(), model.clone());
                tasks.push(tokio::spawn(async move {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(request) = requests.get(i) else {
                            break;
                        };
                        let outcome =
                            complete(addr, &model, &request.prompt, request.max_tokens, timeout)
                                .await;
                        mine.push((i, outcome));
                        tokio::time::sleep(think).await;
                    }
                    mine
                }));
            }
            for task in tasks {
                for (i, outcome) in task.await.unwrap_or_default() {
                    outcomes[i] = Some(outcome);
                }
            }
        }
    }
    let lost = |_| Outcome {
        ttft: None,
        e2e: Duration::ZERO,
        text: String::new(),
        error: Some("the client task was lost".into()),
    };
    let outcomes: Vec<Outcome> = outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| lost(())))
        .collect();
    (outcomes, start.elapsed())
}

/// What one head-to-head needs.
pub struct HeadToHead<'a> {
    /// Router binaries.
    pub binaries: &'a Binaries,
    /// The pool.
    pub pool: &'a Pool,
    /// The model name requests carry.
    pub model: &'a str,
    /// Where router logs go.
    pub logs: PathBuf,
    /// Each request's bound.
    pub timeout: Duration,
}

impl HeadToHead<'_> {
    /// Run every router in `routers` over `requests` per `mode`: one row per router. A router
    /// that cannot start gives a row saying why. `reference` holds the first router's texts, to
    /// check that every router's outputs equal it.
    pub async fn run(
        &self,
        routers: &[RouterSpec],
        workload: &str,
        requests: &[PeerRequest],
        mode: LoopMode,
        reference: &mut Option<Vec<String>>,
    ) -> Vec<Row> {
        let mut rows = Vec::new();
        for &spec in routers {
            let mut row = Row::new(spec, workload, &mode.name());
            let refused = self.pool.reset_caches().await;
            if !refused.is_empty() {
                tracing::warn!(?refused, "engines did not clear their caches");
                row.notes
                    .push(format!("{} engines kept their caches", refused.len()));
            }
            let running = match start(self.binaries, spec, self.pool, self.model, &self.logs).await
            {
                Ok(running) => running,
                Err(error) => {
                    eprintln!("bench-peers: {error}");
                    row.notes.push(error.to_string());
                    rows.push(row);
                    continue;
                }
            };
            // The probe went through the caches: clear them again (the events tell the
            // routers that listen), and let the routers see the clear before timing.
            self.pool.reset_caches().await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            let (queries0, hits0) = self.pool.prefix_counters().await;
            let cpu0 = tree_usage(running.child.id()).cpu_seconds;
            let (outcomes, wall) =
                drive(running.addr, self.model, requests, mode, self.timeout).await;
            let usage = tree_usage(running.child.id());
            let (queries1, hits1) = self.pool.prefix_counters().await;
            drop(running);
            let texts: Vec<String> = outcomes.iter().map(|o| o.text.clone()).collect();
            match reference {
                Some(first) => {
                    row.same_output = Some(
                        texts
                            .iter()
                            .zip(first.iter())
                            .filter(|(a, b)| a == b)
                            .count(),
                    );
                }
                None => *reference = Some(texts),
            }
            row.fill(&outcomes, wall);
            row.hit_rate = if queries1 > queries0 {
                Some((hits1 - hits0) / (queries1 - queries0))
            } else {
                None
            };
            row.cpu_seconds = usage.cpu_seconds - cpu0;
            row.peak_rss_bytes = usage.peak_rss_bytes;
            eprintln!("bench-peers: {}", row.line());
            rows.push(row);
        }
        rows
    }
}
