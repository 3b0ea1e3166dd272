//! The first 16 bytes of a message: our three messages' magics and common start (magic,
//! then 8 zero bytes), and, for anything else, what it is, in the words of a
//! `ProtocolError`'s `seen` (README "Protocol", the texts listed there): an HTTP request, a
//! TLS client at a plaintext side, a bare ipfrs-transport frame header, one of our messages
//! where another belongs, or the bytes in hex.
//!
//! Uses `error` and `frame` (a frame header's fields and the default payload limit); used
//! by `hello`, `auth` and `ack`.

use std::net::SocketAddr;
use std::ops::Range;

use crate::error::{GradientStreamError, Result};
use crate::frame::{FrameHeader, DEFAULT_MAX_PAYLOAD_LEN, HEADER_LEN};

/// Bytes that tell a message from a frame header: magic, zeros, and 4 more.
pub const START_LEN: usize = 16;

/// Where the magic ends and the 8 zero bytes every message has.
const ZEROS: Range<usize> = 4..12;

/// The three messages of the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Hello,
    Auth,
    Ack,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Hello, Kind::Auth, Kind::Ack];

    pub const fn magic(self) -> [u8; 4] {
        match self {
            Kind::Hello => *b"GSHL",
            Kind::Auth => *b"GSAU",
            Kind::Ack => *b"GSAK",
        }
    }

    /// What a `ProtocolError` says was expected when something else came.
    pub const fn expected(self) -> &'static str {
        match self {
            Kind::Hello => "a gradstream hello",
            Kind::Auth => "an auth message",
            Kind::Ack => "an ack",
        }
    }

    /// What a `ProtocolError` says came when this message came where another belongs.
    const fn seen(self) -> &'static str {
        match self {
            Kind::Hello => "a gradstream hello",
            Kind::Auth => "a gradstream auth message",
            Kind::Ack => "a gradstream ack",
        }
    }

    /// How a malformed message of this kind is named: `a hello with ...`.
    pub(crate) const fn article(self) -> &'static str {
        match self {
            Kind::Hello => "a hello",
            Kind::Auth => "an auth message",
            Kind::Ack => "an ack",
        }
    }

    fn of(bytes: &[u8]) -> Option<Kind> {
        let magic = bytes.get(..4)?;
        Kind::ALL.into_iter().find(|kind| kind.magic() == magic)
    }
}

/// HTTP methods whose requests are named as such (`PRI` begins an HTTP/2 preface).
const HTTP_METHODS: [&str; 10] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "PRI",
];

/// What `bytes` (the first up to 16 a peer sent where a `kind` message belongs) are.
/// Fewer than 16 bytes are described as far as they go (a peer that closed early).
pub fn describe(bytes: &[u8], kind: Kind) -> String {
    let bytes = &bytes[..bytes.len().min(START_LEN)];
    if let Some(theirs) = Kind::of(bytes) {
        return theirs.seen().to_string();
    }
    if let Some(line) = http_request_line(bytes) {
        return format!("an HTTP request ({line})");
    }
    if let Some(text) = tls_record(bytes) {
        return text.to_string();
    }
    if let Some(header) = frame_header(bytes) {
        let fields = format!(
            "chunk {} of {}, {}-byte payload",
            header.chunk_index, header.total_chunks, header.payload_len
        );
        return match kind {
            Kind::Hello => format!(
                "an ipfrs-transport frame header ({fields}): use protocol=\"seed\" for the \
                 original crate"
            ),
            Kind::Auth | Kind::Ack => format!("a frame header ({fields})"),
        };
    }
    if bytes.is_empty() {
        return "no bytes".to_string();
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("the bytes {hex}")
}

/// An HTTP request line's start, quoted: up to the line's end, `...` after it when the
/// line goes on past the bytes given; `"` and `\` escaped, bytes outside printable ASCII
/// as `\xNN`.
fn http_request_line(bytes: &[u8]) -> Option<String> {
    let is_request = HTTP_METHODS.iter().any(|m| {
        bytes.len() > m.len() && bytes.starts_with(m.as_bytes()) && bytes[m.len()] == b' '
    });
    if !is_request {
        return None;
    }
    let end = bytes.iter().position(|&b| b == b'\r' || b == b'\n');
    let line = &bytes[..end.unwrap_or(bytes.len())];
    let mut quoted = String::from("\"");
    for &b in line {
        match b {
            b'"' => quoted.push_str("\\\""),
            b'\\' => quoted.push_str("\\\\"),
            0x20..=0x7e => quoted.push(char::from(b)),
            _ => quoted.push_str(&format!("\\x{b:02x}")),
        }
    }
    if end.is_none() {
        quoted.push_str("...");
    }
    quoted.push('"');
    Some(quoted)
}

/// A TLS record's start (content type, then version 3.x): a ClientHello, or any other.
fn tls_record(bytes: &[u8]) -> Option<&'static str> {
    match bytes {
        [0x16, 0x03, 0..=4, _, _, 0x01, ..] => {
            Some("a TLS ClientHello (a TLS client at a plaintext listener)")
        }
        [0x14..=0x17, 0x03, 0..=4, ..] => Some("a TLS record (a TLS peer at a plaintext side)"),
        _ => None,
    }
}

