//! Who a listener lets start a handshake (docs/guides/limits.md "A listener under a
//! flood", docs/spec/threat-model.md): the table of handshakes under way, capped in all
//! and per source, which makes room by dropping the oldest silent one; and the table of
//! failed authentications per source, which refuses a source that failed too often
//! (online guessing of the authkey). Both are bounded whatever the peers do, and both are
//! plain data: the listener's accept loop owns them and gives them the time.
//!
//! Uses nothing of the crate; used by `listener`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A listener's admission settings (the keywords of `listen` of the same names); the
/// defaults are the documented ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    /// Handshakes under way at once, from all sources.
    pub max_pending_handshakes: usize,
    /// Handshakes under way at once from one source (an IPv4 address, an IPv6 /64).
    pub max_pending_per_source: usize,
    /// How long a peer may stay silent after its accept: past it, without a first byte,
    /// it is dropped (a conforming client sends its hello, or its TLS ClientHello, at once).
    pub hello_timeout: Duration,
    /// Failed authentications from one source within `auth_failure_window` after which
    /// its connections are refused until that window ends.
    pub max_auth_failures: u32,
    pub auth_failure_window: Duration,
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            max_pending_handshakes: 256,
            max_pending_per_source: 64,
            hello_timeout: Duration::from_secs(3),
            max_auth_failures: 10,
            auth_failure_window: Duration::from_secs(60),
        }
    }
}

/// Sources the failure table remembers at most; past it the entry whose window began
/// first gives way.
pub const FAILURE_TABLE: usize = 4096;

/// Where a peer connects from, as the caps count it: an IPv4 address, or an IPv6
/// address's /64 (a host is given a whole /64; an IPv4-mapped address is its IPv4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    V4(std::net::Ipv4Addr),
    V6(u64),
}

impl Source {
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self::V4(v4),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Self::V4(v4),
                None => Self::V6((u128::from(v6) >> 64) as u64),
            },
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::V4(v4) => write!(f, "{v4}"),
            Self::V6(prefix) => {
                let address = std::net::Ipv6Addr::from(u128::from(*prefix) << 64);
                write!(f, "{address}/64")
            }
        }
    }
}

/// What a handshake under way tells the accept loop as it runs: whether the peer has
/// sent a byte yet, and how many bytes of the gradstream handshake it sent.
#[derive(Debug, Default)]
pub struct Heard {
    first: AtomicBool,
    bytes: AtomicUsize,
}

impl Heard {
    /// The peer's first byte arrived.
    pub fn first_byte(&self) {
        self.first.store(true, Ordering::Relaxed);
    }

    /// `n` more bytes of the handshake arrived (and so its first byte).
    pub fn handshake_bytes(&self, n: usize) {
        if n > 0 {
            self.first_byte();
            self.bytes.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub fn silent(&self) -> bool {
        !self.first.load(Ordering::Relaxed)
    }

    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// Why a listener closed a connection itself, before or during its handshake (the
/// handshake's own failures are its errors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shed {
    /// `max_connections` links are open.
    Full { max_connections: usize },
    /// `max_pending_per_source` handshakes from its source are under way, none silent.
    SourceBusy { source: Source, cap: usize },
    /// `max_pending_handshakes` handshakes are under way, none silent.
    Busy { cap: usize },
    /// It was the oldest silent handshake when a newer peer needed its place.
    Evicted,
    /// It sent nothing within `hello_timeout`.
    Silent { hello_timeout: Duration },
    /// Its source failed authentication too often (online guessing).
    Guessing {
        source: Source,
        failures: u32,
        window: Duration,
        retry_in: Duration,
    },
}

impl fmt::Display for Shed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |d: &Duration| d.as_secs_f64();
        match self {
            Self::Full { max_connections } => write!(
                f,
                "max_connections ({max_connections}) connections are open: closed at once \
                 (raise max_connections, or close idle connections)"
            ),
            Self::SourceBusy { source, cap } => write!(
                f,
                "{cap} handshakes from {source} are under way (max_pending_per_source), none \
                 silent: closed at once"
            ),
            Self::Busy { cap } => write!(
                f,
                "{cap} handshakes are under way (max_pending_handshakes), none silent: closed \
                 at once"
            ),
            Self::Evicted => write!(
                f,
                "silent, and the oldest silent handshake when a newer peer needed its place"
            ),
            Self::Silent { hello_timeout } => write!(
                f,
                "sent nothing within hello_timeout ({:.3} s)",
                s(hello_timeout)
            ),
            Self::Guessing {
                source,
                failures,
                window,
                retry_in,
            } => write!(
                f,
                "{failures} failed authentications from {source} within auth_failure_window \
                 ({:.0} s): its connections are refused for {:.1} s more (a peer with \
                 another authkey, or one guessing it)",
                s(window),
                s(retry_in)
            ),
        }
    }
}

/// One handshake under way.
struct Pending<H> {
    source: Source,
    heard: Arc<Heard>,
    /// What drops it (the task's abort handle).
    handle: H,
}

/// The handshakes under way, oldest first, counted in all and per source.
pub struct PendingTable<H> {
    cap: usize,
    per_source: usize,
    next: u64,
    pending: BTreeMap<u64, Pending<H>>,
    by_source: HashMap<Source, usize>,
}

