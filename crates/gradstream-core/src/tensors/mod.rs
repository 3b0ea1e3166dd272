//! Tensor sets (README "Tensor sets"): named tensors of any dtype and shape sent as one
//! transfer, a manifest frame first, then each tensor as the frames of a gradient that
//! keeps its shape and dtype.
//!
//! - `json`: the manifest's strict JSON reader, and the writer of what it reads;
//! - `ascii`: compact ASCII JSON, how messages quote names and values.
//!
//! Uses the crate's error only so far; nothing of the crate uses it.

pub mod ascii;
pub mod json;
