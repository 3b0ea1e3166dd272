//! Shared memory for the same-host transport (docs/spec/same-host.md): each side of a
//! Unix-domain connection writes the payloads it sends into a ring of its own, a memfd of
//! fixed size, and passes the ring's descriptor to the peer once, with `SCM_RIGHTS`; the
//! socket then carries everything else.
//!
//! The rules a receiver holds a peer's ring to, whatever the peer does:
//! - the size cannot change under it: the ring must carry `F_SEAL_SHRINK` and
//!   `F_SEAL_GROW`, read with `F_GET_SEALS` (never trusted from a message) before its
//!   size is read, so a truncation (SIGBUS on a mapped page) is impossible once mapped;
//! - it maps at most its own limit (`RingLimits`), checked before `mmap`;
//! - it maps the ring read-only and only ever copies bytes out of it (`PeerRing::copy_out`):
//!   a peer that keeps writing into its ring changes bytes the receiver has not copied yet,
//!   never ones it checked (the CRC is computed over the copy);
//! - a descriptor of another kind (a pipe, a socket, a file that cannot be sealed), or more
//!   than one in a message, is refused, and the extra ones closed (`pass`).
//!
//! Nothing is left behind by a peer that dies: a memfd lives while a descriptor or a
//! mapping holds it, and both sides' go with their processes.
//!
//! Uses rustix (memfd, seals, mmap, `SCM_RIGHTS`) and `error`; used by the connection
//! layer.

mod pass;
mod ring;
#[cfg(feature = "tokio")]
mod stream;

pub use pass::{recv_with_fd, send_with_fd};
pub use ring::{OwnRing, PeerRing, RingLimits, DEFAULT_RING_LEN, MIN_RING_LEN};
#[cfg(feature = "tokio")]
pub use stream::ShmStream;

#[cfg(all(test, feature = "tokio"))]
mod stream_tests;
#[cfg(test)]
mod tests;
