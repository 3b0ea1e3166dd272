//! The server side: a TCP listener whose peers become `Link`s only after TLS, the hello
//! and authentication, each under `handshake_timeout`, and at most
//! `max_pending_handshakes` at a time; at most `max_connections` links live at once (the
//! listener takes no more from the kernel's backlog until one goes). A peer that fails
//! becomes a `Refused` event (the caller logs it) and never a link.
//!
//! Uses `handshake`, `link`, `tls`; used by the bindings.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;

use super::handshake::handshake;
use super::link::{Link, Peer};
use super::{buffered, Protocol};
use crate::error::{GradientStreamError, Result};
use crate::frame::Limits;
use crate::protocol::Role;
use crate::tls::TlsAcceptor;

/// How a listener admits peers: settings, shared by its handshakes.
#[derive(Clone)]
pub struct ListenSettings {
    pub protocol: Protocol,
    pub tls: Option<Arc<TlsAcceptor>>,
    pub authkey: Option<Vec<u8>>,
    /// Bounds each peer's TLS handshake, hello and authentication together.
    pub handshake_timeout: Duration,
    pub max_pending_handshakes: usize,
    pub max_connections: usize,
    /// What this side accepts, told to each peer in its hello.
    pub limits: Limits,
    /// Tests only: this side's hello nonce (see `DialSettings::test_nonce`); `None`.
    #[doc(hidden)]
    pub test_nonce: Option<[u8; 32]>,
}

/// Why a peer was dropped.
pub enum Refusal {
    /// Its handshake failed.
    Failed(GradientStreamError),
    /// It did not finish its handshake within `handshake_timeout` (this long).
    Silent(Duration),
}

/// What happened at the listener.
pub enum Event {
    /// A peer through the handshake.
    Connected(Link),
    /// A peer dropped, and why.
    Refused { address: SocketAddr, why: Refusal },
}

/// The accept loop's task, shared by the listener and its `Stopper`.
type Accepting = Arc<std::sync::Mutex<Option<JoinHandle<()>>>>;

/// A bound listener: its events arrive in `next`; dropping it stops accepting.
pub struct Listener {
    events: mpsc::Receiver<Event>,
    address: SocketAddr,
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
        let tcp = TcpListener::bind((host, port)).await?;
        let address = tcp.local_addr()?;
        let (sender, events) = mpsc::channel(settings.max_pending_handshakes.max(1));
        let accepting = tokio::spawn(accept_loop(tcp, settings, sender));
        Ok(Self {
            events,
            address,
            accepting: Arc::new(std::sync::Mutex::new(Some(accepting))),
        })
    }

    /// The address actually bound (its port, for port 0).
    pub fn address(&self) -> SocketAddr {
        self.address
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

async fn accept_loop(tcp: TcpListener, settings: ListenSettings, events: mpsc::Sender<Event>) {
    let connections = Arc::new(Semaphore::new(settings.max_connections.max(1)));
    let handshakes = Arc::new(Semaphore::new(settings.max_pending_handshakes.max(1)));
    let settings = Arc::new(settings);
    // The handshakes under way: dropped with this loop (an aborted one: a closed listener).
    let mut handshaking = tokio::task::JoinSet::new();
    loop {
        // Reap the finished ones, so the set holds only those still running.
        while handshaking.try_join_next().is_some() {}
        // Both permits before the accept: past either cap, peers wait in the kernel's
        // backlog and cost this process nothing.
        let (Ok(slot), Ok(pending)) = (
            connections.clone().acquire_owned().await,
            handshakes.clone().acquire_owned().await,
        ) else {
            return;
        };
        let (stream, address) = match tcp.accept().await {
            Ok(accepted) => accepted,
            Err(_) => {
                // Out of descriptors, or a peer gone before its accept: wait, go on.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (events, settings) = (events.clone(), settings.clone());
        handshaking.spawn(async move {
            let limit = settings.handshake_timeout;
            let admitted = tokio::time::timeout(limit, admit(stream, address, &settings)).await;
            drop(pending);
            let event = match admitted {
                Ok(Ok(link)) => Event::Connected(link.holding(slot)),
                Ok(Err(error)) => Event::Refused {
                    address,
                    why: Refusal::Failed(error),
                },
                Err(_) => Event::Refused {
                    address,
                    why: Refusal::Silent(limit),
                },
            };
            // A closed listener drops what is still arriving.
            let _ = events.send(event).await;
        });
    }
}

/// TLS, the hello and authentication for one accepted peer.
async fn admit(tcp: TcpStream, address: SocketAddr, settings: &ListenSettings) -> Result<Link> {
    tcp.set_nodelay(true)?;
    let peer = Some(address);
    if let Protocol::Seed = settings.protocol {
        let who = Peer::without_certificate(address, false);
        return Ok(Link::seed(Box::new(tcp), who));
    }
    let authkey = settings.authkey.as_deref();
    match &settings.tls {
        None => {
            let mut stream = tcp;
            let shaken = handshake(
                &mut stream,
                Role::Server,
                false,
                authkey,
                settings.limits,
                peer,
                settings.test_nonce,
            )
            .await;
            let established = shaken.inspect_err(|_| discard_pending(&stream))?;
            let who = Peer::without_certificate(address, established.authenticated);
            Ok(Link::sealed(Box::new(stream), established, who))
        }
        Some(tls) => {
            let (mut stream, tls_subject) = tls.accept(buffered(tcp), peer).await?;
            let established = handshake(
                &mut stream,
                Role::Server,
                true,
                authkey,
                settings.limits,
                peer,
                settings.test_nonce,
            )
            .await?;
            let who = Peer {
                address,
                authenticated: established.authenticated || tls_subject.is_some(),
                tls_subject,
            };
            Ok(Link::sealed(Box::new(stream), established, who))
        }
    }
}

/// Drop what a refused peer already sent (at most 64 KiB, without waiting for more), so
/// that closing ends the connection with a FIN, not a reset that would destroy the hello
/// still on its way to the peer.
fn discard_pending(stream: &TcpStream) {
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        match stream.try_read(&mut sink) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}
