//! gradstream-core: stream gradient tensors as CRC-32-checked Arrow IPC chunks, in the wire
//! format of ipfrs-transport 0.2.0's gradient-streaming module, with every input from a
//! peer treated as hostile. Plain Rust: no Python anywhere in this crate.
//!
//! The original's API sits at the root, under the original's names:
//! [`GradientStreamSession`], [`GradientChunk`] and [`GradientStreamError`] (module
//! `compat`). The modules below it, each with one job, arrows pointing down:
//!
//! - `session`: chunking, reassembly and the sans-I/O receiver (the decoding rules);
//! - `stream` (feature `tokio`): the sender and receiver over any tokio byte stream;
//! - `codec` (one payload: Arrow IPC encode/decode, CRC-32), `template` (the constant
//!   bytes of our own payloads, for the fast paths), `output` (where received values go);
//! - `frame` (the 16-byte header and the limits), `shape`, `dtype` (metadata rules);
//! - `error`: the one error type.

pub mod codec;
mod compat;
pub mod dtype;
pub mod error;
pub mod frame;
pub mod output;
pub mod session;
pub mod shape;
#[cfg(feature = "tokio")]
pub mod stream;
pub mod template;

pub use compat::{GradientChunk, GradientStreamSession};
pub use error::{ArrowIpcDetail, GradientStreamError, Result};
pub use frame::{
    FrameHeader, Limits, DEFAULT_MAX_GRADIENT_LEN, DEFAULT_MAX_PAYLOAD_LEN, HEADER_LEN,
};
pub use session::{
    ChunkRef, EncodedChunk, FramePlan, FrameReceiver, Reassembler, SessionConfig,
    DEFAULT_CHUNK_SIZE,
};
