//! `FrameReceiver`: the sans-I/O push decoder of a frame stream (in the manner of
//! arrow-rs's `arrow-ipc/src/reader/stream.rs`). Told what bytes arrived, it says how many
//! it wants next (a header, then that header's payload), checks each header against the
//! limits and hands each frame to the `Reassembler`. `decode_frames` (here), the tokio
//! receiver (`stream`) and the bindings' asyncio receiver all drive it.
//!
//! Uses `reassembler`, `session`, `seal`, `frame` and `output`; used by
//! `stream`, `compat` and `tensors`.

use crate::error::{GradientStreamError, Result};
use crate::frame::{FrameHeader, Limits, HEADER_LEN};
use crate::output::{OutSlice, Output};
use crate::reassembler::Reassembler;
use crate::seal::{Position, SealCheck, TransferId};
use crate::session::SessionConfig;

impl SessionConfig {
    /// Parse a byte stream of frames as the receiver does (docs/spec/decoding-rules.md,
    /// decode_frames): exactly one gradient, and nothing after it.
    pub fn decode_frames(&self, data: &[u8]) -> Result<Vec<f32>> {
        self.decode_frames_output(data).map(Output::into_vec)
    }

    /// `decode_frames`, with the shape the sender kept.
    pub fn decode_frames_output(&self, data: &[u8]) -> Result<Output> {
        // The input bounds what it can hold: half its bytes in values (float16).
        let receiver = FrameReceiver::new(self, data.len() / 2);
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
        let receiver = FrameReceiver::with_output(self, out);
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

    /// A receiver for one gradient arriving frame by frame over a stream, holding seals
    /// to this session's `seal_check` (a connection's receiver then says what it expects
    /// exactly: `receiver().expect_seal(SealCheck::Exact(id), Position::Lone)`).
    pub fn receiver(&self) -> FrameReceiver {
        FrameReceiver::new(self, self.limits.max_gradient_len)
    }

    /// A receiver that writes the gradient into the caller's buffer.
    pub fn receiver_into(&self, out: OutSlice) -> FrameReceiver {
        FrameReceiver::with_output(self, out)
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
    pub(crate) fn new(config: &SessionConfig, reserve_cap: usize) -> Self {
        let assembly = Reassembler::new(config.limits, reserve_cap)
            .templates(config.templates.clone())
            .bf16_as_f32(config.bf16_as_f32)
            .expect_seal(config.seal_check(), Position::Lone);
        Self {
            limits: config.limits,
            assembly,
            pending: None,
            offset: 0,
        }
    }

    /// Hold every chunk's seal to `check`, at `position` (docs/spec/decoding-rules.md): a
    /// connection's receiver expects `SealCheck::Exact` of the id it derives for the
    /// transfer; a tensor set's receiver gives each gradient its position. Replaces what
    /// the session's `seal` setting chose.
    pub fn expect_seal(mut self, check: SealCheck, position: Position) -> Self {
        self.assembly = self.assembly.expect_seal(check, position);
        self
    }

    /// The transfer id of the chunks taken so far (the expected one, for `Exact`); None
    /// before the first chunk, or when they are unsealed.
    pub fn transfer(&self) -> Option<TransferId> {
        self.assembly.transfer()
    }

    /// A receiver that writes the gradient into the caller's buffer.
    pub(crate) fn with_output(config: &SessionConfig, out: OutSlice) -> Self {
        let mut receiver = Self::new(config, 0);
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

    /// Forget a header whose payload never came (a connection that resumes: the sender
    /// sends that chunk again, header first).
    pub(crate) fn forget_pending(&mut self) {
        self.pending = None;
    }

    /// The chunks taken so far, as increasing half-open ranges (what a resume tells
    /// the sender: docs/spec/protocol.md, "Resume").
    pub(crate) fn held(&self) -> Vec<(u32, u32)> {
        self.assembly.held()
    }

    /// What the receiver's frames are held to.
    pub(crate) fn limits(&self) -> Limits {
        self.limits
    }

    /// Take a whole frame another reader cut, its header checked against `limits`;
    /// `Ok(true)` once the gradient is complete.
    pub(crate) fn accept_frame(
        &mut self,
        header: &FrameHeader,
        payload: &[u8],
        offset: u64,
    ) -> Result<bool> {
        self.assembly.accept(header, payload, offset)
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
            None if got == 0 => Ok(Ended::BeforeFirstByte(Box::new(self))),
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
    /// Before the gradient's first byte (the receiver boxed: it is several times the
    /// size of an `Output`).
    BeforeFirstByte(Box<FrameReceiver>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{frame_error, gradient, session};

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
}
