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

/// The label of a side's join tag.
const fn join_label(role: Role) -> &'static [u8; 24] {
    match role {
        Role::Client => b"gradstream/3 join client",
        Role::Server => b"gradstream/3 join server",
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

    /// What `role`'s join tag is the HMAC of: its label, the index, the joining
    /// connection's hellos and TLS exporter.
    fn joined(role: Role, index: u8, hellos: &[u8; 32], exporter: Option<&[u8; 32]>) -> Vec<u8> {
        [
            join_label(role).as_slice(),
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
        role: Role,
        index: u8,
        hellos: &[u8; 32],
        exporter: Option<&[u8; 32]>,
    ) -> [u8; 32] {
        hmac_of(&self.key, &[&Self::joined(role, index, hellos, exporter)])
    }

    /// Check, in constant time, that `tag` is `role`'s join tag.
    pub fn verify_join(
        &self,
        role: Role,
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

/// The listener's answer to an opening hello: how many streams it grants (1: none
/// beyond the first).
pub fn streams_message(granted: u8) -> [u8; STREAMS_LEN] {
    let mut out = [0u8; STREAMS_LEN];
    out[..4].copy_from_slice(&Kind::Streams.magic());
    out[START_LEN] = granted;
    out
}

/// The grant a streams message carries: 1 to `asked` streams.
pub fn parse_streams(bytes: &[u8; STREAMS_LEN], asked: u8, peer: Option<&PeerAt>) -> Result<u8> {
    let mut start = [0u8; START_LEN];
    start.copy_from_slice(&bytes[..START_LEN]);
    check_start(&start, Kind::Streams, peer)?;
    check_zeros(bytes, START_LEN + 1..STREAMS_LEN, Kind::Streams, peer)?;
    match bytes[START_LEN] {
        granted @ 1.. if granted <= asked => Ok(granted),
        other => Err(protocol_error(
            format!("a grant of 1 to {asked} streams"),
            format!("a grant of {other}"),
            peer,
        )),
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