/// The bytes as a frame header, when they read as one a sender could write: an index
/// below the total and a payload no larger than the default limit. (A random start passes
/// one time in 32; every message of ours and every start above is tried first.)
fn frame_header(bytes: &[u8]) -> Option<FrameHeader> {
    let mut full = [0u8; HEADER_LEN];
    // Without the checksum the three fields that matter are still there.
    let given = bytes.get(..12)?;
    full[..12].copy_from_slice(given);
    let header = FrameHeader::from_bytes(&full);
    let plausible =
        header.chunk_index < header.total_chunks && header.payload_len <= DEFAULT_MAX_PAYLOAD_LEN;
    plausible.then_some(header)
}

/// A `ProtocolError`.
pub(crate) fn protocol_error(
    expected: impl Into<String>,
    seen: impl Into<String>,
    peer: Option<SocketAddr>,
) -> GradientStreamError {
    GradientStreamError::Protocol {
        expected: expected.into(),
        seen: seen.into(),
        peer,
    }
}

/// Check a `kind` message's start: its magic (else what the bytes are instead), then its
/// 8 zero bytes.
pub(crate) fn check_start(
    start: &[u8; START_LEN],
    kind: Kind,
    peer: Option<SocketAddr>,
) -> Result<()> {
    if start[..4] != kind.magic() {
        return Err(protocol_error(kind.expected(), describe(start, kind), peer));
    }
    check_zeros(start, ZEROS, kind, peer)
}

