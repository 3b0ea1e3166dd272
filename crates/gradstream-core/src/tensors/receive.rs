//! The receiving side of a tensor set: `TensorSetReceiver`, the sans-I/O receiver of a
//! whole set (the docs/spec/decoding-rules.md receiver rules 1-4, in order). `decode` drives it
//! over bytes
//! in memory (and its tests walk every rule), the tokio receiver (`stream`) and the
//! bindings' asyncio receiver over a connection.
//!
//! The manifest frame is read with max_payload_len capped at 16 MiB, checked from its
//! header alone, and may hold no values; each tensor is read with max_gradient_len its
//! entry's element count (at least 1) and checked against its entry on arrival. Every
//! error met on a tensor is noted `while receiving tensor "name" (k of n) of a tensor set`.
//! Sealed sets: the manifest is held to the receiver's `SealCheck` at position `Manifest`,
//! and each tensor k to the manifest's transfer id exactly, at position `Tensor(k)`; a
//! manifest a receiver without `seal=True` took unsealed makes every tensor's frames
//! unsealed too (`SealCheck::Absent`).
//!
//! Uses `manifest`, `encode` (the cap), the crate's `FrameReceiver`, `seal` and `output`;
//! used by `decode`, `stream` and the bindings.

use super::ascii::quote_str;
use super::encode::manifest_cap;
use super::manifest::{read_manifest, Entry};
use super::{note, Doing};
use crate::dtype::Dtype;
use crate::error::{GradientStreamError, Result};
use crate::frame::HEADER_LEN;
use crate::output::Output;
use crate::receiver::{Ended, FrameReceiver};
use crate::seal::{Position, SealCheck, TransferId};
use crate::session::SessionConfig;
use crate::shape::shape_text;

/// A received set: each tensor's manifest entry and its values, in manifest order.
pub type TensorSet = Vec<(Entry, Output)>;

/// A sans-I/O receiver for one tensor set, in the manner of `FrameReceiver`: told what
/// bytes arrived (exactly `want()` of them), it applies the rules and says what it wants
/// next, until `feed` says the set is complete; then `finish` hands it over.
#[derive(Debug)]
pub struct TensorSetReceiver {
    config: SessionConfig,
    /// This receive's own bound on the set's values, below the session's
    /// max_gradient_len: what a caller that knows the set's size expects at most.
    max_values: Option<usize>,
    /// Upper bound for what a tensor's receiver reserves up front.
    reserve_cap: usize,
    /// The frames being read: the manifest's, then each tensor's; None once the set is
    /// complete.
    frames: Option<FrameReceiver>,
    /// The manifest's header has been taken.
    header_seen: bool,
    /// The manifest's entries, once it has been read.
    entries: Option<Vec<Entry>>,
    /// What the manifest's seal must say, and the transfer id it carried (which every
    /// tensor's frames must carry too).
    seal: SealCheck,
    transfer: Option<TransferId>,
    /// The tensors received and checked, in order.
    outputs: Vec<Output>,
    /// The set's last tensor, complete, its checks left to `finish` (so that
    /// `decode_tensors` can refuse bytes after it first, as decode_frames' rule 9 does).
    last: Option<LastTensor>,
    /// Bytes taken since the current gradient (manifest or tensor) began.
    offset: u64,
    /// Frames of the tensors taken so far, and the sum of the total_chunks of every
    /// tensor begun (the manifest's frame is in neither).
    frames_received: u64,
    frames_announced: u64,
}

impl TensorSetReceiver {
    pub fn new(config: &SessionConfig) -> Self {
        Self::with_reserve_cap(config, config.limits.max_gradient_len)
    }

    /// A receiver that reserves at most `reserve_cap` values up front for any tensor (an
    /// input of known length bounds what it can hold).
    pub(crate) fn with_reserve_cap(config: &SessionConfig, reserve_cap: usize) -> Self {
        let mut manifest = config.clone();
        manifest.limits.max_payload_len = manifest_cap(config);
        manifest.limits.max_gradient_len = 0;
        let seal = config.seal_check();
        Self {
            config: config.clone(),
            max_values: None,
            reserve_cap,
            frames: Some(FrameReceiver::new(&manifest, 0).expect_seal(seal, Position::Manifest)),
            header_seen: false,
            entries: None,
            seal,
            transfer: None,
            outputs: Vec::new(),
            last: None,
            offset: 0,
            frames_received: 0,
            frames_announced: 0,
        }
    }

    /// Hold the set's seals to `check` (docs/spec/wire-format.md, sealed chunks), before its first
    /// byte: a
    /// connection's receiver expects `SealCheck::Exact` of the id it derives for the set.
    /// Replaces what the session's `seal` setting chose.
    pub fn expect_seal(mut self, check: SealCheck) -> Self {
        self.seal = check;
        if self.entries.is_none() {
            self.frames = self
                .frames
                .map(|frames| frames.expect_seal(check, Position::Manifest));
        }
        self
    }

