//! Chunking and reassembly: the semantics of ipfrs-transport's `GradientStreamSession`,
//! with the original's silent failures (duplicates, out-of-range indices, disagreeing
//! totals, trailing bytes) turned into errors. The rule order is the one the README's
//! "Decoding rules" section states; `gradstream.reference` follows the same list.

use std::collections::BTreeMap;

use crate::codec::{self, Compression, Encoding, Layout};
use crate::dtype::Dtype;
use crate::error::{GradientStreamError, Result};
use crate::frame::{FrameHeader, Limits, HEADER_LEN};
use crate::output::{Head, OutSlice, Output, ValueSink};
use crate::shape::ShapeCheck;
use crate::template::Template;

/// Default chunk size: 65,536 f32 values, 256 KiB of gradient.
pub const DEFAULT_CHUNK_SIZE: usize = 65_536;

/// A session's settings. The session id never goes on the wire; it labels chunks locally.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionConfig {
    pub session_id: String,
    /// Values per chunk; never 0 (the original raises 0 to 1).
    pub chunk_size: usize,
    /// Arrow IPC buffer compression of the payloads this session writes (it reads any).
    pub compression: Option<Compression>,
    pub limits: Limits,
    /// Longest wait for a byte to move, on streams; None waits for ever.
    pub timeout: Option<std::time::Duration>,
    /// Columns of the payloads this session writes (it reads either).
    pub layout: Layout,
    /// The `gradient_shape` text to write into every payload, for the gradient being
    /// encoded: set per call by the bindings when the Python session keeps shapes.
    pub shape: Option<std::sync::Arc<str>>,
    /// The `gradient_dtype` to write into every payload (the dtype the receiver hands
    /// back, when not the wire's): set per call by the bindings.
    pub result: Option<Dtype>,
    /// A tensor set's manifest, written into the payload of the set's first gradient.
    pub manifest: Option<std::sync::Arc<str>>,
}

/// A gradient to send: its values as bytes in memory order, their dtype, and the dtype
/// they travel in (`wire_dtype`: each chunk is cast as it is encoded, by the cast rule).
#[derive(Clone, Copy, Debug)]
pub struct Gradient<'g> {
    raw: &'g [u8],
    dtype: Dtype,
    wire: Dtype,
}

impl<'g> Gradient<'g> {
    /// `raw` holds values of `dtype` (a whole number of them), sent as they are.
    pub fn new(raw: &'g [u8], dtype: Dtype) -> Self {
        let whole = raw.len() - raw.len() % dtype.width();
        Self {
            raw: &raw[..whole],
            dtype,
            wire: dtype,
        }
    }

    /// The same values, cast to `wire` for transfer.
    pub fn cast_to(self, wire: Dtype) -> Self {
        Self { wire, ..self }
    }

    pub fn len(&self) -> usize {
        self.raw.len() / self.dtype.width()
    }

    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    pub fn raw(&self) -> &'g [u8] {
        self.raw
    }
}

impl<'g> From<&'g [f32]> for Gradient<'g> {
    fn from(values: &'g [f32]) -> Self {
        Self::new(codec::f32_bytes(values), Dtype::F32)
    }
}

impl<'g> From<&'g Vec<f32>> for Gradient<'g> {
    fn from(values: &'g Vec<f32>) -> Self {
        Self::from(values.as_slice())
    }
}

/// One chunk's values in the dtype they travel in: borrowed when no cast is asked for,
/// else cast (a chunk at a time, so the sender never holds a cast copy of the gradient).
fn cast_window<'w>(gradient: &Gradient<'_>, window: &'w [u8]) -> std::borrow::Cow<'w, [u8]> {
    if gradient.wire == gradient.dtype {
        return std::borrow::Cow::Borrowed(window);
    }
    let n = window.len() / gradient.dtype.width();
    let mut cast = vec![0u8; n * gradient.wire.width()];
    crate::dtype::convert(window, gradient.dtype, &mut cast, gradient.wire);
    std::borrow::Cow::Owned(cast)
}

/// `raw` as float32 values, when it is aligned for them (the template paths need f32).
pub fn as_f32(raw: &[u8]) -> Option<&[f32]> {
    // SAFETY: every bit pattern is an f32; align_to only hands out the aligned middle.
    let (head, values, tail) = unsafe { raw.align_to::<f32>() };
    (head.is_empty() && tail.is_empty()).then_some(values)
}

/// One encoded chunk, owning its payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedChunk {
    pub chunk_index: u32,
    pub total_chunks: u32,
    pub checksum: u32,
    pub payload: Vec<u8>,
}

