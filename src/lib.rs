//! gradstream: stream gradient tensors as CRC-checked Arrow IPC chunks, in the wire format
//! of ipfrs-transport 0.2.0's gradient-streaming module.
//!
//! `frame` (header + limits), `codec` (payload + CRC), `template` (the constant bytes of
//! our payloads, for the fast paths), `output` (where received values go), `session`
//! (chunking, reassembly) and `stream` (tokio I/O) are plain Rust; `py` is the thin PyO3 layer that the Python package `gradstream` wraps.

pub mod codec;
pub mod dtype;
pub mod error;
pub mod frame;
pub mod output;
pub mod session;
pub mod shape;
pub mod stream;
pub mod template;

mod py;

pub use error::{GradientStreamError, Result};
pub use frame::{
    FrameHeader, Limits, DEFAULT_MAX_GRADIENT_LEN, DEFAULT_MAX_PAYLOAD_LEN, HEADER_LEN,
};
pub use session::{
    ChunkRef, EncodedChunk, FramePlan, FrameReceiver, Reassembler, SessionConfig,
    DEFAULT_CHUNK_SIZE,
};
