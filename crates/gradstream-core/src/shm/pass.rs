//! Descriptors over a Unix-domain socket (`SCM_RIGHTS`): one at most per message, its
//! control message parsed by rustix.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::error::{GradientStreamError, Result};

fn refused(seen: &str) -> GradientStreamError {
    GradientStreamError::Protocol {
        expected: "at most one descriptor in a message".into(),
        seen: seen.into(),
        peer: None,
    }
}

/// Send `bytes` (at least one) on `socket` with `fd` attached; the bytes sent (a stream
/// socket may take fewer: the descriptor goes with the first of them).
pub fn send_with_fd(socket: impl AsFd, bytes: &[u8], fd: BorrowedFd<'_>) -> std::io::Result<usize> {
    let fds = [fd];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other(
            "no room for one descriptor's control message",
        ));
    }
    Ok(rustix::net::sendmsg(
        socket,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?)
}

/// Receive at most `buf.len()` bytes from `socket` and the descriptor sent with them, if
/// any: `(bytes, fd)`. A message that carried more than one descriptor (the kernel closed
/// those that did not fit: `MSG_CTRUNC`) or any other control message is refused, and
/// what came closed.
pub fn recv_with_fd(socket: impl AsFd, buf: &mut [u8]) -> Result<(usize, Option<OwnedFd>)> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        socket,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(std::io::Error::from)?;
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut other = false;
    for message in control.drain() {
        match message {
            RecvAncillaryMessage::ScmRights(received) => fds.extend(received),
            _ => other = true,
        }
    }
    if got.flags.contains(ReturnFlags::CTRUNC) || fds.len() > 1 {
        return Err(refused("more descriptors than one (the rest were closed)"));
    }
    if other {
        return Err(refused("a control message other than SCM_RIGHTS"));
    }
    Ok((got.bytes, fds.pop()))
}
