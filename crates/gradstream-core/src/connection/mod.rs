//! Connections between two gradstream peers (README "Connections"): a client dials
//! (`dial`), a server listens (`listener`), both run the handshake (`handshake`: hellos,
//! authentication) over TCP or TLS (`crate::tls`), and the result is a `Link` carrying
//! sealed, acknowledged transfers (`link`, whose ack digests come from `tap`).
//!
//! Uses `protocol`, `seal`, `tls`, `stream` and `tensors`; used by the bindings.

pub mod dial;
pub mod handshake;
pub mod link;
pub mod listener;
mod tap;

pub use dial::{connect, DialSettings};
pub use link::{Link, Peer, Received};
pub use listener::{Event, ListenSettings, Listener, Refusal};

/// What a connection speaks: a local setting of each side, never negotiated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// Hello, seals and acks (README "Protocol").
    Gradstream,
    /// The bare frames of ipfrs-transport 0.2.0, nothing else.
    Seed,
}
