//! Certificates made at test time (test builds only; none are committed): a CA, a server
//! certificate for 127.0.0.1 and localhost, a client certificate `CN=worker-1,O=lab`, and
//! a second CA that signed neither, each written as PEM into a directory removed on drop.
//! Uses rcgen; used by the TLS tests.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType, IsCa, KeyPair,
};

use super::TlsFiles;

/// A directory of its own under the system's temporary one, removed on drop.
pub(crate) struct Dir(pub PathBuf);

impl Dir {
    fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "gradstream-tls-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    pub(crate) fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every file of the test PKI.
pub(crate) struct Pki {
    pub dir: Dir,
    pub ca: PathBuf,
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A client certificate signed by the other CA.
    pub stranger_cert: PathBuf,
    pub stranger_key: PathBuf,
}

fn authority(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A certificate for `names` (subjectAltName) with the subject `dn`, signed by `issuer`:
/// its PEM and its key's PEM.
fn leaf(
    issuer: &CertifiedIssuer<'static, KeyPair>,
    names: &[&str],
    dn: &[(DnType, &str)],
) -> (String, String) {
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let mut params = CertificateParams::new(names).unwrap();
    params.distinguished_name = DistinguishedName::new();
    for (kind, value) in dn {
        params.distinguished_name.push(kind.clone(), *value);
    }
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

pub(crate) fn pki() -> Pki {
    let dir = Dir::new();
    let ca = authority("gradstream test CA");
    let other = authority("some other CA");
    let (server_cert, server_key) = leaf(
        &ca,
        &["127.0.0.1", "localhost"],
        &[(DnType::CommonName, "server")],
    );
    // In certificate order, the least specific first: the subject text reverses it.
    let worker = [
        (DnType::OrganizationName, "lab"),
        (DnType::CommonName, "worker-1"),
    ];
    let (client_cert, client_key) = leaf(&ca, &[], &worker);
    let (stranger_cert, stranger_key) = leaf(&other, &[], &worker);
    Pki {
        ca: dir.write("ca.pem", &ca.pem()),
        other_ca: dir.write("other-ca.pem", &other.pem()),
        server_cert: dir.write("server.pem", &server_cert),
        server_key: dir.write("server.key", &server_key),
        client_cert: dir.write("client.pem", &client_cert),
        client_key: dir.write("client.key", &client_key),
        stranger_cert: dir.write("stranger.pem", &stranger_cert),
        stranger_key: dir.write("stranger.key", &stranger_key),
        dir,
    }
}

impl Pki {
    /// A listener's files; `mutual` adds the CA, requiring client certificates.
    pub(crate) fn server(&self, mutual: bool) -> TlsFiles {
        TlsFiles {
            cert: Some(self.server_cert.clone()),
            key: Some(self.server_key.clone()),
            ca: mutual.then(|| self.ca.clone()),
        }
    }

    /// A client's files, trusting the CA, with no certificate of its own.
    pub(crate) fn client(&self) -> TlsFiles {
        TlsFiles {
            ca: Some(self.ca.clone()),
            ..TlsFiles::default()
        }
    }

    /// A client's files with the worker's certificate, for mutual TLS.
    pub(crate) fn worker(&self) -> TlsFiles {
        TlsFiles {
            cert: Some(self.client_cert.clone()),
            key: Some(self.client_key.clone()),
            ..self.client()
        }
    }
}
