//! A session's settings: `SessionConfig` (chunk size, compression, layout, limits,
//! timeout, and the per-call metadata the bindings set), the default chunk size, and
//! `ChunkRef`, the chunk a caller hands to `decode_chunks`.
//!
//! The semantics are those of ipfrs-transport's `GradientStreamSession`, with the
//! original's silent failures (duplicates, out-of-range indices, disagreeing totals,
//! trailing bytes) turned into errors; the methods live beside the code they drive:
//! `encoder` (encoding and planning), `rules` (`decode_chunks`), `receiver`
//! (`decode_frames`, the receivers). Dependencies point down only: this file uses
//! `codec` (its setting types), `dtype` and `frame`, none of which uses it.

use crate::codec::{Compression, Layout};
use crate::dtype::Dtype;
use crate::frame::Limits;

/// Default chunk size: 65,536 f32 values, 256 KiB of gradient.
pub const DEFAULT_CHUNK_SIZE: usize = 65_536;

/// A session's settings. The session id never goes on the wire; it labels chunks locally.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionConfig {
    pub session_id: String,
    /// Values per chunk; never 0 (the original raises 0 to 1).
    pub chunk_size: usize,
    /// Arrow IPC buffer compression of the payloads this session writes (it reads any).
    pub compression: Option<Compression>,
    pub limits: Limits,
    /// Longest wait for a byte to move, on streams; None waits for ever.
    pub timeout: Option<std::time::Duration>,
    /// Columns of the payloads this session writes (it reads either).
    pub layout: Layout,
    /// The `gradient_shape` text to write into every payload, for the gradient being
    /// encoded: set per call by the bindings when the Python session keeps shapes.
    pub shape: Option<std::sync::Arc<str>>,
    /// The `gradient_dtype` to write into every payload (the dtype the receiver hands
    /// back, when not the wire's): set per call by the bindings.
    pub result: Option<Dtype>,
    /// A tensor set's manifest, written into the payload of the set's first gradient.
    pub manifest: Option<std::sync::Arc<str>>,
}

/// A chunk to decode, borrowed from wherever the caller keeps it.
#[derive(Clone, Copy, Debug)]
pub struct ChunkRef<'a> {
    pub chunk_index: u32,
    pub total_chunks: u32,
    pub checksum: u32,
    pub payload: &'a [u8],
}

impl SessionConfig {
    pub fn new(session_id: impl Into<String>, chunk_size: usize) -> Self {
        Self {
            session_id: session_id.into(),
            chunk_size: chunk_size.max(1),
            compression: None,
            limits: Limits::default(),
            timeout: None,
            layout: Layout::Seed,
            shape: None,
            result: None,
            manifest: None,
        }
    }
}
