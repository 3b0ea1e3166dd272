//! Authentication by a shared key (docs/spec/protocol.md, step 3): each side's tag is
//! `HMAC-SHA256(authkey, label || client nonce || server nonce || SHA-256(client hello ||
//! server hello))`, the label naming the side, so that a tag cannot be reflected back to its
//! sender and a hello changed on the way changes both tags; the auth message carries it.
//! The peer's tag is checked in constant time (`ring::hmac::verify`).
//!
//! Uses `describe` and `hello` and ring's HMAC and SHA-256; used by the connection driver.

use std::net::SocketAddr;

use ring::digest::{digest, SHA256};
use ring::hmac;

use super::describe::{check_start, Kind, START_LEN};
use super::hello::{Role, HELLO_LEN, NONCE_AT};
use crate::error::{GradientStreamError, Result};

/// Bytes of an auth message.
pub const AUTH_LEN: usize = 48;

/// The label that starts the tagged bytes of a side's tag.
const fn label(role: Role) -> &'static [u8; 19] {
    match role {
        Role::Client => b"gradstream/1 client",
        Role::Server => b"gradstream/1 server",
    }
}

/// What `role`'s tag is computed over.
fn tagged(role: Role, client_hello: &[u8; HELLO_LEN], server_hello: &[u8; HELLO_LEN]) -> Vec<u8> {
    let nonce = |hello: &[u8; HELLO_LEN]| {
        let mut out = [0u8; 32];
        out.copy_from_slice(&hello[NONCE_AT..NONCE_AT + 32]);
        out
    };
    let both = [client_hello.as_slice(), server_hello.as_slice()].concat();
    [
        label(role).as_slice(),
        &nonce(client_hello),
        &nonce(server_hello),
        digest(&SHA256, &both).as_ref(),
    ]
    .concat()
}

/// `role`'s tag over both hellos, as sent.
pub fn tag(
    key: &[u8],
    role: Role,
    client_hello: &[u8; HELLO_LEN],
    server_hello: &[u8; HELLO_LEN],
) -> [u8; 32] {
    let key = hmac::Key::new(hmac::HMAC_SHA256, key);
    let mut out = [0u8; 32];
    out.copy_from_slice(hmac::sign(&key, &tagged(role, client_hello, server_hello)).as_ref());
    out
}

/// The auth message that carries `tag`.
pub fn auth_message(tag: [u8; 32]) -> [u8; AUTH_LEN] {
    let mut out = [0u8; AUTH_LEN];
    out[..4].copy_from_slice(&Kind::Auth.magic());
    out[START_LEN..].copy_from_slice(&tag);
    out
}

/// The tag a peer's auth message carries, once its magic and its 12 zero bytes are checked.
pub fn parse_auth(bytes: &[u8; AUTH_LEN], peer: Option<SocketAddr>) -> Result<[u8; 32]> {
    let mut start = [0u8; START_LEN];
    start.copy_from_slice(&bytes[..START_LEN]);
    check_start(&start, Kind::Auth, peer)?;
    let mut tag = [0u8; 32];
    tag.copy_from_slice(&bytes[START_LEN..]);
    Ok(tag)
}

/// Check, in constant time, that `peer_tag` is `role_of_peer`'s tag under `key`.
pub fn verify(
    key: &[u8],
    role_of_peer: Role,
    client_hello: &[u8; HELLO_LEN],
    server_hello: &[u8; HELLO_LEN],
    peer_tag: &[u8; 32],
    peer: Option<SocketAddr>,
) -> Result<()> {
    let key = hmac::Key::new(hmac::HMAC_SHA256, key);
    let message = tagged(role_of_peer, client_hello, server_hello);
    hmac::verify(&key, &message, peer_tag).map_err(|_| {
        authentication_error(
            "the peer's tag does not match: another authkey, or a hello changed on the way",
            peer,
        )
    })
}

