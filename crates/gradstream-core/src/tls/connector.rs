//! `TlsConnector`: the client's side of TLS. The CA is required, and the server's
//! certificate must name the host or IP `connect` is given in its subjectAltName; with a
//! certificate and key, the client presents them for mutual TLS. Resumption is off.
//!
//! Uses `files`, the notes' helpers and `tensors::ascii` (how messages quote); used by the connection driver.

use crate::error::PeerAt;
use std::sync::Arc;

use rustls::client::Resumption;
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::client::TlsStream;

use super::files::TlsFiles;
use super::{check_alpn, handshake_error, provider, tls_error, Side, ALPN, VERSIONS};
use crate::error::Result;

/// A client's TLS settings, ready to connect.
#[derive(Clone)]
pub struct TlsConnector {
    inner: tokio_rustls::TlsConnector,
}

impl TlsConnector {
    pub fn new(files: &TlsFiles) -> Result<Self> {
        let Some(roots) = files.roots()? else {
            return Err(tls_error("a TLS client needs ca", None));
        };
        let identity = files.identity()?;
        let builder = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(VERSIONS)
            .map_err(|e| tls_error(e.to_string(), None))?
            .with_root_certificates(roots);
        let mut config = match identity {
            None => builder.with_no_client_auth(),
            Some(identity) => builder
                .with_client_auth_cert(identity.chain, identity.key)
                .map_err(|e| {
                    files.identity_error(format!("the certificate and key do not go together: {e}"))
                })?,
        };
        config.alpn_protocols = vec![ALPN.to_vec()];
        config.resumption = Resumption::disabled();
        Ok(Self {
            inner: tokio_rustls::TlsConnector::from(Arc::new(config)),
        })
    }

    /// The client's handshake on `stream` with the server named `host`: a DNS name or an
    /// IP literal (an IPv6 one with or without brackets), which the server's certificate
    /// must hold in its subjectAltName.
    pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        host: &str,
        stream: S,
        peer: Option<&PeerAt>,
    ) -> Result<TlsStream<S>> {
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let name = ServerName::try_from(bare.to_string())
            .map_err(|_| tls_error(format!("{host:?} is not a DNS name or an IP address"), peer))?;
        let tls = self
            .inner
            .connect(name, stream)
            .await
            .map_err(|e| handshake_error(e, Side::Client, peer))?;
        check_alpn(tls.get_ref().1.alpn_protocol(), peer)?;
        Ok(tls)
    }
}
