//! What the HTTP handlers share: the engine, the tokenizer, the P/D identity.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prefill_router::http::Tokenizer;

use super::engine::Engine;
use super::events::EventPorts;

/// What the handlers share.
#[derive(Debug)]
pub struct App {
    /// The engine.
    pub engine: Arc<Engine>,
    /// How text prompts become tokens and tokens text.
    pub tokenizer: Tokenizer,
    /// The engine id in its P/D handles (`remote_engine_id`).
    pub engine_id: String,
    /// The NIXL side channel port its handles name (`remote_port`).
    pub side_port: u16,
    /// The event sockets, if it publishes.
    pub events: Option<EventPorts>,
    pub(super) ids: AtomicU64,
    /// The seed of its ids: `--seed` and its port.
    pub(super) salt: u64,
}

impl App {
    /// `n` pseudo-random hex digits (request and engine ids), from the seed, the port and a
    /// counter.
    pub fn random_hex(&self, n: usize) -> String {
        let k = self.ids.fetch_add(1, Ordering::Relaxed);
        let mut z = (self.salt ^ k.rotate_left(17)).wrapping_add(k);
        let mut out = String::with_capacity(n);
        while out.len() < n {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            out.push_str(&format!("{:016x}", x ^ (x >> 31)));
        }
        out.truncate(n);
        out
    }
}
