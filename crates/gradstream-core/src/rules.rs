//! The decoding rules every receiving path shares (docs/spec/decoding-rules.md; the
//! reference's `_rules` follows the same list): totals that agree, indices in range and
//! new, the CRC before any parsing, the seal (`seal::SealRule`) and the dtype rules
//! (`DtypeCheck`) once a payload's schema is read, and the sink one chunk is decoded
//! through (`take_chunk`). Also `decode_chunks`, which applies them to chunks given all
//! at once.
//!
//! Uses `session`, `codec` (the payload reader), `template` (the fast path), `output`,
//! `seal`, `shape` and `dtype`; used by `reassembler`, which applies the same rules frame
//! by frame.

use crate::codec;
use crate::dtype::Dtype;
use crate::error::{GradientStreamError, Result};
use crate::output::{Head, Output, ValueSink};
use crate::seal::{Position, SealRule};
use crate::session::{ChunkRef, SessionConfig};
use crate::shape::ShapeCheck;
use crate::template::Templates;

impl SessionConfig {
    /// Reassemble chunks given in any order (docs/spec/decoding-rules.md, decode_chunks).
    pub fn decode_chunks(&self, chunks: Vec<ChunkRef<'_>>) -> Result<Vec<f32>> {
        self.decode_chunks_output(chunks).map(Output::into_vec)
    }

    /// `decode_chunks`, with the shape the sender kept.
    pub fn decode_chunks_output(&self, mut chunks: Vec<ChunkRef<'_>>) -> Result<Output> {
        if chunks.is_empty() {
            return Ok(Output::default());
        }
        chunks.sort_by_key(|c| c.chunk_index);
        let first = chunks[0];
        let total = first.total_chunks;
        let mut previous: Option<u32> = None;
        for c in &chunks {
            check_total(first.chunk_index, total, c.chunk_index, c.total_chunks)?;
            if previous == Some(c.chunk_index) {
                return Err(duplicate(c.chunk_index));
            }
            check_range(c.chunk_index, total)?;
            previous = Some(c.chunk_index);
        }
        if chunks.len() != total as usize {
            return Err(GradientStreamError::IncompleteStream {
                received: chunks.len(),
                total: total as usize,
            });
        }
        let mut values = Output::default();
        // The seed layout spends 8 payload bytes a value: a good first guess of the size.
        values.reserve(chunks.iter().map(|c| c.payload.len() / 8).sum());
        let mut shape = ShapeCheck::default();
        let mut dtypes = DtypeCheck::default();
        let mut seal = SealRule::new(self.seal_check(), Position::Lone);
        let mut manifest = None;
        for c in &chunks {
            let room = self.limits.max_gradient_len.saturating_sub(values.len());
            let into = Receiving {
                out: &mut values,
                seal: &mut seal,
                dtypes: &mut dtypes,
                lent: None,
                bf16_as_f32: self.bf16_as_f32,
                room,
                store_room: None,
                templates: &self.templates,
            };
            let (head, _) = take_chunk(*c, into)?;
            shape.check(c.chunk_index, head.shape)?;
            if c.chunk_index == 0 {
                manifest = head.manifest;
            }
        }
        values.shape = shape.finish(values.len())?;
        values.manifest = manifest;
        Ok(values)
    }
}

pub(crate) fn check_total(
    first_index: u32,
    first_total: u32,
    index: u32,
    total: u32,
) -> Result<()> {
    if total == first_total {
        return Ok(());
    }
    Err(GradientStreamError::frame(
        format!(
            "chunks disagree on total_chunks: chunk {first_index} says {first_total}, \
             chunk {index} says {total}"
        ),
        Some(index),
    ))
}

pub(crate) fn check_range(index: u32, total: u32) -> Result<()> {
    if index < total {
        return Ok(());
    }
    Err(GradientStreamError::frame(
        format!("chunk index {index} out of range for total_chunks {total}"),
        Some(index),
    ))
}

pub(crate) fn duplicate(index: u32) -> GradientStreamError {
    GradientStreamError::frame(format!("duplicate chunk index {index}"), Some(index))
}

