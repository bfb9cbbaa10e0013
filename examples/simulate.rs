//! Run the deterministic simulator from the command line (until the `prefill-router simulate`
//! subcommand exists): `cargo run --release --features sim --example simulate -- --seed N --steps K`.
fn main() {
    let mut seed = 0u64;
    let mut steps = 200u32;
    let mut mutant = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_default();
        match arg.as_str() {
            "--seed" => seed = value.parse().unwrap_or(0),
            "--steps" => steps = value.parse().unwrap_or(200),
            "--mutant" => mutant = prefill_router::sim::parse_mutant(&value),
            _ => {}
        }
    }
    let mut config = prefill_router::sim::SimConfig::new(seed, steps);
    config.mutant = mutant;
    let report = prefill_router::sim::simulate(&config).expect("runtime");
    print!("{report}");
    std::process::exit(if report.passed() { 0 } else { 1 });
}
