//! The listener's admission over real sockets, where a test needs a second source
//! (127.0.0.2, loopback on Linux, which `connect` cannot bind to): a source locked out
//! for failed authentications leaves another source served.

use std::time::Duration;

use super::*;
use crate::connection::{connect, DialSettings};

const KEY: &[u8] = b"sixteen bytes or more";

fn settings() -> ListenSettings {
    ListenSettings {
        protocol: Protocol::Gradstream,
        tls: None,
        authkey: Some(KEY.to_vec()),
        handshake_timeout: Duration::from_secs(5),
        max_connections: 8,
        admission: Admission {
            max_auth_failures: 2,
            ..Admission::default()
        },
        limits: Limits::default(),
        max_streams: 16,
        resume_window: Duration::from_secs(5),
        #[cfg(target_os = "linux")]
        local: LocalSettings::default(),
        test_nonce: None,
    }
}

fn dial(key: &[u8]) -> DialSettings {
    DialSettings {
        protocol: Protocol::Gradstream,
        tls: None,
        authkey: Some(key.to_vec()),
        handshake_timeout: Duration::from_secs(5),
        limits: Limits::default(),
        streams: 1,
        resume: None,
        #[cfg(target_os = "linux")]
        local: LocalSettings::default(),
        test_nonce: None,
    }
}

/// A client's handshake from `source` with `key`.
async fn from(source: &str, port: u16, key: &[u8]) -> Result<()> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(format!("{source}:0").parse().expect("an address"))?;
    let mut stream = socket
        .connect(format!("127.0.0.1:{port}").parse().expect("an address"))
        .await?;
    let side = Shake {
        authkey: Some(key),
        ..Shake::plain(Role::Client, Limits::default())
    };
    handshake(&mut stream, side, None).await.map(|_| ())
}

/// The listener's next event, as a word.
async fn next(listener: &mut Listener) -> String {
    match listener.next().await {
        Some(Event::Connected(_)) => "connected".into(),
        Some(Event::Refused {
            why: Refusal::Shed(why),
            ..
        }) => why.to_string(),
        Some(Event::Refused {
            why: Refusal::Failed(error),
            ..
        }) => format!("failed: {error}"),
        Some(Event::Refused {
            why: Refusal::Silent(_),
            ..
        }) => "silent".into(),
        None => "closed".into(),
    }
}

#[tokio::test]
async fn a_locked_out_source_leaves_another_served() {
    let mut listener = Listener::bind("127.0.0.1", 0, settings())
        .await
        .expect("binds");
    let port = listener.address().port();
    for _ in 0..2 {
        assert!(connect("127.0.0.1", port, &dial(b"another key, as long"))
            .await
            .is_err());
        assert!(next(&mut listener)
            .await
            .starts_with("failed: authentication"));
    }
    // 127.0.0.1 is locked out, the right key included...
    assert!(connect("127.0.0.1", port, &dial(KEY)).await.is_err());
    let why = next(&mut listener).await;
    assert!(
        why.starts_with("2 failed authentications from 127.0.0.1 within auth_failure_window"),
        "{why}"
    );
    // ...and 127.0.0.2 is not.
    from("127.0.0.2", port, KEY).await.expect("served");
    assert_eq!(next(&mut listener).await, "connected");
}

#[tokio::test]
async fn a_peer_silent_past_hello_timeout_is_dropped_and_a_speaking_one_is_not() {
    let mut settings = settings();
    settings.authkey = None;
    settings.admission.hello_timeout = Duration::from_millis(200);
    let mut listener = Listener::bind("127.0.0.1", 0, settings)
        .await
        .expect("binds");
    let port = listener.address().port();
    let silent = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connects");
    assert_eq!(
        next(&mut listener).await,
        "sent nothing within hello_timeout (0.200 s)"
    );
    drop(silent);
    // A peer that sends its first byte in time, and the rest after the hello_timeout,
    // is bounded by handshake_timeout only.
    let mut slow = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connects");
    slow.write_all(b"G").await.expect("writes");
    tokio::time::sleep(Duration::from_millis(400)).await;
    slow.write_all(b"ET / HTTP/1.1\r\n\r\n")
        .await
        .expect("writes");
    let why = next(&mut listener).await;
    assert!(why.contains("an HTTP request"), "{why}");
}

#[tokio::test]
async fn refusals_do_not_wait_for_a_caller_slow_to_take_events() {
    // The caller takes no event while 40 peers send an HTTP request each: the event queue
    // (as deep as max_pending_handshakes, 4 here) keeps what fits and the rest of the
    // refusals are dropped, rather than each refused peer's task waiting for its turn
    // (one task per refused peer, without bound, before).
    let mut settings = settings();
    settings.authkey = None;
    settings.admission.max_pending_handshakes = 4;
    let mut listener = Listener::bind("127.0.0.1", 0, settings)
        .await
        .expect("binds");
    let port = listener.address().port();
    for _ in 0..40 {
        let mut peer = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connects");
        peer.write_all(b"GET / HTTP/1.1\r\n\r\n")
            .await
            .expect("writes");
        // Refused: the listener closes it (an error or the end, either way it is over).
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), peer.read_to_end(&mut sink)).await;
    }
    let mut queued = 0;
    while let Ok(event) =
        tokio::time::timeout(Duration::from_millis(300), next(&mut listener)).await
    {
        assert!(event.contains("an HTTP request"), "{event}");
        queued += 1;
    }
    assert!((1..=4).contains(&queued), "{queued} refusals were kept");
}

#[tokio::test]
async fn a_burst_from_one_source_past_both_caps_is_all_served() {
    // 12 clients of one host connect at once, past 4 handshakes per source and 8 in all
    // (so 8 may wait). Accepted together, each looked silent until its task first read
    // it: before, newer ones evicted older ones, or were closed at once; now the ones
    // past the caps wait for a place, and every one is served.
    let mut settings = settings();
    settings.authkey = None;
    settings.max_connections = 64;
    settings.admission.max_pending_per_source = 4;
    settings.admission.max_pending_handshakes = 8;
    let mut listener = Listener::bind("127.0.0.1", 0, settings)
        .await
        .expect("binds");
    let port = listener.address().port();
    let mut plain = dial(KEY);
    plain.authkey = None;
    let mut clients = JoinSet::new();
    for _ in 0..12 {
        let plain = plain.clone();
        clients.spawn(async move { connect("127.0.0.1", port, &plain).await.map(|_| ()) });
    }
    let mut events = Vec::new();
    for _ in 0..12 {
        events.push(next(&mut listener).await);
    }
    assert!(events.iter().all(|e| e == "connected"), "{events:?}");
    while let Some(client) = clients.join_next().await {
        client.expect("runs").expect("served");
    }
}
