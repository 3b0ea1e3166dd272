//! The first 16 bytes of a message: our four messages' magics and common start (magic,
//! then 8 zero bytes), and, for anything else, what it is, in the words of a
//! `ProtocolError`'s `seen` (docs/spec/protocol.md, the texts listed there, the same as the
//! reference's `_protocol.describe`): the end of the connection, an HTTP request, a TLS
//! client or alert at a plaintext side, one of our messages where another belongs, a bare
//! ipfrs-transport frame header, or the bytes in hex.
//!
//! Uses `error` and `frame` (a frame header's fields); used by `hello`, `auth`, `ack` and
//! the connection driver.

use crate::error::PeerAt;
use std::ops::Range;

use crate::error::{GradientStreamError, Result};
use crate::frame::{FrameHeader, HEADER_LEN};

/// Bytes that tell a message from a frame header: magic, zeros, and 4 more.
pub const START_LEN: usize = 16;

/// Where the magic ends and the 8 zero bytes every message has.
const ZEROS: Range<usize> = 4..12;

/// The most `total_chunks` a frame header is taken to have (2^24 chunks of the default
/// 65,536 values: 2^40 values); more, and the bytes are named as hex.
const FRAME_TOTAL_PLAUSIBLE: u32 = 1 << 24;

/// The four messages of the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Hello,
    /// The authkey's SPAKE2 element (docs/spec/protocol.md, step 3).
    Pake,
    /// The authkey's confirmation tag.
    Auth,
    Ack,
    /// A listener's grant of several streams (docs/spec/protocol.md, "Several streams").
    Streams,
    /// A joining (or resuming) stream's proof.
    Join,
    /// What a side holds when its streams were replaced after a failure.
    Resume,
}

impl Kind {
    const ALL: [Kind; 7] = [
        Kind::Hello,
        Kind::Pake,
        Kind::Auth,
        Kind::Ack,
        Kind::Streams,
        Kind::Join,
        Kind::Resume,
    ];

    pub const fn magic(self) -> [u8; 4] {
        match self {
            Kind::Hello => *b"GSHL",
            Kind::Pake => *b"GSPK",
            Kind::Auth => *b"GSAU",
            Kind::Ack => *b"GSAK",
            Kind::Streams => *b"GSST",
            Kind::Join => *b"GSJN",
            Kind::Resume => *b"GSRS",
        }
    }

    /// What a `ProtocolError` says was expected when something else came.
    pub const fn expected(self) -> &'static str {
        match self {
            Kind::Hello => "a gradstream hello",
            Kind::Pake => "a key exchange message",
            Kind::Auth => "an authentication message",
            Kind::Ack => "an ack",
            Kind::Streams => "a streams message",
            Kind::Join => "a join message",
            Kind::Resume => "a resume message",
        }
    }

    /// The message named in a text: `a hello (...)`, `zero bytes at ... of an ack`.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Kind::Hello => "a hello",
            Kind::Pake => "a key exchange message",
            Kind::Auth => "an authentication message",
            Kind::Ack => "an ack",
            Kind::Streams => "a streams message",
            Kind::Join => "a join message",
            Kind::Resume => "a resume message",
        }
    }

    /// How the zero-bytes text names the message.
    const fn within(self) -> &'static str {
        match self {
            Kind::Hello => "the hello",
            Kind::Pake | Kind::Auth | Kind::Ack | Kind::Streams | Kind::Join | Kind::Resume => {
                self.name()
            }
        }
    }

    fn of(bytes: &[u8]) -> Option<Kind> {
        let magic = bytes.get(..4)?;
        Kind::ALL.into_iter().find(|kind| kind.magic() == magic)
    }
}

/// Request starts named as HTTP (`PRI * HTTP/2` begins an HTTP/2 preface).
const HTTP_STARTS: [&str; 10] = [
    "GET ",
    "HEAD ",
    "POST ",
    "PUT ",
    "DELETE ",
    "OPTIONS ",
    "PATCH ",
    "CONNECT ",
    "TRACE ",
    "PRI * HTTP/2",
];

