//! A gradient over a link of several streams (docs/spec/protocol.md, "Several streams"):
//! its frames, sealed to one transfer as on one stream, go out on whichever stream is
//! free next (a slow stream takes fewer), and come in from all of them, in any order,
//! into one reassembly. The ack's digest covers the headers in index order, and the ack
//! travels on the first stream. Tensor sets travel on the first stream alone.
//!
//! Each stream is lent, for the transfer, to a task of its own (`pumps`), so that its
//! reads and writes (TLS's cipher above all) spread over the runtime's threads; this
//! task encodes, reassembles and keeps the clock, whose timeout bounds each wait for
//! bytes, not the transfer.

use std::collections::BTreeMap;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;

use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::{mpsc, watch};

use super::counted::Counted;
use super::pumps::{receive_pump, send_pump, Came, Inlet, Moved, Outbox, Pumps, Sent};
use super::*;

/// The digest of headers held by index.
fn digest_in_order(id: &TransferId, headers: &BTreeMap<u32, [u8; HEADER_LEN]>) -> [u8; 32] {
    let mut digest = Digest::new(&id.0);
    for header in headers.values() {
        digest.header(header);
    }
    digest.finish()
}

/// Frames queued per stream ahead of the pumps: enough that none waits for the encoder.
const AHEAD: usize = 2;

impl Link {
    /// Every stream in index order, the first included.
    fn all_streams(&mut self) -> Vec<&mut Counted> {
        std::iter::once(&mut self.stream)
            .chain(self.lanes.iter_mut())
            .collect()
    }

    /// Every stream, lent out (`Counted::gone` in their places until `put_back`); the
    /// link counts as closed until every one is back (a transfer dropped meanwhile lost
    /// them).
    fn lend_streams(&mut self) -> Vec<Counted> {
        self.lent = true;
        self.all_streams()
            .into_iter()
            .map(|stream| std::mem::replace(stream, Counted::gone()))
            .collect()
    }

    fn put_back(&mut self, lane: usize, stream: Counted) {
        match lane {
            0 => self.stream = stream,
            _ => {
                if let Some(place) = self.lanes.get_mut(lane - 1) {
                    *place = stream;
                }
            }
        }
    }

    /// Send `gradient` (sealed) over every stream, each driven by a task of its own
    /// (`pumps`); the chunk count and the digest.
    pub(super) async fn send_striped(
        &mut self,
        config: &SessionConfig,
        gradient: Gradient<'_>,
        id: TransferId,
        clock: &Clock,
        progress: &Progress,
    ) -> Result<(usize, [u8; 32])> {
        let total = config.chunk_count(gradient.len())?;
        progress.add_total(total);
        let outbox = Arc::new(Outbox::default());
        let (events, mut sent_events) = mpsc::unbounded_channel();
        let mut pumps = Pumps::default();
        let streams = self.lend_streams();
        let count = streams.len();
        for (lane, stream) in streams.into_iter().enumerate() {
            pumps.spawn(send_pump(lane, stream, outbox.clone(), events.clone()));
        }
        drop(events);
        let mut headers = BTreeMap::new();
        let (mut next, mut sent, mut back) = (0u32, 0usize, 0usize);
        let mut failed: Option<GradientStreamError> = None;
        while back < count {
            while failed.is_none() && next < total && outbox.len() < AHEAD * count {
                match config.encode_frame(gradient, next) {
                    Ok(frame) => {
                        let mut head = [0u8; HEADER_LEN];
                        head.copy_from_slice(&frame[..HEADER_LEN]);
                        headers.insert(next, head);
                        outbox.push(frame);
                        next += 1;
                    }
                    Err(e) => {
                        outbox.abandon();
                        failed = Some(e);
                    }
                }
            }
            if next == total {
                outbox.close();
            }
            let event = match failed {
                // Failed: the pumps stop at their frame's end; those that cannot (a peer
                // not reading) are aborted after LINGER, their streams closed.
                Some(_) => tokio::time::timeout(LINGER, sent_events.recv())
                    .await
                    .unwrap_or(None),
                None => {
                    let waited = within(clock, (sent, Some(total)), async {
                        Ok(sent_events.recv().await)
                    });
                    match waited.await {
                        Ok(event) => event,
                        Err(e) => {
                            outbox.abandon();
                            failed = Some(e);
                            continue;
                        }
                    }
                }
            };
            match event {
                None => break,
                Some(Sent::Bytes(n)) => progress.add(n, 0),
                Some(Sent::Frame) => {
                    progress.add(0, 1);
                    sent += 1;
                }
                Some(Sent::Done(lane, stream, written)) => {
                    self.put_back(lane, stream);
                    back += 1;
                    if let Err(e) = written {
                        outbox.abandon();
                        failed.get_or_insert(e.into());
                    }
                }
            }
        }
        drop(pumps);
        self.lent = back < count; // a stream that did not come back: the link is closed
        match failed {
            Some(e) => Err(e),
            None => Ok((sent, digest_in_order(&id, &headers))),
        }
    }

