//! The one error type of the core. Its variants and wording follow ipfrs-transport 0.2.0's
//! `GradientStreamError` (`ArrowIpc`, `ChecksumMismatch`, `IncompleteStream`, `Io`, so code
//! written against the original keeps matching them); the others are ours, for the hostile
//! or malformed input the original accepts silently and for what the original lacks
//! (`out=` buffers, timeouts, tensor sets). `gradstream-py`'s `errors.rs` hands each variant's fields to
//! a Python class of `gradstream.errors`, which builds the same text from them: the Python
//! test `test_error_texts_agree` renders every variant on both sides and compares.
//!
//! Uses nothing of the crate; every other file uses it.

use std::fmt;
use std::net::SocketAddr;

/// Everything that can go wrong encoding, decoding or streaming a gradient.
///
/// Marked `#[non_exhaustive]`: gradstream adds variants to the original's four, so an
/// exhaustive `match` needs a wildcard arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GradientStreamError {
    /// A payload is not an Arrow IPC file with a `value` column gradstream reads.
    #[error("Arrow IPC error{}: {}", on_chunk(.0.chunk_index), .0.detail)]
    ArrowIpc(ArrowIpcDetail),

    /// A chunk's CRC-32 differs from the one its header carries.
    #[error(
        "Checksum mismatch on chunk {chunk_index}: expected {expected:#010x}, got {actual:#010x}"
    )]
    ChecksumMismatch {
        chunk_index: u32,
        expected: u32,
        actual: u32,
    },

    /// Fewer chunks than `total_chunks` (or more, in the original's own check).
    #[error("Incomplete chunk stream: received {received} of {total} chunks")]
    IncompleteStream { received: usize, total: usize },

    /// The connection failed.
    #[error("I/O error: {0}")]
    Io(#[source] std::io::Error),

    /// Malformed framing: truncation, limits, headers that contradict each other.
    /// `offset` is the byte offset of the header concerned, when there is a byte stream.
    #[error("{detail}")]
    Frame {
        detail: String,
        chunk_index: Option<u32>,
        offset: Option<u64>,
    },

    /// The gradient's size is not that of the caller's output buffer (`out=`).
    /// `chunk_index` names the chunk that ran over; None when the gradient came up short.
    #[error("{}", size_message(*expected, *received, *chunk_index))]
    GradientSize {
        expected: usize,
        received: usize,
        chunk_index: Option<u32>,
    },

    /// The gradient's dtype is not that of the caller's output buffer (`out=`).
    #[error("the gradient is {received}; out= is {expected}")]
    GradientDtype {
        expected: &'static str,
        received: &'static str,
        chunk_index: Option<u32>,
    },

    /// No byte moved for `timeout` seconds.
    #[error("{}", timeout_message(*timeout, *received, *total))]
    Timeout {
        timeout: f64,
        received: usize,
        total: Option<u32>,
    },

    /// A transfer (one gradient, or one tensor set) took longer than its `deadline`
    /// seconds from its first byte, however steadily bytes moved.
    #[error("{}", deadline_message(*deadline, *received, *total))]
    Deadline {
        deadline: f64,
        received: usize,
        total: Option<u32>,
    },

    /// A tensor set that is not valid (docs/guides/tensor-sets.md): a repeated or bad name, a
    /// manifest that cannot be read or declares too much, a tensor arriving other than its
    /// manifest entry says. `name` is the tensor concerned, when there is one.
    #[error("{detail}")]
    TensorSet {
        detail: String,
        name: Option<String>,
    },

    /// `error`, met while handling one tensor of a set, with the note that says which:
    /// `while receiving tensor "fc.weight" (3 of 100) of a tensor set`. Python raises
    /// `error` with the note added (`add_note`); the text here is what its traceback
    /// shows, the error's text and then the note on a line of its own.
    #[error("{error}\n{note}")]
    Noted {
        error: Box<GradientStreamError>,
        note: String,
    },

    /// A connection's peer does not speak this side's protocol (docs/spec/protocol.md): an
    /// HTTP client, a TLS client at a plaintext listener, an ipfrs-transport peer, another
    /// version, a malformed message, a message where a frame belongs.
    #[error(
        "protocol error with {}: expected {expected}, got {seen}",
        peer_text(peer)
    )]
    Protocol {
        expected: String,
        seen: String,
        peer: Option<PeerAt>,
    },

    /// The authkey check failed (a wrong or missing key, or a message changed on the way).
    #[error("authentication with {} failed: {detail}", peer_text(peer))]
    Authentication {
        detail: String,
        peer: Option<PeerAt>,
    },

    /// The TLS handshake failed, or the peer's certificate was refused.
    #[error("TLS with {} failed: {detail}", peer_text(peer))]
    Tls {
        detail: String,
        peer: Option<PeerAt>,
    },

    /// A gradient (or tensor set) sent on a connection was not acknowledged: the peer
    /// refused it (`reason` is its error message), closed first, or acknowledged other
    /// bytes than were sent.
    #[error("gradient not delivered to {}: {detail}", peer_text(peer))]
    Delivery {
        detail: String,
        reason: Option<String>,
        peer: Option<PeerAt>,
    },
}