    /// Refuse a set whose manifest declares more than `max_values` values in all (None:
    /// the session's max_gradient_len alone), from the manifest, before any value is read.
    pub fn max_values(mut self, max_values: Option<usize>) -> Self {
        self.max_values = max_values;
        self
    }

    /// Bytes wanted next: a header or a payload; 0 once the set is complete.
    pub fn want(&self) -> usize {
        self.frames.as_ref().map_or(0, FrameReceiver::want)
    }

    /// Whether the bytes wanted next belong to a tensor (what progress counts), not to
    /// the manifest.
    pub fn in_tensors(&self) -> bool {
        self.entries.is_some() && self.frames.is_some()
    }

    /// Frames of the set's tensors taken so far.
    pub fn frames_received(&self) -> u64 {
        self.frames_received
    }

    /// The sum of the total_chunks of every tensor whose first frame has arrived.
    pub fn frames_announced(&self) -> u64 {
        self.frames_announced
    }

    /// Where a transfer stands, for a timeout's message: (chunks received, total) of the
    /// gradient being read; the manifest's total is 1 once its header is in.
    pub fn at(&self) -> (usize, Option<u32>) {
        match (&self.frames, &self.entries) {
            (Some(frames), Some(_)) => (frames.received(), frames.total()),
            (Some(_), None) if self.header_seen => (0, Some(1)),
            _ => (0, None),
        }
    }

    /// Bytes taken since the gradient being read (or the last one read) began: the
    /// offset of anything found after it.
    pub fn gradient_offset(&self) -> u64 {
        self.offset
    }

    /// The index and entry of the tensor being read, or of the last one once the set is
    /// complete; None while the manifest is read and for an empty set.
    fn current(&self) -> Option<(usize, &Entry)> {
        let entries = self.entries.as_ref()?;
        let k = self.outputs.len().min(entries.len().checked_sub(1)?);
        entries.get(k).map(|entry| (k, entry))
    }

    /// `error`, met by the caller (a timeout, the connection) while this receiver is
    /// where it is: noted with the tensor concerned, if any.
    pub fn annotate(&self, error: GradientStreamError) -> GradientStreamError {
        match self.note() {
            Some(text) => error.noted(text),
            None => error,
        }
    }

    /// The note an error met now carries: `while receiving tensor "name" (k of n) of a
    /// tensor set` for the tensor being read; None while the manifest is.
    pub fn note(&self) -> Option<String> {
        let entries = self.entries.as_ref()?;
        let (k, entry) = self.current()?;
        Some(note(Doing::Receiving, &entry.name, k + 1, entries.len()))
    }

