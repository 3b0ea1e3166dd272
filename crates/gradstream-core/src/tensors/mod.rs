//! Tensor sets (README "Tensor sets"): named tensors of any dtype and shape sent as one
//! transfer, a manifest frame first, then each tensor as the frames of a gradient that
//! keeps its shape and dtype.
//!
//! - `manifest`: `Entry`, names, the manifest's text written and read (receiver rule 2);
//! - `json`: the manifest's strict JSON reader, and the writer of what it reads;
//! - `ascii`: compact ASCII JSON, how messages quote names and values.
//!
//! Uses the crate's `dtype`, `shape` and `error`; nothing of the crate uses it.

pub mod ascii;
pub mod json;
pub mod manifest;

pub use manifest::{check_name, manifest_json, read_manifest, Entry};