/// The chunks of one gradient and the exact size of its frame stream.
#[derive(Debug)]
pub struct FramePlan<'g> {
    total: u32,
    /// Each chunk's values, as bytes of the gradient's dtype.
    windows: Vec<&'g [u8]>,
    payload_lens: Vec<u32>,
    len: usize,
    /// Compressed sessions: each chunk's payload and CRC, encoded while planning (their
    /// sizes depend on the values).
    encoded: Vec<(Vec<u8>, u32)>,
}

impl<'g> FramePlan<'g> {
    /// Bytes of the whole frame stream.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn total_chunks(&self) -> u32 {
        self.total
    }

    /// Each chunk's index, values (bytes) and exact payload length.
    pub fn chunks(&self) -> impl Iterator<Item = (u32, &'g [u8], u32)> + '_ {
        (0u32..)
            .zip(self.windows.iter().copied())
            .zip(self.payload_lens.iter().copied())
            .map(|((index, window), len)| (index, window, len))
    }
}

/// Encode one chunk's plain float32 payload into `out` (exactly its planned length);
/// its CRC-32.
pub fn write_payload(layout: Layout, raw: &[u8], out: &mut [u8]) -> Result<u32> {
    let values = as_f32(raw);
    match values.zip(Template::get(layout, raw.len() / 4)) {
        Some((values, template)) if template.len() == out.len() => Ok(template.write(values, out)),
        _ => {
            codec::encode_payload_exact(layout, raw, out)?;
            Ok(codec::checksum(out))
        }
    }
}

/// The length of the payload of `n` values in `layout`.
fn payload_len_of(layout: Layout, n: usize) -> Result<usize> {
    match Template::get(layout, n) {
        Some(template) => Ok(template.len()),
        // No template (empty or huge chunks): measure by encoding as many zeros.
        None => Ok(codec::encode_payload(layout, &vec![0f32; n])?.len()),
    }
}

/// A chunk to decode, borrowed from wherever the caller keeps it.
#[derive(Clone, Copy, Debug)]
pub struct ChunkRef<'a> {
    pub chunk_index: u32,
    pub total_chunks: u32,
    pub checksum: u32,
    pub payload: &'a [u8],
}

impl SessionConfig {
    pub fn new(session_id: impl Into<String>, chunk_size: usize) -> Self {
        Self {
            session_id: session_id.into(),
            chunk_size: chunk_size.max(1),
            compression: None,
            limits: Limits::default(),
            timeout: None,
            layout: Layout::Seed,
            shape: None,
            result: None,
            manifest: None,
        }
    }

    /// How this session writes payloads.
    pub fn encoding(&self, dtype: Dtype) -> Encoding {
        Encoding {
            layout: self.layout,
            compression: self.compression,
            dtype,
            shape: self.shape.clone(),
            result: self.result,
            manifest: self.manifest.clone(),
        }
    }

    /// Whether `gradient`'s payloads come from the Arrow writer chunk by chunk (their
    /// bytes depend on more than the value count: a cast, compression, metadata, a dtype
    /// without templates) rather than templates.
    pub fn writes_each_payload(&self, gradient: &Gradient<'_>) -> bool {
        gradient.dtype != gradient.wire || !self.encoding(gradient.wire).is_plain()
    }

    /// Number of chunks for a gradient of `len` values: ceiling division, and 1 for an
    /// empty gradient so that a stream always has a frame.
    pub fn chunk_count(&self, len: usize) -> Result<u32> {
        let n = len.div_ceil(self.chunk_size).max(1);
        u32::try_from(n).map_err(|_| {
            GradientStreamError::frame(
                format!(
                    "a gradient of {len} values needs {n} chunks of {}, more than \
                     total_chunks can count ({}); use a larger chunk_size",
                    self.chunk_size,
                    u32::MAX
                ),
                None,
            )
        })
    }