impl<H> PendingTable<H> {
    pub fn new(settings: &Admission) -> Self {
        Self {
            cap: settings.max_pending_handshakes.max(1),
            per_source: settings.max_pending_per_source.max(1),
            next: 0,
            pending: BTreeMap::new(),
            by_source: HashMap::new(),
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.pending.len()
    }

    /// Make room for a peer from `source`: at its source's cap, or at the cap in all,
    /// the oldest silent handshake of that scope gives way (its handle is returned, to be
    /// dropped); with none silent, the newcomer is refused.
    pub fn make_room(&mut self, source: Source) -> Result<Option<H>, Shed> {
        if self.from(source) >= self.per_source {
            let Some(oldest) = self.oldest_silent(Some(source)) else {
                return Err(Shed::SourceBusy {
                    source,
                    cap: self.per_source,
                });
            };
            return Ok(self.finish(oldest));
        }
        if self.pending.len() >= self.cap {
            let Some(oldest) = self.oldest_silent(None) else {
                return Err(Shed::Busy { cap: self.cap });
            };
            return Ok(self.finish(oldest));
        }
        Ok(None)
    }

    /// The next handshake's ticket (to `insert` and `finish` it by).
    pub fn ticket(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// A handshake from `source` began (after `make_room`).
    pub fn insert(&mut self, ticket: u64, source: Source, heard: Arc<Heard>, handle: H) {
        let entry = Pending {
            source,
            heard,
            handle,
        };
        self.pending.insert(ticket, entry);
        *self.by_source.entry(source).or_default() += 1;
    }

    /// The handshake of `ticket` is over (or dropped): its handle, if it was still here.
    pub fn finish(&mut self, ticket: u64) -> Option<H> {
        let gone = self.pending.remove(&ticket)?;
        if let Some(count) = self.by_source.get_mut(&gone.source) {
            *count -= 1;
            if *count == 0 {
                self.by_source.remove(&gone.source);
            }
        }
        Some(gone.handle)
    }

    fn from(&self, source: Source) -> usize {
        self.by_source.get(&source).copied().unwrap_or(0)
    }

    fn oldest_silent(&self, source: Option<Source>) -> Option<u64> {
        self.pending
            .iter()
            .filter(|(_, p)| source.is_none_or(|s| p.source == s))
            .find(|(_, p)| p.heard.silent())
            .map(|(ticket, _)| *ticket)
    }
}

/// One source's failed authentications in its current window.
#[derive(Clone, Copy)]
struct Failures {
    count: u32,
    since: Instant,
}

/// Failed authentications per source, at most `FAILURE_TABLE` sources: a source with
/// `max_auth_failures` failures within `auth_failure_window` of its first is refused
/// until that window ends; then its count starts again.
pub struct FailureTable {
    most: u32,
    window: Duration,
    capacity: usize,
    sources: HashMap<Source, Failures>,
}

impl FailureTable {
    pub fn new(settings: &Admission) -> Self {
        Self::with_capacity(settings, FAILURE_TABLE)
    }

    pub fn with_capacity(settings: &Admission, capacity: usize) -> Self {
        Self {
            most: settings.max_auth_failures.max(1),
            window: settings.auth_failure_window,
            capacity: capacity.max(1),
            sources: HashMap::new(),
        }
    }

    /// Why `source`'s connection is refused now, if it is.
    pub fn refused(&self, source: Source, now: Instant) -> Option<Shed> {
        let failures = self.sources.get(&source)?;
        let retry_in = self
            .window
            .saturating_sub(now.saturating_duration_since(failures.since));
        (failures.count >= self.most && !retry_in.is_zero()).then_some(Shed::Guessing {
            source,
            failures: failures.count,
            window: self.window,
            retry_in,
        })
    }

    /// `source` failed an authentication at `now`.
    pub fn failed(&mut self, source: Source, now: Instant) {
        if !self.sources.contains_key(&source) && self.sources.len() >= self.capacity {
            self.make_room(now);
        }
        let window = self.window;
        let failures = self.sources.entry(source).or_insert(Failures {
            count: 0,
            since: now,
        });
        if now.saturating_duration_since(failures.since) >= window {
            *failures = Failures {
                count: 0,
                since: now,
            };
        }
        failures.count = failures.count.saturating_add(1);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.sources.len()
    }

    /// Forget the sources whose window has ended; if none has, the source not locked out
    /// with the fewest failures (the oldest of those), and only when all are locked out,
    /// the one whose window began first: so that failures from fresh sources (a botnet,
    /// IPv6 /64s by the thousand) do not free the sources already locked out.
    fn make_room(&mut self, now: Instant) {
        let (window, most) = (self.window, self.most);
        self.sources
            .retain(|_, f| now.saturating_duration_since(f.since) < window);
        if self.sources.len() >= self.capacity {
            let oldest = self
                .sources
                .iter()
                .min_by_key(|(_, f)| (f.count >= most, f.count, f.since))
                .map(|(source, _)| *source);
            if let Some(oldest) = oldest {
                self.sources.remove(&oldest);
            }
        }
    }
}

#[cfg(test)]
mod tests;
