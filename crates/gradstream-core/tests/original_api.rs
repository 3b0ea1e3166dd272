//! The original module's own unit tests, rewritten in our words against the API this crate
//! keeps under the original's names: a user of ipfrs-transport's gradient streaming changes
//! only the `use` line below. (They need the default `tokio` feature, as the original's do.)

use gradstream_core::{GradientChunk, GradientStreamError, GradientStreamSession};

fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i as f32) * 0.001 - 7.5).collect()
}

#[test]
fn a_million_values_round_trip_in_sixteen_chunks() {
    let session = GradientStreamSession::with_defaults("original-1m");
    assert_eq!(session.chunk_size(), 65_536);
    assert_eq!(session.session_id(), "original-1m");
    assert!(!session.is_compression_enabled());
    let gradient = ramp(1_000_000);
    let chunks = session.encode_gradient(&gradient).unwrap();
    assert_eq!(chunks.len(), 16); // ceil(1_000_000 / 65_536)
    for (i, chunk) in chunks.iter().enumerate() {
        assert_eq!(chunk.chunk_index as usize, i);
        assert_eq!(chunk.total_chunks, 16);
        assert_eq!(chunk.session_id, "original-1m");
        assert!(chunk.verify_checksum());
        assert_eq!(
            chunk.checksum,
            GradientChunk::compute_checksum(&chunk.arrow_ipc_bytes)
        );
    }
    let back = session.decode_chunks(chunks).unwrap();
    assert_eq!(back, gradient);
}

#[test]
fn a_flipped_payload_byte_is_a_checksum_mismatch_on_that_chunk() {
    let session = GradientStreamSession::new("original-flip", 10);
    let mut chunks = session.encode_gradient(&ramp(35)).unwrap();
    let expected = chunks[2].checksum;
    let middle = chunks[2].arrow_ipc_bytes.len() / 2;
    chunks[2].arrow_ipc_bytes[middle] ^= 0xff;
    assert!(!chunks[2].verify_checksum());
    match session.decode_chunks(chunks) {
        Err(GradientStreamError::ChecksumMismatch {
            chunk_index,
            expected: e,
            actual,
        }) => {
            assert_eq!((chunk_index, e), (2, expected));
            assert_ne!(actual, expected);
        }
        other => panic!("expected a checksum mismatch, got {other:?}"),
    }
}

#[test]
fn a_small_gradient_is_one_chunk_and_any_order_decodes() {
    let session = GradientStreamSession::new("original-small", 4);
    let gradient = vec![1.0f32, -2.0, 3.5];
    let chunks = session.encode_gradient(&gradient).unwrap();
    assert_eq!(chunks.len(), 1);
    assert_eq!(session.decode_chunks(chunks).unwrap(), gradient);

    let gradient = ramp(10);
    let mut chunks = session.encode_gradient(&gradient).unwrap();
    chunks.reverse();
    assert_eq!(session.decode_chunks(chunks).unwrap(), gradient);
}

#[test]
fn empty_gradients_and_missing_chunks() {
    let session = GradientStreamSession::new("original-edges", 0);
    assert_eq!(session.chunk_size(), 1); // 0 is raised to 1
    let chunks = session.encode_gradient(&[]).unwrap();
    assert_eq!((chunks.len(), chunks[0].total_chunks), (1, 1));
    assert!(session.decode_chunks(chunks).unwrap().is_empty());
    assert!(session.decode_chunks(Vec::new()).unwrap().is_empty());

    let mut chunks = session.encode_gradient(&ramp(5)).unwrap();
    chunks.truncate(3);
    match session.decode_chunks(chunks) {
        Err(GradientStreamError::IncompleteStream { received, total }) => {
            assert_eq!((received, total), (3, 5));
        }
        other => panic!("expected an incomplete stream, got {other:?}"),
    }
}

