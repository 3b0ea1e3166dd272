//! What a listener accepts on (a TCP or a Unix-domain socket), what it accepts (their
//! streams, read and written alike for a refusal's gentle close), and how the admission
//! caps and the uid rule see a peer.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
#[cfg(target_os = "linux")]
use tokio::net::{UnixListener, UnixStream};

#[cfg(target_os = "linux")]
use super::local::SocketFile;
use super::ListenSettings;
use crate::connection::admission::{Shed, Source};
#[cfg(target_os = "linux")]
use crate::connection::link::LocalPeer;
use crate::connection::link::PeerAddress;

/// What a listener accepts on.
pub(super) enum Incoming {
    Tcp(TcpListener),
    /// A Unix-domain socket, and its file (removed when accepting stops: the listener
    /// closed or dropped).
    #[cfg(target_os = "linux")]
    Unix(UnixListener, SocketFile),
}

impl Incoming {
    pub(super) async fn accept(&self) -> std::io::Result<(Accepted, PeerAddress)> {
        match self {
            Self::Tcp(tcp) => {
                let (stream, address) = tcp.accept().await?;
                Ok((Accepted::Tcp(stream), PeerAddress::Tcp(address)))
            }
            #[cfg(target_os = "linux")]
            Self::Unix(unix, file) => {
                let (stream, _) = unix.accept().await?;
                let peer = LocalPeer::of(&file.path, &stream)?;
                Ok((Accepted::Unix(stream), PeerAddress::Local(peer)))
            }
        }
    }
}

/// A connection taken from the kernel.
pub(super) enum Accepted {
    Tcp(TcpStream),
    #[cfg(target_os = "linux")]
    Unix(UnixStream),
}

impl Accepted {
    pub(super) fn try_read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Tcp(tcp) => tcp.try_read(buf),
            #[cfg(target_os = "linux")]
            Self::Unix(unix) => unix.try_read(buf),
        }
    }
}

/// `Accepted`'s reads and writes are its stream's (for the gentle close of a refusal).
macro_rules! each_stream {
    ($self:ident, $stream:ident => $body:expr) => {
        match $self.get_mut() {
            Accepted::Tcp($stream) => $body,
            #[cfg(target_os = "linux")]
            Accepted::Unix($stream) => $body,
        }
    };
}

impl AsyncRead for Accepted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        each_stream!(self, s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for Accepted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        each_stream!(self, s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        each_stream!(self, s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        each_stream!(self, s => Pin::new(s).poll_shutdown(cx))
    }
}

/// The caps' source of a peer: its address over TCP, its user on this host.
pub(super) fn source_of(address: &PeerAddress) -> Source {
    match address {
        PeerAddress::Tcp(address) => Source::of(address.ip()),
        #[cfg(target_os = "linux")]
        PeerAddress::Local(peer) => Source::Uid(peer.uid),
    }
}

/// A same-host peer of a user the listener does not admit.
pub(super) fn not_allowed(address: &PeerAddress, settings: &ListenSettings) -> Option<Shed> {
    match address {
        #[cfg(target_os = "linux")]
        PeerAddress::Local(peer) => match settings.local.allowed_uid {
            Some(allowed) if allowed != peer.uid => Some(Shed::Uid {
                uid: peer.uid,
                allowed,
            }),
            _ => None,
        },
        _ => {
            let _ = settings;
            None
        }
    }
}