    /// Take exactly `want()` bytes; `Ok(true)` once the set's last frame is in.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<bool> {
        if self.frames.is_none() {
            return Err(GradientStreamError::frame(
                "the tensor set is complete: no more bytes are wanted",
                None,
            ));
        }
        if self.entries.is_none() {
            return self.feed_manifest(bytes);
        }
        self.feed_tensor(bytes).map_err(|e| self.annotate(e))
    }

    /// Rules 1 and 2: the manifest's header (one chunk, a payload within the cap), then
    /// its payload; its entries read and summed.
    fn feed_manifest(&mut self, bytes: &[u8]) -> Result<bool> {
        let Some(frames) = self.frames.as_mut() else {
            return Ok(true);
        };
        if !self.header_seen && bytes.len() == HEADER_LEN {
            let total = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
            if total != 1 {
                return Err(GradientStreamError::tensor_set(
                    format!(
                        "not a tensor set: the first gradient has {total} chunks; a set \
                         starts with a one-chunk manifest"
                    ),
                    None,
                ));
            }
        }
        let done = frames.feed(bytes)?;
        self.header_seen = true;
        self.offset += bytes.len() as u64;
        if !done {
            return Ok(false);
        }
        self.transfer = frames.transfer();
        let manifest = self.frames.take().map(FrameReceiver::finish).transpose()?;
        self.take_manifest(manifest.unwrap_or_default())
    }

    /// The manifest's frame is complete (its seal, if any, checked and its transfer id
    /// taken): its entries, then the first tensor's receiver (none for an empty set,
    /// which is then complete).
    fn take_manifest(&mut self, manifest: Output) -> Result<bool> {
        let Some(text) = manifest.manifest.as_deref() else {
            return Err(GradientStreamError::tensor_set(
                "not a tensor set: the first gradient has no gradstream_tensors manifest",
                None,
            ));
        };
        let entries = read_manifest(text)?;
        let held: u128 = entries.iter().map(|e| e.len() as u128).sum();
        let limit = self.config.limits.max_gradient_len;
        if held > limit as u128 {
            return Err(GradientStreamError::tensor_set(
                format!("tensor set holds {held} values, above max_gradient_len {limit}"),
                None,
            ));
        }
        if let Some(max_values) = self.max_values.filter(|&n| held > n as u128) {
            return Err(GradientStreamError::tensor_set(
                format!(
                    "tensor set holds {held} values, above this receive's max_values {max_values}"
                ),
                None,
            ));
        }
        self.frames = entries.first().map(|entry| self.tensor_receiver(0, entry));
        if self.frames.is_some() {
            self.offset = 0; // a tensor's offsets count from its own first frame
        }
        self.entries = Some(entries);
        Ok(self.frames.is_none())
    }

    /// Rule 3's receiver of tensor `k`: the session's max_payload_len, max_gradient_len
    /// the entry's element count (at least 1); sealed, the manifest's id exactly, at
    /// position k.
    fn tensor_receiver(&self, k: usize, entry: &Entry) -> FrameReceiver {
        let mut config = self.config.clone();
        config.limits.max_gradient_len = entry.len().max(1);
        let check = match (self.seal, self.transfer) {
            (_, Some(id)) => SealCheck::Exact(id),
            // The set's manifest came unsealed: so must its tensors.
            (SealCheck::WhenPresent, None) => SealCheck::Absent,
            (check, None) => check,
        };
        // A manifest of at most 16 MiB lists far fewer than 2^32 - 2 tensors.
        let position = Position::Tensor(k as u32);
        FrameReceiver::new(&config, self.reserve_cap).expect_seal(check, position)
    }

    /// One unit of the current tensor; the next tensor's receiver once it is complete.
    fn feed_tensor(&mut self, bytes: &[u8]) -> Result<bool> {
        let Some(frames) = self.frames.as_mut() else {
            return Ok(true);
        };
        let (before, known) = (frames.received(), frames.total().is_some());
        let done = frames.feed(bytes)?;
        self.offset += bytes.len() as u64;
        self.frames_received += (frames.received() - before) as u64;
        if let (false, Some(total)) = (known, frames.total()) {
            self.frames_announced += u64::from(total);
        }
        if !done {
            return Ok(false);
        }
        let Some(frames) = self.frames.take() else {
            return Ok(true);
        };
        if self.is_last_tensor() {
            // Its shape rule (decoding-rules.md rule 9) comes after the left-over check.
            self.last = Some(LastTensor::Read(Box::new(frames)));
            return Ok(true);
        }
        self.take_tensor(frames.finish()?)
    }

    /// The tensor being read is the manifest's last.
    fn is_last_tensor(&self) -> bool {
        let n = self.entries.as_ref().map_or(0, Vec::len);
        self.outputs.len() + 1 >= n
    }

    /// A tensor complete: checked against its entry, and the next one's receiver; the
    /// last one is kept for `finish` to check.
    fn take_tensor(&mut self, values: Output) -> Result<bool> {
        if self.is_last_tensor() {
            self.last = Some(LastTensor::Ended(values));
            return Ok(true);
        }
        let entries = self.entries.as_deref().unwrap_or_default();
        let k = self.outputs.len();
        as_declared(&entries[k], &values, self.config.bf16_as_f32)?;
        self.outputs.push(values);
        let next = self.tensor_receiver(k + 1, &entries[k + 1]);
        self.frames = Some(next);
        self.offset = 0;
        Ok(false)
    }

    /// The stream ended after `got` bytes of what `want()` asked for: rule 4 (the empty
    /// set, before the first byte), the frame receiver's truncation errors, or a set cut
    /// short between two tensors.
    pub fn end_of_stream(mut self, got: usize) -> Result<TensorSet> {
        let Some(frames) = self.frames.take() else {
            return self.finish();
        };
        if self.entries.is_none() {
            self.transfer = frames.transfer();
            return match frames.end_of_stream(got)? {
                Ended::BeforeFirstByte(_) => Ok(Vec::new()),
                Ended::Gradient(manifest) => match self.take_manifest(manifest)? {
                    true => self.finish(),
                    false => Err(self.cut_short()),
                },
            };
        }
        let ended = frames.end_of_stream(got).map_err(|e| self.annotate(e))?;
        match ended {
            Ended::BeforeFirstByte(_) => Err(self.cut_short()),
            Ended::Gradient(values) => {
                match self.take_tensor(values).map_err(|e| self.annotate(e))? {
                    true => self.finish(),
                    false => Err(self.cut_short()),
                }
            }
        }
    }

    /// The set ends before the current tensor's first byte.
    fn cut_short(&self) -> GradientStreamError {
        let n = self.entries.as_ref().map_or(0, Vec::len);
        let error = GradientStreamError::tensor_set(
            format!(
                "the tensor set ends after {} of its {n} tensors",
                self.outputs.len()
            ),
            None,
        );
        self.annotate(error)
    }

    /// The set, once `feed` said it is complete, its last tensor checked against its
    /// entry; before that, what the stream ending here means (`end_of_stream(0)`).
    pub fn finish(mut self) -> Result<TensorSet> {
        if self.frames.is_some() {
            return self.end_of_stream(0);
        }
        // Both checks while the entries are here, so `annotate` notes the last tensor.
        let last = match self.last.take() {
            Some(LastTensor::Read(frames)) => Some(frames.finish().map_err(|e| self.annotate(e))?),
            Some(LastTensor::Ended(values)) => Some(values),
            None => None,
        };
        if let (Some(last), Some((_, entry))) = (&last, self.current()) {
            as_declared(entry, last, self.config.bf16_as_f32).map_err(|e| self.annotate(e))?;
        }
        self.outputs.extend(last);
        let entries = self.entries.take().unwrap_or_default();
        Ok(entries.into_iter().zip(self.outputs).collect())
    }
}

