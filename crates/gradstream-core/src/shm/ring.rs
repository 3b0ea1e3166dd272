//! A side's own ring (a sealed memfd it writes) and a peer's (adopted from a descriptor,
//! checked, mapped read-only).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{FileType, MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{GradientStreamError, Result};

/// The smallest ring either side makes or maps: one default chunk's payload and room.
pub const MIN_RING_LEN: usize = 64 << 10;

/// A ring's size unless set: in a prototype of two processes copying 1 GiB through rings
/// of 2-32 MiB (2026-12-06), 4-8 MiB went fastest, staying in the last-level cache between
/// the writer's copy in and the reader's copy out.
pub const DEFAULT_RING_LEN: usize = 8 << 20;

/// What this side maps of a peer's ring.
#[derive(Clone, Copy, Debug)]
pub struct RingLimits {
    /// The largest ring it maps, in bytes.
    pub max_len: usize,
}

impl Default for RingLimits {
    /// The default ring's size: what a peer with the defaults passes.
    fn default() -> Self {
        Self {
            max_len: DEFAULT_RING_LEN,
        }
    }
}

/// `statfs.f_type` of tmpfs, where a memfd of ordinary pages lives. A hugetlbfs memfd
/// (`MFD_HUGETLB`) is refused: its pages come from a pool that may be empty, and a page
/// that cannot be had is a SIGBUS on access.
const TMPFS_MAGIC: u64 = 0x0102_1994;

/// A peer's ring refused: `seen` says how.
fn refused(seen: impl Into<String>) -> GradientStreamError {
    GradientStreamError::Protocol {
        expected: "the descriptor of a sealed memfd for the peer's ring".into(),
        seen: seen.into(),
        peer: None,
    }
}

fn page_size() -> usize {
    rustix::param::page_size()
}

/// A shared mapping of `len` bytes, unmapped when dropped.
struct Mapping {
    at: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value alone (no thread-affine state);
// what is read or written through it is synchronised by its owner's `&`/`&mut` borrows.
unsafe impl Send for Mapping {}
// SAFETY: as above; shared borrows only read (`PeerRing::copy_out`).
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes of `fd` shared, read-only unless `writable`; `populate` faults
    /// every page in now (this side's own ring, which it will write anyway).
    ///
    /// # Safety
    ///
    /// `fd` must be a tmpfs memfd of exactly `len` bytes sealed with `F_SEAL_SHRINK` and
    /// `F_SEAL_FUTURE_WRITE` or about to be (this side's own, before it passes it on):
    /// then no page of the mapping can vanish or be punched out under a reader (no
    /// SIGBUS).
    unsafe fn new(fd: BorrowedFd<'_>, len: usize, writable: bool, populate: bool) -> Result<Self> {
        let protection = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        let flags = if populate {
            MapFlags::SHARED | MapFlags::POPULATE
        } else {
            MapFlags::SHARED
        };
        // SAFETY: a fresh mapping at an address the kernel picks (no existing memory is
        // replaced) of `len` bytes of `fd`, which the caller guarantees (see above).
        let at = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, protection, flags, fd, 0) }
            .map_err(std::io::Error::from)?;
        let at = NonNull::new(at.cast::<u8>()).ok_or_else(|| {
            GradientStreamError::Io(std::io::Error::other("mmap returned a null mapping"))
        })?;
        Ok(Self { at, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `at` and `len` are exactly what mmap returned and took; nothing borrows
        // the mapping any more (its owner is being dropped).
        let _ = unsafe { rustix::mm::munmap(self.at.as_ptr().cast(), self.len) };
    }
}

/// The pieces of a ring of `len` bytes that `count` bytes from `offset` occupy, wrapping
/// at the end: `(at, n)` pairs.
fn pieces(len: usize, offset: usize, count: usize) -> [(usize, usize); 2] {
    let at = offset % len;
    let first = count.min(len - at);
    [(at, first), (0, count - first)]
}

/// This side's ring: a memfd of fixed size (sealed against shrinking, growing and further
/// seals), mapped read-write, whose descriptor goes to the peer once.
pub struct OwnRing {
    fd: OwnedFd,
    map: Mapping,
}

