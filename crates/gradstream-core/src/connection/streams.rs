//! A connection of several streams (docs/spec/protocol.md, "Several streams"), the steps
//! after the handshake: the listener's grant on the opening connection, each joining
//! connection's proof both ways, and the listener's table of open sessions, which hands
//! each proven join to the link that opened its session (a join never becomes a
//! connection of its own).
//!
//! Uses `handshake` (`Established`), `protocol::streams`; used by `dial` and `listener`.

use crate::error::PeerAt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::handshake::{read_full, Established};
use super::Duplex;
use crate::error::{GradientStreamError, Result};
use crate::protocol::streams::{
    join_message, parse_join, parse_streams, streams_message, JOIN_LEN, SESSION_ID_LEN, STREAMS_LEN,
};
use crate::protocol::{describe, Intent, Kind, Role, SessionSecret};

/// A joining stream, proven, on its way to the link that opened its session.
pub struct Joined {
    /// Its place among the streams (1 for the first join).
    pub index: u8,
    pub stream: Box<dyn Duplex>,
    /// Its listener connection slot (`max_connections`), held as long as the stream.
    pub slot: Option<OwnedSemaphorePermit>,
}

/// What the listener knows of a session it granted several streams.
struct Opened {
    secret: SessionSecret,
    granted: u8,
    /// Indexes already joined: each joins once.
    joined: Vec<bool>,
    to_owner: mpsc::UnboundedSender<Joined>,
    /// The connection slots (`max_connections`) held for the joins still to come: taken
    /// at the grant, so that a join proven to its client always has one.
    slots: Option<OwnedSemaphorePermit>,
}

/// A listener's open sessions, by id: an entry lives while its link waits for joins, at
/// most the listener's `handshake_timeout` from the grant (`Joining` removes it sooner),
/// so there are at most as many as links.
#[derive(Clone, Default)]
pub struct Sessions(Arc<Mutex<HashMap<[u8; SESSION_ID_LEN], Opened>>>);

/// Removes its session from the table when dropped: once every join came, or the link
/// that waits for them went (the slots held for the rest are given back).
struct Entry {
    sessions: Sessions,
    id: [u8; SESSION_ID_LEN],
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.sessions.table().remove(&self.id);
    }
}

/// Where a link that opened a session waits for its joins: what came so far stays
/// here, so that a wait given up (a cancelled transfer) loses none.
pub struct Joining {
    pub(crate) joins: mpsc::UnboundedReceiver<Joined>,
    /// The joins that came, by index - 1.
    pub(crate) got: Vec<Option<Joined>>,
    /// When they must all have come (the listener's `handshake_timeout` after the
    /// opening connection's).
    pub(crate) until: Instant,
    _entry: Entry,
}

impl Joining {
    /// Joins still to come.
    pub(crate) fn missing(&self) -> usize {
        self.got.iter().filter(|j| j.is_none()).count()
    }
}

/// The error of a step of several streams that went wrong.
fn protocol(expected: &str, seen: String, peer: Option<&PeerAt>) -> GradientStreamError {
    GradientStreamError::Protocol {
        expected: expected.into(),
        seen,
        peer: peer.cloned(),
    }
}

/// The advice when a connection has no secret to prove joins with.
pub const NEEDS_A_SECRET: &str =
    "several streams need an authkey or TLS (a join proves it belongs to its connection \
     with their secret; without one anyone on the path could join)";

