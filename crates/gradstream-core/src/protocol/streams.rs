//! A connection of several streams (docs/spec/protocol.md, "Several streams"): the
//! client's version 3 hello says it opens one (`Intent::Open`) or joins one
//! (`Intent::Join`); the listener grants a number of streams (the streams message); each
//! joining connection proves, after its own handshake, that it belongs to the session it
//! names (the join message, both ways).
//!
//! The proof's key is the session secret of the connection that opened the session: an
//! HMAC, keyed by what only its two ends know (SPAKE2's `K` under an authkey, the TLS
//! exporter under TLS, both when both), of both hellos. Without either there is no
//! secret, and several streams are refused: the hellos' nonces are public, so a join
//! token made of them would be a bearer token anyone on the path could present. A join
//! tag covers the joining connection's own hellos (fresh nonces each side) and its own
//! TLS exporter, so it cannot be replayed onto another connection or session.
//!
//! Uses `describe` and `hello`, ring (HMAC, SHA-256); used by the connection driver.

use crate::error::PeerAt;

use ring::digest::{digest, SHA256};
use ring::hmac;

use super::describe::{
    check_start, check_zeros, protocol_error, read_tag, tag_message, Kind, START_LEN,
    TAG_MESSAGE_LEN,
};
pub use super::hello::{Intent, MAX_STREAMS, SESSION_ID_LEN};
use super::hello::{Role, HELLO_LEN};
use crate::error::{GradientStreamError, Result};

/// Bytes of a streams message (the listener's grant).
pub const STREAMS_LEN: usize = 32;

/// Bytes of a join message.
pub const JOIN_LEN: usize = TAG_MESSAGE_LEN;

/// The TLS exporter label (RFC 8446, 7.5) of a connection's binding to its TLS session.
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-gradstream-session";

/// The secret of a session: what its joins are proven with.
#[derive(Clone)]
pub struct SessionSecret {
    key: hmac::Key,
    id: [u8; SESSION_ID_LEN],
}

impl std::fmt::Debug for SessionSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionSecret({})", super::describe::hex(&self.id))
    }
}

/// SHA-256 of both hellos as sent (client's first).
pub fn hellos_hash(client: &[u8; HELLO_LEN], server: &[u8; HELLO_LEN]) -> [u8; 32] {
    let both = [client.as_slice(), server.as_slice()].concat();
    let mut out = [0u8; 32];
    out.copy_from_slice(digest(&SHA256, &both).as_ref());
    out
}

fn hmac_of(key: &hmac::Key, parts: &[&[u8]]) -> [u8; 32] {
    let mut context = hmac::Context::with_key(key);
    for part in parts {
        context.update(part);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(context.sign().as_ref());
    out
}

/// What a stream's proof is for: joining the session, or taking a failed stream's place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proof {
    Join,
    Resume,
}

/// The label of a side's join (or resume) tag.
const fn join_label(role: Role, proof: Proof) -> &'static [u8] {
    match (proof, role) {
        (Proof::Join, Role::Client) => b"gradstream/3 join client",
        (Proof::Join, Role::Server) => b"gradstream/3 join server",
        (Proof::Resume, Role::Client) => b"gradstream/3 resume client",
        (Proof::Resume, Role::Server) => b"gradstream/3 resume server",
    }
}

impl SessionSecret {
    /// `HMAC-SHA256(K || E, "gradstream/3 session" || SHA-256(client hello || server
    /// hello))`, `K` the SPAKE2 key (under an authkey), `E` the TLS exporter (under TLS);
    /// None without either.
    pub fn derive(
        spake2_key: Option<&[u8]>,
        exporter: Option<&[u8; 32]>,
        hellos: &[u8; 32],
    ) -> Option<Self> {
        if spake2_key.is_none() && exporter.is_none() {
            return None;
        }
        let material = [
            spake2_key.unwrap_or_default(),
            exporter.map_or(&[][..], |e| e.as_slice()),
        ]
        .concat();
        let secret = hmac_of(
            &hmac::Key::new(hmac::HMAC_SHA256, &material),
            &[b"gradstream/3 session", hellos],
        );
        let key = hmac::Key::new(hmac::HMAC_SHA256, &secret);
        let mut id = [0u8; SESSION_ID_LEN];
        id.copy_from_slice(&hmac_of(&key, &[b"gradstream/3 session id"])[..SESSION_ID_LEN]);
        Some(Self { key, id })
    }

