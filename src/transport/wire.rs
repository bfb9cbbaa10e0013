//! Frames and their (pure) encoding.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio_util::codec::{LengthDelimitedCodec, LengthDelimitedCodecError};

use super::error::{FrameError, RemoteError};
use crate::request::{GenerateRequest, GenerateResponse};

/// Default maximum frame payload length: 16 MiB (a 4M-token prompt fits).
pub const DEFAULT_MAX_FRAME_LEN: usize = 16 * 1024 * 1024;

/// One message on the wire, in either direction. `id` is the request id, local to a connection
/// and chosen by the client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Frame {
    /// Client to worker: start a request.
    Request {
        /// Request id.
        id: u64,
        /// Budget the worker may spend, in milliseconds, counted from receipt.
        timeout_ms: Option<u64>,
        /// The request.
        request: GenerateRequest,
    },
    /// Client to worker: the caller dropped its stream; stop generating.
    Cancel {
        /// Request id.
        id: u64,
    },
    /// Worker to client: one response. A response with `finish` set is the last one.
    Data {
        /// Request id.
        id: u64,
        /// The response.
        response: GenerateResponse,
    },
    /// Worker to client: the engine stream ended without a finishing response.
    End {
        /// Request id.
        id: u64,
    },
    /// Worker to client: the request failed; no more frames for it.
    Error {
        /// Request id.
        id: u64,
        /// Why.
        error: RemoteError,
    },
    /// Client to worker: send this connection the worker's KV cache event batches from now
    /// on (see [`crate::transport::serve_with_kv_events`]). Sent at most once, first; a worker
    /// without events ignores it.
    KvSubscribe,
    /// Worker to client: one KV event batch, in the v1 encoding of
    /// [`crate::kv_events::encode_events`] (decoded by the client, not here, so a bad batch
    /// costs that worker's index entries, not the connection).
    KvEvents {
        /// The encoded batch.
        payload: Vec<u8>,
    },
    /// Worker to client: the worker is stopping. Requests already sent on this connection are
    /// served to the end; the client sends no new ones after it answers [`Frame::DrainAck`],
    /// and routes new work to other workers. Sent at most once; the worker closes the
    /// connection once the client acknowledged and the in-flight requests finished (or its
    /// drain timeout passed). Appended to the enum: the encoding of every earlier frame is
    /// unchanged, and a client that predates it reads it as a malformed frame and closes the
    /// connection, which is what a stopping worker did to it before.
    Draining,
    /// Client to worker: the answer to [`Frame::Draining`]. Every request the client sent on
    /// this connection before it is served; a `Request` after it is refused with
    /// [`RemoteError::Draining`]. Sent only in reply to `Draining`, so a worker that predates
    /// the pair never receives it.
    DrainAck,
    /// Client to worker: send this connection a snapshot of the worker's KV cache
    /// ([`Frame::KvSnapshotChunk`]s, or [`Frame::KvSnapshotUnavailable`]). Sent after
    /// [`Frame::KvSubscribe`], at most one outstanding per connection. Appended to the enum
    /// (earlier encodings unchanged); a worker that predates it reads a malformed frame and
    /// closes the connection, so a pool mixing builds upgrades workers first.
    KvSnapshotRequest,
    /// Worker to client: one chunk of the snapshot, in order. The chunk is a v1 batch (the
    /// encoding of [`crate::kv_events::encode_events`], at most
    /// [`crate::kv_events::SNAPSHOT_CHUNK_BLOCKS`] blocks, so within
    /// [`crate::transport::MAX_KV_BATCH_BYTES`]): its epoch is the worker's, its seq the chunk's
    /// index from 0, its events Stored chains.
    KvSnapshotChunk {
        /// The last event batch the snapshot is consistent with (`None`: none yet in its
        /// epoch); live batches with a larger seq apply after it.
        seq: Option<u64>,
        /// Whether this is the snapshot's last chunk.
        last: bool,
        /// The encoded chunk.
        payload: Vec<u8>,
    },
    /// Worker to client: the answer to [`Frame::KvSnapshotRequest`] of a worker that takes no
    /// snapshots (the client then relies on live events alone, as before snapshots existed).
    KvSnapshotUnavailable,
    /// Client to worker: send this connection the worker's load reports
    /// ([`Frame::LoadReport`]) from now on. Sent at most once, right after
    /// [`Frame::KvSubscribe`], by a frontend that books prefill work on a load board
    /// ([`ClientConfig::load_reports`](super::ClientConfig::load_reports)); a worker with
    /// reports off ignores it. A subscription of its own rather than a side effect of
    /// `KvSubscribe`: a client that predates reports never receives a frame it cannot decode
    /// (it would close the connection), and a worker that predates them closes the connection
    /// on it as it did on `KvSubscribe` before KV events (turn the client flag off for such a
    /// pool, or upgrade workers first).
    LoadSubscribe,
    /// Worker to client: the worker's load without this connection's own requests, the 24
    /// bytes of [`crate::load_report::LoadReport::encode`] (decoded by the client, not here,
    /// so a bad report is counted and ignored instead of closing the connection). Sent only
    /// to a connection that sent [`Frame::LoadSubscribe`].
    LoadReport {
        /// The encoded report.
        payload: Vec<u8>,
    },
}

