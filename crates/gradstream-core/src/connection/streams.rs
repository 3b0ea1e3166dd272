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
    join_message, parse_join, parse_streams, streams_message, Grant, Proof, JOIN_LEN,
    SESSION_ID_LEN, STREAMS_LEN,
};
use crate::protocol::{describe, Intent, Kind, Role, SessionSecret};

/// A joining stream, proven, on its way to the link that opened its session.
pub struct Joined {
    /// Its place among the streams (1 for the first join).
    pub index: u8,
    pub stream: Box<dyn Duplex>,
    /// Its listener connection slot (`max_connections`), held as long as the stream
    /// (None for a resumed stream: it takes the slot of the one it replaces).
    pub slot: Option<OwnedSemaphorePermit>,
    /// It takes the place of a failed stream (docs/spec/protocol.md, "Resume").
    pub resumed: bool,
}

/// What the listener knows of a session it granted several streams.
struct Opened {
    secret: SessionSecret,
    granted: u8,
    /// Indexes already joined: each joins once.
    joined: Vec<bool>,
    /// Whether the client may dial its streams again after a failure.
    resume: bool,
    /// Bounded (`owner_queue`): proven streams beyond it wait for no link, they are
    /// refused.
    to_owner: mpsc::Sender<Joined>,
    /// The connection slots (`max_connections`) held for the joins still to come: taken
    /// at the grant, so that a join proven to its client always has one.
    slots: Option<OwnedSemaphorePermit>,
}

/// A listener's open sessions, by id: an entry lives while its link waits for joins, at
/// most the listener's `handshake_timeout` from the grant (`Joining` removes it sooner),
/// or, for a resumable connection, as long as its link; so there are at most as many
/// as links.
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
    pub(crate) joins: mpsc::Receiver<Joined>,
    /// The joins that came, by index - 1.
    pub(crate) got: Vec<Option<Joined>>,
    /// When they must all have come (the listener's `handshake_timeout` after the
    /// opening connection's).
    pub(crate) until: Instant,
    /// The session resumes, its streams coming back within this window (its entry and
    /// channel then live as long as the link).
    pub(crate) resume: Option<Duration>,
    /// Resumed streams that came before every join did.
    pub(crate) resumed: Vec<Joined>,
    pub(crate) entry: SessionEntry,
}