/// Refuse a `kind` message with a nonzero byte at any of the reserved `offsets`, naming
/// the first one.
pub(crate) fn check_zeros(
    message: &[u8],
    offsets: impl IntoIterator<Item = usize>,
    kind: Kind,
    peer: Option<SocketAddr>,
) -> Result<()> {
    let offset = offsets
        .into_iter()
        .find(|&i| message.get(i).is_some_and(|&b| b != 0));
    match offset {
        None => Ok(()),
        Some(at) => Err(protocol_error(
            kind.expected(),
            format!(
                "{} with a nonzero reserved byte at offset {at}",
                kind.article()
            ),
            peer,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(text: &[u8]) -> [u8; START_LEN] {
        let mut out = [0u8; START_LEN];
        out[..text.len()].copy_from_slice(text);
        out
    }

    #[test]
    fn http_requests_are_quoted_up_to_their_line_end() {
        assert_eq!(
            describe(b"GET / HTTP/1.1\r\n", Kind::Hello),
            "an HTTP request (\"GET / HTTP/1.1\")"
        );
        assert_eq!(
            describe(b"POST /api/v1/upload HTTP/1.1", Kind::Hello),
            "an HTTP request (\"POST /api/v1/upl...\")"
        );
        assert_eq!(
            describe(b"PUT /\"a\\\x01\x7f\n", Kind::Ack),
            "an HTTP request (\"PUT /\\\"a\\\\\\x01\\x7f\")"
        );
        // A method needs its space: "GETS" is no request.
        assert_eq!(describe(b"GETS", Kind::Hello), "the bytes 47455453");
        assert_eq!(
            describe(b"PRI * HTTP/2.0\r\n", Kind::Hello),
            "an HTTP request (\"PRI * HTTP/2.0\")"
        );
    }

    #[test]
    fn tls_clients_and_records_are_named() {
        let client_hello = [
            0x16, 0x03, 0x01, 0x01, 0x2c, 0x01, 0x00, 0x01, 0x28, 0x03, 0x03, 1, 2, 3, 4, 5,
        ];
        assert_eq!(
            describe(&client_hello, Kind::Hello),
            "a TLS ClientHello (a TLS client at a plaintext listener)"
        );
        assert_eq!(
            describe(&[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32], Kind::Hello),
            "a TLS record (a TLS peer at a plaintext side)"
        );
    }

    #[test]
    fn frame_headers_point_at_the_seed_protocol_where_a_hello_belongs() {
        let header = FrameHeader {
            chunk_index: 0,
            total_chunks: 3,
            payload_len: 4104,
            checksum: 0xdead_beef,
        }
        .to_bytes();
        assert_eq!(
            describe(&header, Kind::Hello),
            "an ipfrs-transport frame header (chunk 0 of 3, 4104-byte payload): use \
             protocol=\"seed\" for the original crate"
        );
        assert_eq!(
            describe(&header, Kind::Ack),
            "a frame header (chunk 0 of 3, 4104-byte payload)"
        );
        assert_eq!(
            describe(&header[..12], Kind::Auth),
            "a frame header (chunk 0 of 3, 4104-byte payload)"
        );
        // An index at or past the total, or a payload over 256 MiB, is no header.
        let past = FrameHeader {
            chunk_index: 3,
            total_chunks: 3,
            payload_len: 4104,
            checksum: 0,
        }
        .to_bytes();
        assert!(describe(&past, Kind::Hello).starts_with("the bytes 03000000"));
        let huge = FrameHeader {
            chunk_index: 0,
            total_chunks: 3,
            payload_len: DEFAULT_MAX_PAYLOAD_LEN + 1,
            checksum: 0,
        }
        .to_bytes();
        assert!(describe(&huge, Kind::Hello).starts_with("the bytes "));
    }

    #[test]
    fn our_own_messages_are_named_by_their_magic() {
        assert_eq!(
            describe(&start(b"GSAU"), Kind::Hello),
            "a gradstream auth message"
        );
        assert_eq!(describe(&start(b"GSAK"), Kind::Hello), "a gradstream ack");
        assert_eq!(describe(b"GSHL", Kind::Ack), "a gradstream hello");
    }

    #[test]
    fn anything_else_is_its_bytes_in_hex() {
        assert_eq!(
            describe(b"Lorem ipsum dolor sit", Kind::Hello),
            "the bytes 4c6f72656d20697073756d20646f6c6f"
        );
        assert_eq!(describe(&[0xff], Kind::Hello), "the bytes ff");
        assert_eq!(describe(&[], Kind::Hello), "no bytes");
        assert_eq!(
            describe(&[0; 16], Kind::Hello),
            format!("the bytes {}", "0".repeat(32))
        );
    }

    #[test]
    fn every_start_of_up_to_16_bytes_is_described_without_panic() {
        // A cheap sweep of hostile starts: every length, every value of the first byte.
        for len in 0..=START_LEN {
            for first in 0..=255u8 {
                let mut bytes = [0x03u8; START_LEN];
                bytes[0] = first;
                for kind in Kind::ALL {
                    assert!(!describe(&bytes[..len], kind).is_empty());
                }
            }
        }
    }

    #[test]
    fn the_start_check_names_the_first_nonzero_reserved_byte() {
        let mut bytes = start(b"GSAK");
        assert!(check_start(&bytes, Kind::Ack, None).is_ok());
        bytes[9] = 1;
        bytes[11] = 1;
        assert_eq!(
            check_start(&bytes, Kind::Ack, None),
            Err(protocol_error(
                "an ack",
                "an ack with a nonzero reserved byte at offset 9",
                None
            ))
        );
        assert_eq!(
            check_start(&bytes, Kind::Hello, None),
            Err(protocol_error(
                "a gradstream hello",
                "a gradstream ack",
                None
            ))
        );
    }
}
