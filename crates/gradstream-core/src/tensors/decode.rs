//! `decode_tensors`: a tensor set held in memory, read by `TensorSetReceiver` as a
//! stream would be, and then nothing after it. Its tests walk every receiver rule of the
//! docs/spec/decoding-rules.md, as the Python tests do over both implementations.
//!
//! Uses `receive`; used by the bindings.

use super::receive::{TensorSet, TensorSetReceiver};
use crate::error::{GradientStreamError, Result};
use crate::session::SessionConfig;

/// The tensor set held by `data`, by the docs/spec/decoding-rules.md rules; empty for no bytes.
/// Bytes after
/// the set's last frame are decode_frames' "bytes left over" FrameError (offset from the
/// start of the last gradient, noted with the last tensor).
pub fn decode_tensors(config: &SessionConfig, data: &[u8]) -> Result<TensorSet> {
    // The input bounds what it can hold: half its bytes in values (float16).
    let mut receiver = TensorSetReceiver::with_reserve_cap(config, data.len() / 2);
    let mut pos = 0usize;
    loop {
        let want = receiver.want();
        let Some(unit) = data.get(pos..pos + want) else {
            return receiver.end_of_stream(data.len() - pos);
        };
        pos += want;
        if receiver.feed(unit)? {
            break;
        }
    }
    if pos < data.len() {
        let left = GradientStreamError::frame(
            format!("{} bytes left over after the last chunk", data.len() - pos),
            None,
        )
        .at_offset(receiver.gradient_offset());
        return Err(receiver.annotate(left));
    }
    receiver.finish()
}

#[cfg(test)]
mod tests {
    use super::super::encode::encode_tensors;
    use super::super::manifest::manifest_json;
    use super::super::manifest::Entry;
    use super::super::testing::{frames, gradients, manifest_of, mixed, set_of, unnoted};
    use super::*;
    use crate::codec::Layout;
    use crate::dtype::convert;
    use crate::dtype::{Dtype, WireDtype};
    use crate::frame::{FrameHeader, HEADER_LEN};

    fn session() -> SessionConfig {
        SessionConfig::new("rx", 4)
    }

    /// The TensorSet error of a result: (detail, name, notes).
    fn set_error(r: Result<TensorSet>) -> (String, Option<String>, Vec<String>) {
        match r.map(drop).map_err(unnoted) {
            Err((GradientStreamError::TensorSet { detail, name }, notes)) => (detail, name, notes),
            other => panic!("expected a TensorSet error, got {other:?}"),
        }
    }

    /// The FrameError of a result: (detail, chunk_index, offset, notes).
    fn frame_error(r: Result<TensorSet>) -> (String, Option<u32>, Option<u64>, Vec<String>) {
        match r.map(drop).map_err(unnoted) {
            Err((
                GradientStreamError::Frame {
                    detail,
                    chunk_index,
                    offset,
                },
                notes,
            )) => (detail, chunk_index, offset, notes),
            other => panic!("expected a FrameError, got {other:?}"),
        }
    }

    fn note_of(name: &str, k: usize, n: usize) -> Vec<String> {
        vec![format!(
            "while receiving tensor \"{name}\" ({k} of {n}) of a tensor set"
        )]
    }

    #[test]
    fn sets_round_trip_in_every_layout_and_wire_dtype() {
        let set = mixed();
        for layout in [Layout::Seed, Layout::Compact] {
            for wire in [None, Some(Dtype::F16), Some(Dtype::BF16), Some(Dtype::F64)] {
                let mut s = SessionConfig::new("rt", 3);
                s.layout = layout;
                let data =
                    encode_tensors(&s, wire.map(WireDtype::Float), &gradients(&set)).unwrap();
                let back = decode_tensors(&session(), &data).unwrap();
                assert_eq!(back.len(), set.len());
                for ((entry, raw), (got, values)) in set.iter().zip(&back) {
                    assert_eq!(got, entry);
                    assert_eq!(values.dtype(), entry.dtype);
                    assert_eq!(values.shape.as_deref(), Some(entry.shape.as_slice()));
                    // Each value cast to the wire dtype and back, by the cast rule.
                    let via = wire.unwrap_or(entry.dtype);
                    let mut there = vec![0u8; entry.len() * via.width()];
                    convert(raw, entry.dtype, &mut there, via);
                    let mut back = vec![0u8; raw.len()];
                    convert(&there, via, &mut back, entry.dtype);
                    assert_eq!(
                        values.owned_bytes(),
                        &back[..],
                        "{} via {via:?}",
                        entry.name
                    );
                }
            }
        }
        assert!(decode_tensors(&session(), &[]).unwrap().is_empty());
        let empty = encode_tensors(&session(), None, &[]).unwrap();
        assert!(decode_tensors(&session(), &empty).unwrap().is_empty());
    }

