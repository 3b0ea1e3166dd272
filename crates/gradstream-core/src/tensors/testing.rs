//! What the tensor-set tests share (test builds only): sets of every dtype and shape
//! (0-d, empty, non-ASCII names), their gradients, manifest frames of any text, a
//! tensor's frames, and the parts of a noted error.
//!
//! Uses the set's modules, `encoder` and `testing`; nothing depends on it but tests.

use super::manifest::Entry;
use crate::dtype::Dtype;
use crate::encoder::{Gradient, GradientMeta};
use crate::error::GradientStreamError;
use crate::session::SessionConfig;
use crate::shape::shape_text;

/// Value i of a tensor: i * M + seed modulo 2^bits, as the dtype's bits (NaNs and
/// infinities included), as `tests/tensors/test_tensor_wire_golden.py` makes them.
pub(crate) fn pattern(dtype: Dtype, n: usize, seed: u64) -> Vec<u8> {
    (0..n as u64)
        .flat_map(|i| match dtype.width() {
            2 => (i.wrapping_mul(40503).wrapping_add(seed) as u16)
                .to_ne_bytes()
                .to_vec(),
            4 => (i.wrapping_mul(2_654_435_761).wrapping_add(seed) as u32)
                .to_ne_bytes()
                .to_vec(),
            _ => i
                .wrapping_mul(11_400_714_819_323_198_485)
                .wrapping_add(seed)
                .to_ne_bytes()
                .to_vec(),
        })
        .collect()
}

/// Entries with their values, from (name, dtype, shape, seed).
pub(crate) fn set_of(specs: &[(&str, Dtype, Vec<usize>, u64)]) -> Vec<(Entry, Vec<u8>)> {
    specs
        .iter()
        .map(|(name, dtype, shape, seed)| {
            let entry = Entry::new(*name, *dtype, shape.clone());
            let raw = pattern(*dtype, entry.len(), *seed);
            (entry, raw)
        })
        .collect()
}

/// Every dtype, 0-d and empty tensors, names out of order and not ASCII.
pub(crate) fn mixed() -> Vec<(Entry, Vec<u8>)> {
    use Dtype::*;
    set_of(&[
        ("layer.w", F16, vec![3, 4], 1),
        ("scale", F32, vec![], 2),
        ("empty", F64, vec![0, 3], 3),
        ("\u{3b2}/\u{fc} name", F32, vec![7], 4),
        ("bf", BF16, vec![5], 5),
        ("d", F64, vec![2, 3, 2], 6),
    ])
}

/// The set as the senders take it.
pub(crate) fn gradients(set: &[(Entry, Vec<u8>)]) -> Vec<(Entry, Gradient<'_>)> {
    set.iter()
        .map(|(entry, raw)| (entry.clone(), Gradient::new(raw, entry.dtype)))
        .collect()
}

/// A manifest frame holding any text.
pub(crate) fn manifest_of(config: &SessionConfig, text: &str) -> Vec<u8> {
    let meta = GradientMeta {
        manifest: Some(text.into()),
        ..GradientMeta::default()
    };
    config
        .encode_frames(Gradient::from(&[][..]).with_meta(&meta))
        .unwrap()
}

/// The frames of values of `dtype` in `shape` (keep_shape, keep_dtype; None: no shape).
pub(crate) fn frames(
    config: &SessionConfig,
    dtype: Dtype,
    shape: Option<&[usize]>,
    raw: &[u8],
) -> Vec<u8> {
    let meta = GradientMeta {
        shape: shape.map(|s| shape_text(s).into()),
        ..GradientMeta::default()
    };
    config
        .encode_frames(Gradient::new(raw, dtype).with_meta(&meta))
        .unwrap()
}

/// An error's innermost error and its notes, outermost last.
pub(crate) fn unnoted(mut error: GradientStreamError) -> (GradientStreamError, Vec<String>) {
    let mut notes = Vec::new();
    while let GradientStreamError::Noted { error: inner, note } = error {
        notes.insert(0, note);
        error = *inner;
    }
    (error, notes)
}
