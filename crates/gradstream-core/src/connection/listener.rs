//! The server side: a TCP listener whose peers become `Link`s only after TLS, the hello
//! and authentication, each under `handshake_timeout`; at most `max_connections` links
//! live at once. The listener takes every connection from the kernel at once and sorts
//! it (`admission`): refused at once, or a handshake within the caps on handshakes under
//! way, in all and per source, whose first byte must come within `hello_timeout`
//! (docs/guides/limits.md "A listener under a flood"). A peer that fails becomes a
//! `Refused` event (the caller logs it) and never a link; a source that fails
//! authentication too often is refused for a while.
//!
//! Uses `admission`, `handshake`, `link`, `tls`; used by the bindings.

use crate::error::PeerAt;
use std::net::SocketAddr;
#[cfg(target_os = "linux")]
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::{AbortHandle, JoinHandle, JoinSet};

mod accepted;
#[cfg(target_os = "linux")]
mod local;

use super::admission::{Admission, FailureTable, Gone, Heard, PendingTable, Shed, Source};
use super::handshake::{handshake, Shake};
use super::link::{Link, Peer, PeerAddress};
use super::streams::{Joined, Sessions};
use super::{buffered, Duplex, Protocol};
use crate::error::{GradientStreamError, Result};
use crate::frame::Limits;
use crate::protocol::{Role, HELLO_LEN};
use crate::tls::{self, TlsAcceptor};
use accepted::{not_allowed, source_of, Accepted, Incoming};
#[cfg(target_os = "linux")]
use local::{admit_local, bind_unix_socket};
#[cfg(target_os = "linux")]
pub use local::{LocalSettings, Rings};

/// How a listener admits peers: settings, shared by its handshakes.
#[derive(Clone)]
pub struct ListenSettings {
    pub protocol: Protocol,
    pub tls: Option<Arc<TlsAcceptor>>,
    pub authkey: Option<Vec<u8>>,
    /// Bounds each peer's TLS handshake, hello and authentication together.
    pub handshake_timeout: Duration,
    pub max_connections: usize,
    /// The caps on handshakes under way, the first byte's bound, and the online-guessing
    /// limit.
    pub admission: Admission,
    /// What this side accepts, told to each peer in its hello.
    pub limits: Limits,
    /// The most streams it grants one connection (docs/guides/across-the-internet.md,
    /// "Parallel streams"); each counts against `max_connections`.
    pub max_streams: u8,
    /// How long a link of a client that asked to resume waits for its streams to come
    /// back after a failure (docs/guides/across-the-internet.md, "Resume"); zero: this
    /// listener grants no resumes.
    pub resume_window: Duration,
    /// A Unix-domain listener's rule for its peers and its rings (`bind_unix`).
    #[cfg(target_os = "linux")]
    pub local: LocalSettings,
    /// Tests only: this side's hello nonce (see `DialSettings::test_nonce`); `None`.
    #[doc(hidden)]
    pub test_nonce: Option<[u8; 32]>,
}

/// Where a listener is bound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bound {
    Tcp(SocketAddr),
    #[cfg(target_os = "linux")]
    Unix(PathBuf),
}

impl Bound {
    /// The TCP port bound (0 for a Unix-domain socket).
    pub fn port(&self) -> u16 {
        match self {
            Self::Tcp(address) => address.port(),
            #[cfg(target_os = "linux")]
            Self::Unix(_) => 0,
        }
    }
}

/// Why a peer was dropped.
pub enum Refusal {
    /// Its handshake failed.
    Failed(GradientStreamError),
    /// It did not finish its handshake within `handshake_timeout` (this long).
    Silent(Duration),
    /// The listener closed it itself: a cap, a silence, a source locked out.
    Shed(Shed),
}

/// What happened at the listener.
pub enum Event {
    /// A peer through the handshake.
    Connected(Link),
    /// A peer dropped, and why.
    Refused { address: PeerAddress, why: Refusal },
}

/// The accept loop's task, shared by the listener and its `Stopper`.
type Accepting = Arc<std::sync::Mutex<Option<JoinHandle<()>>>>;

/// A bound listener: its events arrive in `next`; dropping it stops accepting.
pub struct Listener {
    events: mpsc::Receiver<Event>,
    address: Bound,
    accepting: Accepting,
}

/// Stops a listener's accept loop from anywhere, while a `next` may hold the listener.
pub struct Stopper(Accepting);