/// What an HTTP server or proxy answers with (`HTTP/1.1 400 Bad Request`).
const HTTP_ANSWER: &[u8] = b"HTTP/";

/// An error page sent without a status line: what Python's `http.server` answers a
/// request line it reads as HTTP/0.9 (a hello's random bytes may hold a newline).
const HTML_PAGE: &[u8] = b"<!doctype html";

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What `bytes` (the first up to 16 a peer sent where a message belongs) are.
pub fn describe(bytes: &[u8]) -> String {
    let bytes = &bytes[..bytes.len().min(START_LEN)];
    if bytes.is_empty() {
        return "the end of the connection".to_string();
    }
    if bytes.len() < START_LEN {
        return format!(
            "the end of the connection after {} bytes ({})",
            bytes.len(),
            hex(bytes)
        );
    }
    if HTTP_STARTS.iter().any(|s| bytes.starts_with(s.as_bytes())) {
        return format!("an HTTP request ({}...)", request_line(bytes));
    }
    if bytes.starts_with(HTTP_ANSWER) {
        return format!(
            "an HTTP answer ({}...): the peer is an HTTP server or proxy, not a gradstream \
             peer",
            request_line(bytes)
        );
    }
    if bytes[..HTML_PAGE.len()].eq_ignore_ascii_case(HTML_PAGE) {
        return "an HTML page (an HTTP/0.9 answer): the peer is an HTTP server, not a \
                gradstream peer"
            .to_string();
    }
    if bytes[0] == 0x16 && bytes[1] == 0x03 && bytes[5] == 0x01 {
        return "a TLS ClientHello (a TLS client at a plaintext listener: give both sides tls=)"
            .to_string();
    }
    if bytes[0] == 0x15 && bytes[1] == 0x03 {
        return "a TLS alert (the peer speaks TLS: give both sides tls=)".to_string();
    }
    if let Some(kind) = Kind::of(bytes) {
        if kind == Kind::Hello && bytes[ZEROS].iter().all(|&b| b == 0) {
            let version = u16::from_le_bytes([bytes[12], bytes[13]]);
            let length = u16::from_le_bytes([bytes[14], bytes[15]]);
            return format!("a hello of version {version} ({length} bytes)");
        }
        return format!("{} ({})", kind.name(), hex(bytes));
    }
    if let Some(fields) = frame_text(bytes) {
        return format!(
            "a bare seed frame header ({fields}): an ipfrs-transport peer, or one with \
             protocol='seed'"
        );
    }
    format!("bytes {}", hex(bytes))
}

/// An HTTP request line's start, quoted: the bytes up to the first CR or LF, `\` and `'`
/// escaped by a backslash, bytes outside printable ASCII as `\xNN`, in single quotes.
fn request_line(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == b'\r' || b == b'\n');
    let mut quoted = String::from("'");
    for &b in &bytes[..end.unwrap_or(bytes.len())] {
        match b {
            b'\'' | b'\\' => {
                quoted.push('\\');
                quoted.push(char::from(b));
            }
            0x20..=0x7e => quoted.push(char::from(b)),
            _ => quoted.push_str(&format!("\\x{b:02x}")),
        }
    }
    quoted.push('\'');
    quoted
}

/// The fields of 16 bytes read as a frame header, when they look like one a sender could
/// write (`chunk_index < total_chunks <= 2^24`).
pub(crate) fn frame_text(bytes: &[u8]) -> Option<String> {
    let header: &[u8; HEADER_LEN] = bytes.get(..HEADER_LEN)?.try_into().ok()?;
    let header = FrameHeader::from_bytes(header);
    let plausible = (1..=FRAME_TOTAL_PLAUSIBLE).contains(&header.total_chunks)
        && header.chunk_index < header.total_chunks;
    plausible.then(|| {
        format!(
            "chunk {} of {}, payload_len {}, checksum {:#010x}",
            header.chunk_index, header.total_chunks, header.payload_len, header.checksum
        )
    })
}