/// CRC first (a corrupt payload is never parsed), then decode into `out`.
fn verify_and_decode(
    index: u32,
    expected: u32,
    payload: &[u8],
    out: &mut Taking<'_>,
    room: usize,
    templates: &Templates,
) -> Result<Head> {
    // Our own payloads (any sender of ours) match a template: the CRC of the constant
    // bytes is known, and the values are copied out without going through Arrow.
    let known = templates.for_payload(payload.len());
    for template in &known {
        if let Some(matched) = template.matches(payload) {
            let actual = matched.checksum;
            if actual != expected {
                return Err(GradientStreamError::ChecksumMismatch {
                    chunk_index: index,
                    expected,
                    actual,
                });
            }
            // Templates are made for float32 payloads without metadata but a seal and a
            // shape.
            let head = Head {
                seal: matched.seal.map(str::to_owned),
                shape: template.shape().map(str::to_owned),
                ..Head::default()
            };
            out.begin(&head)?;
            out.put_raw(matched.raw, Dtype::F32);
            return Ok(head);
        }
    }
    let actual = codec::checksum(payload);
    if actual != expected {
        return Err(GradientStreamError::ChecksumMismatch {
            chunk_index: index,
            expected,
            actual,
        });
    }
    let head = codec::decode_payload(payload, out, room).map_err(|e| e.in_chunk(index))?;
    let bare = Head {
        seal: None,
        shape: None,
        ..head.clone()
    };
    if known.is_empty() && bare == Head::default() {
        // A payload size with no template yet: make this count's templates (with its
        // shape text), so that the next payload of this size (a gradient's next full
        // chunk) takes the fast path.
        let shape = head.shape.as_deref();
        templates.learn(out.offered, payload.len(), head.seal.is_some(), shape);
    }
    Ok(head)
}

/// The dtype rules of the docs/spec/decoding-rules.md decoding rules: every chunk's column dtype
/// and
/// `gradient_dtype` are those of the first chunk taken.
#[derive(Debug, Default)]
pub(crate) struct DtypeCheck {
    /// The first chunk taken: its index, column (its name: a dtype's, or `int8`) and
    /// gradient_dtype.
    first: Option<(u32, &'static str, Option<Dtype>)>,
}

impl DtypeCheck {
    pub(crate) fn check(&mut self, index: u32, head: &Head) -> Result<()> {
        let holds = head.column_name();
        let Some((first, column, dtype)) = self.first else {
            self.first = Some((index, holds, head.dtype));
            return Ok(());
        };
        if holds != column {
            return Err(GradientStreamError::frame(
                format!(
                    "chunks disagree on the value dtype: chunk {first} holds {column}, chunk \
                     {index} holds {holds}"
                ),
                Some(index),
            ));
        }
        if head.dtype != dtype {
            let says = |d: Option<Dtype>| d.map_or("none", Dtype::name);
            return Err(GradientStreamError::frame(
                format!(
                    "chunks disagree on gradient_dtype: chunk {first} says {}, chunk {index} says \
                     {}",
                    says(dtype),
                    says(head.dtype)
                ),
                Some(index),
            ));
        }
        Ok(())
    }

    /// Forget the chunk just checked (it failed a later rule, so it was not taken).
    pub(crate) fn undo(&mut self, index: u32) {
        if matches!(self.first, Some((first, ..)) if first == index) {
            self.first = None;
        }
    }
}

/// The sink one chunk is decoded through: the seal, the dtype rules, then the output's
/// own type.
struct Taking<'a> {
    out: &'a mut Output,
    seal: &'a mut SealRule,
    dtypes: &'a mut DtypeCheck,
    index: u32,
    /// The chunk's header's total_chunks, which its seal must repeat.
    total: u32,
    /// The caller's `out=` dtype, which every chunk's values must come back in.
    lent: Option<Dtype>,
    /// bfloat16 comes back as float32 (Python without ml_dtypes).
    bf16_as_f32: bool,
    /// Values offered by this chunk (stored or not).
    offered: usize,
    /// Store no more than this many of the chunk's values: past it the gradient is over
    /// max_gradient_len, an error once the chunk is counted, so the values are only
    /// counted (a float16 payload cast to float64 would otherwise hold 4x its bytes).
    room: Option<usize>,
}

impl ValueSink for Taking<'_> {
    fn begin(&mut self, head: &Head) -> Result<()> {
        self.seal
            .check(self.index, self.total, head.seal.as_deref())?;
        self.dtypes.check(self.index, head)?;
        let result = match head.result() {
            Dtype::BF16 if self.bf16_as_f32 => Dtype::F32,
            other => other,
        };
        let refused = |expected: Dtype| GradientStreamError::GradientDtype {
            expected: expected.name(),
            received: result.name(),
            chunk_index: Some(self.index),
        };
        if let Some(lent) = self.lent.filter(|&lent| lent != result) {
            return Err(refused(lent));
        }
        self.out.set_dtype(result).map_err(refused)
    }

    fn put_raw(&mut self, raw: &[u8], from: Dtype) {
        self.offered += raw.len() / from.width();
        if self.room.is_none_or(|room| self.offered <= room) {
            self.out.put_raw(raw, from);
        }
    }
}

