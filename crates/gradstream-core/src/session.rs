//! A session's settings: `SessionConfig` (chunk size, compression, layout, limits, how
//! bfloat16 is handed back, standalone sealing), the default chunk size, and `ChunkRef`, the chunk a caller
//! hands to `decode_chunks`. Settings only: what belongs to one gradient (its shape, the
//! dtype it is handed back in, a tensor set's manifest) travels with that gradient
//! (`encoder::Gradient`), and the timeout is an argument of the tokio I/O (`stream`).
//!
//! The semantics are those of ipfrs-transport's `GradientStreamSession`, with the
//! original's silent failures (duplicates, out-of-range indices, disagreeing totals,
//! trailing bytes) turned into errors; the methods live beside the code they drive:
//! `encoder` (encoding and planning), `rules` (`decode_chunks`), `receiver`
//! (`decode_frames`, the receivers). Dependencies point down only: this file uses
//! `codec` (its setting types), `dtype`, `frame`, `seal` and `template` (the session's
//! templates), none of which uses it.

use crate::codec::{Compression, Layout};
use crate::frame::Limits;
use crate::seal::SealCheck;
pub use crate::template::Templates;

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
    /// Columns of the payloads this session writes (it reads either).
    pub layout: Layout,
    /// Hand bfloat16 gradients back as float32 (an exact widening): for a caller with no
    /// bfloat16 type (Python without ml_dtypes).
    pub bf16_as_f32: bool,
    /// Standalone sealed chunks (docs/spec/decoding-rules.md): the senders seal each
    /// gradient (or tensor set) with a fresh random transfer id, and the receivers expect
    /// every chunk sealed, all with the first chunk's id (`SealCheck::Consistent`).
    /// Without it, receivers still verify the seals they find (`SealCheck::WhenPresent`). The seal
    /// itself is per transfer: it travels with the gradient (`Gradient::sealed`), and a
    /// connection's exact expectation with its receiver (`FrameReceiver::expect_seal`).
    pub seal: bool,
    /// The templates of this session's payloads (the fast paths of its encoders and
    /// decoders), shared by its clones and dropped with the last of them. A cache, not a
    /// setting: configs compare equal whatever theirs hold.
    pub templates: Templates,
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
    /// What this session's receivers expect of seals when the caller says nothing more
    /// (a connection says `SealCheck::Exact`): `Consistent` when it seals (one required),
    /// else `WhenPresent` (a seal found is verified all the same).
    pub fn seal_check(&self) -> SealCheck {
        if self.seal {
            SealCheck::Consistent
        } else {
            SealCheck::WhenPresent
        }
    }

    pub fn new(session_id: impl Into<String>, chunk_size: usize) -> Self {
        Self {
            session_id: session_id.into(),
            chunk_size: chunk_size.max(1),
            compression: None,
            limits: Limits::default(),
            layout: Layout::Seed,
            bf16_as_f32: false,
            seal: false,
            templates: Templates::new(),
        }
    }
}
