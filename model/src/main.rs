//! `prefill-router-model`: exhaustively check the prefill-router lifecycle design, or explore
//! its state space in a browser. See docs/model.md.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = prefill_router_model::cli::parse(&args)
        .and_then(|cmd| prefill_router_model::cli::run(&cmd, &mut std::io::stdout().lock()));
    match result {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("prefill-router-model: {e}");
            ExitCode::from(2)
        }
    }
}
