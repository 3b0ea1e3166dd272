//! The link's byte stream, counted (docs/guides/connections.md "Closing"): the bytes that
//! moved each way tell a transfer abandoned midway from one abandoned before its first
//! byte; a read budget lets a caller run a receive's first steps on its own thread; and
//! `Gone`, what the stream becomes once the link released its socket.
//!
//! Uses nothing of the crate but `Duplex`; used by `link`.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::Duplex;

/// What a released link's stream becomes: its socket closed, every read and write an
/// error.
struct Gone;

fn gone() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::NotConnected, "the connection is closed")
}

impl AsyncRead for Gone {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        _: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Poll::Ready(Err(gone()))
    }
}

impl AsyncWrite for Gone {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        _: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Err(gone()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The link's stream, counting the bytes that moved each way: a transfer dropped midway
/// (its task cancelled) is told from one dropped before its first byte by the counts.
pub(super) struct Counted {
    pub(super) inner: Box<dyn Duplex>,
    pub(super) moved: u64,
    /// Bytes reads may still take before they yield (`Link::read_budget`); none: no bound.
    pub(super) budget: Option<ReadBudget>,
}

impl Counted {
    /// Close the socket now (dropping the TCP or TLS stream): unread bytes make the
    /// kernel reset the connection, so a peer still sending learns at once
    /// (docs/guides/connections.md "Closing").
    pub(super) fn release(&mut self) {
        self.inner = Box::new(Gone);
    }
}

/// What a transfer may read before its reads yield (`Poll::Pending`, after waking the
/// task): lets a caller run a receive's first steps on its own thread (the bindings'
/// small-transfer path) for a bounded time, then hand it to tokio, having lifted the bound
/// (`lift`).
#[derive(Clone, Debug)]
pub struct ReadBudget(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl ReadBudget {
    pub fn new(bytes: u64) -> Self {
        Self(std::sync::Arc::new(std::sync::atomic::AtomicU64::new(
            bytes,
        )))
    }

    /// No bound from now on.
    pub fn lift(&self) {
        self.0.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
    }

    fn left(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn spend(&self, bytes: u64) {
        let _ = self.0.fetch_update(
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
            |left| {
                Some(if left == u64::MAX {
                    left
                } else {
                    left.saturating_sub(bytes)
                })
            },
        );
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let Some(budget) = &this.budget {
            if budget.left() == 0 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        let read = (buf.filled().len() - before) as u64;
        this.moved += read;
        if let Some(budget) = &this.budget {
            budget.spend(read);
        }
        polled
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            this.moved += n as u64;
        }
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = polled {
            this.moved += n as u64;
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
