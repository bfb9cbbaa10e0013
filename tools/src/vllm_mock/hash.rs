//! vLLM's block hashes under `--prefix-caching-hash-algo sha256_cbor` (the algorithm
//! `.ci/vllm.sh` starts vLLM with): `H_i = sha256(canonical_cbor([bstr(H_{i-1}), [tokens...],
//! null]))` with `H_{-1} = sha256(cbor("vllm-none-hash"))`, and the 64-bit hash on the wire is the
//! digest's last 8 bytes read big-endian (`kv_events_samples/README.md`, "Block hashes"). So the
//! mock publishes the very hashes a real engine started that way publishes for the same prompt.

use ring::digest::{digest, SHA256};

/// One block's full digest (the chain's input for the next block).
pub type Digest = [u8; 32];

/// The major-type header of CBOR: `major` (0..=7) with argument `n`, shortest form (canonical).
fn head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    match n {
        0..=23 => out.push(m | n as u8),
        24..=0xff => out.extend([m | 24, n as u8]),
        0x100..=0xffff => {
            out.push(m | 25);
            out.extend((n as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(m | 26);
            out.extend((n as u32).to_be_bytes());
        }
        _ => {
            out.push(m | 27);
            out.extend(n.to_be_bytes());
        }
    }
}

fn sha256(bytes: &[u8]) -> Digest {
    let mut out = [0u8; 32];
    out.copy_from_slice(digest(&SHA256, bytes).as_ref());
    out
}

/// `NONE_HASH`: the parent of a chain's first block.
pub fn none_hash() -> Digest {
    let mut cbor = Vec::with_capacity(16);
    head(&mut cbor, 3, 14);
    cbor.extend_from_slice(b"vllm-none-hash");
    sha256(&cbor)
}

/// The digest of one block of `tokens` extending `parent` (no extra keys: no LoRA, no
/// multimodal input, no cache salt).
pub fn block_digest(parent: &Digest, tokens: &[u32]) -> Digest {
    let mut cbor = Vec::with_capacity(40 + tokens.len() * 3);
    head(&mut cbor, 4, 3);
    head(&mut cbor, 2, 32);
    cbor.extend_from_slice(parent);
    head(&mut cbor, 4, tokens.len() as u64);
    for &t in tokens {
        head(&mut cbor, 0, u64::from(t));
    }
    cbor.push(0xf6); // null
    sha256(&cbor)
}

/// The 64-bit form of a digest, as vLLM publishes it (`int.from_bytes(d, "big") & (2**64-1)`).
pub fn wire_hash(d: &Digest) -> u64 {
    let mut last = [0u8; 8];
    last.copy_from_slice(&d[24..]);
    u64::from_be_bytes(last)
}

/// The wire hashes of every *full* block of `tokens` (a partial last block has none).
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = none_hash();
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            parent = block_digest(&parent, block);
            wire_hash(&parent)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_hash_is_vllms() {
        let hex: String = none_hash().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
    }

    #[test]
    fn cbor_heads_are_the_shortest_form() {
        let enc = |n| {
            let mut v = Vec::new();
            head(&mut v, 0, n);
            v
        };
        assert_eq!(enc(23), [23]);
        assert_eq!(enc(24), [0x18, 24]);
        assert_eq!(enc(1000), [0x19, 0x03, 0xe8]);
        assert_eq!(enc(70_000), [0x1a, 0, 1, 0x11, 0x70]);
        assert_eq!(enc(1 << 40), [0x1b, 0, 0, 1, 0, 0, 0, 0, 0]);
    }
}
