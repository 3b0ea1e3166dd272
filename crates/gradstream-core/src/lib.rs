//! gradstream-core: stream gradient tensors as CRC-32-checked Arrow IPC chunks, in the wire
//! format of ipfrs-transport 0.2.0's gradient-streaming module, with every input from a
//! peer treated as hostile. Plain Rust: no Python anywhere in this crate.
//!
//! The original's API sits at the root, under the original's names:
//! [`GradientStreamSession`], [`GradientChunk`] and [`GradientStreamError`] (module
//! `compat`). The modules below it, each with one job, arrows pointing down (a module
//! uses only those listed after it):
//!
//! - `connection` (feature `tls`): connections between two gradstream peers (dialling,
//!   listening, the handshake, sealed and acknowledged transfers), over TCP or `tls`;
//! - `protocol`: the connection protocol's messages, sans-I/O (hello, auth, ack, transfer
//!   ids, and what foreign first bytes are), over `frame` and `error` only;
//! - `tls` (feature `tls`): TLS 1.3 over tokio with rustls, `TlsAcceptor` and
//!   `TlsConnector`, over `error` only;
//! - `tensors`: tensor sets, named tensors of any dtype and shape behind one manifest
//!   (its JSON, the sender, the sans-I/O receiver, and, with `tokio`, the stream I/O);
//! - `at_hand`: a receive over bytes a socket already holds, and (feature `tokio`) the
//!   rest of a send begun on the caller's thread: the bindings' fast path;
//! - `stream` (feature `tokio`): the sender and receiver over any tokio byte stream;
//! - `receiver`: `FrameReceiver`, the sans-I/O push decoder of a frame stream, and
//!   `decode_frames`;
//! - `reassembler`: `Reassembler`, one gradient put together from frames in any order;
//! - `rules`: the decoding rules both receiving paths share, and `decode_chunks`;
//! - `encoder`: `Gradient`, `FramePlan`, chunking and `encode_frames`/`encode_gradient`;
//! - `session`: `SessionConfig`, a session's settings, and `ChunkRef`;
//! - `template` (the constant bytes of our own payloads, for the fast paths; a session's
//!   bounded `Templates`);
//! - `codec` (one payload: `writer`, `reader`, and `guard`, the checks on hostile input
//!   before arrow-rs sees it; CRC-32);
//! - `output` (where received values go, and the `ValueSink` the reader writes through);
//! - `int8` (the int8 wire's blockwise quantization, for the codec);
//! - `frame` (the 16-byte header and the limits), `shape`, `dtype`, `seal` (metadata
//!   rules: the seal's `TransferId`, `Position`, `Seal` and the receiver's `SealCheck`);
//! - `error`: the one error type.
//!
//! Nothing in the crate is process-wide: a session's templates are its own
//! (`SessionConfig::templates`), and a forked child needs no handler to use the crate.

pub mod at_hand;
#[cfg(feature = "tokio")]
mod clock;
pub mod codec;
mod compat;
#[cfg(feature = "tls")]
pub mod connection;
pub mod direct;
pub mod dtype;
pub mod encoder;
pub mod error;
pub mod frame;
pub mod int8;
pub mod output;
pub mod protocol;
mod reassembler;
pub mod receiver;
mod rules;
pub mod seal;
pub mod session;
pub mod shape;
#[cfg(target_os = "linux")]
pub mod shm;
#[cfg(feature = "tokio")]
pub mod stream;
mod template;
pub mod tensors;
#[cfg(test)]
mod testing;
#[cfg(feature = "tls")]
pub mod tls;

pub use compat::{GradientChunk, GradientStreamSession};
pub use encoder::{EncodedChunk, FramePlan, Gradient, GradientMeta};
pub use error::{ArrowIpcDetail, GradientStreamError, Result};
pub use frame::{
    FrameHeader, Limits, DEFAULT_MAX_GRADIENT_LEN, DEFAULT_MAX_PAYLOAD_LEN, HEADER_LEN,
};
pub use reassembler::Reassembler;
pub use receiver::FrameReceiver;
pub use seal::{Position, Seal, SealCheck, TransferId};
pub use session::{ChunkRef, SessionConfig, DEFAULT_CHUNK_SIZE};