    #[test]
    fn rule_1_the_first_frame_is_a_one_chunk_manifest_within_16_mib() {
        let s = session();
        let plain = frames(&s, Dtype::F32, None, &[0; 40]); // 10 values: 3 chunks
        assert_eq!(
            set_error(decode_tensors(&s, &plain)).0,
            "not a tensor set: the first gradient has 3 chunks; a set starts with a one-chunk \
             manifest"
        );
        let no_manifest = frames(&s, Dtype::F32, None, &[]);
        assert_eq!(
            set_error(decode_tensors(&s, &no_manifest)).0,
            "not a tensor set: the first gradient has no gradstream_tensors manifest"
        );
        let one_value = frames(&s, Dtype::F32, None, &[0; 4]);
        assert_eq!(
            frame_error(decode_tensors(&s, &one_value)),
            (
                "gradient exceeds max_gradient_len 0: 1 values by chunk 0".into(),
                Some(0),
                Some(0),
                vec![]
            )
        );
        // The cap, from the header alone: the receiver refuses it when fed the header.
        let header = |len: u32| {
            FrameHeader {
                chunk_index: 0,
                total_chunks: 1,
                payload_len: len,
                checksum: 0,
            }
            .to_bytes()
        };
        let mut rx = TensorSetReceiver::new(&s);
        let err = rx.feed(&header((16 << 20) + 1)).unwrap_err().to_string();
        assert_eq!(
            err,
            "chunk 0 declares a 16777217-byte payload, above max_payload_len 16777216"
        );
        let mut small = session();
        small.limits.max_payload_len = 1000;
        let (detail, ..) = frame_error(decode_tensors(&small, &header(1001)));
        assert!(detail.ends_with("above max_payload_len 1000"), "{detail}");
        for total in [0u32, 2, u32::MAX] {
            let mut h = header(1 << 30);
            h[4..8].copy_from_slice(&total.to_le_bytes());
            let (detail, ..) = set_error(decode_tensors(&s, &h));
            assert!(detail.contains(&format!("has {total} chunks")), "{detail}");
        }
        let good = manifest_of(&s, &manifest_json(&[Entry::new("a", Dtype::F32, vec![2])]));
        assert_eq!(
            frame_error(decode_tensors(&s, &good[..5])).0,
            "truncated frame header: 5 of 16 bytes"
        );
        let (detail, index, offset, notes) = frame_error(decode_tensors(&s, &good[..40]));
        assert!(detail.ends_with("but only 24 bytes follow"), "{detail}");
        assert_eq!((index, offset, notes), (Some(0), Some(0), vec![]));
    }

    #[test]
    fn a_receive_s_max_values_is_checked_from_the_manifest() {
        let s = session();
        let entries = [
            Entry::new("a", Dtype::F32, vec![6]),
            Entry::new("b", Dtype::F64, vec![5]),
        ];
        let manifest = manifest_of(&s, &manifest_json(&entries));
        // What the receiver wants once the manifest frame is in: the first tensor's header.
        let after_manifest = |most: Option<usize>| -> Result<usize> {
            let mut receiver = TensorSetReceiver::new(&s).max_values(most);
            let mut pos = 0;
            while pos < manifest.len() {
                let want = receiver.want();
                receiver.feed(&manifest[pos..pos + want])?;
                pos += want;
            }
            Ok(receiver.want())
        };
        assert_eq!(after_manifest(None).ok(), Some(HEADER_LEN));
        assert_eq!(after_manifest(Some(11)).ok(), Some(HEADER_LEN));
        assert_eq!(
            set_error(after_manifest(Some(10)).map(|_| TensorSet::new())),
            (
                "tensor set holds 11 values, above this receive's max_values 10".into(),
                None,
                vec![]
            )
        );
    }