    /// Chunk `index` of `gradient` as one frame (header + payload): the asyncio-streams
    /// sender asks for frames one at a time.
    pub fn encode_frame<'g>(
        &self,
        gradient: impl Into<Gradient<'g>>,
        index: u32,
    ) -> Result<Vec<u8>> {
        let gradient = gradient.into();
        let total = self.chunk_count(gradient.len())?;
        let width = gradient.dtype.width();
        let start = (index as usize)
            .saturating_mul(self.chunk_size)
            .min(gradient.len());
        let end = start.saturating_add(self.chunk_size).min(gradient.len());
        let mut frame = vec![0u8; HEADER_LEN];
        let window = cast_window(&gradient, &gradient.raw[start * width..end * width]);
        codec::append_payload(self.encoding(gradient.wire), &window, &mut frame)?;
        let payload_len = self.check_payload_len(index, end - start, frame.len() - HEADER_LEN)?;
        let header = FrameHeader {
            chunk_index: index,
            total_chunks: total,
            payload_len,
            checksum: codec::checksum(&frame[HEADER_LEN..]),
        };
        frame[..HEADER_LEN].copy_from_slice(&header.to_bytes());
        Ok(frame)
    }

    /// The gradient's windows, one per chunk (one empty window for an empty gradient).
    fn windows<'g>(&self, gradient: Gradient<'g>) -> Result<(u32, Vec<&'g [u8]>)> {
        let total = self.chunk_count(gradient.len())?;
        let windows = if gradient.is_empty() {
            vec![gradient.raw]
        } else {
            // chunk_count bounds chunk_size * width by the gradient's bytes.
            let bytes = self.chunk_size.saturating_mul(gradient.dtype.width());
            gradient.raw.chunks(bytes).collect()
        };
        Ok((total, windows))
    }

    /// The length of chunk `index`'s payload (`values` values) as the header's u32, if the
    /// session's limit allows it: a peer with the same limit would refuse anything longer.
    /// The message leaves out the byte count, which differs between Arrow writers, so that
    /// the reference words it alike.
    fn check_payload_len(&self, index: u32, values: usize, len: usize) -> Result<u32> {
        u32::try_from(len)
            .ok()
            .filter(|&n| n <= self.limits.max_payload_len)
            .ok_or_else(|| {
                GradientStreamError::frame(
                    format!(
                        "chunk {index} ({values} values) would encode to a payload above \
                         max_payload_len {} bytes; use a smaller chunk_size",
                        self.limits.max_payload_len
                    ),
                    Some(index),
                )
            })
    }

    /// Split a gradient into chunks, each an Arrow IPC payload with its CRC-32.
    pub fn encode_gradient<'g>(
        &self,
        gradient: impl Into<Gradient<'g>>,
    ) -> Result<Vec<EncodedChunk>> {
        let plan = self.plan_frames(gradient)?;
        plan.chunks()
            .map(|(index, window, len)| {
                let mut payload = vec![0u8; len as usize];
                Ok(EncodedChunk {
                    chunk_index: index,
                    total_chunks: plan.total_chunks(),
                    checksum: self.write_chunk(&plan, index, window, &mut payload)?,
                    payload,
                })
            })
            .collect()
    }

    /// The bytes `stream_to` writes: each chunk's header then its payload.
    pub fn encode_frames<'g>(&self, gradient: impl Into<Gradient<'g>>) -> Result<Vec<u8>> {
        let plan = self.plan_frames(gradient)?;
        let mut out = vec![0u8; plan.len];
        self.write_frames(&plan, &mut out)?;
        Ok(out)
    }

    /// Bytes of the frame stream of a gradient of `len` values (what `encode_frames` and
    /// the senders produce), with the errors encoding such a gradient would raise.
    pub fn frames_len(&self, len: usize) -> Result<usize> {
        let total = self.chunk_count(len)?;
        let full = len / self.chunk_size;
        let tail = len % self.chunk_size;
        let mut bytes = 0usize;
        let mut add = |count: usize, values: usize, index: u32| -> Result<()> {
            if count == 0 {
                return Ok(());
            }
            let floor = values.saturating_mul(self.layout.bytes_per_value());
            self.check_payload_len(index, values, floor)?;
            let len = payload_len_of(self.layout, values)?;
            let payload = self.check_payload_len(index, values, len)?;
            bytes = (HEADER_LEN + payload as usize)
                .checked_mul(count)
                .and_then(|b| b.checked_add(bytes))
                .ok_or_else(|| {
                    GradientStreamError::frame(
                        format!("the frames of {len} values do not fit in memory"),
                        None,
                    )
                })?;
            Ok(())
        };
        if len == 0 {
            add(1, 0, 0)?;
        } else {
            add(full, self.chunk_size, 0)?;
            add(usize::from(tail > 0), tail, total - 1)?;
        }
        Ok(bytes)
    }

    /// Work out the chunks of `gradient` and the exact length of its frame stream, so that
    /// the stream can be written into memory allocated once (a Python `bytes`, say).
    pub fn plan_frames<'g>(&self, gradient: impl Into<Gradient<'g>>) -> Result<FramePlan<'g>> {
        let gradient = gradient.into();
        let (total, windows) = self.windows(gradient)?;
        if self.writes_each_payload(&gradient) {
            // Sizes depend on the values (or the metadata): encode every chunk now, keep
            // the payloads.
            let encoded = self.encode_each(&windows, &gradient)?;
            let payload_lens = encoded
                .iter()
                .zip(0u32..)
                .zip(&windows)
                .map(|(((payload, _), index), window)| {
                    let values = window.len() / gradient.dtype.width();
                    self.check_payload_len(index, values, payload.len())
                })
                .collect::<Result<Vec<u32>>>()?;
            let len = payload_lens.iter().map(|&n| HEADER_LEN + n as usize).sum();
            return Ok(FramePlan {
                total,
                windows,
                payload_lens,
                len,
                encoded,
            });
        }
        // A payload's size depends only on its value count, and a gradient has at most two
        // counts (full chunks and the tail): measure each once by encoding it.
        let mut sizes: Vec<(usize, u32)> = Vec::with_capacity(2);
        let mut payload_lens = Vec::with_capacity(windows.len());
        for (window, index) in windows.iter().zip(0u32..) {
            let n = window.len() / 4; // float32: the only dtype planned without encoding
            let len = match sizes.iter().find(|(count, _)| *count == n) {
                Some(&(_, len)) => len,
                None => {
                    // 8 bytes a value is a floor: refuse a hopeless chunk before encoding it.
                    let floor = n.saturating_mul(self.layout.bytes_per_value());
                    self.check_payload_len(index, n, floor)?;
                    let len = payload_len_of(self.layout, n)?;
                    let len = self.check_payload_len(index, n, len)?;
                    sizes.push((n, len));
                    len
                }
            };
            payload_lens.push(len);
        }
        let len = payload_lens.iter().map(|&n| HEADER_LEN + n as usize).sum();
        Ok(FramePlan {
            total,
            windows,
            payload_lens,
            len,
            encoded: Vec::new(),
        })
    }

    /// Each window's payload (from the Arrow writer) and CRC-32. Compression costs far
    /// more than the copies, so the windows are split between the machine's cores.
    fn encode_each(
        &self,
        windows: &[&[u8]],
        gradient: &Gradient<'_>,
    ) -> Result<Vec<(Vec<u8>, u32)>> {
        let encode = |part: &[&[u8]]| -> Result<Vec<(Vec<u8>, u32)>> {
            part.iter()
                .map(|window| {
                    let window = cast_window(gradient, window);
                    let payload = codec::encode_payload_raw(self.encoding(gradient.wire), &window)?;
                    let checksum = codec::checksum(&payload);
                    Ok((payload, checksum))
                })
                .collect()
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let bytes: usize = windows.iter().map(|w| w.len()).sum();
        // Threads only pay for themselves on more than a few chunks of real work.
        if threads < 2 || windows.len() < 4 || bytes < 1 << 18 {
            return encode(windows);
        }
        let per_thread = windows.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let parts: Vec<_> = windows
                .chunks(per_thread)
                .map(|part| scope.spawn(move || encode(part)))
                .collect();
            let mut encoded = Vec::with_capacity(windows.len());
            for part in parts {
                let done = part.join().map_err(|_| {
                    GradientStreamError::arrow("a payload encoder thread panicked")
                })??;
                encoded.extend(done);
            }
            Ok(encoded)
        })
    }

    /// Chunk `index` of a plan into `out` (its planned length); its CRC-32.
    pub fn write_chunk(
        &self,
        plan: &FramePlan<'_>,
        index: u32,
        window: &[u8],
        out: &mut [u8],
    ) -> Result<u32> {
        match plan.encoded.get(index as usize) {
            Some((payload, checksum)) => {
                out.copy_from_slice(payload);
                Ok(*checksum)
            }
            None => write_payload(self.layout, window, out),
        }
    }

    /// Write a planned frame stream into `out`, which must be `plan.len()` bytes long.
    pub fn write_frames(&self, plan: &FramePlan<'_>, out: &mut [u8]) -> Result<()> {
        if out.len() != plan.len {
            return Err(GradientStreamError::frame(
                format!(
                    "frame buffer of {} bytes for a {}-byte stream",
                    out.len(),
                    plan.len
                ),
                None,
            ));
        }
        let mut rest = out;
        for (index, window, payload_len) in plan.chunks() {
            let (frame, tail) = rest.split_at_mut(HEADER_LEN + payload_len as usize);
            rest = tail;
            let (head, payload) = frame.split_at_mut(HEADER_LEN);
            let header = FrameHeader {
                chunk_index: index,
                total_chunks: plan.total,
                payload_len,
                checksum: self.write_chunk(plan, index, window, payload)?,
            };
            head.copy_from_slice(&header.to_bytes());
        }
        Ok(())
    }

    /// Reassemble chunks given in any order (README "Decoding rules", decode_chunks).
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
        let mut manifest = None;
        for c in &chunks {
            let room = self.limits.max_gradient_len.saturating_sub(values.len());
            let (head, _) = take_chunk(
                c.chunk_index,
                c.checksum,
                c.payload,
                &mut values,
                &mut dtypes,
                None,
                self.limits.bf16_as_f32,
                room,
                None,
            )?;
            shape.check(c.chunk_index, head.shape)?;
            if c.chunk_index == 0 {
                manifest = head.manifest;
            }
        }
        values.shape = shape.finish(values.len())?;
        values.manifest = manifest;
        Ok(values)
    }

    /// Parse a byte stream of frames as the receiver does (README "Decoding rules",
    /// decode_frames): exactly one gradient, and nothing after it.
    pub fn decode_frames(&self, data: &[u8]) -> Result<Vec<f32>> {
        self.decode_frames_output(data).map(Output::into_vec)
    }

    /// `decode_frames`, with the shape the sender kept.
    pub fn decode_frames_output(&self, data: &[u8]) -> Result<Output> {
        // The input bounds what it can hold: half its bytes in values (float16).
        let receiver = FrameReceiver::new(self.limits, data.len() / 2);
        Self::decode_frames_with(receiver, data)
    }

    /// `decode_frames` into the caller's buffer, whose length must be the gradient's
    /// (else `GradientSize`). On error `out` may hold part of the gradient.
    pub fn decode_frames_into(&self, data: &[u8], out: &mut [f32]) -> Result<()> {
        // SAFETY: the OutSlice lives in `receiver` and in the Output returned to us, both
        // dropped before this function returns.
        self.decode_frames_lent(data, unsafe { OutSlice::of(out) })
    }

    /// `decode_frames_into` a lent buffer of any dtype.
    pub fn decode_frames_lent(&self, data: &[u8], out: OutSlice) -> Result<()> {
        let receiver = FrameReceiver::with_output(self.limits, out);
        Self::decode_frames_with(receiver, data).map(drop)
    }

    fn decode_frames_with(mut receiver: FrameReceiver, data: &[u8]) -> Result<Output> {
        let mut pos = 0usize;
        loop {
            let want = receiver.want();
            let Some(unit) = data.get(pos..pos + want) else {
                let got = data.len() - pos;
                return match receiver.end_of_stream(got)? {
                    Ended::Gradient(values) => Ok(values),
                    Ended::BeforeFirstByte(receiver) => receiver.finish(),
                };
            };
            pos += want;
            if receiver.feed(unit)? {
                break;
            }
        }
        if pos < data.len() {
            return Err(GradientStreamError::frame(
                format!("{} bytes left over after the last chunk", data.len() - pos),
                None,
            )
            .at_offset(pos as u64));
        }
        receiver.finish()
    }

    /// A receiver for one gradient arriving frame by frame over a stream.
    pub fn receiver(&self) -> FrameReceiver {
        FrameReceiver::new(self.limits, self.limits.max_gradient_len)
    }

    /// A receiver that writes the gradient into the caller's buffer.
    pub fn receiver_into(&self, out: OutSlice) -> FrameReceiver {
        FrameReceiver::with_output(self.limits, out)
    }
}

