//! A listener on a Unix-domain socket (`Listener::bind_unix`, docs/guides/same-host.md):
//! its settings and rings, the socket file it holds (bound under `PATH.lock`, its mode set
//! before it listens) and a same-host peer's admission (the hello, then the rings).

use crate::error::PeerAt;
use std::path::{Path, PathBuf};

use tokio::net::{UnixListener, UnixStream};

use super::{discard_pending, ListenSettings, Watched};
use crate::connection::admission::Heard;
use crate::connection::handshake::{handshake, Shake};
use crate::connection::link::{Link, LocalPeer, Peer, PeerAddress};
use crate::error::{GradientStreamError, Result};
use crate::protocol::Role;
use crate::shm::{RingLimits, ShmStream, DEFAULT_RING_LEN};

/// The shared-memory rings of a same-host connection (`crate::shm`): this side's size,
/// and the most of a peer's it maps.
#[derive(Clone, Copy, Debug)]
pub struct Rings {
    pub len: usize,
    pub limits: RingLimits,
}

impl Default for Rings {
    fn default() -> Self {
        Self {
            len: DEFAULT_RING_LEN,
            limits: RingLimits::default(),
        }
    }
}

/// Who a Unix-domain listener admits, and its rings.
#[derive(Clone, Copy, Debug)]
pub struct LocalSettings {
    /// The only user whose processes are admitted (the kernel's `SO_PEERCRED`); None:
    /// any user who can open the socket file (made with mode 0600: the owner's).
    pub allowed_uid: Option<u32>,
    pub rings: Rings,
}

impl Default for LocalSettings {
    /// This process's own user only.
    fn default() -> Self {
        Self {
            allowed_uid: Some(rustix::process::getuid().as_raw()),
            rings: Rings::default(),
        }
    }
}

/// A Unix-domain listener's socket file and the lock that makes it the listener's: the
/// socket file is removed when the listener goes, then the lock released (its file,
/// `PATH.lock`, stays: removing it would let two listeners lock two files at once).
pub(super) struct SocketFile {
    pub(super) path: PathBuf,
    _lock: std::os::fd::OwnedFd,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        // The lock is still held: nobody else can have bound a socket at the path.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `PATH.lock`, locked (`flock`, exclusive) for as long as the returned descriptor is
/// open: the listener at `path` is whoever holds it. Opened without following a
/// symlink, made with mode 0600.
fn lock_socket_path(path: &Path) -> Result<std::os::fd::OwnedFd> {
    use rustix::fs::{FlockOperation, Mode, OFlags};
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    let flags = OFlags::CREATE | OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    let lock = rustix::fs::open(std::path::Path::new(&name), flags, Mode::RUSR | Mode::WUSR)
        .map_err(std::io::Error::from)?;
    match rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(lock),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(GradientStreamError::Io(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!(
                "a listener is already at unix:{} (close it, or choose another path)",
                path.display()
            ),
        ))),
        Err(e) => Err(std::io::Error::from(e).into()),
    }
}

/// Bind and listen on a Unix-domain socket at `path`, holding its lock (`PATH.lock`): a
/// listener already there is an error at once; a socket file without one (its listener
/// died) is replaced; any other file is left alone and is an error. The socket file's
/// mode is set before it listens (no peer can connect in between): 0600 when only this
/// process's user is admitted (`allowed_uid`), else 0666, the uid check then deciding.
pub(super) fn bind_unix_socket(
    path: &Path,
    backlog: u32,
    allowed_uid: Option<u32>,
) -> Result<(UnixListener, SocketFile)> {
    use rustix::fs::{FileType, Mode, OFlags};
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileTypeExt;
    let lock = lock_socket_path(path)?;
    if let Ok(found) = std::fs::symlink_metadata(path) {
        if !found.file_type().is_socket() {
            return Err(GradientStreamError::Io(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!(
                    "unix:{} exists and is not a socket: it is left alone (choose another path)",
                    path.display()
                ),
            )));
        }
        // The lock is ours: nobody listens there (a socket file left by a dead listener).
        std::fs::remove_file(path)?;
    }
    let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
    let socket = rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None)
        .map_err(std::io::Error::from)?;
    let address = SocketAddrUnix::new(path).map_err(std::io::Error::from)?;
    rustix::net::bind(&socket, &address).map_err(std::io::Error::from)?;
    let file = SocketFile {
        path: path.to_path_buf(),
        _lock: lock,
    };
    let own = rustix::process::getuid().as_raw();
    let mode = if allowed_uid == Some(own) {
        Mode::RUSR | Mode::WUSR
    } else {
        Mode::RUSR | Mode::WUSR | Mode::RGRP | Mode::WGRP | Mode::ROTH | Mode::WOTH
    };
    // The mode of the socket just bound, not of what a symlink put at the path since
    // would point to: the path opened without following (O_PATH), checked to be a
    // socket, and changed through its descriptor's /proc entry (chmod has no
    // descriptor-only form for an O_PATH descriptor).
    let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let bound = rustix::fs::open(path, flags, Mode::empty()).map_err(std::io::Error::from)?;
    let kind = FileType::from_raw_mode(
        rustix::fs::fstat(&bound)
            .map_err(std::io::Error::from)?
            .st_mode,
    );
    if kind != FileType::Socket {
        return Err(GradientStreamError::Io(std::io::Error::other(format!(
            "unix:{} was replaced while the listener set it up ({kind:?}): listen in a \
             directory only you can write",
            path.display()
        ))));
    }
    let by_descriptor = format!("/proc/self/fd/{}", bound.as_raw_fd());
    rustix::fs::chmod(by_descriptor.as_str(), mode).map_err(std::io::Error::from)?;
    let backlog = i32::try_from(backlog).unwrap_or(i32::MAX);
    rustix::net::listen(&socket, backlog).map_err(std::io::Error::from)?;
    let listener = UnixListener::from_std(std::os::unix::net::UnixListener::from(socket))?;
    Ok((listener, file))
}

/// The hello and authentication of a same-host peer on its socket, then the rings
/// (`ShmStream::open`): a peer costs no ring before it has shaken hands.
pub(super) async fn admit_local(
    mut unix: UnixStream,
    peer: LocalPeer,
    settings: &ListenSettings,
    heard: &Heard,
) -> Result<Link> {
    let at = PeerAt::Unix(peer.path.clone());
    let side = Shake {
        authkey: settings.authkey.as_deref(),
        test_nonce: settings.test_nonce,
        ..Shake::plain(Role::Server, settings.limits)
    };
    let shaken = handshake(&mut Watched::new(&mut unix, heard), side, Some(&at)).await;
    let established = shaken.inspect_err(|_| discard_pending(|b| unix.try_read(b)))?;
    heard.shook_hands();
    let rings = settings.local.rings;
    let stream = ShmStream::open(unix, rings.len, &rings.limits).await?;
    let who = Peer::without_certificate(PeerAddress::Local(peer), established.authenticated);
    Ok(Link::sealed(Box::new(stream), established, who))
}