impl Stopper {
    /// Stop accepting, and return once the listening socket and the handshakes under way
    /// are gone (a peer connecting after this is refused by the kernel).
    pub async fn stop(&self) {
        let handle = self.0.lock().map(|mut h| h.take()).unwrap_or(None);
        if let Some(handle) = handle {
            handle.abort();
            // Cancelled, as asked: the loop's socket is dropped with it.
            let _ = handle.await;
        }
    }
}

impl Listener {
    pub async fn bind(host: &str, port: u16, settings: ListenSettings) -> Result<Self> {
        let tcp = bind_tcp(host, port, backlog(&settings)).await?;
        let address = tcp.local_addr()?;
        // The event queue: as deep as the handshakes under way (kept within what tokio's
        // channel takes: a setting past it must not panic the listener).
        let depth = settings.admission.max_pending_handshakes.clamp(1, 1 << 16);
        let (sender, events) = mpsc::channel(depth);
        let accepting = tokio::spawn(accept_loop(Incoming::Tcp(tcp), settings, sender));
        Ok(Self {
            events,
            address: Bound::Tcp(address),
            accepting: Arc::new(std::sync::Mutex::new(Some(accepting))),
        })
    }

    /// Listen on a Unix-domain socket at `path`, for processes of this host: the same
    /// hello, authkey, seals and acks as over TCP, the payloads through shared memory
    /// (`crate::shm`), peers of `settings.local.allowed_uid` only. The listener holds
    /// `PATH.lock` (`flock`): a second listener at the path is an error, a socket file
    /// left by a dead one is replaced, any other file is an error and left alone. The
    /// socket file's mode is set before it listens: 0600 when only this process's user is
    /// admitted, else 0666 (the uid check decides). It is removed when the listener stops
    /// accepting (`Stopper::stop` returns after it; a dropped listener's goes with its
    /// accept task). TLS and the seed protocol are refused: the kernel is the only party
    /// between the two processes, and the seed's frames have no hello to set rings up.
    #[cfg(target_os = "linux")]
    pub async fn bind_unix(path: &Path, settings: ListenSettings) -> Result<Self> {
        if settings.tls.is_some() || settings.protocol == Protocol::Seed {
            return Err(GradientStreamError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a unix: listener takes neither TLS nor protocol='seed': the kernel is the \
                 only party between two processes of one host (the peer's uid is checked, \
                 and an authkey still applies)",
            )));
        }
        let (unix, file) = bind_unix_socket(path, backlog(&settings), settings.local.allowed_uid)?;
        let depth = settings.admission.max_pending_handshakes.clamp(1, 1 << 16);
        let (sender, events) = mpsc::channel(depth);
        let incoming = Incoming::Unix(unix, file);
        let accepting = tokio::spawn(accept_loop(incoming, settings, sender));
        Ok(Self {
            events,
            address: Bound::Unix(path.to_path_buf()),
            accepting: Arc::new(std::sync::Mutex::new(Some(accepting))),
        })
    }

    /// Where it is bound (the port actually bound, for port 0).
    pub fn address(&self) -> &Bound {
        &self.address
    }

    /// What stops the accept loop from anywhere (the next `next` then ends).
    pub fn stopper(&self) -> Stopper {
        Stopper(self.accepting.clone())
    }

    /// The next connection or refusal; None once closed.
    pub async fn next(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    fn abort(&self) {
        if let Ok(Some(handle)) = self.accepting.lock().as_deref() {
            handle.abort();
        }
    }

    /// Stop accepting; handshakes under way are dropped.
    pub fn close(&mut self) {
        self.abort();
        self.events.close();
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.abort();
    }
}

/// What a finished handshake tells the accept loop.
struct Done {
    ticket: u64,
    source: Source,
    /// It counts as a failed authentication (`failed_authentication`).
    failed_authentication: bool,
}

/// Sends its `Done` to the accept loop when dropped.
struct Over {
    finished: mpsc::UnboundedSender<Done>,
    done: Option<Done>,
}

impl Drop for Over {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            let _ = self.finished.send(done);
        }
    }
}

/// What the pending table holds of a handshake: what drops it, and its peer's address.
type Handle = (AbortHandle, PeerAddress);

/// The kernel's backlog for these settings: what the listener could take at once (the
/// kernel caps it at net.core.somaxconn).
fn backlog(settings: &ListenSettings) -> u32 {
    let most = (settings.admission.max_pending_handshakes).saturating_add(settings.max_connections);
    u32::try_from(most).unwrap_or(u32::MAX).clamp(128, 65_535)
}

