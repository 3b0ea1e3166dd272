//! The PEM files a TLS side is given (`TlsFiles`), read into a certificate chain, a
//! private key and a store of CA roots; every failure a `Tls` error naming the keyword
//! and the file (`TLS cert= ... and key= ... do not load: ...`, `TLS ca= ... does not
//! load: ...`, the reference's words), which the bindings raise as a `SettingError`.
//!
//! Uses rustls-pki-types' PEM reader and rustls's root store; used by `acceptor` and
//! `connector`.

use std::path::{Path, PathBuf};

use rustls::RootCertStore;
use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::tls_error;
use crate::error::{GradientStreamError, Result};

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
            (Some(cert), Some(key)) => {
                let loaded = certificates(cert).and_then(|chain| Ok((chain, private_key(key)?)));
                let (chain, key) = loaded.map_err(|what| self.identity_error(what))?;
                Ok(Some(Identity { chain, key }))
            }
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
        let loaded = certificates(path).and_then(|chain| {
            for certificate in chain {
                roots.add(certificate).map_err(|e| {
                    format!(
                        "{} holds a CA certificate rustls refuses: {e}",
                        path.display()
                    )
                })?;
            }
            Ok(())
        });
        loaded.map_err(|what| {
            tls_error(
                format!("TLS ca= {} does not load: {what}", quoted(path)),
                None,
            )
        })?;
        Ok(Some(roots))
    }

    /// A failure to load `cert` and `key`, or to use them together (`what`), in the
    /// words of a setting (the bindings raise it as a `SettingError`).
    pub(crate) fn identity_error(&self, what: impl std::fmt::Display) -> GradientStreamError {
        let path = |p: &Option<PathBuf>| p.as_deref().map_or_else(|| "None".into(), quoted);
        tls_error(
            format!(
                "TLS cert= {} and key= {} do not load: {what}",
                path(&self.cert),
                path(&self.key)
            ),
            None,
        )
    }
}

/// A path as the Python side quotes it (`_peers.quoted`): in single quotes, `\` and `'`
/// escaped by a backslash.
fn quoted(path: &Path) -> String {
    let text = path.display().to_string();
    format!("'{}'", text.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// A file's failure to load, in words.
type Unloaded = String;

fn read(path: &Path) -> std::result::Result<Vec<u8>, Unloaded> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn unreadable(path: &Path, what: &str, error: pem::Error) -> Unloaded {
    match error {
        pem::Error::NoItemsFound => format!("{} holds no PEM {what}", path.display()),
        other => format!("{} is not valid PEM: {other}", path.display()),
    }
}

/// Every certificate in a PEM file; at least one.
fn certificates(path: &Path) -> std::result::Result<Vec<CertificateDer<'static>>, Unloaded> {
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
fn private_key(path: &Path) -> std::result::Result<PrivateKeyDer<'static>, Unloaded> {
    let text = read(path)?;
    PrivateKeyDer::from_pem_slice(&text).map_err(|e| unreadable(path, "private key", e))
}
