//! The hello (docs/spec/protocol.md, step 2): the first message each way, 80 bytes, saying
//! which side sent it, whether it holds an authkey, a fresh nonce, and the limits its
//! receiver applies. Read in two steps, so that at most 80 bytes are ever read for it: the
//! first 16 (`check_start`: magic, zeros, version, length), then the whole (`parse`). A
//! client's hello of version 3 also says it opens or joins a connection of several
//! streams (`Intent`; docs/spec/protocol.md, "Several streams").
//!
//! Uses `describe`, `frame` (the limits) and ring's system RNG; used by `auth`, `ids`,
//! `streams` and the connection driver.

use crate::error::PeerAt;

use ring::rand::{SecureRandom, SystemRandom};

use super::describe::{check_start, check_zeros, protocol_error, Kind, START_LEN};
use crate::error::{GradientStreamError, Result};
use crate::frame::Limits;

/// Bytes of a version 2 hello.
pub const HELLO_LEN: usize = 80;

/// The protocol version this side speaks (docs/spec/protocol.md, versions): 2 since the
/// authkey's exchange became SPAKE2; a peer of another version is refused at its hello,
/// told which side to upgrade.
pub const VERSION: u16 = 2;

/// The version of a client's hello that opens or joins a connection of several streams
/// (`Intent`); every other hello, and every listener's, is version 2.
pub const STREAMS_VERSION: u16 = 3;

/// Where the nonce sits in a hello (the auth tags read it from the bytes).
pub(crate) const NONCE_AT: usize = 20;

/// Bytes of a session id.
pub const SESSION_ID_LEN: usize = 16;

/// The most streams one connection may have (the hello's one byte).
pub const MAX_STREAMS: u8 = 255;

/// What a client's version 3 hello asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Intent {
    /// Open a connection of `streams` streams (2 to 255, or 1 when resumable), this one
    /// the first; `resume`: the client asks that its streams may be dialled again after
    /// a failure (docs/spec/protocol.md, "Resume").
    Open { streams: u8, resume: bool },
    /// Join the session `session` as its stream `index` (1 to 254).
    Join {
        index: u8,
        session: [u8; SESSION_ID_LEN],
    },
    /// Take the place of stream `index` (0 to 254) of the session `session`, after a
    /// failure.
    Resume {
        index: u8,
        session: [u8; SESSION_ID_LEN],
    },
}

impl Intent {
    /// Bytes 18, 19 and 64..80 of the hello.
    pub(crate) fn write(self, hello: &mut [u8; HELLO_LEN]) {
        match self {
            Intent::Open { streams, resume } => {
                hello[18] = 1;
                hello[19] = streams;
                hello[64] = u8::from(resume);
            }
            Intent::Join { index, session } => {
                hello[18] = 2;
                hello[19] = index;
                hello[64..80].copy_from_slice(&session);
            }
            Intent::Resume { index, session } => {
                hello[18] = 3;
                hello[19] = index;
                hello[64..80].copy_from_slice(&session);
            }
        }
    }

    /// The intent of a version 3 hello, strictly read.
    pub(crate) fn read(hello: &[u8; HELLO_LEN], peer: Option<&PeerAt>) -> Result<Intent> {
        let mut session = [0u8; SESSION_ID_LEN];
        session.copy_from_slice(&hello[64..80]);
        match (hello[18], hello[19], hello[64]) {
            (1, streams, resume @ (0 | 1)) if streams >= 2 - resume => {
                check_zeros(hello, 65..HELLO_LEN, Kind::Hello, peer)?;
                let resume = resume == 1;
                Ok(Intent::Open { streams, resume })
            }
            (2, index, _) if (1..MAX_STREAMS).contains(&index) => {
                Ok(Intent::Join { index, session })
            }
            (3, index, _) if index < MAX_STREAMS => Ok(Intent::Resume { index, session }),
            (intent, count, flag) => Err(protocol_error(
                "a version 3 hello that opens (intent 1, 2 to 255 streams, or 1 resumable; \
                 byte 64 0 or 1), joins (intent 2, index 1 to 254) or resumes (intent 3, \
                 index 0 to 254) a connection of several streams",
                format!("intent {intent} with {count} and byte 64 {flag}"),
                peer,
            )),
        }
    }
}

/// Which end of the connection a side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The side that connected.
    Client,
    /// The side that accepted.
    Server,
}

impl Role {
    pub const fn byte(self) -> u8 {
        match self {
            Role::Client => 1,
            Role::Server => 2,
        }
    }

    /// The role of the other end.
    pub const fn peer(self) -> Role {
        match self {
            Role::Client => Role::Server,
            Role::Server => Role::Client,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Role::Client => "client",
            Role::Server => "server",
        }
    }

