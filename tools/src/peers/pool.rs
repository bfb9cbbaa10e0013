//! The engine pool every router is put in front of: mock vLLM engines started here (`mock-vllm`),
//! or engines already running (real vLLM), and what the harness asks of them between and after
//! runs: clear the prefix caches, read the prefix-cache counters.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::procs::{adopt, kill_tree, release};
use super::routers::PoolAddrs;
use crate::engines::{http_get, http_post_json};

/// Why the pool could not be used.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// An engine process did not start.
    #[error("cannot start {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// An engine did not answer `/health` in time.
    #[error("engine {0} not healthy within {1:?}")]
    NotHealthy(String, Duration),
    /// An engine's address is not `http://HOST:PORT`.
    #[error("bad engine address {0}")]
    BadAddress(String),
}

/// Engines the harness started (stopped on drop) or was given.
pub struct Pool {
    /// The addresses routers need.
    pub addrs: PoolAddrs,
    children: Vec<Child>,
}

/// How to start a mock pool.
#[derive(Clone, Debug)]
pub struct MockPoolConfig {
    /// The `mock-vllm` binary.
    pub binary: PathBuf,
    /// Prefill engines.
    pub prefill: usize,
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// Blocks each engine's cache holds.
    pub cache_blocks: u32,
    /// A model folder whose tokenizer the engines use (`None`: the built-in word tokenizer).
    pub tokenizer: Option<PathBuf>,
    /// The prefill engines' compute time per uncached prompt token, in µs (`None`: the mock's
    /// default, 100): a slower pool makes queues form at the same request rate.
    pub prefill_us_per_token: Option<u64>,
}

/// A free loopback port (bound and released: good enough on a quiet loopback).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_or(0, |a| a.port())
}

/// `http://HOST:PORT` as a socket address.
pub fn socket_of(url: &str) -> Result<SocketAddr, PoolError> {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .map_err(|_| PoolError::BadAddress(url.to_owned()))
}

/// Wait until `url` answers `/health` with 200, up to `within`.
pub async fn wait_healthy(url: &str, within: Duration) -> Result<(), PoolError> {
    let addr = socket_of(url)?;
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok((200, _)) = http_get(addr, "/health", Duration::from_secs(2)).await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(PoolError::NotHealthy(url.to_owned(), within))
}

