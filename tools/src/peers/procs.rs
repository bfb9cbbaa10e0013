//! What a router process costs: the CPU seconds and peak resident memory of its whole process
//! tree (a Python launcher and the router it starts count together), read from `/proc`; and
//! the harness's children, stopped with it ([`adopt`], [`stop_children_on_signal`]).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs;

use parking_lot::Mutex;

/// The process trees the harness started and has not stopped yet (by root pid).
static CHILDREN: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

/// Remember `pid` as a child the harness must stop if it is signalled ([`release`] when it is
/// stopped the usual way, on drop).
pub fn adopt(pid: u32) {
    CHILDREN.lock().insert(pid);
}

/// Forget `pid` (stopped by its owner).
pub fn release(pid: u32) {
    CHILDREN.lock().remove(&pid);
}

/// On SIGINT or SIGTERM, stop every adopted process tree ([`kill_tree`]) and exit with 130.
/// Drops do not run when a signal ends the process, so without this a run interrupted
/// mid-way left its router and engines running. Call once, inside the runtime.
pub fn stop_children_on_signal() {
    tokio::spawn(async {
        let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        else {
            tracing::warn!("cannot watch SIGTERM: children outlive a terminated run");
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        let children: Vec<u32> = CHILDREN.lock().iter().copied().collect();
        eprintln!(
            "bench-peers: signalled; stopping {} child process trees",
            children.len()
        );
        // kill_tree blocks (it waits up to 3 s per tree): off the runtime's workers.
        let _ = tokio::task::spawn_blocking(move || children.into_iter().for_each(kill_tree)).await;
        std::process::exit(130);
    });
}

/// Clock ticks per second of `/proc/PID/stat`'s times (USER_HZ, 100 on every Linux the
/// harness targets).
const TICKS_PER_SECOND: f64 = 100.0;

/// A reading of one process tree.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TreeUsage {
    /// User plus system CPU seconds of every process in the tree so far.
    pub cpu_seconds: f64,
    /// The sum of the processes' peak resident set (`VmHWM`), in bytes.
    pub peak_rss_bytes: u64,
    /// Processes in the tree.
    pub processes: usize,
}

/// The fields of `/proc/PID/stat` the harness needs: parent pid and CPU ticks.
fn parse_stat(stat: &str) -> Option<(u32, u64)> {
    // The command name is in parentheses and may hold spaces: fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(0) ppid(1) ... utime(11) stime(12).
    let ppid = fields.get(1)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((ppid, utime + stime))
}

/// `VmHWM` of `/proc/PID/status`, in bytes.
fn parse_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Every process's parent and CPU ticks, now.
fn processes() -> HashMap<u32, (u32, u64)> {
    let mut parents: HashMap<u32, (u32, u64)> = HashMap::new();
    if let Ok(entries) = fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some(parsed) = fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .as_deref()
                .and_then(parse_stat)
            {
                parents.insert(pid, parsed);
            }
        }
    }
    parents
}

/// `root` and every process descended from it, as `processes` lists them.
fn tree_of(root: u32, parents: &HashMap<u32, (u32, u64)>) -> HashSet<u32> {
    let mut tree = HashSet::from([root]);
    // Parents before children is not guaranteed by pid order: iterate to a fixed point.
    loop {
        let before = tree.len();
        for (pid, (ppid, _)) in parents {
            if tree.contains(ppid) {
                tree.insert(*pid);
            }
        }
        if tree.len() == before {
            break;
        }
    }
    tree
}

/// The pids of `root` and its descendants now.
pub fn tree_pids(root: u32) -> HashSet<u32> {
    tree_of(root, &processes())
}

/// Whether `pid` is a live process (not exited, not a zombie).
pub fn alive(pid: u32) -> bool {
    processes().contains_key(&pid) && !zombie(pid)
}

/// Stop `root` and its descendants: SIGTERM, up to 3 s to exit, then SIGKILL (a router's
/// launcher may leave its router behind if only it is signalled).
pub fn kill_tree(root: u32) {
    let signal = |name: &str, pids: &HashSet<u32>| {
        if pids.is_empty() {
            return;
        }
        let _ = std::process::Command::new("kill")
            .arg(format!("-{name}"))
            .args(pids.iter().map(u32::to_string))
            .stderr(std::process::Stdio::null())
            .status();
    };
    let tree = tree_of(root, &processes());
    signal("TERM", &tree);
    for _ in 0..30 {
        let alive = processes();
        if tree
            .iter()
            .all(|pid| !alive.contains_key(pid) || zombie(*pid))
        {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let alive = processes();
    signal(
        "KILL",
        &tree.into_iter().filter(|p| alive.contains_key(p)).collect(),
    );
}

/// Whether `pid` has exited and waits for its parent to reap it.
fn zombie(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .and_then(|i| s.get(i + 2..i + 3))
                .map(|c| c == "Z")
        })
        .unwrap_or(true)
}

/// The usage of `root` and every process descended from it, now.
pub fn tree_usage(root: u32) -> TreeUsage {
    let parents = processes();
    let tree = tree_of(root, &parents);
    let mut usage = TreeUsage::default();
    for pid in tree {
        let Some((_, ticks)) = parents.get(&pid) else {
            continue;
        };
        #[allow(clippy::cast_precision_loss)]
        {
            usage.cpu_seconds += *ticks as f64 / TICKS_PER_SECOND;
        }
        usage.peak_rss_bytes += fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .as_deref()
            .and_then(parse_hwm)
            .unwrap_or(0);
        usage.processes += 1;
    }
    usage
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_after_a_name_with_spaces() {
        let stat = "42 (smg ::router) S 7 42 42 0 -1 4194560 100 0 0 0 250 31 0 0 20 0 9 0 1 2 3";
        assert_eq!(parse_stat(stat), Some((7, 281)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn peak_rss_is_vm_hwm_in_bytes() {
        let status = "Name:\tx\nVmPeak:\t  9000 kB\nVmHWM:\t  2048 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(parse_hwm(status), Some(2048 * 1024));
        assert_eq!(parse_hwm("Name:\tx\n"), None);
    }

    #[test]
    fn this_process_is_a_tree_of_at_least_one_with_memory() {
        let usage = tree_usage(std::process::id());
        assert!(usage.processes >= 1);
        assert!(usage.peak_rss_bytes > 0);
    }
}
