//! Gradients over a byte stream with tokio: the sender writes chunk by chunk from one
//! reusable frame buffer; the receiver reads exactly one gradient's bytes (never past its
//! last frame) and checks each frame as it arrives. Every wait is bounded by the optional
//! timeout, and the whole transfer by the optional deadline (`Waits`, run by a `Clock`);
//! dropping the future (a cancelled Python task) stops the transfer there.
//!
//! Uses `clock` (Progress, Waits, Clock: re-exported here), `session`, `encoder`,
//! `receiver`, `template`, `frame` and `error`; used by `compat` and the bindings.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::encoder::{as_f32, kind, Gradient};
use crate::error::Result;
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::receiver::{Ended, FrameReceiver};
use crate::session::SessionConfig;

pub(crate) use crate::clock::{within, Clock};
pub use crate::clock::{Progress, Waits};

/// Send one gradient; the number of chunks sent.
///
/// A chunk of ours goes out as one vectored write of the header, the template's constant
/// bytes and the values straight from the caller's memory: no copy of the gradient is made
/// (see `template.rs`). Chunks without a template are encoded into a reused frame buffer.
///
/// Sealed as the gradient says (`Gradient::sealed`: a connection seals each gradient with
/// the id it derives, `Seal::lone(id)`), else with a fresh random id when the session
/// seals (`SessionConfig::seal`), else not at all.
pub async fn send_gradient<'g, W: AsyncWrite + Unpin>(
    config: &SessionConfig,
    gradient: impl Into<Gradient<'g>>,
    writer: &mut W,
    waits: impl Into<Waits>,
    progress: &Progress,
) -> Result<usize> {
    let clock = Clock::running(waits);
    let gradient = config.sealing(gradient.into())?;
    send_gradient_on(config, gradient, writer, &clock, progress).await
}

/// `send_gradient` under a clock already running (a tensor set's, for its tensors), of a
/// gradient already sealed as it is to be sent.
pub(crate) async fn send_gradient_on<W: AsyncWrite + Unpin>(
    config: &SessionConfig,
    gradient: Gradient<'_>,
    writer: &mut W,
    clock: &Clock,
    progress: &Progress,
) -> Result<usize> {
    progress.add_total(config.chunk_count(gradient.len())?);
    send_gradient_from(config, gradient, writer, (clock, progress), 0).await
}

/// `send_gradient_on` from chunk `from` on (a connection that resumed after its
/// receiver took chunks 0 to `from`: docs/spec/protocol.md "Resume"); the chunks sent.
/// The caller counts the gradient's chunks in `progress` (once, whatever the passes).
pub(crate) async fn send_gradient_from<W: AsyncWrite + Unpin>(
    config: &SessionConfig,
    gradient: Gradient<'_>,
    writer: &mut W,
    (clock, progress): (&Clock, &Progress),
    from: u32,
) -> Result<usize> {
    if config.writes_each_payload(&gradient) {
        return send_each(config, gradient, writer, (clock, progress), from).await;
    }
    let plan = config.plan_frames(gradient)?;
    let total = plan.total_chunks();
    let mut frame: Vec<u8> = Vec::new();
    let mut sent = from as usize;
    for (index, window, payload_len) in plan.chunks() {
        if index < from {
            continue;
        }
        // Planned without encoding, so float32 (aligned: it is the caller's f32 array).
        let values = as_f32(window);
        let (seal, shape) = plan.marks(index);
        let template = values
            .and_then(|v| {
                config
                    .templates
                    .get(kind(config.layout, v.len(), seal.is_some(), shape))
            })
            .filter(|t| writer.is_write_vectored() && t.len() == payload_len as usize)
            .zip(values);
        let header = |checksum| FrameHeader {
            chunk_index: index,
            total_chunks: total,
            payload_len,
            checksum,
        };
        let head;
        let parts: [&[u8]; 8] = match &template {
            Some((t, values)) => {
                let pieces = t.pieces(values, seal.as_ref());
                head = header(pieces.checksum).to_bytes();
                let [a, b, c, d, e, f, g] = pieces.parts;
                [&head[..], a, b, c, d, e, f, g]
            }
            None => {
                // Header and payload in one buffer: two writes would meet Nagle's
                // algorithm and delayed ACKs on TCP.
                frame.resize(HEADER_LEN + payload_len as usize, 0);
                let (head, payload) = frame.split_at_mut(HEADER_LEN);
                let checksum = config.write_payload((seal, shape), window, payload)?;
                head.copy_from_slice(&header(checksum).to_bytes());
                [&frame[..], &[], &[], &[], &[], &[], &[], &[]]
            }
        };
        write_frame(writer, parts, clock, (sent, Some(total)), progress).await?;
        sent += 1;
    }
    within(clock, (sent, Some(total)), writer.flush()).await?;
    Ok(sent - from as usize)
}

