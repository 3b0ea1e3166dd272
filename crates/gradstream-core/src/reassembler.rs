//! `Reassembler`: puts one gradient together from frames as they arrive, in any order,
//! applying the decoding rules to each on arrival and leaving the assembly untouched when
//! a frame is refused.
//!
//! Uses `rules` (the checks and `take_chunk`), `session` (`ChunkRef`), `output`, `seal`,
//! `shape` and `frame`; used by `receiver`.

use std::collections::BTreeMap;

use crate::error::{GradientStreamError, Result};
use crate::frame::{FrameHeader, Limits};
use crate::output::{OutSlice, Output, ValueSink};
use crate::rules::{check_range, check_total, duplicate, take_chunk, DtypeCheck, Receiving};
use crate::seal::{Position, SealCheck, SealRule, TransferId};
use crate::session::{ChunkRef, Templates};
use crate::shape::ShapeCheck;

/// Puts a gradient together from frames as they arrive, checking each on arrival.
///
/// Frames in index order (the usual case) are decoded straight into the result; a frame
/// that comes early waits, decoded, until the ones before it are in.
#[derive(Debug)]
pub struct Reassembler {
    max_gradient_len: usize,
    /// Index and total_chunks of the first frame: every later frame must agree.
    first: Option<(u32, u32)>,
    received: usize,
    /// Values decoded so far, early ones included.
    count: usize,
    /// The index whose values go at the end of `values` next.
    next: u32,
    values: Output,
    early: BTreeMap<u32, Output>,
    /// Upper bound for the initial reservation (values the input could hold at most).
    reserve_cap: usize,
    shape: ShapeCheck,
    dtypes: DtypeCheck,
    /// What the chunks' seals must say.
    seal: SealRule,
    /// bfloat16 comes back as float32.
    bf16_as_f32: bool,
    /// Chunk 0's `gradstream_tensors`, a tensor set's manifest.
    manifest: Option<String>,
    /// The templates our own payloads match (the session's, or a set of its own).
    templates: Templates,
}

/// The half-open ranges of chunk indexes given in increasing order, each range as long
/// as it can be (what a resume message carries: docs/spec/protocol.md "Resume").
pub(crate) fn ranges_of(indexes: impl IntoIterator<Item = u32>) -> Vec<(u32, u32)> {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for index in indexes {
        match ranges.last_mut() {
            Some((_, end)) if *end == index => *end = index.saturating_add(1),
            _ => ranges.push((index, index.saturating_add(1))),
        }
    }
    ranges
}

impl Reassembler {
    /// The chunks taken so far, as increasing, disjoint, non-adjacent half-open ranges:
    /// those before `next`, then the early ones.
    pub(crate) fn held(&self) -> Vec<(u32, u32)> {
        // Chunk `next` is missing (else it would be in place), so the early ones never
        // touch those before it.
        let in_order = (self.next > 0).then_some((0, self.next));
        in_order
            .into_iter()
            .chain(ranges_of(self.early.keys().copied()))
            .collect()
    }

    pub fn new(limits: Limits, reserve_cap: usize) -> Self {
        Self {
            max_gradient_len: limits.max_gradient_len,
            first: None,
            received: 0,
            count: 0,
            next: 0,
            values: Output::default(),
            early: BTreeMap::new(),
            reserve_cap: reserve_cap.min(limits.max_gradient_len),
            shape: ShapeCheck::default(),
            dtypes: DtypeCheck::default(),
            seal: SealRule::default(),
            bf16_as_f32: false,
            manifest: None,
            templates: Templates::new(),
        }
    }

    /// Match payloads against `templates` (a session's: `SessionConfig::templates`)
    /// rather than a set of its own.
    pub fn templates(mut self, templates: Templates) -> Self {
        self.templates = templates;
        self
    }

    /// Hand bfloat16 gradients back as float32 (`SessionConfig::bf16_as_f32`).
    pub fn bf16_as_f32(mut self, widen: bool) -> Self {
        self.bf16_as_f32 = widen;
        self
    }

    /// Hold every chunk to `check`, sealed at `position`.
    pub fn expect_seal(mut self, check: SealCheck, position: Position) -> Self {
        self.seal = SealRule::new(check, position);
        self
    }

    /// The transfer id of the chunks taken so far (the expected one, in `Exact` mode).
    pub fn transfer(&self) -> Option<TransferId> {
        self.seal.transfer()
    }

