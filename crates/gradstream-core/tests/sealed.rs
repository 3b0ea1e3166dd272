//! Sealed chunks (docs/spec/decoding-rules.md) through the crate's public API, as the
//! connection layer uses it: each attack the seal is for, first accepted unsealed (a wrong
//! gradient comes back "verified"), then refused sealed, in both layouts and compressed, by
//! a `seal` receiver and by a default one alike (every receiver verifies a seal it finds);
//! the exact expectation of a connection's receivers; and the original crate's decoder
//! (arrow-rs `FileReader`, the `value` column by name) reading sealed payloads.

use arrow_array::{Array, Float32Array};
use gradstream_core::codec::{Compression, Layout};
use gradstream_core::dtype::Dtype;
use gradstream_core::receiver::Ended;
use gradstream_core::stream::{receive_gradient, send_gradient, Progress};
use gradstream_core::tensors::{
    decode_tensors, encode_tensors, encode_tensors_sealed, receive_tensor_set, send_tensors_sealed,
    Entry, TensorSetReceiver,
};
use gradstream_core::{
    EncodedChunk, GradientStreamError, Position, Seal, SealCheck, SessionConfig, TransferId,
    HEADER_LEN,
};

fn values(n: usize, salt: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761) ^ salt))
        .collect()
}

fn id(byte: u8) -> TransferId {
    TransferId([byte; 16])
}

/// Every setting a sealed payload is written in: both layouts, plain and compressed.
fn sessions(seal: bool) -> Vec<SessionConfig> {
    let mut all = Vec::new();
    for layout in [Layout::Seed, Layout::Compact] {
        for compression in [None, Some(Compression::Lz4)] {
            let mut s = SessionConfig::new("sealed", 5);
            s.layout = layout;
            s.compression = compression;
            s.seal = seal;
            all.push(s);
        }
    }
    all
}

/// The same settings without `seal`: a default receiver.
fn plain_of(s: &SessionConfig) -> SessionConfig {
    SessionConfig {
        seal: false,
        ..s.clone()
    }
}

fn frames_of(chunks: &[EncodedChunk]) -> Vec<u8> {
    chunks
        .iter()
        .flat_map(|c| [&c.header().to_bytes()[..], &c.payload].concat())
        .collect()
}

fn frame_detail<T: std::fmt::Debug>(r: Result<T, GradientStreamError>) -> (String, Option<u32>) {
    match r {
        Err(GradientStreamError::Frame {
            detail,
            chunk_index,
            ..
        }) => (detail, chunk_index),
        other => panic!("expected a FrameError, got {other:?}"),
    }
}

/// The seal's text as a receiver reads it from a payload's schema (what the original's
/// FileReader sees too).
fn seal_of(payload: &[u8]) -> Option<String> {
    let reader =
        arrow_ipc::reader::FileReader::try_new(std::io::Cursor::new(payload), None).unwrap();
    reader.schema().metadata().get("gradstream_seal").cloned()
}

#[test]
fn the_original_decoder_reads_sealed_payloads_by_their_value_column() {
    for s in sessions(false)
        .into_iter()
        .filter(|s| s.compression.is_none())
    {
        let g = values(12, 7);
        let seal = Seal::lone(id(0x42));
        let chunks = s
            .encode_gradient(gradstream_core::Gradient::from(&g).sealed(seal))
            .unwrap();
        let mut back = Vec::new();
        for c in &chunks {
            // What ipfrs-transport 0.2.0 does with a payload.
            let reader =
                arrow_ipc::reader::FileReader::try_new(std::io::Cursor::new(&c.payload), None)
                    .unwrap();
            for batch in reader {
                let batch = batch.unwrap();
                let column = batch.column_by_name("value").unwrap();
                let floats = column.as_any().downcast_ref::<Float32Array>().unwrap();
                assert_eq!(floats.null_count(), 0);
                back.extend(floats.values().iter().copied());
            }
            assert_eq!(
                seal_of(&c.payload).unwrap(),
                seal.text(c.chunk_index, c.total_chunks).as_str()
            );
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&g), "{:?}", s.layout);
    }
}

