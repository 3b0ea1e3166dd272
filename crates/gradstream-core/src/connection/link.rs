//! One established connection (docs/guides/connections.md): its transfers, sealed to it and
//! acknowledged, one at a time in either direction.
//!
//! A `Link` owns the byte stream (TCP, or TLS over it) and, for a `"gradstream"`
//! connection, the handshake's keys: the nonces every transfer id derives from and the
//! count of transfers each way, so the receiver knows the one id it must see next. A
//! failed transfer leaves the connection out of step, so the link closes (`State`); so
//! does one abandoned midway (its future dropped: a cancelled task), which the byte counts
//! of its stream (`Counted`) tell from one abandoned before its first byte.
//!
//! Uses `handshake` (`Established`), `tap`, `protocol` (ids, acks), `seal`, `stream`
//! and `tensors::stream`; used by `dial`, `listener` and the bindings.

use crate::error::PeerAt;
use std::time::Duration;

use std::future::Future;
use std::task::{Context, Poll};

use tokio::io::AsyncWriteExt;
use tokio::sync::OwnedSemaphorePermit;

use super::handshake::{read_full, Established};
use super::streams::Joining;
use super::tap::Tap;
use crate::dtype::WireDtype;
use crate::encoder::Gradient;
use crate::error::{GradientStreamError, Result};
use crate::frame::HEADER_LEN;
use crate::protocol::describe::{describe, Kind};
use crate::protocol::{transfer_id, Ack, Digest, Direction, Verdict, START_LEN};
use crate::receiver::{Ended, FrameReceiver};
use crate::seal::{Position, Seal, SealCheck, TransferId};
use crate::session::SessionConfig;
use crate::stream::{receive_gradient, send_gradient_on, within, Clock, Progress, Waits};
use crate::tensors::{self, Entry, TensorSet, TensorSetReceiver};

mod counted;
mod peer;
mod pumps;
mod resume;
mod send;
mod single;
mod striped;

use counted::Counted;
pub use counted::{Direct, ReadBudget};
pub use peer::{LocalPeer, Peer, PeerAddress};
pub use resume::{Dialling, Redial, Resume, Resumed};

pub use super::Duplex;

/// The descriptor of a plain TCP stream (None for TLS and anything else).
fn tcp_fd(stream: &dyn Duplex) -> Option<std::os::fd::RawFd> {
    use std::os::fd::AsRawFd;
    let any: &dyn std::any::Any = stream;
    any.downcast_ref::<tokio::net::TcpStream>()
        .map(AsRawFd::as_raw_fd)
        .filter(|_| cfg!(target_os = "linux"))
}

/// How long a refusing receiver keeps reading (and discarding) what the sender is still
/// writing, so that the sender reaches the refusal instead of a reset connection
/// (docs/spec/protocol.md
/// "Connections": at most 1 s); also how long a close waits for the stream's shutdown.
const LINGER: Duration = Duration::from_secs(1);

/// The protocol state of the connection.
enum Mode {
    /// `protocol="seed"`: bare frames, nothing else.
    Seed,
    /// `protocol="gradstream"`: sealed, acknowledged transfers (boxed: the keys, a
    /// session secret among them, would make every link as large).
    Sealed(Box<Keys>),
}

/// What a gradstream connection's transfers derive from and count.
struct Keys {
    established: Established,
    /// Transfers this side has sent, and received: the next id's counter each way.
    sent: u64,
    received: u64,
    /// The digest of the last transfer received and taken (zeros before one): what a
    /// resume tells a sender whose ack was lost (docs/spec/protocol.md, "Resume").
    last_digest: [u8; 32],
}

impl Keys {
    fn direction(&self, outgoing: bool) -> Direction {
        let role = self.established.role;
        Direction::sent_by(if outgoing { role } else { role.peer() })
    }

    /// The id of this side's next outgoing (or incoming) transfer.
    fn id(&self, outgoing: bool) -> TransferId {
        let counter = if outgoing { self.sent } else { self.received };
        let e = &self.established;
        TransferId(transfer_id(
            &e.client_nonce,
            &e.server_nonce,
            self.direction(outgoing),
            counter,
        ))
    }
}

