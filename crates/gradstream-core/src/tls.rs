//! PLACEHOLDER until the TLS module lands (branch rsproto).
use std::net::SocketAddr;
use std::path::PathBuf;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::error::{GradientStreamError, Result};

pub struct TlsFiles {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca: Option<PathBuf>,
}

pub struct TlsAcceptor;
pub struct TlsConnector;

fn missing() -> GradientStreamError {
    GradientStreamError::Tls {
        detail: "not built yet".into(),
        peer: None,
    }
}

impl TlsAcceptor {
    pub fn new(_: &TlsFiles) -> Result<Self> {
        Err(missing())
    }
    pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: S,
        _: Option<SocketAddr>,
    ) -> Result<(S, Option<String>)> {
        Ok((stream, None))
    }
}

impl TlsConnector {
    pub fn new(_: &TlsFiles) -> Result<Self> {
        Err(missing())
    }
    pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        _: &str,
        stream: S,
        _: Option<SocketAddr>,
    ) -> Result<S> {
        Ok(stream)
    }
}