    /// The session's id, which a joining hello names: `HMAC-SHA256(S, "gradstream/3
    /// session id")[0:16]`.
    pub fn id(&self) -> [u8; SESSION_ID_LEN] {
        self.id
    }

    /// What `role`'s join (or resume) tag is the HMAC of: its label, the index, the
    /// joining connection's hellos and TLS exporter.
    fn joined(
        (role, proof): (Role, Proof),
        index: u8,
        hellos: &[u8; 32],
        exporter: Option<&[u8; 32]>,
    ) -> Vec<u8> {
        [
            join_label(role, proof),
            &[index],
            hellos,
            exporter.map_or(&[][..], |e| e.as_slice()),
        ]
        .concat()
    }

    /// `role`'s tag for the joining connection of stream `index`, whose hellos hash to
    /// `hellos` and whose TLS exporter, under TLS, is `exporter`.
    pub fn join_tag(
        &self,
        role: (Role, Proof),
        index: u8,
        hellos: &[u8; 32],
        exporter: Option<&[u8; 32]>,
    ) -> [u8; 32] {
        hmac_of(&self.key, &[&Self::joined(role, index, hellos, exporter)])
    }

    /// Check, in constant time, that `tag` is `role`'s join tag.
    pub fn verify_join(
        &self,
        role: (Role, Proof),
        index: u8,
        hellos: &[u8; 32],
        exporter: Option<&[u8; 32]>,
        tag: &[u8; 32],
        peer: Option<&PeerAt>,
    ) -> Result<()> {
        let tagged = Self::joined(role, index, hellos, exporter);
        hmac::verify(&self.key, &tagged, tag).map_err(|_| GradientStreamError::Authentication {
            detail: "the join's tag does not match its session: a peer that does not hold \
                     the secret of the connection it claims to join"
                .into(),
            peer: peer.cloned(),
        })
    }
}

/// What a listener grants an opening connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// Streams (1: none beyond the first).
    pub streams: u8,
    /// Whether the client may dial its streams again after a failure (only if asked).
    pub resume: bool,
}

/// The listener's answer to an opening hello: the streams it grants, and whether it
/// takes resumes.
pub fn streams_message(grant: Grant) -> [u8; STREAMS_LEN] {
    let mut out = [0u8; STREAMS_LEN];
    out[..4].copy_from_slice(&Kind::Streams.magic());
    out[START_LEN] = grant.streams;
    out[START_LEN + 1] = u8::from(grant.resume);
    out
}

/// The grant a streams message carries: 1 to `asked` streams, and a resume only if
/// asked.
pub fn parse_streams(
    bytes: &[u8; STREAMS_LEN],
    asked: Grant,
    peer: Option<&PeerAt>,
) -> Result<Grant> {
    let mut start = [0u8; START_LEN];
    start.copy_from_slice(&bytes[..START_LEN]);
    check_start(&start, Kind::Streams, peer)?;
    check_zeros(bytes, START_LEN + 2..STREAMS_LEN, Kind::Streams, peer)?;
    let resume = match bytes[START_LEN + 1] {
        0 => false,
        1 if asked.resume => true,
        other => {
            return Err(protocol_error(
                format!(
                    "a resume byte of 0{}",
                    if asked.resume { " or 1" } else { "" }
                ),
                format!("a resume byte of {other}"),
                peer,
            ))
        }
    };
    match bytes[START_LEN] {
        streams @ 1.. if streams <= asked.streams => Ok(Grant { streams, resume }),
        other => Err(protocol_error(
            format!("a grant of 1 to {} streams", asked.streams),
            format!("a grant of {other}"),
            peer,
        )),
    }
}

/// Bytes of a resume message before its ranges.
pub const RESUME_LEN: usize = 64;

/// The most ranges of held chunks a resume message carries.
pub const MAX_HELD_RANGES: u32 = 1 << 16;