/// Whether the link can still carry a transfer.
enum State {
    Open,
    /// A transfer began when `moved` bytes had moved, and has not ended: if its future
    /// was dropped (a cancelled task) after a byte of it moved, the peer and this side
    /// no longer agree where the next transfer starts.
    Running {
        moved: u64,
    },
    /// Closed, by this side or after a failure (its text), or by the peer.
    Closed(String),
}

/// One connection.
pub struct Link {
    stream: Counted,
    /// The connection's other streams, in index order (docs/spec/protocol.md, "Several
    /// streams"): a gradient's frames go over all of them.
    lanes: Vec<Counted>,
    /// A listener's link whose joins have yet to come.
    joining: Option<Box<Joining>>,
    /// The listener's connection slots of the joined streams.
    lane_slots: Vec<OwnedSemaphorePermit>,
    /// Its streams are lent to a transfer's tasks (`striped`): while they are, and for
    /// good when a transfer dropped midway lost them, the link is closed.
    lent: bool,
    /// How its streams come back after a failure (None: they do not; the transfer fails).
    resume: Option<Box<Resume>>,
    /// What resumes there were.
    resumed: std::sync::Arc<Resumed>,
    mode: Mode,
    peer: Peer,
    state: State,
    /// The ack this side owes or has yet to write (boxed: a link travels in the
    /// listener's events, which stay small).
    settling: Box<Settling>,
    /// A listener's connection slot (`max_connections`), freed when the link goes.
    _slot: Option<OwnedSemaphorePermit>,
}

/// A receiver's acknowledgement between the transfer and the wire.
#[derive(Default)]
struct Settling {
    /// The digest of a transfer received and verified whose acknowledgement waits for
    /// the caller to take it (`Link::settle`): docs/guides/connections.md "Delivery".
    owed: Option<[u8; 32]>,
    /// An ack (or refusal) settled but not yet all written.
    unsent: Vec<u8>,
}

/// The refusal a receiver sends for a transfer its caller never took.
const CANCELLED: &str = "the receiver cancelled its receive before taking the transfer";

/// An ack's digest of a transfer's frame headers, given in chunk-index order (on one
/// stream, the order they passed; on several, the order of their indexes:
/// docs/spec/protocol.md "Several streams").
fn digest_of<'h>(
    id: &TransferId,
    headers: impl IntoIterator<Item = &'h [u8; HEADER_LEN]>,
) -> [u8; 32] {
    let mut digest = Digest::new(&id.0);
    for header in headers {
        digest.header(header);
    }
    digest.finish()
}

/// What a receive gave: a transfer, or the peer's clean close before one began.
pub enum Received<T> {
    Transfer(T),
    End,
}

impl Link {
    /// A `"gradstream"` link after its handshake.
    pub fn sealed(stream: Box<dyn Duplex>, established: Established, peer: Peer) -> Self {
        Self::new(
            stream,
            Mode::Sealed(Box::new(Keys {
                established,
                sent: 0,
                received: 0,
                last_digest: [0; 32],
            })),
            peer,
        )
    }

    /// A `"seed"` link: bare frames.
    pub fn seed(stream: Box<dyn Duplex>, peer: Peer) -> Self {
        Self::new(stream, Mode::Seed, peer)
    }

    fn new(stream: Box<dyn Duplex>, mode: Mode, peer: Peer) -> Self {
        Self {
            stream: Counted::of(stream),
            lanes: Vec::new(),
            joining: None,
            lane_slots: Vec::new(),
            lent: false,
            resume: None,
            resumed: std::sync::Arc::default(),
            mode,
            peer,
            state: State::Open,
            settling: Box::default(),
            _slot: None,
        }
    }

    /// The same link over these other streams too (a client's, joined already).
    pub fn with_streams(mut self, lanes: Vec<Box<dyn Duplex>>) -> Self {
        self.lanes = lanes.into_iter().map(Counted::of).collect();
        self
    }

