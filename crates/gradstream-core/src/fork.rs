//! Locks that survive `fork`: `SpinLock`, and the `fork` handlers that hold every
//! process-wide lock of ours across a fork (`guard_across_fork`).
//!
//! Why: a child forked while another thread of its parent held a lock has that lock held
//! for ever (the thread that would release it does not exist in the child), so its first
//! decode or large allocation waits for ever; found by `tests/codec/test_kept_memory.py`,
//! a child hung in the template cache's `Mutex`. `multiprocessing`'s default start method
//! on Linux forks. The handlers take the locks before the fork (waiting for any holder to
//! finish, which is short: no lock of ours is held across I/O or another lock of ours) and
//! drop them after it, in the parent and in the child.
//!
//! The locks: the template cache's two shelves (`template`) and the kept memory's
//! (`kept`, the allocator's; its lock is taken last, since a shelf's holder may allocate).
//! Uses libc (`pthread_atfork`) on Linux; used by `template` and `kept`.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

/// A lock with no allocation, no lazy set-up and a guard-free `hold`/`release`, so that
/// the allocator can use it and the `fork` handlers can take it and drop it later.
pub struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: `value` is only reached through `with`, which holds the lock for the whole
// access, so at most one thread sees it at a time (T: Send suffices).
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    pub const fn new(value: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Run `f` on the value with the lock held. `f` must not take this lock again.
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        self.hold();
        // Released even if `f` panics (a panic inside the allocator aborts anyway).
        struct Release<'a>(&'a AtomicBool);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _release = Release(&self.locked);
        // SAFETY: the lock is held until `_release` drops, after `f` returns: this is the
        // only reference to the value meanwhile.
        f(unsafe { &mut *self.value.get() })
    }

    /// Take the lock, waiting for a holder to let go (spinning a little, then yielding).
    fn hold(&self) {
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn release(&self) {
        self.locked.store(false, Ordering::Release);
    }
}

/// Something whose locks the `fork` handlers hold.
pub trait HeldAcrossFork: Sync {
    fn hold_all(&self);
    fn release_all(&self);
}

impl<T> HeldAcrossFork for SpinLock<T>
where
    SpinLock<T>: Sync,
{
    fn hold_all(&self) {
        self.hold();
    }
    fn release_all(&self) {
        self.release();
    }
}

/// The allocator's lock, held last (set once by `guard_across_fork`).
static ALLOCATOR: AtomicPtr<&'static dyn HeldAcrossFork> = AtomicPtr::new(std::ptr::null_mut());
static GUARDED: AtomicBool = AtomicBool::new(false);

/// Install the `fork` handlers (once per process; later calls do nothing): the template
/// cache's locks and then `allocator`'s are held across every fork.
pub fn guard_across_fork(allocator: &'static dyn HeldAcrossFork) {
    if GUARDED.swap(true, Ordering::AcqRel) {
        return;
    }
    // A `'static` place for the fat pointer, made once (leaked on purpose).
    let slot: &'static mut &'static dyn HeldAcrossFork = Box::leak(Box::new(allocator));
    ALLOCATOR.store(slot, Ordering::Release);
    #[cfg(target_os = "linux")]
    // SAFETY: the handlers are plain functions over `'static` locks.
    unsafe {
        libc::pthread_atfork(Some(before_fork), Some(after_fork), Some(after_fork));
    }
}

fn allocator() -> Option<&'static dyn HeldAcrossFork> {
    // SAFETY: null or the leaked `'static` slot `guard_across_fork` stored.
    unsafe { ALLOCATOR.load(Ordering::Acquire).as_ref().copied() }
}

#[cfg(target_os = "linux")]
extern "C" fn before_fork() {
    crate::template::hold_for_fork();
    if let Some(allocator) = allocator() {
        allocator.hold_all();
    }
}

#[cfg(target_os = "linux")]
extern "C" fn after_fork() {
    if let Some(allocator) = allocator() {
        allocator.release_all();
    }
    crate::template::release_after_fork();
}
