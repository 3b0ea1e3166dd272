//! A byte stream over a Unix-domain socket whose bytes move through the two sides' rings:
//! what one side writes is copied into its own ring and announced on the socket (`DATA n`);
//! the other copies it out of its mapping of that ring and releases the room (`CREDIT n`).
//! The socket carries only these 16-byte control messages (and `FIN`, the end of one
//! direction), and the two rings' descriptors at the start (`ShmStream::open`).
//! Everything above it (the hello, frames, acks) runs on it as on TCP.
//!
//! A peer's messages are checked against what it can have done: it cannot announce more
//! bytes than the room this side has released to it, nor release more than this side
//! wrote; either is a `Protocol` error and the stream is of no more use. The bytes
//! themselves are the peer's to get wrong: they are copied out once and checked by the
//! codec (CRC, seal) in the copy. What this side owes the peer (announcements, credits,
//! its FIN) is kept as counts and put on the socket when it has room, so a peer that
//! stops reading costs at most three messages of memory.

use std::io::IoSlice;
use std::os::fd::{AsFd, BorrowedFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::UnixStream;

use super::{recv_with_fd, send_with_fd, OwnRing, PeerRing, RingLimits};
use crate::direct::{Direct, WANTS_READ, WANTS_WRITE};
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
/// Control messages read from the socket at a time, and at most in one poll (then the
/// task is woken to go on: a peer's flood of messages does not hold a runtime thread).
const INBOX_MESSAGES: usize = 64;
const MESSAGES_PER_POLL: usize = 4096;

fn protocol(expected: &str, seen: String) -> GradientStreamError {
    GradientStreamError::Protocol {
        expected: expected.into(),
        seen,
        peer: None,
    }
}

/// A `GradientStreamError` carried through `std::io` (the AsyncRead/AsyncWrite traits).
fn io_error(error: GradientStreamError) -> std::io::Error {
    match error {
        GradientStreamError::Io(io) => io,
        other => std::io::Error::new(std::io::ErrorKind::InvalidData, other),
    }
}

/// `io_error` undone.
fn from_io(error: std::io::Error) -> GradientStreamError {
    if error
        .get_ref()
        .is_some_and(|inner| inner.is::<GradientStreamError>())
    {
        if let Some(inner) = error.into_inner() {
            if let Ok(ours) = inner.downcast::<GradientStreamError>() {
                return *ours;
            }
        }
        return GradientStreamError::Io(std::io::Error::other("a lost error"));
    }
    GradientStreamError::Io(error)
}

fn gone(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
    )
}

/// A control message: `kind` (u32 LE), 4 zero bytes, `n` (u64 LE).
fn message(kind: u32, n: u64) -> [u8; MESSAGE_LEN] {
    let mut out = [0u8; MESSAGE_LEN];
    out[..4].copy_from_slice(&kind.to_le_bytes());
    out[8..].copy_from_slice(&n.to_le_bytes());
    out
}

/// The tasks waiting on the stream: a reader and a writer may be two tasks (halves of a
/// `tokio::io::split`), and either one may take the message the other waits for, so the
/// socket's readiness wakes both.
#[derive(Default)]
struct Waiting {
    read: Mutex<Option<Waker>>,
    write: Mutex<Option<Waker>>,
}

impl Waiting {
    fn set(slot: &Mutex<Option<Waker>>, waker: &Waker) {
        let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
        if !slot.as_ref().is_some_and(|w| w.will_wake(waker)) {
            *slot = Some(waker.clone());
        }
    }
}

impl Wake for Waiting {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        for slot in [&self.read, &self.write] {
            let waker = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }
}