#[test]
fn swapped_indices_with_valid_crcs_pass_unsealed_and_fail_sealed() {
    for seal in [false, true] {
        for s in sessions(seal) {
            let g = values(10, 1);
            let mut chunks = s.encode_gradient(&g).unwrap();
            // Each header keeps its own payload's CRC: only the indices trade places.
            (chunks[0].chunk_index, chunks[1].chunk_index) = (1, 0);
            let wire = frames_of(&chunks);
            if !seal {
                let back = s.decode_frames(&wire).unwrap();
                assert_ne!(back, g, "a wrong gradient, accepted");
                assert_eq!(back[..5], g[5..]);
                continue;
            }
            let expected = (
                "chunk 1 of 2 is sealed as chunk 0 of 2".to_string(),
                Some(1),
            );
            let sorted_first = "chunk 0 of 2 is sealed as chunk 1 of 2".to_string();
            for rx in [s.clone(), plain_of(&s)] {
                assert_eq!(frame_detail(rx.decode_frames(&wire)), expected);
                let refs = chunks.iter().map(EncodedChunk::as_ref).collect();
                let got = frame_detail(rx.decode_chunks(refs));
                assert_eq!(got, (sorted_first.clone(), Some(0)));
            }
        }
    }
}

#[test]
fn frames_spliced_from_another_transfer_of_the_same_size_fail_sealed() {
    for seal in [false, true] {
        for s in sessions(seal) {
            let (a, b) = (values(10, 1), values(10, 2));
            let mut spliced = s.encode_gradient(&a).unwrap();
            let other = s.encode_gradient(&b).unwrap();
            spliced[1] = other[1].clone();
            let wire = frames_of(&spliced);
            if !seal {
                let back = s.decode_frames(&wire).unwrap();
                assert_eq!([&a[..5], &b[5..]].concat(), back, "half of each, accepted");
                continue;
            }
            let (ours, theirs) = (seal_of_chunk(&spliced[0]), seal_of_chunk(&other[1]));
            assert_ne!(ours, theirs);
            for rx in [s.clone(), plain_of(&s)] {
                assert_eq!(
                    frame_detail(rx.decode_frames(&wire)),
                    (
                        format!("chunk 1 is sealed for transfer {theirs}; chunk 0 is sealed for transfer {ours}"),
                        Some(1)
                    )
                );
            }
        }
    }
}

/// The transfer id a chunk is sealed with.
fn seal_of_chunk(chunk: &EncodedChunk) -> String {
    let text = match seal_of(&chunk.payload) {
        Some(text) => text,
        // A compressed payload: read with the crate's own reader, which has the codecs.
        None => panic!("unsealed chunk"),
    };
    text[..32].to_string()
}

#[test]
fn a_sealing_receiver_refuses_unsealed_payloads_and_others_take_either_but_not_both() {
    for (plain, sealed) in sessions(false).into_iter().zip(sessions(true)) {
        let g = values(7, 3);
        let unsealed = plain.encode_frames(&g).unwrap();
        assert_eq!(
            frame_detail(sealed.decode_frames(&unsealed)),
            (
                "chunk 0 is not sealed; this receiver expects sealed chunks".to_string(),
                Some(0)
            )
        );
        let wire = sealed.encode_frames(&g).unwrap();
        assert_eq!(plain.decode_frames(&wire).unwrap(), g);
        assert_eq!(sealed.decode_frames(&wire).unwrap(), g);
        // Once one chunk of a gradient is sealed, every chunk must be: either way round.
        let (sealed_chunks, plain_chunks) = (
            sealed.encode_gradient(&g).unwrap(),
            plain.encode_gradient(&g).unwrap(),
        );
        let id = seal_of_chunk(&sealed_chunks[0]);
        let mixed = frames_of(&[sealed_chunks[0].clone(), plain_chunks[1].clone()]);
        assert_eq!(
            frame_detail(plain.decode_frames(&mixed)),
            (
                format!("chunk 1 is not sealed; chunk 0 is sealed for transfer {id}"),
                Some(1)
            )
        );
        let mixed = frames_of(&[plain_chunks[0].clone(), sealed_chunks[1].clone()]);
        assert_eq!(
            frame_detail(plain.decode_frames(&mixed)),
            (
                "chunk 1 is sealed; chunk 0 is not sealed".to_string(),
                Some(1)
            )
        );
        // Two gradients of one sealing session: two transfer ids.
        assert_ne!(wire, sealed.encode_frames(&g).unwrap());
        if plain.compression.is_none() {
            assert_eq!(sealed.frames_len(g.len()).unwrap(), wire.len());
            assert!(wire.len() > unsealed.len());
        }
    }
}

