//! Connections end to end over 127.0.0.1: a sealed, acknowledged round trip each way, an
//! authkey both sides hold and one they do not, a foreign peer turned into a refusal
//! event while the listener goes on, a peer's limit honoured before a byte is sent, and
//! the tests' fixed nonce in the hello.

use std::time::Duration;

use tokio::io::AsyncWriteExt;

use super::*;
use crate::error::GradientStreamError;
use crate::frame::Limits;
use crate::protocol::streams::Grant;
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
        max_streams: 16,
        resume_window: Duration::from_secs(5),
        #[cfg(target_os = "linux")]
        local: LocalSettings::default(),
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
        streams: 1,
        resume: None,
        #[cfg(target_os = "linux")]
        local: LocalSettings::default(),
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
    let side = handshake::Shake {
        test_nonce: Some(nonce),
        ..handshake::Shake::plain(Role::Client, limits)
    };
    let shaken = handshake::handshake(&mut ours, side, None)
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

/// A fresh path for a Unix-domain socket in the temporary directory.
#[cfg(target_os = "linux")]
fn socket_path(name: &str) -> std::path::PathBuf {
    let unique = format!(
        "gs-{}-{name}-{:?}",
        std::process::id(),
        std::time::Instant::now()
    );
    std::env::temp_dir().join(unique.replace([' ', ':', '.'], "_"))
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_unix_listener_and_dialler_move_gradients_through_shared_memory() {
    use std::os::unix::fs::PermissionsExt;
    let path = socket_path("round");
    let config = SessionConfig::new("t", 65536);
    let mut listener = Listener::bind_unix(&path, listen_settings(Some(KEY), Limits::default()))
        .await
        .expect("binds");
    assert_eq!(listener.address(), &Bound::Unix(path.clone()));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the socket file is the owner's alone");
    let grad: Vec<f32> = (0..3_000_000).map(|i| (i % 977) as f32 - 3.5).collect();
    let client = async {
        let mut link = connect_unix(&path, &dial_settings(Some(KEY)))
            .await
            .expect("connects");
        assert!(link.peer().authenticated);
        let PeerAddress::Local(server) = &link.peer().address else {
            panic!("not a same-host peer: {:?}", link.peer().address);
        };
        assert_eq!(server.pid, Some(std::process::id()));
        assert_eq!(server.uid, rustix::process::getuid().as_raw());
        let p = Progress::default();
        let sent = link.send_gradient(&config, (&grad).into(), Waits::default(), &p);
        assert_eq!(sent.await.expect("acknowledged"), 46);
        link.close().await;
    };
    let server = async {
        let mut link = next_link(&mut listener).await;
        assert!(matches!(&link.peer().address, PeerAddress::Local(p) if p.path == path));
        let ended = link
            .recv_gradient(config.receiver(), Waits::default(), &Progress::default())
            .await;
        let got = values(ended.expect("receives"));
        link.acknowledge().await.expect("acknowledges");
        got
    };
    let ((), got) = tokio::join!(client, server);
    assert!(got == grad, "the gradient differs");
    listener.stopper().stop().await;
    assert!(!path.exists(), "the socket file outlived its listener");
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_unix_listener_admits_its_own_user_only_unless_told_otherwise() {
    let path = socket_path("uid");
    let mut settings = listen_settings(None, Limits::default());
    let own = rustix::process::getuid().as_raw();
    settings.local.allowed_uid = Some(own.wrapping_add(1));
    let mut listener = Listener::bind_unix(&path, settings).await.expect("binds");
    let dial = dial_settings(None);
    let dialled = connect_unix(&path, &dial);
    let refused = listener.next();
    let (dialled, refused) = tokio::join!(dialled, refused);
    assert!(dialled.is_err(), "a refused peer got a link");
    match refused {
        Some(Event::Refused {
            address: PeerAddress::Local(peer),
            why: Refusal::Shed(why),
        }) => {
            assert_eq!(peer.uid, own);
            let text = why.to_string();
            assert!(
                text.contains(&format!(
                    "uid {own}, where this listener admits uid {}",
                    own.wrapping_add(1)
                )),
                "{text}"
            );
        }
        _ => panic!("expected the listener's refusal of the uid"),
    }
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_unix_listener_replaces_a_stale_socket_file_and_nothing_else() {
    let settings = || listen_settings(None, Limits::default());
    // A socket file nobody listens on (its listener died): replaced.
    let stale = socket_path("stale");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let listener = Listener::bind_unix(&stale, settings())
        .await
        .expect("replaces it");
    // A live one: an error, and the live listener keeps its file.
    let error = Listener::bind_unix(&stale, settings())
        .await
        .err()
        .expect("in use")
        .to_string();
    assert!(error.contains("a listener is already at unix:"), "{error}");
    assert!(stale.exists());
    drop(listener);
    // A file of another kind: left alone.
    let file = socket_path("file");
    std::fs::write(&file, b"precious").unwrap();
    let error = Listener::bind_unix(&file, settings())
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(error.contains("is not a socket"), "{error}");
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");
    std::fs::remove_file(&file).unwrap();
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn tls_and_the_seed_protocol_are_refused_on_unix_sockets() {
    let path = socket_path("seed");
    let mut settings = listen_settings(None, Limits::default());
    settings.protocol = Protocol::Seed;
    let error = Listener::bind_unix(&path, settings)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(error.contains("neither TLS nor protocol='seed'"), "{error}");
    let mut dial = dial_settings(None);
    dial.protocol = Protocol::Seed;
    let error = connect_unix(&path, &dial)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(error.contains("neither TLS nor protocol='seed'"), "{error}");
    // Refused before anything was made: neither the socket nor its lock file.
    assert!(!path.exists());
    let mut lock = path.clone().into_os_string();
    lock.push(".lock");
    assert!(!std::path::Path::new(&lock).exists());
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_unix_dialler_refuses_a_listener_of_another_user_before_sending_anything() {
    use std::os::unix::fs::PermissionsExt;
    let path = socket_path("squat");
    let own = rustix::process::getuid().as_raw();
    let mut settings = listen_settings(None, Limits::default());
    settings.local.allowed_uid = None; // any user: the file is open to all
    let listener = Listener::bind_unix(&path, settings).await.expect("binds");
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o666, "another user could not connect");
    let mut dial = dial_settings(None);
    dial.local.allowed_uid = Some(own.wrapping_add(1));
    let error = connect_unix(&path, &dial)
        .await
        .err()
        .expect("refused")
        .to_string();
    let says = format!(
        "is a process of uid {own}, not of uid {}",
        own.wrapping_add(1)
    );
    assert!(error.contains(&says), "{error}");
    drop(listener);
}

/// A blocking receive on a unix: link (as the bindings' `run_here` drives it): direct
/// with its socket parked, its read budget spent, then finished by tokio from bytes
/// already announced in the ring (so it ends without once waiting on the socket through
/// tokio's reactor); the ack written by
/// `send_settled_now` (one poll, no waiting) reaches the sender at once.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_unix_receive_finished_by_tokio_after_a_parked_phase_acks_at_once() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    let path = socket_path("escape");
    let config = SessionConfig::new("t", 65536);
    let mut listener = Listener::bind_unix(&path, listen_settings(Some(KEY), Limits::default()))
        .await
        .expect("binds");
    let grad: Vec<f32> = (0..250_000).map(|i| (i % 977) as f32).collect(); // 1 MB, < a ring
    let (client_path, client_config) = (path.clone(), config.clone());
    let client = tokio::spawn(async move {
        let mut link = connect_unix(&client_path, &dial_settings(Some(KEY)))
            .await
            .unwrap();
        let sent = link
            .send_gradient(
                &client_config,
                (&grad).into(),
                Waits::default(),
                &Progress::default(),
            )
            .await;
        (sent.map(drop), link)
    });
    let mut link = next_link(&mut listener).await;
    tokio::time::sleep(Duration::from_millis(300)).await; // all of it in the ring
    let (_, direct) = link.go_direct(true).expect("a same-host link goes direct");
    let budget = crate::connection::ReadBudget::new(256 * 1024);
    link.read_budget(Some(budget.clone()));
    let progress = Progress::default();
    let mut receive = Box::pin(link.recv_gradient(config.receiver(), Waits::default(), &progress));
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(got) = receive.as_mut().poll(&mut cx) {
            got.unwrap();
            panic!("the receive ended within the caller's budget: nothing was handed over");
        }
        if budget.exhausted() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    direct.off();
    budget.lift();
    receive.await.unwrap();
    link.read_budget(None);
    link.settle(true);
    link.send_settled_now();
    let (sent, _client_link) = tokio::time::timeout(Duration::from_secs(5), client)
        .await
        .expect("the sender had its ack within 5 s")
        .unwrap();
    sent.expect("acknowledged");
}

/// Dial `streams` streams with `settings` to a listener of `max_streams`; both ends.
async fn streamed(streams: u8, max_streams: u8) -> (Link, Link) {
    let settings = ListenSettings {
        max_streams,
        max_connections: 64,
        ..listen_settings(Some(KEY), Limits::default())
    };
    let mut listener = Listener::bind("127.0.0.1", 0, settings)
        .await
        .expect("binds");
    let port = listener.address().port();
    let dial = DialSettings {
        streams,
        ..dial_settings(Some(KEY))
    };
    let (client, server) =
        tokio::join!(connect("127.0.0.1", port, &dial), next_link(&mut listener));
    (client.expect("connects"), server)
}

/// `grad` from one end to the other, acknowledged: the chunks sent, what arrived.
async fn across(
    from: &mut Link,
    to: &mut Link,
    config: &SessionConfig,
    grad: &[f32],
) -> (usize, Vec<f32>) {
    let p = Progress::default();
    let sent = from.send_gradient(config, grad.into(), Waits::default(), &p);
    let got = async {
        let got = to
            .recv_gradient(config.receiver(), Waits::default(), &p)
            .await;
        to.acknowledge().await.expect("acknowledges");
        values(got.expect("receives"))
    };
    let (sent, got) = tokio::join!(sent, got);
    (sent.expect("acknowledged"), got)
}

#[tokio::test]
async fn a_gradient_crosses_several_streams_each_way_and_is_acknowledged() {
    let (mut client, mut server) = streamed(4, 16).await;
    assert_eq!((client.streams(), server.streams()), (4, 4));
    let config = SessionConfig::new("t", 100);
    let p = Progress::default();
    // 10 000 values in 100 chunks, then one chunk (three streams carry nothing), then none.
    for n in [10_000usize, 7, 0] {
        let grad: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
        let (chunks, got) = across(&mut client, &mut server, &config, &grad).await;
        assert_eq!((chunks, &got), (n.div_ceil(100).max(1), &grad));
        // And back, from the listener's side.
        let (_, returned) = across(&mut server, &mut client, &config, &got).await;
        assert_eq!(returned, grad);
    }
    client.close().await;
    let end = server
        .recv_gradient(config.receiver(), Waits::default(), &p)
        .await;
    assert!(matches!(end, Ok(Ended::BeforeFirstByte(_))), "{end:?}");
}

#[tokio::test]
async fn the_listener_grants_at_most_its_max_streams() {
    let (client, server) = streamed(5, 2).await;
    assert_eq!((client.streams(), server.streams()), (2, 2));
}

#[tokio::test]
async fn several_streams_need_an_authkey_or_tls() {
    let dial = DialSettings {
        streams: 2,
        ..dial_settings(None)
    };
    let Err(error) = connect("127.0.0.1", 1, &dial).await else {
        panic!("connected without a secret");
    };
    assert!(
        error
            .to_string()
            .contains("several streams need an authkey or TLS"),
        "{error}"
    );
}

/// A peer that proved the authkey, then joins a session it does not hold.
async fn stray_join(port: u16) -> Vec<u8> {
    use crate::protocol::streams::join_message;
    use crate::protocol::{Intent, Role};
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connects");
    let side = handshake::Shake {
        authkey: Some(KEY),
        intent: Some(Intent::Join {
            index: 1,
            session: [3; 16],
        }),
        ..handshake::Shake::plain(Role::Client, Limits::default())
    };
    handshake::handshake(&mut tcp, side, None)
        .await
        .expect("shakes hands");
    tcp.write_all(&join_message([0; 32])).await.expect("writes");
    let mut answer = Vec::new();
    let _ = tokio::io::AsyncReadExt::read_to_end(&mut tcp, &mut answer).await;
    answer
}

#[tokio::test]
async fn a_join_naming_no_open_session_is_refused_and_not_counted_as_a_guess() {
    let settings = ListenSettings {
        admission: Admission {
            max_auth_failures: 1,
            ..Admission::default()
        },
        ..listen_settings(Some(KEY), Limits::default())
    };
    let mut listener = Listener::bind("127.0.0.1", 0, settings)
        .await
        .expect("binds");
    let port = listener.address().port();
    for _ in 0..2 {
        // The listener answers nothing and closes: no join message comes back.
        assert_eq!(stray_join(port).await, Vec::<u8>::new());
        let error = refusal(&mut listener).await;
        assert!(
            matches!(&error, GradientStreamError::Authentication { detail, .. }
                if detail.contains("names no session open at this listener")),
            "{error}"
        );
    }
    // It proved the authkey in its handshake: no guess at the key, and not counted as
    // one (one failure would lock the source out here).
    let settings = dial_settings(Some(KEY));
    let (good, _) = tokio::join!(
        connect("127.0.0.1", port, &settings),
        next_link(&mut listener)
    );
    assert!(good.is_ok());
}

#[tokio::test]
async fn slots_held_for_joins_that_never_come_go_back_after_the_handshake_timeout() {
    use crate::protocol::streams::{parse_streams, STREAMS_LEN};
    use crate::protocol::{Intent, Role};
    let settings = ListenSettings {
        max_connections: 4,
        handshake_timeout: Duration::from_millis(500),
        ..listen_settings(Some(KEY), Limits::default())
    };
    let mut listener = Listener::bind("127.0.0.1", 0, settings)
        .await
        .expect("binds");
    let port = listener.address().port();
    // A peer that opens 4 streams and never joins: granted 4, so 3 slots held, and the
    // opening connection holds the fourth.
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connects");
    let side = handshake::Shake {
        authkey: Some(KEY),
        intent: Some(Intent::Open {
            streams: 4,
            resume: false,
        }),
        ..handshake::Shake::plain(Role::Client, Limits::default())
    };
    handshake::handshake(&mut tcp, side, None)
        .await
        .expect("shakes hands");
    let mut grant = [0u8; STREAMS_LEN];
    tokio::io::AsyncReadExt::read_exact(&mut tcp, &mut grant)
        .await
        .expect("a grant");
    let asked = Grant {
        streams: 4,
        resume: false,
    };
    assert_eq!(parse_streams(&grant, asked, None), Ok(asked));
    let mut opened = next_link(&mut listener).await;
    // Full meanwhile: a newcomer that is no join finds no slot after its handshake.
    let settings = dial_settings(Some(KEY));
    let (_early, event) = tokio::join!(connect("127.0.0.1", port, &settings), listener.next());
    assert!(
        matches!(
            event,
            Some(Event::Refused {
                why: Refusal::Shed(Shed::Full { .. }),
                ..
            })
        ),
        "the newcomer was not refused for want of a slot"
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (late, accepted) = tokio::join!(
        connect("127.0.0.1", port, &settings),
        next_link(&mut listener)
    );
    assert!(late.is_ok() && accepted.peer().authenticated);
    // The link that opened them waited for its joins no longer than the timeout either:
    // its first receive says how many came, and it is closed.
    let got = opened
        .recv_gradient(
            SessionConfig::new("t", 10).receiver(),
            Waits::default(),
            &Progress::default(),
        )
        .await;
    match got {
        Err(error) => assert!(
            error
                .to_string()
                .contains("1 of the 4 streams the peer opened joined within the listener's"),
            "{error}"
        ),
        Ok(_) => panic!("a receive on a link missing its streams"),
    }
    assert!(opened.is_closed());
}
