//! The sending side: a `Gradient` to send (with its seal, when sealed), its chunking
//! (`FramePlan`, planned once so the frame stream can be written into memory allocated
//! once), each chunk's payload (`write_payload`: a template of the session's where one fits, else
//! the Arrow writer), and the `SessionConfig` methods that encode (`encode_frames`,
//! `encode_gradient`, `encode_frame`, `frames_len`, `plan_frames`, `write_frames`,
//! `sealing`).
//!
//! Uses `session` (the settings), `codec` (the payload writer), `template` (the fast
//! path), `seal`, `frame` and `dtype`; the decoding files never use it (its tests decode,
//! to round-trip).

use std::mem::MaybeUninit;
use std::sync::Arc;

use crate::codec::{self, Encoding, Layout, Stores};
use crate::dtype::{self, Dtype, WireDtype};
use crate::error::{GradientStreamError, Result};
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::seal::{Seal, SealText, TransferId};
use crate::session::{ChunkRef, SessionConfig};
use crate::template::Kind;

/// What one gradient's payloads say about it besides its values: per gradient, not per
/// session (two gradients sent by one session have their own shapes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GradientMeta {
    /// The `gradient_shape` text to write into every payload (`keep_shape`).
    pub shape: Option<Arc<str>>,
    /// The `gradient_dtype` to write into every payload: the dtype the receiver hands the
    /// gradient back in, when not the wire's (after a `wire_dtype` cast).
    pub result: Option<Dtype>,
    /// A tensor set's manifest, written into the payload of the set's first gradient.
    pub manifest: Option<Arc<str>>,
}

/// No metadata: the payloads are the original's.
static NO_META: GradientMeta = GradientMeta {
    shape: None,
    result: None,
    manifest: None,
};

/// A gradient to send: its values as bytes in memory order, their dtype, what they
/// travel as (`wire_dtype`: each chunk is cast as it is encoded, by the cast rule, and
/// quantized on the int8 wire), its metadata, and its seal (per transfer, so here and not
/// in the settings).
#[derive(Clone, Copy, Debug)]
pub struct Gradient<'g> {
    raw: &'g [u8],
    dtype: Dtype,
    /// The dtype each chunk is cast to (float32 on the int8 wire).
    wire: Dtype,
    /// The cast values are quantized to the int8 wire.
    int8: bool,
    meta: &'g GradientMeta,
    seal: Option<Seal>,
}

impl<'g> Gradient<'g> {
    /// `raw` holds values of `dtype` (a whole number of them), sent as they are.
    pub fn new(raw: &'g [u8], dtype: Dtype) -> Self {
        let whole = raw.len() - raw.len() % dtype.width();
        Self {
            raw: &raw[..whole],
            dtype,
            wire: dtype,
            int8: false,
            meta: &NO_META,
            seal: None,
        }
    }

    /// The same values, cast to `wire` for transfer.
    pub fn cast_to(self, wire: Dtype) -> Self {
        Self {
            wire,
            int8: false,
            ..self
        }
    }

    /// The same values, travelling as `wire` (None: as they are).
    pub fn travel_as(self, wire: Option<WireDtype>) -> Self {
        let Some(wire) = wire else { return self };
        Self {
            int8: wire == WireDtype::Int8,
            ..self.cast_to(wire.carrier())
        }
    }

    /// The same values, with this metadata in every payload.
    pub fn with_meta(self, meta: &'g GradientMeta) -> Self {
        Self { meta, ..self }
    }

    /// The same values, each chunk sealed with `seal` and its own index and total
    /// (docs/spec/wire-format.md, sealed chunks).
    pub fn sealed(self, seal: Seal) -> Self {
        self.seal_with(Some(seal))
    }

    /// The same values, sealed with `seal` or not at all.
    pub fn seal_with(self, seal: Option<Seal>) -> Self {
        Self { seal, ..self }
    }

