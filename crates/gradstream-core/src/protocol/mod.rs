//! The connection protocol's messages (docs/spec/protocol.md), sans-I/O: bytes in, bytes out,
//! no tokio. A `"gradstream"` connection sends, besides frames, a hello each way,
//! optionally a key exchange and an auth message each way, and an ack per transfer; each begins with a
//! 4-byte magic and 8 zero bytes, so that its first 16 bytes tell it from a frame header.
//!
//! - `ack`: `Ack`, the receiver's verdict on a transfer, and `Digest`, what it accepted;
//! - `auth`: the authkey's SPAKE2 exchange, its key exchange and auth messages;
//! - `hello`: `Hello`, `Role`, the first message each way;
//! - `ids`: `transfer_id`, each transfer's seal id, and `Direction`;
//! - `streams`: a connection of several streams: the session secret, the streams and
//!   join messages (the intents of a version 3 hello are `hello`'s);
//! - `describe`: the four messages' magics and common start, and what foreign first bytes
//!   are (an HTTP request, a TLS client, a bare frame header...), for a `ProtocolError`.
//!
//! Uses `error` and `frame` (the limits a hello carries), ring for SHA-256, HMAC and
//! random nonces, and `spake2` for the authkey's exchange; used by the connection driver and the bindings.

pub mod ack;
pub mod auth;
pub mod describe;
pub mod hello;
pub mod ids;
pub mod streams;
#[cfg(test)]
mod testing;

pub use ack::{Ack, Digest, Verdict, ACK_HEAD_LEN, MAX_REASON_LEN};
pub use auth::{
    auth_message, check_modes, parse_auth, parse_pake, Confirmation, Exchange, ScalarSeed,
    AUTH_LEN, ELEMENT_LEN, PAKE_LEN, SEED_LEN,
};
pub use describe::{describe, Kind, START_LEN};
pub use hello::Intent;
pub use hello::{Hello, Role, HELLO_LEN, VERSION};
pub use ids::{transfer_id, Direction, TRANSFER_ID_LEN};
pub use streams::SessionSecret;
