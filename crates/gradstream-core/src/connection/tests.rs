//! Connections end to end over 127.0.0.1: a sealed, acknowledged round trip each way, an
//! authkey both sides hold and one they do not, a foreign peer turned into a refusal
//! event while the listener goes on, a peer's limit honoured before a byte is sent, and
//! the tests' fixed nonce in the hello.

use std::time::Duration;

use tokio::io::AsyncWriteExt;

use super::*;
use crate::error::GradientStreamError;
use crate::frame::Limits;
use crate::receiver::Ended;
use crate::session::SessionConfig;
use crate::stream::{Progress, Waits};

const KEY: &[u8] = b"sixteen bytes or more";

fn listen_settings(authkey: Option<&[u8]>, limits: Limits) -> ListenSettings {
    ListenSettings {
        protocol: Protocol::Gradstream,
        tls: None,
        authkey: authkey.map(<[u8]>::to_vec),
        handshake_timeout: Duration::from_secs(5),
        max_connections: 4,
        admission: Admission {
            max_pending_handshakes: 4,
            ..Admission::default()
        },
        limits,
        test_nonce: None,
    }
}

fn dial_settings(authkey: Option<&[u8]>) -> DialSettings {
    DialSettings {
        protocol: Protocol::Gradstream,
        tls: None,
        authkey: authkey.map(<[u8]>::to_vec),
        handshake_timeout: Duration::from_secs(5),
        limits: Limits::default(),
        test_nonce: None,
    }
}

async fn next_link(listener: &mut Listener) -> Link {
    match listener.next().await {
        Some(Event::Connected(link)) => link,
        Some(Event::Refused { .. }) => panic!("refused"),
        None => panic!("the listener closed"),
    }
}

async fn refusal(listener: &mut Listener) -> GradientStreamError {
    match listener.next().await {
        Some(Event::Refused {
            why: Refusal::Failed(error),
            ..
        }) => error,
        _ => panic!("expected a refusal"),
    }
}

fn values(link: Ended) -> Vec<f32> {
    match link {
        Ended::Gradient(output) => output.into_vec(),
        Ended::BeforeFirstByte(_) => panic!("the peer closed"),
    }
}

#[tokio::test]
async fn a_sealed_round_trip_each_way_is_acknowledged() {
    let config = SessionConfig::new("t", 1000);
    let mut listener = Listener::bind(
        "127.0.0.1",
        0,
        listen_settings(Some(KEY), Limits::default()),
    )
    .await
    .expect("binds");
    let port = listener.address().port();
    let grad: Vec<f32> = (0..2500).map(|i| i as f32 * 0.5).collect();
    let client = async {
        let mut link = connect("127.0.0.1", port, &dial_settings(Some(KEY)))
            .await
            .expect("connects");
        assert!(link.peer().authenticated);
        let p = Progress::default();
        for _ in 0..2 {
            let sent = link.send_gradient(&config, (&grad).into(), Waits::default(), &p);
            assert_eq!(sent.await.expect("acknowledged"), 3);
        }
        let back = link
            .recv_gradient(config.receiver(), Waits::default(), &p)
            .await;
        link.acknowledge().await.expect("acknowledges");
        link.close().await;
        values(back.expect("receives"))
    };
    let server = async {
        let mut link = next_link(&mut listener).await;
        let p = Progress::default();
        let mut got = Vec::new();
        for _ in 0..2 {
            let ended = link
                .recv_gradient(config.receiver(), Waits::default(), &p)
                .await;
            got.push(values(ended.expect("receives")));
            link.acknowledge().await.expect("acknowledges");
        }
        let sent = link.send_gradient(&config, (&got[0]).into(), Waits::default(), &p);
        assert_eq!(sent.await.expect("acknowledged"), 3);
        let end = link
            .recv_gradient(config.receiver(), Waits::default(), &p)
            .await;
        assert!(matches!(end, Ok(Ended::BeforeFirstByte(_))));
        assert!(link.is_closed());
        got
    };
    let (back, got) = tokio::join!(client, server);
    assert_eq!(got, vec![grad.clone(), grad.clone()]);
    assert_eq!(back, grad);
}

#[tokio::test]
async fn a_wrong_authkey_fails_on_both_sides_and_the_listener_goes_on() {
    let mut listener = Listener::bind(
        "127.0.0.1",
        0,
        listen_settings(Some(KEY), Limits::default()),
    )
    .await
    .expect("binds");
    let port = listener.address().port();
    let wrong = connect(
        "127.0.0.1",
        port,
        &dial_settings(Some(b"another key of 16+ bytes")),
    )
    .await;
    assert!(
        matches!(wrong, Err(GradientStreamError::Authentication { .. })),
        "{:?}",
        wrong.err()
    );
    let error = refusal(&mut listener).await;
    assert!(
        matches!(error, GradientStreamError::Authentication { .. }),
        "{error}"
    );
    // A foreign peer: an HTTP request.
    let mut http = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connects");
    http.write_all(b"GET / HTTP/1.1\r\n\r\n")
        .await
        .expect("writes");
    let error = refusal(&mut listener).await;
    assert!(error.to_string().contains("an HTTP request"), "{error}");
    let settings = dial_settings(Some(KEY));
    let good = connect("127.0.0.1", port, &settings);
    let (good, accepted) = tokio::join!(good, next_link(&mut listener));
    assert!(good.expect("connects").peer().authenticated && accepted.peer().authenticated);
}

