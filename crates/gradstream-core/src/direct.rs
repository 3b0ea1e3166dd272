//! `Direct`: a caller's thread driving a link's transfer itself, with system calls on
//! the link's socket instead of tokio's reactor (docs/performance.md, the caller-thread
//! driver). Shared by the TCP link's stream (`connection::link`) and the same-host
//! stream (`shm`), which make the calls; the bindings wait for what they recorded.
//!
//! Uses nothing of the crate.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

const DIRECT_ON: u8 = 1;
pub(crate) const WANTS_READ: u8 = 2;
pub(crate) const WANTS_WRITE: u8 = 4;

/// While on, a link's reads and writes are non-blocking system calls on its socket, a
/// `Poll::Pending` meaning "the socket would block" (recorded in `wants`), with no waker
/// registered: the caller waits for the descriptor (poll(2)) and polls the transfer
/// again. tokio's reactor is bypassed because its readiness, once a read would block,
/// says "not ready" until its own thread has seen the socket's event: a caller woken by
/// the kernel first would find the stream still pending. Turned off (`off`) before the
/// transfer goes on in a tokio task, whose reads then register as usual.
#[derive(Clone, Debug)]
pub struct Direct(Arc<AtomicU8>);

impl Default for Direct {
    fn default() -> Self {
        Self(Arc::new(AtomicU8::new(DIRECT_ON)))
    }
}

impl Direct {
    pub(crate) fn is_on(&self) -> bool {
        self.0.load(Ordering::Relaxed) & DIRECT_ON != 0
    }

    /// Back to tokio's reactor from now on.
    pub fn off(&self) {
        self.0.store(0, Ordering::Relaxed);
    }

    /// What the transfer waited for since the last call, `(read, write)`, forgotten.
    pub fn take_wants(&self) -> (bool, bool) {
        let was = self.0.fetch_and(DIRECT_ON, Ordering::Relaxed);
        (was & WANTS_READ != 0, was & WANTS_WRITE != 0)
    }

    /// The transfer waits for `what` (`WANTS_READ`, `WANTS_WRITE`) of the socket.
    #[cfg(target_os = "linux")] // only the direct system calls wait
    pub(crate) fn want(&self, what: u8) {
        self.0.fetch_or(what, Ordering::Relaxed);
    }
}
