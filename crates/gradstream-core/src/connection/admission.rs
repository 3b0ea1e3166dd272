//! Who a listener lets start a handshake (docs/guides/limits.md "A listener under a
//! flood", docs/spec/threat-model.md): the table of handshakes under way, capped in all
//! and per source, which makes room by dropping the oldest silent one past a short grace,
//! with a bounded queue of the connections waiting for a place; and the table of
//! failed authentications per source, which refuses a source that failed too often
//! (online guessing of the authkey). Both are bounded whatever the peers do, and both are
//! plain data: the listener's accept loop owns them and gives them the time.
//!
//! Uses nothing of the crate; used by `listener`.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
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
    /// A same-host peer (a Unix-domain connection): its user.
    Uid(u32),
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
            Self::Uid(uid) => write!(f, "uid {uid}"),
        }
    }
}

/// What a handshake under way tells the accept loop as it runs: whether the peer has
/// sent a byte yet, and how many bytes of the gradstream handshake it sent.
#[derive(Debug, Default)]
pub struct Heard {
    first: AtomicBool,
    bytes: AtomicUsize,
    /// The handshake succeeded (what fails after it, a same-host peer's rings, is no
    /// failed authentication).
    shaken: AtomicBool,
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

    /// The handshake succeeded (said before what follows it: a Unix peer's rings, a
    /// stream's grant or join).
    pub fn shook_hands(&self) {
        self.shaken.store(true, Ordering::Relaxed);
    }

    pub fn has_shaken_hands(&self) -> bool {
        self.shaken.load(Ordering::Relaxed)
    }
}

