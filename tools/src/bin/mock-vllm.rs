//! `mock-vllm`: one mock engine speaking vLLM's protocol (`prefill_router_tools::vllm_mock`,
//! `docs/engines.md`, "The mock vLLM engine"). Prints `{"event":"ready","port":P,...}` on stdout
//! once it listens; stops on SIGTERM or SIGINT.

use std::process::ExitCode;
use std::time::Duration;

use prefill_router_tools::vllm_mock::{KvRole, MockVllm, MockVllmConfig};

const USAGE: &str = "\
usage: mock-vllm --port P [options]

  --port P                  HTTP port (0: any free port)
  --host H                  listen address (default 127.0.0.1)
  --model NAME              served model name (default tiny-llama)
  --tokenizer DIR           HF model folder (tokenizer.json, chat template) for text prompts;
                            default: the library's built-in word tokenizer (every token id
                            is then in vocabulary: its ids are 32-bit hashes)
  --block-size N            tokens per KV block (default 32)
  --num-gpu-blocks N        prefix cache capacity in blocks (default 4096)
  --kv-events-port E        KV events ZMQ PUB port (off if absent; 0: any free port)
  --kv-replay-port R        KV events replay ROUTER port (needs --kv-events-port)
  --kv-topic T              topic of the event batches (default kv-events)
  --kv-role ROLE            producer | consumer | both (default both)
  --prefill-overhead-ms X   fixed prefill time (default 5)
  --prefill-us-per-token Y  prefill time per uncached prompt token (default 100)
  --decode-ms-per-token Z   time per output token after the first (default 25)
  --transfer-us-per-block T decode leg's time per KV block pulled (default 20)
  --max-batch K             prefills run at once, the rest wait (default 4)
  --max-model-len L         longest prompt + output (default 4096)
  --seed S                  seeds request and engine ids (default 0)";

fn parse(args: &[String]) -> Result<MockVllmConfig, String> {
    let mut c = MockVllmConfig::default();
    let mut port = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(String::new());
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?
            .as_str();
        fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("invalid value `{v}` for {flag}"))
        }
        match flag.as_str() {
            "--port" => port = Some(num(flag, value)?),
            "--host" => c.host = value.to_owned(),
            "--model" => c.model = value.to_owned(),
            "--tokenizer" => c.tokenizer = Some(value.into()),
            "--block-size" => c.block_size = num(flag, value)?,
            "--num-gpu-blocks" => c.num_gpu_blocks = num(flag, value)?,
            "--kv-events-port" => c.kv_events_port = Some(num(flag, value)?),
            "--kv-replay-port" => c.kv_replay_port = Some(num(flag, value)?),
            "--kv-topic" => c.kv_topic = value.to_owned(),
            "--kv-role" => c.kv_role = value.parse::<KvRole>()?,
            "--prefill-overhead-ms" => {
                c.cost.prefill_overhead = Duration::from_secs_f64(num::<f64>(flag, value)? / 1e3)
            }
            "--prefill-us-per-token" => {
                c.cost.prefill_per_token = Duration::from_secs_f64(num::<f64>(flag, value)? / 1e6)
            }
            "--decode-ms-per-token" => {
                c.cost.decode_per_token = Duration::from_secs_f64(num::<f64>(flag, value)? / 1e3)
            }
            "--transfer-us-per-block" => {
                c.transfer_per_block = Duration::from_secs_f64(num::<f64>(flag, value)? / 1e6)
            }
            "--max-batch" => c.cost.max_batch = num(flag, value)?,
            "--max-model-len" => c.max_model_len = num(flag, value)?,
            "--seed" => c.seed = num(flag, value)?,
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    c.port = port.ok_or("--port is required")?;
    if c.block_size == 0 || c.max_model_len < 2 || c.cost.max_batch == 0 {
        return Err(
            "--block-size, --max-batch must be positive, --max-model-len at least 2".into(),
        );
    }
    if c.kv_replay_port.is_some() && c.kv_events_port.is_none() {
        return Err("--kv-replay-port needs --kv-events-port".into());
    }
    // Without a model's tokenizer, prompts are the built-in word tokenizer's, whose ids are
    // 32-bit hashes: a router using that tokenizer sends them, so every id is in vocabulary.
    if c.tokenizer.is_none() {
        c.vocab_size = u32::MAX;
    }
    Ok(c)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let config = match parse(&args) {
        Ok(c) => c,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    // Two worker threads: eight engines on two cores share them with the router.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(config))
}

async fn run(config: MockVllmConfig) -> ExitCode {
    let engine = match MockVllm::start(config).await {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let events = engine.events();
    println!(
        "{}",
        serde_json::json!({
            "event": "ready",
            "port": engine.addr.port(),
            "addr": engine.addr.to_string(),
            "kv_events_port": events.map(|e| e.events),
            "kv_replay_port": events.and_then(|e| e.replay),
            "engine_id": engine.app.engine_id,
        })
    );
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        eprintln!("error: cannot listen for SIGTERM");
        return ExitCode::FAILURE;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    // Open streams end with the server; a bounded wait, then out.
    let _ = tokio::time::timeout(Duration::from_secs(5), engine.shutdown()).await;
    ExitCode::SUCCESS
}
