//! The start of a `"gradstream"` connection (README "Protocol", steps 2 and 3): both
//! hellos, then, with an authkey, both tags. Runs over any byte stream (TCP, or TLS once
//! its own handshake is done); the caller bounds it in time (`handshake_timeout`).
//!
//! Uses `protocol` (the messages) and `frame::Limits`; used by `dial` and `listener`.

use std::net::SocketAddr;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{GradientStreamError, Result};
use crate::frame::Limits;
use crate::protocol::{auth, Hello, Role, HELLO_LEN};

/// What a finished handshake leaves the connection: the two nonces (every transfer id
/// derives from them), what the peer accepts, and whether it proved the authkey.
#[derive(Clone, Debug)]
pub struct Established {
    pub role: Role,
    pub client_nonce: [u8; 32],
    pub server_nonce: [u8; 32],
    /// The peer's limits from its hello: a sender refuses what they would refuse.
    pub peer_limits: Limits,
    pub authenticated: bool,
}

/// Read into all of `buf`; the bytes read when the stream ended first.
pub(crate) async fn read_full<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut [u8],
) -> std::io::Result<std::result::Result<(), usize>> {
    let mut have = 0;
    while have < buf.len() {
        let n = reader.read(&mut buf[have..]).await?;
        if n == 0 {
            return Ok(Err(have));
        }
        have += n;
    }
    Ok(Ok(()))
}

/// A message's bytes, or the ProtocolError of a stream that ended inside it.
async fn read_message<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut [u8],
    expected: &str,
    peer: Option<SocketAddr>,
) -> Result<()> {
    read_full(reader, buf)
        .await?
        .map_err(|got| GradientStreamError::Protocol {
            expected: expected.to_string(),
            seen: format!(
                "the end of the connection after {got} of its {} bytes",
                buf.len()
            ),
            peer,
        })
}

/// Exchange hellos (and, with `authkey`, tags) as `role`.
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    role: Role,
    authkey: Option<&[u8]>,
    limits: Limits,
    peer: Option<SocketAddr>,
) -> Result<Established> {
    let mine = Hello::new(role, authkey.is_some(), limits)?;
    let mine_bytes = mine.to_bytes();
    // Both sides write first: 80 bytes fit any socket buffer, so neither waits on the other.
    stream.write_all(&mine_bytes).await?;
    stream.flush().await?;
    // The first 16 bytes decide: a foreign peer is named from them, before more is read.
    let mut start = [0u8; 16];
    read_message(stream, &mut start, "a gradstream hello", peer).await?;
    Hello::check_start(&start, peer)?;
    let mut theirs_bytes = [0u8; HELLO_LEN];
    theirs_bytes[..16].copy_from_slice(&start);
    read_message(stream, &mut theirs_bytes[16..], "a gradstream hello", peer).await?;
    let theirs = Hello::parse(&theirs_bytes, role.peer(), peer)?;
    let (client, server) = match role {
        Role::Client => (&mine_bytes, &theirs_bytes),
        Role::Server => (&theirs_bytes, &mine_bytes),
    };
    auth::check_modes(authkey.is_some(), theirs.auth, peer)?;
    let authenticated = match authkey {
        None => false,
        Some(key) => {
            let tag = auth::tag(key, role, client, server);
            stream.write_all(&auth::auth_message(tag)).await?;
            stream.flush().await?;
            let mut message = [0u8; auth::AUTH_LEN];
            read_message(stream, &mut message, "the peer's auth message", peer).await?;
            let peer_tag = auth::parse_auth(&message, peer)?;
            auth::verify(key, role.peer(), client, server, &peer_tag, peer)?;
            true
        }
    };
    let (client_nonce, server_nonce) = match role {
        Role::Client => (mine.nonce, theirs.nonce),
        Role::Server => (theirs.nonce, mine.nonce),
    };
    Ok(Established {
        role,
        client_nonce,
        server_nonce,
        peer_limits: Limits {
            max_payload_len: theirs.max_payload_len,
            max_gradient_len: usize::try_from(theirs.max_gradient_len).unwrap_or(usize::MAX),
        },
        authenticated,
    })
}
