//! The sending side of a tensor set, in memory: the checks made before anything is
//! encoded (every name, then each tensor's shape and values), the manifest frame (refused
//! when a receiver would refuse it for its size), each tensor as a keep_shape, keep_dtype
//! gradient in the session's wire dtype, the set's seal (one transfer id for all its
//! frames: the manifest at position `Manifest`, tensor k at `Tensor(k)`), and
//! `encode_tensors`, which joins them. The unsealed bytes are those the Python set layer
//! wrote over the native codec; `tests/tensors/test_tensor_wire_golden.py` records some.
//!
//! Uses `manifest`, the crate's encoder, `seal`, `shape` and `session`; used by `stream`
//! (the tokio sender) and by the bindings.

use std::collections::HashSet;

use super::manifest::{check_name, manifest_json, Entry};
use super::{note, Doing};
use crate::dtype::WireDtype;
use crate::encoder::{Gradient, GradientMeta};
use crate::error::{GradientStreamError, Result};
use crate::frame::HEADER_LEN;
use crate::seal::{Position, Seal, TransferId};
use crate::session::SessionConfig;
use crate::shape::shape_text;

/// The most a manifest frame's payload may take (receiver rule 1): 16 MiB, or the
/// session's max_payload_len when smaller.
pub const MANIFEST_CAP: u32 = 16 << 20;

/// The max_payload_len a manifest frame is written and read under.
pub fn manifest_cap(config: &SessionConfig) -> u32 {
    config.limits.max_payload_len.min(MANIFEST_CAP)
}

/// The transfer id of a set a session sends on its own: a fresh random one when it seals
/// (`SessionConfig::seal`), else none.
pub fn set_transfer(config: &SessionConfig) -> Result<Option<TransferId>> {
    Ok(config.draw_seal()?.map(|seal| seal.transfer))
}

/// The seal of the set's gradient at `position`, when the set is sealed (`transfer`).
pub fn set_seal(transfer: Option<TransferId>, position: Position) -> Option<Seal> {
    transfer.map(|transfer| Seal { transfer, position })
}

/// The seal of tensor `k` (from 0) of a set sealed with `transfer`.
pub fn tensor_seal(transfer: Option<TransferId>, k: usize) -> Option<Seal> {
    // A manifest of at most 16 MiB lists far fewer than 2^32 - 2 tensors.
    set_seal(transfer, Position::Tensor(k as u32))
}

/// The set's manifest frame: chunk 0 of 1, an empty float32 gradient whose payload's
/// schema metadata `gradstream_tensors` is the manifest's text, in the session's layout
/// and compression, sealed as the set's manifest when the set is sealed (`transfer`).
/// `TensorSet` when a receiver with this session's max_payload_len would refuse it for
/// its size (the JSON alone first: the payload holds it twice).
pub fn manifest_frame(
    config: &SessionConfig,
    entries: &[Entry],
    transfer: Option<TransferId>,
) -> Result<Vec<u8>> {
    let cap = manifest_cap(config);
    let text = manifest_json(entries);
    let too_big = |what: String| {
        GradientStreamError::tensor_set(
            format!(
                "the tensor set's manifest takes {what}, above the {cap}-byte limit of a \
                 manifest frame (max_payload_len, at most {MANIFEST_CAP}): send fewer \
                 tensors per set or shorter names"
            ),
            None,
        )
    };
    if text.len() > cap as usize {
        return Err(too_big(format!("{} bytes of JSON", text.len())));
    }
    let meta = GradientMeta {
        manifest: Some(text.into()),
        ..GradientMeta::default()
    };
    // Written without the cap (the text is bounded above), to tell its size.
    let mut unlimited = config.clone();
    unlimited.limits.max_payload_len = u32::MAX;
    let seal = set_seal(transfer, Position::Manifest);
    let empty = Gradient::from(&[][..]).with_meta(&meta).seal_with(seal);
    let frame = unlimited.encode_frames(empty)?;
    let payload = frame.len() - HEADER_LEN;
    if payload > cap as usize {
        return Err(too_big(format!("{payload} bytes")));
    }
    Ok(frame)
}

/// The metadata of a tensor's payloads: its shape, and its own dtype when it travels as
/// another (`wire`; the int8 wire reads back as float32).
pub fn tensor_meta(entry: &Entry, wire: Option<WireDtype>) -> GradientMeta {
    let carrier = wire.map_or(entry.dtype, WireDtype::carrier);
    GradientMeta {
        shape: Some(shape_text(&entry.shape).into()),
        result: (carrier != entry.dtype).then_some(entry.dtype),
        manifest: None,
    }
}

/// A tensor as a keep_shape, keep_dtype session with `wire_dtype` sends it: its values in
/// its own dtype, cast to the wire dtype as they are encoded, with `meta`
/// (`tensor_meta`). Whatever cast, metadata or seal `values` had is replaced (the set's
/// sender seals it with `tensor_seal`).
pub fn tensor_gradient<'g>(
    entry: &Entry,
    values: &Gradient<'g>,
    wire_dtype: Option<WireDtype>,
    meta: &'g GradientMeta,
) -> Gradient<'g> {
    Gradient::new(values.raw(), entry.dtype)
        .travel_as(wire_dtype)
        .with_meta(meta)
}