/// The stream's socket: on tokio's reactor; off it while a caller's thread drives the
/// stream (`ShmStream::go_direct` with `park`); or lost, should the reactor refuse it
/// back (it never does; the socket is closed then, and every call an error).
enum Control {
    /// `unproven`: the ways (`WANTS_READ`, `WANTS_WRITE`) the socket has not been seen to
    /// block since it came back from `Parked`. tokio has no readiness for them yet (its
    /// first event comes later, through its own thread), so a call that way is made
    /// without asking it, until one would block: a poll that must not wait (an ack
    /// written once, `Link::send_settled_now`) then still puts its message out.
    Reactor {
        socket: UnixStream,
        unproven: u8,
    },
    Parked(std::os::unix::net::UnixStream),
    Lost,
}

fn lost() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::NotConnected,
        "the same-host socket was lost between tokio and a caller's thread",
    )
}

/// `interest` as a `Direct` want bit.
fn way(interest: Interest) -> u8 {
    if interest == Interest::READABLE {
        WANTS_READ
    } else {
        WANTS_WRITE
    }
}

impl Control {
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        match self {
            Self::Reactor { socket, .. } => Some(socket.as_fd()),
            Self::Parked(socket) => Some(socket.as_fd()),
            Self::Lost => None,
        }
    }

    /// Off the reactor (nothing if it is off already).
    fn park(&mut self) {
        if !matches!(self, Self::Reactor { .. }) {
            return;
        }
        if let Self::Reactor { socket, .. } = std::mem::replace(self, Self::Lost) {
            if let Ok(parked) = socket.into_std() {
                *self = Self::Parked(parked);
            }
        }
    }

    /// Back on the reactor, from within the runtime's context (every poll of a link is).
    fn unpark(&mut self) -> std::io::Result<()> {
        if !matches!(self, Self::Parked(_)) {
            return Ok(());
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(std::io::Error::other(
                "a same-host stream was polled outside the tokio runtime",
            ));
        }
        if let Self::Parked(parked) = std::mem::replace(self, Self::Lost) {
            *self = Self::Reactor {
                socket: UnixStream::from_std(parked)?,
                unproven: WANTS_READ | WANTS_WRITE,
            };
        }
        Ok(())
    }

    /// Ready for `interest` as far as this poll can know: always under a `Direct` (the
    /// system call says, and records a would-block there), and a way still unproven;
    /// else by tokio's readiness, the socket put back on the reactor first and watched
    /// for both waiting tasks.
    fn poll_ready(
        &mut self,
        direct: bool,
        cx: &mut Context<'_>,
        interest: Interest,
    ) -> Poll<std::io::Result<()>> {
        if direct {
            return Poll::Ready(Ok(()));
        }
        self.unpark()?;
        match self {
            Self::Reactor { unproven, .. } if *unproven & way(interest) != 0 => Poll::Ready(Ok(())),
            Self::Reactor { socket, .. } if interest == Interest::READABLE => {
                socket.poll_read_ready(cx)
            }
            Self::Reactor { socket, .. } => socket.poll_write_ready(cx),
            _ => Poll::Ready(Err(lost())),
        }
    }

    /// One non-blocking system call on the socket, `call`: made directly under `direct`
    /// (which records what it would block on) and while that way is unproven (a
    /// would-block proves it), else through tokio's `try_io` (which clears its readiness
    /// on a would-block).
    fn call<R>(
        &mut self,
        direct: Option<&Direct>,
        interest: Interest,
        call: impl FnOnce(BorrowedFd<'_>) -> std::io::Result<R>,
    ) -> std::io::Result<R> {
        let bit = way(interest);
        match (&*self, direct) {
            (Self::Reactor { socket, unproven }, None) if *unproven & bit == 0 => {
                return socket.try_io(interest, || call(socket.as_fd()));
            }
            (Self::Parked(_) | Self::Lost, None) => return Err(lost()), // poll_ready unparks
            _ => {}
        }
        // Made directly: a would-block is recorded for the caller's thread, or proves
        // that way of a socket just back on the reactor.
        let result = call(self.fd().ok_or_else(lost)?);
        if result
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock)
        {
            match (direct, self) {
                (Some(direct), _) => direct.want(bit),
                (None, Self::Reactor { unproven, .. }) => *unproven &= !bit,
                (None, _) => {}
            }
        }
        result
    }
}

