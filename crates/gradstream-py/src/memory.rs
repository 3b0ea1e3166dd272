//! What the extension keeps for the next results: its global allocator, gradstream-core's
//! `KeptMemory` (released results' large blocks), and the last large `bytes` result,
//! written again by the next `encode_frames` of the same length once the caller has let go
//! of it. The functions `keep_memory`, `kept_memory`, `release_memory` read and set both
//! (Python's `gradstream/_memory.py`).
//!
//! Why the `bytes`: its memory is CPython's (malloc, then munmap on release), so the
//! allocator cannot keep it, and a new 512 MiB `bytes` per call faults in fresh memory,
//! on the development VM a host fault per page once the host has taken freed memory
//! back (README "Results without out="). A `bytes` whose only reference is ours is one
//! no code can see any more: writing it again is as safe as writing a new one, the way
//! numpy reuses a temporary array whose reference count says nobody else holds it. Its
//! cached hash is reset first; where that hash lives is checked once against CPython's
//! own (`bytes_hash_slot`), and without that check nothing is reused.
//!
//! Uses gradstream-core's `kept`; lib.rs registers the functions, `buffers` asks for and
//! offers the `bytes`.

use std::sync::{Mutex, OnceLock};

use gradstream_core::kept::{KeptMemory, DEFAULT_LIMIT, KEEP_FROM};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

#[global_allocator]
static MEMORY: KeptMemory = KeptMemory::new(DEFAULT_LIMIT);

/// The last large `bytes` result, and how many times one was written again.
static LAST_BYTES: Mutex<Option<Py<PyBytes>>> = Mutex::new(None);
static BYTES_REUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Called once at import: the allocator's lock is taken around `fork` from now on.
pub fn init() {
    MEMORY.make_fork_safe();
}

/// Keep at most `limit` bytes of released results' memory from now on (0: none).
#[pyfunction]
pub fn keep_memory(py: Python<'_>, limit: usize) {
    MEMORY.set_limit(limit);
    let mut last = lock_last(py);
    if last
        .as_ref()
        .is_some_and(|b| b.bind(py).len().is_ok_and(|n| n > limit))
    {
        *last = None;
    }
}

/// `(limit, held, blocks, reused)`: the allocator's, with the last `bytes` when only we
/// hold it.
#[pyfunction]
pub fn kept_memory(py: Python<'_>) -> (usize, usize, usize, u64) {
    let stats = MEMORY.stats();
    let (mut held, mut blocks) = (stats.held, stats.blocks);
    if let Some(bytes) = lock_last(py).as_ref().map(|b| b.bind(py)) {
        if only_ours(bytes) {
            held += bytes.as_bytes().len();
            blocks += 1;
        }
    }
    let reused = stats.reused + BYTES_REUSED.load(std::sync::atomic::Ordering::Relaxed);
    (stats.limit, held, blocks, reused)
}

/// Hand every kept block back to the system; the bytes that were kept.
#[pyfunction]
pub fn release_memory(py: Python<'_>) -> usize {
    let (_, held, _, _) = kept_memory(py);
    lock_last(py).take();
    // munmap of large blocks: without the GIL.
    py.detach(|| MEMORY.release());
    held
}

/// The last large `bytes` result, if it is `len` bytes long and nobody but us holds it:
/// then its cached hash is reset and it is the caller's to write over.
pub fn reusable_bytes<'py>(py: Python<'py>, len: usize) -> Option<Bound<'py, PyBytes>> {
    if len < KEEP_FROM || !bytes_hash_slot(py) {
        return None;
    }
    let mut last = lock_last(py);
    let bytes = last.as_ref()?.bind(py);
    if !only_ours(bytes) || bytes.as_bytes().len() != len {
        return None;
    }
    let bytes = last.take()?.into_bound(py);
    // SAFETY: `bytes_hash_slot` found the cached hash in the `Py_hash_t` just before the
    // data, inside the object's header; nobody else holds the object (one reference,
    // now `bytes`), so no one reads it while it changes.
    unsafe {
        let data = ffi::PyBytes_AsString(bytes.as_ptr()).cast::<ffi::Py_hash_t>();
        data.sub(1).write_unaligned(-1);
    }
    BYTES_REUSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Some(bytes)
}

/// Remember `bytes`, a large result about to be returned, for `reusable_bytes`.
pub fn offer_bytes(py: Python<'_>, bytes: &Bound<'_, PyBytes>) {
    let len = bytes.as_bytes().len();
    if len < KEEP_FROM || len > MEMORY.limit() || !bytes_hash_slot(py) {
        return;
    }
    *lock_last(py) = Some(bytes.clone().unbind());
}

/// Whether the one reference to `bytes` is the slot's (or the caller's one handle).
fn only_ours(bytes: &Bound<'_, PyBytes>) -> bool {
    // SAFETY: a live object, its count read with the GIL held.
    unsafe { ffi::Py_REFCNT(bytes.as_ptr()) == 1 }
}

fn lock_last(_py: Python<'_>) -> std::sync::MutexGuard<'static, Option<Py<PyBytes>>> {
    // Taken with the GIL held only, so never contended for long; a panic while it was
    // held left nothing half-done (it only swaps an Option).
    LAST_BYTES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether this interpreter's `bytes` keeps its cached hash in the `Py_hash_t` just
/// before its data (CPython 3.11 to 3.14 do, `ob_shash`): a probe's hash, computed by
/// CPython, is looked for there. Checked once.
fn bytes_hash_slot(py: Python<'_>) -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        let probe = PyBytes::new(py, b"gradstream: where does a bytes object keep its hash?");
        let Ok(hash) = probe.hash() else {
            return false;
        };
        // SAFETY: a read of the 8 bytes before the data, inside the object's header (at
        // least the 24 bytes of PyObject_VAR_HEAD precede the data); nothing is written.
        let slot = unsafe {
            let data = ffi::PyBytes_AsString(probe.as_ptr()).cast::<ffi::Py_hash_t>();
            data.sub(1).read_unaligned()
        };
        slot == hash && hash != -1
    })
}
