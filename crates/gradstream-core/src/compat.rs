//! The Rust API of ipfrs-transport 0.2.0's gradient-streaming module, under its own names,
//! so that a Rust user of the original can switch the dependency and keep their code:
//! `GradientStreamSession`, `GradientChunk` and `GradientStreamError` (the crate root's).
//!
//! The bytes on the wire are the original's. What differs is what the original let
//! through: duplicate or out-of-range chunks, disagreeing totals, payloads over the
//! limits, trailing bytes and a truncated first header are errors here (docs/spec/decoding-rules.md
//! "Differences from ipfrs-transport 0.2.0"), and `with_compression(true)` really
//! compresses (lz4; the original only stored the flag).
//!
//! Uses `session`, `encoder`/`rules`/`receiver` (through `SessionConfig`'s methods),
//! `stream`, `codec` and `error`; nothing uses it but the crate root.

use crate::codec::{self, Compression};
use crate::error::Result;
use crate::session::{ChunkRef, SessionConfig, DEFAULT_CHUNK_SIZE};

/// One Arrow IPC-encoded chunk of a gradient, with its CRC-32.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradientChunk {
    /// The session that made it (never on the wire).
    pub session_id: String,
    /// Position of this chunk in the gradient, from 0.
    pub chunk_index: u32,
    /// Chunks in the gradient.
    pub total_chunks: u32,
    /// The payload: an Arrow IPC file holding this chunk's values.
    pub arrow_ipc_bytes: Vec<u8>,
    /// CRC-32 (IEEE) of `arrow_ipc_bytes`.
    pub checksum: u32,
}

impl GradientChunk {
    /// CRC-32 (IEEE 802.3, as zlib computes it) of `data`.
    pub fn compute_checksum(data: &[u8]) -> u32 {
        codec::checksum(data)
    }

    /// Whether `checksum` is the CRC-32 of `arrow_ipc_bytes`.
    pub fn verify_checksum(&self) -> bool {
        Self::compute_checksum(&self.arrow_ipc_bytes) == self.checksum
    }
}

/// A gradient-streaming session: splits gradients into Arrow IPC chunks and puts them
/// back together, in memory or over a tokio byte stream.
#[derive(Debug, Clone)]
pub struct GradientStreamSession {
    config: SessionConfig,
}

impl GradientStreamSession {
    /// A session whose chunks hold `chunk_size` values (0 is raised to 1).
    pub fn new(session_id: &str, chunk_size: usize) -> Self {
        Self {
            config: SessionConfig::new(session_id, chunk_size),
        }
    }

    /// A session with the default chunk size, 65,536 values (256 KiB of float32).
    pub fn with_defaults(session_id: &str) -> Self {
        Self::new(session_id, DEFAULT_CHUNK_SIZE)
    }

    /// The same session, compressing its payloads with lz4 (Arrow IPC buffer compression)
    /// or not. Receivers of gradstream read either; the original crate may not read
    /// compressed payloads, so leave it off when the peer is the original.
    pub fn with_compression(mut self, enabled: bool) -> Self {
        self.config.compression = enabled.then_some(Compression::Lz4);
        self
    }

    pub fn is_compression_enabled(&self) -> bool {
        self.config.compression.is_some()
    }

    pub fn session_id(&self) -> &str {
        &self.config.session_id
    }

    /// Values per chunk.
    pub fn chunk_size(&self) -> usize {
        self.config.chunk_size
    }

    /// The settings behind this session (limits, layout...), for the rest of the crate's
    /// API.
    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// Split `gradient` into chunks, each an Arrow IPC file with its CRC-32; an empty
    /// gradient is one chunk holding no values.
    pub fn encode_gradient(&self, gradient: &[f32]) -> Result<Vec<GradientChunk>> {
        let chunks = self.config.encode_gradient(gradient)?;
        Ok(chunks
            .into_iter()
            .map(|c| GradientChunk {
                session_id: self.config.session_id.clone(),
                chunk_index: c.chunk_index,
                total_chunks: c.total_chunks,
                arrow_ipc_bytes: c.payload,
                checksum: c.checksum,
            })
            .collect())
    }

    /// Put chunks given in any order back together, checking each one's CRC-32 first. No
    /// chunks: an empty gradient.
    pub fn decode_chunks(&self, chunks: Vec<GradientChunk>) -> Result<Vec<f32>> {
        let refs = chunks
            .iter()
            .map(|c| ChunkRef {
                chunk_index: c.chunk_index,
                total_chunks: c.total_chunks,
                checksum: c.checksum,
                payload: &c.arrow_ipc_bytes,
            })
            .collect();
        self.config.decode_chunks(refs)
    }
}

#[cfg(feature = "tokio")]
impl GradientStreamSession {
    /// Write `gradient` to `stream` as frames (16-byte header, then the payload), chunk by
    /// chunk; the number of chunks sent.
    pub async fn stream_to<S>(&self, gradient: &[f32], stream: &mut S) -> Result<usize>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let progress = crate::stream::Progress::default();
        crate::stream::send_gradient(&self.config, gradient, stream, None, &progress).await
    }

    /// Read one gradient's frames from `stream`, checking each as it arrives, and nothing
    /// past its last frame. A stream that ends before the first byte gives an empty
    /// gradient, as in the original.
    pub async fn receive_from<S>(&self, stream: &mut S) -> Result<Vec<f32>>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let progress = crate::stream::Progress::default();
        let receiver = self.config.receiver();
        let ended = crate::stream::receive_gradient(receiver, stream, None, &progress).await?;
        let values = match ended {
            crate::receiver::Ended::Gradient(values) => values,
            crate::receiver::Ended::BeforeFirstByte(receiver) => receiver.finish()?,
        };
        Ok(values.into_vec())
    }
}
