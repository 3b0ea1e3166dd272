//! A byte stream over a Unix-domain socket whose bytes move through the two sides' rings:
//! what one side writes is copied into its own ring and announced on the socket (`DATA n`);
//! the other copies it out of its mapping of that ring and releases the room (`CREDIT n`).
//! The socket carries only these 16-byte control messages (and `FIN`, the end of one
//! direction), and the two rings' descriptors at the start (`ShmStream::open`). Everything above it (the hello, frames, acks) runs on
//! it as on TCP.
//!
//! A peer's messages are checked against what it can have done: it cannot announce more
//! bytes than its ring holds unread, nor release more than this side wrote; either is a
//! `Protocol` error and the stream is of no more use. The bytes themselves are the peer's
//! to get wrong: they are copied out once and checked by the codec (CRC, seal) in the copy.

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;

use super::{recv_with_fd, send_with_fd, OwnRing, PeerRing, RingLimits};
use crate::error::{GradientStreamError, Result};

/// The first message of each side, with its ring's descriptor: magic, then the ring's
/// size (u64 LE).
const SETUP_MAGIC: &[u8; 8] = b"gsring1\0";
const MESSAGE_LEN: usize = 16;
const DATA: u32 = 1;
const CREDIT: u32 = 2;
/// This side writes no more (`poll_shutdown`): the peer reads to the end of what was
/// announced, then the end of the stream. The socket stays open for the credits of what
/// the other way still carries (a half-closed stream, as TCP's).
const FIN: u32 = 3;

fn protocol(expected: &str, seen: String) -> GradientStreamError {
    GradientStreamError::Protocol {
        expected: expected.into(),
        seen,
        peer: None,
    }
}

fn io_error(error: GradientStreamError) -> std::io::Error {
    match error {
        GradientStreamError::Io(io) => io,
        other => std::io::Error::new(std::io::ErrorKind::InvalidData, other),
    }
}

/// A control message: `kind` (u32 LE), 4 zero bytes, `n` (u64 LE).
fn message(kind: u32, n: u64) -> [u8; MESSAGE_LEN] {
    let mut out = [0u8; MESSAGE_LEN];
    out[..4].copy_from_slice(&kind.to_le_bytes());
    out[8..].copy_from_slice(&n.to_le_bytes());
    out
}

/// The byte stream (see the module).
pub struct ShmStream {
    socket: UnixStream,
    own: OwnRing,
    peer: PeerRing,
    /// Bytes written into `own`, in all; and those the peer released (`CREDIT`).
    written: u64,
    released: u64,
    /// Bytes the peer announced (`DATA`), in all; those copied out; those released.
    announced: u64,
    consumed: u64,
    credited: u64,
    /// A control message being read, and how much of it has arrived.
    inbox: [u8; MESSAGE_LEN],
    inbox_len: usize,
    /// Control messages not yet taken by the socket.
    outbox: Vec<u8>,
    /// The peer said `FIN`: it writes no more.
    peer_finished: bool,
    /// This side said `FIN` (queued in the outbox).
    finished: bool,
    /// The peer's end of the socket closed: no more messages, not even credits.
    closed: bool,
    /// The peer reads no more (a credit's write failed): credits are no longer sent.
    credits_unread: bool,
}