    /// The same link, whose other streams will come through `joining` (a listener's),
    /// and come back through it after a failure, if its session resumes.
    pub fn joining(mut self, joining: Option<Joining>) -> Self {
        self.joining = joining.map(Box::new);
        self
    }

    /// The same link, whose streams are dialled again after a failure (a client's).
    pub fn resuming(mut self, resume: Option<Resume>) -> Self {
        self.resume = resume.map(Box::new);
        self
    }

    /// How many streams the connection has (joined or to come).
    pub fn streams(&self) -> usize {
        1 + self.lanes.len() + self.joining.as_ref().map_or(0, |j| j.got.len())
    }

    /// Whether its gradients go through the striped engine (`striped`): several
    /// streams.
    fn striped(&self) -> bool {
        self.streams() > 1
    }

    /// Whether its streams come back after a failure.
    pub fn resumes(&self) -> bool {
        self.resume.is_some() || self.joining.as_ref().is_some_and(|j| j.resume.is_some())
    }

    /// What resumes there were (counts shared with the link, readable while it runs a
    /// transfer).
    pub fn resumed(&self) -> std::sync::Arc<Resumed> {
        self.resumed.clone()
    }

    /// Bytes moved on every stream.
    fn moved(&self) -> u64 {
        self.lanes
            .iter()
            .fold(self.stream.moved, |sum, lane| sum + lane.moved)
    }

