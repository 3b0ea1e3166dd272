//! Authentication by a shared key (docs/spec/protocol.md, step 3): a balanced PAKE,
//! SPAKE2 over Ed25519 (RustCrypto's `spake2`, the client as side A and the server as
//! side B), then a confirmation each way. Each side sends its SPAKE2 element right after
//! its hello (a key exchange message), derives the session key `K` from the peer's, and
//! sends its tag `HMAC-SHA256(K, label || SHA-256(client hello || server hello))`, the
//! label naming the side, so that a tag cannot be reflected back to its sender and a
//! hello changed on the way changes both tags; the peer's tag is checked in constant
//! time (`ring::hmac::verify`). The client sends its tag first; the server answers only
//! a tag it verified.
//!
//! Nothing a side sends is a function of the authkey alone: the element hides it under
//! a fresh scalar, and `K` needs that scalar or the peer's. So a recorded connection, or
//! one run by a fake peer, gives nothing to test a guessed key against offline; a fake
//! peer learns whether one guess, the one its element was made with, was right.
//!
//! Uses `describe` and `hello`, ring (HMAC, SHA-256/512, the system RNG), `spake2` and
//! curve25519-dalek; used by the connection driver and the bindings.

use crate::error::PeerAt;

use curve25519_dalek::edwards::CompressedEdwardsY;
use curve25519_dalek::traits::IsIdentity;
use rand_core::{CryptoRng, RngCore};
use ring::digest::{digest, Context, SHA256, SHA512};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use spake2::{Ed25519Group, Identity, Password, Spake2};

use super::describe::{
    check_start, hex, protocol_error, read_tag, tag_message, Kind, START_LEN, TAG_MESSAGE_LEN,
};
use super::hello::{Role, HELLO_LEN};
use crate::error::{GradientStreamError, Result};

/// Bytes of an auth message (a confirmation tag).
pub const AUTH_LEN: usize = TAG_MESSAGE_LEN;

/// Bytes of a key exchange message (a SPAKE2 element).
pub const PAKE_LEN: usize = 48;

/// Bytes of a SPAKE2 element (a compressed Ed25519 point).
pub const ELEMENT_LEN: usize = 32;

/// Bytes a SPAKE2 scalar is drawn from (reduced modulo the group order).
pub const SEED_LEN: usize = 64;

/// SPAKE2's identities: the two roles (the hellos are bound by the tags instead).
const ID_CLIENT: &[u8] = b"gradstream client";
const ID_SERVER: &[u8] = b"gradstream server";

/// What a test seed is hashed from, with the side's nonce.
const TEST_SEED_LABEL: &[u8] = b"gradstream/2 test scalar";

/// The label that starts the tagged bytes of a side's tag.
const fn label(role: Role) -> &'static [u8; 19] {
    match role {
        Role::Client => b"gradstream/2 client",
        Role::Server => b"gradstream/2 server",
    }
}

/// The 64 bytes a side's SPAKE2 scalar is made of: fresh from the system's RNG, or, for
/// the tests' recorded sessions only, fixed by the side's hello nonce.
#[derive(Clone)]
pub struct ScalarSeed([u8; SEED_LEN]);

impl ScalarSeed {
    /// Fresh bytes from the system's RNG (an `Io` error in the unlikely case it fails).
    pub fn fresh() -> Result<Self> {
        let mut bytes = [0u8; SEED_LEN];
        SystemRandom::new().fill(&mut bytes).map_err(|_| {
            GradientStreamError::Io(std::io::Error::other(
                "the system random number generator failed",
            ))
        })?;
        Ok(Self(bytes))
    }

    /// `SHA-512("gradstream/2 test scalar" || nonce)`: the seed of a side whose nonce a
    /// test fixed (docs/spec/protocol.md, test vectors). Never for a real connection.
    pub fn for_test(nonce: &[u8; 32]) -> Self {
        let mut hash = Context::new(&SHA512);
        hash.update(TEST_SEED_LABEL);
        hash.update(nonce);
        Self::from_bytes(hash.finish().as_ref())
    }

    /// Given bytes (the golden tests'); only the first 64 count, zeros fill a shorter one.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut out = [0u8; SEED_LEN];
        let n = bytes.len().min(SEED_LEN);
        out[..n].copy_from_slice(&bytes[..n]);
        Self(out)
    }
}