    /// The first bytes of a transfer, read here (at most a header's), so that the
    /// streams stay the link's until one comes: a receive given up, or out of time,
    /// before its first byte leaves the link as it was. `Ok(None)`: the peer closed the
    /// connection, every stream ended with nothing (a peer's close reaches each stream in
    /// its own time), or the first did and no other brought a byte within LINGER. Bytes
    /// on another stream after the first ended begin a transfer, which then fails.
    async fn first_bytes(&mut self) -> std::io::Result<Option<(usize, Vec<u8>)>> {
        let mut streams = self.all_streams();
        let mut ended = vec![false; streams.len()];
        let mut head = [0u8; HEADER_LEN];
        let mut linger = std::pin::pin!(tokio::time::sleep(LINGER));
        poll_fn(|cx| {
            for (lane, stream) in streams.iter_mut().enumerate() {
                if ended[lane] {
                    continue;
                }
                let mut buf = ReadBuf::new(&mut head);
                match Pin::new(&mut **stream).poll_read(cx, &mut buf) {
                    Poll::Ready(Ok(())) if buf.filled().is_empty() => {
                        if lane == 0 {
                            // LINGER from the first stream's end.
                            linger.as_mut().reset(tokio::time::Instant::now() + LINGER);
                        }
                        ended[lane] = true;
                    }
                    Poll::Ready(Ok(())) => {
                        return Poll::Ready(Ok(Some((lane, buf.filled().to_vec()))))
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {}
                }
            }
            let closed =
                ended.iter().all(|e| *e) || (ended[0] && linger.as_mut().poll(cx).is_ready());
            if closed {
                Poll::Ready(Ok(None))
            } else {
                Poll::Pending
            }
        })
        .await
    }

    /// Receive one gradient through `receiver` from every stream, each read, from the
    /// transfer's first byte, by a task of its own (`pumps`); what it ended with, the
    /// digest, and the first stream's first header.
    pub(super) async fn recv_striped(
        &mut self,
        mut receiver: FrameReceiver,
        id: TransferId,
        waits: Waits,
        progress: &Progress,
    ) -> (Result<Ended>, [u8; 32], Option<[u8; HEADER_LEN]>) {
        let mut headers = BTreeMap::new();
        let mut clock = Clock::idle(waits);
        let (begun_on, mut begun) = match within(&clock, (0, None), self.first_bytes()).await {
            Ok(Some(begun)) => begun,
            Ok(None) => {
                let end = Ended::BeforeFirstByte(Box::new(receiver));
                return (Ok(end), digest_in_order(&id, &headers), None);
            }
            Err(e) => return (Err(e), digest_in_order(&id, &headers), None),
        };
        clock.start();
        progress.add(begun.len(), 0);
        let streams = self.lend_streams();
        let count = streams.len();
        // One frame a stream waiting for the reassembly, and at most twice the largest
        // payload held by the pumps at once (docs/guides/limits.md: what a receiver holds).
        let (frames, mut came) = mpsc::channel(count);
        let limits = receiver.limits();
        let room = (limits.max_payload_len as usize)
            .saturating_mul(2)
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        let room = Arc::new(tokio::sync::Semaphore::new(room));
        let (stop, stopping) = watch::channel(false);
        let moved = Arc::new(Moved::default());
        let mut pumps = Pumps::default();
        for (lane, stream) in streams.into_iter().enumerate() {
            // The first bytes go to the pump of the stream they came on.
            let first = match lane == begun_on {
                true => std::mem::take(&mut begun),
                false => Vec::new(),
            };
            let inlet = Inlet {
                frames: frames.clone(),
                moved: moved.clone(),
                room: room.clone(),
                limits,
                stop: stopping.clone(),
            };
            pumps.spawn(receive_pump(lane, stream, first, inlet));
        }
        drop(frames);
        let mut first = None;
        let mut counted = 0u64;
        let got = loop {
            let at = (receiver.received(), receiver.total());
            // A frame, or bytes of one: each wait for bytes is the timeout's.
            let next = within(&clock, at, async {
                tokio::select! {
                    frame = came.recv() => Ok(Some(frame)),
                    () = moved.read.notified() => Ok(None),
                }
            })
            .await;
            let bytes = moved.bytes.load(Ordering::Relaxed);
            progress.add((bytes - counted) as usize, 0);
            counted = bytes;
            let (lane, header, payload, offset, _room) = match next {
                Err(e) => break Err(e),
                Ok(None) => continue,
                Ok(Some(None)) | Ok(Some(Some(Came::Back(..)))) => {
                    break Err(std::io::Error::other("a stream's task ended early").into())
                }
                Ok(Some(Some(Came::Ended { lane, error, .. }))) => {
                    break Err(error.unwrap_or_else(|| {
                        GradientStreamError::Io(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            format!(
                                "stream {} of the connection's {count} ended before the \
                                 transfer's last frame",
                                lane + 1
                            ),
                        ))
                    }))
                }
                Ok(Some(Some(Came::Frame {
                    lane,
                    header,
                    payload,
                    offset,
                    room,
                }))) => (lane, header, payload, offset, room),
            };
            if lane == 0 && first.is_none() {
                first = Some(header.to_bytes());
            }
            let known = receiver.total().is_some();
            match receiver.accept_frame(&header, &payload, offset) {
                Err(e) => break Err(e),
                Ok(done) => {
                    headers.insert(header.chunk_index, header.to_bytes());
                    progress.add(0, 1);
                    if let (false, Some(total)) = (known, receiver.total()) {
                        progress.add_total(total);
                    }
                    if done {
                        break receiver.finish().map(Ended::Gradient);
                    }
                }
            }
        };
        // Every stream back: a frame or part of one past the transfer's last fails it.
        let _ = stop.send(true);
        room.close(); // a pump waiting for room stops
        let mut extra = None;
        let mut back = 0;
        while back < count {
            match tokio::time::timeout(LINGER, came.recv()).await {
                Ok(Some(Came::Back(lane, stream, beyond))) => {
                    self.put_back(lane, stream);
                    back += 1;
                    if beyond {
                        extra.get_or_insert(lane);
                    }
                }
                Ok(Some(
                    Came::Frame { lane, .. }
                    | Came::Ended {
                        lane, mid: true, ..
                    },
                )) => {
                    extra.get_or_insert(lane);
                }
                Ok(Some(Came::Ended { .. })) => {}
                Ok(None) | Err(_) => break,
            }
        }
        drop(pumps);
        self.lent = back < count; // a stream that did not come back: the link is closed
        let got = match (got, extra) {
            (Ok(Ended::Gradient(_)), Some(lane)) => Err(GradientStreamError::frame(
                format!(
                    "stream {} of the connection's {count} holds bytes past the transfer's \
                     last frame",
                    lane + 1
                ),
                None,
            )),
            (got, _) => got,
        };
        (got, digest_in_order(&id, &headers), first)
    }
}

impl Link {
    /// Read and drop what comes on every stream until each ends (a refusing receiver's:
    /// the sender's writes on any stream must end for it to read the refusal).
    pub(super) async fn drain_all(&mut self) -> std::io::Result<()> {
        let mut streams = self.all_streams();
        let mut ended = vec![false; streams.len()];
        let mut sink = vec![0u8; 64 * 1024];
        poll_fn(|cx| {
            for (stream, ended) in streams.iter_mut().zip(ended.iter_mut()) {
                while !*ended {
                    let mut buf = ReadBuf::new(&mut sink);
                    match Pin::new(&mut **stream).poll_read(cx, &mut buf) {
                        Poll::Ready(Ok(())) if buf.filled().is_empty() => *ended = true,
                        Poll::Ready(Ok(())) => {}
                        // A broken stream has nothing more to drain; the others may.
                        Poll::Ready(Err(_)) => *ended = true,
                        Poll::Pending => break,
                    }
                }
            }
            if ended.iter().all(|e| *e) {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        })
        .await
    }
}
