//! The 16-byte frame header of ipfrs-transport's TensorSwap gradient stream, and the limits
//! a receiver applies to it before it trusts a single number in it.
//!
//! ```text
//! [u32 LE chunk_index][u32 LE total_chunks][u32 LE payload_len][u32 LE checksum][payload]
//! ```
//!
//! Uses `error` only; used by the session files and `stream`.

use crate::error::{GradientStreamError, Result};

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 16;

/// Default largest payload a receiver accepts in one frame: 256 MiB, room for a chunk of
/// 32M values in the seed layout (8 bytes a value), 512 times the default chunk.
pub const DEFAULT_MAX_PAYLOAD_LEN: u32 = 256 << 20;

/// Default largest gradient a receiver accepts: 2^30 values, 4 GiB of float32.
pub const DEFAULT_MAX_GRADIENT_LEN: usize = 1 << 30;

/// One frame's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub chunk_index: u32,
    pub total_chunks: u32,
    pub payload_len: u32,
    pub checksum: u32,
}

impl FrameHeader {
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        let fields = [
            self.chunk_index,
            self.total_chunks,
            self.payload_len,
            self.checksum,
        ];
        for (dst, field) in out.chunks_exact_mut(4).zip(fields) {
            dst.copy_from_slice(&field.to_le_bytes());
        }
        out
    }

    pub fn from_bytes(bytes: &[u8; HEADER_LEN]) -> Self {
        let word =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        Self {
            chunk_index: word(0),
            total_chunks: word(4),
            payload_len: word(8),
            checksum: word(12),
        }
    }
}

/// What a receiver will accept from a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest payload of one frame, in bytes.
    pub max_payload_len: u32,
    /// Largest gradient, in values: bounds what a receiver allocates for one gradient.
    pub max_gradient_len: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_payload_len: DEFAULT_MAX_PAYLOAD_LEN,
            max_gradient_len: DEFAULT_MAX_GRADIENT_LEN,
        }
    }
}

impl Limits {
    /// Refuse a header whose payload is over the limit, before anything is allocated for it.
    pub fn check_header(&self, header: &FrameHeader, offset: u64) -> Result<()> {
        if header.payload_len > self.max_payload_len {
            return Err(GradientStreamError::frame(
                format!(
                    "chunk {} declares a {}-byte payload, above max_payload_len {}",
                    header.chunk_index, header.payload_len, self.max_payload_len
                ),
                Some(header.chunk_index),
            )
            .at_offset(offset));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(i: u32, t: u32, len: u32, crc: u32) -> FrameHeader {
        FrameHeader {
            chunk_index: i,
            total_chunks: t,
            payload_len: len,
            checksum: crc,
        }
    }

    #[test]
    fn header_is_four_little_endian_words() {
        let h = header(1, 0x0203_0405, 3, 0xdead_beef);
        let bytes = h.to_bytes();
        assert_eq!(&bytes[..4], &[1, 0, 0, 0]);
        assert_eq!(&bytes[4..8], &[5, 4, 3, 2]);
        assert_eq!(&bytes[12..], &[0xef, 0xbe, 0xad, 0xde]);
        assert_eq!(FrameHeader::from_bytes(&bytes), h);
    }

    #[test]
    fn oversized_payload_is_refused_from_the_header_alone() {
        let limits = Limits {
            max_payload_len: 1024,
            ..Limits::default()
        };
        assert!(limits.check_header(&header(0, 1, 1024, 0), 0).is_ok());
        match limits
            .check_header(&header(0, 1, u32::MAX, 0), 0)
            .unwrap_err()
        {
            GradientStreamError::Frame { detail, .. } => assert_eq!(
                detail,
                "chunk 0 declares a 4294967295-byte payload, above max_payload_len 1024"
            ),
            e => panic!("wrong error {e:?}"),
        }
    }
}