#[tokio::test]
async fn a_gradient_over_the_peers_limit_is_refused_before_a_byte() {
    let small = Limits {
        max_gradient_len: 10,
        ..Limits::default()
    };
    let mut listener = Listener::bind("127.0.0.1", 0, listen_settings(None, small))
        .await
        .expect("binds");
    let port = listener.address().port();
    let settings = dial_settings(None);
    let (client, _server) = tokio::join!(
        connect("127.0.0.1", port, &settings),
        next_link(&mut listener)
    );
    let mut link = client.expect("connects");
    let config = SessionConfig::new("t", 4);
    let grad = vec![1.0f32; 11];
    let sent = link
        .send_gradient(
            &config,
            (&grad).into(),
            Waits::default(),
            &Progress::default(),
        )
        .await;
    match sent {
        Err(GradientStreamError::Delivery { detail, reason, .. }) => {
            assert!(
                detail.contains("above the peer's max_gradient_len 10"),
                "{detail}"
            );
            assert_eq!(reason, None);
        }
        other => panic!("expected a DeliveryError, got {:?}", other.err()),
    }
}

#[tokio::test]
async fn a_fixed_test_nonce_is_the_hellos_nonce() {
    use crate::protocol::{Hello, Role, HELLO_LEN};
    let (mut ours, mut theirs) = tokio::io::duplex(1024);
    let nonce = [7u8; 32];
    let limits = Limits::default();
    let peer_hello = Hello::with_nonce(Role::Server, false, [9u8; 32], limits).to_bytes();
    theirs.write_all(&peer_hello).await.expect("writes");
    let shaken = handshake::handshake(
        &mut ours,
        Role::Client,
        false,
        None,
        limits,
        None,
        Some(nonce),
    )
    .await
    .expect("shakes hands");
    assert_eq!(
        (shaken.client_nonce, shaken.server_nonce),
        (nonce, [9u8; 32])
    );
    let mut sent = [0u8; HELLO_LEN];
    tokio::io::AsyncReadExt::read_exact(&mut theirs, &mut sent)
        .await
        .expect("reads");
    assert_eq!(
        sent,
        Hello::with_nonce(Role::Client, false, nonce, limits).to_bytes()
    );
}

/// One side of a Unix-domain connection whose bytes move through shared-memory rings
/// (`crate::shm::ShmStream`): the hello and authentication on the socket, then the rings,
/// then a link as over TCP (the same-host transport, issue 24, before it has addresses).
#[cfg(target_os = "linux")]
async fn shm_link(socket: tokio::net::UnixStream, role: crate::protocol::Role) -> Link {
    use crate::shm::{RingLimits, ShmStream};
    let mut socket = socket;
    let established = handshake::handshake(
        &mut socket,
        role,
        false,
        Some(KEY),
        Limits::default(),
        None,
        None,
    )
    .await
    .expect("shakes hands");
    let stream = ShmStream::open(socket, 64 << 10, &RingLimits::default())
        .await
        .expect("opens the rings");
    let nowhere = std::net::SocketAddr::from(([0, 0, 0, 0], 0));
    let who = link::Peer::without_certificate(nowhere, established.authenticated);
    Link::sealed(Box::new(stream), established, who)
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_sealed_round_trip_each_way_runs_over_shared_memory_rings() {
    use crate::protocol::Role;
    let config = SessionConfig::new("t", 65536);
    let (a, b) = tokio::net::UnixStream::pair().expect("a socket pair");
    // Larger than the 64 KiB rings: sends wait for credits and the rings wrap.
    let grad: Vec<f32> = (0..300_000).map(|i| i as f32 * 0.25 - 7.0).collect();
    let client = async {
        let mut link = shm_link(a, Role::Client).await;
        assert!(link.peer().authenticated);
        let p = Progress::default();
        let sent = link.send_gradient(&config, (&grad).into(), Waits::default(), &p);
        assert_eq!(sent.await.expect("acknowledged"), 5);
        let back = link
            .recv_gradient(config.receiver(), Waits::default(), &p)
            .await;
        link.acknowledge().await.expect("acknowledges");
        link.close().await;
        values(back.expect("receives"))
    };
    let server = async {
        let mut link = shm_link(b, Role::Server).await;
        let p = Progress::default();
        let ended = link
            .recv_gradient(config.receiver(), Waits::default(), &p)
            .await;
        let got = values(ended.expect("receives"));
        link.acknowledge().await.expect("acknowledges");
        let sent = link.send_gradient(&config, (&got).into(), Waits::default(), &p);
        assert_eq!(sent.await.expect("acknowledged"), 5);
        let end = link
            .recv_gradient(config.receiver(), Waits::default(), &p)
            .await;
        assert!(matches!(end, Ok(Ended::BeforeFirstByte(_))));
        assert!(link.is_closed());
        got
    };
    let (back, got) = tokio::join!(client, server);
    assert_eq!(got, grad);
    assert_eq!(back, grad);
}