/// Bind `host:port` (the first of its addresses that binds, as `TcpListener::bind`
/// does) with `backlog`.
async fn bind_tcp(host: &str, port: u16, backlog: u32) -> Result<TcpListener> {
    let mut last = None;
    for address in tokio::net::lookup_host((host, port)).await? {
        let socket = if address.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        // As std and mio do on Unix: a restarted listener rebinds its port at once.
        #[cfg(unix)]
        socket.set_reuseaddr(true)?;
        match socket.bind(address).and_then(|()| socket.listen(backlog)) {
            Ok(listener) => return Ok(listener),
            Err(error) => last = Some(error),
        }
    }
    Err(last
        .unwrap_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{host} resolves to no address"),
            )
        })
        .into())
}

/// The listener's own refusal of `address`, for the log: never waits (a full event
/// queue drops it), so that a flood cannot slow the accepts.
fn tell(events: &mpsc::Sender<Event>, address: PeerAddress, why: Shed) {
    let _ = events.try_send(Event::Refused {
        address,
        why: Refusal::Shed(why),
    });
}

/// Connections being closed gently at once (`Closing`); past this many, at once.
const CLOSING: usize = 64;

/// How long a gently closed connection's bytes are read and dropped.
const CLOSING_FOR: Duration = Duration::from_secs(1);

/// Closes the connections the listener refuses at their accept: gently, while fewer
/// than `CLOSING` are being closed so (a FIN at once, then the peer's bytes read and
/// dropped until it closes, for at most `CLOSING_FOR`, so that its hello on the way
/// meets no reset and the peer reads the end of the connection, not an error), else at
/// once; either way the listener takes no more of the peer.
struct Closing(Arc<Semaphore>);

impl Closing {
    fn new() -> Self {
        Self(Arc::new(Semaphore::new(CLOSING)))
    }

    fn shed(
        &self,
        arrived: Arrived,
        why: Shed,
        events: &mpsc::Sender<Event>,
        tasks: &mut JoinSet<()>,
    ) {
        tell(events, arrived.address, why);
        let Ok(permit) = self.0.clone().try_acquire_owned() else {
            discard_pending(|b| arrived.stream.try_read(b));
            return;
        };
        tasks.spawn(async move {
            let mut stream = arrived.stream;
            let _ = tokio::time::timeout(CLOSING_FOR, async {
                stream.shutdown().await?;
                let mut sink = [0u8; 4096];
                while stream.read(&mut sink).await? > 0 {}
                std::io::Result::Ok(())
            })
            .await;
            drop(permit);
        });
    }
}

/// A connection taken from the kernel, waiting for its handshake to begin.
struct Arrived {
    stream: Accepted,
    address: PeerAddress,
    /// Its accept: `hello_timeout` runs from here, waiting included.
    accepted: Instant,
}

/// What the accept loop lends to begin a handshake.
struct Starter<'a> {
    settings: &'a Arc<ListenSettings>,
    sessions: &'a Sessions,
    connections: &'a Arc<Semaphore>,
    finished: &'a mpsc::UnboundedSender<Done>,
    events: &'a mpsc::Sender<Event>,
    tasks: &'a mut JoinSet<()>,
}

impl Starter<'_> {
    fn start(
        &mut self,
        ticket: u64,
        source: Source,
        arrived: Arrived,
        heard: Arc<Heard>,
    ) -> Handle {
        let address = arrived.address;
        let handle_address = address.clone();
        let task = handshake_task(
            Shaking {
                stream: arrived.stream,
                address,
                accepted: arrived.accepted,
                ticket,
                source,
                heard,
            },
            self.settings.clone(),
            self.sessions.clone(),
            self.connections.clone(),
            self.finished.clone(),
            self.events.clone(),
        );
        (self.tasks.spawn(task), handle_address)
    }
}