/// What a side tells its peer once its streams were replaced after a failure
/// (docs/spec/protocol.md, "Resume"): where it stands as a receiver.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResumeState {
    /// Transfers it received and whose ack it settled: the counter of the next.
    pub received: u64,
    /// The ack digest of the last of them (zeros before the first).
    pub last_digest: [u8; 32],
    /// The chunks it holds of the transfer it is receiving (transfer `received`), as
    /// increasing, disjoint, non-adjacent half-open ranges; empty when it is not
    /// receiving one.
    pub held: Vec<(u32, u32)>,
}

impl ResumeState {
    /// The message: magic, 12 zeros, `received` (u64 LE), the digest, the count of
    /// ranges (u32 LE), 4 zeros, then each range's first and end (u32 LE each).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; RESUME_LEN];
        out[..4].copy_from_slice(&Kind::Resume.magic());
        out[16..24].copy_from_slice(&self.received.to_le_bytes());
        out[24..56].copy_from_slice(&self.last_digest);
        let count = u32::try_from(self.held.len()).unwrap_or(u32::MAX);
        out[56..60].copy_from_slice(&count.to_le_bytes());
        for (first, end) in &self.held {
            out.extend_from_slice(&first.to_le_bytes());
            out.extend_from_slice(&end.to_le_bytes());
        }
        out
    }

    /// The fixed part, strictly read: the state without its ranges, and how many
    /// ranges follow (at most `MAX_HELD_RANGES`, so at most 512 KiB).
    pub fn parse_start(bytes: &[u8; RESUME_LEN], peer: Option<&PeerAt>) -> Result<(Self, u32)> {
        let mut start = [0u8; START_LEN];
        start.copy_from_slice(&bytes[..START_LEN]);
        check_start(&start, Kind::Resume, peer)?;
        check_zeros(bytes, 60..RESUME_LEN, Kind::Resume, peer)?;
        let mut received = [0u8; 8];
        received.copy_from_slice(&bytes[16..24]);
        let mut last_digest = [0u8; 32];
        last_digest.copy_from_slice(&bytes[24..56]);
        let count = u32::from_le_bytes([bytes[56], bytes[57], bytes[58], bytes[59]]);
        if count > MAX_HELD_RANGES {
            return Err(protocol_error(
                format!("a resume message of at most {MAX_HELD_RANGES} ranges"),
                format!("one of {count}"),
                peer,
            ));
        }
        let state = Self {
            received: u64::from_le_bytes(received),
            last_digest,
            held: Vec::new(),
        };
        Ok((state, count))
    }

    /// The ranges (8 bytes each), strictly read: each non-empty, each beginning past
    /// the end of the one before (increasing, disjoint, not adjacent).
    pub fn parse_ranges(&mut self, bytes: &[u8], peer: Option<&PeerAt>) -> Result<()> {
        let mut past = None::<u32>;
        for pair in bytes.chunks_exact(8) {
            let first = u32::from_le_bytes([pair[0], pair[1], pair[2], pair[3]]);
            let end = u32::from_le_bytes([pair[4], pair[5], pair[6], pair[7]]);
            if first >= end || past.is_some_and(|past| first <= past) {
                return Err(protocol_error(
                    "held chunks as increasing, disjoint, non-adjacent ranges of at least one \
                     chunk",
                    format!("a range {first}..{end} after one ending at {past:?}"),
                    peer,
                ));
            }
            past = Some(end);
            self.held.push((first, end));
        }
        Ok(())
    }

    /// Whether chunk `index` is held.
    pub fn holds(&self, index: u32) -> bool {
        let at = self.held.partition_point(|(_, end)| *end <= index);
        self.held.get(at).is_some_and(|(first, _)| *first <= index)
    }
}

/// The join message that carries `tag`.
pub fn join_message(tag: [u8; 32]) -> [u8; JOIN_LEN] {
    tag_message(Kind::Join, tag)
}

/// The tag a join message carries, once its magic and its 12 zero bytes are checked.
pub fn parse_join(bytes: &[u8; JOIN_LEN], peer: Option<&PeerAt>) -> Result<[u8; 32]> {
    read_tag(bytes, Kind::Join, peer)
}

#[cfg(test)]
mod tests;