impl Sessions {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; SESSION_ID_LEN], Opened>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Connection slots held for joins still to come.
    pub fn held(&self) -> usize {
        self.table()
            .values()
            .filter_map(|opened| opened.slots.as_ref())
            .map(OwnedSemaphorePermit::num_permits)
            .sum()
    }

    /// The listener's answer to an opening connection (its hello's `Open`): grant up to
    /// `max_streams`, and no more than `connections` has free slots for (one left for
    /// the opening connection), held now; write the grant; and, when more than one, the
    /// session its joins will be routed to.
    pub async fn grant<S: AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
        established: &Established,
        max_streams: u8,
        connections: &Arc<Semaphore>,
        handshake_timeout: Duration,
        peer: Option<&PeerAt>,
    ) -> Result<Option<Joining>> {
        let Some(Intent::Open { streams }) = established.intent else {
            return Ok(None);
        };
        let Some(secret) = established.secret.clone() else {
            return Err(protocol(
                "no opening of several streams on a connection without an authkey or TLS",
                format!("a hello opening {streams} streams ({NEEDS_A_SECRET})"),
                peer,
            ));
        };
        let room = connections.available_permits().saturating_sub(1);
        let wanted = streams.min(max_streams).max(1);
        let mut granted = wanted.min(u8::try_from(room.saturating_add(1)).unwrap_or(u8::MAX));
        let slots = match granted {
            1 => None,
            _ => connections
                .clone()
                .try_acquire_many_owned(u32::from(granted - 1))
                .ok(),
        };
        if slots.is_none() {
            granted = 1; // the slots went meanwhile: one stream
        }
        let joining = slots.map(|slots| {
            let (to_owner, joins) = mpsc::unbounded_channel();
            let id = secret.id();
            self.table().insert(
                id,
                Opened {
                    secret,
                    granted,
                    joined: vec![false; usize::from(granted)],
                    to_owner,
                    slots: Some(slots),
                },
            );
            // Joins come within the handshake_timeout or not at all: the slots held for
            // them go back then, whether or not the link ever waits for them (a peer
            // that opens and never joins holds them no longer than a handshake).
            let expiry = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(handshake_timeout).await;
                expiry.table().remove(&id);
            });
            Joining {
                joins,
                got: (1..granted).map(|_| None).collect(),
                until: Instant::now() + handshake_timeout,
                _entry: Entry {
                    sessions: self.clone(),
                    id,
                },
            }
        });
        stream.write_all(&streams_message(granted)).await?;
        stream.flush().await?;
        Ok(joining)
    }

    /// A joining connection after its handshake: its proof read and checked against the
    /// session it names, the listener's proof written back; then its index, the slot
    /// held for it, and where it goes.
    #[allow(clippy::type_complexity)]
    pub async fn join<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
        established: &Established,
        peer: Option<&PeerAt>,
    ) -> Result<Option<(u8, OwnedSemaphorePermit, mpsc::UnboundedSender<Joined>)>> {
        let Some(Intent::Join { index, session }) = established.intent else {
            return Ok(None);
        };
        let mut message = [0u8; JOIN_LEN];
        if let Err(got) = read_full(stream, &mut message).await? {
            return Err(protocol(
                Kind::Join.expected(),
                format!("the end of the connection after {got} bytes"),
                peer,
            ));
        }
        let tag = parse_join(&message, peer)?;
        let (secret, slot, to_owner) = {
            let mut table = self.table();
            let Some(opened) = table.get_mut(&session) else {
                return Err(GradientStreamError::Authentication {
                    detail: "the join names no session open at this listener (never opened, \
                             or its connection has closed)"
                        .into(),
                    peer: peer.cloned(),
                });
            };
            opened.secret.verify_join(
                Role::Client,
                index,
                &established.hellos,
                established.tls_exporter.as_ref(),
                &tag,
                peer,
            )?;
            match opened.joined.get_mut(usize::from(index)) {
                Some(taken @ false) => *taken = true,
                _ => {
                    return Err(protocol(
                        "a join of a stream the session was granted and has not joined yet",
                        format!(
                            "a join as stream {index} of a session granted {} streams",
                            opened.granted
                        ),
                        peer,
                    ))
                }
            }
            // Held at the grant, one per index: never missing for an index taken once.
            let Some(slot) = opened.slots.as_mut().and_then(|s| s.split(1)) else {
                return Err(GradientStreamError::Io(std::io::Error::other(
                    "no connection slot left for the join",
                )));
            };
            (opened.secret.clone(), slot, opened.to_owner.clone())
        };
        let ours = secret.join_tag(
            Role::Server,
            index,
            &established.hellos,
            established.tls_exporter.as_ref(),
        );
        stream.write_all(&join_message(ours)).await?;
        stream.flush().await?;
        Ok(Some((index, slot, to_owner)))
    }
}

/// The client's side of an opening connection after its handshake: the listener's grant.
pub async fn read_grant<S: AsyncRead + Unpin>(
    stream: &mut S,
    asked: u8,
    peer: Option<&PeerAt>,
) -> Result<u8> {
    let mut message = [0u8; STREAMS_LEN];
    if let Err(got) = read_full(stream, &mut message).await? {
        return Err(protocol(
            Kind::Streams.expected(),
            format!(
                "the end of the connection after {} ({got} bytes): a listener of gradstream \
                 0.3 or older takes one stream only (upgrade it, or connect with streams=1)",
                describe(&message[..got])
            ),
            peer,
        ));
    }
    parse_streams(&message, asked, peer)
}

/// The client's side of a joining connection after its handshake: its proof written,
/// the listener's read and checked.
pub async fn prove_join<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &SessionSecret,
    index: u8,
    established: &Established,
    peer: Option<&PeerAt>,
) -> Result<()> {
    let exporter = established.tls_exporter.as_ref();
    let tag = secret.join_tag(Role::Client, index, &established.hellos, exporter);
    stream.write_all(&join_message(tag)).await?;
    stream.flush().await?;
    let mut message = [0u8; JOIN_LEN];
    if read_full(stream, &mut message).await?.is_err() {
        return Err(GradientStreamError::Authentication {
            detail: "the listener closed the joining stream instead of proving it: it \
                     refused the join (its log says why)"
                .into(),
            peer: peer.cloned(),
        });
    }
    let theirs = parse_join(&message, peer)?;
    secret.verify_join(
        Role::Server,
        index,
        &established.hellos,
        exporter,
        &theirs,
        peer,
    )
}