/// The byte stream (see the module).
pub struct ShmStream {
    control: Control,
    own: OwnRing,
    peer: PeerRing,
    /// Bytes written into `own`, in all; those not announced yet; those the peer
    /// released (`CREDIT`).
    written: u64,
    unannounced: u64,
    released: u64,
    /// Bytes the peer announced (`DATA`), in all; those copied out; those released to
    /// it in credits put on the wire.
    announced: u64,
    consumed: u64,
    credited: u64,
    /// Messages being sent: `wire[sent..built]`.
    wire: [u8; 3 * MESSAGE_LEN],
    sent: usize,
    built: usize,
    /// Control messages read, and how many bytes of them.
    inbox: [u8; INBOX_MESSAGES * MESSAGE_LEN],
    inbox_len: usize,
    /// This side's FIN: asked for (`poll_shutdown`), and put on the wire.
    finishing: bool,
    fin_built: bool,
    /// The peer said `FIN`: it writes no more.
    peer_finished: bool,
    /// The peer's end of the socket closed (or was reset): no more messages.
    closed: bool,
    /// It closed mid-message: the stream ends in an error once what came is read.
    truncated: bool,
    /// The peer reads no more (a write to it failed): nothing more is put on the wire.
    deaf: bool,
    waiting: Arc<Waiting>,
    both: Waker,
    /// While on, the socket's reads and writes are non-blocking system calls made by
    /// whichever thread polls (`go_direct`), a would-block recorded there for it to wait
    /// for; tokio's readiness is neither asked nor waited on meanwhile.
    direct: Option<Direct>,
}

