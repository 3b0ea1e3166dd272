//! The ack (README "Protocol", step 4): the receiver's answer to each transfer, accepted
//! with a digest of what it accepted or refused with its error message, read in two steps
//! (the 56-byte head, then the reason it declares), and `Digest`, the running SHA-256 of a
//! transfer's id and frame headers that both sides compute. `Ack::confirm` is the sender's
//! check of the answer it got.
//!
//! Uses `describe` and `ids`, and ring's SHA-256; used by the connection driver.

use std::net::SocketAddr;

use ring::digest::{Context, SHA256};

use super::describe::{check_start, check_zeros, protocol_error, Kind, START_LEN};
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

/// An ack's head, checked: complete when it accepts, waiting for its reason when it refuses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AckHead {
    Accepted(Ack),
    Refused { counter: u64, reason_len: usize },
}

impl AckHead {
    /// Bytes of reason that follow the head.
    pub fn reason_len(&self) -> usize {
        match self {
            AckHead::Accepted(_) => 0,
            AckHead::Refused { reason_len, .. } => *reason_len,
        }
    }

    /// The whole ack, from the `reason_len()` bytes that followed the head (strict UTF-8).
    pub fn finish(self, reason: &[u8], peer: Option<SocketAddr>) -> Result<Ack> {
        let (counter, reason_len) = match self {
            AckHead::Accepted(ack) => return Ok(ack),
            AckHead::Refused {
                counter,
                reason_len,
            } => (counter, reason_len),
        };
        let Some(reason) = reason.get(..reason_len) else {
            return Err(malformed(
                format!(
                    "an ack whose reason ends after {} of {reason_len} bytes",
                    reason.len()
                ),
                peer,
            ));
        };
        let reason = std::str::from_utf8(reason)
            .map_err(|_| malformed("an ack whose reason is not UTF-8".into(), peer))?;
        Ok(Ack {
            counter,
            verdict: Verdict::Refused {
                reason: reason.to_string(),
            },
        })
    }
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

    /// Check an ack's head: magic (a frame header here is a peer that started a transfer
    /// while this side waits for its ack), zeros, a verdict of 0 or 1, a reason of at most
    /// 1024 bytes and only on a refusal, a digest of zeros on a refusal.
    pub fn parse_head(head: &[u8; ACK_HEAD_LEN], peer: Option<SocketAddr>) -> Result<AckHead> {
        let mut start = [0u8; START_LEN];
        start.copy_from_slice(&head[..START_LEN]);
        check_start(&start, Kind::Ack, peer)?;
        check_zeros(head, 13..14, Kind::Ack, peer)?;
        let reason_len = usize::from(u16::from_le_bytes([head[14], head[15]]));
        let mut counter = [0u8; 8];
        counter.copy_from_slice(&head[16..24]);
        let counter = u64::from_le_bytes(counter);
        let mut digest = [0u8; 32];
        digest.copy_from_slice(&head[24..56]);
        match head[12] {
            0 if reason_len != 0 => Err(malformed(
                format!("an accepting ack with a {reason_len}-byte reason"),
                peer,
            )),
            0 => Ok(AckHead::Accepted(Ack::accepted(counter, digest))),
            1 if reason_len > MAX_REASON_LEN => Err(malformed(
                format!("an ack with a {reason_len}-byte reason (at most {MAX_REASON_LEN})"),
                peer,
            )),
            1 if digest != [0; 32] => Err(malformed(
                "a refusing ack with a nonzero digest".into(),
                peer,
            )),
            1 => Ok(AckHead::Refused {
                counter,
                reason_len,
            }),
            other => Err(malformed(format!("an ack with verdict {other}"), peer)),
        }
    }

