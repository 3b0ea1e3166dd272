//! The frame headers that pass through a stream, for an ack's digest.
//!
//! An ack's digest covers every frame header of a transfer in wire order (README
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
        }
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