/// The checks made before anything is encoded or sent: every name (none noted), then each
/// tensor's shape and values against its entry, noted with `doing`.
pub fn check_tensors(tensors: &[(Entry, Gradient<'_>)], doing: Doing) -> Result<()> {
    check_first_tensors(tensors, doing, tensors.len())
}

/// `check_tensors` on the first tensors of a set of `n` (those converted so far, when a
/// binding's conversion of the next one failed): the notes count the whole set.
pub fn check_first_tensors(
    tensors: &[(Entry, Gradient<'_>)],
    doing: Doing,
    n: usize,
) -> Result<()> {
    let mut taken = HashSet::with_capacity(tensors.len());
    for (entry, _) in tensors {
        check_name(&entry.name, &mut taken)?;
    }
    for (k, (entry, values)) in tensors.iter().enumerate() {
        check_tensor(entry, values).map_err(|e| e.noted(note(doing, &entry.name, k + 1, n)))?;
    }
    Ok(())
}

/// A tensor's shape (`Entry::check_shape`), and values that are its entry's: of its
/// dtype, as many as its shape holds.
fn check_tensor(entry: &Entry, values: &Gradient<'_>) -> Result<()> {
    entry.check_shape()?;
    if values.dtype() == entry.dtype && values.len() == entry.len() {
        return Ok(());
    }
    Err(GradientStreamError::tensor_set(
        format!(
            "tensor {} is given as {} {} values; its entry says {} {}",
            super::ascii::quote_str(&entry.name),
            values.len(),
            values.dtype().name(),
            entry.dtype.name(),
            shape_text(&entry.shape)
        ),
        Some(&entry.name),
    ))
}

/// The frames of a tensor set, joined: the manifest's, then each tensor's (as
/// `encode_frames` writes it for a keep_shape, keep_dtype session with `wire_dtype`).
/// Each tensor's `Gradient` holds its values in its entry's dtype
/// (`Gradient::new(raw, entry.dtype)`). Errors met on a tensor are noted
/// `while encoding tensor "name" (k of n) of a tensor set`. Sealed with a fresh random
/// id when the session seals.
pub fn encode_tensors(
    config: &SessionConfig,
    wire_dtype: Option<WireDtype>,
    tensors: &[(Entry, Gradient<'_>)],
) -> Result<Vec<u8>> {
    encode_set(config, wire_dtype, tensors, set_transfer(config)?)
}

/// `encode_tensors`, every frame sealed with `transfer` (a connection's id).
pub fn encode_tensors_sealed(
    config: &SessionConfig,
    wire_dtype: Option<WireDtype>,
    tensors: &[(Entry, Gradient<'_>)],
    transfer: TransferId,
) -> Result<Vec<u8>> {
    encode_set(config, wire_dtype, tensors, Some(transfer))
}

fn encode_set(
    config: &SessionConfig,
    wire_dtype: Option<WireDtype>,
    tensors: &[(Entry, Gradient<'_>)],
    transfer: Option<TransferId>,
) -> Result<Vec<u8>> {
    check_tensors(tensors, Doing::Encoding)?;
    let entries: Vec<Entry> = tensors.iter().map(|(entry, _)| entry.clone()).collect();
    let mut out = manifest_frame(config, &entries, transfer)?;
    let n = tensors.len();
    for (k, (entry, values)) in tensors.iter().enumerate() {
        let append = |out: &mut Vec<u8>| -> Result<()> {
            let meta = tensor_meta(entry, wire_dtype);
            let gradient = tensor_gradient(entry, values, wire_dtype, &meta)
                .seal_with(tensor_seal(transfer, k));
            let plan = config.plan_frames(gradient)?;
            let start = out.len();
            out.resize(start + plan.len(), 0);
            config.write_frames(&plan, &mut out[start..])
        };
        append(&mut out).map_err(|e| e.noted(note(Doing::Encoding, &entry.name, k + 1, n)))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{gradients, mixed, set_of};
    use super::*;
    use crate::codec::Layout;
    use crate::dtype::Dtype;
    use crate::testing::bytes_of;

    fn encoded(
        config: &SessionConfig,
        wire: Option<WireDtype>,
        set: &[(Entry, Vec<u8>)],
    ) -> Vec<u8> {
        encode_tensors(config, wire, &gradients(set)).unwrap()
    }

    #[test]
    fn sets_match_the_recorded_python_bytes() {
        use Dtype::*;
        let mixed = mixed();
        let session = |chunk_size, layout| {
            let mut s = SessionConfig::new("golden", chunk_size);
            s.layout = layout;
            s
        };
        // (the set's bytes, their CRC-32 and length as Python wrote them)
        let cases = [
            (
                encoded(&session(4, Layout::Seed), None, &mixed),
                150_289_276,
                14_218,
            ),
            (
                encoded(
                    &session(5, Layout::Compact),
                    Some(WireDtype::Float(BF16)),
                    &mixed,
                ),
                2_610_481_093,
                13_864,
            ),
            (
                encoded(
                    &session(65536, Layout::Seed),
                    Some(WireDtype::Float(F64)),
                    &set_of(&[("a", F32, vec![10], 7), ("b", F16, vec![2, 2], 8)]),
                ),
                4_141_625_934,
                3_430,
            ),
            (
                encoded(&session(65536, Layout::Seed), None, &[]),
                790_166_562,
                1_034,
            ),
        ];
        for (k, (wire, crc, len)) in cases.iter().enumerate() {
            assert_eq!(
                (crc32fast::hash(wire), wire.len()),
                (*crc, *len),
                "case {k}"
            );
        }
    }

    #[test]
    fn a_manifest_frame_too_large_for_a_receiver_is_refused() {
        let mut s = SessionConfig::new("m", 4);
        let entries: Vec<Entry> = (0..20)
            .map(|i| Entry::new(format!("tensor.{i:02}"), Dtype::F32, vec![1]))
            .collect();
        let frame = manifest_frame(&s, &entries, None).unwrap();
        let payload = frame.len() - HEADER_LEN;
        s.limits.max_payload_len = payload as u32;
        assert_eq!(manifest_frame(&s, &entries, None).unwrap(), frame);
        s.limits.max_payload_len = payload as u32 - 1;
        assert_eq!(
            manifest_frame(&s, &entries, None).unwrap_err().to_string(),
            format!(
                "the tensor set's manifest takes {payload} bytes, above the {}-byte limit of a \
                 manifest frame (max_payload_len, at most 16777216): send fewer tensors per set \
                 or shorter names",
                payload - 1
            )
        );
        s.limits.max_payload_len = 100;
        let json = manifest_json(&entries).len();
        assert!(manifest_frame(&s, &entries, None)
            .unwrap_err()
            .to_string()
            .starts_with(&format!(
                "the tensor set's manifest takes {json} bytes of JSON, above the 100-byte"
            )));
        // The 16 MiB cap, whatever the session allows.
        s.limits.max_payload_len = u32::MAX;
        let many: Vec<Entry> = (0..200_000)
            .map(|i| Entry::new(format!("{i:07}{}", "x".repeat(80)), Dtype::F32, vec![]))
            .collect();
        let err = manifest_frame(&s, &many, None).unwrap_err().to_string();
        assert!(
            err.contains("bytes of JSON, above the 16777216-byte limit"),
            "{err}"
        );
    }

    #[test]
    fn names_and_tensors_are_checked_before_anything_is_encoded() {
        let s = SessionConfig::new("c", 4);
        let raw = bytes_of(Dtype::F32, 2);
        let g = Gradient::new(&raw, Dtype::F32);
        let two = |a: &str, b: &str| {
            vec![
                (Entry::new(a, Dtype::F32, vec![2]), g),
                (Entry::new(b, Dtype::F32, vec![2]), g),
            ]
        };
        let err = encode_tensors(&s, None, &two("a", "a")).unwrap_err();
        assert_eq!(
            err,
            GradientStreamError::tensor_set(
                r#"tensor name "a" appears twice in the tensor set"#,
                Some("a")
            )
        );
        // A name is checked before the tensors: the bad second tensor is not reached.
        let mut bad = two("a", "");
        bad[0].0.shape = vec![3];
        assert_eq!(
            encode_tensors(&s, None, &bad).unwrap_err().to_string(),
            "a tensor name is empty; names are non-empty strings"
        );
        let mut deep = two("ok", "deep");
        deep[1].0.shape = vec![1; 33];
        deep[1].1 = Gradient::new(&raw[..4], Dtype::F32);
        assert_eq!(
            encode_tensors(&s, None, &deep).unwrap_err().to_string(),
            "tensor \"deep\" has 33 dimensions; a tensor set carries at most 32\n\
             while encoding tensor \"deep\" (2 of 2) of a tensor set"
        );
        let mut other = two("x", "y");
        other[1].0.dtype = Dtype::F16;
        let err = encode_tensors(&s, None, &other).unwrap_err();
        assert_eq!(
            err.to_string(),
            "tensor \"y\" is given as 2 float32 values; its entry says float16 [2]\n\
             while encoding tensor \"y\" (2 of 2) of a tensor set"
        );
        // An encoding error is noted too.
        let mut tight = SessionConfig::new("t", 1000);
        tight.limits.max_payload_len = 2000;
        let big = bytes_of(Dtype::F32, 1000);
        let tensors = [(
            Entry::new("big", Dtype::F32, vec![1000]),
            Gradient::new(&big, Dtype::F32),
        )];
        let err = encode_tensors(&tight, None, &tensors).unwrap_err();
        assert!(
            matches!(&err, GradientStreamError::Noted { error, note }
            if matches!(**error, GradientStreamError::Frame { .. })
                && note == "while encoding tensor \"big\" (1 of 1) of a tensor set"),
            "{err:?}"
        );
    }
}