    fn from_byte(byte: u8) -> Option<Role> {
        match byte {
            1 => Some(Role::Client),
            2 => Some(Role::Server),
            _ => None,
        }
    }
}

/// One side's hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub role: Role,
    /// The side holds an authkey, and will send and expect an auth message.
    pub auth: bool,
    pub nonce: [u8; 32],
    /// Values the side accepts in one gradient.
    pub max_gradient_len: u64,
    /// Bytes the side accepts in one frame's payload.
    pub max_payload_len: u32,
    /// A client's several streams: opened or joined (a version 3 hello).
    pub intent: Option<Intent>,
}

impl Hello {
    /// This side's hello, with a fresh nonce from the system's random number generator
    /// (an `Io` error in the unlikely case that it fails).
    pub fn new(role: Role, auth: bool, limits: Limits) -> Result<Self> {
        let mut nonce = [0u8; 32];
        SystemRandom::new().fill(&mut nonce).map_err(|_| {
            GradientStreamError::Io(std::io::Error::other(
                "the system random number generator failed",
            ))
        })?;
        Ok(Self::with_nonce(role, auth, nonce, limits))
    }

    /// A hello with the given nonce (test vectors; a real side uses `new`).
    pub fn with_nonce(role: Role, auth: bool, nonce: [u8; 32], limits: Limits) -> Self {
        Self {
            role,
            auth,
            nonce,
            max_gradient_len: u64::try_from(limits.max_gradient_len).unwrap_or(u64::MAX),
            max_payload_len: limits.max_payload_len,
            intent: None,
        }
    }

    /// The same hello, opening or joining a connection of several streams.
    pub fn with_intent(self, intent: Option<Intent>) -> Self {
        Self { intent, ..self }
    }

    /// The limits the hello's sender applies to what it receives.
    pub fn limits(&self) -> Limits {
        Limits {
            max_payload_len: self.max_payload_len,
            max_gradient_len: usize::try_from(self.max_gradient_len).unwrap_or(usize::MAX),
        }
    }

    pub fn to_bytes(&self) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[..4].copy_from_slice(&Kind::Hello.magic());
        let version = if self.intent.is_some() {
            STREAMS_VERSION
        } else {
            VERSION
        };
        out[12..14].copy_from_slice(&version.to_le_bytes());
        out[14..16].copy_from_slice(&(HELLO_LEN as u16).to_le_bytes());
        out[16] = self.role.byte();
        out[17] = u8::from(self.auth);
        out[NONCE_AT..NONCE_AT + 32].copy_from_slice(&self.nonce);
        out[52..60].copy_from_slice(&self.max_gradient_len.to_le_bytes());
        out[60..64].copy_from_slice(&self.max_payload_len.to_le_bytes());
        if let Some(intent) = self.intent {
            intent.write(&mut out);
        }
        out
    }

    /// Check a peer's first 16 bytes before reading more: a hello's magic (else a
    /// `ProtocolError` naming what they are), its zeros, version 2 (or 3 from a client:
    /// `from`; else which side to upgrade) and length 80.
    pub fn check_start(first: &[u8; START_LEN], from: Role, peer: Option<&PeerAt>) -> Result<()> {
        check_start(first, Kind::Hello, peer)?;
        let version = u16::from_le_bytes([first[12], first[13]]);
        if version == STREAMS_VERSION && from == Role::Server {
            return Err(protocol_error(
                format!("a listener's hello of version {VERSION}"),
                format!("a hello of version {version} (only a client's opens several streams)"),
                peer,
            ));
        }
        if version != VERSION && version != STREAMS_VERSION {
            let fix = if version < VERSION {
                "an older gradstream: upgrade the peer"
            } else {
                "a newer gradstream: upgrade this side"
            };
            return Err(protocol_error(
                format!("a hello of version {VERSION}"),
                format!("a hello of version {version} ({fix})"),
                peer,
            ));
        }
        let length = u16::from_le_bytes([first[14], first[15]]);
        if usize::from(length) != HELLO_LEN {
            return Err(protocol_error(
                format!("a version {VERSION} hello of {HELLO_LEN} bytes"),
                format!("a length of {length}"),
                peer,
            ));
        }
        Ok(())
    }

    /// Read a peer's whole hello, which must come from `expected_role` (the other end's
    /// role), with auth 0 or 1 and every reserved byte zero.
    pub fn parse(
        bytes: &[u8; HELLO_LEN],
        expected_role: Role,
        peer: Option<&PeerAt>,
    ) -> Result<Hello> {
        let mut first = [0u8; START_LEN];
        first.copy_from_slice(&bytes[..START_LEN]);
        Self::check_start(&first, expected_role, peer)?;
        let role = match Role::from_byte(bytes[16]) {
            Some(role) if role == expected_role => role,
            other => {
                let name = other.map_or_else(|| format!("role {}", bytes[16]), |r| r.name().into());
                return Err(protocol_error(
                    format!("the hello of a {}", expected_role.name()),
                    format!("the hello of a {name}"),
                    peer,
                ));
            }
        };
        let auth = match bytes[17] {
            0 => false,
            1 => true,
            other => {
                return Err(protocol_error(
                    "auth 0 (none) or 1 (authkey) in the hello",
                    format!("auth {other}"),
                    peer,
                ))
            }
        };
        let intent = if u16::from_le_bytes([bytes[12], bytes[13]]) == STREAMS_VERSION {
            Some(Intent::read(bytes, peer)?)
        } else {
            check_zeros(bytes, 18..20, Kind::Hello, peer)?;
            check_zeros(bytes, 64..HELLO_LEN, Kind::Hello, peer)?;
            None
        };
        let mut nonce = [0u8; 32];
        nonce.copy_from_slice(&bytes[NONCE_AT..NONCE_AT + 32]);
        let mut gradient = [0u8; 8];
        gradient.copy_from_slice(&bytes[52..60]);
        let mut payload = [0u8; 4];
        payload.copy_from_slice(&bytes[60..64]);
        Ok(Hello {
            role,
            auth,
            nonce,
            max_gradient_len: u64::from_le_bytes(gradient),
            max_payload_len: u32::from_le_bytes(payload),
            intent,
        })
    }

    /// A sender's check, on the peer's hello, that the peer accepts a gradient of
    /// `values` values: a `DeliveryError` before a byte is sent, if not.
    pub fn check_gradient_len(&self, values: usize, peer: Option<&PeerAt>) -> Result<()> {
        if u64::try_from(values).unwrap_or(u64::MAX) > self.max_gradient_len {
            return Err(undeliverable(
                format!(
                    "the gradient holds {values} values, above the peer's max_gradient_len \
                     {}; nothing was sent",
                    self.max_gradient_len
                ),
                peer,
            ));
        }
        Ok(())
    }

    /// A sender's check, on the peer's hello, that the peer accepts chunk `chunk_index`'s
    /// `payload_len` payload bytes: a `DeliveryError` before the frame is sent, if not.
    pub fn check_payload_len(
        &self,
        chunk_index: usize,
        payload_len: usize,
        peer: Option<&PeerAt>,
    ) -> Result<()> {
        if u64::try_from(payload_len).unwrap_or(u64::MAX) > u64::from(self.max_payload_len) {
            return Err(undeliverable(
                format!(
                    "chunk {chunk_index}'s payload of {payload_len} bytes is above the peer's \
                     max_payload_len {}; use a smaller chunk_size",
                    self.max_payload_len
                ),
                peer,
            ));
        }
        Ok(())
    }
}

