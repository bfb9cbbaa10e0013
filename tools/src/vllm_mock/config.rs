//! The mock engine's configuration (the `mock-vllm` flags).

use std::path::PathBuf;
use std::time::Duration;

use crate::replay::CostModel;

/// Which P/D legs the engine serves (vLLM's `kv_role` of its NixlConnector).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvRole {
    /// `kv_producer`: answers prefill legs with a handle; decode legs recompute.
    Producer,
    /// `kv_consumer`: pulls on decode legs; prefill legs get no handle.
    Consumer,
    /// `kv_both`.
    Both,
}

impl KvRole {
    /// Whether it answers `do_remote_decode` with a handle.
    pub fn produces(self) -> bool {
        matches!(self, KvRole::Producer | KvRole::Both)
    }

    /// Whether it pulls on `do_remote_prefill`.
    pub fn consumes(self) -> bool {
        matches!(self, KvRole::Consumer | KvRole::Both)
    }
}

impl std::str::FromStr for KvRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "producer" | "kv_producer" => Ok(KvRole::Producer),
            "consumer" | "kv_consumer" => Ok(KvRole::Consumer),
            "both" | "kv_both" => Ok(KvRole::Both),
            other => Err(format!("kv role {other:?}: producer, consumer or both")),
        }
    }
}

/// Everything a mock engine is started with.
#[derive(Clone, Debug)]
pub struct MockVllmConfig {
    /// The address it listens on.
    pub host: String,
    /// The HTTP port (0: any free port).
    pub port: u16,
    /// The served model name (`/v1/models`, the `model` field, the metrics' `model_name`).
    pub model: String,
    /// A HF model folder whose `tokenizer.json` (and chat template) text prompts go through;
    /// `None`: the library's built-in word tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// The prefix cache's capacity in blocks (`--num-gpu-blocks-override`).
    pub num_gpu_blocks: usize,
    /// The KV events PUB port (`None`: no events; 0: any free port).
    pub kv_events_port: Option<u16>,
    /// The replay ROUTER port (`None`: no replay; 0: any free port).
    pub kv_replay_port: Option<u16>,
    /// The topic of the event batches.
    pub kv_topic: String,
    /// Which P/D legs it serves.
    pub kv_role: KvRole,
    /// The timing model (the replay's; `max_batch` is the prefills run at once).
    pub cost: CostModel,
    /// What a decode leg pays per KV block it pulls from the prefill engine.
    pub transfer_per_block: Duration,
    /// The longest prompt plus output (`--max-model-len`).
    pub max_model_len: usize,
    /// Token ids are below this (the tiny model's vocabulary; with the built-in word tokenizer,
    /// whose ids are 32-bit hashes, every id: the `mock-vllm` binary lifts it when given no
    /// `--tokenizer`).
    pub vocab_size: u32,
    /// Seeds the engine id (so a restarted engine with the same seed has the same id).
    pub seed: u64,
}

impl Default for MockVllmConfig {
    fn default() -> Self {
        MockVllmConfig {
            host: "127.0.0.1".into(),
            port: 0,
            model: "tiny-llama".into(),
            tokenizer: None,
            block_size: 32,
            num_gpu_blocks: 4096,
            kv_events_port: None,
            kv_replay_port: None,
            kv_topic: "kv-events".into(),
            kv_role: KvRole::Both,
            cost: CostModel::default(),
            transfer_per_block: Duration::from_micros(20),
            max_model_len: 4096,
            vocab_size: 1024,
            seed: 0,
        }
    }
}