/// Where a connection's peer is, as errors name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerAt {
    /// A TCP peer: its address.
    Tcp(SocketAddr),
    /// A peer of this host: the path of the Unix socket the connection was made at
    /// (docs/spec/same-host.md).
    Unix(std::path::PathBuf),
}

impl From<SocketAddr> for PeerAt {
    fn from(address: SocketAddr) -> Self {
        Self::Tcp(address)
    }
}

impl fmt::Display for PeerAt {
    /// `host:port` (`[v6]:port`), or `unix:PATH`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(address) => address.fmt(f),
            Self::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// How messages name a connection's peer: where it is, or `the peer`.
fn peer_text(peer: &Option<PeerAt>) -> String {
    peer.as_ref()
        .map_or_else(|| "the peer".to_string(), ToString::to_string)
}

/// What the Arrow IPC reader or writer refused, and in which chunk (where the original
/// carried an `anyhow::Error`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArrowIpcDetail {
    pub detail: String,
    pub chunk_index: Option<u32>,
}

impl fmt::Display for ArrowIpcDetail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

impl From<std::io::Error> for GradientStreamError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

/// Errors compare by their fields; I/O errors by kind, OS error code and text (an
/// `std::io::Error` has no equality of its own).
///
/// `eq` stays one piece: a single match with one arm a variant, over 60 lines only
/// because rustfmt spreads each variant's fields over lines; split, one comparison would
/// be scattered over several functions.
impl PartialEq for GradientStreamError {
    fn eq(&self, other: &Self) -> bool {
        use GradientStreamError as E;
        match (self, other) {
            (E::ArrowIpc(a), E::ArrowIpc(b)) => a == b,
            (
                E::ChecksumMismatch {
                    chunk_index: a,
                    expected: b,
                    actual: c,
                },
                E::ChecksumMismatch {
                    chunk_index: x,
                    expected: y,
                    actual: z,
                },
            ) => (a, b, c) == (x, y, z),
            (
                E::IncompleteStream {
                    received: a,
                    total: b,
                },
                E::IncompleteStream {
                    received: x,
                    total: y,
                },
            ) => (a, b) == (x, y),
            (E::Io(a), E::Io(b)) => {
                (a.kind(), a.raw_os_error(), a.to_string())
                    == (b.kind(), b.raw_os_error(), b.to_string())
            }
            (
                E::Frame {
                    detail: a,
                    chunk_index: b,
                    offset: c,
                },
                E::Frame {
                    detail: x,
                    chunk_index: y,
                    offset: z,
                },
            ) => (a, b, c) == (x, y, z),
            (
                E::GradientSize {
                    expected: a,
                    received: b,
                    chunk_index: c,
                },
                E::GradientSize {
                    expected: x,
                    received: y,
                    chunk_index: z,
                },
            ) => (a, b, c) == (x, y, z),
            (
                E::GradientDtype {
                    expected: a,
                    received: b,
                    chunk_index: c,
                },
                E::GradientDtype {
                    expected: x,
                    received: y,
                    chunk_index: z,
                },
            ) => (a, b, c) == (x, y, z),
            (
                E::Timeout {
                    timeout: a,
                    received: b,
                    total: c,
                },
                E::Timeout {
                    timeout: x,
                    received: y,
                    total: z,
                },
            ) => a.to_bits() == x.to_bits() && (b, c) == (y, z),
            (
                E::Deadline {
                    deadline: a,
                    received: b,
                    total: c,
                },
                E::Deadline {
                    deadline: x,
                    received: y,
                    total: z,
                },
            ) => a.to_bits() == x.to_bits() && (b, c) == (y, z),
            (E::TensorSet { detail: a, name: b }, E::TensorSet { detail: x, name: y }) => {
                (a, b) == (x, y)
            }
            (E::Noted { error: a, note: b }, E::Noted { error: x, note: y }) => (a, b) == (x, y),
            (
                E::Protocol {
                    expected: a,
                    seen: b,
                    peer: c,
                },
                E::Protocol {
                    expected: x,
                    seen: y,
                    peer: z,
                },
            ) => (a, b, c) == (x, y, z),
            (
                E::Authentication { detail: a, peer: b },
                E::Authentication { detail: x, peer: y },
            ) => (a, b) == (x, y),
            (E::Tls { detail: a, peer: b }, E::Tls { detail: x, peer: y }) => (a, b) == (x, y),
            (
                E::Delivery {
                    detail: a,
                    reason: b,
                    peer: c,
                },
                E::Delivery {
                    detail: x,
                    reason: y,
                    peer: z,
                },
            ) => (a, b, c) == (x, y, z),
            _ => false,
        }
    }
}