/// `spake2` draws its scalar from an RNG: it asks for 64 bytes once, and gets the seed.
struct SeedRng(ScalarSeed);

impl RngCore for SeedRng {
    fn next_u32(&mut self) -> u32 {
        let mut b = [0u8; 4];
        self.fill_bytes(&mut b);
        u32::from_le_bytes(b)
    }

    fn next_u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        self.fill_bytes(&mut b);
        u64::from_le_bytes(b)
    }

    fn fill_bytes(&mut self, dest: &mut [u8]) {
        for (at, byte) in dest.iter_mut().enumerate() {
            *byte = self.0 .0[at % SEED_LEN];
        }
    }

    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> std::result::Result<(), rand_core::Error> {
        self.fill_bytes(dest);
        Ok(())
    }
}

// The seed is from the system's CSPRNG (`ScalarSeed::fresh`) outside recorded tests.
impl CryptoRng for SeedRng {}

/// One side's SPAKE2 exchange, between sending its element and reading the peer's.
pub struct Exchange {
    state: Spake2<Ed25519Group>,
    element: [u8; ELEMENT_LEN],
}

impl Exchange {
    /// Start as `role` (the client is SPAKE2's side A) with the authkey `key`.
    pub fn start(key: &[u8], role: Role, seed: ScalarSeed) -> Self {
        let (password, client, server) = (
            Password::new(key),
            Identity::new(ID_CLIENT),
            Identity::new(ID_SERVER),
        );
        let rng = SeedRng(seed);
        let (state, message) = match role {
            Role::Client => {
                Spake2::<Ed25519Group>::start_a_with_rng(&password, &client, &server, rng)
            }
            Role::Server => {
                Spake2::<Ed25519Group>::start_b_with_rng(&password, &client, &server, rng)
            }
        };
        // `message` is a side byte ('A' or 'B') and the 32-byte element.
        let mut element = [0u8; ELEMENT_LEN];
        element.copy_from_slice(&message[1..]);
        Self { state, element }
    }

    /// This side's key exchange message.
    pub fn message(&self) -> [u8; PAKE_LEN] {
        let mut out = [0u8; PAKE_LEN];
        out[..4].copy_from_slice(&Kind::Pake.magic());
        out[START_LEN..].copy_from_slice(&self.element);
        out
    }

    /// The session's confirmation keys, from the peer's element (as `parse_pake` read
    /// it) and both hellos as sent. The peer's element must not be this side's own.
    pub fn finish(
        self,
        peer_element: &[u8; ELEMENT_LEN],
        role: Role,
        client_hello: &[u8; HELLO_LEN],
        server_hello: &[u8; HELLO_LEN],
        peer: Option<&PeerAt>,
    ) -> Result<Confirmation> {
        if peer_element == &self.element {
            return Err(authentication_error(
                "the peer's key exchange message is this side's own, sent back",
                peer,
            ));
        }
        let side = match role.peer() {
            Role::Client => b'A',
            Role::Server => b'B',
        };
        let message = [[side].as_slice(), peer_element].concat();
        // `parse_pake` has checked the element; spake2 refuses only a wrong length, side
        // or point, which it cannot see here.
        let key = self
            .state
            .finish(&message)
            .map_err(|_| bad_point(peer_element, peer))?;
        let both = [client_hello.as_slice(), server_hello.as_slice()].concat();
        let mut hellos = [0u8; 32];
        hellos.copy_from_slice(digest(&SHA256, &both).as_ref());
        Ok(Confirmation {
            key: hmac::Key::new(hmac::HMAC_SHA256, &key),
            hellos,
            spake2_key: key,
        })
    }
}

/// What a finished SPAKE2 exchange gives: the session key, as the key of both tags.
pub struct Confirmation {
    key: hmac::Key,
    hellos: [u8; 32],
    /// `K` itself, which the session secret of several streams is derived from.
    spake2_key: Vec<u8>,
}

impl Confirmation {
    /// SPAKE2's key `K` (docs/spec/protocol.md, step 3).
    pub fn spake2_key(&self) -> &[u8] {
        &self.spake2_key
    }

