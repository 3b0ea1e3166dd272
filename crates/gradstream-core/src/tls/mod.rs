//! TLS for connections (docs/guides/connections.md): rustls on the ring provider,
//! TLS 1.3 only (rustls is built without TLS 1.2), ALPN `gradstream/1` required on both
//! sides, the server's certificate checked against the CA and the name or IP given to
//! `connect` (no way to turn that off), and under mutual TLS a client certificate signed
//! by the listener's CA required, its subject handed back as text.
//!
//! - `acceptor`: `TlsAcceptor`, the listener's side;
//! - `connector`: `TlsConnector`, the client's side;
//! - `files`: `TlsFiles`, and the PEM files read into certificates, a key and roots;
//! - `subject`: a certificate's subject as RFC 4514 text (x509-cert).
//!
//! Every failure is a `GradientStreamError::Tls` saying what rustls said (or which file
//! could not be read). Under TLS 1.3 a client learns that the listener refused its
//! certificate only on its first read after the handshake: `from_io` turns that read's
//! error into the same `Tls` error.
//!
//! Uses `error`, rustls, tokio-rustls, rustls-pki-types and x509-cert (feature `tls`);
//! used by the connection driver and the bindings.

mod acceptor;
mod connector;
mod files;
pub mod subject;
#[cfg(test)]
mod testing;

use crate::error::PeerAt;
use std::sync::Arc;

use rustls::crypto::CryptoProvider;

use crate::error::GradientStreamError;

pub use acceptor::TlsAcceptor;
pub use connector::TlsConnector;
pub use files::TlsFiles;

/// The one ALPN protocol both sides offer and require.
pub const ALPN: &[u8] = b"gradstream/1";

/// The TLS versions both sides allow.
const VERSIONS: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];

/// ring's provider, its TLS 1.3 suites in our order: AES-128-GCM first. Gradients are
/// bulk data and both ends spend a core on the cipher; AES-128-GCM is a standard TLS 1.3
/// suite (the one every implementation must offer), with the CPU's AES instructions it
/// runs faster than AES-256-GCM (fewer rounds), and a peer preferring another still gets
/// it (the server picks from what both offer).
fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::ring::cipher_suite::{
        TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
    };
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites = vec![
        TLS13_AES_128_GCM_SHA256,
        TLS13_AES_256_GCM_SHA384,
        TLS13_CHACHA20_POLY1305_SHA256,
    ];
    Arc::new(provider)
}

/// The TLS session's exporter value (RFC 8446, 7.5) for the label
/// `EXPORTER-gradstream-session`, no context: what binds a connection's session secret,
/// and a join's proof, to this TLS session (docs/spec/protocol.md, "Several streams").
pub(crate) fn exporter<D>(
    connection: &rustls::ConnectionCommon<D>,
    peer: Option<&PeerAt>,
) -> crate::error::Result<[u8; 32]> {
    connection
        .export_keying_material([0u8; 32], crate::protocol::streams::EXPORTER_LABEL, None)
        .map_err(|e| tls_error(format!("the TLS exporter failed: {e}"), peer))
}

/// A `Tls` error.
pub(crate) fn tls_error(detail: impl Into<String>, peer: Option<&PeerAt>) -> GradientStreamError {
    GradientStreamError::Tls {
        detail: detail.into(),
        peer: peer.cloned(),
    }
}

/// Which side of a handshake this is: a listener's words for a client that broke off
/// differ from a client's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Listener,
    Client,
}

/// What a peer that does not speak TLS at all is told (and the log says).
const NOT_TLS: &str = "the peer does not speak TLS (give both sides tls=, or neither)";

/// Our words for what rustls said where its words have a plainer cause (docs/guides/
/// connections.md): `{hint} ({rustls's words})`; else rustls's words alone.
fn described(error: &rustls::Error) -> String {
    use rustls::{AlertDescription, Error, InvalidMessage, PeerIncompatible};
    let hint = match error {
        Error::InvalidMessage(InvalidMessage::InvalidContentType) => Some(NOT_TLS),
        Error::PeerIncompatible(
            PeerIncompatible::SupportedVersionsExtensionRequired
            | PeerIncompatible::Tls12NotOffered
            | PeerIncompatible::Tls12NotOfferedOrEnabled,
        ) => Some("the peer does not offer TLS 1.3"),
        Error::NoCertificatesPresented => {
            Some("the client presented no certificate (this listener requires one: mutual TLS)")
        }
        Error::AlertReceived(AlertDescription::CertificateRequired) => Some(
            "the listener requires a client certificate (mutual TLS): give tls=TLS(cert=, \
             key=, ca=)",
        ),
        Error::AlertReceived(AlertDescription::ProtocolVersion) => Some("the peer refused TLS 1.3"),
        _ => None,
    };
    match hint {
        Some(hint) => format!("{hint} ({error})"),
        None => error.to_string(),
    }
}

/// An error of a TLS stream's read or write: `Tls` with what rustls said when the error
/// is rustls's (a fatal alert the peer sent, a corrupt record), else `Io`.
pub fn from_io(error: std::io::Error, peer: Option<&PeerAt>) -> GradientStreamError {
    match rustls_error(&error) {
        Some(e) => tls_error(described(e), peer),
        None => GradientStreamError::Io(error),
    }
}

/// An error of a handshake: always `Tls`, with rustls's own words when it has them. A
/// listener whose client hung up or sent an alert of its own is told the likely reason.
fn handshake_error(
    error: std::io::Error,
    side: Side,
    peer: Option<&PeerAt>,
) -> GradientStreamError {
    let broke_off = |what: String| {
        format!(
            "the client broke off the TLS handshake ({what}): it refused this listener's \
             certificate, or is no TLS client"
        )
    };
    let detail = match (rustls_error(&error), side) {
        (Some(e @ rustls::Error::AlertReceived(_)), Side::Listener) => {
            let said = described(e);
            if said == e.to_string() {
                broke_off(said)
            } else {
                said
            }
        }
        (Some(e), _) => described(e),
        (None, Side::Listener) => broke_off(error.to_string()),
        (None, Side::Client) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
            "the connection closed during the handshake".to_string()
        }
        (None, Side::Client) => error.to_string(),
    };
    tls_error(detail, peer)
}

fn rustls_error(error: &std::io::Error) -> Option<&rustls::Error> {
    error.get_ref()?.downcast_ref::<rustls::Error>()
}

/// Refuse a handshake that did not settle on `gradstream/1` (rustls refuses a peer that
/// offers only other protocols; one that offers none would otherwise pass).
fn check_alpn(agreed: Option<&[u8]>, peer: Option<&PeerAt>) -> crate::error::Result<()> {
    match agreed {
        Some(ALPN) => Ok(()),
        None => Err(tls_error(
            "the peer negotiated no ALPN; 'gradstream/1' is required",
            peer,
        )),
        Some(other) => Err(tls_error(
            format!(
                "the peer negotiated ALPN '{}'; 'gradstream/1' is required",
                String::from_utf8_lossy(other)
            ),
            peer,
        )),
    }
}

#[cfg(test)]
mod tests;
