//! Handshakes between `TlsAcceptor` and `TlsConnector` over in-memory pipes and loopback
//! TCP, with certificates made at test time: the good cases, and the peers each side must
//! refuse (the wrong name, an unknown CA, no client certificate, no ALPN, a plaintext peer).
//! Uses `testing` (the certificates), the module's API and raw rustls peers; test builds
//! only.

use std::net::SocketAddr;
use std::sync::Arc;

use rustls::ProtocolVersion;
use rustls_pki_types::ServerName;
use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt, DuplexStream};

use super::testing::{pki, Pki};
use super::*;
use crate::error::{GradientStreamError, Result};

const CLIENT_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 50000);
const SERVER_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 7000);

type Accepted = Result<(
    tokio_rustls::server::TlsStream<DuplexStream>,
    Option<String>,
)>;
type Connected = Result<tokio_rustls::client::TlsStream<DuplexStream>>;

/// Both handshakes at once over a pipe; the side that fails drops its end, so the other
/// never waits for ever.
async fn handshake(server: &TlsFiles, client: &TlsFiles, host: &str) -> (Accepted, Connected) {
    let acceptor = TlsAcceptor::new(server).unwrap();
    let connector = TlsConnector::new(client).unwrap();
    let (a, b) = duplex(1 << 16);
    tokio::join!(
        acceptor.accept(a, Some(&PeerAt::Tcp(CLIENT_ADDR))),
        connector.connect(host, b, Some(&PeerAt::Tcp(SERVER_ADDR)))
    )
}

/// The detail of a `Tls` error, after checking it names `peer`.
fn detail<T>(result: Result<T>, peer: SocketAddr) -> String {
    match result {
        Err(GradientStreamError::Tls { detail, peer: p }) => {
            assert_eq!(p, Some(PeerAt::Tcp(peer)));
            detail
        }
        Err(e) => panic!("not a TLS error: {e:?}"),
        Ok(_) => panic!("no error"),
    }
}

fn setting_error<T>(result: Result<T>) -> String {
    match result {
        Err(GradientStreamError::Tls { detail, peer: None }) => detail,
        Err(e) => panic!("not a TLS setting error: {e:?}"),
        Ok(_) => panic!("no error"),
    }
}

async fn exchange<A, B>(mut a: A, mut b: B)
where
    A: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    B: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    a.write_all(b"ping").await.unwrap();
    a.flush().await.unwrap();
    let mut got = [0u8; 4];
    b.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"ping");
    b.write_all(b"pong").await.unwrap();
    b.flush().await.unwrap();
    a.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"pong");
}

#[tokio::test]
async fn a_good_handshake_is_tls13_with_alpn_by_ip_and_by_name() {
    let pki = pki();
    for host in ["127.0.0.1", "localhost"] {
        let (server, client) = handshake(&pki.server(false), &pki.client(), host).await;
        let (server, subject) = server.unwrap();
        let client = client.unwrap();
        assert_eq!(subject, None);
        for state in [
            server.get_ref().1.protocol_version(),
            client.get_ref().1.protocol_version(),
        ] {
            assert_eq!(state, Some(ProtocolVersion::TLSv1_3));
        }
        assert_eq!(server.get_ref().1.alpn_protocol(), Some(ALPN));
        assert_eq!(client.get_ref().1.alpn_protocol(), Some(ALPN));
        exchange(client, server).await;
    }
}

