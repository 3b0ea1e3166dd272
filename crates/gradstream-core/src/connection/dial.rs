//! The client side of a connection: TCP connect, TLS, the handshake, bounded in time.
//!
//! Uses `handshake`, `link`, `tls`; used by the bindings.

use crate::error::PeerAt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;

use super::handshake::{handshake, Established, Shake};
use super::link::{Link, Peer, Redial, Resume};
#[cfg(target_os = "linux")]
use super::link::{LocalPeer, PeerAddress};
#[cfg(target_os = "linux")]
use super::listener::LocalSettings;
use super::{buffered, streams, Duplex, Protocol};
use crate::error::{GradientStreamError, Result};
use crate::frame::Limits;
use crate::protocol::streams::{Grant, Proof};
use crate::protocol::{Intent, Role, SessionSecret};
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
    /// Connections the link runs over (docs/guides/across-the-internet.md, "Parallel
    /// streams"): 1, or up to 255 with an authkey or TLS (the listener may grant fewer).
    pub streams: u8,
    /// A TCP connection's resume window (docs/guides/across-the-internet.md, "Resume"):
    /// after a failure in a transfer, its streams are dialled again for at most this
    /// long, if the listener grants resumes; None: they are not (the transfer fails).
    /// Needs an authkey or TLS.
    pub resume: Option<Duration>,
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
    if settings.streams > 1 {
        return Err(invalid(
            "a unix: connection has one stream: its payloads go through shared memory, \
             which no window limits (connect with streams=1)",
        ));
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
    let side = Shake {
        authkey: settings.authkey.as_deref(),
        test_nonce: settings.test_nonce,
        ..Shake::plain(Role::Client, settings.limits)
    };
    let established = handshake(&mut unix, side, Some(&at)).await?;
    let rings = settings.local.rings;
    let stream = crate::shm::ShmStream::open(unix, rings.len, &rings.limits).await?;
    let who = Peer::without_certificate(PeerAddress::Local(peer), established.authenticated);
    Ok(Link::sealed(Box::new(stream), established, who))
}

async fn establish(host: &str, port: u16, settings: &DialSettings) -> Result<Link> {
    let streams = settings.streams.max(1);
    if streams > 1 && settings.protocol == Protocol::Seed {
        return Err(invalid(
            "several streams need protocol='gradstream' (the seed's bare \
                            frames have no hello to open them with)",
        ));
    }
    let resume = settings.resume.is_some();
    if resume && settings.protocol == Protocol::Seed {
        return Err(invalid(
            "resume needs protocol='gradstream' (the seed's bare frames have no hello to \
             resume with)",
        ));
    }
    if (streams > 1 || resume) && settings.authkey.is_none() && settings.tls.is_none() {
        return Err(invalid(match streams > 1 {
            true => streams::NEEDS_A_SECRET,
            false => streams::RESUME_NEEDS_A_SECRET,
        }));
    }
    let intent = (streams > 1 || resume).then_some(Intent::Open { streams, resume });
    let (mut stream, established, who) = match shake((host, port), None, settings, intent).await? {
        Shaken::Seed(link) => return Ok(*link),
        Shaken::Sealed(stream, established, who) => (stream, established, who),
    };
    let (Some(secret), Some(_)) = (established.secret.clone(), intent) else {
        return Ok(Link::sealed(stream, *established, who));
    };
    let at = who.address.at();
    let asked = Grant { streams, resume };
    let grant = streams::read_grant(&mut stream, asked, at.as_ref()).await?;
    let granted = grant.streams;
    let resolved = match who.address {
        super::link::PeerAddress::Tcp(address) => Some(address),
        #[cfg(target_os = "linux")]
        super::link::PeerAddress::Local(_) => None,
    };
    let mut joins = tokio::task::JoinSet::new();
    for index in 1..granted {
        let (host, settings, secret) = (host.to_string(), settings.clone(), secret.clone());
        joins.spawn(async move {
            let proof = (index, Proof::Join);
            let joined = join((&host, port), resolved, &settings, &secret, proof).await;
            (index, joined)
        });
    }
    let mut extra: Vec<Option<Box<dyn Duplex>>> = (1..granted).map(|_| None).collect();
    while let Some(done) = joins.join_next().await {
        let (index, joined) =
            done.map_err(|e| GradientStreamError::Io(std::io::Error::other(e)))?;
        extra[usize::from(index) - 1] = Some(joined?);
    }
    let extra = extra.into_iter().flatten().collect();
    let resume = match (grant.resume, settings.resume) {
        (true, Some(window)) => {
            let (host, settings) = (host.to_string(), settings.clone());
            let redial: Redial = Arc::new(move |index| {
                let (host, settings, secret) = (host.clone(), settings.clone(), secret.clone());
                Box::pin(async move {
                    let proof = (index, Proof::Resume);
                    let dialled = join((&host, port), resolved, &settings, &secret, proof);
                    match tokio::time::timeout(settings.handshake_timeout, dialled).await {
                        Ok(done) => done,
                        Err(_) => Err(GradientStreamError::Timeout {
                            timeout: settings.handshake_timeout.as_secs_f64(),
                            received: 0,
                            total: None,
                        }),
                    }
                })
            });
            Some(Resume::redialling(window, redial))
        }
        _ => None,
    };
    Ok(Link::sealed(stream, *established, who)
        .with_streams(extra)
        .resuming(resume))
}