/// Accept every connection the kernel has, at once, and sort it: refused (its source is
/// locked out for failed authentications, or `max_connections` are open), or given to
/// the pending table, which begins its handshake when there is room (dropping the oldest
/// handshake silent past `EVICTION_GRACE` if need be) or keeps it waiting, in a bounded
/// queue, until a handshake ends or a silent one's grace does (docs/guides/limits.md "A
/// listener under a flood").
async fn accept_loop(incoming: Incoming, settings: ListenSettings, events: mpsc::Sender<Event>) {
    let connections = Arc::new(Semaphore::new(
        settings.max_connections.clamp(1, Semaphore::MAX_PERMITS),
    ));
    let mut pending = PendingTable::<Arrived, Handle>::new(&settings.admission);
    let mut failures = FailureTable::new(&settings.admission);
    let closing = Closing::new();
    let settings = Arc::new(settings);
    let sessions = Sessions::default();
    let (finished, mut done) = mpsc::unbounded_channel::<Done>();
    // The handshakes under way and the gentle closes: dropped with this loop (an aborted
    // one: a closed listener).
    let mut handshaking = JoinSet::new();
    loop {
        let wake = pending.next_wake(Instant::now());
        let arrived = tokio::select! {
            biased;
            Some(over) = done.recv() => {
                pending.finish(over.ticket);
                if over.failed_authentication {
                    let now = Instant::now();
                    failures.failed(over.source, now);
                    // Locked out now: what of its source still waits is closed, as a
                    // newcomer would be.
                    if let Some(why) = failures.refused(over.source, now) {
                        for shed in pending.remove_waiting(over.source) {
                            closing.shed(shed, why.clone(), &events, &mut handshaking);
                        }
                    }
                }
                None
            }
            Some(_) = handshaking.join_next(), if !handshaking.is_empty() => continue,
            () = sleep_until(wake), if wake.is_some() => None,
            accepted = incoming.accept() => match accepted {
                Ok((stream, address)) => Some(Arrived { stream, address, accepted: Instant::now() }),
                Err(_) => {
                    // Out of descriptors, or a peer gone before its accept: wait, go on.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let now = Instant::now();
        let mut starter = Starter {
            settings: &settings,
            sessions: &sessions,
            connections: &connections,
            finished: &finished,
            events: &events,
            tasks: &mut handshaking,
        };
        let start = |ticket, source, arrived, heard| starter.start(ticket, source, arrived, heard);
        let gone = match arrived {
            // A handshake ended, or a silent one's grace did: room for what waits.
            None => pending.place(now, start),
            Some(arrived) => {
                let source = source_of(&arrived.address);
                let refused = failures
                    .refused(source, now)
                    .or_else(|| not_allowed(&arrived.address, &settings))
                    .or_else(|| {
                        // Slots held for joins still to come let a newcomer in: it may be
                        // one (a newcomer that is not finds no slot after its handshake);
                        // so does a connection that resumes: it may be its stream, again.
                        let full = connections.available_permits() == 0
                            && sessions.held() == 0
                            && !sessions.any_resumable();
                        full.then_some(Shed::Full {
                            max_connections: settings.max_connections,
                        })
                    });
                if let Some(why) = refused {
                    closing.shed(arrived, why, &events, &mut handshaking);
                    continue;
                }
                pending.arrive(source, arrived, now, start)
            }
        };
        for gone in gone {
            match gone {
                Gone::Evicted((handle, address)) => {
                    handle.abort();
                    tell(&events, address, Shed::Evicted);
                }
                Gone::Displaced(arrived, why) => {
                    closing.shed(arrived, why, &events, &mut handshaking);
                }
            }
        }
    }
}

/// Sleep until `at`; never, without one (a `select!` branch disabled by its condition).
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// One accepted peer on its way through the handshake.
struct Shaking {
    stream: Accepted,
    address: PeerAddress,
    accepted: Instant,
    ticket: u64,
    source: Source,
    heard: Arc<Heard>,
}

/// Run a peer's handshake under `hello_timeout` (for its first byte) and
/// `handshake_timeout` (for all of it); tell the accept loop it is over, then the caller
/// what became of it.
async fn handshake_task(
    peer: Shaking,
    settings: Arc<ListenSettings>,
    sessions: Sessions,
    connections: Arc<Semaphore>,
    finished: mpsc::UnboundedSender<Done>,
    events: mpsc::Sender<Event>,
) {
    let Shaking {
        stream,
        address,
        accepted,
        ticket,
        source,
        heard,
    } = peer;
    // Tells the accept loop the handshake is over however it ends, a panic included:
    // else its ticket would hold a place in the pending table for the listener's life.
    let mut over = Over {
        finished,
        done: Some(Done {
            ticket,
            source,
            failed_authentication: false,
        }),
    };
    let limit = settings.handshake_timeout;
    let hello_timeout = settings.admission.hello_timeout;
    let admitted = tokio::time::timeout(limit, async {
        tokio::select! {
            // The handshake first: a peer that waited past its `hello_timeout` for a place
            // and whose hello is already here is read before its silence is judged.
            biased;
            admitted = admit(stream, address.clone(), &settings, &sessions, &connections, &heard) => Some(admitted),
            () = silent_since(&heard, accepted, hello_timeout) => None,
        }
    })
    .await;
    let why = match admitted {
        Ok(Some(Ok(link))) => Ok(link),
        Ok(Some(Err(error))) => Err(Refusal::Failed(error)),
        Ok(None) => Err(Refusal::Shed(Shed::Silent { hello_timeout })),
        Err(_) => Err(Refusal::Silent(limit)),
    };
    let failed_authentication = match &why {
        Ok(_) => false,
        Err(_) if heard.has_shaken_hands() => false,
        Err(why) => failed_authentication(settings.authkey.is_some(), why, heard.bytes()),
    };
    if let Some(done) = over.done.as_mut() {
        done.failed_authentication = failed_authentication;
    }
    drop(over);
    let why = match why {
        // A join never becomes a connection of its own: its link takes it, with the slot
        // held for it at the grant. One whose link went meanwhile is dropped.
        Ok(Admitted::Join(joined, to_owner)) => match to_owner.try_send(joined) {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Closed(_)) => Err(Refusal::Failed(
                GradientStreamError::Io(std::io::Error::new(
                    std::io::ErrorKind::NotConnected,
                    "the connection it joined closed while it shook hands",
                )),
            )),
            // A flood of resumes (proven: only a holder of the session's secret) waits
            // for no link: three rounds of the session's streams are queued at most.
            Err(mpsc::error::TrySendError::Full(_)) => Err(Refusal::Failed(
                GradientStreamError::Io(std::io::Error::other(super::streams::QUEUE_FULL)),
            )),
        },
        Ok(Admitted::Link(link)) => Ok(link),
        Err(why) => Err(why),
    };
    let event = match why.map(|link| (connections.try_acquire_owned(), link)) {
        Ok((Ok(slot), link)) => Event::Connected((*link).holding(slot)),
        // Links opened while this one shook hands: it is dropped, as at the accept.
        Ok((Err(_), _)) => Event::Refused {
            address,
            why: Refusal::Shed(Shed::Full {
                max_connections: settings.max_connections,
            }),
        },
        Err(why) => Event::Refused { address, why },
    };
    match event {
        // A closed listener drops what is still arriving. A link waits for its turn:
        // it holds a `max_connections` slot, so at most that many wait.
        Event::Connected(_) => {
            let _ = events.send(event).await;
        }
        // A refusal is only for the log: it never waits (a full queue drops it), else
        // a caller slow to take events, under a flood of bad hellos, would keep one task
        // per refused peer, without bound.
        Event::Refused { .. } => {
            let _ = events.try_send(event);
        }
    }
}

/// Whether a failed handshake counts as a failed authentication (docs/guides/limits.md
/// "Online guessing"): only at a listener with an authkey, when the handshake's error is
/// an authentication error, or when it failed or went silent after the peer's whole hello
/// arrived (`heard` bytes of the gradstream handshake), that is once the keyed exchange
/// had begun: a peer that learns what the listener sends there and then closes, stalls
/// or sends garbage is counted as one that sent a wrong key.
fn failed_authentication(authkey: bool, why: &Refusal, heard: usize) -> bool {
    authkey
        && match why {
            Refusal::Failed(GradientStreamError::Authentication { .. }) => true,
            Refusal::Failed(_) | Refusal::Silent(_) => heard >= HELLO_LEN,
            Refusal::Shed(_) => false,
        }
}

/// Return once the peer has been silent (not a byte) for `limit` since `accepted`;
/// never, once it spoke.
async fn silent_since(heard: &Heard, accepted: Instant, limit: Duration) {
    match accepted.checked_add(limit) {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        // Past the clock's range: never.
        None => std::future::pending::<()>().await,
    }
    if !heard.silent() {
        std::future::pending::<()>().await;
    }
}

/// What an admitted peer is: a connection, or a stream joining one.
enum Admitted {
    Link(Box<Link>),
    Join(Joined, mpsc::Sender<Joined>),
}

/// TLS, the hello and authentication for one accepted peer (then, for a same-host
/// peer, the rings); what the peer sends is counted in `heard`.
async fn admit(
    stream: Accepted,
    address: PeerAddress,
    settings: &ListenSettings,
    sessions: &Sessions,
    connections: &Arc<Semaphore>,
    heard: &Heard,
) -> Result<Admitted> {
    match (stream, address) {
        (Accepted::Tcp(tcp), PeerAddress::Tcp(address)) => {
            admit_tcp(tcp, address, settings, (sessions, connections), heard).await
        }
        #[cfg(target_os = "linux")]
        (Accepted::Unix(unix), PeerAddress::Local(peer)) => {
            admit_local(unix, peer, settings, heard)
                .await
                .map(|link| Admitted::Link(Box::new(link)))
        }
        #[cfg(target_os = "linux")]
        _ => Err(GradientStreamError::Io(std::io::Error::other(
            "a stream and an address of different kinds",
        ))),
    }
}

/// TLS, the hello and authentication for one peer over TCP; then, for a peer opening
/// several streams, the grant, or for one joining a connection, its proof.
async fn admit_tcp(
    tcp: TcpStream,
    address: SocketAddr,
    settings: &ListenSettings,
    (sessions, connections): (&Sessions, &Arc<Semaphore>),
    heard: &Heard,
) -> Result<Admitted> {
    tcp.set_nodelay(true)?;
    let at = PeerAt::from(address);
    let peer = Some(&at);
    if let Protocol::Seed = settings.protocol {
        let who = Peer::without_certificate(address, false);
        return Ok(Admitted::Link(Box::new(Link::seed(Box::new(tcp), who))));
    }
    let side = Shake {
        authkey: settings.authkey.as_deref(),
        test_nonce: settings.test_nonce,
        ..Shake::plain(Role::Server, settings.limits)
    };
    let (mut stream, established, who): (Box<dyn Duplex>, _, _) = match &settings.tls {
        None => {
            let mut stream = tcp;
            let shaken = handshake(&mut Watched::new(&mut stream, heard), side, peer).await;
            let established = shaken.inspect_err(|_| discard_pending(|b| stream.try_read(b)))?;
            let who = Peer::without_certificate(address, established.authenticated);
            (Box::new(stream), established, who)
        }
        Some(acceptor) => {
            // The client speaks first (its ClientHello): its first byte, for `hello_timeout`.
            tcp.peek(&mut [0u8; 1]).await?;
            heard.first_byte();
            let (mut stream, tls_subject) = acceptor.accept(buffered(tcp), peer).await?;
            let side = Shake {
                tls: Some(tls::exporter(stream.get_ref().1, peer)?),
                ..side
            };
            let established = handshake(&mut Watched::new(&mut stream, heard), side, peer).await?;
            let who = Peer {
                address: address.into(),
                authenticated: established.authenticated || tls_subject.is_some(),
                tls_subject,
            };
            (Box::new(stream), established, who)
        }
    };
    // The peer proved the authkey, or has a TLS session: what fails from here is no
    // guess at the key, and not counted as one (docs/guides/limits.md "Online guessing").
    heard.shook_hands();
    if let Some(proven) = sessions.join(&mut stream, &established, peer).await? {
        let joined = Joined {
            index: proven.index,
            stream,
            slot: proven.slot,
            resumed: proven.resumed,
        };
        return Ok(Admitted::Join(joined, proven.to_owner));
    }
    let joining = sessions
        .grant(
            &mut stream,
            &established,
            (settings.max_streams, settings.resume_window),
            connections,
            settings.handshake_timeout,
            peer,
        )
        .await?;
    Ok(Admitted::Link(Box::new(
        Link::sealed(stream, established, who).joining(joining),
    )))
}

/// A stream whose reads are counted in a `Heard`, for the length of a handshake.
struct Watched<'s, S> {
    inner: &'s mut S,
    heard: &'s Heard,
}

impl<'s, S> Watched<'s, S> {
    fn new(inner: &'s mut S, heard: &'s Heard) -> Self {
        Self { inner, heard }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<'_, S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut *this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            this.heard.handshake_bytes(buf.filled().len() - before);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<'_, S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Drop what a refused peer already sent (at most 64 KiB, without waiting for more), so
/// that closing ends the connection with a FIN, not a reset that would destroy the hello
/// still on its way to the peer.
fn discard_pending(try_read: impl Fn(&mut [u8]) -> std::io::Result<usize>) {
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        match try_read(&mut sink) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

#[cfg(test)]
mod tests;
