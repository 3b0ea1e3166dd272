//! The docs/spec/protocol.md test vectors and helpers the protocol's unit tests share (test builds
//! only). Uses `hello`; used by the tests of every protocol file.

use std::net::SocketAddr;

use super::hello::{Hello, Role};
use crate::frame::Limits;

/// The docs/spec/protocol.md client nonce, `00 01 .. 1f`.
pub(crate) const CLIENT_NONCE: [u8; 32] = nonce(0);
/// The docs/spec/protocol.md server nonce, `20 21 .. 3f`.
pub(crate) const SERVER_NONCE: [u8; 32] = nonce(32);
/// The docs/spec/protocol.md authkey.
pub(crate) const AUTHKEY: &[u8] = b"correct horse battery staple";
/// A peer address for errors to carry.
pub(crate) const PEER: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 7000);

const fn nonce(from: u8) -> [u8; 32] {
    let mut out = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        out[i] = from + i as u8;
        i += 1;
    }
    out
}

/// The docs/spec/protocol.md client hello: default limits, with an authkey.
pub(crate) fn client_hello() -> Hello {
    Hello::with_nonce(Role::Client, true, CLIENT_NONCE, Limits::default())
}

/// The docs/spec/protocol.md server hello.
pub(crate) fn server_hello() -> Hello {
    Hello::with_nonce(Role::Server, true, SERVER_NONCE, Limits::default())
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