/// The set's last tensor before `finish`: its frames all read (their gradient's own
/// end checks still to run), or its gradient as a stream that ended gave it.
#[derive(Debug)]
enum LastTensor {
    Read(Box<FrameReceiver>),
    Ended(Output),
}

/// Rule 3's end: the tensor came back in its entry's dtype (as this session hands it
/// back: bfloat16 as float32 with `bf16_as_f32`) and shape (a flat shape when its frames
/// carried none).
fn as_declared(entry: &Entry, values: &Output, bf16_as_f32: bool) -> Result<()> {
    let hand_back = match entry.dtype {
        Dtype::BF16 if bf16_as_f32 => Dtype::F32,
        dtype => dtype,
    };
    let flat = [values.len()];
    let shape = values.shape.as_deref().unwrap_or(&flat);
    if values.dtype() == hand_back && shape == entry.shape.as_slice() {
        return Ok(());
    }
    Err(GradientStreamError::tensor_set(
        format!(
            "tensor {} arrived as {} {}; the manifest says {} {}",
            quote_str(&entry.name),
            values.dtype().name(),
            shape_text(shape),
            entry.dtype.name(),
            shape_text(&entry.shape)
        ),
        Some(&entry.name),
    ))
}

#[cfg(test)]
mod tests {
    use super::super::encode::encode_tensors;
    use super::super::manifest::manifest_json;
    use super::super::testing::{frames, gradients, manifest_of, set_of};
    use super::*;
    use crate::dtype::convert;

    fn session() -> SessionConfig {
        SessionConfig::new("rx", 4)
    }

    #[test]
    fn the_receiver_counts_frames_and_bfloat16_comes_back_as_asked() {
        let s = session();
        let set = set_of(&[
            ("h", Dtype::BF16, vec![9], 4),
            ("f", Dtype::F32, vec![2], 5),
        ]);
        let wire = encode_tensors(&s, None, &gradients(&set)).unwrap();
        let mut widened = session();
        widened.bf16_as_f32 = true;
        let mut rx = TensorSetReceiver::new(&widened);
        assert_eq!(rx.at(), (0, None));
        let mut pos = 0;
        let mut seen = Vec::new();
        loop {
            let want = rx.want();
            seen.push((rx.in_tensors(), rx.frames_received(), rx.frames_announced()));
            let done = rx.feed(&wire[pos..pos + want]).unwrap();
            pos += want;
            if done {
                break;
            }
        }
        assert_eq!((pos, rx.want()), (wire.len(), 0));
        // Manifest (header, payload), then "h" in 3 frames, "f" in 1.
        assert_eq!(&seen[..3], &[(false, 0, 0), (false, 0, 0), (true, 0, 0)]);
        assert_eq!((rx.frames_received(), rx.frames_announced()), (4, 4));
        assert!(rx.feed(&[]).is_err());
        let back = rx.finish().unwrap();
        assert_eq!(back[0].1.dtype(), Dtype::F32);
        let mut bits = vec![0u8; 9 * 4];
        convert(&set[0].1, Dtype::BF16, &mut bits, Dtype::F32);
        assert_eq!(back[0].1.owned_bytes(), &bits[..]);
        // Without ml_dtypes a float32 tensor passes for a bfloat16 entry.
        let m = manifest_of(&s, &manifest_json(&[Entry::new("h", Dtype::BF16, vec![1])]));
        let data = [&m[..], &frames(&s, Dtype::F32, Some(&[1]), &[0; 4])].concat();
        assert!(super::super::decode_tensors(&widened, &data).is_ok());
        assert!(super::super::decode_tensors(&s, &data).is_err());
    }
}
