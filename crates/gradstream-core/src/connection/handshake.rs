//! The start of a `"gradstream"` connection (docs/spec/protocol.md, steps 2 and 3): both
//! hellos, each with, under an authkey, its side's SPAKE2 element right behind it; then
//! both confirmation tags. Runs over any byte stream (TCP, or TLS once
//! its own handshake is done); the caller bounds it in time (`handshake_timeout`).
//!
//! Uses `protocol` (the messages) and `frame::Limits`; used by `dial` and `listener`.

use crate::error::PeerAt;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{GradientStreamError, Result};
use crate::frame::Limits;
use crate::protocol::streams::hellos_hash;
use crate::protocol::{
    auth, describe, Hello, Intent, Kind, Role, SessionSecret, HELLO_LEN, START_LEN,
};

/// What a side brings to a handshake: its role and settings, and what its stream is.
#[derive(Clone, Copy, Debug)]
pub struct Shake<'a> {
    pub role: Role,
    /// Under TLS, the TLS session's exporter value (`tls::exporter`); None on a plain
    /// stream.
    pub tls: Option<[u8; 32]>,
    pub authkey: Option<&'a [u8]>,
    pub limits: Limits,
    /// Tests only: see `DialSettings::test_nonce`.
    pub test_nonce: Option<[u8; 32]>,
    /// A client opening or joining a connection of several streams (its hello is then
    /// version 3).
    pub intent: Option<Intent>,
}

impl<'a> Shake<'a> {
    /// A side with no TLS, no authkey, no intent, the given limits.
    pub fn plain(role: Role, limits: Limits) -> Self {
        Self {
            role,
            tls: None,
            authkey: None,
            limits,
            test_nonce: None,
            intent: None,
        }
    }
}

/// What a finished handshake leaves the connection: the two nonces (every transfer id
/// derives from them), the peer's hello (what it accepts), whether it proved the
/// authkey, and what several streams need.
#[derive(Clone, Debug)]
pub struct Established {
    pub role: Role,
    pub client_nonce: [u8; 32],
    pub server_nonce: [u8; 32],
    /// The peer's hello: a sender refuses what its limits would refuse.
    pub peer_hello: Hello,
    pub authenticated: bool,
    /// The session's secret: None without an authkey and TLS (docs/spec/protocol.md,
    /// "Several streams").
    pub secret: Option<SessionSecret>,
    /// SHA-256 of both hellos as sent, and the TLS exporter: what a join's tag covers.
    pub hellos: [u8; 32],
    pub tls_exporter: Option<[u8; 32]>,
    /// The client's intent (its own, or the one its hello told the server).
    pub intent: Option<Intent>,
}

/// Read into all of `buf`; the bytes read when the stream ended first (a TLS peer that
/// closed without its close_notify ends the stream too).
pub(crate) async fn read_full<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut [u8],
) -> std::io::Result<std::result::Result<(), usize>> {
    let mut have = 0;
    while have < buf.len() {
        let n = match reader.read(&mut buf[have..]).await {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => 0,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Ok(Err(have));
        }
        have += n;
    }
    Ok(Ok(()))
}

/// Where a message was cut short by the end of the connection: the bytes that came.
struct Ended(Vec<u8>);

/// A message's bytes, or the bytes that came before the stream ended.
async fn read_message<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut [u8],
) -> Result<std::result::Result<(), Ended>> {
    Ok(read_full(reader, buf)
        .await?
        .map_err(|got| Ended(buf[..got].to_vec())))
}

/// The ProtocolError of a message cut short in its first 16 bytes.
fn cut_short(ended: &Ended, kind: Kind, peer: Option<&PeerAt>) -> GradientStreamError {
    GradientStreamError::Protocol {
        expected: kind.expected().to_string(),
        seen: describe(&ended.0),
        peer: peer.cloned(),
    }
}

/// What a client is told when the listener closes before its hello (with nothing, or
/// only a TLS alert record, sent): the listener dropped it, and its log says why; the
/// likely reason by whether this side speaks TLS (a TLS 1.3 client learns only now that
/// its certificate was refused). `None` for any other end.
fn dropped(ended: &Ended, tls: bool, peer: Option<&PeerAt>) -> Option<GradientStreamError> {
    if !(ended.0.is_empty() || ended.0.starts_with(&[0x15, 0x03])) {
        return None;
    }
    Some(if tls {
        GradientStreamError::Tls {
            detail: "the listener closed the connection after the TLS handshake: it requires \
                     a client certificate signed by its ca (give tls=TLS(cert=, key=, ca=)), \
                     or refused this side's"
                .into(),
            peer: peer.cloned(),
        }
    } else {
        GradientStreamError::Protocol {
            expected: Kind::Hello.expected().to_string(),
            seen: "the end of the connection: the listener dropped this side before its \
                   hello (a TLS listener drops a plaintext client; its log says why)"
                .into(),
            peer: peer.cloned(),
        }
    })
}

