//! The bench binaries' `--name value` arguments (shared by `benches/serve.rs` and
//! `benches/slow_clients.rs`).

/// The value after `name` on the command line, if any.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// The number after `name`, or `default` when it is absent or not a number.
pub fn num(name: &str, default: u64) -> u64 {
    arg(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}