    /// Write the values into the caller's buffer instead of a vector of our own.
    pub(crate) fn into_output(mut self, out: OutSlice) -> Self {
        self.values = Output::lent(out);
        self
    }

    pub fn received(&self) -> usize {
        self.received
    }

    /// total_chunks of the gradient, once a frame has told it.
    pub fn total(&self) -> Option<u32> {
        self.first.map(|(_, total)| total)
    }

    /// Check and take one frame; `Ok(true)` once every chunk is in. A frame that fails
    /// leaves the assembly as it was.
    pub fn accept(&mut self, header: &FrameHeader, payload: &[u8], offset: u64) -> Result<bool> {
        let index = header.chunk_index;
        let (first_index, total) = self.first.unwrap_or((index, header.total_chunks));
        self.check_frame(first_index, total, header)
            .map_err(|e| e.at_offset(offset))?;
        let first_in_order = index == self.next && self.received == 0;
        let before = self.values.len();
        let mut fresh = Output::default();
        self.count = match self.take(header, payload, offset, &mut fresh) {
            Ok(count) => count,
            Err(e) => {
                self.forget(index, before);
                return Err(e);
            }
        };
        if first_in_order {
            // Room for the gradient, guessed from the first chunk's own values (every
            // chunk but the last holds as many), within what can come: one allocation
            // of about the result's size, where growing by doubling would copy.
            let per_chunk = self.values.len() - before;
            let guess = (total as usize)
                .saturating_mul(per_chunk)
                .min(self.reserve_cap);
            self.values.reserve(guess.saturating_sub(self.values.len()));
        }
        self.place(index, fresh);
        self.first = Some((first_index, total));
        self.received += 1;
        Ok(self.received == total as usize)
    }

    /// Decode the frame's chunk under the rules, into the result when it is the next in
    /// order, else into `fresh`; the gradient's value count with it.
    fn take(
        &mut self,
        header: &FrameHeader,
        payload: &[u8],
        offset: u64,
        fresh: &mut Output,
    ) -> Result<usize> {
        let index = header.chunk_index;
        let room = self.max_gradient_len.saturating_sub(self.count);
        // A filled out= fixes the dtype every chunk must come back in; a sum takes any.
        let lent = (self.values.lending() == Some(crate::output::Lending::Fill))
            .then(|| self.values.dtype());
        let out = if index == self.next {
            &mut self.values
        } else {
            fresh
        };
        let into = Receiving {
            out,
            seal: &mut self.seal,
            dtypes: &mut self.dtypes,
            lent,
            bf16_as_f32: self.bf16_as_f32,
            room,
            store_room: Some(room),
            templates: &self.templates,
        };
        let chunk = ChunkRef {
            chunk_index: index,
            total_chunks: header.total_chunks,
            checksum: header.checksum,
            payload,
        };
        let (head, n) = take_chunk(chunk, into).map_err(|e| e.at_offset(offset))?;
        self.shape
            .check(index, head.shape)
            .map_err(|e| e.at_offset(offset))?;
        if index == 0 {
            self.manifest = head.manifest;
        }
        self.check_count(index, self.count + n, offset)
    }

    /// The gradient's value count once chunk `index` is in, if within max_gradient_len and
    /// the caller's buffer.
    fn check_count(&self, index: u32, count: usize, offset: u64) -> Result<usize> {
        if count > self.max_gradient_len {
            return Err(GradientStreamError::frame(
                format!(
                    "gradient exceeds max_gradient_len {}: {count} values by chunk {index}",
                    self.max_gradient_len
                ),
                Some(index),
            )
            .at_offset(offset));
        }
        if let Some(expected) = self.values.limit().filter(|&room| count > room) {
            return Err(GradientStreamError::GradientSize {
                expected,
                received: count,
                chunk_index: Some(index),
            });
        }
        Ok(count)
    }

    /// Undo what a refused chunk `index` did: its values (past `before`) go, and the
    /// first chunk's shape and dtype are only kept if the chunk is taken.
    fn forget(&mut self, index: u32, before: usize) {
        self.values.truncate(before);
        self.shape.undo(index);
        self.dtypes.undo(index);
        self.seal.undo(index);
        if index == 0 {
            self.manifest = None;
        }
    }

