//! The link's byte stream, counted (docs/guides/connections.md "Closing"): the bytes that
//! moved each way tell a transfer abandoned midway from one abandoned before its first
//! byte; a read budget lets a caller run a receive's first steps on its own thread;
//! `Direct` (crate::direct), with which a caller's thread drives a plain TCP link's
//! transfers itself (system calls on its descriptor, no tokio reactor between); and
//! `Gone`, what the stream becomes once the link released its socket.
//!
//! Uses `Duplex` and `direct`; used by `link`.

use std::os::fd::RawFd;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::Duplex;
pub use crate::direct::Direct;
#[cfg(target_os = "linux")]
use crate::direct::{WANTS_READ, WANTS_WRITE};

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
    /// The descriptor of `inner` when it is a plain TCP stream (not TLS), while it is
    /// open: what `Direct` reads and writes.
    pub(super) fd: Option<RawFd>,
    /// While on, reads and writes are system calls on `fd` (`Link::go_direct`).
    pub(super) direct: Option<Direct>,
    /// The plain TCP stream while it is off tokio's reactor (`park`): a caller's thread
    /// drives it directly (`inner` is `Gone` meanwhile, never polled: the stream is put
    /// back on the reactor first, `unpark`).
    pub(super) parked: Option<std::net::TcpStream>,
}

impl Counted {
    /// What stands in a link for a stream lent to a task of its own (`pumps`): closed,
    /// and none of the stream's bytes counted, so a link whose transfer was abandoned
    /// while it was lent counts as out of step.
    pub(super) fn gone() -> Self {
        Self::of(Box::new(Gone))
    }

    /// `inner`, counted from 0, as tokio drives it.
    pub(super) fn of(inner: Box<dyn Duplex>) -> Self {
        Self {
            fd: super::tcp_fd(inner.as_ref()),
            inner,
            moved: 0,
            budget: None,
            direct: None,
            parked: None,
        }
    }

    /// Close the socket now (dropping the TCP or TLS stream): unread bytes make the
    /// kernel reset the connection, so a peer still sending learns at once
    /// (docs/guides/connections.md "Closing").
    pub(super) fn release(&mut self) {
        self.fd = None;
        self.parked = None;
        self.inner = Box::new(Gone);
    }

    /// Take a plain TCP stream off tokio's reactor (for `Direct` use by a caller's
    /// thread); nothing for any other stream, or one parked already. Should the reactor
    /// refuse (it never does), the socket is closed, as `release` does.
    pub(super) fn park(&mut self) {
        let any: &dyn std::any::Any = self.inner.as_ref();
        if self.parked.is_some() || !any.is::<tokio::net::TcpStream>() {
            return;
        }
        let inner: Box<dyn Duplex> = std::mem::replace(&mut self.inner, Box::new(Gone));
        let inner: Box<dyn std::any::Any> = inner;
        self.parked = inner
            .downcast::<tokio::net::TcpStream>()
            .ok()
            .and_then(|tcp| tcp.into_std().ok());
        if self.parked.is_none() {
            self.release();
        }
    }

    /// Put a parked stream back on tokio's reactor, before a poll that is not direct.
    /// Within a runtime's context (every poll of a link is); an error when not, or when
    /// the reactor refuses it (the socket is then closed, as `release` does).
    fn unpark(&mut self) -> std::io::Result<()> {
        if self.parked.is_none() {
            return Ok(());
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(std::io::Error::other(
                "a connection's stream was polled outside the tokio runtime",
            ));
        }
        let Some(parked) = self.parked.take() else {
            return Ok(());
        };
        match tokio::net::TcpStream::from_std(parked) {
            Ok(tcp) => {
                self.inner = Box::new(tcp);
                Ok(())
            }
            Err(e) => {
                self.release();
                Err(e)
            }
        }
    }

    /// The stream to poll through tokio: put back on the reactor if it was parked.
    fn through_tokio(&mut self) -> std::io::Result<Pin<&mut Box<dyn Duplex>>> {
        self.unpark()?;
        Ok(Pin::new(&mut self.inner))
    }

    /// The same-host stream, when that is what the link runs on (and it is open).
    #[cfg(target_os = "linux")]
    pub(super) fn same_host(&mut self) -> Option<&mut crate::shm::ShmStream> {
        let any: &mut dyn std::any::Any = self.inner.as_mut();
        any.downcast_mut::<crate::shm::ShmStream>()
    }

