//! One chunk's payload: an Arrow IPC *file* in the original's "seed layout", and its CRC-32.
//!
//! Encoding writes one record batch of `index: Int32` (0..n-1) and `value: Float32`, both
//! non-nullable, so that ipfrs-transport's decoder reads what we send. Decoding accepts
//! what the original accepts (any IPC file whose `value` column is Float32, other columns
//! ignored, batches concatenated) but treats the bytes as hostile: every block the footer
//! names is bounds-checked before arrow-rs slices it, only the `value` column is decoded,
//! and a panic inside arrow-rs becomes an error instead of unwinding into Python.
//!
//! This file only names the parts and re-exports what callers use; arrows point down:
//!
//! - `reader`: `decode_payload` (footer, schema and `value` column into a `ValueSink`),
//!   using `guard` (the checks on footer, blocks and compressed buffers before arrow-rs
//!   sees them), which uses `bounds` (what each compressed buffer may declare, from the
//!   schema's columns);
//! - `writer`: `encode_payload*`, the schemas, `Layout`, `Compression`, `Encoding`;
//! - `shared`: what both sides use (the CRC, metadata keys, the borrowed Arrow buffer);
//! - `copy`: value bytes into large destinations at memcpy's speed (streaming stores,
//!   the copy fused with the CRC), for the templates and the outputs.
//!
//! Outside the codec it uses `dtype`, `error` and `output` (`Head`, `ValueSink`).

mod bounds;
mod copy;
mod guard;
mod reader;
mod shared;
mod writer;

pub use copy::{copy_and_crc, Stores};
pub use reader::decode_payload;
pub use shared::{checksum, MANIFEST_KEY, SHAPE_KEY};
pub(crate) use writer::{
    append_payload, encode_payload, encode_payload_exact, encode_payload_raw, Encoding,
};
pub use writer::{Compression, Layout};
