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

use std::collections::{BTreeMap, VecDeque};
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;

use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::{mpsc, watch};

use super::counted::Counted;
use super::pumps::{receive_pump, send_pump, Came, Inlet, Moved, Outbox, Pumps, Sent};
use super::resume::{mendable, resumed_by_peer, Mended, MAX_RESUMES};
use super::*;
use crate::frame::{FrameHeader, Limits};
use crate::protocol::streams::ResumeState;

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
    pub(super) fn lend_streams(&mut self) -> Vec<Counted> {
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
    /// (`pumps`); the chunk count and the digest (a link that does not resume: its
    /// caller waits for the ack).
    pub(super) async fn send_striped(
        &mut self,
        config: &SessionConfig,
        gradient: Gradient<'_>,
        id: TransferId,
        clock: &Clock,
        progress: &Progress,
    ) -> Result<(usize, [u8; 32])> {
        let (mut plan, mut headers) = Plan::of(config, &gradient, progress)?;
        let shipment = (gradient, &mut plan, &mut headers);
        self.send_round(config, shipment, clock, progress).await?;
        Ok((plan.sent, digest_of(&id, headers.values())))
    }

    /// Send `gradient` (sealed) over a link that resumes, and wait for its ack: after a
    /// failure of a stream, or of the wait for the ack, every stream is replaced
    /// (`resume`) and the chunks the receiver does not hold are sent again. The chunk
    /// count, once the peer acknowledged the transfer.
    pub(super) async fn send_resumable(
        &mut self,
        config: &SessionConfig,
        gradient: Gradient<'_>,
        id: TransferId,
        clock: &Clock,
        progress: &Progress,
    ) -> Result<usize> {
        let (mut plan, mut headers) = Plan::of(config, &gradient, progress)?;
        let total = plan.total;
        let at = self.peer.address.at();
        let peer = at.as_ref();
        let mut resumes = 0;
        loop {
            let shipment = (gradient, &mut plan, &mut headers);
            let broken = match self.send_round(config, shipment, clock, progress).await {
                Ok(()) => match self.ack_or_break(clock, (plan.sent, Some(total))).await {
                    Ok(ack) => {
                        let digest = digest_of(&id, headers.values());
                        return self.confirmed(ack, &digest, total).await;
                    }
                    Err(e) => e,
                },
                Err(e) => e,
            };
            let digest = (digest_of(&id, headers.values()), plan.finished());
            let at = (plan.sent, Some(total));
            let theirs = match self
                .mend_send(broken, &mut resumes, digest, total, clock, at)
                .await?
            {
                Mended::Acknowledged => return Ok(total as usize),
                Mended::Resumed(theirs) => theirs,
            };
            match plan.again_from(&theirs, peer) {
                Ok(again) => {
                    let resent = &self.resumed.chunks_resent;
                    resent.fetch_add(again, Ordering::Relaxed);
                }
                Err(e) => return self.fail(e).await,
            }
        }
    }

    /// The ack of the transfer just sent, checked: the chunk count, or the failure (the
    /// link closed).
    pub(super) async fn confirmed(
        &mut self,
        ack: Ack,
        digest: &[u8; 32],
        chunks: u32,
    ) -> Result<usize> {
        let at = self.peer.address.at();
        let Mode::Sealed(keys) = &mut self.mode else {
            return Ok(chunks as usize);
        };
        match ack.confirm(keys.sent, digest, at.as_ref()) {
            Ok(()) => {
                keys.sent += 1;
                Ok(chunks as usize)
            }
            Err(e) => self.fail(e).await,
        }
    }

    /// Send the plan's chunks over every stream, each lent to a pump, until none is
    /// left; then every stream back (a pump that cannot stop within LINGER is aborted,
    /// its stream lost: the link is then closed). The first failure, if any.
    async fn send_round(
        &mut self,
        config: &SessionConfig,
        (gradient, plan, headers): (
            Gradient<'_>,
            &mut Plan,
            &mut BTreeMap<u32, [u8; HEADER_LEN]>,
        ),
        clock: &Clock,
        progress: &Progress,
    ) -> Result<()> {
        let outbox = Arc::new(Outbox::default());
        let (events, mut sent_events) = mpsc::unbounded_channel();
        let mut pumps = Pumps::default();
        let streams = self.lend_streams();
        let count = streams.len();
        for (lane, stream) in streams.into_iter().enumerate() {
            pumps.spawn(send_pump(lane, stream, outbox.clone(), events.clone()));
        }
        drop(events);
        let mut back = 0usize;
        let mut failed: Option<GradientStreamError> = None;
        while back < count {
            while failed.is_none() && outbox.len() < AHEAD * count {
                let Some(index) = plan.next_chunk() else {
                    break;
                };
                match config.encode_frame(gradient, index) {
                    Ok(frame) => {
                        let mut head = [0u8; HEADER_LEN];
                        head.copy_from_slice(&frame[..HEADER_LEN]);
                        headers.insert(index, head);
                        outbox.push(index, frame);
                    }
                    Err(e) => {
                        outbox.abandon();
                        failed = Some(e);
                    }
                }
            }
            if failed.is_none() && plan.all_queued() {
                outbox.close();
            }
            let event = match failed {
                // Failed: the pumps stop at their frame's end; those that cannot (a peer
                // not reading) are aborted after LINGER, their streams closed.
                Some(_) => tokio::time::timeout(LINGER, sent_events.recv())
                    .await
                    .unwrap_or(None),
                None => {
                    let resume = &mut self.resume;
                    let waited = within(clock, (plan.sent, Some(plan.total)), async {
                        tokio::select! {
                            event = sent_events.recv() => Ok(event),
                            () = Self::resume_arrival(resume) => Err(resumed_by_peer()),
                        }
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
                Some(Sent::Frame(index)) => {
                    progress.add(0, 1);
                    plan.wrote(index);
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
        // Frames whose news came after the wait gave up: written all the same.
        while let Ok(event) = sent_events.try_recv() {
            if let Sent::Frame(index) = event {
                plan.wrote(index);
            }
        }
        self.lent = back < count; // a stream that did not come back: the link is closed
        failed.map_or(Ok(()), Err)
    }

    /// The first bytes of a transfer, read here (at most a header's), so that the
    /// streams stay the link's until one comes: a receive given up, or out of time,
    /// before its first byte leaves the link as it was. `Closed`: the peer closed the
    /// connection, every stream ended with nothing (a peer's close reaches each stream in
    /// its own time), or the first did and no other brought a byte within LINGER. Bytes
    /// on another stream after the first ended begin a transfer, which then fails.
    /// `Resumed`: the peer dialled the streams again (a listener's link that resumes).
    async fn first_bytes(&mut self) -> std::io::Result<First> {
        let mut streams: Vec<&mut Counted> = std::iter::once(&mut self.stream)
            .chain(self.lanes.iter_mut())
            .collect();
        let resume = &mut self.resume;
        let mut ended = vec![false; streams.len()];
        let mut head = [0u8; HEADER_LEN];
        let mut linger = std::pin::pin!(tokio::time::sleep(LINGER));
        poll_fn(|cx| {
            if let Some(Poll::Ready(())) = resume.as_mut().map(|r| r.poll_arrival(cx)) {
                return Poll::Ready(Ok(First::Resumed));
            }
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
                        return Poll::Ready(Ok(First::Began(lane, buf.filled().to_vec())))
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {}
                }
            }
            let closed =
                ended.iter().all(|e| *e) || (ended[0] && linger.as_mut().poll(cx).is_ready());
            if closed {
                Poll::Ready(Ok(First::Closed))
            } else {
                Poll::Pending
            }
        })
        .await
    }

    /// Receive one gradient through `receiver` from every stream, each read, from the
    /// transfer's first byte, by a task of its own (`pumps`); what it ended with, the
    /// digest, and the first stream's first header. On a link that resumes, a failure
    /// of a stream (or of a wait for bytes) replaces every stream and the transfer goes
    /// on with the chunks held.
    pub(super) async fn recv_striped(
        &mut self,
        mut receiver: FrameReceiver,
        id: TransferId,
        waits: Waits,
        progress: &Progress,
    ) -> (Result<Ended>, [u8; 32], Option<[u8; HEADER_LEN]>) {
        let mut headers = BTreeMap::new();
        let mut clock = Clock::idle(waits);
        let mut resumes = 0;
        let (begun_on, begun) = loop {
            let error = match within(&clock, (0, None), self.first_bytes()).await {
                Ok(First::Began(lane, bytes)) => break (lane, bytes),
                Ok(First::Closed) => {
                    let end = Ended::BeforeFirstByte(Box::new(receiver));
                    return (Ok(end), digest_of(&id, headers.values()), None);
                }
                Ok(First::Resumed) => resumed_by_peer().into(),
                Err(e) => e,
            };
            // A wait out of time before a byte leaves the link as it was; a failure of
            // a stream of a link that resumes is mended first.
            let resumed = match (&error, self.resumable() && resumes < MAX_RESUMES) {
                (GradientStreamError::Io(_), true) if mendable(&error) => {
                    resumes += 1;
                    self.resumed_as_receiver(Vec::new(), &clock, ((0, None), false))
                        .await
                }
                _ => Err(error),
            };
            if let Err(e) = resumed {
                return (Err(e), digest_of(&id, headers.values()), None);
            }
        };
        clock.start();
        progress.add(begun.len(), 0);
        let limits = receiver.limits();
        let mut round = self.start_round(Some((begun_on, begun)), limits);
        let mut first = None;
        let got = loop {
            let at = (receiver.received(), receiver.total());
            // A frame, or bytes of one: each wait for bytes is the timeout's.
            let resume = &mut self.resume;
            let next = within(&clock, at, async {
                tokio::select! {
                    frame = round.came.recv() => Ok(Some(frame)),
                    () = round.moved.read.notified() => Ok(None),
                    () = Self::resume_arrival(resume) => Err(resumed_by_peer()),
                }
            })
            .await;
            round.count_bytes(progress);
            let count = round.count;
            let broken = match next {
                Err(e) => e,
                Ok(None) => continue,
                Ok(Some(None)) | Ok(Some(Some(Came::Back(..)))) => {
                    break Err(std::io::Error::other("a stream's task ended early").into())
                }
                Ok(Some(Some(Came::Ended { lane, error, .. }))) => error.unwrap_or_else(|| {
                    GradientStreamError::Io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "stream {} of the connection's {count} ended before the \
                                 transfer's last frame",
                            lane + 1
                        ),
                    ))
                }),
                Ok(Some(Some(Came::Frame {
                    lane,
                    header,
                    payload,
                    offset,
                    room: _room,
                }))) => {
                    if lane == 0 && first.is_none() {
                        first = Some(header.to_bytes());
                    }
                    let frame = (header, payload, offset);
                    match take_frame(&mut receiver, &mut headers, frame, progress) {
                        Err(e) => break Err(e),
                        Ok(true) => break receiver.finish().map(Ended::Gradient),
                        Ok(false) => continue,
                    }
                }
            };
            if !(mendable(&broken) && self.resumable() && resumes < MAX_RESUMES) {
                break Err(broken);
            }
            resumes += 1;
            // The frames the pumps read before they stopped are held too.
            let (_, frames) = self.end_round(round).await;
            let mut done = false;
            for (_, frame) in frames {
                match take_frame(&mut receiver, &mut headers, frame, progress) {
                    Err(e) => return (Err(e), digest_of(&id, headers.values()), first),
                    Ok(complete) => done |= complete,
                }
            }
            if done {
                // Complete after all: its ack goes on the new streams, or through a resume.
                let got = receiver.finish().map(Ended::Gradient);
                return (got, digest_of(&id, headers.values()), first);
            }
            let held = receiver.held();
            if let Err(e) = self.resumed_as_receiver(held, &clock, (at, true)).await {
                return (Err(e), digest_of(&id, headers.values()), first);
            }
            round = self.start_round(None, limits);
        };
        let count = round.count;
        let (extra, frames) = self.end_round(round).await;
        let extra = extra.or(frames.first().map(|(lane, _)| *lane));
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
        (got, digest_of(&id, headers.values()), first)
    }

    /// Every stream replaced, as a transfer's receiver (holding `held`), and the
    /// sender's state checked: it has taken the acks of every transfer before, and
    /// receives none.
    pub(super) async fn resumed_as_receiver(
        &mut self,
        held: Vec<(u32, u32)>,
        clock: &Clock,
        at: ((usize, Option<u32>), bool),
    ) -> Result<()> {
        let theirs = match self.resume_streams(held, clock, at).await {
            Ok(theirs) => theirs,
            Err(e) => {
                return Err(GradientStreamError::Io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    format!("a stream of the connection failed and it did not resume: {e}"),
                )))
            }
        };
        let Mode::Sealed(keys) = &self.mode else {
            return Ok(());
        };
        if theirs.received == keys.sent && theirs.held.is_empty() {
            return Ok(());
        }
        Err(GradientStreamError::Protocol {
            expected: format!(
                "a resume message of a sender that took {} transfers and receives none",
                keys.sent
            ),
            seen: format!(
                "one that took {} and holds {} ranges of chunks",
                theirs.received,
                theirs.held.len()
            ),
            peer: self.peer.address.at(),
        })
    }

    /// Lend every stream to a receiving pump; `begun`: the first bytes, and the stream
    /// they came on.
    fn start_round(&mut self, mut begun: Option<(usize, Vec<u8>)>, limits: Limits) -> Round {
        let streams = self.lend_streams();
        let count = streams.len();
        // One frame a stream waiting for the reassembly, and at most twice the largest
        // payload held by the pumps at once (docs/guides/limits.md: what a receiver holds).
        let (frames, came) = mpsc::channel(count);
        let room = (limits.max_payload_len as usize)
            .saturating_mul(2)
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        let room = Arc::new(tokio::sync::Semaphore::new(room));
        let (stop, stopping) = watch::channel(false);
        let moved = Arc::new(Moved::default());
        let mut pumps = Pumps::default();
        for (lane, stream) in streams.into_iter().enumerate() {
            // The first bytes go to the pump of the stream they came on.
            let first = match &mut begun {
                Some((on, bytes)) if *on == lane => std::mem::take(bytes),
                _ => Vec::new(),
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
        Round {
            came,
            stop,
            room,
            moved,
            pumps,
            count,
            counted: 0,
        }
    }

    /// Stop the round's pumps and take every stream back: the first stream that held
    /// bytes past what the transfer took (a part of a frame, or an end inside one), and
    /// the whole frames that came meanwhile.
    async fn end_round(&mut self, mut round: Round) -> (Option<usize>, Vec<(usize, Frame)>) {
        let _ = round.stop.send(true);
        round.room.close(); // a pump waiting for room stops
        let mut extra = None;
        let mut frames = Vec::new();
        let mut back = 0;
        while back < round.count {
            match tokio::time::timeout(LINGER, round.came.recv()).await {
                Ok(Some(Came::Back(lane, stream, beyond))) => {
                    self.put_back(lane, stream);
                    back += 1;
                    if beyond {
                        extra.get_or_insert(lane);
                    }
                }
                Ok(Some(Came::Frame {
                    lane,
                    header,
                    payload,
                    offset,
                    ..
                })) => frames.push((lane, (header, payload, offset))),
                Ok(Some(Came::Ended {
                    lane, mid: true, ..
                })) => {
                    extra.get_or_insert(lane);
                }
                Ok(Some(Came::Ended { .. })) => {}
                Ok(None) | Err(_) => break,
            }
        }
        drop(round.pumps);
        self.lent = back < round.count; // a stream that did not come back: the link is closed
        (extra, frames)
    }
}

/// A whole frame a pump read: its header, payload, and where it began in its stream.
type Frame = (FrameHeader, Vec<u8>, u64);

/// Give `receiver` a frame; whether the gradient is complete.
fn take_frame(
    receiver: &mut FrameReceiver,
    headers: &mut BTreeMap<u32, [u8; HEADER_LEN]>,
    (header, payload, offset): Frame,
    progress: &Progress,
) -> Result<bool> {
    let known = receiver.total().is_some();
    let done = receiver.accept_frame(&header, &payload, offset)?;
    headers.insert(header.chunk_index, header.to_bytes());
    progress.add(0, 1);
    if let (false, Some(total)) = (known, receiver.total()) {
        progress.add_total(total);
    }
    Ok(done)
}

/// One round of a receive's pumps: from the transfer's first byte, or from a resume.
struct Round {
    came: mpsc::Receiver<Came>,
    stop: watch::Sender<bool>,
    room: Arc<tokio::sync::Semaphore>,
    moved: Arc<Moved>,
    pumps: Pumps,
    count: usize,
    /// The pumps' bytes already counted in the progress.
    counted: u64,
}

impl Round {
    fn count_bytes(&mut self, progress: &Progress) {
        let bytes = self.moved.bytes.load(Ordering::Relaxed);
        progress.add((bytes - self.counted) as usize, 0);
        self.counted = bytes;
    }
}

/// What came first on a receive's streams.
enum First {
    Began(usize, Vec<u8>),
    Closed,
    Resumed,
}

/// Which chunks a striped send sends next: those to send again (after a resume), then
/// the next new one.
struct Plan {
    total: u32,
    /// The next chunk never queued.
    next: u32,
    again: VecDeque<u32>,
    /// Chunks written whole at least once, by index.
    written: Vec<bool>,
    /// Frames written whole (those sent again included).
    sent: usize,
}

/// The headers of a transfer's frames, by chunk index (what its digest covers).
type Headers = BTreeMap<u32, [u8; HEADER_LEN]>;

impl Plan {
    /// The plan of `gradient`'s chunks (counted in `progress`), and where their headers
    /// go.
    fn of(
        config: &SessionConfig,
        gradient: &Gradient<'_>,
        progress: &Progress,
    ) -> Result<(Self, Headers)> {
        let total = config.chunk_count(gradient.len())?;
        progress.add_total(total);
        let plan = Self {
            total,
            next: 0,
            again: VecDeque::new(),
            written: vec![false; total as usize],
            sent: 0,
        };
        Ok((plan, BTreeMap::new()))
    }

    fn next_chunk(&mut self) -> Option<u32> {
        if let Some(index) = self.again.pop_front() {
            return Some(index);
        }
        let index = self.next;
        (index < self.total).then(|| {
            self.next += 1;
            index
        })
    }

    fn all_queued(&self) -> bool {
        self.again.is_empty() && self.next == self.total
    }

    /// Every chunk was queued (so every header is in the digest).
    fn finished(&self) -> bool {
        self.next == self.total
    }

    fn wrote(&mut self, index: u32) {
        if let Some(written) = self.written.get_mut(index as usize) {
            *written = true;
        }
        self.sent += 1;
    }

    /// After a resume: the chunks queued and not held by the receiver (`theirs`) are
    /// sent again, first; how many of them had been written. Refused: a receiver that
    /// holds a chunk this side never wrote.
    fn again_from(&mut self, theirs: &ResumeState, peer: Option<&PeerAt>) -> Result<u64> {
        for &(first, end) in &theirs.held {
            let unwritten =
                (first..end).find(|i| !self.written.get(*i as usize).copied().unwrap_or(false));
            if let Some(index) = unwritten {
                return Err(GradientStreamError::Protocol {
                    expected: format!(
                        "a resume message holding only chunks this side wrote (of {})",
                        self.total
                    ),
                    seen: format!("one that holds chunk {index}"),
                    peer: peer.cloned(),
                });
            }
        }
        self.again = (0..self.next).filter(|i| !theirs.holds(*i)).collect();
        Ok(self
            .again
            .iter()
            .filter(|i| self.written[**i as usize])
            .count() as u64)
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