    /// The descriptor to use directly now, if any.
    fn direct_fd(&self) -> Option<(RawFd, &Direct)> {
        match (&self.direct, self.fd) {
            (Some(direct), Some(fd)) if direct.is_on() => Some((fd, direct)),
            _ => None,
        }
    }
}

/// A non-blocking system call's result: Pending (recorded in `direct`) when it would
/// block; EINTR retried.
#[cfg(target_os = "linux")]
fn syscall(
    direct: &Direct,
    what: u8,
    mut call: impl FnMut() -> isize,
) -> Poll<std::io::Result<usize>> {
    loop {
        let n = call();
        if n >= 0 {
            return Poll::Ready(Ok(n as usize));
        }
        let error = std::io::Error::last_os_error();
        match error.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => {
                direct.want(what);
                return Poll::Pending;
            }
            _ => return Poll::Ready(Err(error)),
        }
    }
}

#[cfg(target_os = "linux")]
fn read_direct(fd: RawFd, direct: &Direct, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
    // SAFETY: the unfilled part is writable memory of its length; recv writes at most
    // that many bytes, which are initialized once it returns n >= 0 (`assume_init`).
    let unfilled = unsafe { buf.unfilled_mut() };
    let (at, len) = (unfilled.as_mut_ptr(), unfilled.len());
    // SAFETY: `fd` is the open descriptor of the stream this `Counted` owns.
    let read = syscall(direct, WANTS_READ, || unsafe {
        libc::recv(fd, at.cast(), len, libc::MSG_DONTWAIT)
    });
    match read {
        Poll::Ready(Ok(n)) => {
            // SAFETY: recv initialized the first `n` bytes of the unfilled part.
            unsafe { buf.assume_init(n) };
            buf.advance(n);
            Poll::Ready(Ok(()))
        }
        Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
        Poll::Pending => Poll::Pending,
    }
}

#[cfg(target_os = "linux")]
fn write_direct(
    fd: RawFd,
    direct: &Direct,
    bufs: &[std::io::IoSlice<'_>],
) -> Poll<std::io::Result<usize>> {
    // SAFETY: an all-zero msghdr is valid (no address, no control data).
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is guaranteed ABI-compatible with iovec on Unix; sendmsg only reads them.
    message.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    message.msg_iovlen = bufs.len().min(libc::UIO_MAXIOV as usize) as _;
    // SAFETY: `message` points at `bufs`, live for the call; `fd` is the stream's open
    // descriptor. MSG_NOSIGNAL: a closed peer is an EPIPE error, not a SIGPIPE.
    syscall(direct, WANTS_WRITE, || unsafe {
        libc::sendmsg(fd, &message, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
    })
}

#[cfg(not(target_os = "linux"))]
fn read_direct(_: RawFd, _: &Direct, _: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
    unreachable!("Link::direct has no descriptor to use outside Linux")
}

#[cfg(not(target_os = "linux"))]
fn write_direct(_: RawFd, _: &Direct, _: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
    unreachable!("Link::direct has no descriptor to use outside Linux")
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

    /// Nothing left: the reads yield until `lift`.
    pub fn exhausted(&self) -> bool {
        self.left() == 0
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
        let polled = match this.direct_fd() {
            Some((fd, direct)) => read_direct(fd, direct, buf),
            None => match this.through_tokio() {
                Ok(inner) => inner.poll_read(cx, buf),
                Err(e) => Poll::Ready(Err(e)),
            },
        };
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
        let polled = match this.direct_fd() {
            Some((fd, direct)) => write_direct(fd, direct, &[std::io::IoSlice::new(buf)]),
            None => match this.through_tokio() {
                Ok(inner) => inner.poll_write(cx, buf),
                Err(e) => Poll::Ready(Err(e)),
            },
        };
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
        let polled = match this.direct_fd() {
            Some((fd, direct)) => write_direct(fd, direct, bufs),
            None => match this.through_tokio() {
                Ok(inner) => inner.poll_write_vectored(cx, bufs),
                Err(e) => Poll::Ready(Err(e)),
            },
        };
        if let Poll::Ready(Ok(n)) = polled {
            this.moved += n as u64;
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        // A parked stream is written by `write_direct`, a vectored sendmsg.
        self.parked.is_some() || self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.direct_fd().is_some() {
            // Direct writes are system calls: nothing is held back.
            return Poll::Ready(Ok(()));
        }
        match this.through_tokio() {
            Ok(inner) => inner.poll_flush(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut().through_tokio() {
            Ok(inner) => inner.poll_shutdown(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}