impl EncodedChunk {
    pub fn header(&self) -> FrameHeader {
        FrameHeader {
            chunk_index: self.chunk_index,
            total_chunks: self.total_chunks,
            // plan_frames refused payloads over max_payload_len, itself a u32.
            payload_len: self.payload.len() as u32,
            checksum: self.checksum,
        }
    }

    pub fn as_ref(&self) -> ChunkRef<'_> {
        ChunkRef {
            chunk_index: self.chunk_index,
            total_chunks: self.total_chunks,
            checksum: self.checksum,
            payload: &self.payload,
        }
    }
}

fn check_total(first_index: u32, first_total: u32, index: u32, total: u32) -> Result<()> {
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

fn check_range(index: u32, total: u32) -> Result<()> {
    if index < total {
        return Ok(());
    }
    Err(GradientStreamError::frame(
        format!("chunk index {index} out of range for total_chunks {total}"),
        Some(index),
    ))
}

fn duplicate(index: u32) -> GradientStreamError {
    GradientStreamError::frame(format!("duplicate chunk index {index}"), Some(index))
}

/// CRC first (a corrupt payload is never parsed), then decode into `out`.
fn verify_and_decode(
    index: u32,
    expected: u32,
    payload: &[u8],
    out: &mut Taking<'_>,
    room: usize,
) -> Result<Head> {
    // Our own payloads (any sender of ours) match a template: the CRC of the constant
    // bytes is known, and the values are copied out without going through Arrow.
    let templates = Template::for_payload(payload.len());
    for template in &templates {
        if let Some((actual, raw)) = template.matches(payload) {
            if actual != expected {
                return Err(GradientStreamError::ChecksumMismatch {
                    chunk_index: index,
                    expected,
                    actual,
                });
            }
            // Templates are made for plain float32 payloads without metadata.
            let head = Head::default();
            out.begin(&head)?;
            out.put_raw(raw, Dtype::F32);
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
    if templates.is_empty() && head == Head::default() {
        // A payload size with no template yet: make this count's templates, so that
        // the next payload of this size (a gradient's next full chunk) takes the fast path.
        Template::learn(out.offered, payload.len());
    }
    Ok(head)
}

/// The dtype rules of the README's decoding rules: every chunk's column dtype and
/// `gradient_dtype` are those of the first chunk taken.
#[derive(Debug, Default)]
struct DtypeCheck {
    /// The first chunk taken: its index, column dtype and gradient_dtype.
    first: Option<(u32, Dtype, Option<Dtype>)>,
}

impl DtypeCheck {
    fn check(&mut self, index: u32, head: &Head) -> Result<()> {
        let Some((first, column, dtype)) = self.first else {
            self.first = Some((index, head.column, head.dtype));
            return Ok(());
        };
        if head.column != column {
            return Err(GradientStreamError::frame(
                format!(
                    "chunks disagree on the value dtype: chunk {first} holds {}, chunk {index} \
                     holds {}",
                    column.name(),
                    head.column.name()
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
    fn undo(&mut self, index: u32) {
        if matches!(self.first, Some((first, ..)) if first == index) {
            self.first = None;
        }
    }
}

/// The sink one chunk is decoded through: the dtype rules, then the output's own type.
struct Taking<'a> {
    out: &'a mut Output,
    dtypes: &'a mut DtypeCheck,
    index: u32,
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

/// Verify and decode chunk `index` into `out` under the dtype rules; the chunk's head and
/// its value count. With `room`, values past it are counted, not stored (the caller
/// refuses such a chunk).
#[allow(clippy::too_many_arguments)]
fn take_chunk(
    index: u32,
    checksum: u32,
    payload: &[u8],
    out: &mut Output,
    dtypes: &mut DtypeCheck,
    lent: Option<Dtype>,
    bf16_as_f32: bool,
    room: usize,
    store_room: Option<usize>,
) -> Result<(Head, usize)> {
    let mut sink = Taking {
        out,
        dtypes,
        index,
        lent,
        bf16_as_f32,
        offered: 0,
        room: store_room,
    };
    let head = verify_and_decode(index, checksum, payload, &mut sink, room)?;
    Ok((head, sink.offered))
}

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
    /// bfloat16 comes back as float32.
    bf16_as_f32: bool,
    /// Chunk 0's `gradstream_tensors`, a tensor set's manifest.
    manifest: Option<String>,
}

impl Reassembler {
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
            bf16_as_f32: limits.bf16_as_f32,
            manifest: None,
        }
    }

    /// Write the values into the caller's buffer instead of a vector of our own.
    pub fn into_output(mut self, out: OutSlice) -> Self {
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
        let mut fresh = Output::default();
        let in_order = index == self.next;
        if in_order && self.received == 0 {
            // Guess the gradient's size from the first chunk, within what can come (a
            // guess in float32 values; a dtype change keeps the bytes).
            let guess = (total as usize).saturating_mul(payload.len() / 8);
            self.values.reserve(guess.min(self.reserve_cap));
        }
        let before = self.values.len();
        let room = self.max_gradient_len.saturating_sub(self.count);
        let lent = self.values.limit().map(|_| self.values.dtype());
        let out = if in_order {
            &mut self.values
        } else {
            &mut fresh
        };
        let decoded = take_chunk(
            index,
            header.checksum,
            payload,
            out,
            &mut self.dtypes,
            lent,
            self.bf16_as_f32,
            room,
            Some(room),
        )
        .map_err(|e| e.at_offset(offset));
        let decoded = decoded.and_then(|(head, n)| {
            self.shape
                .check(index, head.shape)
                .map_err(|e| e.at_offset(offset))?;
            if index == 0 {
                self.manifest = head.manifest;
            }
            let count = self.count + n;
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
        });
        let count = match decoded {
            Ok(count) => count,
            Err(e) => {
                self.values.truncate(before);
                // The first chunk's shape and dtype are only kept if the chunk is taken.
                self.shape.undo(index);
                self.dtypes.undo(index);
                if index == 0 {
                    self.manifest = None;
                }
                return Err(e);
            }
        };
        self.count = count;
        if index == self.next {
            self.next += 1;
            while let Some(early) = self.early.remove(&self.next) {
                if self.values.is_empty() {
                    // Takes the chunks' dtype (all agree), if no chunk set it yet.
                    let _ = self.values.set_dtype(early.dtype());
                }
                self.values.put_raw(early.owned_bytes(), early.dtype());
                self.next += 1;
            }
        } else {
            self.early.insert(index, fresh);
        }
        self.first = Some((first_index, total));
        self.received += 1;
        Ok(self.received == total as usize)
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

/// A sans-I/O receiver for one gradient: told what bytes arrived, it says how many it
/// wants next (a header, then that header's payload) and applies the decoding rules.
/// `decode_frames`, the tokio receiver and the asyncio-streams receiver all drive it.
#[derive(Debug)]
pub struct FrameReceiver {
    limits: Limits,
    assembly: Reassembler,
    /// The header whose payload is awaited.
    pending: Option<FrameHeader>,
    /// Byte offset of the current frame's header, from the gradient's first byte.
    offset: u64,
}

impl FrameReceiver {
    pub fn new(limits: Limits, reserve_cap: usize) -> Self {
        Self {
            limits,
            assembly: Reassembler::new(limits, reserve_cap),
            pending: None,
            offset: 0,
        }
    }

    /// A receiver that writes the gradient into the caller's buffer.
    pub fn with_output(limits: Limits, out: OutSlice) -> Self {
        let mut receiver = Self::new(limits, 0);
        receiver.assembly = receiver.assembly.into_output(out);
        receiver
    }

    /// Bytes wanted next: a header, or the pending header's payload.
    pub fn want(&self) -> usize {
        self.pending.map_or(HEADER_LEN, |h| h.payload_len as usize)
    }

    pub fn received(&self) -> usize {
        self.assembly.received()
    }

    pub fn total(&self) -> Option<u32> {
        self.assembly.total()
    }

    /// Take exactly `want()` bytes; `Ok(true)` once the gradient is complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<bool> {
        match self.pending.take() {
            None => {
                let head: &[u8; HEADER_LEN] = bytes.try_into().map_err(|_| {
                    GradientStreamError::frame(
                        format!("a frame header is {HEADER_LEN} bytes, got {}", bytes.len()),
                        None,
                    )
                })?;
                let header = FrameHeader::from_bytes(head);
                self.limits.check_header(&header, self.offset)?;
                self.pending = Some(header);
                Ok(false)
            }
            Some(header) => {
                if bytes.len() != header.payload_len as usize {
                    self.pending = Some(header);
                    return Err(GradientStreamError::frame(
                        format!(
                            "chunk {} wants a {}-byte payload, got {}",
                            header.chunk_index,
                            header.payload_len,
                            bytes.len()
                        ),
                        Some(header.chunk_index),
                    ));
                }
                let done = self.assembly.accept(&header, bytes, self.offset)?;
                self.offset += (HEADER_LEN + bytes.len()) as u64;
                Ok(done)
            }
        }
    }

    /// The stream ended after `got` bytes of what `want()` asked for. It may have ended
    /// cleanly before the gradient's first byte (the original's "no network"): then the
    /// receiver comes back, for the caller to say what that means.
    pub fn end_of_stream(self, got: usize) -> Result<Ended> {
        match self.pending {
            Some(header) => Err(GradientStreamError::frame(
                format!(
                    "truncated frame: chunk {} declares a {}-byte payload but only {got} bytes \
                     follow",
                    header.chunk_index, header.payload_len
                ),
                Some(header.chunk_index),
            )
            .at_offset(self.offset)),
            None if self.assembly.received() > 0 => self.assembly.finish().map(Ended::Gradient),
            None if got == 0 => Ok(Ended::BeforeFirstByte(self)),
            None => Err(GradientStreamError::frame(
                format!("truncated frame header: {got} of {HEADER_LEN} bytes"),
                None,
            )
            .at_offset(self.offset)),
        }
    }

    /// The gradient; on a stream that ended before its first byte, the empty gradient.
    pub fn finish(self) -> Result<Output> {
        self.assembly.finish()
    }
}

/// How a stream ended.
#[derive(Debug)]
pub enum Ended {
    /// After the gradient's last frame.
    Gradient(Output),
    /// Before the gradient's first byte.
    BeforeFirstByte(FrameReceiver),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unlimited() -> Limits {
        Limits {
            max_gradient_len: usize::MAX,
            ..Limits::default()
        }
    }

    fn gradient(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32 * 0.5 - 3.0).collect()
    }

    fn session(chunk_size: usize) -> SessionConfig {
        SessionConfig::new("test", chunk_size)
    }

    fn refs(chunks: &[EncodedChunk]) -> Vec<ChunkRef<'_>> {
        chunks.iter().map(EncodedChunk::as_ref).collect()
    }

    fn frames_of(chunks: &[EncodedChunk]) -> Vec<u8> {
        let mut out = Vec::new();
        for c in chunks {
            out.extend_from_slice(&c.header().to_bytes());
            out.extend_from_slice(&c.payload);
        }
        out
    }

    fn frame_error<T: std::fmt::Debug>(r: Result<T>) -> (String, Option<u32>, Option<u64>) {
        match r {
            Err(GradientStreamError::Frame {
                detail,
                chunk_index,
                offset,
            }) => (detail, chunk_index, offset),
            other => panic!("expected a FrameError, got {other:?}"),
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
    fn truncation_and_leftovers_are_frame_errors() {
        let s = session(2);
        let wire = s.encode_frames(&gradient(4)).unwrap();
        let (detail, _, off) = frame_error(s.decode_frames(&wire[..7]));
        assert_eq!(
            (detail.as_str(), off),
            ("truncated frame header: 7 of 16 bytes", Some(0))
        );
        let (detail, idx, _) = frame_error(s.decode_frames(&wire[..wire.len() - 1]));
        assert!(detail.starts_with("truncated frame: chunk 1"), "{detail}");
        assert_eq!(idx, Some(1));
        let mut extra = wire.clone();
        extra.extend_from_slice(b"xyz");
        let (detail, _, off) = frame_error(s.decode_frames(&extra));
        assert_eq!(detail, "3 bytes left over after the last chunk");
        assert_eq!(off, Some(wire.len() as u64));
    }

    #[test]
    fn a_refused_frame_leaves_the_assembly_untouched() {
        let s = session(2);
        let chunks = s.encode_gradient(&gradient(6)).unwrap();
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
    fn hostile_payload_len_fails_before_allocating() {
        let mut s = session(2);
        s.limits.max_payload_len = 1 << 20;
        let h = FrameHeader {
            chunk_index: 0,
            total_chunks: 1,
            payload_len: u32::MAX,
            checksum: 0,
        };
        let (detail, idx, off) = frame_error(s.decode_frames(&h.to_bytes()));
        assert!(detail.contains("above max_payload_len 1048576"), "{detail}");
        assert_eq!((idx, off), (Some(0), Some(0)));
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
        let bits = [
            0x7fc0_0001u32,
            0xffff_ffff,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x0000_0001,
            0x807f_ffff,
        ];
        let g: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
        let s = session(3);
        let back = s.decode_frames(&s.encode_frames(&g).unwrap()).unwrap();
        assert_eq!(back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), bits);
    }

    #[test]
    fn random_frame_streams_never_panic() {
        // A small deterministic fuzz: every prefix and single-byte corruption of a frame
        // stream gives a result or one of our errors.
        let s = session(3);
        let wire = s.encode_frames(&gradient(7)).unwrap();
        for cut in 0..wire.len() {
            let _ = s.decode_frames(&wire[..cut]);
        }
        for i in 0..wire.len() {
            let mut bad = wire.clone();
            bad[i] = bad[i].wrapping_add(0x5b);
            let _ = s.decode_frames(&bad);
        }
    }

    #[test]
    fn a_kept_shape_travels_in_every_payload_and_comes_back() {
        let mut s = session(4);
        s.shape = Some("[2,5]".into());
        let g = gradient(10);
        let wire = s.encode_frames(&g).unwrap();
        let plain = session(4).encode_frames(&g).unwrap();
        assert!(wire.len() > plain.len());
        let back = session(3).decode_frames_output(&wire).unwrap();
        assert_eq!(back.shape, Some(vec![2, 5]));
        assert_eq!(back.into_vec(), g);
        let chunks = s.encode_gradient(&g).unwrap();
        let back = session(3).decode_chunks_output(refs(&chunks)).unwrap();
        assert_eq!(back.shape, Some(vec![2, 5]));
        // A shape that does not hold the values, and chunks that disagree.
        s.shape = Some("[3,3]".into());
        let (detail, index, _) =
            frame_error(session(3).decode_frames(&s.encode_frames(&g).unwrap()));
        assert_eq!(
            (detail.as_str(), index),
            (
                "gradient_shape [3,3] holds 9 values; the gradient has 10",
                None
            )
        );
        let mut mixed = s.encode_gradient(&g).unwrap();
        mixed[1] = session(4).encode_gradient(&g).unwrap().remove(1);
        let (detail, index, offset) = frame_error(session(3).decode_frames(&frames_of(&mixed)));
        assert_eq!(
            detail,
            "chunks disagree on gradient_shape: chunk 0 says [3,3], chunk 1 says none"
        );
        assert_eq!(index, Some(1));
        assert!(offset.is_some());
    }

    fn bytes_of(dtype: Dtype, n: usize) -> Vec<u8> {
        // Every bit pattern, NaNs included: values travel as raw bits.
        (0..n * dtype.width())
            .map(|i| (i as u8).wrapping_mul(151).wrapping_add(7))
            .collect()
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

    #[test]
    fn gradient_dtype_casts_on_receipt_and_a_lent_buffer_must_match_it() {
        let values = [1.5f32, -0.0, 3.0e38, f32::from_bits(0xffc0_1234)];
        let raw = codec::f32_bytes(&values).to_vec();
        let mut s = SessionConfig::new("d", 3);
        s.result = Some(Dtype::F64);
        let wire = s.encode_frames(&values.to_vec()).unwrap();
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
        s.result = None;
        s.limits.bf16_as_f32 = true;
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
        let mut t = s.clone();
        t.result = Some(Dtype::F64);
        let c = t.encode_gradient(Gradient::new(&half, Dtype::F16)).unwrap();
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
