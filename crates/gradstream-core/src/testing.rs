//! Helpers the unit tests of the session files share (test builds only): sample
//! gradients, sessions, chunks as frames, the pieces of a FrameError, and payloads to
//! decode. Depends on `session`, `encoder`, `codec`, `frame` and `error`; nothing
//! depends on it but tests.

use arrow_array::RecordBatch;
use arrow_ipc::writer::FileWriter;

use crate::codec::decode_payload;
use crate::dtype::Dtype;
use crate::encoder::EncodedChunk;
use crate::error::{GradientStreamError, Result};
use crate::frame::Limits;
use crate::session::{ChunkRef, SessionConfig};

pub(crate) fn unlimited() -> Limits {
    Limits {
        max_gradient_len: usize::MAX,
        ..Limits::default()
    }
}

pub(crate) fn gradient(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32 * 0.5 - 3.0).collect()
}

pub(crate) fn session(chunk_size: usize) -> SessionConfig {
    SessionConfig::new("test", chunk_size)
}

pub(crate) fn refs(chunks: &[EncodedChunk]) -> Vec<ChunkRef<'_>> {
    chunks.iter().map(EncodedChunk::as_ref).collect()
}

pub(crate) fn frames_of(chunks: &[EncodedChunk]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in chunks {
        out.extend_from_slice(&c.header().to_bytes());
        out.extend_from_slice(&c.payload);
    }
    out
}

pub(crate) fn frame_error<T: std::fmt::Debug>(r: Result<T>) -> (String, Option<u32>, Option<u64>) {
    match r {
        Err(GradientStreamError::Frame {
            detail,
            chunk_index,
            offset,
        }) => (detail, chunk_index, offset),
        other => panic!("expected a FrameError, got {other:?}"),
    }
}

pub(crate) fn bytes_of(dtype: Dtype, n: usize) -> Vec<u8> {
    // Every bit pattern, NaNs included: values travel as raw bits.
    (0..n * dtype.width())
        .map(|i| (i as u8).wrapping_mul(151).wrapping_add(7))
        .collect()
}

// The payload decoder tests.

pub(crate) fn decode(payload: &[u8]) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    decode_payload(payload, &mut out, usize::MAX).map(|_| out)
}

pub(crate) fn file_of(batches: &[RecordBatch]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = FileWriter::try_new(&mut out, &batches[0].schema()).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
    drop(w);
    out
}

/// float32 values whose bits a round trip must keep: a NaN with a payload, an all-ones
/// NaN, -0.0, both infinities, the smallest subnormal, the most negative subnormal.
pub(crate) fn special_floats() -> Vec<f32> {
    [
        0x7fc0_0001u32,
        0xffff_ffff,
        0x8000_0000,
        0x7f80_0000,
        0xff80_0000,
        0x0000_0001,
        0x807f_ffff,
    ]
    .map(f32::from_bits)
    .to_vec()
}

pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