/// Exchange hellos (and, with `authkey`, SPAKE2 elements and tags) as `role`, over TLS
/// when `tls`. This side's nonce and SPAKE2 scalar are fresh from the system's RNG,
/// unless `test_nonce` fixes both (the tests' replays of recorded sessions only: see
/// `DialSettings::test_nonce`; the scalar then follows from the nonce).
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    side: Shake<'_>,
    peer: Option<&PeerAt>,
) -> Result<Established> {
    let Shake {
        role,
        authkey,
        limits,
        test_nonce,
        ..
    } = side;
    let tls = side.tls.is_some();
    let mine = match test_nonce {
        Some(nonce) => Hello::with_nonce(role, authkey.is_some(), nonce, limits),
        None => Hello::new(role, authkey.is_some(), limits)?,
    }
    .with_intent(side.intent.filter(|_| role == Role::Client));
    let mine_bytes = mine.to_bytes();
    let exchange = match authkey {
        None => None,
        Some(key) => {
            let seed = match test_nonce {
                Some(nonce) => auth::ScalarSeed::for_test(&nonce),
                None => auth::ScalarSeed::fresh()?,
            };
            Some(auth::Exchange::start(key, role, seed))
        }
    };
    // Both sides write first: 128 bytes fit any socket buffer, so neither waits on the
    // other. The element needs nothing of the peer's, so it goes with the hello.
    let mut first = mine_bytes.to_vec();
    if let Some(exchange) = &exchange {
        first.extend_from_slice(&exchange.message());
    }
    stream.write_all(&first).await?;
    stream.flush().await?;
    // The first 16 bytes decide: a foreign peer is named from them, before more is read.
    let mut theirs_bytes = [0u8; HELLO_LEN];
    let mut start = [0u8; START_LEN];
    if let Err(ended) = read_message(stream, &mut start).await? {
        let told = (role == Role::Client).then(|| dropped(&ended, tls, peer));
        return Err(told
            .flatten()
            .unwrap_or_else(|| cut_short(&ended, Kind::Hello, peer)));
    }
    Hello::check_start(&start, role.peer(), peer)?;
    theirs_bytes[..START_LEN].copy_from_slice(&start);
    if let Err(ended) = read_message(stream, &mut theirs_bytes[START_LEN..]).await? {
        return Err(GradientStreamError::Protocol {
            expected: Kind::Hello.expected().to_string(),
            seen: format!(
                "the end of the connection {} bytes into its last {}",
                ended.0.len(),
                HELLO_LEN - START_LEN
            ),
            peer: peer.cloned(),
        });
    }
    let theirs = Hello::parse(&theirs_bytes, role.peer(), peer)?;
    let (client, server) = match role {
        Role::Client => (&mine_bytes, &theirs_bytes),
        Role::Server => (&theirs_bytes, &mine_bytes),
    };
    auth::check_modes(authkey.is_some(), theirs.auth, peer)?;
    let mut spake2_key = None;
    // A client whose hello was version 3 (several streams, a resume) may have met a
    // listener of gradstream 0.3.0, which refuses it by closing, as it refuses a key.
    let newer = role == Role::Client && side.intent.is_some();
    let refused = || match newer {
        true => auth::closed_instead_of_version_3(peer),
        false => auth::closed_instead(peer),
    };
    let authenticated = match exchange {
        None => false,
        Some(exchange) => {
            let mut message = [0u8; auth::PAKE_LEN];
            if read_message(stream, &mut message).await?.is_err() {
                return Err(refused());
            }
            let element = auth::parse_pake(&message, peer)?;
            let confirmation = exchange.finish(&element, role, client, server, peer)?;
            let tag = auth::auth_message(confirmation.tag(role));
            // The client's tag first: the server answers only a tag it verified, so a
            // client learns whether its key is right only by sending its tag, which the
            // listener counts as a failure when wrong (docs/spec/protocol.md, step 3).
            if role == Role::Client {
                stream.write_all(&tag).await?;
                stream.flush().await?;
            }
            let mut message = [0u8; auth::AUTH_LEN];
            if read_message(stream, &mut message).await?.is_err() {
                return Err(refused());
            }
            let peer_tag = auth::parse_auth(&message, peer)?;
            confirmation.verify(role.peer(), &peer_tag, peer)?;
            spake2_key = Some(confirmation.spake2_key().to_vec());
            if role == Role::Server {
                stream.write_all(&tag).await?;
                stream.flush().await?;
            }
            true
        }
    };
    let (client_nonce, server_nonce) = match role {
        Role::Client => (mine.nonce, theirs.nonce),
        Role::Server => (theirs.nonce, mine.nonce),
    };
    let hellos = hellos_hash(client, server);
    let secret = SessionSecret::derive(spake2_key.as_deref(), side.tls.as_ref(), &hellos);
    let intent = match role {
        Role::Client => mine.intent,
        Role::Server => theirs.intent,
    };
    Ok(Established {
        role,
        client_nonce,
        server_nonce,
        peer_hello: theirs,
        authenticated,
        secret,
        hellos,
        tls_exporter: side.tls,
        intent,
    })
}
