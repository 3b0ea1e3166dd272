//! Connections between two gradstream peers (docs/guides/connections.md): a client dials
//! (`dial`), a server listens (`listener`), both run the handshake (`handshake`: hellos,
//! authentication) over TCP or TLS (`crate::tls`), and the result is a `Link` carrying
//! sealed, acknowledged transfers (`link`, whose ack digests come from `tap`). A
//! listener lets peers start their handshakes by `admission`'s caps and tables.
//!
//! Uses `protocol`, `seal`, `tls`, `stream` and `tensors`; used by the bindings.

mod admission;
pub mod dial;
pub mod handshake;
pub mod link;
pub mod listener;
pub mod streams;
mod tap;

#[cfg(target_os = "linux")]
pub use dial::connect_unix;
pub use dial::{connect, DialSettings};
#[cfg(target_os = "linux")]
pub use listener::{LocalSettings, Rings};

/// The ack digest of a transfer whose frames pass in `pieces` of any size, as a
/// connection's tap computes it (for the golden tests of the bindings).
pub fn digest_of_stream(transfer: &[u8; 16], pieces: &[&[u8]]) -> [u8; 32] {
    let mut nowhere = ();
    let mut tap = tap::Tap::new(&mut nowhere, crate::protocol::Digest::new(transfer));
    for piece in pieces {
        tap.observe(piece);
    }
    tap.finish()
}
pub use admission::{Admission, Shed, Source, FAILURE_TABLE};
pub use link::{Link, LocalPeer, Peer, PeerAddress, ReadBudget, Received, Resumed};
pub use listener::{Bound, Event, ListenSettings, Listener, Refusal, Stopper};

/// A byte stream a link can own: a TCP stream, or a TLS stream over one (`Any`: a plain
/// TCP stream's descriptor is found by its type, for `Link::direct`).
pub trait Duplex:
    tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + std::any::Any
{
}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static> Duplex for T {}

/// What a connection speaks: a local setting of each side, never negotiated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// Hello, seals and acks (docs/spec/protocol.md).
    Gradstream,
    /// The bare frames of ipfrs-transport 0.2.0, nothing else.
    Seed,
}

/// Bytes read from the socket at a time under TLS. rustls asks for at most 4 KiB per
/// read (and resizes its buffer as it empties); a buffer beneath it turns those into one
/// system call per 256 KiB: measured, 2.6 x the TLS receive rate (docs/performance.md).
const TLS_READ_BUFFER: usize = 256 << 10;

/// A TCP stream with a read buffer, for TLS to read its records from.
fn buffered(tcp: tokio::net::TcpStream) -> tokio::io::BufReader<tokio::net::TcpStream> {
    tokio::io::BufReader::with_capacity(TLS_READ_BUFFER, tcp)
}

#[cfg(test)]
mod tests;
