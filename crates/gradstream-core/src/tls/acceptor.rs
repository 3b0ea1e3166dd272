//! `TlsAcceptor`: the listener's side of TLS. Its certificate and key are required; with a
//! CA, mutual TLS: the client must present a certificate signed by it, whose subject
//! `accept` hands back. Session resumption is off, so every connection is verified in full.
//!
//! Uses `files`, `subject` and the notes' helpers; used by the connection driver.

use crate::error::PeerAt;
use std::sync::Arc;

use rustls::server::{NoServerSessionStorage, WebPkiClientVerifier};
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::server::TlsStream;

use super::files::TlsFiles;
use super::subject::subject_text;
use super::{check_alpn, handshake_error, provider, tls_error, Side, ALPN, VERSIONS};
use crate::error::Result;

/// A listener's TLS settings, ready to accept connections.
#[derive(Clone)]
pub struct TlsAcceptor {
    inner: tokio_rustls::TlsAcceptor,
    mutual: bool,
}

impl TlsAcceptor {
    pub fn new(files: &TlsFiles) -> Result<Self> {
        let Some(identity) = files.identity()? else {
            return Err(tls_error("a TLS listener needs cert and key", None));
        };
        let builder = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(VERSIONS)
            .map_err(|e| tls_error(e.to_string(), None))?;
        let roots = files.roots()?;
        let mutual = roots.is_some();
        let builder = match roots {
            None => builder.with_no_client_auth(),
            Some(roots) => {
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                        .build()
                        .map_err(|e| {
                            tls_error(format!("the CA cannot verify clients: {e}"), None)
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(identity.chain, identity.key)
            .map_err(|e| {
                files.identity_error(format!("the certificate and key do not go together: {e}"))
            })?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        config.session_storage = Arc::new(NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
        Ok(Self {
            inner: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            mutual,
        })
    }

    /// The server's handshake on `stream`; under mutual TLS, with the subject text of
    /// the client's verified certificate.
    pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: S,
        peer: Option<&PeerAt>,
    ) -> Result<(TlsStream<S>, Option<String>)> {
        let tls = self
            .inner
            .accept(stream)
            .await
            .map_err(|e| handshake_error(e, Side::Listener, peer))?;
        let connection = tls.get_ref().1;
        check_alpn(connection.alpn_protocol(), peer)?;
        let subject = match (self.mutual, connection.peer_certificates()) {
            (false, _) => None,
            (true, Some([certificate, ..])) => Some(subject_text(certificate).map_err(|why| {
                tls_error(
                    format!("the client certificate's subject cannot be read: {why}"),
                    peer,
                )
            })?),
            // The verifier requires a certificate: rustls never gets here without one.
            (true, _) => return Err(tls_error("the client sent no certificate", peer)),
        };
        Ok((tls, subject))
    }
}