    pub fn seal(&self) -> Option<Seal> {
        self.seal
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

    /// The dtype of the values (not the one they travel in).
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Whether the values travel as float32 (not quantized), whose payload sizes are
    /// known without encoding.
    pub fn travels_as_float32(&self) -> bool {
        self.wire == Dtype::F32 && !self.int8
    }
}

impl<'g> From<&'g [f32]> for Gradient<'g> {
    fn from(values: &'g [f32]) -> Self {
        Self::new(dtype::f32_bytes(values), Dtype::F32)
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
pub(crate) fn as_f32(raw: &[u8]) -> Option<&[f32]> {
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
    /// The gradient's seal: each chunk's payload carries it with its index and the total.
    seal: Option<Seal>,
    /// The gradient's `gradient_shape` text, in every payload when kept.
    shape: Option<Arc<str>>,
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

    /// The seal the gradient is sent with, if any.
    pub fn seal(&self) -> Option<Seal> {
        self.seal
    }

    /// Chunk `index`'s seal text, when the gradient is sealed.
    pub fn seal_text(&self, index: u32) -> Option<SealText> {
        self.seal.map(|seal| seal.text(index, self.total))
    }

    /// Chunk `index`'s seal text and the gradient's shape text: what a templated payload
    /// carries besides its values.
    pub(crate) fn marks(&self, index: u32) -> (Option<SealText>, Option<&Arc<str>>) {
        (self.seal_text(index), self.shape.as_ref())
    }

    /// Each chunk's index, values (bytes) and exact payload length.
    pub fn chunks(&self) -> impl Iterator<Item = (u32, &'g [u8], u32)> + '_ {
        (0u32..)
            .zip(self.windows.iter().copied())
            .zip(self.payload_lens.iter().copied())
            .map(|((index, window), len)| (index, window, len))
    }
}

/// The template kind of the payloads of `values` float32 values in `layout`, sealed or not.
pub(crate) fn kind(layout: Layout, values: usize, sealed: bool, shape: Option<&Arc<str>>) -> Kind {
    Kind {
        layout,
        values,
        sealed,
        shape: shape.cloned(),
    }
}

impl SessionConfig {
    /// Encode one chunk's float32 payload (sealed with `seal`, if given) into `out`
    /// (exactly its planned length); its CRC-32.
    // Only the tokio sender (`stream`) writes payloads one at a time.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn write_payload(
        &self,
        (seal, shape): (Option<SealText>, Option<&Arc<str>>),
        raw: &[u8],
        out: &mut [u8],
    ) -> Result<u32> {
        self.write_payload_with((seal, shape), raw, out, Stores::Cached)
    }

    /// `write_payload`, a template's bytes stored with `stores` (streaming for a frame
    /// stream larger than the caches).
    fn write_payload_with(
        &self,
        (seal, shape): (Option<SealText>, Option<&Arc<str>>),
        raw: &[u8],
        out: &mut [u8],
        stores: Stores,
    ) -> Result<u32> {
        let values = as_f32(raw);
        let template = self
            .templates
            .get(kind(self.layout, raw.len() / 4, seal.is_some(), shape));
        match values.zip(template) {
            Some((values, template)) if template.len() == out.len() => {
                Ok(template.write(values, seal.as_ref(), out, stores))
            }
            _ => {
                codec::encode_payload_exact(self.templated(shape).sealed(seal), raw, out)?;
                Ok(codec::checksum(out))
            }
        }
    }

    /// How this session writes a float32 payload a template may reproduce: its layout,
    /// with the gradient's shape text when it keeps one.
    fn templated(&self, shape: Option<&Arc<str>>) -> Encoding {
        Encoding {
            shape: shape.cloned(),
            ..Encoding::from(self.layout)
        }
    }

    /// The length of this session's payload of `n` float32 values, sealed or not (a
    /// seal's text has one width, so its value does not matter), with `shape`.
    fn payload_len_of(&self, n: usize, sealed: bool, shape: Option<&Arc<str>>) -> Result<usize> {
        match self.templates.get(kind(self.layout, n, sealed, shape)) {
            Some(template) => Ok(template.len()),
            // No template (empty or huge chunks): measure by encoding as many zeros.
            None => {
                let seal = sealed.then(|| Seal::lone(TransferId([0; 16])).text(0, 1));
                let encoding = self.templated(shape).sealed(seal);
                Ok(codec::encode_payload(encoding, &vec![0f32; n])?.len())
            }
        }
    }
}

impl SessionConfig {
    /// How this session writes `gradient`'s payloads, but for their seal (each chunk's own).
    pub(crate) fn encoding(&self, gradient: &Gradient<'_>) -> Encoding {
        Encoding {
            layout: self.layout,
            compression: self.compression,
            dtype: gradient.wire,
            shape: gradient.meta.shape.clone(),
            result: gradient.meta.result,
            manifest: gradient.meta.manifest.clone(),
            seal: None,
            int8: gradient.int8,
        }
    }

    /// How this session writes chunk `index` of `total` of `gradient`.
    fn chunk_encoding(&self, gradient: &Gradient<'_>, index: u32, total: u32) -> Encoding {
        let seal = gradient.seal.map(|seal| seal.text(index, total));
        self.encoding(gradient).sealed(seal)
    }

    /// Whether `gradient`'s payloads come from the Arrow writer chunk by chunk (their
    /// bytes depend on more than the value count and the seal: a cast, compression,
    /// metadata, a dtype without templates) rather than templates.
    pub(crate) fn writes_each_payload(&self, gradient: &Gradient<'_>) -> bool {
        gradient.dtype != gradient.wire || !self.encoding(gradient).is_templated()
    }

    /// A fresh seal for one gradient of a sealing session (`seal`, standalone mode): a
    /// random transfer id, position lone; None when the session does not seal.
    pub fn draw_seal(&self) -> Result<Option<Seal>> {
        if !self.seal {
            return Ok(None);
        }
        Ok(Some(Seal::lone(TransferId::random()?)))
    }

    /// `gradient` as this session sends it: as it is when it carries a seal (a
    /// connection's) or the session does not seal, else sealed with a fresh random id.
    /// Every encoding entry point that takes a whole gradient calls it once; a caller
    /// asking for frames one at a time (`encode_frame`) seals the gradient first.
    pub fn sealing<'g>(&self, gradient: Gradient<'g>) -> Result<Gradient<'g>> {
        if gradient.seal.is_some() {
            return Ok(gradient);
        }
        Ok(gradient.seal_with(self.draw_seal()?))
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
    /// sender asks for frames one at a time. Sealed as `gradient` is: a sealing session's
    /// caller draws the gradient's seal once (`sealing`), for all its frames.
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
        let encoding = self.chunk_encoding(&gradient, index, total);
        codec::append_payload(encoding, &window, &mut frame)?;
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
        // Fresh memory, advised before the writes fault it in.
        let mut out = Vec::with_capacity(plan.len);
        crate::output::advise_huge_pages(out.as_ptr(), plan.len);
        self.write_new_frames(&plan, &mut out.spare_capacity_mut()[..plan.len])?;
        // SAFETY: write_new_frames initialised all `plan.len` bytes (it returned Ok).
        unsafe { out.set_len(plan.len) };
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
            let len = self.payload_len_of(values, self.seal, None)?;
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
    /// the stream can be written into memory allocated once (a Python `bytes`, say). A
    /// sealing session seals it here (`sealing`), once for all its chunks.
    pub fn plan_frames<'g>(&self, gradient: impl Into<Gradient<'g>>) -> Result<FramePlan<'g>> {
        let gradient = self.sealing(gradient.into())?;
        let (total, windows) = self.windows(gradient)?;
        let seal = gradient.seal;
        let shape = gradient.meta.shape.clone();
        if self.writes_each_payload(&gradient) {
            // Sizes depend on the values (or the metadata): encode every chunk now, keep
            // the payloads.
            let encoded = self.encode_each(&windows, &gradient, total)?;
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
                seal,
                shape,
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
                    let len = self.payload_len_of(n, seal.is_some(), shape.as_ref())?;
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
            seal,
            shape,
            windows,
            payload_lens,
            len,
            encoded: Vec::new(),
        })
    }

    /// Each window's payload (from the Arrow writer) and CRC-32, of `total` chunks.
    /// Compression costs far more than the copies, so the windows are split between the
    /// machine's cores.
    fn encode_each(
        &self,
        windows: &[&[u8]],
        gradient: &Gradient<'_>,
        total: u32,
    ) -> Result<Vec<(Vec<u8>, u32)>> {
        let indexed: Vec<(u32, &[u8])> = (0u32..).zip(windows.iter().copied()).collect();
        let encode = |part: &[(u32, &[u8])]| -> Result<Vec<(Vec<u8>, u32)>> {
            part.iter()
                .map(|&(index, window)| {
                    let window = cast_window(gradient, window);
                    let encoding = self.chunk_encoding(gradient, index, total);
                    let payload = codec::encode_payload_raw(encoding, &window)?;
                    let checksum = codec::checksum(&payload);
                    Ok((payload, checksum))
                })
                .collect()
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let bytes: usize = windows.iter().map(|w| w.len()).sum();
        // Threads only pay for themselves on more than a few chunks of real work.
        if threads < 2 || windows.len() < 4 || bytes < 1 << 18 {
            return encode(&indexed);
        }
        let per_thread = windows.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let parts: Vec<_> = indexed
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
        self.write_chunk_with(plan, index, window, out, Stores::Cached)
    }

    /// `write_chunk`, storing with `stores`.
    fn write_chunk_with(
        &self,
        plan: &FramePlan<'_>,
        index: u32,
        window: &[u8],
        out: &mut [u8],
        stores: Stores,
    ) -> Result<u32> {
        match plan.encoded.get(index as usize) {
            Some((payload, checksum)) => {
                stores.copy(payload, out);
                Ok(*checksum)
            }
            None => self.write_payload_with(plan.marks(index), window, out, stores),
        }
    }

    /// Write a planned frame stream into `out`, which must be `plan.len()` bytes long.
    pub fn write_frames(&self, plan: &FramePlan<'_>, out: &mut [u8]) -> Result<()> {
        self.check_frames_len(plan, out.len())?;
        // A stream larger than the caches is written around them: nothing reads it back
        // soon, and streaming stores spare reading each line before it is written.
        let stores = Stores::for_destination(plan.len);
        let mut rest = out;
        for (index, window, payload_len) in plan.chunks() {
            let (frame, tail) = rest.split_at_mut(HEADER_LEN + payload_len as usize);
            rest = tail;
            self.write_frame(plan, (index, window, payload_len), frame, stores)?;
        }
        Ok(())
    }

    /// `write_frames` into memory just allocated (`plan.len()` bytes, not yet
    /// initialised: a new `bytes` object's, a vector's spare capacity). Each frame's
    /// bytes are zeroed just before it is written, so that its first touch (a page fault:
    /// the kernel zeroes the page, 2 MiB of it with huge pages, and leaves it in cache),
    /// the zeroing and the writes all land on the same cached lines, written back to
    /// memory once; streaming stores would write them a second time. Every byte is
    /// initialised on success; on error some may not be.
    pub fn write_new_frames(
        &self,
        plan: &FramePlan<'_>,
        out: &mut [MaybeUninit<u8>],
    ) -> Result<()> {
        self.check_frames_len(plan, out.len())?;
        let mut rest = out;
        for (index, window, payload_len) in plan.chunks() {
            let (frame, tail) = rest.split_at_mut(HEADER_LEN + payload_len as usize);
            rest = tail;
            // SAFETY: zeroing every byte of `frame` initialises it, so it may then be seen
            // as bytes (MaybeUninit<u8> and u8 have one layout).
            let frame = unsafe {
                std::ptr::write_bytes(frame.as_mut_ptr(), 0, frame.len());
                &mut *(std::ptr::from_mut::<[MaybeUninit<u8>]>(frame) as *mut [u8])
            };
            self.write_frame(plan, (index, window, payload_len), frame, Stores::Cached)?;
        }
        Ok(())
    }

    fn check_frames_len(&self, plan: &FramePlan<'_>, len: usize) -> Result<()> {
        if len == plan.len {
            return Ok(());
        }
        Err(GradientStreamError::frame(
            format!("frame buffer of {len} bytes for a {}-byte stream", plan.len),
            None,
        ))
    }

    /// One chunk of a plan (as `FramePlan::chunks` gives it) as a frame, header and
    /// payload, into `frame` (its exact length).
    fn write_frame(
        &self,
        plan: &FramePlan<'_>,
        (index, window, payload_len): (u32, &[u8], u32),
        frame: &mut [u8],
        stores: Stores,
    ) -> Result<()> {
        let (head, payload) = frame.split_at_mut(HEADER_LEN);
        let header = FrameHeader {
            chunk_index: index,
            total_chunks: plan.total,
            payload_len,
            checksum: self.write_chunk_with(plan, index, window, payload, stores)?,
        };
        head.copy_from_slice(&header.to_bytes());
        Ok(())
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

#[cfg(test)]
mod tests;