/// A `ProtocolError`.
pub(crate) fn protocol_error(
    expected: impl Into<String>,
    seen: impl Into<String>,
    peer: Option<&PeerAt>,
) -> GradientStreamError {
    GradientStreamError::Protocol {
        expected: expected.into(),
        seen: seen.into(),
        peer: peer.cloned(),
    }
}

/// Check a `kind` message's start: its magic and, for a hello or an ack, the 8 zero bytes
/// after it (else what the bytes are instead); a key exchange or auth message's 12 zero
/// bytes.
pub(crate) fn check_start(
    start: &[u8; START_LEN],
    kind: Kind,
    peer: Option<&PeerAt>,
) -> Result<()> {
    if start[..4] != kind.magic() {
        return Err(protocol_error(kind.expected(), describe(start), peer));
    }
    match kind {
        Kind::Pake | Kind::Auth | Kind::Streams | Kind::Join | Kind::Resume => {
            check_zeros(start, 4..START_LEN, kind, peer)
        }
        Kind::Hello | Kind::Ack if start[ZEROS].iter().any(|&b| b != 0) => {
            Err(protocol_error(kind.expected(), describe(start), peer))
        }
        Kind::Hello | Kind::Ack => Ok(()),
    }
}

/// Refuse a `kind` message with a nonzero byte in the reserved `range`.
pub(crate) fn check_zeros(
    message: &[u8],
    range: Range<usize>,
    kind: Kind,
    peer: Option<&PeerAt>,
) -> Result<()> {
    let reserved = &message[range.clone()];
    if reserved.iter().all(|&b| b == 0) {
        return Ok(());
    }
    Err(protocol_error(
        format!(
            "zero bytes at offsets {}..{} of {}",
            range.start,
            range.end - 1,
            kind.within()
        ),
        hex(reserved),
        peer,
    ))
}

/// Bytes of a message that carries one 32-byte tag after its 16-byte start (an auth
/// message, a join message).
pub(crate) const TAG_MESSAGE_LEN: usize = START_LEN + 32;

/// The `kind` message that carries `tag` (its magic, 12 zero bytes, the tag).
pub(crate) fn tag_message(kind: Kind, tag: [u8; 32]) -> [u8; TAG_MESSAGE_LEN] {
    let mut out = [0u8; TAG_MESSAGE_LEN];
    out[..4].copy_from_slice(&kind.magic());
    out[START_LEN..].copy_from_slice(&tag);
    out
}