fn size_message(expected: usize, received: usize, chunk_index: Option<u32>) -> String {
    match chunk_index {
        None => {
            format!("the gradient holds {received} values; out= has room for exactly {expected}")
        }
        Some(i) => format!(
            "the gradient runs over the {expected} values out= has room for: {received} values \
             by chunk {i}"
        ),
    }
}

fn timeout_message(timeout: f64, received: usize, total: Option<u32>) -> String {
    let of = total.map_or_else(String::new, |t| format!(" of {t}"));
    format!(
        "no progress for {} s (after {received}{of} chunks); the peer stalled",
        general_format(timeout)
    )
}

fn deadline_message(deadline: f64, received: usize, total: Option<u32>) -> String {
    let of = total.map_or_else(String::new, |t| format!(" of {t}"));
    format!(
        "the transfer took longer than its deadline of {} s (after {received}{of} chunks)",
        general_format(deadline)
    )
}

/// `x` as Python's `format(x, "g")` writes it (6 significant digits, trailing zeros
/// dropped, an exponent below 1e-4 and from 1e6 on), so that Rust and Python texts agree.
pub(crate) fn general_format(x: f64) -> String {
    if !x.is_finite() {
        return if x.is_nan() {
            "nan".into()
        } else if x > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0" } else { "0" }.into();
    }
    // The exponent after rounding to 6 significant digits decides the notation.
    let sci = format!("{x:.5e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let trim = |s: &str| -> String {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s.to_string()
        }
    };
    if !(-4..6).contains(&exponent) {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{}e{sign}{:02}", trim(mantissa), exponent.abs())
    } else {
        let decimals = usize::try_from(5 - exponent).unwrap_or(0);
        trim(&format!("{x:.decimals$}"))
    }
}

fn on_chunk(chunk_index: Option<u32>) -> String {
    chunk_index.map_or_else(String::new, |i| format!(" on chunk {i}"))
}

