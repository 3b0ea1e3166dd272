//! A gradient over a link of several streams (docs/spec/protocol.md, "Several streams"):
//! its frames, sealed to one transfer as on one stream, go out on whichever stream is
//! free next (a slow stream takes fewer), and come in from all of them, in any order,
//! into one reassembly. The ack's digest covers the headers in index order, and the ack
//! travels on the first stream. Tensor sets travel on the first stream alone.
//!
//! One task drives every stream: a poll that tries each in turn returns as soon as one
//! moved bytes, so the timeout still bounds each wait, not the transfer.

use std::collections::BTreeMap;
use std::future::poll_fn;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::counted::Counted;
use super::*;
use crate::frame::FrameHeader;

/// One stream's outgoing frame: its bytes and how many of them went.
struct Out<'s> {
    stream: &'s mut Counted,
    frame: Vec<u8>,
    at: usize,
}

/// One stream's incoming frame: the header or payload being read (`unit`, of which
/// `filled` bytes came), the header whose payload this is, the stream's byte offset.
struct In<'s> {
    stream: &'s mut Counted,
    unit: Vec<u8>,
    filled: usize,
    pending: Option<FrameHeader>,
    offset: u64,
    ended: bool,
}

impl In<'_> {
    fn want(&self) -> usize {
        self.pending.map_or(HEADER_LEN, |h| h.payload_len as usize)
    }

    /// Mid-frame: bytes of a header or payload came, or a header waits for its payload.
    fn mid_frame(&self) -> bool {
        self.filled > 0 || self.pending.is_some()
    }
}

/// What a poll of the incoming streams saw.
enum Came {
    /// Stream `0` has a whole unit (a header, or a payload) in.
    Unit(usize),
    /// Bytes came, not yet a whole unit.
    Bytes,
    /// Stream `0` ended.
    End(usize),
}

/// The digest of headers held by index.
fn digest_in_order(id: &TransferId, headers: &BTreeMap<u32, [u8; HEADER_LEN]>) -> [u8; 32] {
    let mut digest = Digest::new(&id.0);
    for header in headers.values() {
        digest.header(header);
    }
    digest.finish()
}

impl Link {
    /// Every stream in index order, the first included.
    fn all_streams(&mut self) -> Vec<&mut Counted> {
        std::iter::once(&mut self.stream)
            .chain(self.lanes.iter_mut())
            .collect()
    }

