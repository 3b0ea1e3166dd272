//! The frame headers that pass through a stream, for an ack's digest.
//!
//! An ack's digest covers every frame header of a transfer in wire order (docs/spec/protocol.md
//! "Protocol"). Rather than thread a hook through the sender and the receivers, a
//! `Tap` wraps the connection's stream for the length of one transfer and walks the frame
//! stream as its bytes pass: 16 header bytes, then the payload length they declare,
//! skipped. It sees exactly the bytes that moved (a write's accepted count, a read's
//! filled bytes), so it agrees with the peer's tap byte for byte.
//!
//! Uses `protocol::Digest` and `frame`; used by `link`.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::frame::{FrameHeader, HEADER_LEN};
use crate::protocol::Digest;

/// Where the walk stands in the frame stream.
enum Walk {
    /// Inside a header: `have` of its 16 bytes seen so far.
    Header {
        bytes: [u8; HEADER_LEN],
        have: usize,
    },
    /// Inside a payload: `left` bytes of it still to pass.
    Payload { left: u64 },
}

/// A stream whose frame headers, as they pass, go into a digest.
pub struct Tap<'s, S> {
    inner: &'s mut S,
    walk: Walk,
    digest: Digest,
    /// The first header's bytes (to tell a message from a frame header when a transfer
    /// fails on its first frame).
    first: Option<[u8; HEADER_LEN]>,
    /// Every header that passed, in order, when kept (`keeping`): a transfer that
    /// resumes digests the headers of the chunks taken, not of every pass.
    headers: Option<Vec<[u8; HEADER_LEN]>>,
    /// A byte passed.
    seen: bool,
}

impl<'s, S> Tap<'s, S> {
    pub fn new(inner: &'s mut S, digest: Digest) -> Self {
        Self {
            inner,
            walk: Walk::Header {
                bytes: [0; HEADER_LEN],
                have: 0,
            },
            digest,
            first: None,
            headers: None,
            seen: false,
        }
    }

    /// Whether a byte passed.
    pub fn seen_any(&self) -> bool {
        self.seen
    }

    /// Whether the last frame's header passed and its payload has not all passed.
    pub fn inside_payload(&self) -> bool {
        matches!(self.walk, Walk::Payload { left } if left > 0)
    }

    /// The same tap, keeping every header that passes after `headers`.
    pub fn keeping(mut self, headers: Vec<[u8; HEADER_LEN]>) -> Self {
        self.headers = Some(headers);
        self
    }

    /// The headers kept (`keeping`), in the order they passed.
    pub fn kept(&mut self) -> Vec<[u8; HEADER_LEN]> {
        self.headers.take().unwrap_or_default()
    }

    /// The digest of the headers seen so far.
    pub fn finish(self) -> [u8; 32] {
        self.digest.finish()
    }

    /// The first complete header that passed, if any.
    pub fn first_header(&self) -> Option<[u8; HEADER_LEN]> {
        self.first
    }

    /// Walk `passed`, bytes that just moved.
    pub(super) fn observe(&mut self, mut passed: &[u8]) {
        self.seen |= !passed.is_empty();
        while !passed.is_empty() {
            match &mut self.walk {
                Walk::Header { bytes, have } => {
                    let take = (HEADER_LEN - *have).min(passed.len());
                    bytes[*have..*have + take].copy_from_slice(&passed[..take]);
                    *have += take;
                    passed = &passed[take..];
                    if *have == HEADER_LEN {
                        let header = *bytes;
                        self.digest.header(&header);
                        self.first.get_or_insert(header);
                        if let Some(headers) = &mut self.headers {
                            headers.push(header);
                        }
                        let left = FrameHeader::from_bytes(&header).payload_len;
                        self.walk = Walk::Payload {
                            left: u64::from(left),
                        };
                    }
                }
                Walk::Payload { left } => {
                    let take = (*left).min(passed.len() as u64);
                    *left -= take;
                    passed = &passed[take as usize..];
                }
            }
            if let Walk::Payload { left: 0 } = self.walk {
                self.walk = Walk::Header {
                    bytes: [0; HEADER_LEN],
                    have: 0,
                };
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tap<'_, S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut *this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            this.observe(&buf.filled()[before..]);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tap<'_, S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut *this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            this.observe(&buf[..n]);
        }
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut *this.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = polled {
            let mut left = n;
            for slice in bufs {
                if left == 0 {
                    break;
                }
                let take = left.min(slice.len());
                this.observe(&slice[..take]);
                left -= take;
            }
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::SessionConfig;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The digest the protocol defines, from the headers of `frames` (a frame stream).
    fn expected(id: &[u8; 16], frames: &[u8]) -> [u8; 32] {
        let mut digest = Digest::new(id);
        let mut at = 0;
        while at < frames.len() {
            let mut header = [0u8; HEADER_LEN];
            header.copy_from_slice(&frames[at..at + HEADER_LEN]);
            digest.header(&header);
            at += HEADER_LEN + FrameHeader::from_bytes(&header).payload_len as usize;
        }
        digest.finish()
    }

    #[tokio::test]
    async fn a_tap_digests_the_headers_however_the_bytes_are_split() {
        let values: Vec<f32> = (0..2500).map(|i| i as f32).collect();
        let frames = SessionConfig::new("t", 1000)
            .encode_frames(&values)
            .expect("encodes");
        let id = [7u8; 16];
        let want = expected(&id, &frames);
        for piece in [1, 5, 16, 17, 999, frames.len()] {
            // Written in pieces of `piece` bytes...
            let mut sink = Vec::new();
            let mut tap = Tap::new(&mut sink, Digest::new(&id));
            for part in frames.chunks(piece) {
                tap.write_all(part).await.expect("writes");
            }
            assert_eq!(
                tap.first_header().map(|h| h.to_vec()),
                Some(frames[..16].to_vec())
            );
            assert_eq!(tap.finish(), want, "written {piece} bytes at a time");
            assert_eq!(sink, frames);
            // ...and read in pieces of `piece` bytes.
            let mut source: &[u8] = &frames;
            let mut tap = Tap::new(&mut source, Digest::new(&id));
            let mut got = Vec::new();
            let mut buf = vec![0u8; piece];
            loop {
                let n = tap.read(&mut buf).await.expect("reads");
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
            assert_eq!(tap.finish(), want, "read {piece} bytes at a time");
            assert_eq!(got, frames);
        }
    }

    #[tokio::test]
    async fn another_header_changes_the_digest() {
        let frames = SessionConfig::new("t", 4)
            .encode_frames(&[1.0f32, 2.0, 3.0, 4.0, 5.0][..])
            .expect("encodes");
        let id = [1u8; 16];
        let mut changed = frames.clone();
        changed[0] ^= 1; // chunk_index 0 -> 1
        assert_ne!(expected(&id, &frames), expected(&id, &changed));
        let mut sink = Vec::new();
        let mut tap = Tap::new(&mut sink, Digest::new(&id));
        tap.write_all(&changed).await.expect("writes");
        assert_eq!(tap.finish(), expected(&id, &changed));
    }
}