    fn tagged(&self, role: Role) -> Vec<u8> {
        [label(role).as_slice(), &self.hellos].concat()
    }

    /// `role`'s tag.
    pub fn tag(&self, role: Role) -> [u8; 32] {
        let mut out = [0u8; 32];
        out.copy_from_slice(hmac::sign(&self.key, &self.tagged(role)).as_ref());
        out
    }

    /// Check, in constant time, that `peer_tag` is `role_of_peer`'s tag.
    pub fn verify(
        &self,
        role_of_peer: Role,
        peer_tag: &[u8; 32],
        peer: Option<&PeerAt>,
    ) -> Result<()> {
        hmac::verify(&self.key, &self.tagged(role_of_peer), peer_tag).map_err(|_| {
            authentication_error(
                "the peer's tag does not match: another authkey, or a message changed on the \
                 way",
                peer,
            )
        })
    }
}

/// The element a peer's key exchange message carries, once its magic, its 12 zero bytes
/// and its point (a point of Ed25519's prime-order group, not the identity) are checked.
pub fn parse_pake(bytes: &[u8; PAKE_LEN], peer: Option<&PeerAt>) -> Result<[u8; ELEMENT_LEN]> {
    let mut start = [0u8; START_LEN];
    start.copy_from_slice(&bytes[..START_LEN]);
    check_start(&start, Kind::Pake, peer)?;
    let mut element = [0u8; ELEMENT_LEN];
    element.copy_from_slice(&bytes[START_LEN..]);
    match CompressedEdwardsY(element).decompress() {
        Some(point) if point.is_torsion_free() && !point.is_identity() => Ok(element),
        _ => Err(bad_point(&element, peer)),
    }
}

fn bad_point(element: &[u8; ELEMENT_LEN], peer: Option<&PeerAt>) -> GradientStreamError {
    protocol_error(
        "a point of Ed25519's prime-order group in a key exchange message",
        format!("bytes {}", hex(element)),
        peer,
    )
}

/// The auth message that carries `tag`.
pub fn auth_message(tag: [u8; 32]) -> [u8; AUTH_LEN] {
    tag_message(Kind::Auth, tag)
}

/// The tag a peer's auth message carries, once its magic and its 12 zero bytes are checked.
pub fn parse_auth(bytes: &[u8; AUTH_LEN], peer: Option<&PeerAt>) -> Result<[u8; 32]> {
    read_tag(bytes, Kind::Auth, peer)
}

/// Check that both sides agree on using an authkey: `has_key` this side's, `peer_auth`
/// the `auth` of the peer's hello.
pub fn check_modes(has_key: bool, peer_auth: bool, peer: Option<&PeerAt>) -> Result<()> {
    match (has_key, peer_auth) {
        (true, false) => Err(authentication_error(
            "this side requires an authkey and the peer's hello offers none",
            peer,
        )),
        (false, true) => Err(authentication_error(
            "the peer requires an authkey and this side has none (give authkey=)",
            peer,
        )),
        _ => Ok(()),
    }
}

/// The error of a side whose peer closed the connection where its key exchange or auth
/// message belongs (it refused this side's hello, its element, or its tag: its authkey,
/// and said so in its own log). A client whose tag the listener refused learns it so: a
/// listener answers only a tag it verified.
pub fn closed_instead(peer: Option<&PeerAt>) -> GradientStreamError {
    authentication_error(
        "the peer closed the connection instead of authenticating: it refused this side's \
         hello or authkey",
        peer,
    )
}

/// `closed_instead` for a client whose hello was version 3: a listener of gradstream
/// 0.3.0 refuses such a hello by closing too, so both causes are named.
pub fn closed_instead_of_version_3(peer: Option<&PeerAt>) -> GradientStreamError {
    authentication_error(
        "the peer closed the connection instead of authenticating: it refused this side's \
         authkey, or its hello of version 3 (sent for several streams or a resume; a \
         listener of gradstream 0.3.0 refuses it: upgrade the listener, or connect with \
         streams=1 and resume=False)",
        peer,
    )
}

fn authentication_error(detail: &str, peer: Option<&PeerAt>) -> GradientStreamError {
    GradientStreamError::Authentication {
        detail: detail.to_string(),
        peer: peer.cloned(),
    }
}

#[cfg(test)]
mod tests;
