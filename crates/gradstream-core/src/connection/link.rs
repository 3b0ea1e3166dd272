//! One established connection (README "Connections"): its transfers, sealed to it and
//! acknowledged, one at a time in either direction.
//!
//! A `Link` owns the byte stream (TCP, or TLS over it) and, for a `"gradstream"`
//! connection, the handshake's keys: the nonces every transfer id derives from and the
//! count of transfers each way, so the receiver knows the one id it must see next. A
//! failed transfer leaves the connection out of step, so the link closes (`State`).
//!
//! Uses `handshake` (`Established`), `tap`, `protocol` (ids, acks), `seal`, `stream`
//! and `tensors::stream`; used by `dial`, `listener` and the bindings.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::OwnedSemaphorePermit;

use super::handshake::{read_full, Established};
use super::tap::Tap;
use crate::dtype::Dtype;
use crate::encoder::Gradient;
use crate::error::{GradientStreamError, Result};
use crate::frame::HEADER_LEN;
use crate::protocol::describe::{describe, Kind};
use crate::protocol::{transfer_id, Ack, Digest, Direction, Verdict, ACK_HEAD_LEN};
use crate::receiver::{Ended, FrameReceiver};
use crate::seal::{Position, Seal, SealCheck, TransferId};
use crate::session::SessionConfig;
use crate::stream::{receive_gradient, send_gradient_on, within, Clock, Progress, Waits};
use crate::tensors::{self, Entry, TensorSet, TensorSetReceiver};

/// A byte stream a link can own: a TCP stream, or a TLS stream over one.
pub trait Duplex: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Duplex for T {}

/// Who is at the other end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub address: SocketAddr,
    /// The subject of the client certificate this side verified (mutual TLS), if any.
    pub tls_subject: Option<String>,
    /// The peer proved the authkey, or presented a certificate this side verified.
    pub authenticated: bool,
}

/// How long a refusing receiver keeps reading (and discarding) what the sender is still
/// writing, so that the sender reaches the refusal instead of a reset connection.
const LINGER: Duration = Duration::from_secs(2);

/// The protocol state of the connection.
enum Mode {
    /// `protocol="seed"`: bare frames, nothing else.
    Seed,
    /// `protocol="gradstream"`: sealed, acknowledged transfers.
    Sealed(Keys),
}

/// What a gradstream connection's transfers derive from and count.
struct Keys {
    established: Established,
    /// Transfers this side has sent, and received: the next id's counter each way.
    sent: u64,
    received: u64,
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
    /// Closed, by this side or after a failure (its text), or by the peer.
    Closed(String),
}