impl Pool {
    /// Start `config.prefill` prefill engines (with KV events) and one decode engine.
    pub async fn start_mock(config: &MockPoolConfig) -> Result<Pool, PoolError> {
        let mut pool = Pool {
            addrs: PoolAddrs {
                prefill: Vec::new(),
                events: Vec::new(),
                decode: Vec::new(),
                block_tokens: config.block_tokens,
                tokenizer: config.tokenizer.clone(),
            },
            children: Vec::new(),
        };
        for i in 0..=config.prefill {
            let decode = i == config.prefill;
            let port = free_port();
            let mut command = Command::new(&config.binary);
            command
                .args(["--port", &port.to_string()])
                .args(["--block-size", &config.block_tokens.to_string()])
                .args(["--num-gpu-blocks", &config.cache_blocks.to_string()])
                .args(["--max-model-len", "65536", "--seed", &i.to_string()])
                .args(["--kv-role", if decode { "consumer" } else { "producer" }]);
            if let Some(dir) = &config.tokenizer {
                command.args(["--tokenizer", &dir.display().to_string()]);
            }
            if let (Some(us), false) = (config.prefill_us_per_token, decode) {
                command.args(["--prefill-us-per-token", &us.to_string()]);
            }
            if !decode {
                let (events, replay) = (free_port(), free_port());
                command
                    .args(["--kv-events-port", &events.to_string()])
                    .args(["--kv-replay-port", &replay.to_string()]);
                pool.addrs.events.push(format!("tcp://127.0.0.1:{events}"));
            }
            let child = command
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|source| PoolError::Spawn {
                    program: config.binary.display().to_string(),
                    source,
                })?;
            adopt(child.id());
            pool.children.push(child);
            let url = format!("http://127.0.0.1:{port}");
            if decode {
                pool.addrs.decode.push(url);
            } else {
                pool.addrs.prefill.push(url);
            }
        }
        for url in pool.addrs.prefill.iter().chain(&pool.addrs.decode) {
            wait_healthy(url, Duration::from_secs(30)).await?;
        }
        Ok(pool)
    }

    /// Engines already running (e.g. real vLLM): nothing is started or stopped.
    pub fn given(addrs: PoolAddrs) -> Pool {
        Pool {
            addrs,
            children: Vec::new(),
        }
    }

    /// Clear every engine's prefix cache (`POST /reset_prefix_cache`, vLLM's; real vLLM needs
    /// `VLLM_SERVER_DEV_MODE=1`). Returns the engines that refused.
    pub async fn reset_caches(&self) -> Vec<String> {
        let mut refused = Vec::new();
        for url in self.addrs.prefill.iter().chain(&self.addrs.decode) {
            let ok = match socket_of(url) {
                Ok(addr) => matches!(
                    http_post_json(
                        addr,
                        "/reset_prefix_cache",
                        &serde_json::json!({}),
                        Duration::from_secs(10)
                    )
                    .await,
                    Ok((200, _))
                ),
                Err(_) => false,
            };
            if !ok {
                refused.push(url.clone());
            }
        }
        refused
    }

    /// Send each of `prompts` to every engine directly (`/v1/completions`, 4 tokens) and
    /// return how many answered 200. Real vLLM on CPU serves its first requests several times
    /// slower than the next ones; without this the first router measured met engines fresh
    /// from start-up (docs/performance.md, "On real vLLM"). The caches are cleared before
    /// every router anyway.
    pub async fn warm(&self, model: &str, prompts: &[&str]) -> usize {
        let mut answered = 0;
        for url in self.addrs.prefill.iter().chain(&self.addrs.decode) {
            let Ok(addr) = socket_of(url) else { continue };
            for prompt in prompts {
                let body = serde_json::json!({ "model": model, "prompt": prompt, "max_tokens": 4 });
                match http_post_json(addr, "/v1/completions", &body, Duration::from_secs(120)).await
                {
                    Ok((200, _)) => answered += 1,
                    other => tracing::warn!(%url, ?other, "a warm-up request failed"),
                }
            }
        }
        answered
    }

    /// The prefill engines' prefix-cache counters summed: (queried tokens, hit tokens).
    pub async fn prefix_counters(&self) -> (f64, f64) {
        let (mut queries, mut hits) = (0.0, 0.0);
        for url in &self.addrs.prefill {
            let Ok(addr) = socket_of(url) else { continue };
            if let Ok((200, body)) = http_get(addr, "/metrics", Duration::from_secs(10)).await {
                let text = String::from_utf8_lossy(&body);
                queries += metric_sum(&text, "vllm:prefix_cache_queries_total");
                hits += metric_sum(&text, "vllm:prefix_cache_hits_total");
            }
        }
        (queries, hits)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for child in &mut self.children {
            kill_tree(child.id());
            let _ = child.wait();
            release(child.id());
        }
    }
}

/// The sum of every sample of `name` in a Prometheus text answer (all label sets).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metric_is_summed_over_its_label_sets_and_not_its_prefix_relatives() {
        let text = "# HELP vllm:prefix_cache_hits_total x\n\
            vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 32.0\n\
            vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 16.0\n\
            vllm:prefix_cache_hits_total_created{engine=\"0\"} 1.7e9\n\
            vllm:prefix_cache_queries_total 64\n";
        assert_eq!(metric_sum(text, "vllm:prefix_cache_hits_total"), 48.0);
        assert_eq!(metric_sum(text, "vllm:prefix_cache_queries_total"), 64.0);
        assert_eq!(metric_sum(text, "vllm:absent"), 0.0);
    }

    #[test]
    fn an_engine_url_is_a_socket_address_or_a_typed_error() {
        assert_eq!(socket_of("http://127.0.0.1:8100/").unwrap().port(), 8100);
        assert!(matches!(
            socket_of("http://e:1"),
            Err(PoolError::BadAddress(_))
        ));
    }
}