    /// The sender's check of the ack to transfer `counter`, whose frames it digested into
    /// `digest`: a `DeliveryError` for a refusal, another counter or another digest.
    pub fn confirm(&self, counter: u64, digest: &[u8; 32], peer: Option<SocketAddr>) -> Result<()> {
        let undelivered = |detail: String, reason: Option<String>| {
            Err(GradientStreamError::Delivery {
                detail,
                reason,
                peer,
            })
        };
        match &self.verdict {
            Verdict::Refused { reason } => undelivered(
                format!("the peer refused it: {reason}"),
                Some(reason.clone()),
            ),
            Verdict::Accepted { .. } if self.counter != counter => undelivered(
                format!(
                    "the peer acknowledged transfer {}, not {counter}",
                    self.counter
                ),
                None,
            ),
            Verdict::Accepted { digest: theirs } if theirs != digest => undelivered(
                "the peer acknowledged other bytes than were sent".into(),
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

fn malformed(seen: String, peer: Option<SocketAddr>) -> GradientStreamError {
    protocol_error(Kind::Ack.expected(), seen, peer)
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

    /// The README's digest: transfer 0 from the client, headers (0, 2, 10, 0x11111111)
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

    fn head(bytes: &[u8]) -> [u8; ACK_HEAD_LEN] {
        let mut out = [0u8; ACK_HEAD_LEN];
        out.copy_from_slice(&bytes[..ACK_HEAD_LEN]);
        out
    }

    fn seen(result: Result<AckHead>) -> String {
        match result {
            Err(GradientStreamError::Protocol { expected, seen, .. }) => {
                assert_eq!(expected, "an ack");
                seen
            }
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
            let head_of = Ack::parse_head(&head(&bytes), None).unwrap();
            assert_eq!(head_of.reason_len(), bytes.len() - ACK_HEAD_LEN);
            assert_eq!(head_of.finish(&bytes[ACK_HEAD_LEN..], None), Ok(ack));
        }
    }

    #[test]
    fn long_reasons_are_cut_on_a_character_boundary() {
        // 1023 ASCII bytes and a two-byte character: the character does not fit.
        let reason = format!("{}\u{e9}tail", "x".repeat(1023));
        let bytes = Ack::refused(1, reason).to_bytes();
        assert_eq!(bytes.len(), ACK_HEAD_LEN + 1023);
        let ack = Ack::parse_head(&head(&bytes), None)
            .unwrap()
            .finish(&bytes[ACK_HEAD_LEN..], None)
            .unwrap();
        assert_eq!(ack, Ack::refused(1, "x".repeat(1023)));
        assert_eq!(cut(&"y".repeat(5000)).len(), MAX_REASON_LEN);
    }

    #[test]
    fn a_frame_header_where_an_ack_belongs_is_named() {
        // The peer began a transfer of its own while this side waits for an ack.
        let mut bytes = [0u8; ACK_HEAD_LEN];
        let header = FrameHeader {
            chunk_index: 0,
            total_chunks: 3,
            payload_len: 4104,
            checksum: 9,
        };
        bytes[..HEADER_LEN].copy_from_slice(&header.to_bytes());
        assert_eq!(
            Ack::parse_head(&bytes, Some(PEER)),
            Err(protocol_error(
                "an ack",
                "a frame header (chunk 0 of 3, 4104-byte payload)",
                Some(PEER)
            ))
        );
    }

    #[test]
    fn malformed_heads_are_refused() {
        let accepted = Ack::accepted(0, [1; 32]).to_bytes();
        let refused = Ack::refused(0, "no").to_bytes();
        let with = |bytes: &[u8], at: usize, value: u8| {
            let mut out = head(bytes);
            out[at] = value;
            out
        };
        for at in (4..12).chain(13..14) {
            assert_eq!(
                seen(Ack::parse_head(&with(&accepted, at, 1), None)),
                format!("an ack with a nonzero reserved byte at offset {at}")
            );
        }
        assert_eq!(
            seen(Ack::parse_head(&with(&accepted, 12, 2), None)),
            "an ack with verdict 2"
        );
        assert_eq!(
            seen(Ack::parse_head(&with(&accepted, 14, 5), None)),
            "an accepting ack with a 5-byte reason"
        );
        let mut long = head(&refused);
        long[14..16].copy_from_slice(&1025u16.to_le_bytes());
        assert_eq!(
            seen(Ack::parse_head(&long, None)),
            "an ack with a 1025-byte reason (at most 1024)"
        );
        assert_eq!(
            seen(Ack::parse_head(&with(&refused, 40, 1), None)),
            "a refusing ack with a nonzero digest"
        );
    }

    #[test]
    fn reasons_must_be_whole_utf8() {
        let head_of = AckHead::Refused {
            counter: 0,
            reason_len: 3,
        };
        for bad in [&b"a\xffb"[..], b"\xe9ab", b"ab\xc3"] {
            assert_eq!(
                head_of.clone().finish(bad, Some(PEER)),
                Err(protocol_error(
                    "an ack",
                    "an ack whose reason is not UTF-8",
                    Some(PEER)
                ))
            );
        }
        assert_eq!(
            head_of.finish(b"ab", None),
            Err(protocol_error(
                "an ack",
                "an ack whose reason ends after 2 of 3 bytes",
                None
            ))
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
            ("the peer acknowledged transfer 0, not 1".into(), None)
        );
        assert_eq!(
            delivery(ack.confirm(0, &[0; 32], None)),
            (
                "the peer acknowledged other bytes than were sent".into(),
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