/// An `InvalidInput` error: settings that cannot make the connection asked for.
fn invalid(detail: &str) -> GradientStreamError {
    GradientStreamError::Io(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        detail.to_string(),
    ))
}

/// What a dialled connection is after its handshake.
enum Shaken {
    Seed(Box<Link>),
    Sealed(Box<dyn Duplex>, Box<Established>, Peer),
}

/// TCP connect (to `resolved` when given: a join goes where the first stream went),
/// TLS (for `host`'s name), the handshake with `intent` in the hello.
async fn shake(
    (host, port): (&str, u16),
    resolved: Option<std::net::SocketAddr>,
    settings: &DialSettings,
    intent: Option<Intent>,
) -> Result<Shaken> {
    let tcp = match resolved {
        Some(address) => TcpStream::connect(address).await?,
        None => TcpStream::connect((host, port)).await?,
    };
    // Frames go out whole; Nagle would hold each one's tail for the peer's delayed ack.
    tcp.set_nodelay(true)?;
    let address = tcp.peer_addr()?;
    let at = PeerAt::from(address);
    let peer = Some(&at);
    if let Protocol::Seed = settings.protocol {
        let who = Peer::without_certificate(address, false);
        return Ok(Shaken::Seed(Box::new(Link::seed(Box::new(tcp), who))));
    }
    let side = Shake {
        authkey: settings.authkey.as_deref(),
        test_nonce: settings.test_nonce,
        intent,
        ..Shake::plain(Role::Client, settings.limits)
    };
    match &settings.tls {
        None => {
            let mut stream = tcp;
            let established = handshake(&mut stream, side, peer).await?;
            let who = Peer::without_certificate(address, established.authenticated);
            Ok(Shaken::Sealed(Box::new(stream), Box::new(established), who))
        }
        Some(tls) => {
            let mut stream = tls.connect(host, buffered(tcp), peer).await?;
            let exporter = tls::exporter(stream.get_ref().1, peer)?;
            // Under TLS 1.3 a listener's refusal of our certificate arrives as an alert on
            // the first read after the handshake: the hello's.
            let side = Shake {
                tls: Some(exporter),
                ..side
            };
            let established = handshake(&mut stream, side, peer)
                .await
                .map_err(|e| match e {
                    GradientStreamError::Io(io) => tls::from_io(io, peer),
                    other => other,
                })?;
            // The server's certificate was verified against `ca`, for the name dialled;
            // `tls_subject` names a client certificate a listener verified.
            let who = Peer::without_certificate(address, true);
            Ok(Shaken::Sealed(Box::new(stream), Box::new(established), who))
        }
    }
}

/// One joining connection of the session `secret` is the secret of, as stream `index`
/// (or one resuming it: dialled again after a failure).
async fn join(
    at: (&str, u16),
    resolved: Option<std::net::SocketAddr>,
    settings: &DialSettings,
    secret: &SessionSecret,
    (index, proof): (u8, Proof),
) -> Result<Box<dyn Duplex>> {
    let session = secret.id();
    let intent = match proof {
        Proof::Join => Intent::Join { index, session },
        Proof::Resume => Intent::Resume { index, session },
    };
    let Shaken::Sealed(mut stream, established, who) =
        shake(at, resolved, settings, Some(intent)).await?
    else {
        return Err(invalid("a joining stream of a seed connection"));
    };
    let at = who.address.at();
    streams::prove_join(
        &mut stream,
        secret,
        (index, proof),
        &established,
        at.as_ref(),
    )
    .await?;
    Ok(stream)
}
