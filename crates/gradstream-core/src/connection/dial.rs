//! The client side of a connection: TCP connect, TLS, the handshake, bounded in time.
//!
//! Uses `handshake`, `link`, `tls`; used by the bindings.

use crate::error::PeerAt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;

use super::handshake::handshake;
use super::link::{Link, Peer};
#[cfg(target_os = "linux")]
use super::link::{LocalPeer, PeerAddress};
#[cfg(target_os = "linux")]
use super::listener::LocalSettings;
use super::{buffered, Protocol};
use crate::error::{GradientStreamError, Result};
use crate::frame::Limits;
use crate::protocol::Role;
use crate::tls::{self, TlsConnector};

/// How a client connects: settings, shared by every connection made with them.
#[derive(Clone)]
pub struct DialSettings {
    pub protocol: Protocol,
    pub tls: Option<Arc<TlsConnector>>,
    pub authkey: Option<Vec<u8>>,
    /// Bounds the TCP connect, TLS and the hello together.
    pub handshake_timeout: Duration,
    /// What this side accepts, told to the peer in its hello.
    pub limits: Limits,
    /// A same-host connection's rule for the listener's user, and its rings
    /// (`connect_unix`).
    #[cfg(target_os = "linux")]
    pub local: LocalSettings,
    /// Tests only (the recorded sessions of docs/spec/protocol.md, replayed byte for
    /// byte): this side's hello nonce, instead of a fresh random one, and with it the
    /// scalar of its SPAKE2 element (`auth::ScalarSeed::for_test`). A fixed nonce gives
    /// every connection the same transfer ids and elements, so a seal no longer tells one
    /// connection's transfers from another's, and a recorded handshake lets the authkey
    /// be guessed offline: leave it `None`.
    #[doc(hidden)]
    pub test_nonce: Option<[u8; 32]>,
}

/// Connect to `host:port` and do the handshake the settings say.
pub async fn connect(host: &str, port: u16, settings: &DialSettings) -> Result<Link> {
    within(settings.handshake_timeout, establish(host, port, settings)).await
}

/// `dialling` within `limit`; as the reference, a wait that ran out is a
/// StreamTimeoutError.
async fn within(limit: Duration, dialling: impl Future<Output = Result<Link>>) -> Result<Link> {
    match tokio::time::timeout(limit, dialling).await {
        Ok(done) => done,
        Err(_) => Err(GradientStreamError::Timeout {
            timeout: limit.as_secs_f64(),
            received: 0,
            total: None,
        }),
    }
}

/// Connect to a Unix-domain listener at `path` (`Listener::bind_unix`): the hello and
/// authentication on the socket, then the shared-memory rings, all within
/// `handshake_timeout`. TLS and the seed protocol are refused, as the listener does.
#[cfg(target_os = "linux")]
pub async fn connect_unix(path: &std::path::Path, settings: &DialSettings) -> Result<Link> {
    if settings.tls.is_some() || settings.protocol == Protocol::Seed {
        return Err(GradientStreamError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a unix: connection takes neither TLS nor protocol='seed': the kernel is the only \
             party between two processes of one host (an authkey still applies)",
        )));
    }
    within(settings.handshake_timeout, establish_unix(path, settings)).await
}

#[cfg(target_os = "linux")]
async fn establish_unix(path: &std::path::Path, settings: &DialSettings) -> Result<Link> {
    let mut unix = tokio::net::UnixStream::connect(path).await?;
    let peer = LocalPeer::of(path, &unix)?;
    // Anyone who could write the socket's directory could have put a listener there.
    if let Some(allowed) = settings.local.allowed_uid {
        if peer.uid != allowed {
            return Err(GradientStreamError::Io(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "the listener at unix:{} is a process of uid {}, not of uid {allowed}: \
                     nothing was sent (connect with allowed_uid={} if that user is the one \
                     you meant)",
                    path.display(),
                    peer.uid,
                    peer.uid
                ),
            )));
        }
    }
    let at = PeerAt::Unix(peer.path.clone());
    let established = handshake(
        &mut unix,
        Role::Client,
        false,
        settings.authkey.as_deref(),
        settings.limits,
        Some(&at),
        settings.test_nonce,
    )
    .await?;
    let rings = settings.local.rings;
    let stream = crate::shm::ShmStream::open(unix, rings.len, &rings.limits).await?;
    let who = Peer::without_certificate(PeerAddress::Local(peer), established.authenticated);
    Ok(Link::sealed(Box::new(stream), established, who))
}

async fn establish(host: &str, port: u16, settings: &DialSettings) -> Result<Link> {
    let tcp = TcpStream::connect((host, port)).await?;
    // Frames go out whole; Nagle would hold each one's tail for the peer's delayed ack.
    tcp.set_nodelay(true)?;
    let address = tcp.peer_addr()?;
    let at = PeerAt::from(address);
    let peer = Some(&at);
    if let Protocol::Seed = settings.protocol {
        let who = Peer::without_certificate(address, false);
        return Ok(Link::seed(Box::new(tcp), who));
    }
    let authkey = settings.authkey.as_deref();
    match &settings.tls {
        None => {
            let mut stream = tcp;
            let established = handshake(
                &mut stream,
                Role::Client,
                false,
                authkey,
                settings.limits,
                peer,
                settings.test_nonce,
            )
            .await?;
            let who = Peer::without_certificate(address, established.authenticated);
            Ok(Link::sealed(Box::new(stream), established, who))
        }
        Some(tls) => {
            let mut stream = tls.connect(host, buffered(tcp), peer).await?;
            // Under TLS 1.3 a listener's refusal of our certificate arrives as an alert on
            // the first read after the handshake: the hello's.
            let established = handshake(
                &mut stream,
                Role::Client,
                true,
                authkey,
                settings.limits,
                peer,
                settings.test_nonce,
            )
            .await
            .map_err(|e| match e {
                GradientStreamError::Io(io) => tls::from_io(io, peer),
                other => other,
            })?;
            // The server's certificate was verified against `ca`, for the name dialled;
            // `tls_subject` names a client certificate a listener verified.
            let who = Peer::without_certificate(address, true);
            Ok(Link::sealed(Box::new(stream), established, who))
        }
    }
}
