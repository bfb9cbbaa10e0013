//! Fuzz target `frame_decode`: arbitrary bytes, and encodings of well-formed frames cut,
//! flipped or extended, through the request plane's payload decoder
//! [`decode_frame`].
//!
//! Checked on every input: no panic; an error is the typed `FrameError::Malformed`; a decoded
//! frame re-encodes to a payload that decodes to the same frame; a well-formed frame's encoding
//! decodes to exactly that frame; and decoding never holds more memory at once than the frame
//! limit (`DEFAULT_MAX_FRAME_LEN`), nor more than [`proportional_bound`] of the payload length,
//! measured by the [`CountingAllocator`] that the fuzz binary and the replay test install.
//!
//! [`CountingAllocator`]: crate::alloc_probe::CountingAllocator

use arbitrary::{Arbitrary, Unstructured};

use crate::alloc_probe::peak_bytes;
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse, PrefillInfo};
use prefill_router::transport::{
    decode_frame, encode_frame, Frame, FrameError, RemoteError, DEFAULT_MAX_FRAME_LEN,
};

/// `PrefillInfo`, field by field.
#[derive(Arbitrary, Clone, Debug)]
pub struct PrefillSeed {
    worker: u64,
    prompt_tokens: u32,
    cached_blocks: u32,
    block_size: u32,
}

/// A frame, field by field.
#[derive(Arbitrary, Clone, Debug)]
pub enum FrameSeed {
    /// `Frame::Request`.
    Request {
        /// Request id.
        id: u64,
        /// Budget.
        timeout_ms: Option<u64>,
        /// Prompt.
        token_ids: Vec<u32>,
        /// Tokens to generate.
        max_tokens: u32,
        /// Session key.
        session: Option<String>,
        /// Stop tokens.
        stop_token_ids: Vec<u32>,
        /// Handoff.
        handoff: Option<PrefillSeed>,
    },
    /// `Frame::Cancel`.
    Cancel(u64),
    /// `Frame::Data`.
    Data {
        /// Request id.
        id: u64,
        /// Tokens.
        token_ids: Vec<u32>,
        /// Finish reason, by index.
        finish: Option<u8>,
        /// Prefill report.
        prefill: Option<PrefillSeed>,
    },
    /// `Frame::End`.
    End(u64),
    /// `Frame::Error`, the error by index (the engine's message when 0).
    Error {
        /// Request id.
        id: u64,
        /// Which error.
        kind: u8,
        /// The engine's message.
        message: String,
    },
    /// `Frame::KvSubscribe`.
    KvSubscribe,
    /// `Frame::KvEvents`, its payload (any bytes: the frame decoder does not look inside).
    KvEvents(Vec<u8>),
    /// `Frame::Draining`.
    Draining,
    /// `Frame::DrainAck`.
    DrainAck,
    /// `Frame::KvSnapshotRequest`.
    KvSnapshotRequest,
    /// `Frame::KvSnapshotChunk`: its snapshot seq, last flag and payload (any bytes: the
    /// frame decoder does not look inside).
    KvSnapshotChunk(Option<u64>, bool, Vec<u8>),
    /// `Frame::KvSnapshotUnavailable`.
    KvSnapshotUnavailable,
    /// `Frame::LoadSubscribe`.
    LoadSubscribe,
    /// `Frame::LoadReport`, its payload (any bytes: decoded by the client, not the frame
    /// decoder).
    LoadReport(Vec<u8>),
}

impl PrefillSeed {
    fn info(&self) -> PrefillInfo {
        PrefillInfo {
            engine_params: None,
            worker: self.worker,
            prompt_tokens: self.prompt_tokens,
            cached_blocks: self.cached_blocks,
            block_size: self.block_size,
        }
    }
}

impl FrameSeed {
    /// The frame this seed stands for.
    pub fn frame(&self) -> Frame {
        match self {
            FrameSeed::Request {
                id,
                timeout_ms,
                token_ids,
                max_tokens,
                session,
                stop_token_ids,
                handoff,
            } => Frame::Request {
                id: *id,
                timeout_ms: *timeout_ms,
                request: GenerateRequest {
                    token_ids: token_ids.clone(),
                    max_tokens: *max_tokens,
                    session: session.clone(),
                    stop_token_ids: stop_token_ids.clone(),
                    handoff: handoff.as_ref().map(PrefillSeed::info),
                    engine_fields: None,
                    // Process-local, never on the wire.
                    request_id: None,
                },
            },
            FrameSeed::Cancel(id) => Frame::Cancel { id: *id },
            FrameSeed::Data {
                id,
                token_ids,
                finish,
                prefill,
            } => Frame::Data {
                id: *id,
                response: GenerateResponse {
                    text: None,
                    usage: None,
                    token_ids: token_ids.clone(),
                    finish: finish.map(|f| match f % 3 {
                        0 => FinishReason::Length,
                        1 => FinishReason::Stop,
                        _ => FinishReason::Cancelled,
                    }),
                    prefill: prefill.as_ref().map(PrefillSeed::info),
                },
            },
            FrameSeed::End(id) => Frame::End { id: *id },
            FrameSeed::Error { id, kind, message } => Frame::Error {
                id: *id,
                error: match kind % 5 {
                    0 => RemoteError::Engine {
                        message: message.clone(),
                    },
                    1 => RemoteError::Overloaded,
                    2 => RemoteError::DeadlineExceeded,
                    3 => RemoteError::ResponseTooLarge,
                    _ => RemoteError::Draining,
                },
            },
            FrameSeed::KvSubscribe => Frame::KvSubscribe,
            FrameSeed::KvEvents(payload) => Frame::KvEvents {
                payload: payload.clone(),
            },
            FrameSeed::Draining => Frame::Draining,
            FrameSeed::DrainAck => Frame::DrainAck,
            FrameSeed::KvSnapshotRequest => Frame::KvSnapshotRequest,
            FrameSeed::KvSnapshotChunk(seq, last, payload) => Frame::KvSnapshotChunk {
                seq: *seq,
                last: *last,
                payload: payload.clone(),
            },
            FrameSeed::KvSnapshotUnavailable => Frame::KvSnapshotUnavailable,
            FrameSeed::LoadSubscribe => Frame::LoadSubscribe,
            FrameSeed::LoadReport(payload) => Frame::LoadReport {
                payload: payload.clone(),
            },
        }
    }
}