#[test]
fn errors_keep_the_original_wording_and_match_by_variant() {
    let session = GradientStreamSession::new("original-words", 4);
    let mut chunks = session.encode_gradient(&ramp(4)).unwrap();
    chunks[0].arrow_ipc_bytes = b"not arrow".to_vec();
    chunks[0].checksum = GradientChunk::compute_checksum(&chunks[0].arrow_ipc_bytes);
    let err = session.decode_chunks(chunks).unwrap_err();
    // Matching as code written for the original does (with the wildcard the
    // non_exhaustive enum asks for).
    let arrow = match &err {
        GradientStreamError::ArrowIpc(detail) => detail.to_string(),
        GradientStreamError::ChecksumMismatch { .. }
        | GradientStreamError::IncompleteStream { .. }
        | GradientStreamError::Io(_) => panic!("wrong variant: {err}"),
        _ => panic!("one of gradstream's own variants: {err}"),
    };
    assert!(err.to_string().starts_with("Arrow IPC error"), "{err}");
    assert!(err.to_string().ends_with(&arrow), "{err}");
    let io: GradientStreamError = std::io::Error::from(std::io::ErrorKind::BrokenPipe).into();
    assert!(
        matches!(&io, GradientStreamError::Io(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
    );
    assert!(io.to_string().starts_with("I/O error: "), "{io}");
    // Error chains reach the io error, as the original's #[from] made them.
    let source = std::error::Error::source(&io).expect("Io has a source");
    let inner = source
        .downcast_ref::<std::io::Error>()
        .expect("an io::Error");
    assert_eq!(inner.kind(), std::io::ErrorKind::BrokenPipe);
}

#[test]
fn compression_really_compresses_and_still_round_trips() {
    let plain = GradientStreamSession::new("original-lz4", 4096);
    let packed = plain.clone().with_compression(true);
    assert!(packed.is_compression_enabled());
    let gradient = vec![0.0f32; 20_000];
    let payload_bytes = |session: &GradientStreamSession| -> usize {
        let chunks = session.encode_gradient(&gradient).unwrap();
        chunks.iter().map(|c| c.arrow_ipc_bytes.len()).sum()
    };
    let (small, big) = (payload_bytes(&packed), payload_bytes(&plain));
    // Zeros shrink to almost nothing; the seed layout's index column 0..n-1 less so.
    assert!(small * 3 < big * 2, "{small} vs {big}");
    let chunks = packed.encode_gradient(&gradient).unwrap();
    assert_eq!(plain.decode_chunks(chunks).unwrap(), gradient);
    assert!(!packed.with_compression(false).is_compression_enabled());
}

#[tokio::test]
async fn a_tokio_duplex_carries_a_gradient_and_its_end() {
    let sender = GradientStreamSession::new("original-duplex", 1000);
    let receiver = GradientStreamSession::new("original-duplex", 1000);
    let (mut a, mut b) = tokio::io::duplex(64 * 1024);
    let gradient = ramp(10_500);
    let (sent, got) = tokio::join!(
        sender.stream_to(&gradient, &mut a),
        receiver.receive_from(&mut b)
    );
    assert_eq!(sent.unwrap(), 11);
    assert_eq!(got.unwrap(), gradient);
    // The peer closes before a byte: the original's "no network", an empty gradient.
    drop(a);
    assert!(receiver.receive_from(&mut b).await.unwrap().is_empty());
}

#[tokio::test]
async fn the_stream_carries_exactly_what_encode_gradient_makes() {
    use tokio::io::AsyncReadExt;
    let session = GradientStreamSession::new("original-bytes", 3);
    let gradient = ramp(8);
    let (mut a, mut b) = tokio::io::duplex(1 << 16);
    session.stream_to(&gradient, &mut a).await.unwrap();
    drop(a);
    let mut wire = Vec::new();
    b.read_to_end(&mut wire).await.unwrap();
    let mut expected = Vec::new();
    for c in session.encode_gradient(&gradient).unwrap() {
        for word in [
            c.chunk_index,
            c.total_chunks,
            c.arrow_ipc_bytes.len() as u32,
            c.checksum,
        ] {
            expected.extend_from_slice(&word.to_le_bytes());
        }
        expected.extend_from_slice(&c.arrow_ipc_bytes);
    }
    assert_eq!(wire, expected);
}
