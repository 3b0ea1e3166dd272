//! The encoder's tests: every frame writer writes the same bytes, chunking mirrors the
//! original, frames round-trip (special floats, kept shapes, every dtype), and the
//! payload limit is enforced.

use super::*;
use crate::testing::{bytes_of, frame_error, frames_of, gradient, refs, session};

/// The frames as `encode_gradient` makes them, chunk by chunk (the Arrow writer and
/// the templates' `Cached` stores), for the stream writers to match.
fn frames_chunk_by_chunk(s: &SessionConfig, g: Gradient<'_>) -> Vec<u8> {
    let chunks = s.encode_gradient(g).unwrap();
    frames_of(&chunks)
}

#[test]
fn every_frame_writer_writes_the_same_bytes() {
    // Sizes around a chunk, a block of the fused copy (16 KiB = 4096 values) and the
    // streaming threshold (4 MiB of frames), with a short last chunk or none.
    let sizes = [0, 1, 4095, 4097, 65_536, 65_537, 1_100_000];
    for layout in [Layout::Seed, Layout::Compact] {
        for seal in [false, true] {
            for &n in &sizes {
                let mut s = session(65_536);
                s.layout = layout;
                let values = gradient(n);
                let g = Gradient::from(&values[..])
                    .seal_with(seal.then(|| Seal::lone(TransferId([7; 16]))));
                let expected = frames_chunk_by_chunk(&s, g);
                let plan = s.plan_frames(g).unwrap();
                let mut reused = vec![0xa5u8; plan.len()];
                s.write_frames(&plan, &mut reused).unwrap();
                assert!(
                    reused == expected,
                    "write_frames {layout:?} n={n} seal={seal}"
                );
                let mut fresh = Vec::with_capacity(plan.len());
                s.write_new_frames(&plan, &mut fresh.spare_capacity_mut()[..plan.len()])
                    .unwrap();
                // SAFETY: write_new_frames returned Ok: every byte is initialised.
                unsafe { fresh.set_len(plan.len()) };
                assert!(fresh == expected, "write_new_frames {layout:?} n={n}");
                assert!(s.encode_frames(g).unwrap() == expected);
                // A buffer of another length is refused, by both.
                let mut short = vec![0u8; plan.len() + 1];
                assert!(s.write_frames(&plan, &mut short).is_err());
                let mut spare = Vec::<u8>::with_capacity(plan.len() + 1);
                let spare = &mut spare.spare_capacity_mut()[..plan.len() + 1];
                assert!(s.write_new_frames(&plan, spare).is_err());
            }
        }
    }
}

#[test]
fn chunking_mirrors_the_original() {
    let s = session(4);
    for (len, chunks) in [(0, 1), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)] {
        let encoded = s.encode_gradient(&gradient(len)).unwrap();
        assert_eq!(encoded.len(), chunks, "len {len}");
        for (i, c) in encoded.iter().enumerate() {
            assert_eq!(c.chunk_index as usize, i);
            assert_eq!(c.total_chunks as usize, chunks);
            assert_eq!(c.checksum, crc32fast::hash(&c.payload));
        }
        assert_eq!(s.decode_chunks(refs(&encoded)).unwrap(), gradient(len));
    }
    assert_eq!(session(0).chunk_size, 1);
    assert!(session(7).decode_chunks(Vec::new()).unwrap().is_empty());
}

#[test]
fn frames_are_header_then_payload_and_round_trip() {
    let s = session(3);
    let g = gradient(10);
    let chunks = s.encode_gradient(&g).unwrap();
    let wire = s.encode_frames(&g).unwrap();
    assert_eq!(wire, frames_of(&chunks));
    assert_eq!(s.decode_frames(&wire).unwrap(), g);
    assert!(s.decode_frames(&[]).unwrap().is_empty());
}

#[test]
fn encoder_refuses_chunks_over_the_payload_limit() {
    let mut s = session(1000);
    s.limits.max_payload_len = 4096;
    let (detail, idx, _) = frame_error(s.encode_frames(&gradient(3000)));
    assert!(detail.contains("use a smaller chunk_size"), "{detail}");
    assert_eq!(idx, Some(0));
}

#[test]
fn special_floats_survive_bit_for_bit() {
    let g = crate::testing::special_floats();
    let s = session(3);
    let back = s.decode_frames(&s.encode_frames(&g).unwrap()).unwrap();
    assert_eq!(crate::testing::bits(&back), crate::testing::bits(&g));
}

