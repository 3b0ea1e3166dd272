//! Tensor sets (docs/guides/tensor-sets.md): named tensors of any dtype and shape sent as one
//! transfer, a manifest frame first, then each tensor as the frames of a gradient that
//! keeps its shape and dtype. Everything the Python set layers do but the conversion of
//! Python objects, so that a binding crosses into Rust once per set. Here too: the note an
//! error met on one tensor carries (`note`, `Doing`).
//!
//! - `stream` (feature `tokio`): `send_tensors` and `receive_tensors`;
//! - `decode`: `decode_tensors`, a set in memory;
//! - `receive`: `TensorSetReceiver`, the sans-I/O receiver of a set;
//! - `encode`: the sender's checks, the manifest frame, `encode_tensors`;
//! - `manifest`: `Entry`, names, the manifest's text written and read (receiver rule 2);
//! - `json`: the manifest's strict JSON reader, and the writer of what it reads;
//! - `ascii`: compact ASCII JSON, how messages quote names and values.
//!
//! Uses the crate's encoder, receiver, output and stream; nothing of the crate uses it.

pub mod ascii;
pub mod decode;
pub mod encode;
pub mod json;
pub mod manifest;
pub mod receive;
#[cfg(feature = "tokio")]
pub mod stream;
#[cfg(test)]
mod testing;

pub use decode::decode_tensors;
pub use encode::{encode_tensors, encode_tensors_sealed, manifest_frame, MANIFEST_CAP};
pub use manifest::{check_name, manifest_json, read_manifest, Entry};
pub use receive::{TensorSet, TensorSetReceiver};
#[cfg(feature = "tokio")]
pub use stream::{receive_tensor_set, receive_tensors, send_tensors, send_tensors_sealed};

/// What was being done with a tensor when an error was met, as its note says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Doing {
    Encoding,
    Sending,
    Receiving,
}

impl Doing {
    fn word(self) -> &'static str {
        match self {
            Self::Encoding => "encoding",
            Self::Sending => "sending",
            Self::Receiving => "receiving",
        }
    }
}

/// The note of an error met on tensor `k` of `n` (from 1):
/// `while receiving tensor "fc.weight" (3 of 100) of a tensor set`.
pub fn note(doing: Doing, name: &str, k: usize, n: usize) -> String {
    format!(
        "while {} tensor {} ({k} of {n}) of a tensor set",
        doing.word(),
        ascii::quote_str(name)
    )
}