/// Write one frame given in pieces (header, payload parts; empty pieces are skipped), as
/// one vectored write where the writer takes it, and count it in `progress`. The timeout
/// bounds each write call, not the frame: a slow reader that keeps taking bytes is
/// progress. `at` is (chunks sent, total) for the timeout error.
pub(crate) async fn write_frame<W: AsyncWrite + Unpin, const N: usize>(
    writer: &mut W,
    mut parts: [&[u8]; N],
    clock: &Clock,
    at: (usize, Option<u32>),
    progress: &Progress,
) -> Result<()> {
    while parts.iter().any(|p| !p.is_empty()) {
        let slices = parts.map(std::io::IoSlice::new);
        let n = within(clock, at, writer.write_vectored(&slices)).await?;
        if n == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into());
        }
        progress.add(n, 0);
        let mut left = n;
        for part in &mut parts {
            let take = left.min(part.len());
            *part = &part[take..];
            left -= take;
        }
    }
    progress.add(0, 1);
    Ok(())
}

/// The sender when payloads come from the Arrow writer (compression, shape metadata):
/// each frame is encoded as it is sent, and the whole stream is never held.
async fn send_each<W: AsyncWrite + Unpin>(
    config: &SessionConfig,
    gradient: Gradient<'_>,
    writer: &mut W,
    (clock, progress): (&Clock, &Progress),
    from: u32,
) -> Result<usize> {
    let total = config.chunk_count(gradient.len())?;
    for index in from..total {
        let frame = config.encode_frame(gradient, index)?;
        let at = (index as usize, Some(total));
        write_frame(writer, [&frame, &[], &[], &[]], clock, at, progress).await?;
    }
    within(clock, (total as usize, Some(total)), writer.flush()).await?;
    Ok(total.saturating_sub(from) as usize)
}

/// Receive one gradient through `receiver` (`SessionConfig::receiver` or `receiver_into`):
/// each header, then each payload, read whole into one reused buffer and fed.
pub async fn receive_gradient<R: AsyncRead + Unpin>(
    mut receiver: FrameReceiver,
    reader: &mut R,
    waits: impl Into<Waits>,
    progress: &Progress,
) -> Result<Ended> {
    let mut clock = Clock::idle(waits);
    match receive_some(&mut receiver, reader, &mut clock, progress).await? {
        None => receiver.finish().map(Ended::Gradient),
        Some(got) => receiver.end_of_stream(got),
    }
}

/// Feed `receiver` from `reader` until the gradient is complete (None) or the stream
/// ends (the bytes of the unit it ended in); `receiver` keeps what it took either way,
/// and on an error (a connection that resumes goes on with it).
pub(crate) async fn receive_some<R: AsyncRead + Unpin>(
    receiver: &mut FrameReceiver,
    reader: &mut R,
    clock: &mut Clock,
    progress: &Progress,
) -> Result<Option<usize>> {
    // Holds a header or a payload (at most max_payload_len, checked from the header).
    let mut unit = Vec::with_capacity(HEADER_LEN);
    loop {
        let (before, known) = (receiver.received(), receiver.total().is_some());
        let (want, at) = (receiver.want(), (receiver.received(), receiver.total()));
        if !read_unit(reader, &mut unit, want, clock, at, Some(progress)).await? {
            return Ok(Some(unit.len()));
        }
        let done = receiver.feed(&unit)?;
        if let (false, Some(total)) = (known, receiver.total()) {
            progress.add_total(total);
        }
        progress.add(0, (receiver.received() - before) as u64);
        if done {
            return Ok(None);
        }
    }
}