/// A session's place in the listener's table: removed when dropped.
pub struct SessionEntry(#[allow(dead_code)] Entry);

/// Streams a session's channel holds for its link: three rounds of its streams (its
/// joins, then resumes), beyond which a proven stream is refused.
fn owner_queue(granted: u8) -> usize {
    3 * usize::from(granted)
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

/// Why a proven stream was refused: its session's channel is full.
pub const QUEUE_FULL: &str =
    "too many streams of its session wait for their connection to take them";

/// The advice when a connection that resumes has no secret to prove its streams with.
pub const RESUME_NEEDS_A_SECRET: &str =
    "resume needs an authkey or TLS (a resumed stream proves it belongs to its connection \
     with their secret; without one anyone on the path could take the connection over)";

/// The advice when a connection has no secret to prove joins with.
pub const NEEDS_A_SECRET: &str =
    "several streams need an authkey or TLS (a join proves it belongs to its connection \
     with their secret; without one anyone on the path could join)";

impl Sessions {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; SESSION_ID_LEN], Opened>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a connection open here resumes: a newcomer when every slot is taken may
    /// be one of its streams, dialled again (it takes the slot of the one it replaces).
    pub fn any_resumable(&self) -> bool {
        self.table().values().any(|opened| opened.resume)
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
    #[allow(clippy::too_many_arguments)]
    pub async fn grant<S: AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
        established: &Established,
        (max_streams, resume_window): (u8, Duration),
        connections: &Arc<Semaphore>,
        handshake_timeout: Duration,
        peer: Option<&PeerAt>,
    ) -> Result<Option<Joining>> {
        let Some(Intent::Open { streams, resume }) = established.intent else {
            return Ok(None);
        };
        let resume = resume && !resume_window.is_zero();
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
        let joining = (slots.is_some() || resume).then(|| {
            let (to_owner, joins) = mpsc::channel(owner_queue(granted));
            let id = secret.id();
            self.table().insert(
                id,
                Opened {
                    secret,
                    granted,
                    joined: vec![false; usize::from(granted)],
                    resume,
                    to_owner,
                    slots,
                },
            );
            // Joins come within the handshake_timeout or not at all: the slots held for
            // them go back then, whether or not the link ever waits for them (a peer
            // that opens and never joins holds them no longer than a handshake); the
            // entry of a connection that resumes stays for its link.
            let expiry = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(handshake_timeout).await;
                let mut table = expiry.table();
                match table.get_mut(&id) {
                    Some(opened) if opened.resume => opened.slots = None,
                    _ => drop(table.remove(&id)),
                }
            });
            Joining {
                joins,
                got: (1..granted).map(|_| None).collect(),
                until: Instant::now() + handshake_timeout,
                resume: resume.then_some(resume_window),
                resumed: Vec::new(),
                entry: SessionEntry(Entry {
                    sessions: self.clone(),
                    id,
                }),
            }
        });
        let grant = Grant {
            streams: granted,
            resume,
        };
        stream.write_all(&streams_message(grant)).await?;
        stream.flush().await?;
        Ok(joining)
    }

    /// A joining (or resuming) connection after its handshake: its proof read and
    /// checked against the session it names, the listener's proof written back; then
    /// its index, the slot held for it (none for a resumed stream), and where it goes.
    pub async fn join<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
        established: &Established,
        peer: Option<&PeerAt>,
    ) -> Result<Option<Proven>> {
        let (index, session, proof) = match established.intent {
            Some(Intent::Join { index, session }) => (index, session, Proof::Join),
            Some(Intent::Resume { index, session }) => (index, session, Proof::Resume),
            _ => return Ok(None),
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
                (Role::Client, proof),
                index,
                &established.hellos,
                established.tls_exporter.as_ref(),
                &tag,
                peer,
            )?;
            if proof == Proof::Resume {
                if !opened.resume || index >= opened.granted {
                    return Err(protocol(
                        "a resume of a stream of a session that resumes",
                        format!(
                            "a resume of stream {index} of a session granted {} streams{}",
                            opened.granted,
                            if opened.resume { "" } else { " and no resume" }
                        ),
                        peer,
                    ));
                }
                if opened.to_owner.capacity() == 0 {
                    // Its link takes none meanwhile (it is between transfers): a flood.
                    return Err(GradientStreamError::Io(std::io::Error::other(QUEUE_FULL)));
                }
                (opened.secret.clone(), None, opened.to_owner.clone())
            } else {
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
                // Held at the grant, one per index: never missing for an index taken
                // once (until the handshake_timeout, when the slots go back).
                let Some(slot) = opened.slots.as_mut().and_then(|s| s.split(1)) else {
                    return Err(GradientStreamError::Io(std::io::Error::other(
                        "no connection slot left for the join",
                    )));
                };
                (opened.secret.clone(), Some(slot), opened.to_owner.clone())
            }
        };
        prove_back(stream, &secret, (index, proof), established).await?;
        Ok(Some(Proven {
            index,
            slot,
            resumed: proof == Proof::Resume,
            to_owner,
        }))
    }
}

/// A proven join (or resume): its index, its slot, and the channel to its link.
pub struct Proven {
    pub index: u8,
    pub slot: Option<OwnedSemaphorePermit>,
    pub resumed: bool,
    pub to_owner: mpsc::Sender<Joined>,
}

/// The listener's proof, written back to a joining (or resuming) stream.
async fn prove_back<S: AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &SessionSecret,
    (index, proof): (u8, Proof),
    established: &Established,
) -> Result<()> {
    let ours = secret.join_tag(
        (Role::Server, proof),
        index,
        &established.hellos,
        established.tls_exporter.as_ref(),
    );
    stream.write_all(&join_message(ours)).await?;
    stream.flush().await?;
    Ok(())
}

/// The client's side of an opening connection after its handshake: the listener's grant.
pub async fn read_grant<S: AsyncRead + Unpin>(
    stream: &mut S,
    asked: Grant,
    peer: Option<&PeerAt>,
) -> Result<Grant> {
    let mut message = [0u8; STREAMS_LEN];
    if let Err(got) = read_full(stream, &mut message).await? {
        return Err(protocol(
            Kind::Streams.expected(),
            format!(
                "the end of the connection after {} ({got} bytes): a listener of gradstream \
                 0.3 or older refuses a hello of version 3 (several streams, a resume): \
                 upgrade it, or connect with streams=1 and resume=False",
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
    (index, proof): (u8, Proof),
    established: &Established,
    peer: Option<&PeerAt>,
) -> Result<()> {
    let exporter = established.tls_exporter.as_ref();
    let tag = secret.join_tag((Role::Client, proof), index, &established.hellos, exporter);
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
        (Role::Server, proof),
        index,
        &established.hellos,
        exporter,
        &theirs,
        peer,
    )
}