impl ShmStream {
    /// Make this side's ring of `ring_len` bytes, pass it to the peer and adopt the peer's
    /// (checked against `limits`); both sides call this at once on the two ends of a
    /// connected socket.
    pub async fn open(socket: UnixStream, ring_len: usize, limits: &RingLimits) -> Result<Self> {
        let own = OwnRing::create(ring_len)?;
        let mut setup = [0u8; MESSAGE_LEN];
        setup[..8].copy_from_slice(SETUP_MAGIC);
        setup[8..].copy_from_slice(&(own.len() as u64).to_le_bytes());
        let mut sent = 0;
        while sent < MESSAGE_LEN {
            socket.writable().await?;
            let fd = own.fd();
            match socket.try_io(tokio::io::Interest::WRITABLE, || {
                if sent == 0 {
                    send_with_fd(&socket, &setup, fd)
                } else {
                    rustix::net::send(&socket, &setup[sent..], rustix::net::SendFlags::NOSIGNAL)
                        .map_err(std::io::Error::from)
                }
            }) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e.into()),
            }
        }
        let mut got = [0u8; MESSAGE_LEN];
        let mut filled = 0;
        let mut fd = None;
        while filled < MESSAGE_LEN {
            socket.readable().await?;
            let read = socket.try_io(tokio::io::Interest::READABLE, || {
                recv_with_fd(&socket, &mut got[filled..]).map_err(io_error)
            });
            match read {
                Ok((0, _)) => {
                    return Err(protocol(
                        "the peer's ring",
                        "the end of the connection".into(),
                    ))
                }
                Ok((n, passed)) => {
                    if passed.is_some() && (filled > 0 || fd.is_some()) {
                        return Err(protocol(
                            "one descriptor, with the setup's first byte",
                            "a descriptor later in the setup".into(),
                        ));
                    }
                    fd = fd.or(passed);
                    filled += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e.into()),
            }
        }
        if &got[..8] != SETUP_MAGIC {
            return Err(protocol(
                "the same-host setup message",
                format!("{:02x?}", &got[..8]),
            ));
        }
        let Some(fd) = fd else {
            return Err(protocol(
                "the peer's ring with its setup",
                "a setup without a descriptor".into(),
            ));
        };
        let peer = PeerRing::adopt(fd, limits)?;
        let said = u64::from_le_bytes(got[8..].try_into().unwrap_or([0; 8]));
        if said != peer.len() as u64 {
            return Err(protocol(
                "the size the setup says",
                format!("a ring of {} bytes said to be {said}", peer.len()),
            ));
        }
        Ok(Self {
            socket,
            own,
            peer,
            written: 0,
            released: 0,
            announced: 0,
            consumed: 0,
            credited: 0,
            inbox: [0; MESSAGE_LEN],
            inbox_len: 0,
            outbox: Vec::new(),
            peer_finished: false,
            finished: false,
            closed: false,
            credits_unread: false,
        })
    }

    /// Send what the outbox holds, as far as the socket takes it now; Pending (the socket
    /// watched for room) while some is left.
    fn poll_flush_outbox(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while !self.outbox.is_empty() {
            ready!(self.socket.poll_write_ready(cx))?;
            match self.socket.try_write(&self.outbox) {
                Ok(n) => {
                    self.outbox.drain(..n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        Poll::Ready(Ok(()))
    }

    /// `poll_flush_outbox` for a reader: a peer gone (its end of the socket closed, so
    /// the credits would reach nobody) is not the reader's error: what it announced is
    /// still read to the end.
    fn poll_flush_credits(&mut self, cx: &mut Context<'_>) -> std::io::Result<()> {
        match self.poll_flush_outbox(cx) {
            Poll::Ready(Err(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                // Its messages still in the socket are read to its end (`take_messages`).
                self.outbox.clear();
                self.credits_unread = true;
                Ok(())
            }
            Poll::Ready(Err(e)) => Err(e),
            _ => Ok(()),
        }
    }

    /// Take every control message the socket holds now (the socket watched for more).
    fn take_messages(&mut self, cx: &mut Context<'_>) -> std::io::Result<()> {
        while !self.closed {
            if self.socket.poll_read_ready(cx).is_pending() {
                return Ok(());
            }
            let at = self.inbox_len;
            match self.socket.try_read(&mut self.inbox[at..]) {
                Ok(0) => self.closed = true,
                Ok(n) => {
                    self.inbox_len += n;
                    if self.inbox_len == MESSAGE_LEN {
                        self.inbox_len = 0;
                        self.apply(self.inbox).map_err(io_error)?;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// One control message of the peer, checked against what it can have done.
    fn apply(&mut self, message: [u8; MESSAGE_LEN]) -> Result<()> {
        let kind = u32::from_le_bytes([message[0], message[1], message[2], message[3]]);
        let mut n_bytes = [0u8; 8];
        n_bytes.copy_from_slice(&message[8..]);
        let n = u64::from_le_bytes(n_bytes);
        if message[4..8] != [0; 4] {
            return Err(protocol(
                "a same-host control message",
                format!("{message:02x?}"),
            ));
        }
        if self.peer_finished {
            // Nothing follows a FIN but credits for this side's bytes.
            if kind != CREDIT {
                return Err(protocol(
                    "nothing but credits after the peer's FIN",
                    format!("a message of kind {kind}"),
                ));
            }
        }
        match kind {
            FIN if n == 0 => self.peer_finished = true,
            DATA => {
                let unread = self.announced - self.consumed;
                if n == 0 || n > self.peer.len() as u64 - unread {
                    return Err(protocol(
                        "at most what the peer's ring holds unread",
                        format!(
                            "{n} more bytes announced with {unread} of its {} unread",
                            self.peer.len()
                        ),
                    ));
                }
                self.announced += n;
            }
            CREDIT => {
                let outstanding = self.written - self.released;
                if n == 0 || n > outstanding {
                    return Err(protocol(
                        "a release of bytes this side wrote",
                        format!("{n} bytes released of {outstanding} outstanding"),
                    ));
                }
                self.released += n;
            }
            other => {
                return Err(protocol(
                    "a same-host control message",
                    format!("a message of kind {other}"),
                ))
            }
        }
        Ok(())
    }

    /// Release what was copied out once it is a quarter of the peer's ring, or all of
    /// what the peer announced (it may be waiting for the room).
    fn credit(&mut self) {
        let owed = self.consumed - self.credited;
        if owed > 0
            && !self.credits_unread
            && (owed >= self.peer.len() as u64 / 4 || self.consumed == self.announced)
        {
            self.outbox.extend_from_slice(&message(CREDIT, owed));
            self.credited = self.consumed;
        }
    }
}

impl AsyncRead for ShmStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        // Credits owed go out first; one the socket has no room for yet stays queued.
        this.poll_flush_credits(cx)?;
        this.take_messages(cx)?;
        let unread = this.announced - this.consumed;
        if unread == 0 {
            // The peer's end: Ready with nothing read. Else the socket is watched.
            return if this.peer_finished || this.closed {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            };
        }
        let n = buf.remaining().min(unread as usize);
        let offset = (this.consumed % this.peer.len() as u64) as usize;
        this.peer.copy_out(offset, buf.initialize_unfilled_to(n));
        buf.advance(n);
        this.consumed += n as u64;
        this.credit();
        this.poll_flush_credits(cx)?;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for ShmStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let _ = this.poll_flush_outbox(cx)?;
        this.take_messages(cx)?;
        if this.closed || this.finished {
            // No reader left for what it would write, or a write after shutdown.
            return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()));
        }
        let room = this.own.len() as u64 - (this.written - this.released);
        if room == 0 {
            // Waiting for a credit: the socket is watched (take_messages).
            return Poll::Pending;
        }
        let mut moved = 0usize;
        for buf in bufs {
            let n = buf.len().min((room as usize) - moved);
            this.own
                .write_at((this.written % this.own.len() as u64) as usize, &buf[..n]);
            this.written += n as u64;
            moved += n;
            if moved as u64 == room {
                break;
            }
        }
        if moved > 0 {
            this.outbox.extend_from_slice(&message(DATA, moved as u64));
        }
        // Announced as far as the socket takes it now; the rest by the next poll.
        let _ = this.poll_flush_outbox(cx)?;
        Poll::Ready(Ok(moved))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.get_mut().poll_flush_outbox(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.finished {
            this.finished = true;
            this.outbox.extend_from_slice(&message(FIN, 0));
        }
        this.poll_flush_outbox(cx)
    }
}