/// A structure-aware `frame_decode` input: a frame, and what to do to its encoding.
#[derive(Arbitrary, Clone, Debug)]
pub struct FrameScript {
    /// The frame.
    pub frame: FrameSeed,
    /// Keep only this many bytes of the encoding.
    pub keep: Option<u16>,
    /// Xor the byte at `.0` with `.1`.
    pub flip: Option<(u16, u8)>,
    /// Bytes appended after the (possibly cut) encoding.
    pub append: Vec<u8>,
}

/// The memory a decode may hold for a payload of `len` bytes, per `decode_frame`'s promise that
/// allocation is bounded by the payload length: every element consumes at least one input byte
/// and takes at most 4 bytes (a `u32` token), doubled by `Vec` growth (8 per input byte; 16
/// leaves headroom), plus 4 KiB for the error text and fixed-size parts.
pub fn proportional_bound(len: usize) -> usize {
    16 * len + 4096
}

/// A payload decoder: [`decode_frame`], or a mutant of it.
pub type Decoder = fn(&[u8]) -> Result<Frame, FrameError>;

/// What decoding one payload gave: the frame, if any, and the peak bytes held at once.
pub type Decoded = (Option<Frame>, usize);

/// Decode one payload with [`decode_frame`] and check everything that must hold for any payload.
pub fn check_payload(payload: &[u8]) -> Result<Decoded, String> {
    check_payload_with(payload, decode_frame)
}

/// Decode one payload with `decoder` and check everything that must hold for any payload.
pub fn check_payload_with(payload: &[u8], decoder: Decoder) -> Result<Decoded, String> {
    let (decoded, peak) = peak_bytes(|| decoder(payload));
    let Some(peak) = peak else {
        return Err(
            "frame_decode needs testkit::alloc_probe::CountingAllocator as the global allocator"
                .to_owned(),
        );
    };
    if peak > DEFAULT_MAX_FRAME_LEN {
        return Err(format!(
            "decoding {} bytes held {peak} bytes at once, above the frame limit {DEFAULT_MAX_FRAME_LEN}",
            payload.len()
        ));
    }
    if peak > proportional_bound(payload.len()) {
        return Err(format!(
            "decoding {} bytes held {peak} bytes at once, above {} (not bounded by the payload)",
            payload.len(),
            proportional_bound(payload.len())
        ));
    }
    match decoded {
        Ok(frame) => {
            let again = decoder(&encode_frame(&frame));
            if again.as_ref() != Ok(&frame) {
                return Err(format!("{frame:?} re-encoded decodes to {again:?}"));
            }
            Ok((Some(frame), peak))
        }
        Err(FrameError::Malformed { reason }) if !reason.is_empty() => Ok((None, peak)),
        Err(other) => Err(format!("decoding a payload failed with {other:?}")),
    }
}

/// Check one structure-aware script against [`decode_frame`]; returns the peak bytes held.
pub fn check_frame_script(script: &FrameScript) -> Result<usize, String> {
    check_frame_script_with(script, decode_frame)
}

/// Check one structure-aware script against `decoder`; returns the peak bytes held.
pub fn check_frame_script_with(script: &FrameScript, decoder: Decoder) -> Result<usize, String> {
    let frame = script.frame.frame();
    let mut bytes = encode_frame(&frame);
    let first_peak = match check_payload_with(&bytes, decoder)? {
        (Some(decoded), peak) if decoded == frame => peak,
        other => return Err(format!("{frame:?} encoded decodes to {other:?}")),
    };
    if let Some(keep) = script.keep {
        bytes.truncate(usize::from(keep));
    }
    if let Some((at, mask)) = script.flip {
        if let Some(b) = bytes.get_mut(usize::from(at)) {
            *b ^= mask;
        }
    }
    bytes.extend_from_slice(&script.append);
    let (_, peak) = check_payload_with(&bytes, decoder)?;
    Ok(first_peak.max(peak))
}

/// Decode raw fuzz bytes as a structure-aware script.
pub fn decode(bytes: &[u8]) -> Option<FrameScript> {
    FrameScript::arbitrary_take_rest(Unstructured::new(bytes)).ok()
}

/// The `frame_decode` harness: the raw bytes as a payload, then as a structure-aware script.
pub fn frame_decode(bytes: &[u8]) {
    if let Err(e) = check_payload(bytes) {
        panic!("frame_decode (raw payload): {e}");
    }
    if let Some(script) = decode(bytes) {
        if let Err(e) = check_frame_script(&script) {
            panic!("frame_decode: {e}\nscript: {script:?}");
        }
    }
}
