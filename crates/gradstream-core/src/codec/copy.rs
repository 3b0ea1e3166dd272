//! Moving value bytes between a payload and a large destination at memcpy's speed: copies
//! that write around the cache (non-temporal stores) once the destination is larger than
//! the caches, and the copy fused with the CRC-32, block by block, so that each block is
//! read from memory once.
//!
//! Why: glibc's memmove writes through the cache below its non-temporal threshold (192 MiB
//! on the development VM), and the codec copies a chunk (256 KiB at chunk 65536) at a time,
//! so every store first reads its cache line from memory (read-for-ownership) and later
//! evicts it: one and a half times the traffic of numpy's whole-gradient memcpy, which does
//! stream. Streaming stores skip both, for a destination nobody reads soon (a gradient of
//! megabytes is read long after, and not from this core's cache).
//!
//! Uses `crc32fast` alone; used (through `mod.rs`) by `template` (a payload's values
//! copied and CRC'd as it is written), `encoder` (which stores a frame stream takes) and
//! `output` (values into a caller's `out=` array or a vector of ours).

use std::mem::MaybeUninit;

use crc32fast::Hasher;

/// Bytes copied and CRC'd at a time: the CRC brings a block into L1 (32 KiB per core
/// here), the copy reads it from there.
pub const BLOCK: usize = 16 * 1024;

/// Destinations at least this large are written with streaming stores: past L2 (1 MiB a
/// core here) and a good part of L3, so the bytes would be evicted unread anyway. Below
/// it, a destination may well be read back from cache (a small gradient in a loop).
pub const STREAM_FROM: usize = 4 << 20;

/// How stores reach the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stores {
    /// Through the cache (memmove): for destinations read back soon.
    Cached,
    /// Around the cache (non-temporal stores, x86_64; memmove elsewhere).
    Streaming,
}

impl Stores {
    /// The stores for a destination of `len` bytes in all (the whole array or stream,
    /// not the piece being copied).
    pub fn for_destination(len: usize) -> Self {
        if len >= STREAM_FROM {
            Self::Streaming
        } else {
            Self::Cached
        }
    }

    /// Copy `src` into `dst` (the same length).
    pub fn copy(self, src: &[u8], dst: &mut [u8]) {
        match self {
            Self::Cached => dst.copy_from_slice(src),
            Self::Streaming => stream_copy(src, dst),
        }
    }

    /// Copy `src` into `dst` (the same length), which may be uninitialised (a vector's
    /// spare capacity).
    pub fn copy_uninit(self, src: &[u8], dst: &mut [MaybeUninit<u8>]) {
        assert_eq!(src.len(), dst.len(), "copy of unequal lengths");
        let to = dst.as_mut_ptr().cast::<u8>();
        match self {
            // SAFETY: `dst` is `src.len()` writable bytes, apart from `src` (borrowed
            // mutably while `src` is borrowed).
            Self::Cached => unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), to, src.len()) },
            // SAFETY: as above.
            Self::Streaming => unsafe { stream_copy_raw(src, to) },
        }
    }
}

/// Copy `src` into `dst` and feed `src` to `crc`, one block at a time: the CRC reads the
/// block from memory, the copy from L1.
pub fn copy_and_crc(crc: &mut Hasher, src: &[u8], dst: &mut [u8], stores: Stores) {
    assert_eq!(src.len(), dst.len(), "copy of unequal lengths");
    for (from, to) in src.chunks(BLOCK).zip(dst.chunks_mut(BLOCK)) {
        crc.update(from);
        stores.copy(from, to);
    }
}

/// `dst.copy_from_slice(src)`, with non-temporal stores for all but the unaligned ends.
fn stream_copy(src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "copy of unequal lengths");
    // SAFETY: `dst` is `src.len()` writable bytes, not overlapping `src` (it is borrowed
    // mutably while `src` is borrowed).
    unsafe { stream_copy_raw(src, dst.as_mut_ptr()) }
}

/// Copy `src` to the `src.len()` bytes at `dst`, which may be uninitialised.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes that do not overlap `src`.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy_raw(src: &[u8], dst: *mut u8) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    const LANE: usize = 16;
    const GROUP: usize = 4 * LANE;
    let len = src.len();
    let head = dst.align_offset(LANE).min(len);
    let body = (len - head) / GROUP * GROUP;
    // SAFETY (all three blocks): the caller gives `len` writable bytes at `dst`, apart
    // from `src`; head + body <= len, so every range below lies inside both.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head) };
    let mut at = head;
    while at < head + body {
        // SAFETY: SSE2 is part of x86_64. Bytes at..at + 64 lie inside both buffers (see
        // above); the loads are unaligned ones, and `dst + at` is 16-byte aligned (`head`
        // aligned it, and `at` steps by 64), as the streaming store requires.
        unsafe {
            let s = src.as_ptr().add(at).cast::<__m128i>();
            let d = dst.add(at).cast::<__m128i>();
            let lanes = [
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            ];
            for (i, lane) in lanes.into_iter().enumerate() {
                _mm_stream_si128(d.add(i), lane);
            }
        }
        at += GROUP;
    }
    // SAFETY: as above; the tail is len - at bytes inside both.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(at), dst.add(at), len - at) };
    // Streaming stores are weakly ordered: fence them before anything that publishes the
    // destination (a lock release, the GIL taken back) can be seen by another thread.
    // SAFETY: SSE is part of x86_64; sfence has no memory operands.
    unsafe { _mm_sfence() };
}

/// # Safety
/// As the x86_64 version.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn stream_copy_raw(src: &[u8], dst: *mut u8) {
    // SAFETY: the caller's promise.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 + i / 251) as u8).collect()
    }

    #[test]
    fn streaming_copies_equal_memmove_at_every_alignment_and_length() {
        let src = bytes(BLOCK * 2 + 300);
        for len in [
            0,
            1,
            15,
            16,
            17,
            63,
            64,
            65,
            127,
            1000,
            BLOCK - 1,
            BLOCK + 1,
            src.len() - 8,
        ] {
            for src_at in [0, 1, 7] {
                for dst_at in [0, 1, 9, 15] {
                    let mut dst = vec![0xeeu8; len + dst_at + 5];
                    let from = &src[src_at..src_at + len];
                    Stores::Streaming.copy(from, &mut dst[dst_at..dst_at + len]);
                    assert_eq!(
                        &dst[dst_at..dst_at + len],
                        from,
                        "len {len} at {src_at}/{dst_at}"
                    );
                    // Nothing written around the destination.
                    assert!(dst[..dst_at]
                        .iter()
                        .chain(&dst[dst_at + len..])
                        .all(|&b| b == 0xee));
                }
            }
        }
    }

    #[test]
    fn copy_and_crc_is_a_copy_and_the_crc_of_the_source() {
        let src = bytes(3 * BLOCK + 77);
        for len in [0, 1, BLOCK, BLOCK + 1, src.len()] {
            for stores in [Stores::Cached, Stores::Streaming] {
                let mut crc = Hasher::new_with_initial(0x1234_5678);
                let mut dst = vec![0u8; len];
                copy_and_crc(&mut crc, &src[..len], &mut dst, stores);
                let mut expected = Hasher::new_with_initial(0x1234_5678);
                expected.update(&src[..len]);
                assert_eq!(crc.finalize(), expected.finalize());
                assert_eq!(dst, &src[..len]);
            }
        }
    }

    #[test]
    fn large_destinations_stream() {
        assert_eq!(Stores::for_destination(STREAM_FROM - 1), Stores::Cached);
        assert_eq!(Stores::for_destination(STREAM_FROM), Stores::Streaming);
    }
}
