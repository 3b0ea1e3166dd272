//! The ack (docs/spec/protocol.md, step 4): the receiver's answer to each transfer, accepted
//! with a digest of what it accepted or refused with its error message, read in two steps
//! (the 56-byte head, then the reason it declares), and `Digest`, the running SHA-256 of a
//! transfer's id and frame headers that both sides compute. `Ack::confirm` is the sender's
//! check of the answer it got.
//!
//! Uses `describe` and `ids`, and ring's SHA-256; used by the connection driver.

use crate::error::PeerAt;

use ring::digest::{Context, SHA256};

use super::describe::{
    check_start, check_zeros, describe, frame_text, hex, protocol_error, Kind, START_LEN,
};
use super::ids::TRANSFER_ID_LEN;
use crate::error::{GradientStreamError, Result};
use crate::frame::HEADER_LEN;

/// Bytes of an ack before its reason.
pub const ACK_HEAD_LEN: usize = 56;

/// Most bytes of a refusal's reason.
pub const MAX_REASON_LEN: usize = 1024;

/// What the receiver made of a transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Accepted: the digest of the id and the headers it received.
    Accepted { digest: [u8; 32] },
    /// Refused: the receiver's error message.
    Refused { reason: String },
}

/// The answer to one transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ack {
    /// The transfer answered: its direction's counter.
    pub counter: u64,
    pub verdict: Verdict,
}

impl Ack {
    pub fn accepted(counter: u64, digest: [u8; 32]) -> Self {
        Self {
            counter,
            verdict: Verdict::Accepted { digest },
        }
    }

    pub fn refused(counter: u64, reason: impl Into<String>) -> Self {
        Self {
            counter,
            verdict: Verdict::Refused {
                reason: reason.into(),
            },
        }
    }

    /// The ack's bytes; a reason longer than 1024 bytes is cut there, on a character's
    /// boundary.
    pub fn to_bytes(&self) -> Vec<u8> {
        let (verdict, digest, reason) = match &self.verdict {
            Verdict::Accepted { digest } => (0u8, *digest, ""),
            Verdict::Refused { reason } => (1u8, [0u8; 32], cut(reason)),
        };
        let mut out = vec![0u8; ACK_HEAD_LEN];
        out[..4].copy_from_slice(&Kind::Ack.magic());
        out[12] = verdict;
        // At most 1024 after the cut: fits.
        out[14..16].copy_from_slice(&(reason.len() as u16).to_le_bytes());
        out[16..24].copy_from_slice(&self.counter.to_le_bytes());
        out[24..56].copy_from_slice(&digest);
        out.extend_from_slice(reason.as_bytes());
        out
    }

    /// Check an ack's first 16 bytes before reading more: magic (a frame header here is
    /// a peer that started a transfer while this side waits for its ack), zeros, a
    /// verdict of 0 or 1, a reason of at most 1024 bytes and only on a refusal. The bytes
    /// still to read: the rest of the head and the reason.
    pub fn check_start(start: &[u8; START_LEN], peer: Option<&PeerAt>) -> Result<usize> {
        if let Err(foreign) = check_start(start, Kind::Ack, peer) {
            return Err(match frame_text(start) {
                Some(fields) => protocol_error(
                    Kind::Ack.expected(),
                    format!(
                        "a frame header ({fields}): the peer started a transfer while this \
                         side waited for its ack; open a second connection for the other \
                         direction"
                    ),
                    peer,
                ),
                None => foreign,
            });
        }
        let verdict = start[12];
        if verdict > 1 {
            return Err(protocol_error(
                "verdict 0 (accepted) or 1 (refused) in an ack",
                format!("verdict {verdict}"),
                peer,
            ));
        }
        check_zeros(start, 13..14, Kind::Ack, peer)?;
        let reason_len = usize::from(u16::from_le_bytes([start[14], start[15]]));
        if reason_len > MAX_REASON_LEN {
            return Err(protocol_error(
                format!("an ack's reason of at most {MAX_REASON_LEN} bytes"),
                format!("{reason_len} bytes"),
                peer,
            ));
        }
        if verdict == 0 && reason_len != 0 {
            return Err(protocol_error(
                "no reason in an accepting ack",
                format!("{reason_len} bytes of reason"),
                peer,
            ));
        }
        Ok(ACK_HEAD_LEN - START_LEN + reason_len)
    }

