//! The client side of a connection: TCP connect, TLS, the handshake, bounded in time.
//!
//! Uses `handshake`, `link`, `tls`; used by the bindings.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;

use super::handshake::handshake;
use super::link::{Link, Peer};
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
    let limit = settings.handshake_timeout;
    match tokio::time::timeout(limit, establish(host, port, settings)).await {
        Ok(done) => done,
        // As the reference: a wait that ran out, a StreamTimeoutError.
        Err(_) => Err(GradientStreamError::Timeout {
            timeout: limit.as_secs_f64(),
            received: 0,
            total: None,
        }),
    }
}

async fn establish(host: &str, port: u16, settings: &DialSettings) -> Result<Link> {
    let tcp = TcpStream::connect((host, port)).await?;
    // Frames go out whole; Nagle would hold each one's tail for the peer's delayed ack.
    tcp.set_nodelay(true)?;
    let address = tcp.peer_addr()?;
    let peer = Some(address);
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