    #[test]
    fn rule_2_the_manifest_is_read_and_its_counts_summed() {
        let mut s = session();
        s.limits.max_gradient_len = 100;
        let bad = manifest_of(
            &s,
            "{\"format\":\"gradstream.tensors\",\"version\":2,\"tensors\":[]}",
        );
        assert_eq!(
            set_error(decode_tensors(&s, &bad)).0,
            "tensor set manifest version 2 is not supported (this gradstream reads version 1)"
        );
        let entries = [
            Entry::new("a", Dtype::F16, vec![50]),
            Entry::new("b", Dtype::F64, vec![1 << 30, 1 << 30]),
        ];
        let over = manifest_of(&s, &manifest_json(&entries));
        assert_eq!(
            set_error(decode_tensors(&s, &over)),
            (
                format!(
                    "tensor set holds {} values, above max_gradient_len 100",
                    50 + (1u64 << 60)
                ),
                None,
                vec![]
            )
        );
        // Exactly the limit passes, and the set is then cut short.
        let at_limit = manifest_of(
            &s,
            &manifest_json(&[Entry::new("a", Dtype::F32, vec![10, 10])]),
        );
        assert_eq!(
            set_error(decode_tensors(&s, &at_limit)),
            (
                "the tensor set ends after 0 of its 1 tensors".into(),
                None,
                note_of("a", 1, 1)
            )
        );
    }

    #[test]
    fn rule_3_each_tensor_is_bounded_by_and_checked_against_its_entry() {
        let s = session();
        let entries = [
            Entry::new("ok", Dtype::F64, vec![]),
            Entry::new("fc.weight", Dtype::F32, vec![4, 3]),
        ];
        let m = manifest_of(&s, &manifest_json(&entries));
        let ok = frames(&s, Dtype::F64, Some(&[]), &[0; 8]);
        for (dtype, shape, arrived) in [
            (Dtype::F16, Some(&[3usize, 4][..]), "float16 [3,4]"),
            (Dtype::F32, None, "float32 [12]"),
            (Dtype::F32, Some(&[2, 6][..]), "float32 [2,6]"),
        ] {
            let data = [
                &m[..],
                &ok,
                &frames(&s, dtype, shape, &vec![0; 12 * dtype.width()]),
            ]
            .concat();
            assert_eq!(
                set_error(decode_tensors(&s, &data)),
                (
                    format!("tensor \"fc.weight\" arrived as {arrived}; the manifest says float32 [4,3]"),
                    Some("fc.weight".into()),
                    note_of("fc.weight", 2, 2)
                )
            );
        }
        // Flat float32 frames match a one-dimensional float32 entry.
        let v = manifest_of(&s, &manifest_json(&[Entry::new("v", Dtype::F32, vec![3])]));
        let back = decode_tensors(
            &s,
            &[&v[..], &frames(&s, Dtype::F32, None, &[0; 12])].concat(),
        );
        assert_eq!(back.unwrap()[0].1.len(), 3);
        // More values than the entry holds stop at the limit.
        let w = manifest_of(&s, &manifest_json(&[Entry::new("w", Dtype::F32, vec![2])]));
        let mut big = SessionConfig::new("big", 64);
        big.layout = s.layout;
        let data = [&w[..], &frames(&big, Dtype::F32, None, &[0; 160])].concat();
        let (detail, _, _, notes) = frame_error(decode_tensors(&s, &data));
        assert_eq!(
            detail,
            "gradient exceeds max_gradient_len 2: 40 values by chunk 0"
        );
        assert_eq!(notes, note_of("w", 1, 1));
        // An empty tensor's frame has room for one value, which then fails the shape.
        let e = manifest_of(
            &s,
            &manifest_json(&[Entry::new("e", Dtype::F32, vec![0, 3])]),
        );
        let data = [&e[..], &frames(&s, Dtype::F32, Some(&[1]), &[0; 4])].concat();
        assert_eq!(
            set_error(decode_tensors(&s, &data)).0,
            "tensor \"e\" arrived as float32 [1]; the manifest says float32 [0,3]"
        );
    }