impl Frame {
    /// The request the frame belongs to (`None` for the KV event, snapshot, drain and load
    /// frames).
    pub(crate) fn request_id(&self) -> Option<u64> {
        match self {
            Frame::Request { id, .. }
            | Frame::Cancel { id }
            | Frame::Data { id, .. }
            | Frame::End { id }
            | Frame::Error { id, .. } => Some(*id),
            Frame::KvSubscribe
            | Frame::KvEvents { .. }
            | Frame::Draining
            | Frame::DrainAck
            | Frame::KvSnapshotRequest
            | Frame::KvSnapshotChunk { .. }
            | Frame::KvSnapshotUnavailable
            | Frame::LoadSubscribe
            | Frame::LoadReport { .. } => None,
        }
    }
}

/// Decode one frame payload (the bytes after the length prefix).
///
/// Pure and panic-free on any input; allocation is bounded by the payload length (serde caps
/// pre-allocation from length prefixes, and every element consumes at least one input byte).
/// Trailing bytes are rejected so that one payload is exactly one frame.
pub fn decode_frame(payload: &[u8]) -> Result<Frame, FrameError> {
    match postcard::take_from_bytes::<Frame>(payload) {
        Ok((frame, [])) => Ok(frame),
        Ok((_, rest)) => Err(FrameError::Malformed {
            reason: format!("{} trailing bytes", rest.len()),
        }),
        Err(e) => Err(FrameError::Malformed {
            reason: e.to_string(),
        }),
    }
}

/// Encode one frame payload (without the length prefix).
pub fn encode_frame(frame: &Frame) -> Vec<u8> {
    // Serializing these plain data types into a growable Vec cannot fail: postcard only errors
    // on unsupported serde features (none used) or a full fixed buffer (not used here).
    postcard::to_stdvec(frame).unwrap_or_default()
}

/// Encode a frame for sending, refusing payloads above `max`.
pub(crate) fn encode_bounded(frame: &Frame, max: usize) -> Option<Bytes> {
    let payload = encode_frame(frame);
    (payload.len() <= max).then(|| Bytes::from(payload))
}

/// The length-delimited codec both sides use: `u32` big-endian length, then the payload.
pub(crate) fn codec(max_frame_len: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_type::<u32>()
        .max_frame_length(max_frame_len)
        .new_codec()
}

/// Classify an I/O error from the codec: an oversized length prefix is a frame error, anything
/// else is a lost connection.
pub(crate) fn classify_read_error(err: &std::io::Error, max: usize) -> Option<FrameError> {
    err.get_ref()
        .and_then(|inner| inner.downcast_ref::<LengthDelimitedCodecError>())
        .map(|_| FrameError::Oversized { max })
}
