//! Memory kept for the next result: `KeptMemory`, an allocator over the system's that
//! keeps the blocks of released large allocations and serves later large allocations from
//! them, instead of handing each back to the kernel and faulting fresh pages in again.
//!
//! Why: a result made without `out=` (a decoded array, a received one, frames as a
//! `pyarrow.Buffer`) is fresh memory, and fresh memory is slow to touch for the first time:
//! the kernel faults in and zeroes every page. On a virtual machine whose host takes freed
//! guest memory back (virtio free page reporting, as on the development VM, about two
//! seconds after a free), every page faults on the host as well: there a 256 MiB copy into
//! a new numpy array ran at 5.7 GB/s straight after the last one was freed and at 0.3 to
//! 0.6 GB/s three seconds later. A training loop that decodes one gradient per step and
//! drops the last step's result gets the same pages back instead.
//!
//! Bounded: at most `limit` bytes in at most `SLOTS` blocks are kept; when a new block
//! would go over, the oldest go back to the system first. Only blocks of at least
//! `KEEP_FROM` bytes at malloc's own alignment are kept, so small allocations take the
//! system allocator's path after one comparison. A kept block serves a request of at least
//! half its size (the smallest that fits is chosen), so at most half of it lies unused.
//!
//! Uses std's `System` allocator, libc (`malloc_usable_size`) on Linux (elsewhere nothing
//! is kept) and `fork` (its lock, held across a fork). The extension installs one as its global allocator
//! (`gradstream-py`'s lib.rs) and its `memory` bindings read and set it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::fork::SpinLock;

/// Allocations of at least this many bytes are kept when released: numpy's threshold for
/// huge pages (`output::HUGE_PAGES_FROM`), above glibc's largest mmap threshold (32 MiB
/// is its cap; 4 MiB blocks already come from mmap once the threshold has adapted).
pub const KEEP_FROM: usize = 4 << 20;

/// How many released blocks are kept at most.
pub const SLOTS: usize = 16;

/// The limit a fresh `KeptMemory` has: a 1 GiB gradient's block (its usable size is a
/// page more than 1 GiB) and another large one fit.
pub const DEFAULT_LIMIT: usize = 2 << 30;

/// malloc's alignment on the 64-bit targets (what `System` gives without
/// `posix_memalign`): a block with a larger alignment is not one of malloc's own.
const MALLOC_ALIGN: usize = 16;

/// One kept block: its address and usable size (0: the slot is empty), and when it was
/// kept (a count, for "the oldest first").
#[derive(Clone, Copy, Default)]
struct Block {
    address: usize,
    size: usize,
    kept_at: u64,
}

/// The blocks and their total, behind `KeptMemory`'s lock.
struct Kept {
    blocks: [Block; SLOTS],
    held: usize,
    clock: u64,
}

/// What `KeptMemory` holds and has done, for the Python `kept_memory()`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeptStats {
    pub limit: usize,
    /// Bytes kept now, and in how many blocks.
    pub held: usize,
    pub blocks: usize,
    /// Allocations served from a kept block so far.
    pub reused: u64,
}

/// An allocator over `System` that keeps released large blocks (see the module comment).
pub struct KeptMemory {
    /// A spin lock (`fork::SpinLock`), not a `Mutex`: the allocator runs before anything
    /// else (no allocation, no lazy initialisation), and the `fork` handlers hold it.
    kept: SpinLock<Kept>,
    limit: AtomicUsize,
    reused: AtomicU64,
}

impl KeptMemory {
    pub const fn new(limit: usize) -> Self {
        Self {
            kept: SpinLock::new(Kept {
                blocks: [Block {
                    address: 0,
                    size: 0,
                    kept_at: 0,
                }; SLOTS],
                held: 0,
                clock: 0,
            }),
            limit: AtomicUsize::new(limit),
            reused: AtomicU64::new(0),
        }
    }

