//! The PEM files a TLS side is given (`TlsFiles`), read into a certificate chain, a
//! private key and a store of CA roots; every failure a `Tls` error naming the file.
//!
//! Uses rustls-pki-types' PEM reader and rustls's root store; used by `acceptor` and
//! `connector`.

use std::path::{Path, PathBuf};

use rustls::RootCertStore;
use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::tls_error;
use crate::error::Result;

/// Where a side's certificate, key and CA are, each a PEM file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// The side's certificate chain, its own certificate first.
    pub cert: Option<PathBuf>,
    /// The private key of `cert`.
    pub key: Option<PathBuf>,
    /// The CA certificates the peer's certificate must be signed by.
    pub ca: Option<PathBuf>,
}

/// What a side presents: its chain and key.
pub(crate) struct Identity {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl TlsFiles {
    /// The chain and key, when `cert` and `key` are both given (both or neither).
    pub(crate) fn identity(&self) -> Result<Option<Identity>> {
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Ok(Some(Identity {
                chain: certificates(cert)?,
                key: private_key(key)?,
            })),
            (None, None) => Ok(None),
            _ => Err(tls_error(
                "cert and key go together: give both or neither",
                None,
            )),
        }
    }

    /// The CA roots, when `ca` is given.
    pub(crate) fn roots(&self) -> Result<Option<RootCertStore>> {
        let Some(path) = &self.ca else {
            return Ok(None);
        };
        let mut roots = RootCertStore::empty();
        for certificate in certificates(path)? {
            roots.add(certificate).map_err(|e| {
                tls_error(
                    format!(
                        "{} holds a CA certificate rustls refuses: {e}",
                        path.display()
                    ),
                    None,
                )
            })?;
        }
        Ok(Some(roots))
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| tls_error(format!("cannot read {}: {e}", path.display()), None))
}

fn unreadable(path: &Path, what: &str, error: pem::Error) -> crate::error::GradientStreamError {
    match error {
        pem::Error::NoItemsFound => {
            tls_error(format!("{} holds no PEM {what}", path.display()), None)
        }
        other => tls_error(
            format!("{} is not valid PEM: {other}", path.display()),
            None,
        ),
    }
}

/// Every certificate in a PEM file; at least one.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let text = read(path)?;
    let chain = CertificateDer::pem_slice_iter(&text)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| unreadable(path, "certificate", e))?;
    if chain.is_empty() {
        return Err(unreadable(path, "certificate", pem::Error::NoItemsFound));
    }
    Ok(chain)
}

/// The first private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    let text = read(path)?;
    PrivateKeyDer::from_pem_slice(&text).map_err(|e| unreadable(path, "private key", e))
}