/// The tag a peer's `kind` message carries, once its magic and its 12 zero bytes are
/// checked.
pub(crate) fn read_tag(
    bytes: &[u8; TAG_MESSAGE_LEN],
    kind: Kind,
    peer: Option<&PeerAt>,
) -> Result<[u8; 32]> {
    let mut start = [0u8; START_LEN];
    start.copy_from_slice(&bytes[..START_LEN]);
    check_start(&start, kind, peer)?;
    let mut tag = [0u8; 32];
    tag.copy_from_slice(&bytes[START_LEN..]);
    Ok(tag)
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
            describe(b"GET / HTTP/1.1\r\nHost: x"),
            "an HTTP request ('GET / HTTP/1.1'...)"
        );
        assert_eq!(
            describe(b"POST /api/v1/upload HTTP/1.1"),
            "an HTTP request ('POST /api/v1/upl'...)"
        );
        assert_eq!(
            describe(b"PUT /'a\\\x01\x7f\n0123456"),
            "an HTTP request ('PUT /\\'a\\\\\\x01\\x7f'...)"
        );
        // A method needs its space: "GETS" is no request.
        assert_eq!(
            describe(b"GETS 0123456789ab"),
            "bytes 47455453203031323334353637383961"
        );
        assert_eq!(
            describe(b"PRI * HTTP/2.0\r\n"),
            "an HTTP request ('PRI * HTTP/2.0'...)"
        );
    }

    #[test]
    fn tls_clients_and_alerts_are_named() {
        let client_hello = [
            0x16, 0x03, 0x01, 0x01, 0x2c, 0x01, 0x00, 0x01, 0x28, 0x03, 0x03, 1, 2, 3, 4, 5,
        ];
        assert!(describe(&client_hello)
            .starts_with("a TLS ClientHello (a TLS client at a plaintext listener"));
        assert!(
            describe(&start(&[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32]))
                .starts_with("a TLS alert (the peer speaks TLS")
        );
    }

    #[test]
    fn frame_headers_are_named_with_their_fields() {
        let header = FrameHeader {
            chunk_index: 0,
            total_chunks: 3,
            payload_len: 4104,
            checksum: 0xbeef,
        }
        .to_bytes();
        assert_eq!(
            describe(&header),
            "a bare seed frame header (chunk 0 of 3, payload_len 4104, checksum 0x0000beef): \
             an ipfrs-transport peer, or one with protocol='seed'"
        );
        // An index at or past the total, or a total past 2^24, is no header.
        let past = FrameHeader {
            chunk_index: 3,
            total_chunks: 3,
            payload_len: 4104,
            checksum: 0,
        }
        .to_bytes();
        assert!(describe(&past).starts_with("bytes 03000000"));
        let huge = FrameHeader {
            chunk_index: 0,
            total_chunks: (1 << 24) + 1,
            payload_len: 1,
            checksum: 0,
        }
        .to_bytes();
        assert!(describe(&huge).starts_with("bytes "));
    }

    #[test]
    fn our_own_messages_are_named_by_their_magic() {
        assert_eq!(
            describe(&start(b"GSAU")),
            format!("an authentication message (47534155{})", "0".repeat(24))
        );
        assert!(describe(&start(b"GSAK")).starts_with("an ack (4753414b"));
        let mut hello = start(b"GSHL");
        hello[12] = 2;
        hello[14] = 80;
        assert_eq!(describe(&hello), "a hello of version 2 (80 bytes)");
        assert!(describe(&start(b"GSPK")).starts_with("a key exchange message (4753504b"));
        hello[4] = 1;
        assert!(describe(&hello).starts_with("a hello (4753484c01"));
    }

    #[test]
    fn the_end_and_anything_else() {
        assert_eq!(
            describe(b"Lorem ipsum dolor sit"),
            "bytes 4c6f72656d20697073756d20646f6c6f"
        );
        assert_eq!(describe(&[]), "the end of the connection");
        assert_eq!(
            describe(&[1, 2, 3]),
            "the end of the connection after 3 bytes (010203)"
        );
    }

    #[test]
    fn every_start_of_up_to_16_bytes_is_described_without_panic() {
        // A cheap sweep of hostile starts: every length, every value of the first byte.
        for len in 0..=START_LEN {
            for first in 0..=255u8 {
                let mut bytes = [0x03u8; START_LEN];
                bytes[0] = first;
                assert!(!describe(&bytes[..len]).is_empty());
            }
        }
    }

    #[test]
    fn the_start_check_names_what_came_or_the_reserved_bytes() {
        let mut bytes = start(b"GSAK");
        assert!(check_start(&bytes, Kind::Ack, None).is_ok());
        bytes[9] = 1;
        assert_eq!(
            check_start(&bytes, Kind::Ack, None),
            Err(protocol_error("an ack", describe(&bytes), None))
        );
        let mut auth = start(b"GSAU");
        auth[13] = 1;
        assert_eq!(
            check_start(&auth, Kind::Auth, None),
            Err(protocol_error(
                "zero bytes at offsets 4..15 of an authentication message",
                "000000000000000000010000",
                None
            ))
        );
        assert_eq!(
            check_start(&start(b"GSAK"), Kind::Hello, None),
            Err(protocol_error(
                "a gradstream hello",
                describe(&start(b"GSAK")),
                None
            ))
        );
    }
}