/// Check that both sides agree on using an authkey: `has_key` this side's, `peer_auth`
/// the `auth` of the peer's hello.
pub fn check_modes(has_key: bool, peer_auth: bool, peer: Option<SocketAddr>) -> Result<()> {
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

/// The error of a side whose peer closed the connection where its auth message belongs
/// (it refused this side's hello, or its authkey, and said so in its own log).
pub fn closed_instead(peer: Option<SocketAddr>) -> GradientStreamError {
    authentication_error(
        "the peer closed the connection instead of authenticating: it refused this side's \
         hello or authkey",
        peer,
    )
}

fn authentication_error(detail: &str, peer: Option<SocketAddr>) -> GradientStreamError {
    GradientStreamError::Authentication {
        detail: detail.to_string(),
        peer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::describe::protocol_error;
    use crate::protocol::testing::{client_hello, hex, server_hello, AUTHKEY, PEER};

    fn hellos() -> ([u8; HELLO_LEN], [u8; HELLO_LEN]) {
        (client_hello().to_bytes(), server_hello().to_bytes())
    }

    #[test]
    fn auth_messages_match_the_readme_vectors() {
        let (c, s) = hellos();
        assert_eq!(
            hex(&auth_message(tag(AUTHKEY, Role::Client, &c, &s))),
            concat!(
                "47534155000000000000000000000000",
                "c58d31f898bb2c705e72805d419a03935dcc469545087860d5cd42ef9f90d7bb"
            )
        );
        assert_eq!(
            hex(&auth_message(tag(AUTHKEY, Role::Server, &c, &s))),
            concat!(
                "47534155000000000000000000000000",
                "b2fba0c69216c74f27ee75d0b3c4bc103b48f767406d4be0ac49510b64316f5a"
            )
        );
    }

    #[test]
    fn the_right_tag_passes() {
        let (c, s) = hellos();
        for role in [Role::Client, Role::Server] {
            let message = auth_message(tag(AUTHKEY, role, &c, &s));
            let peer_tag = parse_auth(&message, None).unwrap();
            assert_eq!(verify(AUTHKEY, role, &c, &s, &peer_tag, None), Ok(()));
        }
    }

    fn refused(result: Result<()>) {
        assert_eq!(
            result,
            Err(authentication_error(
                "the peer's tag does not match: another authkey, or a hello changed on the way",
                Some(PEER)
            ))
        );
    }

    #[test]
    fn a_wrong_key_is_refused() {
        let (c, s) = hellos();
        let theirs = tag(b"correct horse battery stapler", Role::Client, &c, &s);
        refused(verify(AUTHKEY, Role::Client, &c, &s, &theirs, Some(PEER)));
    }

    #[test]
    fn a_reflected_tag_is_refused() {
        // The server's own tag sent back to it as the client's.
        let (c, s) = hellos();
        let own = tag(AUTHKEY, Role::Server, &c, &s);
        refused(verify(AUTHKEY, Role::Client, &c, &s, &own, Some(PEER)));
    }

    #[test]
    fn a_hello_changed_on_the_way_is_refused() {
        // A man in the middle lowers the limits the client sees in the server's hello:
        // the client's tag is then over other bytes than the server's check.
        let (c, s) = hellos();
        let mut edited = s;
        edited[60] ^= 1;
        let client_tag = tag(AUTHKEY, Role::Client, &c, &edited);
        refused(verify(
            AUTHKEY,
            Role::Client,
            &c,
            &s,
            &client_tag,
            Some(PEER),
        ));
        for at in 0..HELLO_LEN {
            let mut edited = c;
            edited[at] ^= 0x40;
            assert_ne!(
                tag(AUTHKEY, Role::Client, &edited, &s),
                tag(AUTHKEY, Role::Client, &c, &s),
                "byte {at}"
            );
        }
    }

    #[test]
    fn a_cut_tag_is_refused() {
        // A tag of zeros, and one with its last byte flipped.
        let (c, s) = hellos();
        refused(verify(AUTHKEY, Role::Client, &c, &s, &[0; 32], Some(PEER)));
        let mut near = tag(AUTHKEY, Role::Client, &c, &s);
        near[31] ^= 1;
        refused(verify(AUTHKEY, Role::Client, &c, &s, &near, Some(PEER)));
    }

    #[test]
    fn malformed_auth_messages_are_protocol_errors() {
        let message = auth_message([7; 32]);
        let mut bytes = message;
        bytes[9] = 1;
        assert_eq!(
            parse_auth(&bytes, None),
            Err(protocol_error(
                "zero bytes at offsets 4..15 of an authentication message",
                "000000000001000000000000",
                None
            ))
        );
        let mut hello_instead = [0u8; AUTH_LEN];
        hello_instead.copy_from_slice(&client_hello().to_bytes()[..AUTH_LEN]);
        assert_eq!(
            parse_auth(&hello_instead, Some(PEER)),
            Err(protocol_error(
                "an authentication message",
                "a hello of version 1 (80 bytes)",
                Some(PEER)
            ))
        );
    }

    #[test]
    fn both_sides_must_agree_on_an_authkey() {
        assert_eq!(check_modes(true, true, None), Ok(()));
        assert_eq!(check_modes(false, false, None), Ok(()));
        assert_eq!(
            check_modes(true, false, None).map_err(|e| e.to_string()),
            Err(
                "authentication with the peer failed: this side requires an authkey and the \
                 peer's hello offers none"
                    .into()
            )
        );
        assert_eq!(
            check_modes(false, true, Some(PEER)).map_err(|e| e.to_string()),
            Err(
                "authentication with 127.0.0.1:7000 failed: the peer requires an authkey \
                 and this side has none (give authkey=)"
                    .into()
            )
        );
    }
}