impl GradientStreamError {
    pub(crate) fn frame(detail: impl Into<String>, chunk_index: Option<u32>) -> Self {
        Self::Frame {
            detail: detail.into(),
            chunk_index,
            offset: None,
        }
    }

    pub(crate) fn arrow(detail: impl Into<String>) -> Self {
        Self::ArrowIpc(ArrowIpcDetail {
            detail: detail.into(),
            chunk_index: None,
        })
    }

    pub(crate) fn tensor_set(detail: impl Into<String>, name: Option<&str>) -> Self {
        Self::TensorSet {
            detail: detail.into(),
            name: name.map(str::to_owned),
        }
    }

    /// This error with a note saying what was being done when it happened.
    pub(crate) fn noted(self, note: String) -> Self {
        Self::Noted {
            error: Box::new(self),
            note,
        }
    }

    /// Attach the byte offset of the frame header an error is about.
    pub(crate) fn at_offset(mut self, at: u64) -> Self {
        if let Self::Frame { offset, .. } = &mut self {
            *offset = Some(at);
        }
        self
    }

    /// Attach the chunk index to an Arrow error raised while decoding one chunk's payload.
    pub(crate) fn in_chunk(mut self, index: u32) -> Self {
        if let Self::ArrowIpc(detail) = &mut self {
            detail.chunk_index = Some(index);
        }
        self
    }

    /// One error of every variant, with fields that exercise each message's branches: the
    /// bindings' test renders them through both the Rust `Display` and the Python classes.
    #[doc(hidden)]
    pub fn samples() -> Vec<Self> {
        let io = |code| Self::Io(std::io::Error::from_raw_os_error(code));
        let samples =
            vec![
            Self::arrow("'value' column is not Float32"),
            Self::arrow("Arrow IPC block missing 'value' column").in_chunk(4),
            Self::ChecksumMismatch {
                chunk_index: 3,
                expected: 0x1a2b_3c4d,
                actual: 0,
            },
            Self::IncompleteStream {
                received: 2,
                total: 5,
            },
            io(104),
            Self::frame("duplicate chunk index 1", Some(1)).at_offset(96),
            Self::frame("truncated frame header: 7 of 16 bytes", None),
            Self::GradientSize {
                expected: 1000,
                received: 999,
                chunk_index: None,
            },
            Self::GradientSize {
                expected: 1000,
                received: 1024,
                chunk_index: Some(3),
            },
            Self::GradientDtype {
                expected: "float32",
                received: "float16",
                chunk_index: Some(0),
            },
            Self::Timeout {
                timeout: 30.0,
                received: 0,
                total: None,
            },
            Self::Timeout {
                timeout: 0.25,
                received: 7,
                total: Some(9),
            },
            Self::Timeout {
                timeout: 1.5e-5,
                received: 1,
                total: Some(1),
            },
            Self::Deadline {
                deadline: 60.0,
                received: 3,
                total: Some(12),
            },
            Self::Deadline {
                deadline: 0.5,
                received: 0,
                total: None,
            },
            Self::tensor_set(
                "tensor \"fc.weight\" arrived as float16 [3,4]; the manifest says float32 [4,3]",
                Some("fc.weight"),
            ),
            Self::tensor_set("tensor set manifest is not valid JSON", None),
            Self::tensor_set("the tensor set ends after 2 of its 100 tensors", None)
                .noted("while receiving tensor \"fc.weight\" (3 of 100) of a tensor set".into()),
            Self::ChecksumMismatch {
                chunk_index: 1,
                expected: 7,
                actual: 8,
            }
            .noted("while receiving tensor \"b\" (2 of 3) of a tensor set".into()),
            io(32).noted("while sending tensor \"\\u00e9\" (1 of 1) of a tensor set".into()),
            Self::Protocol {
                expected: "a gradstream hello".into(),
                seen: "an HTTP request (\"GET / HTTP/1.1\")".into(),
                peer: Some(SocketAddr::from(([127, 0, 0, 1], 7000)).into()),
            },
            Self::Protocol {
                expected: "an ack".into(),
                seen: "a frame header".into(),
                peer: None,
            },
            Self::Authentication {
                detail: "the peer's tag does not match this side's authkey".into(),
                peer: Some(PeerAt::Unix("/run/user/1000/trainer.sock".into())),
            },
            Self::Authentication {
                detail: "the peer's tag does not match this side's authkey".into(),
                peer: Some(PeerAt::Tcp("[::1]:41000".parse().expect("a literal address"))),
            },
            Self::Tls {
                detail: "invalid peer certificate: UnknownIssuer".into(),
                peer: Some(SocketAddr::from(([10, 0, 0, 5], 443)).into()),
            },
            Self::Delivery {
                detail: "the peer refused it: chunk 1 failed its CRC check".into(),
                reason: Some("chunk 1 failed its CRC check".into()),
                peer: Some(SocketAddr::from(([127, 0, 0, 1], 7000)).into()),
            },
            Self::Delivery {
                detail: "the connection closed before the peer acknowledged it".into(),
                reason: None,
                peer: None,
            },
        ];
        samples
    }

