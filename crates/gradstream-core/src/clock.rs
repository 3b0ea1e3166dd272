//! The clock and the counters of one transfer: `Progress` (what moved so far, readable
//! from any thread), `Waits` (the timeout and deadline asked for), `Clock` (those waits
//! running) and `within` (one I/O wait under the clock). Shared by the stream's sender and
//! receiver (`stream`), the caller-thread steps (`at_hand`),
//! tensor sets and connections; uses only `error`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{GradientStreamError, Result};

/// Counters a transfer updates as it goes, readable from any thread.
#[derive(Debug, Default)]
pub struct Progress {
    pub bytes: AtomicU64,
    pub chunks: AtomicU64,
    pub total_chunks: AtomicU64,
}

impl Progress {
    pub fn add(&self, bytes: usize, chunks: u64) {
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.chunks.fetch_add(chunks, Ordering::Relaxed);
    }

    /// Counters add up over transfers, so one object can follow a `receive_iter`.
    pub fn add_total(&self, total: u32) {
        self.total_chunks
            .fetch_add(u64::from(total), Ordering::Relaxed);
    }
}

/// How long a transfer may wait: `timeout`, the longest time without a byte moving, and
/// `deadline`, the longest a whole transfer (one gradient, or one tensor set) may take
/// from its first byte. Settings; the clock of one transfer is `Clock`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Waits {
    pub timeout: Option<Duration>,
    pub deadline: Option<Duration>,
}

impl From<Option<Duration>> for Waits {
    /// A timeout alone (the original's API has neither).
    fn from(timeout: Option<Duration>) -> Self {
        Self {
            timeout,
            deadline: None,
        }
    }
}

/// One transfer's clock: its waits, and when its deadline began (a sender's at once, a
/// receiver's at the first byte that arrives, so that waiting for a gradient to begin is
/// idle time, not the transfer's).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clock {
    waits: Waits,
    since: Option<Instant>,
}

impl Clock {
    /// A receiver's clock: the deadline starts with `start`.
    pub(crate) fn idle(waits: impl Into<Waits>) -> Self {
        Self {
            waits: waits.into(),
            since: None,
        }
    }

    /// A sender's clock: the deadline runs from now.
    pub(crate) fn running(waits: impl Into<Waits>) -> Self {
        let mut clock = Self::idle(waits);
        clock.start();
        clock
    }

    /// Start the deadline, if it has not started.
    pub(crate) fn start(&mut self) {
        self.since.get_or_insert_with(Instant::now);
    }

    /// The next wait's bound and the error its expiry means, `at` (chunks moved, total)
    /// saying how far the transfer had got.
    fn bound(
        &self,
        (received, total): (usize, Option<u32>),
    ) -> Option<(Duration, GradientStreamError)> {
        let stall = self.waits.timeout.map(|limit| {
            let error = GradientStreamError::Timeout {
                timeout: limit.as_secs_f64(),
                received,
                total,
            };
            (limit, error)
        });
        let late = self
            .waits
            .deadline
            .zip(self.since)
            .map(|(deadline, since)| {
                let error = GradientStreamError::Deadline {
                    deadline: deadline.as_secs_f64(),
                    received,
                    total,
                };
                (deadline.saturating_sub(since.elapsed()), error)
            });
        match (stall, late) {
            (Some(stall), Some(late)) => Some(if late.0 < stall.0 { late } else { stall }),
            (stall, late) => stall.or(late),
        }
    }
}

/// Run one I/O wait under the transfer's clock: the timeout, or what is left of the
/// deadline when that is shorter; on expiry, the error says which, and how far the
/// transfer had got (`at`: chunks moved, total).
pub(crate) async fn within<T>(
    clock: &Clock,
    at: (usize, Option<u32>),
    io: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T> {
    match clock.bound(at) {
        None => Ok(io.await?),
        Some((limit, expired)) => match tokio::time::timeout(limit, io).await {
            Ok(done) => Ok(done?),
            Err(_) => Err(expired),
        },
    }
}