    /// Send `gradient` (sealed) over every stream; the chunk count and the digest.
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
        let mut outs: Vec<Out<'_>> = self
            .all_streams()
            .into_iter()
            .map(|stream| Out {
                stream,
                frame: Vec::new(),
                at: 0,
            })
            .collect();
        let mut headers = BTreeMap::new();
        let (mut next, mut sent) = (0u32, 0usize);
        loop {
            for out in outs.iter_mut().filter(|o| o.at == o.frame.len()) {
                if next == total {
                    out.frame.clear();
                    out.at = 0;
                    continue;
                }
                out.frame = config.encode_frame(gradient, next)?;
                let mut head = [0u8; HEADER_LEN];
                head.copy_from_slice(&out.frame[..HEADER_LEN]);
                headers.insert(next, head);
                out.at = 0;
                next += 1;
            }
            if outs.iter().all(|o| o.frame.is_empty()) {
                break;
            }
            let at = (sent, Some(total));
            sent += within(
                clock,
                at,
                poll_fn(|cx| poll_writes(cx, &mut outs, progress)),
            )
            .await?;
        }
        for out in &mut outs {
            within(clock, (sent, Some(total)), out.stream.flush()).await?;
        }
        Ok((sent, digest_in_order(&id, &headers)))
    }

    /// Receive one gradient through `receiver` from every stream; what it ended with,
    /// the digest, and the first stream's first header.
    pub(super) async fn recv_striped(
        &mut self,
        mut receiver: FrameReceiver,
        id: TransferId,
        waits: Waits,
        progress: &Progress,
    ) -> (Result<Ended>, [u8; 32], Option<[u8; HEADER_LEN]>) {
        let mut clock = Clock::idle(waits);
        let mut ins: Vec<In<'_>> = self
            .all_streams()
            .into_iter()
            .map(|stream| In {
                stream,
                unit: Vec::new(),
                filled: 0,
                pending: None,
                offset: 0,
                ended: false,
            })
            .collect();
        let streams = ins.len();
        let mut headers = BTreeMap::new();
        let mut first = None;
        let mut turn = 0;
        let got = loop {
            let at = (receiver.received(), receiver.total());
            let came = within(
                &clock,
                at,
                poll_fn(|cx| poll_reads(cx, &mut ins, &mut turn, progress)),
            )
            .await;
            let lane = match came {
                Err(e) => break Err(e),
                Ok(Came::Bytes) => {
                    clock.start();
                    continue;
                }
                Ok(Came::End(lane)) => {
                    let nothing_yet =
                        receiver.received() == 0 && ins.iter().all(|i| !i.mid_frame());
                    // A peer's close reaches each stream in its own time (separate flows):
                    // before a transfer began, the first stream's end is the one that says.
                    if lane != 0 && nothing_yet {
                        continue;
                    }
                    if lane == 0 && nothing_yet {
                        break Ok(Ended::BeforeFirstByte(Box::new(receiver)));
                    }
                    break Err(GradientStreamError::Io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "stream {} of the connection's {streams} ended before the \
                             transfer's last frame",
                            lane + 1
                        ),
                    )));
                }
                Ok(Came::Unit(lane)) => lane,
            };
            clock.start();
            let input = &mut ins[lane];
            let step = match input.pending.take() {
                None => {
                    let mut head = [0u8; HEADER_LEN];
                    head.copy_from_slice(&input.unit[..HEADER_LEN]);
                    if lane == 0 && first.is_none() {
                        first = Some(head);
                    }
                    let header = FrameHeader::from_bytes(&head);
                    input.filled = 0;
                    receiver.check_header(&header, input.offset).map(|()| {
                        input.pending = Some(header);
                        false
                    })
                }
                Some(header) => {
                    let known = receiver.total().is_some();
                    let len = header.payload_len as usize;
                    let done = receiver.accept_frame(&header, &input.unit[..len], input.offset);
                    input.offset += (HEADER_LEN + len) as u64;
                    input.filled = 0;
                    if done.is_ok() {
                        headers.insert(header.chunk_index, header.to_bytes());
                        progress.add(0, 1);
                        if let (false, Some(total)) = (known, receiver.total()) {
                            progress.add_total(total);
                        }
                    }
                    done
                }
            };
            match step {
                Err(e) => break Err(e),
                Ok(false) => {}
                Ok(true) => {
                    // The transfer's last frame: no stream may hold more of it.
                    if let Some(extra) = ins.iter().position(In::mid_frame) {
                        break Err(GradientStreamError::frame(
                            format!(
                                "stream {} of the connection's {streams} holds bytes past the \
                                 transfer's last frame",
                                extra + 1
                            ),
                            None,
                        ));
                    }
                    break receiver.finish().map(Ended::Gradient);
                }
            }
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
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
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

/// Write what each stream's frame still has, as far as the streams take it now; ready
/// with the frames finished once any stream moved bytes.
fn poll_writes(
    cx: &mut Context<'_>,
    outs: &mut [Out<'_>],
    progress: &Progress,
) -> Poll<std::io::Result<usize>> {
    let (mut moved, mut finished) = (false, 0);
    for out in outs.iter_mut() {
        while out.at < out.frame.len() {
            match Pin::new(&mut *out.stream).poll_write(cx, &out.frame[out.at..]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()))
                }
                Poll::Ready(Ok(n)) => {
                    out.at += n;
                    moved = true;
                    progress.add(n, 0);
                    if out.at == out.frame.len() {
                        finished += 1;
                        progress.add(0, 1);
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => break,
            }
        }
    }
    if moved {
        Poll::Ready(Ok(finished))
    } else {
        Poll::Pending
    }
}

/// Read into each stream's unit, taking the streams in turn from `turn`; ready once a
/// stream has a whole unit, has ended, or bytes came.
fn poll_reads(
    cx: &mut Context<'_>,
    ins: &mut [In<'_>],
    turn: &mut usize,
    progress: &Progress,
) -> Poll<std::io::Result<Came>> {
    let count = ins.len();
    let mut moved = false;
    for step in 0..count {
        let lane = (*turn + step) % count;
        let input = &mut ins[lane];
        if input.ended {
            continue;
        }
        loop {
            let want = input.want();
            if input.filled == want {
                *turn = (lane + 1) % count;
                return Poll::Ready(Ok(Came::Unit(lane)));
            }
            // Grow with what arrives, not with what the header claims (as `read_unit`).
            let room = want.min(input.filled + input.filled.max(64 * 1024));
            if input.unit.len() < room {
                input.unit.resize(room, 0);
            }
            let mut buf = ReadBuf::new(&mut input.unit[input.filled..room]);
            match Pin::new(&mut *input.stream).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) => {
                    let n = buf.filled().len();
                    if n == 0 {
                        input.ended = true;
                        return Poll::Ready(Ok(Came::End(lane)));
                    }
                    input.filled += n;
                    moved = true;
                    progress.add(n, 0);
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => break,
            }
        }
    }
    if moved {
        Poll::Ready(Ok(Came::Bytes))
    } else {
        Poll::Pending
    }
}