#[test]
fn a_kept_shape_travels_in_every_payload_and_comes_back() {
    let s = session(4);
    let meta = GradientMeta {
        shape: Some("[2,5]".into()),
        ..GradientMeta::default()
    };
    let g = gradient(10);
    let shaped = |meta| Gradient::from(&g).with_meta(meta);
    let wire = s.encode_frames(shaped(&meta)).unwrap();
    let plain = session(4).encode_frames(&g).unwrap();
    assert!(wire.len() > plain.len());
    let back = session(3).decode_frames_output(&wire).unwrap();
    assert_eq!(back.shape, Some(vec![2, 5]));
    assert_eq!(back.into_vec(), g);
    let chunks = s.encode_gradient(shaped(&meta)).unwrap();
    let back = session(3).decode_chunks_output(refs(&chunks)).unwrap();
    assert_eq!(back.shape, Some(vec![2, 5]));
    // Shaped float32 payloads take the templates at both ends (a gradstream connection
    // keeps shapes by default): the sender's made shelf holds the shaped kinds, and a
    // receiver learns them from the first payload of a size and matches the next ones.
    let big = gradient(3 * 1000 + 7);
    let big_meta = GradientMeta {
        shape: Some("[3007]".into()),
        ..GradientMeta::default()
    };
    let sender = session(1000);
    let wire = sender
        .encode_frames(Gradient::from(&big).with_meta(&big_meta))
        .unwrap();
    let first = FrameHeader::from_bytes(wire[..HEADER_LEN].try_into().unwrap()).payload_len;
    let shaped_held = |s: &SessionConfig| {
        let found = s.templates.for_payload(first as usize);
        found.iter().any(|t| t.shape() == Some("[3007]"))
    };
    assert!(shaped_held(&sender), "the sender's full chunks");
    let receiver = session(1000);
    let back = receiver.decode_frames_output(&wire).unwrap();
    assert_eq!(back.shape, Some(vec![3007]));
    assert_eq!(back.into_vec(), big);
    assert!(shaped_held(&receiver), "learned from the first chunk");
    let again = receiver.decode_frames_output(&wire).unwrap();
    assert_eq!(again.shape, Some(vec![3007]));
    // The session keeps no shape of its own: the next gradient is the original's.
    assert_eq!(s.encode_frames(&g).unwrap(), plain);
    // A shape that does not hold the values, and chunks that disagree.
    let bad = GradientMeta {
        shape: Some("[3,3]".into()),
        ..GradientMeta::default()
    };
    let (detail, index, _) =
        frame_error(session(3).decode_frames(&s.encode_frames(shaped(&bad)).unwrap()));
    assert_eq!(
        (detail.as_str(), index),
        (
            "gradient_shape [3,3] holds 9 values; the gradient has 10",
            None
        )
    );
    let mut mixed = s.encode_gradient(shaped(&bad)).unwrap();
    mixed[1] = session(4).encode_gradient(&g).unwrap().remove(1);
    let (detail, index, offset) = frame_error(session(3).decode_frames(&frames_of(&mixed)));
    assert_eq!(
        detail,
        "chunks disagree on gradient_shape: chunk 0 says [3,3], chunk 1 says none"
    );
    assert_eq!(index, Some(1));
    assert!(offset.is_some());
}

#[test]
fn every_dtype_travels_bit_for_bit_through_frames_and_chunks() {
    for dtype in Dtype::ALL {
        for layout in [Layout::Seed, Layout::Compact] {
            let mut s = SessionConfig::new("d", 7);
            s.layout = layout;
            let raw = bytes_of(dtype, 30);
            let wire = s.encode_frames(Gradient::new(&raw, dtype)).unwrap();
            let back = s.decode_frames_output(&wire).unwrap();
            assert_eq!((back.dtype(), back.owned_bytes()), (dtype, &raw[..]));
            let chunks = s.encode_gradient(Gradient::new(&raw, dtype)).unwrap();
            let refs = chunks.iter().rev().map(|c| c.as_ref()).collect();
            let back = s.decode_chunks_output(refs).unwrap();
            assert_eq!((back.dtype(), back.owned_bytes()), (dtype, &raw[..]));
        }
    }
}