/// One connection.
pub struct Link {
    stream: Box<dyn Duplex>,
    mode: Mode,
    peer: Peer,
    state: State,
    /// A listener's connection slot (`max_connections`), freed when the link goes.
    _slot: Option<OwnedSemaphorePermit>,
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
            Mode::Sealed(Keys {
                established,
                sent: 0,
                received: 0,
            }),
            peer,
        )
    }

    /// A `"seed"` link: bare frames.
    pub fn seed(stream: Box<dyn Duplex>, peer: Peer) -> Self {
        Self::new(stream, Mode::Seed, peer)
    }

    fn new(stream: Box<dyn Duplex>, mode: Mode, peer: Peer) -> Self {
        Self {
            stream,
            mode,
            peer,
            state: State::Open,
            _slot: None,
        }
    }

    /// Hold a listener's connection slot for as long as this link lives.
    pub fn holding(mut self, slot: OwnedSemaphorePermit) -> Self {
        self._slot = Some(slot);
        self
    }

    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// Closed: by this side, by the peer (between transfers), or after a failure.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed(_))
    }

    /// Close the connection (a TLS close_notify first); idempotent.
    pub async fn close(&mut self) {
        if let State::Open = self.state {
            self.state = State::Closed("it was closed".into());
            // The peer may be gone already; there is nothing left to tell it.
            let _ = tokio::time::timeout(LINGER, self.stream.shutdown()).await;
        }
    }

    fn check_open(&self) -> Result<()> {
        match &self.state {
            State::Open => Ok(()),
            State::Closed(why) => Err(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                format!("the connection is closed: {why}"),
            )
            .into()),
        }
    }

    /// Close after a failed transfer: the stream is out of step with the peer.
    async fn fail<T>(&mut self, error: GradientStreamError) -> Result<T> {
        self.state = State::Closed(error.to_string());
        let _ = tokio::time::timeout(LINGER, self.stream.shutdown()).await;
        Err(error)
    }

    fn delivery(&self, detail: String, reason: Option<String>) -> GradientStreamError {
        GradientStreamError::Delivery {
            detail,
            reason,
            peer: Some(self.peer.address),
        }
    }

    /// Refuse, before a byte is sent, what the peer said it would refuse.
    fn check_fits(&self, config: &SessionConfig, values: usize) -> Result<()> {
        let Mode::Sealed(keys) = &self.mode else {
            return Ok(());
        };
        let limits = keys.established.peer_limits;
        if values > limits.max_gradient_len {
            return Err(self.delivery(
                format!(
                    "the gradient has {values} values; the peer accepts at most {}",
                    limits.max_gradient_len
                ),
                None,
            ));
        }
        let chunk = config.chunk_size.min(values.max(1));
        let payload = config.frames_len(chunk)?.saturating_sub(HEADER_LEN);
        if payload > limits.max_payload_len as usize {
            return Err(self.delivery(
                format!(
                    "a chunk's payload is {payload} bytes; the peer accepts at most {}",
                    limits.max_payload_len
                ),
                None,
            ));
        }
        Ok(())
    }

    /// Send one gradient; the number of chunks, once the peer has acknowledged it.
    pub async fn send_gradient(
        &mut self,
        config: &SessionConfig,
        gradient: Gradient<'_>,
        waits: Waits,
        progress: &Progress,
    ) -> Result<usize> {
        self.check_open()?;
        self.check_fits(config, gradient.len())?;
        let clock = Clock::running(waits);
        let Mode::Sealed(keys) = &self.mode else {
            let sent = send_gradient_on(config, gradient, &mut self.stream, &clock, progress).await;
            return match sent {
                Ok(n) => Ok(n),
                Err(e) => self.fail(e).await,
            };
        };
        let id = keys.id(true);
        let sealed = gradient.sealed(Seal::lone(id));
        let mut tap = Tap::new(&mut self.stream, Digest::new(&id.0));
        let sent = send_gradient_on(config, sealed, &mut tap, &clock, progress).await;
        let digest = tap.finish();
        self.acknowledged(sent, digest, &clock).await
    }

    /// Send a tensor set; the number of frames, once the peer has acknowledged it.
    pub async fn send_tensors(
        &mut self,
        config: &SessionConfig,
        wire_dtype: Option<Dtype>,
        tensors: &[(Entry, Gradient<'_>)],
        waits: Waits,
        progress: &Progress,
    ) -> Result<usize> {
        self.check_open()?;
        for (entry, _) in tensors {
            self.check_fits(config, entry.shape.iter().product())?;
        }
        let Mode::Sealed(keys) = &self.mode else {
            let sent = tensors::send_tensors(
                config,
                wire_dtype,
                tensors,
                &mut self.stream,
                waits,
                progress,
            )
            .await;
            return match sent {
                Ok(n) => Ok(n),
                Err(e) => self.fail(e).await,
            };
        };
        let clock = Clock::running(waits);
        let id = keys.id(true);
        let mut tap = Tap::new(&mut self.stream, Digest::new(&id.0));
        let sent = tensors::send_tensors_sealed(
            config, wire_dtype, tensors, id, &mut tap, waits, progress,
        )
        .await;
        let digest = tap.finish();
        self.acknowledged(sent, digest, &clock).await
    }

    /// After the frames of an outgoing transfer: the peer's ack, checked against what
    /// was sent.
    async fn acknowledged(
        &mut self,
        sent: Result<usize>,
        digest: [u8; 32],
        clock: &Clock,
    ) -> Result<usize> {
        let peer = Some(self.peer.address);
        let sent = match sent {
            Ok(n) => n,
            // A stall is the caller's to see as such; anything else (a reset, a closed
            // pipe) may be the peer refusing mid-way: its refusal may be waiting.
            Err(GradientStreamError::Io(io)) => {
                let error = match tokio::time::timeout(LINGER, self.read_ack()).await {
                    Ok(Ok(
                        ack @ Ack {
                            verdict: Verdict::Refused { .. },
                            ..
                        },
                    )) => ack.confirm(0, &digest, peer).err(),
                    _ => None,
                };
                let error = error.unwrap_or_else(|| {
                    self.delivery(
                        format!("the connection failed before the peer acknowledged it: {io}"),
                        None,
                    )
                });
                return self.fail(error).await;
            }
            Err(e) => return self.fail(e).await,
        };
        let Mode::Sealed(keys) = &self.mode else {
            return Ok(sent);
        };
        let counter = keys.sent;
        let read = within(clock, (sent, None), async { Ok(self.read_ack().await) }).await;
        let checked = match read {
            Ok(Ok(ack)) => ack.confirm(counter, &digest, peer),
            Ok(Err(e)) | Err(e) => Err(e),
        };
        match checked {
            Ok(()) => {
                if let Mode::Sealed(keys) = &mut self.mode {
                    keys.sent += 1;
                }
                Ok(sent)
            }
            Err(e) => self.fail(e).await,
        }
    }

    /// The peer's next ack.
    async fn read_ack(&mut self) -> Result<Ack> {
        let peer = Some(self.peer.address);
        let mut head = [0u8; ACK_HEAD_LEN];
        if read_full(&mut self.stream, &mut head).await?.is_err() {
            return Err(self.delivery(
                "the connection closed before the peer acknowledged it".into(),
                None,
            ));
        }
        let head = Ack::parse_head(&head, peer)?;
        let mut reason = vec![0u8; head.reason_len()];
        if read_full(&mut self.stream, &mut reason).await?.is_err() {
            return Err(self.delivery("the connection closed inside the peer's ack".into(), None));
        }
        head.finish(&reason, peer)
    }

    /// Receive one gradient through `receiver` (`config.receiver()` or `receiver_into`);
    /// `BeforeFirstByte` when the peer closed the connection before one began.
    pub async fn recv_gradient(
        &mut self,
        receiver: FrameReceiver,
        waits: Waits,
        progress: &Progress,
    ) -> Result<Ended> {
        self.check_open()?;
        let Mode::Sealed(keys) = &self.mode else {
            return match receive_gradient(receiver, &mut self.stream, waits, progress).await {
                Ok(Ended::BeforeFirstByte(receiver)) => {
                    self.state = State::Closed("the peer closed it".into());
                    Ok(Ended::BeforeFirstByte(receiver))
                }
                Ok(got) => Ok(got),
                Err(e) => self.fail(e).await,
            };
        };
        let id = keys.id(false);
        let receiver = receiver.expect_seal(SealCheck::Exact(id), Position::Lone);
        let mut tap = Tap::new(&mut self.stream, Digest::new(&id.0));
        let got = receive_gradient(receiver, &mut tap, waits, progress).await;
        let first = tap.first_header();
        let digest = tap.finish();
        match got {
            Ok(Ended::Gradient(values)) => {
                self.accept(digest).await?;
                Ok(Ended::Gradient(values))
            }
            Ok(Ended::BeforeFirstByte(receiver)) => {
                self.state = State::Closed("the peer closed it".into());
                Ok(Ended::BeforeFirstByte(receiver))
            }
            Err(e) => {
                self.refuse(message_instead(e, first, self.peer.address))
                    .await
            }
        }
    }

    /// Receive one tensor set.
    pub async fn recv_tensors(
        &mut self,
        config: &SessionConfig,
        waits: Waits,
        progress: &Progress,
    ) -> Result<Received<TensorSet>> {
        self.check_open()?;
        let Mode::Sealed(keys) = &self.mode else {
            let mut tap = Tap::new(&mut self.stream, Digest::new(&[0; 16]));
            let got = tensors::receive_tensors(config, &mut tap, waits, progress).await;
            let began = tap.first_header().is_some();
            return match got {
                Ok(_) if !began => {
                    self.state = State::Closed("the peer closed it".into());
                    Ok(Received::End)
                }
                Ok(set) => Ok(Received::Transfer(set)),
                Err(e) => self.fail(e).await,
            };
        };
        let id = keys.id(false);
        let mut tap = Tap::new(&mut self.stream, Digest::new(&id.0));
        let receiver = TensorSetReceiver::new(config).expect_seal(SealCheck::Exact(id));
        let got = tensors::receive_tensor_set(receiver, &mut tap, waits, progress).await;
        let first = tap.first_header();
        let digest = tap.finish();
        match got {
            Ok(_) if first.is_none() => {
                self.state = State::Closed("the peer closed it".into());
                Ok(Received::End)
            }
            Ok(set) => {
                self.accept(digest).await?;
                Ok(Received::Transfer(set))
            }
            Err(e) => {
                self.refuse(message_instead(e, first, self.peer.address))
                    .await
            }
        }
    }

    /// Acknowledge the transfer just received.
    async fn accept(&mut self, digest: [u8; 32]) -> Result<()> {
        let Mode::Sealed(keys) = &mut self.mode else {
            return Ok(());
        };
        let ack = Ack::accepted(keys.received, digest);
        keys.received += 1;
        let sent = async {
            self.stream.write_all(&ack.to_bytes()).await?;
            self.stream.flush().await
        };
        match sent.await {
            Ok(()) => Ok(()),
            Err(e) => self.fail(e.into()).await,
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
                // Discard what the sender still writes (for at most LINGER), so that its
                // writes end and it reads the refusal rather than a reset.
                let mut sink = vec![0u8; 64 * 1024];
                while tokio::io::AsyncReadExt::read(&mut self.stream, &mut sink).await? > 0 {}
                std::io::Result::Ok(())
            };
            let _ = tokio::time::timeout(LINGER, told).await;
        }
        self.fail(error).await
    }
}

/// A broken connection cannot carry a refusal.
fn is_io(error: &GradientStreamError) -> bool {
    matches!(
        error,
        GradientStreamError::Io(_)
            | GradientStreamError::Timeout { .. }
            | GradientStreamError::Deadline { .. }
    )
}

/// A failed first frame that was a protocol message (an ack, a hello) is a
/// ProtocolError: the peer waits for an ack while this side waits for a gradient.
fn message_instead(
    error: GradientStreamError,
    first: Option<[u8; HEADER_LEN]>,
    peer: SocketAddr,
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
                describe(&head, Kind::Hello)
            ),
            peer: Some(peer),
        },
        None => error,
    }
}