impl OwnRing {
    /// A ring of `len` bytes: a multiple of the page size, at least `MIN_RING_LEN`.
    pub fn create(len: usize) -> Result<Self> {
        if len < MIN_RING_LEN || !len.is_multiple_of(page_size()) {
            return Err(GradientStreamError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "a ring of {len} bytes: it must be a multiple of the page size ({}) and at \
                     least {MIN_RING_LEN} bytes",
                    page_size()
                ),
            )));
        }
        let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        let fd =
            rustix::fs::memfd_create("gradstream-ring", flags).map_err(std::io::Error::from)?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(std::io::Error::from)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW)
            .map_err(std::io::Error::from)?;
        // SAFETY: our memfd of `len` bytes, sealed against shrinking; against writes
        // other than through this mapping just below.
        let map = unsafe { Mapping::new(fd.as_fd(), len, true, true) }?;
        // Mapped: from now on the descriptor the peer gets can neither write the ring,
        // nor map it writable, nor punch holes in it, nor add or remove seals.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::FUTURE_WRITE | SealFlags::SEAL)
            .map_err(std::io::Error::from)?;
        Ok(Self { fd, map })
    }

    pub fn len(&self) -> usize {
        self.map.len
    }

    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    /// The descriptor to pass to the peer (`send_with_fd`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Write `bytes` at `offset` (taken modulo the ring's size, wrapping at its end). The
    /// caller keeps what it writes within what the peer has released.
    pub fn write_at(&mut self, offset: usize, bytes: &[u8]) {
        assert!(bytes.len() <= self.map.len, "a write larger than the ring");
        let mut from = 0;
        for (at, n) in pieces(self.map.len, offset, bytes.len()) {
            // SAFETY: `at + n <= len` (`pieces`), inside the mapping, writable; `bytes` is
            // a distinct allocation of at least `from + n` bytes. The peer only reads.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr().add(from),
                    self.map.at.as_ptr().add(at),
                    n,
                );
            }
            from += n;
        }
    }
}

/// A peer's ring, adopted from the descriptor it passed: checked (see the module), then
/// mapped read-only; the descriptor is closed once mapped.
pub struct PeerRing {
    map: Mapping,
}

impl PeerRing {
    /// Check `fd` and map it, or refuse it (a `Protocol` error naming what it was).
    pub fn adopt(fd: OwnedFd, limits: &RingLimits) -> Result<Self> {
        let stat = rustix::fs::fstat(&fd).map_err(std::io::Error::from)?;
        let kind = FileType::from_raw_mode(stat.st_mode);
        if kind != FileType::RegularFile {
            return Err(refused(format!("a descriptor of another kind ({kind:?})")));
        }
        let filesystem = rustix::fs::fstatfs(&fd).map_err(std::io::Error::from)?;
        if filesystem.f_type as u64 != TMPFS_MAGIC {
            return Err(refused(format!(
                "a file on another filesystem than tmpfs (type {:#x}), where memfds live (a \
                 hugetlbfs memfd's pages may be missing)",
                filesystem.f_type
            )));
        }
        // The seals first: once the size is sealed it is read once and holds.
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|_| refused("a file that cannot carry seals (not a memfd)"))?;
        for (seal, name) in [
            (SealFlags::SHRINK, "F_SEAL_SHRINK"),
            (SealFlags::GROW, "F_SEAL_GROW"),
            // Without it the peer could punch holes (fallocate, MADV_REMOVE) that cost a
            // page each to read back, or a SIGBUS where no page can be had.
            (SealFlags::FUTURE_WRITE, "F_SEAL_FUTURE_WRITE"),
        ] {
            if !seals.contains(seal) {
                return Err(refused(format!("a memfd without {name}")));
            }
        }
        let stat = rustix::fs::fstat(&fd).map_err(std::io::Error::from)?;
        let len = usize::try_from(stat.st_size).unwrap_or(usize::MAX);
        if len < MIN_RING_LEN || len > limits.max_len || !len.is_multiple_of(page_size()) {
            return Err(refused(format!(
                "a ring of {len} bytes (this side maps whole pages, {MIN_RING_LEN} to {} bytes)",
                limits.max_len
            )));
        }
        // Not populated: the pages are the peer's, faulted in as they are read (a peer
        // cannot make this side hold its ring's memory before it sends anything).
        // SAFETY: checked above: a tmpfs memfd of `len` bytes, sealed against shrinking
        // and hole punching.
        let map = unsafe { Mapping::new(fd.as_fd(), len, false, false) }?;
        Ok(Self { map })
    }

    pub fn len(&self) -> usize {
        self.map.len
    }

    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    /// Copy `out.len()` bytes from `offset` (modulo the ring's size, wrapping) into `out`.
    /// The peer may be writing those bytes meanwhile: what lands in `out` is then some mix
    /// of old and new bytes, which the caller checks (CRC) in `out`, never in the ring.
    pub fn copy_out(&self, offset: usize, out: &mut [u8]) {
        assert!(out.len() <= self.map.len, "a read larger than the ring");
        let mut to = 0;
        for (at, n) in pieces(self.map.len, offset, out.len()) {
            // SAFETY: `at + n <= len` (`pieces`), inside the read-only mapping, whose pages
            // cannot vanish (the seals `adopt` checked); `out` is a distinct allocation of
            // at least `to + n` bytes. Another process may write those bytes during the
            // copy: a race outside this process, which the compiler cannot see into (an
            // opaque memcpy over shared memory), whose only effect is which bytes land in
            // `out`. They are read once, here, and checked (CRC) only in `out`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.map.at.as_ptr().add(at),
                    out.as_mut_ptr().add(to),
                    n,
                );
            }
            to += n;
        }
    }
}