/// What one chunk is decoded into: the receiver's output and the state and settings the
/// rules hold the chunk to (the chunk itself is a `ChunkRef`).
pub(crate) struct Receiving<'a> {
    /// Where the values go.
    pub(crate) out: &'a mut Output,
    /// The seal every chunk is held to, and the transfer the first one taken fixed.
    pub(crate) seal: &'a mut SealRule,
    /// The dtypes of the chunks taken so far.
    pub(crate) dtypes: &'a mut DtypeCheck,
    /// The caller's `out=` dtype, which every chunk's values must come back in.
    pub(crate) lent: Option<Dtype>,
    /// bfloat16 comes back as float32 (Python without ml_dtypes).
    pub(crate) bf16_as_f32: bool,
    /// The most values the gradient may still take (max_gradient_len less what is in):
    /// what the payload reader may allocate for.
    pub(crate) room: usize,
    /// With `Some`, values past it are counted, not stored (the caller refuses such a
    /// chunk).
    pub(crate) store_room: Option<usize>,
    /// The session's templates, which our own payloads match.
    pub(crate) templates: &'a Templates,
}

/// Verify and decode `chunk` into `into.out` under the dtype rules; the chunk's head and
/// its value count.
pub(crate) fn take_chunk(chunk: ChunkRef<'_>, into: Receiving<'_>) -> Result<(Head, usize)> {
    let mut sink = Taking {
        out: into.out,
        seal: into.seal,
        dtypes: into.dtypes,
        index: chunk.chunk_index,
        total: chunk.total_chunks,
        lent: into.lent,
        bf16_as_f32: into.bf16_as_f32,
        offered: 0,
        room: into.store_room,
    };
    let head = verify_and_decode(
        chunk.chunk_index,
        chunk.checksum,
        chunk.payload,
        &mut sink,
        into.room,
        into.templates,
    )?;
    Ok((head, sink.offered))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encoder::{Gradient, GradientMeta};
    use crate::testing::{bytes_of, frame_error, frames_of, gradient, refs, session};

    #[test]
    fn any_delivery_order_decodes() {
        let s = session(2);
        let g = gradient(9);
        let mut chunks = s.encode_gradient(&g).unwrap();
        chunks.reverse();
        chunks.swap(1, 3);
        assert_eq!(s.decode_chunks(refs(&chunks)).unwrap(), g);
        assert_eq!(s.decode_frames(&frames_of(&chunks)).unwrap(), g);
    }

    #[test]
    fn flipped_bit_names_the_chunk_and_both_checksums() {
        let s = session(2);
        let mut chunks = s.encode_gradient(&gradient(6)).unwrap();
        let expected = chunks[1].checksum;
        chunks[1].payload[40] ^= 0x04;
        let actual = crc32fast::hash(&chunks[1].payload);
        let want = GradientStreamError::ChecksumMismatch {
            chunk_index: 1,
            expected,
            actual,
        };
        assert_eq!(s.decode_chunks(refs(&chunks)).unwrap_err(), want);
        assert_eq!(s.decode_frames(&frames_of(&chunks)).unwrap_err(), want);
    }

    #[test]
    fn missing_chunks_are_an_incomplete_stream() {
        let s = session(2);
        let chunks = s.encode_gradient(&gradient(10)).unwrap();
        let err = s.decode_chunks(refs(&chunks[..2])).unwrap_err();
        assert_eq!(
            err,
            GradientStreamError::IncompleteStream {
                received: 2,
                total: 5
            }
        );
        assert_eq!(s.decode_frames(&frames_of(&chunks[..2])).unwrap_err(), err);
        // A header cut short after a whole frame: the original's loop ends the same way.
        let mut wire = frames_of(&chunks[..2]);
        wire.extend_from_slice(&[1, 2, 3]);
        assert_eq!(s.decode_frames(&wire).unwrap_err(), err);
    }

    #[test]
    fn duplicates_out_of_range_and_disagreeing_totals_are_refused() {
        let s = session(2);
        let chunks = s.encode_gradient(&gradient(6)).unwrap();

        let dup = vec![chunks[0].clone(), chunks[1].clone(), chunks[1].clone()];
        let (detail, idx, off) = frame_error(s.decode_chunks(refs(&dup)));
        assert_eq!(
            (detail.as_str(), idx, off),
            ("duplicate chunk index 1", Some(1), None)
        );
        let (detail, _, off) = frame_error(s.decode_frames(&frames_of(&dup)));
        assert_eq!(detail, "duplicate chunk index 1");
        assert_eq!(off, Some(frames_of(&dup[..2]).len() as u64));

        let mut far = chunks.clone();
        far[2].chunk_index = 7;
        let (detail, idx, _) = frame_error(s.decode_chunks(refs(&far)));
        assert_eq!(detail, "chunk index 7 out of range for total_chunks 3");
        assert_eq!(idx, Some(7));
        frame_error(s.decode_frames(&frames_of(&far)));

        let mut disagree = chunks.clone();
        disagree[2].total_chunks = 4;
        let (detail, idx, _) = frame_error(s.decode_chunks(refs(&disagree)));
        assert_eq!(
            detail,
            "chunks disagree on total_chunks: chunk 0 says 3, chunk 2 says 4"
        );
        assert_eq!(idx, Some(2));
        frame_error(s.decode_frames(&frames_of(&disagree)));

        let mut zero = chunks[..1].to_vec();
        zero[0].total_chunks = 0;
        frame_error(s.decode_chunks(refs(&zero)));
        frame_error(s.decode_frames(&frames_of(&zero)));
    }

    #[test]
    fn gradient_dtype_casts_on_receipt_and_a_lent_buffer_must_match_it() {
        let values = [1.5f32, -0.0, 3.0e38, f32::from_bits(0xffc0_1234)];
        let raw = crate::dtype::f32_bytes(&values).to_vec();
        let mut s = SessionConfig::new("d", 3);
        let as_f64 = GradientMeta {
            result: Some(Dtype::F64),
            ..GradientMeta::default()
        };
        let wire = s
            .encode_frames(Gradient::from(&values[..]).with_meta(&as_f64))
            .unwrap();
        let back = s.decode_frames_output(&wire).unwrap();
        assert_eq!(back.dtype(), Dtype::F64);
        let mut expected = vec![0u8; 32];
        crate::dtype::convert(&raw, Dtype::F32, &mut expected, Dtype::F64);
        assert_eq!(back.owned_bytes(), &expected[..]);
        // A float32 out= for a gradient that comes back as float64: refused at chunk 0,
        // nothing written.
        let mut out = [7.0f32; 4];
        let err = s.decode_frames_into(&wire, &mut out).unwrap_err();
        assert_eq!(
            err,
            GradientStreamError::GradientDtype {
                expected: "float32",
                received: "float64",
                chunk_index: Some(0),
            }
        );
        assert_eq!(out, [7.0; 4]);
        // bfloat16 handed back as float32 (no bfloat16 dtype in Python): an exact widening.
        s.bf16_as_f32 = true;
        let bf = [0x3f81u16, 0xc000];
        let raw: Vec<u8> = bf.iter().flat_map(|b| b.to_ne_bytes()).collect();
        let wire = s.encode_frames(Gradient::new(&raw, Dtype::BF16)).unwrap();
        assert_eq!(
            s.decode_frames_output(&wire).unwrap().into_vec(),
            [f32::from_bits(0x3f81_0000), -2.0]
        );
    }

    #[test]
    fn chunks_must_agree_on_their_dtypes() {
        let s = SessionConfig::new("d", 2);
        let half = bytes_of(Dtype::F16, 4);
        let a = s.encode_gradient(Gradient::new(&half, Dtype::F16)).unwrap();
        let b = s.encode_gradient(&vec![1.0f32; 4]).unwrap();
        let mixed = vec![a[0].as_ref(), b[1].as_ref()];
        let err = s.decode_chunks_output(mixed).unwrap_err();
        assert_eq!(
            err.to_string(),
            "chunks disagree on the value dtype: chunk 0 holds float16, chunk 1 holds float32"
        );
        let as_f64 = GradientMeta {
            result: Some(Dtype::F64),
            ..GradientMeta::default()
        };
        let c = s
            .encode_gradient(Gradient::new(&half, Dtype::F16).with_meta(&as_f64))
            .unwrap();
        let mut wire = Vec::new();
        for chunk in [&a[0], &c[1]] {
            wire.extend(chunk.header().to_bytes());
            wire.extend(&chunk.payload);
        }
        match s.decode_frames_output(&wire).unwrap_err() {
            GradientStreamError::Frame {
                detail,
                chunk_index,
                offset,
            } => {
                assert_eq!(
                    detail,
                    "chunks disagree on gradient_dtype: chunk 0 says none, chunk 1 says float64"
                );
                assert_eq!(
                    (chunk_index, offset),
                    (Some(1), Some(a[0].payload.len() as u64 + 16))
                );
            }
            e => panic!("wrong error {e:?}"),
        }
    }
}