/// Read exactly `want` bytes into `unit` (emptied first); false when the stream ended
/// first (`unit` then holds what came). `at` is (chunks received, total) for the timeout
/// error; `progress`, when given, counts the bytes.
pub(crate) async fn read_unit<R: AsyncRead + Unpin>(
    reader: &mut R,
    unit: &mut Vec<u8>,
    want: usize,
    clock: &mut Clock,
    at: (usize, Option<u32>),
    progress: Option<&Progress>,
) -> Result<bool> {
    unit.clear();
    while unit.len() < want {
        let remaining = want - unit.len();
        // Grow with what arrives, not with what the header claims: a 16-byte header
        // must not cost max_payload_len of memory before its payload shows up.
        unit.reserve(remaining.min(unit.len().max(64 * 1024)));
        let mut limited = (&mut *reader).take(remaining as u64);
        let n = within(clock, at, limited.read_buf(unit)).await?;
        if n == 0 {
            return Ok(false);
        }
        clock.start();
        if let Some(progress) = progress {
            progress.add(n, 0);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::GradientStreamError;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    use tokio::io::{duplex, AsyncWriteExt};

    fn gradient(n: usize) -> Vec<f32> {
        (0..n).map(|i| (i as f32).sin()).collect()
    }

    fn session(chunk_size: usize) -> SessionConfig {
        SessionConfig::new("t", chunk_size)
    }

    /// The gradient, or None when the stream ended before its first byte.
    async fn receive<R: AsyncRead + Unpin>(
        s: &SessionConfig,
        reader: &mut R,
        timeout: Option<Duration>,
        progress: &Progress,
    ) -> Result<Option<Vec<f32>>> {
        Ok(
            match receive_gradient(s.receiver(), reader, timeout, progress).await? {
                Ended::Gradient(values) => Some(values.into_vec()),
                Ended::BeforeFirstByte(_) => None,
            },
        )
    }

    #[tokio::test]
    async fn receives_into_the_callers_buffer_and_checks_its_size() {
        let s = session(1000);
        let g = gradient(4500);
        let wire = s.encode_frames(&g).unwrap();
        for room in [4500, 4499, 4501] {
            let mut out = vec![f32::NAN; room];
            let (mut a, mut b) = duplex(1 << 16);
            a.write_all(&wire).await.unwrap();
            drop(a);
            // SAFETY: the receiver (and its Output) is dropped within this iteration.
            let receiver = s.receiver_into(unsafe { crate::output::OutSlice::of(&mut out) });
            let got = receive_gradient(receiver, &mut b, None, &Progress::default()).await;
            match (room, got) {
                (4500, Ok(Ended::Gradient(_))) => assert_eq!(out, g),
                (
                    4499,
                    Err(GradientStreamError::GradientSize {
                        expected,
                        received,
                        chunk_index,
                    }),
                ) => {
                    assert_eq!((expected, received, chunk_index), (4499, 4500, Some(4)));
                }
                (
                    4501,
                    Err(GradientStreamError::GradientSize {
                        expected,
                        received,
                        chunk_index,
                    }),
                ) => {
                    assert_eq!((expected, received, chunk_index), (4501, 4500, None));
                }
                (room, got) => panic!("room {room}: {got:?}"),
            }
        }
    }

    #[tokio::test]
    async fn sends_the_encode_frames_bytes_and_receives_them_back() {
        let s = session(1000);
        let g = gradient(4500);
        let (mut a, mut b) = duplex(1 << 16);
        let (progress, unobserved) = (Progress::default(), Progress::default());
        let (sent, got) = tokio::join!(
            send_gradient(&s, &g, &mut a, None, &progress),
            receive(&s, &mut b, None, &unobserved)
        );
        assert_eq!(sent.unwrap(), 5);
        assert_eq!(got.unwrap(), Some(g.clone()));
        let wire = s.encode_frames(&g).unwrap();
        assert_eq!(progress.bytes.load(Ordering::Relaxed), wire.len() as u64);
    }

    #[tokio::test]
    async fn compressed_sessions_stream_frame_by_frame_and_match_encode_frames() {
        for compression in [
            crate::codec::Compression::Lz4,
            crate::codec::Compression::Zstd,
        ] {
            let mut s = session(1000);
            s.compression = Some(compression);
            let mut g = vec![0.0f32; 4500];
            g[10] = 3.0;
            let (mut a, mut b) = duplex(1 << 16);
            let (progress, unobserved) = (Progress::default(), Progress::default());
            let receiver = session(7);
            let (sent, got) = tokio::join!(
                send_gradient(&s, &g, &mut a, None, &progress),
                receive(&receiver, &mut b, None, &unobserved)
            );
            assert_eq!(sent.unwrap(), 5);
            assert_eq!(got.unwrap(), Some(g.clone()));
            let wire = s.encode_frames(&g).unwrap();
            assert_eq!(progress.bytes.load(Ordering::Relaxed), wire.len() as u64);
            assert!(wire.len() < s.encode_frames(&gradient(4500)).unwrap().len());
        }
    }

    #[tokio::test]
    async fn reads_exactly_one_gradient_then_the_next() {
        let s = session(7);
        let (mut a, mut b) = duplex(1 << 16);
        let mut both = s.encode_frames(&gradient(20)).unwrap();
        both.extend(s.encode_frames(&gradient(3)).unwrap());
        a.write_all(&both).await.unwrap();
        drop(a);
        let p = Progress::default();
        assert_eq!(
            receive(&s, &mut b, None, &p).await.unwrap(),
            Some(gradient(20))
        );
        assert_eq!(
            receive(&s, &mut b, None, &p).await.unwrap(),
            Some(gradient(3))
        );
        assert_eq!(receive(&s, &mut b, None, &p).await.unwrap(), None);
    }

    #[tokio::test]
    async fn end_of_stream_cases_follow_the_rules() {
        let s = session(4);
        let wire = s.encode_frames(&gradient(10)).unwrap();
        let first_frame = HEADER_LEN
            + FrameHeader::from_bytes(wire[..16].try_into().unwrap()).payload_len as usize;
        for (cut, expect) in [
            (5, "truncated frame header: 5 of 16 bytes"),
            (20, "truncated frame: chunk 0"),
            (
                first_frame,
                "Incomplete chunk stream: received 1 of 3 chunks",
            ),
            (
                first_frame + 3,
                "Incomplete chunk stream: received 1 of 3 chunks",
            ),
        ] {
            let (mut a, mut b) = duplex(1 << 16);
            a.write_all(&wire[..cut]).await.unwrap();
            drop(a);
            let err = receive(&s, &mut b, None, &Progress::default())
                .await
                .unwrap_err();
            assert!(err.to_string().starts_with(expect), "cut {cut}: {err}");
        }
    }

    #[tokio::test]
    async fn a_stalled_peer_times_out() {
        let s = session(4);
        let (mut a, mut b) = duplex(1 << 16);
        let wire = s.encode_frames(&gradient(10)).unwrap();
        a.write_all(&wire[..30]).await.unwrap(); // and then nothing, connection kept open
        let err = receive(
            &s,
            &mut b,
            Some(Duration::from_millis(50)),
            &Progress::default(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(
                err,
                GradientStreamError::Timeout {
                    received: 0,
                    total: None,
                    ..
                }
            ),
            "{err:?}"
        );
        drop(a);
    }

    #[tokio::test]
    async fn a_hostile_total_is_refused_at_the_first_header() {
        let mut s = session(4);
        s.limits.max_gradient_len = 1000;
        let chunk = s.encode_gradient(&gradient(1)).unwrap().remove(0);
        let mut header = chunk.header();
        header.total_chunks = u32::MAX;
        let (mut a, mut b) = duplex(1 << 16);
        a.write_all(&header.to_bytes()).await.unwrap();
        a.write_all(&chunk.payload).await.unwrap();
        let err = receive(&s, &mut b, None, &Progress::default())
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("above max_gradient_len 1000"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn values_past_max_gradient_len_stop_the_transfer() {
        let mut s = session(4);
        let wire = s.encode_frames(&gradient(10)).unwrap();
        s.limits.max_gradient_len = 6;
        let (mut a, mut b) = duplex(1 << 16);
        a.write_all(&wire).await.unwrap();
        let err = receive(&s, &mut b, None, &Progress::default())
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "gradient exceeds max_gradient_len 6: 8 values by chunk 1"
        );
    }

    #[tokio::test]
    async fn a_slow_drip_meets_the_deadline_not_the_timeout() {
        let s = session(256);
        let wire = s.encode_frames(&gradient(4096)).unwrap();
        let (mut a, mut b) = duplex(1 << 16);
        let drip = async move {
            for piece in wire.chunks(64) {
                if a.write_all(piece).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        };
        let waits = Waits {
            timeout: Some(Duration::from_secs(5)),
            deadline: Some(Duration::from_millis(60)),
        };
        let started = Instant::now();
        let progress = Progress::default();
        let (_, got) = tokio::join!(drip, async {
            let got = receive_gradient(s.receiver(), &mut b, waits, &progress).await;
            drop(b);
            got
        });
        match got {
            Err(GradientStreamError::Deadline {
                deadline,
                received,
                total,
            }) => {
                assert_eq!(deadline, 0.06);
                assert!(received < 16 && total.is_none_or(|t| t == 16));
            }
            other => panic!("expected the deadline, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn idle_time_before_the_first_byte_is_not_the_transfers() {
        let s = session(256);
        let g = gradient(4096);
        let wire = s.encode_frames(&g).unwrap();
        let (mut a, mut b) = duplex(1 << 20);
        let late = async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            a.write_all(&wire).await.unwrap();
        };
        let waits = Waits {
            timeout: None,
            deadline: Some(Duration::from_millis(100)),
        };
        let progress = Progress::default();
        let (_, got) = tokio::join!(
            late,
            receive_gradient(s.receiver(), &mut b, waits, &progress)
        );
        match got {
            Ok(Ended::Gradient(values)) => assert_eq!(values.into_vec(), g),
            other => panic!("{other:?}"),
        }
    }
}