/// Why a listener closed a connection itself, before or during its handshake (the
/// handshake's own failures are its errors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shed {
    /// `max_connections` links are open.
    Full { max_connections: usize },
    /// It waited for a place among the handshakes while `waiting` others did (as many as
    /// `max_pending_handshakes`), and a newer connection needed its place in the queue:
    /// it was the oldest waiting of the newcomer's source (`own_source`), else of all.
    Displaced { waiting: usize, own_source: bool },
    /// It was the oldest silent handshake, under way for `EVICTION_GRACE` at least, when
    /// a newer peer needed its place.
    Evicted,
    /// It sent nothing within `hello_timeout`.
    Silent { hello_timeout: Duration },
    /// A same-host peer of another user than the listener admits.
    Uid { uid: u32, allowed: u32 },
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
            Self::Displaced {
                waiting,
                own_source,
            } => write!(
                f,
                "waited for a place among the handshakes under way while {waiting} \
                 connections waited (max_pending_handshakes), and was the oldest waiting {} \
                 when a newer one arrived: closed",
                if *own_source {
                    "of the newcomer's source"
                } else {
                    "of all"
                }
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
            Self::Uid { uid, allowed } => write!(
                f,
                "a process of uid {uid}, where this listener admits uid {allowed} only: closed \
                 at once (listen with allowed_uid=None to admit any user that can open the \
                 socket file)"
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

/// How long a handshake under way is safe from eviction however silent it is: a
/// conforming client sends its hello (or TLS ClientHello) as soon as it is connected, but
/// the listener reads it only once the handshake's task first runs, which for a burst of
/// hundreds of peers accepted at once can be milliseconds later on a loaded machine; until
/// then an honest peer looks silent. 250 ms is two orders of magnitude above that delay,
/// and short next to `hello_timeout` (3 s), so that a silent socket still gives way soon
/// (docs/guides/limits.md "A listener under a flood").
pub const EVICTION_GRACE: Duration = Duration::from_millis(250);

/// One handshake under way.
struct Pending<H> {
    source: Source,
    heard: Arc<Heard>,
    /// When its handshake began (it was placed), for `EVICTION_GRACE`.
    since: Instant,
    /// What drops it (the task's abort handle).
    handle: H,
}

/// What gave way while the table placed connections.
#[derive(Debug, PartialEq, Eq)]
pub enum Gone<W, H> {
    /// A handshake under way, evicted (the oldest silent one past `EVICTION_GRACE`):
    /// its handle, to be dropped.
    Evicted(H),
    /// A connection that waited for a place, pushed out of the full queue, and why.
    Displaced(W, Shed),
}

/// The handshakes under way, oldest first, counted in all and per source; and the
/// connections waiting for a place among them, oldest first, at most as many as
/// `max_pending_handshakes`. `W` is a waiting connection, `H` what drops a handshake.
pub struct PendingTable<W, H> {
    cap: usize,
    per_source: usize,
    next: u64,
    pending: BTreeMap<u64, Pending<H>>,
    by_source: HashMap<Source, usize>,
    waiting: VecDeque<(Source, W)>,
}

impl<W, H> PendingTable<W, H> {
    pub fn new(settings: &Admission) -> Self {
        Self {
            cap: settings.max_pending_handshakes.max(1),
            per_source: settings.max_pending_per_source.max(1),
            next: 0,
            pending: BTreeMap::new(),
            by_source: HashMap::new(),
            waiting: VecDeque::new(),
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.pending.len()
    }

    /// Connections waiting for a place.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// A connection from `source` arrived at `now`: its handshake begins at once when
    /// there is room (`start` begins it, given its ticket and its `Heard`, and returns
    /// its handle), else it waits for a place. When the queue is full, the oldest waiting
    /// connection of its source gives way, else the oldest waiting of all.
    pub fn arrive(
        &mut self,
        source: Source,
        connection: W,
        now: Instant,
        start: impl FnMut(u64, Source, W, Arc<Heard>) -> H,
    ) -> Vec<Gone<W, H>> {
        self.waiting.push_back((source, connection));
        let mut gone = self.place(now, start);
        if self.waiting.len() > self.cap {
            // Not the newcomer (the last): it is the newest.
            let last = self.waiting.len() - 1;
            let own = self.waiting.iter().position(|(s, _)| *s == source);
            let (index, why) = match own {
                Some(index) if index < last => (
                    index,
                    Shed::Displaced {
                        waiting: self.cap,
                        own_source: true,
                    },
                ),
                _ => (
                    0,
                    Shed::Displaced {
                        waiting: self.cap,
                        own_source: false,
                    },
                ),
            };
            if let Some((_, displaced)) = self.waiting.remove(index) {
                gone.push(Gone::Displaced(displaced, why));
            }
        }
        gone
    }

    /// Begin the handshakes of the waiting connections there is room for now, oldest
    /// first (after a handshake ended, or at `next_wake`). A connection finds room when
    /// its source is under `max_pending_per_source` and the table under
    /// `max_pending_handshakes`, or when a handshake of that scope (its source's, or
    /// any) is evictable: silent, and under way for `EVICTION_GRACE` at least; the
    /// oldest such gives way.
    pub fn place(
        &mut self,
        now: Instant,
        mut start: impl FnMut(u64, Source, W, Arc<Heard>) -> H,
    ) -> Vec<Gone<W, H>> {
        let mut gone = Vec::new();
        if self.waiting.is_empty() {
            return gone;
        }
        // Sources found without room in this pass: each is looked at once, so that a
        // queue full of one source costs one look, not one per connection.
        let mut blocked = HashSet::new();
        let mut full = false;
        let mut kept = VecDeque::with_capacity(self.waiting.len());
        for (source, connection) in std::mem::take(&mut self.waiting) {
            if full || blocked.contains(&source) {
                kept.push_back((source, connection));
                continue;
            }
            let scope = if self.from(source) >= self.per_source {
                Some(Some(source))
            } else if self.pending.len() >= self.cap {
                Some(None)
            } else {
                None
            };
            if let Some(scope) = scope {
                match self.oldest_evictable(scope, now) {
                    Some(oldest) => gone.extend(self.finish(oldest).map(Gone::Evicted)),
                    None => {
                        match scope {
                            Some(source) => {
                                blocked.insert(source);
                            }
                            None => full = true,
                        }
                        kept.push_back((source, connection));
                        continue;
                    }
                }
            }
            self.next += 1;
            let ticket = self.next;
            let heard = Arc::new(Heard::default());
            let handle = start(ticket, source, connection, heard.clone());
            self.pending.insert(
                ticket,
                Pending {
                    source,
                    heard,
                    since: now,
                    handle,
                },
            );
            *self.by_source.entry(source).or_default() += 1;
        }
        self.waiting = kept;
        gone
    }

    /// When a waiting connection may next find room without a handshake ending: the
    /// moment the oldest silent handshake still within `EVICTION_GRACE` leaves it. None
    /// when nothing waits, or no handshake is silent within its grace.
    pub fn next_wake(&self, now: Instant) -> Option<Instant> {
        if self.waiting.is_empty() {
            return None;
        }
        self.pending
            .values()
            .filter(|p| p.heard.silent())
            .map(|p| p.since.checked_add(EVICTION_GRACE).unwrap_or(p.since))
            .find(|&at| at > now)
    }

    /// Take every waiting connection of `source` (locked out: they are closed).
    pub fn remove_waiting(&mut self, source: Source) -> Vec<W> {
        let mut removed = Vec::new();
        let mut kept = VecDeque::with_capacity(self.waiting.len());
        for (s, connection) in std::mem::take(&mut self.waiting) {
            if s == source {
                removed.push(connection);
            } else {
                kept.push_back((s, connection));
            }
        }
        self.waiting = kept;
        removed
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

    /// The oldest handshake of `scope` (a source, or all) silent and under way for
    /// `EVICTION_GRACE` at least. The table is in order of placement: the look stops at
    /// the first handshake still within its grace.
    fn oldest_evictable(&self, scope: Option<Source>, now: Instant) -> Option<u64> {
        self.pending
            .iter()
            .take_while(|(_, p)| now.saturating_duration_since(p.since) >= EVICTION_GRACE)
            .filter(|(_, p)| scope.is_none_or(|s| p.source == s))
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