    /// The variant's position in the declaration, by an exhaustive match: a new variant
    /// fails to compile here, and the test `samples_cover_every_variant` then asks for a
    /// sample of it.
    #[cfg(test)]
    fn variant(&self) -> usize {
        match self {
            Self::ArrowIpc(_) => 0,
            Self::ChecksumMismatch { .. } => 1,
            Self::IncompleteStream { .. } => 2,
            Self::Io(_) => 3,
            Self::Frame { .. } => 4,
            Self::GradientSize { .. } => 5,
            Self::GradientDtype { .. } => 6,
            Self::Timeout { .. } => 7,
            Self::Deadline { .. } => 8,
            Self::TensorSet { .. } => 9,
            Self::Noted { .. } => 10,
            Self::Protocol { .. } => 11,
            Self::Authentication { .. } => 12,
            Self::Tls { .. } => 13,
            Self::Delivery { .. } => 14,
        }
    }
}

pub type Result<T> = std::result::Result<T, GradientStreamError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_cover_every_variant() {
        let seen: std::collections::BTreeSet<usize> = GradientStreamError::samples()
            .iter()
            .map(|e| e.variant())
            .collect();
        assert_eq!(seen, (0..15).collect());
    }

    #[test]
    fn general_format_writes_what_python_g_writes() {
        for (x, text) in [
            (30.0, "30"),
            (0.25, "0.25"),
            (1.5e-5, "1.5e-05"),
            (1e-4, "0.0001"),
            (123456.0, "123456"),
            (1234567.0, "1.23457e+06"),
            (0.1 + 0.2, "0.3"),
            (2.0f64.powi(70), "1.18059e+21"),
            (f64::INFINITY, "inf"),
        ] {
            assert_eq!(general_format(x), text, "{x}");
        }
    }

    #[test]
    fn messages_keep_the_original_wording() {
        let e = GradientStreamError::ChecksumMismatch {
            chunk_index: 3,
            expected: 0x1a2b_3c4d,
            actual: 0,
        };
        assert_eq!(
            e.to_string(),
            "Checksum mismatch on chunk 3: expected 0x1a2b3c4d, got 0x00000000"
        );
        let e = GradientStreamError::IncompleteStream {
            received: 2,
            total: 5,
        };
        assert_eq!(
            e.to_string(),
            "Incomplete chunk stream: received 2 of 5 chunks"
        );
        assert_eq!(
            GradientStreamError::arrow("bad").in_chunk(4).to_string(),
            "Arrow IPC error on chunk 4: bad"
        );
        assert_eq!(
            GradientStreamError::arrow("bad").to_string(),
            "Arrow IPC error: bad"
        );
    }
}