    #[test]
    fn errors_on_a_tensor_are_noted_and_bytes_after_the_set_refused() {
        let s = SessionConfig::new("n", 2);
        let set = set_of(&[
            ("a", Dtype::F32, vec![3], 1),
            ("b", Dtype::F16, vec![5], 2),
            ("c", Dtype::F64, vec![2, 2], 3),
        ]);
        let wire = encode_tensors(&s, None, &gradients(&set)).unwrap();
        let manifest_len = HEADER_LEN
            + FrameHeader::from_bytes(wire[..16].try_into().unwrap()).payload_len as usize;
        // Cut inside tensor "b", and between tensors.
        let a_len = frames(&s, Dtype::F32, Some(&[3]), &set[0].1).len();
        let b_len = frames(&s, Dtype::F16, Some(&[5]), &set[1].1).len();
        let cut = manifest_len + a_len + 20;
        let (detail, _, offset, notes) = frame_error(decode_tensors(&s, &wire[..cut]));
        assert!(detail.starts_with("truncated frame: chunk 0"), "{detail}");
        assert_eq!((offset, notes), (Some(0), note_of("b", 2, 3)));
        let between = manifest_len + a_len + b_len;
        assert_eq!(
            set_error(decode_tensors(&s, &wire[..between])),
            (
                "the tensor set ends after 2 of its 3 tensors".into(),
                None,
                note_of("c", 3, 3)
            )
        );
        // A damaged payload in "b"'s second frame.
        let mut bad = wire.clone();
        let second = manifest_len
            + a_len
            + HEADER_LEN
            + FrameHeader::from_bytes(wire[manifest_len + a_len..][..16].try_into().unwrap())
                .payload_len as usize;
        bad[second + HEADER_LEN + 10] ^= 0xff;
        let (error, notes) = unnoted(decode_tensors(&s, &bad).unwrap_err());
        assert!(matches!(
            error,
            GradientStreamError::ChecksumMismatch { chunk_index: 1, .. }
        ));
        assert_eq!(notes, note_of("b", 2, 3));
    }

    #[test]
    fn bytes_after_the_set_are_refused_before_the_last_check() {
        let s = SessionConfig::new("n", 2);
        let set = set_of(&[
            ("a", Dtype::F32, vec![3], 1),
            ("c", Dtype::F64, vec![2, 2], 3),
        ]);
        let wire = encode_tensors(&s, None, &gradients(&set)).unwrap();
        let c_len = frames(&s, Dtype::F64, Some(&[2, 2]), &set[1].1).len();
        // Bytes after the last tensor: offset from its first frame, with its note; after
        // an empty set, from the start.
        let extra = [&wire[..], b"xyz"].concat();
        assert_eq!(
            frame_error(decode_tensors(&s, &extra)),
            (
                "3 bytes left over after the last chunk".into(),
                None,
                Some(c_len as u64),
                note_of("c", 2, 2)
            )
        );
        let empty = encode_tensors(&s, None, &[]).unwrap();
        let (detail, _, offset, notes) =
            frame_error(decode_tensors(&s, &[&empty[..], b"x"].concat()));
        assert_eq!(
            (detail.as_str(), offset, notes),
            (
                "1 bytes left over after the last chunk",
                Some(empty.len() as u64),
                vec![]
            )
        );
        // ... and come before the last tensor's check against its entry.
        let m = manifest_of(&s, &manifest_json(&[Entry::new("z", Dtype::F32, vec![2])]));
        let wrong = [
            &m[..],
            &frames(&s, Dtype::F32, Some(&[1, 2]), &[0; 8]),
            b"!",
        ]
        .concat();
        assert!(frame_error(decode_tensors(&s, &wrong))
            .0
            .contains("left over"));
    }
}