fn undeliverable(detail: String, peer: Option<&PeerAt>) -> GradientStreamError {
    GradientStreamError::Delivery {
        detail,
        reason: None,
        peer: peer.cloned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::testing::{client_hello, hex, server_hello, PEER};

    fn refusal(bytes: &[u8; HELLO_LEN], expected_role: Role) -> (String, String) {
        match Hello::parse(bytes, expected_role, Some(&PeerAt::Tcp(PEER))) {
            Err(GradientStreamError::Protocol {
                expected,
                seen,
                peer,
            }) => {
                assert_eq!(peer, Some(PeerAt::Tcp(PEER)));
                (expected, seen)
            }
            other => panic!("not a ProtocolError: {other:?}"),
        }
    }

    fn pair(expected: &str, seen: &str) -> (String, String) {
        (expected.to_string(), seen.to_string())
    }

    #[test]
    fn hellos_match_the_readme_vectors() {
        assert_eq!(
            hex(&client_hello().to_bytes()),
            concat!(
                "4753484c",
                "0000000000000000",
                "0200",
                "5000",
                "01",
                "01",
                "0000",
                "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
                "0000004000000000",
                "00000010",
                "00000000000000000000000000000000"
            )
        );
        assert_eq!(
            hex(&server_hello().to_bytes()),
            concat!(
                "4753484c",
                "0000000000000000",
                "0200",
                "5000",
                "02",
                "01",
                "0000",
                "202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f",
                "0000004000000000",
                "00000010",
                "00000000000000000000000000000000"
            )
        );
    }

    #[test]
    fn a_hello_reads_back_as_written() {
        let hello = client_hello();
        assert_eq!(
            Hello::parse(&hello.to_bytes(), Role::Client, None),
            Ok(hello)
        );
        assert_eq!(hello.limits(), Limits::default());
        let odd = Hello {
            auth: false,
            max_gradient_len: u64::MAX,
            max_payload_len: 7,
            ..server_hello()
        };
        assert_eq!(Hello::parse(&odd.to_bytes(), Role::Server, None), Ok(odd));
    }

    #[test]
    fn fresh_hellos_have_fresh_nonces() {
        let a = Hello::new(Role::Client, false, Limits::default()).unwrap();
        let b = Hello::new(Role::Client, false, Limits::default()).unwrap();
        assert_ne!(a.nonce, b.nonce);
        assert_ne!(a.nonce, [0; 32]);
    }

    #[test]
    fn the_same_role_is_refused() {
        // A hello reflected back to its sender, or two clients wired together.
        assert_eq!(
            refusal(&client_hello().to_bytes(), Role::Server),
            pair("the hello of a server", "the hello of a client")
        );
        assert_eq!(
            refusal(&server_hello().to_bytes(), Role::Client),
            pair("the hello of a client", "the hello of a server")
        );
        let mut bytes = client_hello().to_bytes();
        bytes[16] = 0;
        assert_eq!(
            refusal(&bytes, Role::Client),
            pair("the hello of a client", "the hello of a role 0")
        );
    }

    #[test]
    fn other_versions_lengths_and_auth_bytes_are_refused() {
        let mut bytes = client_hello().to_bytes();
        bytes[12] = 1;
        assert_eq!(
            refusal(&bytes, Role::Client),
            pair(
                "a hello of version 2",
                "a hello of version 1 (an older gradstream: upgrade the peer)"
            )
        );
        bytes[12] = 4;
        assert_eq!(
            refusal(&bytes, Role::Client),
            pair(
                "a hello of version 2",
                "a hello of version 4 (a newer gradstream: upgrade this side)"
            )
        );
        let mut bytes = client_hello().to_bytes();
        bytes[14..16].copy_from_slice(&96u16.to_le_bytes());
        assert_eq!(
            refusal(&bytes, Role::Client),
            pair("a version 2 hello of 80 bytes", "a length of 96")
        );
        let mut bytes = client_hello().to_bytes();
        bytes[17] = 2;
        assert_eq!(
            refusal(&bytes, Role::Client),
            pair("auth 0 (none) or 1 (authkey) in the hello", "auth 2")
        );
    }

    #[test]
    fn every_reserved_byte_must_be_zero() {
        for at in 4..12 {
            let mut bytes = client_hello().to_bytes();
            bytes[at] = 0x80;
            let (expected, seen) = refusal(&bytes, Role::Client);
            assert_eq!(expected, "a gradstream hello", "offset {at}");
            assert!(seen.starts_with("a hello (4753484c"), "offset {at}: {seen}");
        }
        for (range, at) in [(18..20, 19), (64..80, 70)] {
            let mut bytes = client_hello().to_bytes();
            bytes[at] = 0x80;
            let mut zeros = vec![0u8; range.len()];
            zeros[at - range.start] = 0x80;
            assert_eq!(
                refusal(&bytes, Role::Client),
                pair(
                    &format!(
                        "zero bytes at offsets {}..{} of the hello",
                        range.start,
                        range.end - 1
                    ),
                    &hex(&zeros)
                ),
                "offset {at}"
            );
        }
    }

    #[test]
    fn the_start_is_checked_from_16_bytes() {
        let bytes = client_hello().to_bytes();
        let mut first = [0u8; START_LEN];
        first.copy_from_slice(&bytes[..START_LEN]);
        assert!(Hello::check_start(&first, Role::Client, None).is_ok());
        first.copy_from_slice(b"GET / HTTP/1.1\r\n");
        assert_eq!(
            Hello::check_start(&first, Role::Client, Some(&PeerAt::Tcp(PEER))),
            Err(protocol_error(
                "a gradstream hello",
                "an HTTP request ('GET / HTTP/1.1'...)",
                Some(&PeerAt::Tcp(PEER))
            ))
        );
    }

    #[test]
    fn senders_check_the_peers_limits() {
        let hello = Hello {
            max_gradient_len: 10,
            max_payload_len: 100,
            ..server_hello()
        };
        assert!(hello.check_gradient_len(10, None).is_ok());
        assert!(hello.check_payload_len(0, 100, None).is_ok());
        assert_eq!(
            hello.check_gradient_len(11, Some(&PeerAt::Tcp(PEER))),
            Err(undeliverable(
                "the gradient holds 11 values, above the peer's max_gradient_len 10; nothing \
                 was sent"
                    .into(),
                Some(&PeerAt::Tcp(PEER))
            ))
        );
        assert_eq!(
            hello
                .check_payload_len(2, 101, None)
                .map_err(|e| e.to_string()),
            Err(
                "gradient not delivered to the peer: chunk 2's payload of 101 bytes is \
                 above the peer's max_payload_len 100; use a smaller chunk_size"
                    .into()
            )
        );
    }
}