    /// A whole ack, whose first 16 bytes `check_start` passed: a refusal's digest must be
    /// zero and its reason UTF-8.
    pub fn parse(bytes: &[u8], peer: Option<&PeerAt>) -> Result<Ack> {
        let start: &[u8; START_LEN] = bytes
            .get(..START_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or_else(|| protocol_error(Kind::Ack.expected(), describe(bytes), peer))?;
        let whole = START_LEN + Self::check_start(start, peer)?;
        if bytes.len() != whole {
            return Err(protocol_error(
                format!("an ack of {whole} bytes"),
                format!("{} bytes", bytes.len()),
                peer,
            ));
        }
        let mut counter = [0u8; 8];
        counter.copy_from_slice(&bytes[16..24]);
        let counter = u64::from_le_bytes(counter);
        let mut digest = [0u8; 32];
        digest.copy_from_slice(&bytes[24..56]);
        if bytes[12] == 0 {
            return Ok(Ack::accepted(counter, digest));
        }
        if digest != [0; 32] {
            return Err(protocol_error(
                "a zero digest in a refusal",
                format!("digest {}", hex(&digest)),
                peer,
            ));
        }
        let reason = &bytes[ACK_HEAD_LEN..];
        let reason = std::str::from_utf8(reason).map_err(|_| {
            protocol_error(
                "a UTF-8 reason in a refusal",
                format!("bytes {}", hex(reason)),
                peer,
            )
        })?;
        Ok(Ack::refused(counter, reason))
    }

    /// The sender's check of the ack to transfer `counter`, whose frames it digested into
    /// `digest`: a `DeliveryError` for another counter, a refusal or another digest.
    pub fn confirm(&self, counter: u64, digest: &[u8; 32], peer: Option<&PeerAt>) -> Result<()> {
        let undelivered = |detail: String, reason: Option<String>| {
            Err(GradientStreamError::Delivery {
                detail,
                reason,
                peer: peer.cloned(),
            })
        };
        match &self.verdict {
            _ if self.counter != counter => undelivered(
                format!(
                    "the peer acknowledged transfer {}; this was transfer {counter}",
                    self.counter
                ),
                None,
            ),
            Verdict::Refused { reason } => undelivered(
                format!("the peer refused it: {reason}"),
                Some(reason.clone()),
            ),
            Verdict::Accepted { digest: theirs } if theirs != digest => undelivered(
                format!(
                    "the peer acknowledged other frames than were sent (its digest {}..., \
                     this side's {}...)",
                    hex(&theirs[..8]),
                    hex(&digest[..8])
                ),
                None,
            ),
            Verdict::Accepted { .. } => Ok(()),
        }
    }
}

/// `reason` cut to at most 1024 bytes, on a character's boundary.
fn cut(reason: &str) -> &str {
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

/// The digest of a transfer: `SHA-256("gradstream/1 digest" || id || every frame's
/// header, in order)`, fed header by header as frames go out or come in.
#[derive(Clone)]
pub struct Digest(Context);

impl Digest {
    pub fn new(transfer_id: &[u8; TRANSFER_ID_LEN]) -> Self {
        let mut hash = Context::new(&SHA256);
        hash.update(b"gradstream/1 digest");
        hash.update(transfer_id);
        Self(hash)
    }

    pub fn header(&mut self, header: &[u8; HEADER_LEN]) {
        self.0.update(header);
    }

    pub fn finish(self) -> [u8; 32] {
        let mut out = [0u8; 32];
        out.copy_from_slice(self.0.finish().as_ref());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::FrameHeader;
    use crate::protocol::ids::{transfer_id, Direction};
    use crate::protocol::testing::{hex, CLIENT_NONCE, PEER, SERVER_NONCE};

    /// The docs/spec/protocol.md digest: transfer 0 from the client, headers (0, 2, 10, 0x11111111)
    /// and (1, 2, 10, 0x22222222).
    fn vector_digest() -> [u8; 32] {
        let id = transfer_id(&CLIENT_NONCE, &SERVER_NONCE, Direction::ClientToServer, 0);
        let mut digest = Digest::new(&id);
        for (chunk_index, checksum) in [(0, 0x1111_1111), (1, 0x2222_2222)] {
            let header = FrameHeader {
                chunk_index,
                total_chunks: 2,
                payload_len: 10,
                checksum,
            };
            digest.header(&header.to_bytes());
        }
        digest.finish()
    }

    fn start(bytes: &[u8]) -> [u8; START_LEN] {
        let mut out = [0u8; START_LEN];
        out.copy_from_slice(&bytes[..START_LEN]);
        out
    }

    /// The (expected, seen) of a ProtocolError.
    fn refusal<T: std::fmt::Debug>(result: Result<T>) -> (String, String) {
        match result {
            Err(GradientStreamError::Protocol { expected, seen, .. }) => (expected, seen),
            other => panic!("not a ProtocolError: {other:?}"),
        }
    }

    #[test]
    fn acks_match_the_readme_vectors() {
        let ack = Ack::accepted(0, vector_digest());
        assert_eq!(
            hex(&ack.to_bytes()),
            concat!(
                "4753414b",
                "0000000000000000",
                "00",
                "00",
                "0000",
                "0000000000000000",
                "5da574165e2673baf8fb84f1debe477aec7b68a4428c3a29cf5d7a2679a1b86e"
            )
        );
        let refusal = Ack::refused(0, "chunk 1 failed its CRC check");
        assert_eq!(
            hex(&refusal.to_bytes()),
            format!(
                "{}{}{}",
                "4753414b000000000000000001001c000000000000000000",
                "00".repeat(32),
                "6368756e6b2031206661696c6564206974732043524320636865636b"
            )
        );
    }

    #[test]
    fn acks_read_back_as_written() {
        for ack in [
            Ack::accepted(u64::MAX, [0xab; 32]),
            Ack::refused(3, ""),
            Ack::refused(7, "chunk 1 failed its CRC check"),
            Ack::refused(8, "\u{e9}".repeat(512)),
        ] {
            let bytes = ack.to_bytes();
            let rest = Ack::check_start(&start(&bytes), None).unwrap();
            assert_eq!(START_LEN + rest, bytes.len());
            assert_eq!(Ack::parse(&bytes, None), Ok(ack));
        }
    }

    #[test]
    fn long_reasons_are_cut_on_a_character_boundary() {
        let reason = format!("{}\u{e9}tail", "x".repeat(1023));
        let bytes = Ack::refused(1, reason).to_bytes();
        assert_eq!(bytes.len(), ACK_HEAD_LEN + 1023);
        assert_eq!(
            Ack::parse(&bytes, None),
            Ok(Ack::refused(1, "x".repeat(1023)))
        );
        assert_eq!(cut(&"y".repeat(5000)).len(), MAX_REASON_LEN);
    }

    #[test]
    fn a_frame_header_where_an_ack_belongs_is_named() {
        // The peer began a transfer of its own while this side waits for an ack.
        let header = FrameHeader {
            chunk_index: 0,
            total_chunks: 3,
            payload_len: 4104,
            checksum: 9,
        };
        assert_eq!(
            Ack::check_start(&header.to_bytes(), Some(&PeerAt::Tcp(PEER))),
            Err(protocol_error(
                "an ack",
                "a frame header (chunk 0 of 3, payload_len 4104, checksum 0x00000009): the \
                 peer started a transfer while this side waited for its ack; open a second \
                 connection for the other direction",
                Some(&PeerAt::Tcp(PEER))
            ))
        );
    }

    #[test]
    fn malformed_acks_are_refused() {
        let accepted = Ack::accepted(0, [1; 32]).to_bytes();
        let refused = Ack::refused(0, "no").to_bytes();
        let with = |bytes: &[u8], at: usize, value: u8| {
            let mut out = bytes.to_vec();
            out[at] = value;
            out
        };
        let pair = |e: &str, s: &str| (e.to_string(), s.to_string());
        let head = |bytes: Vec<u8>| refusal(Ack::check_start(&start(&bytes), None));
        assert_eq!(
            head(with(&accepted, 6, 1)).1,
            describe(&with(&accepted, 6, 1))
        );
        assert_eq!(
            head(with(&accepted, 12, 2)),
            pair("verdict 0 (accepted) or 1 (refused) in an ack", "verdict 2")
        );
        assert_eq!(
            head(with(&accepted, 13, 1)),
            pair("zero bytes at offsets 13..13 of an ack", "01")
        );
        assert_eq!(
            head(with(&accepted, 14, 5)),
            pair("no reason in an accepting ack", "5 bytes of reason")
        );
        assert_eq!(
            head(with(&refused, 15, 4)),
            pair("an ack's reason of at most 1024 bytes", "1026 bytes")
        );
        assert_eq!(
            refusal(Ack::parse(&with(&refused, 40, 1), None)),
            pair(
                "a zero digest in a refusal",
                &format!("digest {}01{}", "00".repeat(16), "00".repeat(15))
            )
        );
        assert_eq!(
            refusal(Ack::parse(&refused[..refused.len() - 1], None)),
            pair("an ack of 58 bytes", "57 bytes")
        );
        let mut bad = refused.clone();
        bad[ACK_HEAD_LEN] = 0xff;
        assert_eq!(
            refusal(Ack::parse(&bad, None)),
            pair("a UTF-8 reason in a refusal", "bytes ff6f")
        );
    }

    #[test]
    fn the_sender_confirms_counter_and_digest() {
        let digest = vector_digest();
        let ack = Ack::accepted(0, digest);
        assert_eq!(ack.confirm(0, &digest, None), Ok(()));
        let delivery = |result: Result<()>| match result {
            Err(GradientStreamError::Delivery { detail, reason, .. }) => (detail, reason),
            other => panic!("not a DeliveryError: {other:?}"),
        };
        assert_eq!(
            delivery(ack.confirm(1, &digest, None)),
            (
                "the peer acknowledged transfer 0; this was transfer 1".into(),
                None
            )
        );
        assert_eq!(
            delivery(Ack::accepted(0, digest).confirm(0, &[0; 32], None)),
            (
                format!(
                    "the peer acknowledged other frames than were sent (its digest {}..., \
                     this side's {}...)",
                    hex(&digest[..8]),
                    "00".repeat(8)
                ),
                None
            )
        );
        assert_eq!(
            delivery(Ack::refused(0, "chunk 1 failed its CRC check").confirm(0, &digest, None)),
            (
                "the peer refused it: chunk 1 failed its CRC check".into(),
                Some("chunk 1 failed its CRC check".into())
            )
        );
    }

    #[test]
    fn the_digest_depends_on_every_header_and_their_order() {
        let id = [5u8; TRANSFER_ID_LEN];
        let headers = [[1u8; HEADER_LEN], [2u8; HEADER_LEN]];
        let of = |order: &[usize]| {
            let mut digest = Digest::new(&id);
            for &i in order {
                digest.header(&headers[i]);
            }
            digest.finish()
        };
        assert_ne!(of(&[0, 1]), of(&[1, 0]));
        assert_ne!(of(&[0, 1]), of(&[0]));
        let mut other_id = Digest::new(&[6; TRANSFER_ID_LEN]);
        other_id.header(&headers[0]);
        assert_ne!(of(&[0]), other_id.finish());
    }
}