    /// Wait for the joins still to come (before the first gradient that needs them),
    /// until the listener's `handshake_timeout` after the opening connection's, and
    /// within the transfer's waits (`clock`). Cancel-safe: what came stays in `joining`.
    /// A wait the clock ends leaves the link open (no byte of the transfer moved); joins
    /// that never came close it.
    async fn gather(&mut self, clock: &Clock) -> Result<()> {
        while let Some(joining) = self.joining.as_mut().filter(|j| j.missing() > 0) {
            let next = tokio::time::timeout_at(joining.until.into(), joining.joins.recv());
            let Ok(Some(join)) = within(clock, (0, None), async { Ok(next.await) }).await? else {
                let streams = joining.got.len() + 1;
                let came = streams - joining.missing();
                let error = GradientStreamError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "{came} of the {streams} streams the peer opened joined within the \
                         listener's handshake_timeout"
                    ),
                ));
                return self.fail(error).await;
            };
            if join.resumed {
                // The peer saw a failure before every join came: kept for the resume.
                joining.resumed.push(join);
                continue;
            }
            // The session table lets each index join once, within the grant (1 and up).
            let index = usize::from(join.index).saturating_sub(1);
            if let Some(place) = joining.got.get_mut(index) {
                *place = Some(join);
            }
        }
        let Some(joining) = self.joining.take().map(|j| *j) else {
            return Ok(());
        };
        for join in joining.got.into_iter().flatten() {
            self.lanes.push(Counted::of(join.stream));
            self.lane_slots.extend(join.slot);
        }
        if let Some(window) = joining.resume {
            self.resume = Some(Box::new(Resume::awaiting(
                window,
                (joining.joins, joining.resumed),
                joining.entry,
            )));
        }
        Ok(())
    }

    /// Hold a listener's connection slot for as long as this link lives.
    pub fn holding(mut self, slot: OwnedSemaphorePermit) -> Self {
        self._slot = Some(slot);
        self
    }

    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// Bound what the link's reads take from now on by `budget` (None: no bound).
    pub fn read_budget(&mut self, budget: Option<ReadBudget>) {
        self.stream.budget = budget;
    }

    /// Drive the link's reads and writes as system calls on its socket, from whichever
    /// thread polls its transfers, while the `Direct` returned is on; with `park`, the
    /// socket is taken off tokio's reactor meanwhile (a blocking caller's link: tokio's
    /// thread is not woken by its every event), and put back by the first poll that is
    /// not direct. The socket, which the caller waits for; None for a TLS link, and once
    /// the socket is closed.
    pub fn go_direct(&mut self, park: bool) -> Option<(std::os::fd::RawFd, Direct)> {
        if self.striped() || self.resumes() {
            // One descriptor cannot carry several streams' waits, nor a resume's (which
            // replaces it).
            return None;
        }
        let direct = Direct::default();
        #[cfg(target_os = "linux")]
        if let Some(shm) = self.stream.same_host() {
            // The same-host stream makes its own system calls (its socket carries only
            // control messages; the bytes are in its rings) and parks its own socket.
            let fd = shm.go_direct(direct.clone(), park)?;
            self.stream.direct = Some(direct.clone());
            return Some((fd, direct));
        }
        let fd = self.stream.fd?;
        self.stream.direct = Some(direct.clone());
        if park {
            self.stream.park();
        }
        // `park` closes the socket should the reactor refuse to let it go.
        self.stream.fd.map(|_| (fd, direct))
    }

    /// Reads and writes through tokio from now on (`go_direct` undone).
    pub fn leave_direct(&mut self) {
        if let Some(direct) = self.stream.direct.take() {
            direct.off(); // a same-host stream holds it too
        }
    }

    /// Closed: by this side, by the peer (between transfers), after a failure, or after
    /// a transfer abandoned midway.
    pub fn is_closed(&self) -> bool {
        if self.lent {
            return true;
        }
        match self.state {
            State::Open => false,
            State::Running { moved } => moved != self.moved(),
            State::Closed(_) => true,
        }
    }

    /// Mark the link closed (why) and give back its listener's connection slot.
    fn closed(&mut self, why: String) {
        self.state = State::Closed(why);
        self._slot = None;
        self.lane_slots.clear();
        self.joining = None;
        self.resume = None; // its session's entry goes: no stream can resume it
    }

    /// The peer ended the connection between transfers: closed, and this side's end
    /// shut down too (a peer that only shut down its sending side gets its end of the
    /// connection now, not when this link is dropped).
    async fn peer_closed(&mut self) {
        self.closed("the peer closed it".into());
        self.shut().await;
    }

    /// This side's end of the stream: what is settled but unsent written, a TLS
    /// close_notify and a FIN, each for at most LINGER (the peer may be gone already:
    /// there is nothing left to tell it); then the socket closed (`Counted::release`).
    async fn shut(&mut self) {
        let _ = tokio::time::timeout(LINGER, self.write_unsent()).await;
        let _ = tokio::time::timeout(LINGER, self.stream.shutdown()).await;
        for lane in &mut self.lanes {
            let _ = tokio::time::timeout(LINGER, lane.shutdown()).await;
        }
        self.release_all();
    }

    /// Every stream's socket closed now.
    fn release_all(&mut self) {
        self.stream.release();
        for lane in &mut self.lanes {
            lane.release();
        }
    }

    /// Closed by this side: a transfer received but not taken is refused.
    fn closing(&mut self) {
        if self.settling.owed.is_some() {
            self.settle(false);
        }
        if !matches!(self.state, State::Closed(_)) {
            self.closed("it was closed".into());
        }
    }

    /// Close the connection: a transfer received but not taken is refused first, then
    /// the stream is shut down and its socket closed at once (docs/guides/connections.md
    /// "Closing"); idempotent.
    pub async fn close(&mut self) {
        self.closing();
        self.shut().await;
    }

    /// `close` without waiting: what can be written at once is, then the socket is
    /// closed (for a connection dropped without `close`, or one a cancelled transfer
    /// left out of step). Call it within the tokio runtime's context.
    pub fn close_now(&mut self) {
        self.closing();
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut shut = Box::pin(async {
            self.write_unsent().await?;
            self.stream.shutdown().await
        });
        let _ = shut.as_mut().poll(&mut cx);
        drop(shut);
        self.release_all();
    }

    /// After a transfer whose caller gave up on it (its future dropped, a cancelled
    /// task): a transfer received but not taken is refused, and a link it left out of
    /// step (a byte of it moved) closed, now; one abandoned before its first byte stays
    /// open. True when the link is closed. Within the tokio runtime's context.
    pub fn abandoned(&mut self) -> bool {
        if self.settling.owed.is_some() || self.is_closed() {
            if let State::Running { .. } = self.state {
                self.closed("a transfer was abandoned midway".into());
            }
            self.close_now();
            return true;
        }
        if let State::Running { .. } = self.state {
            self.state = State::Open;
        }
        false
    }

    /// Whether a transfer received and verified waits for `settle`.
    pub fn owes(&self) -> bool {
        self.settling.owed.is_some()
    }

    /// The caller took the transfer just received (`taken`): its ack is due; or it never
    /// will: its refusal is due, and the link closes. Either is written by
    /// `send_settled_now`, the next transfer, or `close`. Nothing when nothing is owed.
    pub fn settle(&mut self, taken: bool) {
        let (Some(digest), Mode::Sealed(keys)) = (self.settling.owed.take(), &mut self.mode) else {
            return;
        };
        let ack = if taken {
            keys.last_digest = digest;
            Ack::accepted(keys.received, digest)
        } else {
            Ack::refused(keys.received, CANCELLED)
        };
        keys.received += 1;
        self.settling.unsent.extend_from_slice(&ack.to_bytes());
        if !taken {
            self.closed(CANCELLED.into());
        }
    }

    /// Write what `settle` queued as far as the socket takes it now, without waiting
    /// (an ack is a few dozen bytes to a peer that waits for it: all of it, but for a
    /// peer that stopped reading). A failed write closes the link. Within the tokio
    /// runtime's context.
    pub fn send_settled_now(&mut self) {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut write = Box::pin(self.write_unsent());
        let failed = matches!(write.as_mut().poll(&mut cx), Poll::Ready(Err(_)));
        drop(write);
        if failed {
            self.settling.unsent.clear();
            if self.resumes() {
                // The ack's news reaches the sender through the resume (its state).
                return;
            }
            self.closed("the acknowledgement could not be written".into());
            self.release_all();
        }
    }

    /// Take the transfer just received and write its ack (for callers that hold what
    /// the receive returned once it returns).
    pub async fn acknowledge(&mut self) -> Result<()> {
        self.settle(true);
        match self.write_unsent().await {
            Ok(()) => Ok(()),
            Err(_) if self.resumes() => {
                // The ack's news reaches the sender through the resume (its state).
                self.settling.unsent.clear();
                Ok(())
            }
            Err(e) => self.fail(e.into()).await,
        }
    }

    /// Write what `settle` queued; cancel-safe (what was written is gone from the queue).
    async fn write_unsent(&mut self) -> std::io::Result<()> {
        if self.settling.unsent.is_empty() {
            return Ok(());
        }
        while !self.settling.unsent.is_empty() {
            let n = self.stream.write(&self.settling.unsent).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            self.settling.unsent.drain(..n);
        }
        self.stream.flush().await
    }

    /// Start a transfer: refused on a closed link, and on one whose last transfer was
    /// abandoned after its first byte (which closes it).
    async fn begin(&mut self) -> Result<()> {
        if self.settling.owed.is_some() {
            // The last transfer's caller never settled it: it did not take it.
            self.settle(false);
            self.shut().await;
        } else if !self.settling.unsent.is_empty() {
            // The last transfer's ack, which the socket did not take at once: the peer
            // waits for it, so it reads it (within LINGER) unless it is broken.
            let written = tokio::time::timeout(LINGER, self.write_unsent())
                .await
                .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()));
            match written {
                Ok(()) => {}
                // The streams failed: the transfer about to begin resumes them, and the
                // resume tells the sender what the ack would have.
                Err(_) if self.resumes() => self.settling.unsent.clear(),
                Err(e) => return self.fail(e.into()).await,
            }
        }
        if self.is_closed() {
            if let State::Running { .. } = self.state {
                self.closed("a transfer was abandoned midway".into());
                self.shut().await;
            }
            let why = match &self.state {
                State::Closed(why) => why.clone(),
                _ => String::new(),
            };
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                format!("the connection is closed: {why}"),
            )
            .into());
        }
        self.state = State::Running {
            moved: self.moved(),
        };
        Ok(())
    }

    /// End a transfer: the link is open for the next one unless the transfer closed it.
    fn end<T>(&mut self, result: Result<T>) -> Result<T> {
        if let State::Running { .. } = self.state {
            self.state = State::Open;
        }
        result
    }

    /// Close after a failed transfer: the stream is out of step with the peer.
    /// The socket stays open until `close` (or the link's drop): what the peer sent
    /// last (a refusal, a frame where an ack belongs) stays readable for it, not reset.
    async fn fail<T>(&mut self, error: GradientStreamError) -> Result<T> {
        self.closed(error.to_string());
        let _ = tokio::time::timeout(LINGER, self.stream.shutdown()).await;
        for lane in &mut self.lanes {
            let _ = tokio::time::timeout(LINGER, lane.shutdown()).await;
        }
        Err(error)
    }

    fn delivery(&self, detail: String, reason: Option<String>) -> GradientStreamError {
        GradientStreamError::Delivery {
            detail,
            reason,
            peer: self.peer.address.at(),
        }
    }

    /// Receive one gradient through `receiver` (`config.receiver()` or `receiver_into`);
    /// `BeforeFirstByte` when the peer closed the connection before one began. A
    /// gradient's ack is owed until the caller holds it and `settle`s it (or
    /// `acknowledge`s it): docs/guides/connections.md "Delivery".
    pub async fn recv_gradient(
        &mut self,
        receiver: FrameReceiver,
        waits: Waits,
        progress: &Progress,
    ) -> Result<Ended> {
        self.begin().await?;
        let got = self.recv_gradient_begun(receiver, waits, progress).await;
        self.end(got)
    }

    async fn recv_gradient_begun(
        &mut self,
        receiver: FrameReceiver,
        waits: Waits,
        progress: &Progress,
    ) -> Result<Ended> {
        let Mode::Sealed(keys) = &self.mode else {
            return match receive_gradient(receiver, &mut self.stream, waits, progress).await {
                Ok(Ended::BeforeFirstByte(receiver)) => {
                    self.peer_closed().await;
                    Ok(Ended::BeforeFirstByte(receiver))
                }
                Ok(got) => Ok(got),
                Err(e) => self.failed_receive(e, None).await,
            };
        };
        let id = keys.id(false);
        let receiver = receiver.expect_seal(SealCheck::Exact(id), Position::Lone);
        let (got, digest, first) = if self.striped() {
            self.gather(&Clock::idle(waits)).await?;
            self.recv_striped(receiver, id, waits, progress).await
        } else if self.resumes() {
            self.gather(&Clock::idle(waits)).await?;
            self.recv_resumable_one(receiver, id, waits, progress).await
        } else {
            let mut tap = Tap::new(&mut self.stream, Digest::new(&id.0));
            let got = receive_gradient(receiver, &mut tap, waits, progress).await;
            let first = tap.first_header();
            (got, tap.finish(), first)
        };
        match got {
            Ok(Ended::Gradient(values)) => {
                self.settling.owed = Some(digest);
                Ok(Ended::Gradient(values))
            }
            Ok(Ended::BeforeFirstByte(receiver)) => {
                self.peer_closed().await;
                Ok(Ended::BeforeFirstByte(receiver))
            }
            Err(e) => self.failed_receive(e, Some(first)).await,
        }
    }

    /// Receive one tensor set, of at most `max_values` values in all when given (refused
    /// from its manifest, as a set above max_gradient_len is); its ack owed as a
    /// gradient's (`recv_gradient`).
    pub async fn recv_tensors(
        &mut self,
        config: &SessionConfig,
        max_values: Option<usize>,
        waits: Waits,
        progress: &Progress,
    ) -> Result<Received<TensorSet>> {
        self.begin().await?;
        let got = self
            .recv_tensors_begun(config, max_values, waits, progress)
            .await;
        self.end(got)
    }

    async fn recv_tensors_begun(
        &mut self,
        config: &SessionConfig,
        max_values: Option<usize>,
        waits: Waits,
        progress: &Progress,
    ) -> Result<Received<TensorSet>> {
        let receiver = TensorSetReceiver::new(config).max_values(max_values);
        let Mode::Sealed(keys) = &self.mode else {
            let mut tap = Tap::new(&mut self.stream, Digest::new(&[0; 16]));
            let got = tensors::receive_tensor_set(receiver, &mut tap, waits, progress).await;
            let began = tap.first_header().is_some();
            return match got {
                Ok(_) if !began => {
                    self.peer_closed().await;
                    Ok(Received::End)
                }
                Ok(set) => Ok(Received::Transfer(set)),
                Err(e) => self.failed_receive(e, None).await,
            };
        };
        let id = keys.id(false);
        let mut tap = Tap::new(&mut self.stream, Digest::new(&id.0));
        let receiver = receiver.expect_seal(SealCheck::Exact(id));
        let got = tensors::receive_tensor_set(receiver, &mut tap, waits, progress).await;
        let first = tap.first_header();
        let digest = tap.finish();
        match got {
            Ok(_) if first.is_none() => {
                self.peer_closed().await;
                Ok(Received::End)
            }
            Ok(set) => {
                self.settling.owed = Some(digest);
                Ok(Received::Transfer(set))
            }
            Err(e) => self.failed_receive(e, Some(first)).await,
        }
    }

    /// After a receive failed: a broken connection closes; a transfer of which no byte
    /// moved (a timeout while waiting for it) leaves the link in step and open; any other
    /// is refused (a `"gradstream"` link, whose first header `first` was) and closes.
    async fn failed_receive<T>(
        &mut self,
        error: GradientStreamError,
        first: Option<Option<[u8; HEADER_LEN]>>,
    ) -> Result<T> {
        let untouched = matches!(self.state, State::Running { moved } if moved == self.moved());
        match first {
            _ if is_io(&error) => self.fail(error).await,
            _ if untouched => Err(error),
            Some(first) => {
                let address = self.peer.address.at();
                self.refuse(message_instead(error, first, address.as_ref()))
                    .await
            }
            None => self.fail(error).await,
        }
    }

    /// Tell the sender why its transfer was refused, let it reach the refusal, close.
    async fn refuse<T>(&mut self, error: GradientStreamError) -> Result<T> {
        if let (Mode::Sealed(keys), false) = (&self.mode, is_io(&error)) {
            let ack = Ack::refused(keys.received, error.to_string());
            let told = async {
                self.stream.write_all(&ack.to_bytes()).await?;
                self.stream.flush().await?;
                self.stream.shutdown().await?;
                // Discard what the sender still writes (for at most LINGER), on every
                // stream, so that its writes end and it reads the refusal rather than a
                // reset.
                self.drain_all().await
            };
            let _ = tokio::time::timeout(LINGER, told).await;
        }
        self.fail(error).await
    }
}

/// A broken connection cannot carry a refusal (a stalled or slow one can: it is told
/// the timeout or deadline, as any other refusal, for at most LINGER).
fn is_io(error: &GradientStreamError) -> bool {
    matches!(error, GradientStreamError::Io(_))
}

/// A failed first frame that was a protocol message (an ack, a hello) is a
/// ProtocolError: the peer waits for an ack while this side waits for a gradient.
fn message_instead(
    error: GradientStreamError,
    first: Option<[u8; HEADER_LEN]>,
    peer: Option<&PeerAt>,
) -> GradientStreamError {
    let is_message = |head: &[u8; HEADER_LEN]| {
        [Kind::Hello, Kind::Auth, Kind::Ack]
            .iter()
            .any(|kind| kind.magic() == head[..4])
    };
    match first.filter(is_message) {
        Some(head) => GradientStreamError::Protocol {
            expected: "a gradient's frames".into(),
            seen: format!(
                "{}: both sides wait for the other (one transfer at a time on a connection)",
                describe(&head)
            ),
            peer: peer.cloned(),
        },
        None => error,
    }
}