    /// Keep at most `limit` bytes from now on (0: keep nothing); blocks over it go back
    /// to the system at once.
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
        self.trim(limit);
    }

    /// Hand every kept block back to the system; the bytes that were kept.
    pub fn release(&self) -> usize {
        let held = self.with_kept(|kept| kept.held);
        self.trim(0);
        held
    }

    /// The most bytes kept.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> KeptStats {
        let (held, blocks) =
            self.with_kept(|kept| (kept.held, kept.blocks.iter().filter(|b| b.size > 0).count()));
        KeptStats {
            limit: self.limit(),
            held,
            blocks,
            reused: self.reused.load(Ordering::Relaxed),
        }
    }

    /// Hold the lock across `fork` (with the other locks of ours: `fork`), so that a child
    /// forked while another thread held it does not wait for ever at its first large
    /// allocation. For the one global instance; once.
    pub fn make_fork_safe(&'static self) {
        crate::fork::guard_across_fork(&self.kept);
    }

    fn with_kept<R>(&self, f: impl FnOnce(&mut Kept) -> R) -> R {
        self.kept.with(f)
    }

    /// A kept block for `size` bytes: the smallest of at least `size` and at most twice it.
    fn take(&self, size: usize) -> Option<*mut u8> {
        let taken = self.with_kept(|kept| {
            let best = kept
                .blocks
                .iter_mut()
                .filter(|b| b.size >= size && b.size / 2 <= size)
                .min_by_key(|b| b.size)?;
            let block = std::mem::take(best);
            kept.held -= block.size;
            Some(block.address)
        })?;
        self.reused.fetch_add(1, Ordering::Relaxed);
        Some(taken as *mut u8)
    }

    /// Keep the released block at `ptr` (`size` usable bytes), making room by handing the
    /// oldest back; false when it is not kept (then the caller frees it).
    fn keep(&self, ptr: *mut u8, size: usize) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        if size > limit {
            return false;
        }
        let mut evicted = [0usize; SLOTS];
        let mut n = 0;
        self.with_kept(|kept| {
            while kept.held + size > limit || kept.blocks.iter().all(|b| b.size > 0) {
                let Some(oldest) = kept
                    .blocks
                    .iter_mut()
                    .filter(|b| b.size > 0)
                    .min_by_key(|b| b.kept_at)
                else {
                    break;
                };
                let block = std::mem::take(oldest);
                kept.held -= block.size;
                evicted[n] = block.address;
                n += 1;
            }
            kept.clock += 1;
            if let Some(free) = kept.blocks.iter_mut().find(|b| b.size == 0) {
                *free = Block {
                    address: ptr as usize,
                    size,
                    kept_at: kept.clock,
                };
                kept.held += size;
            }
        });
        // The system's frees (munmap, for blocks this large) outside the lock.
        for &address in &evicted[..n] {
            // SAFETY: each address is a block `keep` was given, from malloc, no longer
            // in a slot; freed once.
            unsafe { free_block(address as *mut u8) };
        }
        true
    }

    /// Hand blocks back until at most `limit` bytes are kept, the oldest first.
    fn trim(&self, limit: usize) {
        loop {
            let address = self.with_kept(|kept| {
                if kept.held <= limit {
                    return None;
                }
                let oldest = kept
                    .blocks
                    .iter_mut()
                    .filter(|b| b.size > 0)
                    .min_by_key(|b| b.kept_at)?;
                let block = std::mem::take(oldest);
                kept.held -= block.size;
                Some(block.address)
            });
            match address {
                // SAFETY: as in `keep`: a malloc block taken out of its slot, freed once.
                Some(address) => unsafe { free_block(address as *mut u8) },
                None => return,
            }
        }
    }
}

/// Whether a block of `layout` is one that is kept: large, at malloc's alignment (so
/// `System` got it from malloc and frees it with free).
fn kept_kind(layout: &Layout) -> bool {
    cfg!(target_os = "linux") && layout.size() >= KEEP_FROM && layout.align() <= MALLOC_ALIGN
}

/// The usable size of malloc block `ptr`.
///
/// # Safety
/// `ptr` must be a live block from malloc.
unsafe fn usable_size(ptr: *mut u8) -> usize {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: the caller's promise: a live malloc block.
        unsafe { libc::malloc_usable_size(ptr.cast()) }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = ptr;
        0
    }
}

/// # Safety
/// `ptr` must be a live block from malloc, not used again.
unsafe fn free_block(ptr: *mut u8) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: the caller's promise.
        unsafe { libc::free(ptr.cast()) }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = ptr;
}

// SAFETY: every block handed out is either `System`'s or a kept block of at least the
// requested size and at malloc's alignment (16, at least the layout's); released blocks
// are either kept (never handed out twice: `take` empties the slot) or given back to
// `System`/free, which own them. `realloc` keeps the first `layout.size()` bytes.
unsafe impl GlobalAlloc for KeptMemory {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if kept_kind(&layout) {
            if let Some(ptr) = self.take(layout.size()) {
                return ptr;
            }
        }
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(layout) }
    }

    // Zeroed memory stays the system's: fresh pages from the kernel are zero already,
    // where a kept block would need a pass to clear it.
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: a kept kind of block came from malloc (kept or System's); it is live.
        if kept_kind(&layout) && self.keep(ptr, unsafe { usable_size(ptr) }) {
            return;
        }
        // SAFETY: the caller's block and layout, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let grown = Layout::from_size_align(new_size, layout.align());
        if let Ok(grown) = grown {
            if kept_kind(&grown) && layout.align() <= MALLOC_ALIGN {
                // SAFETY: at malloc's alignment, a block System got from malloc (or a
                // kept one); it is live.
                let usable = unsafe { usable_size(ptr) };
                if new_size <= usable {
                    // Room enough already (a kept block larger than asked for): keep it
                    // all, so that it is kept whole when released.
                    return ptr;
                }
                if let Some(new) = self.take(new_size) {
                    // SAFETY: the old block holds `layout.size()` bytes, the new one at
                    // least `new_size` > that; two different live blocks.
                    unsafe {
                        std::ptr::copy_nonoverlapping(ptr, new, layout.size());
                        self.dealloc(ptr, layout);
                    }
                    return new;
                }
            }
        }
        // SAFETY: the caller's block, layout and size, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests;