impl ShmStream {
    /// Make this side's ring of `ring_len` bytes, pass it to the peer and adopt the peer's
    /// (checked against `limits`); both sides call this at once on the two ends of a
    /// connected socket, after anything that must come first (the hello and
    /// authentication: a peer that has not proved itself costs no ring).
    pub async fn open(socket: UnixStream, ring_len: usize, limits: &RingLimits) -> Result<Self> {
        let own = OwnRing::create(ring_len)?;
        let mut setup = [0u8; MESSAGE_LEN];
        setup[..8].copy_from_slice(SETUP_MAGIC);
        setup[8..].copy_from_slice(&(own.len() as u64).to_le_bytes());
        let mut sent = 0;
        while sent < MESSAGE_LEN {
            socket.writable().await?;
            let fd = own.fd();
            match socket.try_io(Interest::WRITABLE, || {
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
            let read = socket.try_io(Interest::READABLE, || {
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
                Err(e) => return Err(from_io(e)),
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
        let mut said = [0u8; 8];
        said.copy_from_slice(&got[8..]);
        let said = u64::from_le_bytes(said);
        if said != peer.len() as u64 {
            return Err(protocol(
                "the size the setup says",
                format!("a ring of {} bytes said to be {said}", peer.len()),
            ));
        }
        let waiting = Arc::new(Waiting::default());
        Ok(Self {
            control: Control::Reactor {
                socket,
                unproven: 0,
            },
            own,
            peer,
            written: 0,
            unannounced: 0,
            released: 0,
            announced: 0,
            consumed: 0,
            credited: 0,
            wire: [0; 3 * MESSAGE_LEN],
            sent: 0,
            built: 0,
            inbox: [0; INBOX_MESSAGES * MESSAGE_LEN],
            inbox_len: 0,
            finishing: false,
            fin_built: false,
            peer_finished: false,
            closed: false,
            truncated: false,
            deaf: false,
            both: Waker::from(waiting.clone()),
            waiting,
            direct: None,
        })
    }

    /// Drive the socket by `direct`'s system calls while it is on (a caller's thread
    /// polls the transfer and waits for the socket itself, `Link::go_direct`); with
    /// `park`, the socket is taken off tokio's reactor meanwhile (whose thread would
    /// otherwise wake for its every event), and put back by the first poll that is not
    /// direct. The socket's descriptor, which that caller waits for; None once it is lost.
    pub fn go_direct(&mut self, direct: Direct, park: bool) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.direct = Some(direct);
        if park {
            self.control.park();
        }
        self.control.fd().map(|fd| fd.as_raw_fd())
    }

    /// The `Direct` in force now, if any (cloned only while on: through tokio, a poll
    /// pays no reference count).
    fn direct_now(&self) -> Option<Direct> {
        self.direct
            .as_ref()
            .filter(|direct| direct.is_on())
            .cloned()
    }

    /// What this side owes the peer, as messages, when the wire is free: its
    /// announcements, a credit, then its FIN after its last bytes. A credit goes out
    /// once a quarter of the peer's ring was copied out, else only beside a message of
    /// this side's own (the same system call): the peer waits for room only when all of
    /// its ring is unread or owed here, and then more than a quarter is owed once this
    /// side has read it. So a small message costs one control message, not two.
    fn build(&mut self) {
        if self.sent < self.built {
            return;
        }
        let (mut at, wire) = (0, &mut self.wire);
        let mut push = |kind, n| {
            wire[at..at + MESSAGE_LEN].copy_from_slice(&message(kind, n));
            at += MESSAGE_LEN;
        };
        let sending = self.unannounced > 0 || (self.finishing && !self.fin_built);
        if self.unannounced > 0 {
            push(DATA, self.unannounced);
            self.unannounced = 0;
        }
        let owed = self.consumed - self.credited;
        let quarter = self.peer.len() as u64 / 4;
        if owed > 0 && (owed >= quarter || sending) {
            push(CREDIT, owed);
            self.credited = self.consumed;
        }
        if self.finishing && !self.fin_built {
            push(FIN, 0);
            self.fin_built = true;
        }
        (self.sent, self.built) = (0, at);
    }

    /// Put what is owed on the socket, as far as it takes it now: Ready once all went,
    /// Pending (the socket watched for room, for both waiting tasks) while some is left.
    /// A peer that reads no more (`deaf`) is told nothing more.
    fn poll_send(&mut self) -> Poll<std::io::Result<()>> {
        let both = self.both.clone();
        let mut cx = Context::from_waker(&both);
        loop {
            self.build();
            if self.sent == self.built || self.deaf {
                return Poll::Ready(Ok(()));
            }
            let direct = self.direct_now();
            match self
                .control
                .poll_ready(direct.is_some(), &mut cx, Interest::WRITABLE)
            {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
            let pending = &self.wire[self.sent..self.built];
            let flags = rustix::net::SendFlags::NOSIGNAL | rustix::net::SendFlags::DONTWAIT;
            match self
                .control
                .call(direct.as_ref(), Interest::WRITABLE, |socket| {
                    rustix::net::send(socket, pending, flags).map_err(std::io::Error::from)
                }) {
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if direct.is_some() {
                        return Poll::Pending; // recorded: the caller waits for room
                    }
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if gone(&e) => {
                    self.deaf = true;
                    return Poll::Ready(Err(e));
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Take the control messages the socket holds now, at most `MESSAGES_PER_POLL` (the
    /// socket watched for more, for both waiting tasks).
    fn take_messages(&mut self) -> std::io::Result<()> {
        let both = self.both.clone();
        let mut cx = Context::from_waker(&both);
        let mut taken = 0;
        while !self.closed {
            if taken >= MESSAGES_PER_POLL {
                self.both.wake_by_ref();
                return Ok(());
            }
            let direct = self.direct_now();
            match self
                .control
                .poll_ready(direct.is_some(), &mut cx, Interest::READABLE)
            {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => return Ok(()),
            }
            let at = self.inbox_len;
            let inbox = &mut self.inbox[at..];
            let read = self
                .control
                .call(direct.as_ref(), Interest::READABLE, |socket| {
                    rustix::net::recv(socket, inbox, rustix::net::RecvFlags::DONTWAIT)
                        .map(|(n, _)| n)
                        .map_err(std::io::Error::from)
                });
            match read {
                Ok(0) => {
                    self.closed = true;
                    self.truncated = self.inbox_len > 0;
                }
                Ok(n) => {
                    self.inbox_len += n;
                    let whole = self.inbox_len / MESSAGE_LEN * MESSAGE_LEN;
                    for start in (0..whole).step_by(MESSAGE_LEN) {
                        let mut one = [0u8; MESSAGE_LEN];
                        one.copy_from_slice(&self.inbox[start..start + MESSAGE_LEN]);
                        self.apply(one).map_err(io_error)?;
                        taken += 1;
                    }
                    self.inbox.copy_within(whole..self.inbox_len, 0);
                    self.inbox_len -= whole;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if direct.is_some() {
                        return Ok(()); // recorded: the caller waits for the socket
                    }
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // A reset ends the messages; what the peer announced is still read.
                Err(e) if gone(&e) => self.closed = true,
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
        if self.peer_finished && kind != CREDIT {
            // Nothing follows a FIN but credits for this side's bytes.
            return Err(protocol(
                "nothing but credits after the peer's FIN",
                format!("a message of kind {kind}"),
            ));
        }
        match kind {
            FIN if n == 0 => self.peer_finished = true,
            DATA => {
                // The peer may have written up to its ring's size past what this side
                // released to it.
                let room = self.credited + self.peer.len() as u64 - self.announced;
                if n == 0 || n > room {
                    return Err(protocol(
                        "at most the room this side released in the peer's ring",
                        format!("{n} more bytes announced with room for {room}"),
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
}

impl AsyncRead for ShmStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        Waiting::set(&this.waiting.read, cx.waker());
        // Credits owed go out first; a peer that reads no more is not the reader's error.
        if let Poll::Ready(Err(e)) = this.poll_send() {
            if !gone(&e) {
                return Poll::Ready(Err(e));
            }
        }
        // Announcements are read only when what is known unread does not fill `buf`: a
        // frame read in pieces (its header, then its payload) costs no system call for
        // the pieces already announced.
        if this.announced - this.consumed < buf.remaining() as u64 {
            this.take_messages()?;
        }
        let unread = this.announced - this.consumed;
        if unread == 0 {
            return if this.truncated {
                Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the peer closed the same-host socket in the middle of a control message",
                )))
            } else if this.peer_finished || this.closed {
                Poll::Ready(Ok(())) // the end: nothing read
            } else {
                Poll::Pending // the socket is watched (take_messages)
            };
        }
        let n = buf.remaining().min(unread as usize);
        let offset = (this.consumed % this.peer.len() as u64) as usize;
        this.peer.copy_out(offset, buf.initialize_unfilled_to(n));
        buf.advance(n);
        this.consumed += n as u64;
        // The bytes are the caller's now: a failure to send the credit shows at the next
        // call, never in place of them.
        let _ = this.poll_send();
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
        Waiting::set(&this.waiting.write, cx.waker());
        if let Poll::Ready(Err(e)) = this.poll_send() {
            return Poll::Ready(Err(e));
        }
        this.take_messages()?;
        if this.closed || this.finishing || this.deaf {
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
            let n = buf.len().min(room as usize - moved);
            let at = (this.written % this.own.len() as u64) as usize;
            this.own.write_at(at, &buf[..n]);
            this.written += n as u64;
            moved += n;
            if moved as u64 == room {
                break;
            }
        }
        this.unannounced += moved as u64;
        // Announced as far as the socket takes it now; the rest by the next poll.
        let _ = this.poll_send();
        Poll::Ready(Ok(moved))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        Waiting::set(&this.waiting.write, cx.waker());
        match this.poll_send() {
            Poll::Ready(Ok(())) if this.deaf => {
                Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()))
            }
            other => other,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        this.finishing = true;
        Pin::new(this).poll_flush(cx)
    }
}