#[tokio::test]
async fn a_connections_receiver_takes_exactly_the_transfer_it_expects() {
    for s in sessions(false) {
        let g = values(13, 4);
        let sealed = gradstream_core::Gradient::from(&g).sealed(Seal::lone(id(9)));
        for (expect, verdict) in [(id(9), None), (id(8), Some(()))] {
            let (mut a, mut b) = tokio::io::duplex(1 << 12);
            let receiver = s
                .receiver()
                .expect_seal(SealCheck::Exact(expect), Position::Lone);
            let progress = (Progress::default(), Progress::default());
            let (sent, got) = tokio::join!(
                send_gradient(&s, sealed, &mut a, None, &progress.0),
                receive_gradient(receiver, &mut b, None, &progress.1)
            );
            match (verdict, got) {
                (None, Ok(Ended::Gradient(values))) => {
                    assert_eq!(sent.unwrap(), 3);
                    assert_eq!(values.into_vec(), g);
                }
                (Some(()), got) => assert_eq!(
                    frame_detail(got.map(drop)).0,
                    format!(
                        "chunk 0 is sealed for transfer {}, expected transfer {}",
                        id(9),
                        id(8)
                    )
                ),
                (_, got) => panic!("{got:?}"),
            }
        }
        // A lone gradient where a set's manifest is expected, and the other way round.
        let wire = s.encode_frames(sealed).unwrap();
        let receiver = TensorSetReceiver::new(&s).expect_seal(SealCheck::Exact(id(9)));
        let mut reader = &wire[..];
        let got = receive_tensor_set(receiver, &mut reader, None, &Progress::default()).await;
        let err = got.unwrap_err().to_string();
        assert!(
            err.contains("not a tensor set")
                || err.contains("sealed for a lone gradient, expected a tensor set's manifest"),
            "{err}"
        );
    }
}

fn two_same_shape_tensors() -> (Vec<Entry>, Vec<Vec<u8>>) {
    let entries = vec![
        Entry::new("fc1.weight", Dtype::F32, vec![2, 3]),
        Entry::new("fc2.weight", Dtype::F32, vec![2, 3]),
    ];
    let raws = [values(6, 11), values(6, 12)]
        .iter()
        .map(|v| v.iter().flat_map(|x| x.to_ne_bytes()).collect())
        .collect();
    (entries, raws)
}

/// A set's frames with its two tensors' frames traded places (the manifest first).
fn swap_tensors(wire: &[u8]) -> Vec<u8> {
    let mut frames = Vec::new();
    let mut pos = 0;
    while pos < wire.len() {
        let len = u32::from_le_bytes(wire[pos + 8..pos + 12].try_into().unwrap()) as usize;
        frames.push(&wire[pos..pos + HEADER_LEN + len]);
        pos += HEADER_LEN + len;
    }
    // chunk_size 5: each 6-value tensor is 2 frames, after the manifest's 1.
    assert_eq!(frames.len(), 5);
    [frames[0], frames[3], frames[4], frames[1], frames[2]].concat()
}