    /// Put a taken chunk in place: after the values when it was next (and then the early
    /// chunks it lets through), else among the early ones (its values in `fresh`).
    fn place(&mut self, index: u32, fresh: Output) {
        if index != self.next {
            self.early.insert(index, fresh);
            return;
        }
        self.next += 1;
        while let Some(early) = self.early.remove(&self.next) {
            if self.values.is_empty() {
                // Takes the chunks' dtype (all agree), if no chunk set it yet.
                let _ = self.values.set_dtype(early.dtype());
            }
            self.values.put_raw(early.owned_bytes(), early.dtype());
            self.next += 1;
        }
    }

    /// Rules 5 to 7: the header agrees with the first, is within the limits, is new.
    fn check_frame(&self, first_index: u32, total: u32, header: &FrameHeader) -> Result<()> {
        let index = header.chunk_index;
        check_total(first_index, total, index, header.total_chunks)?;
        // Every chunk carries at least one value (but the empty gradient's single chunk),
        // so more chunks than max_gradient_len values cannot be a gradient we accept.
        if total as usize > self.max_gradient_len.max(1) {
            return Err(GradientStreamError::frame(
                format!(
                    "total_chunks {total} above max_gradient_len {}",
                    self.max_gradient_len
                ),
                Some(index),
            ));
        }
        check_range(index, total)?;
        if index < self.next || self.early.contains_key(&index) {
            return Err(duplicate(index));
        }
        Ok(())
    }

    /// The gradient, or IncompleteStreamError when chunks are missing (or GradientSize
    /// when it is shorter than the caller's buffer).
    pub fn finish(self) -> Result<Output> {
        let total = self.total().map_or(0, |t| t as usize);
        if self.received < total {
            return Err(GradientStreamError::IncompleteStream {
                received: self.received,
                total,
            });
        }
        let shape = self.shape.finish(self.count)?;
        if let Some(expected) = self.values.limit().filter(|&room| room != self.count) {
            return Err(GradientStreamError::GradientSize {
                expected,
                received: self.count,
                chunk_index: None,
            });
        }
        let mut values = self.values;
        values.shape = shape;
        values.manifest = self.manifest;
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{gradient, session, unlimited};

    #[test]
    fn a_refused_frame_leaves_the_assembly_untouched() {
        let chunks = session(2).encode_gradient(&gradient(6)).unwrap();
        let mut bad = chunks[1].clone();
        bad.checksum ^= 1;
        let mut assembly = Reassembler::new(unlimited(), 1 << 20);
        assert!(!assembly
            .accept(&chunks[0].header(), &chunks[0].payload, 0)
            .unwrap());
        assert!(assembly.accept(&bad.header(), &bad.payload, 0).is_err());
        // An out-of-range first frame must not fix the total for the frames after it.
        let mut fresh = Reassembler::new(unlimited(), 1 << 20);
        let mut far = chunks[0].clone();
        far.total_chunks = 0;
        assert!(fresh.accept(&far.header(), &far.payload, 0).is_err());
        assert!(!fresh
            .accept(&chunks[0].header(), &chunks[0].payload, 0)
            .unwrap());
        for c in &chunks[1..] {
            assembly.accept(&c.header(), &c.payload, 0).unwrap();
        }
        assert_eq!(assembly.finish().unwrap().into_vec(), gradient(6));
    }

    #[test]
    fn what_is_held_is_the_chunks_taken_as_ranges() {
        // 10 chunks of 2 values; taken in the order 3, 4, 0, 7, 1, 9: held 0..2, 3..5,
        // 7..8, 9..10 (what a resume tells the sender).
        let chunks = session(2).encode_gradient(&gradient(20)).unwrap();
        let mut assembly = Reassembler::new(unlimited(), 1 << 20);
        assert_eq!(assembly.held(), vec![]);
        let mut expected = vec![
            vec![(3, 4)],
            vec![(3, 5)],
            vec![(0, 1), (3, 5)],
            vec![(0, 1), (3, 5), (7, 8)],
            vec![(0, 2), (3, 5), (7, 8)],
            vec![(0, 2), (3, 5), (7, 8), (9, 10)],
        ]
        .into_iter();
        for index in [3usize, 4, 0, 7, 1, 9] {
            let chunk = &chunks[index];
            assembly.accept(&chunk.header(), &chunk.payload, 0).unwrap();
            assert_eq!(
                Some(assembly.held()),
                expected.next(),
                "after chunk {index}"
            );
        }
        for index in [2usize, 5, 6, 8] {
            let chunk = &chunks[index];
            assembly.accept(&chunk.header(), &chunk.payload, 0).unwrap();
        }
        assert_eq!(assembly.held(), vec![(0, 10)]);
    }
}
