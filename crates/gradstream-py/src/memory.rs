//! The extension's global allocator, gradstream-core's `KeptMemory` (released results'
//! large blocks kept for the next results), and the functions that read and set it:
//! `keep_memory`, `kept_memory`, `release_memory` (Python's `gradstream/_memory.py`).
//!
//! Uses only gradstream-core's `kept`; lib.rs registers the functions.

use gradstream_core::kept::{KeptMemory, DEFAULT_LIMIT};
use pyo3::prelude::*;

#[global_allocator]
static MEMORY: KeptMemory = KeptMemory::new(DEFAULT_LIMIT);

/// Called once at import: the allocator's lock is taken around `fork` from now on.
pub fn init() {
    MEMORY.make_fork_safe();
}

/// Keep at most `limit` bytes of released results' memory from now on (0: none).
#[pyfunction]
pub fn keep_memory(limit: usize) {
    MEMORY.set_limit(limit);
}

/// `(limit, held, blocks, reused)`.
#[pyfunction]
pub fn kept_memory() -> (usize, usize, usize, u64) {
    let stats = MEMORY.stats();
    (stats.limit, stats.held, stats.blocks, stats.reused)
}

/// Hand every kept block back to the system; the bytes that were kept.
#[pyfunction]
pub fn release_memory(py: Python<'_>) -> usize {
    // munmap of large blocks: without the GIL.
    py.detach(|| MEMORY.release())
}