#[tokio::test]
async fn two_same_shape_tensors_swapped_in_a_set_pass_unsealed_and_fail_sealed() {
    let (entries, raws) = two_same_shape_tensors();
    let tensors: Vec<_> = entries
        .iter()
        .cloned()
        .zip(
            raws.iter()
                .map(|r| gradstream_core::Gradient::new(r, Dtype::F32)),
        )
        .collect();
    for (plain, sealed) in sessions(false).into_iter().zip(sessions(true)) {
        let swapped = swap_tensors(&encode_tensors(&plain, None, &tensors).unwrap());
        let set = decode_tensors(&plain, &swapped).unwrap();
        assert_eq!(set[0].1.owned_bytes(), &raws[1][..], "swapped, accepted");
        let swapped = swap_tensors(&encode_tensors(&sealed, None, &tensors).unwrap());
        let expected = "chunk 0 is sealed for tensor position 1 of a tensor set, expected \
                        tensor position 0 of a tensor set\n\
                        while receiving tensor \"fc1.weight\" (1 of 2) of a tensor set";
        for rx in [&sealed, &plain] {
            assert_eq!(
                decode_tensors(rx, &swapped).unwrap_err().to_string(),
                expected
            );
        }
        // A sealed tensor in a set whose manifest came unsealed.
        let unsealed = encode_tensors(&plain, None, &tensors).unwrap();
        let ours = encode_tensors(&sealed, None, &tensors).unwrap();
        let mixed = [
            &unsealed[..frame_end(&unsealed, 3)],
            &ours[frame_end(&ours, 3)..],
        ]
        .concat();
        assert_eq!(
            decode_tensors(&plain, &mixed).unwrap_err().to_string(),
            "chunk 0 is sealed; the tensor set's manifest is not sealed\n\
             while receiving tensor \"fc2.weight\" (2 of 2) of a tensor set"
        );
        // A connection's set: its id exactly, over a stream.
        let (mut a, mut b) = tokio::io::duplex(1 << 12);
        let receiver = TensorSetReceiver::new(&plain).expect_seal(SealCheck::Exact(id(5)));
        let progress = (Progress::default(), Progress::default());
        let (sent, got) = tokio::join!(
            send_tensors_sealed(&plain, None, &tensors, id(5), &mut a, None, &progress.0),
            receive_tensor_set(receiver, &mut b, None, &progress.1)
        );
        assert_eq!(sent.unwrap(), 5);
        let got = got.unwrap();
        assert_eq!(got[1].1.owned_bytes(), &raws[1][..]);
        let other = encode_tensors_sealed(&plain, None, &tensors, id(6)).unwrap();
        let receiver = TensorSetReceiver::new(&plain).expect_seal(SealCheck::Exact(id(5)));
        let mut reader = &other[..];
        let err = receive_tensor_set(receiver, &mut reader, None, &Progress::default())
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "chunk 0 is sealed for transfer {}, expected transfer {}",
                id(6),
                id(5)
            )
        );
        // A tensor spliced in from another set of the same shapes: the manifest's id.
        let ours = encode_tensors_sealed(&plain, None, &tensors, id(5)).unwrap();
        let mixed = [&ours[..frame_end(&ours, 3)], &other[frame_end(&other, 3)..]].concat();
        for rx in [&sealed, &plain] {
            let err = decode_tensors(rx, &mixed).unwrap_err().to_string();
            assert_eq!(
                err,
                format!(
                    "chunk 0 is sealed for transfer {}, expected transfer {}\n\
                     while receiving tensor \"fc2.weight\" (2 of 2) of a tensor set",
                    id(6),
                    id(5)
                )
            );
        }
    }
}

/// Where frame `k` of a frame stream ends.
fn frame_end(wire: &[u8], k: usize) -> usize {
    let mut pos = 0;
    for _ in 0..k {
        let len = u32::from_le_bytes(wire[pos + 8..pos + 12].try_into().unwrap()) as usize;
        pos += HEADER_LEN + len;
    }
    pos
}
