//! Who is at the other end of a link: where (a TCP address, or a process of this host),
//! and what it proved (a verified client certificate, the authkey).
//!
//! Used by `link`, `dial`, `listener` and the bindings.

use std::net::SocketAddr;

use crate::error::PeerAt;

/// A same-host peer (a Unix-domain connection): the socket's path and the peer process's
/// credentials, from the kernel (`SO_PEERCRED`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalPeer {
    pub path: std::path::PathBuf,
    /// None when the kernel does not say (a peer in another pid namespace).
    pub pid: Option<u32>,
    pub uid: u32,
    pub gid: u32,
}

impl LocalPeer {
    /// The process at the other end of `socket`, connected through the socket file at
    /// `path`, as the kernel tells it (`SO_PEERCRED`).
    #[cfg(target_os = "linux")]
    pub(crate) fn of(
        path: &std::path::Path,
        socket: &tokio::net::UnixStream,
    ) -> std::io::Result<Self> {
        let credentials = socket.peer_cred()?;
        Ok(Self {
            path: path.to_path_buf(),
            pid: credentials.pid().and_then(|pid| u32::try_from(pid).ok()),
            uid: credentials.uid(),
            gid: credentials.gid(),
        })
    }
}

/// Where a peer is: an address over TCP, or a process of this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerAddress {
    Tcp(SocketAddr),
    /// A same-host peer (the same-host transport is Linux's: memfd rings).
    #[cfg(target_os = "linux")]
    Local(LocalPeer),
}

impl PeerAddress {
    /// Where the peer is, as errors name it: its TCP address, or the path of the Unix
    /// socket the connection was made at.
    pub fn at(&self) -> Option<PeerAt> {
        Some(match self {
            Self::Tcp(address) => PeerAt::Tcp(*address),
            #[cfg(target_os = "linux")]
            Self::Local(local) => PeerAt::Unix(local.path.clone()),
        })
    }
}

impl From<SocketAddr> for PeerAddress {
    fn from(address: SocketAddr) -> Self {
        Self::Tcp(address)
    }
}

/// Who is at the other end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub address: PeerAddress,
    /// The subject of the client certificate this side verified (mutual TLS), if any.
    pub tls_subject: Option<String>,
    /// The peer proved the authkey, or presented a certificate this side verified.
    pub authenticated: bool,
}

impl Peer {
    /// A peer that presented no certificate this side verified (every client's view,
    /// and a listener's without mutual TLS): authenticated or not by other means.
    pub fn without_certificate(address: impl Into<PeerAddress>, authenticated: bool) -> Self {
        Self {
            address: address.into(),
            tls_subject: None,
            authenticated,
        }
    }
}