#[tokio::test]
async fn a_handshake_over_loopback_tcp() {
    let pki = pki();
    let acceptor = TlsAcceptor::new(&pki.server(true)).unwrap();
    let connector = TlsConnector::new(&pki.worker()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (accepted, connected) = tokio::join!(
        async {
            let (tcp, peer) = listener.accept().await.unwrap();
            acceptor.accept(tcp, Some(&PeerAt::Tcp(peer))).await
        },
        async {
            let tcp = tokio::net::TcpStream::connect(address).await.unwrap();
            connector
                .connect("127.0.0.1", tcp, Some(&PeerAt::Tcp(address)))
                .await
        }
    );
    let (server, subject) = accepted.unwrap();
    assert_eq!(subject.as_deref(), Some("CN=worker-1,O=lab"));
    exchange(connected.unwrap(), server).await;
}

#[tokio::test]
async fn a_name_the_certificate_does_not_hold_is_refused() {
    let pki = pki();
    for host in ["example.com", "127.0.0.2", "[::1]"] {
        let (server, client) = handshake(&pki.server(false), &pki.client(), host).await;
        let text = detail(client, SERVER_ADDR);
        assert!(
            text.starts_with("invalid peer certificate: certificate not valid for name"),
            "{text}"
        );
        assert!(
            text.contains("127.0.0.1") && text.contains("localhost"),
            "{text}"
        );
        assert_eq!(
            detail(server, CLIENT_ADDR),
            "the client broke off the TLS handshake (received fatal alert: BadCertificate): \
             it refused this listener's certificate, or is no TLS client"
        );
    }
}

#[tokio::test]
async fn a_server_signed_by_another_ca_is_refused() {
    let pki = pki();
    let client = TlsFiles {
        ca: Some(pki.other_ca.clone()),
        ..TlsFiles::default()
    };
    let (server, client) = handshake(&pki.server(false), &client, "localhost").await;
    assert_eq!(
        detail(client, SERVER_ADDR),
        "invalid peer certificate: UnknownIssuer"
    );
    assert!(detail(server, CLIENT_ADDR)
        .starts_with("the client broke off the TLS handshake (received fatal alert: UnknownCA)"));
}

#[tokio::test]
async fn mutual_tls_refuses_a_client_without_a_certificate_on_both_sides() {
    let pki = pki();
    let (server, client) = handshake(&pki.server(true), &pki.client(), "localhost").await;
    assert_eq!(
        detail(server, CLIENT_ADDR),
        "the client presented no certificate (this listener requires one: mutual TLS) (peer \
         sent no certificates)"
    );
    // TLS 1.3: the client's handshake is over before the server has read its (empty)
    // certificate; its first read gets the server's alert.
    let mut client = client.unwrap();
    let mut byte = [0u8; 1];
    let read = client
        .read(&mut byte)
        .await
        .map_err(|e| from_io(e, Some(&PeerAt::Tcp(SERVER_ADDR))));
    assert_eq!(
        detail(read, SERVER_ADDR),
        "the listener requires a client certificate (mutual TLS): give tls=TLS(cert=, key=, \
         ca=) (received fatal alert: CertificateRequired)"
    );
}

#[tokio::test]
async fn mutual_tls_refuses_a_client_certificate_of_another_ca() {
    let pki = pki();
    let stranger = TlsFiles {
        cert: Some(pki.stranger_cert.clone()),
        key: Some(pki.stranger_key.clone()),
        ..pki.client()
    };
    let (server, client) = handshake(&pki.server(true), &stranger, "localhost").await;
    assert_eq!(
        detail(server, CLIENT_ADDR),
        "invalid peer certificate: UnknownIssuer"
    );
    let mut byte = [0u8; 1];
    let read = client
        .unwrap()
        .read(&mut byte)
        .await
        .map_err(|e| from_io(e, Some(&PeerAt::Tcp(SERVER_ADDR))));
    assert_eq!(detail(read, SERVER_ADDR), "received fatal alert: UnknownCA");
}

#[tokio::test]
async fn mutual_tls_hands_back_the_client_subject() {
    let pki = pki();
    let (server, client) = handshake(&pki.server(true), &pki.worker(), "127.0.0.1").await;
    let (server, subject) = server.unwrap();
    assert_eq!(subject.as_deref(), Some("CN=worker-1,O=lab"));
    exchange(client.unwrap(), server).await;
}

/// A rustls client config trusting the test CA, offering `alpn`.
fn raw_client(pki: &Pki, alpn: Vec<Vec<u8>>) -> tokio_rustls::TlsConnector {
    let roots = pki.client().roots().unwrap().unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn;
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

#[tokio::test]
async fn a_client_without_alpn_is_refused() {
    let pki = pki();
    let acceptor = TlsAcceptor::new(&pki.server(false)).unwrap();
    for (alpn, server_says) in [
        (
            vec![],
            "the peer negotiated no ALPN; 'gradstream/1' is required",
        ),
        (
            vec![b"h2".to_vec()],
            "peer doesn't support any known protocol",
        ),
    ] {
        let (a, b) = duplex(1 << 16);
        let name = ServerName::try_from("localhost").unwrap();
        let raw = raw_client(&pki, alpn);
        let (server, _client) = tokio::join!(
            acceptor.accept(a, Some(&PeerAt::Tcp(CLIENT_ADDR))),
            raw.connect(name, b)
        );
        assert_eq!(detail(server, CLIENT_ADDR), server_says);
    }
}

#[tokio::test]
async fn a_server_without_alpn_is_refused() {
    let pki = pki();
    let identity = pki.server(false).identity().unwrap().unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(identity.chain, identity.key)
        .unwrap();
    let raw = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let connector = TlsConnector::new(&pki.client()).unwrap();
    let (a, b) = duplex(1 << 16);
    let (_server, client) = tokio::join!(
        raw.accept(a),
        connector.connect("localhost", b, Some(&PeerAt::Tcp(SERVER_ADDR)))
    );
    assert_eq!(
        detail(client, SERVER_ADDR),
        "the peer negotiated no ALPN; 'gradstream/1' is required"
    );
}

#[tokio::test]
async fn a_plaintext_peer_at_a_tls_listener_is_refused() {
    let pki = pki();
    let acceptor = TlsAcceptor::new(&pki.server(false)).unwrap();
    let hello = crate::protocol::Hello::with_nonce(
        crate::protocol::Role::Client,
        false,
        [0; 32],
        crate::frame::Limits::default(),
    );
    for first in [
        hello.to_bytes().to_vec(),
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        vec![],
    ] {
        let (a, mut b) = duplex(1 << 16);
        b.write_all(&first).await.unwrap();
        drop(b);
        let text = detail(
            acceptor.accept(a, Some(&PeerAt::Tcp(CLIENT_ADDR))).await,
            CLIENT_ADDR,
        );
        if first.is_empty() {
            assert!(
                text.starts_with("the client broke off the TLS handshake"),
                "{text}"
            );
        } else {
            assert!(text.starts_with("the peer does not speak TLS"), "{text}");
        }
    }
}

#[tokio::test]
async fn hosts_that_are_not_names_are_refused_before_a_byte_is_sent() {
    let pki = pki();
    let connector = TlsConnector::new(&pki.client()).unwrap();
    let (_a, b) = duplex(64);
    assert_eq!(
        detail(
            connector
                .connect("not a host!", b, Some(&PeerAt::Tcp(SERVER_ADDR)))
                .await,
            SERVER_ADDR
        ),
        "\"not a host!\" is not a DNS name or an IP address"
    );
}

#[test]
fn files_are_checked_naming_the_file() {
    let pki = pki();
    let missing = pki.dir.0.join("missing.key");
    let no_key = TlsFiles {
        key: Some(missing.clone()),
        ..pki.server(false)
    };
    let text = setting_error(TlsAcceptor::new(&no_key));
    assert!(
        text.contains(&format!("do not load: cannot read {}: ", missing.display())),
        "{text}"
    );
    let not_pem = pki.dir.write("notes.txt", "not a certificate\n");
    let bad_cert = TlsFiles {
        cert: Some(not_pem.clone()),
        ..pki.server(false)
    };
    assert_eq!(
        setting_error(TlsAcceptor::new(&bad_cert)),
        format!(
            "TLS cert= '{}' and key= '{}' do not load: {} holds no PEM certificate",
            not_pem.display(),
            pki.server_key.display(),
            not_pem.display()
        )
    );
    // A certificate where the key belongs.
    let cert_as_key = TlsFiles {
        key: Some(pki.server_cert.clone()),
        ..pki.server(false)
    };
    assert!(
        setting_error(TlsAcceptor::new(&cert_as_key)).ends_with(&format!(
            "do not load: {} holds no PEM private key",
            pki.server_cert.display()
        ))
    );
    let cut = pki
        .dir
        .write("cut.pem", "-----BEGIN CERTIFICATE-----\nMIIB\n");
    let cut_ca = TlsFiles {
        ca: Some(cut.clone()),
        ..TlsFiles::default()
    };
    let text = setting_error(TlsConnector::new(&cut_ca));
    assert!(
        text.starts_with(&format!(
            "TLS ca= '{}' does not load: {} is not valid PEM: ",
            cut.display(),
            cut.display()
        )),
        "{text}"
    );
    // The client's key with the server's certificate.
    let mismatched = TlsFiles {
        key: Some(pki.client_key.clone()),
        ..pki.server(false)
    };
    let text = setting_error(TlsAcceptor::new(&mismatched));
    assert!(
        text.contains("do not load: the certificate and key do not go together: "),
        "{text}"
    );
}

#[test]
fn each_side_needs_its_files() {
    let pki = pki();
    assert_eq!(
        setting_error(TlsAcceptor::new(&pki.client())),
        "a TLS listener needs cert and key"
    );
    assert_eq!(
        setting_error(TlsConnector::new(&TlsFiles::default())),
        "a TLS client needs ca"
    );
    let half = TlsFiles {
        key: None,
        ..pki.server(false)
    };
    assert_eq!(
        setting_error(TlsAcceptor::new(&half)),
        "cert and key go together: give both or neither"
    );
}

#[test]
fn io_errors_that_are_not_tls_stay_io() {
    let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
    assert!(matches!(from_io(reset, None), GradientStreamError::Io(_)));
    let alert = std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRequired),
    );
    assert!(matches!(
        from_io(alert, None),
        GradientStreamError::Tls { detail, .. } if detail.ends_with("(received fatal alert: CertificateRequired)")
    ));
}

#[test]
fn the_subject_of_a_real_certificate_is_rfc_4514_text_and_no_cut_of_it_reads() {
    use rustls_pki_types::pem::PemObject;
    let pki = pki();
    let der = rustls_pki_types::CertificateDer::from_pem_file(&pki.client_cert).unwrap();
    let der: &[u8] = der.as_ref();
    assert_eq!(subject::subject_text(der), Ok("CN=worker-1,O=lab".into()));
    for len in 0..der.len() {
        assert!(subject::subject_text(&der[..len]).is_err(), "cut at {len}");
    }
    for at in 0..der.len() {
        let mut mutated = der.to_vec();
        mutated[at] ^= 0xff;
        let _ = subject::subject_text(&mutated);
    }
}
