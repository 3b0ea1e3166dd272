//! The tasks a striped transfer lends its streams to (`striped`): one per stream, for one
//! transfer, so that what each stream's reads and writes cost (TLS's cipher, above all)
//! runs on whichever of the runtime's threads is free (docs/spec/protocol.md, "Several
//! streams"). The transfer's own task encodes and reassembles; the pumps only move
//! whole frames, and hand their streams back when told to stop (or, sending, when no
//! frame is left). A transfer dropped midway aborts its pumps: their streams close, and
//! the link, which then counts none of their bytes, is out of step (closed).
//!
//! Uses `counted` and `frame`; used by `striped`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use super::counted::Counted;
use crate::error::GradientStreamError;
use crate::frame::{FrameHeader, Limits, HEADER_LEN};

/// The pumps of one transfer: aborted when dropped (a transfer given up midway).
#[derive(Default)]
pub(super) struct Pumps(Vec<JoinHandle<()>>);

impl Pumps {
    pub(super) fn spawn(&mut self, pump: impl std::future::Future<Output = ()> + Send + 'static) {
        self.0.push(tokio::spawn(pump));
    }
}

impl Drop for Pumps {
    fn drop(&mut self) {
        for pump in &self.0 {
            pump.abort();
        }
    }
}

/// Frames waiting for a sending pump: the first free one takes the next.
#[derive(Default)]
pub(super) struct Outbox {
    /// Each frame with its chunk's index.
    frames: Mutex<VecDeque<(u32, Vec<u8>)>>,
    closed: std::sync::atomic::AtomicBool,
    ready: Notify,
}

impl Outbox {
    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<(u32, Vec<u8>)>> {
        self.frames.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn len(&self) -> usize {
        self.queue().len()
    }

    pub(super) fn push(&self, index: u32, frame: Vec<u8>) {
        self.queue().push_back((index, frame));
        self.ready.notify_one();
    }

    /// No more frames: the pumps finish what is queued, then hand their streams back.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.ready.notify_waiters();
    }

    /// Stop now: what is queued is dropped (a transfer that failed).
    pub(super) fn abandon(&self) {
        self.queue().clear();
        self.close();
    }

    async fn next(&self) -> Option<(u32, Vec<u8>)> {
        loop {
            let ready = self.ready.notified();
            tokio::pin!(ready);
            // Registered before the checks, so a push or close between them wakes it.
            ready.as_mut().enable();
            if let Some(frame) = self.queue().pop_front() {
                return Some(frame);
            }
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            ready.await;
        }
    }
}

/// What a sending pump tells the transfer.
pub(super) enum Sent {
    /// Bytes went.
    Bytes(usize),
    /// A whole frame went: chunk `.0`'s.
    Frame(u32),
    /// No frame is left (or a write failed): its stream, back.
    Done(usize, Counted, std::io::Result<()>),
}

/// Write the outbox's frames on `stream` (stream `lane`) until it is closed and empty.
pub(super) async fn send_pump(
    lane: usize,
    mut stream: Counted,
    outbox: Arc<Outbox>,
    events: mpsc::UnboundedSender<Sent>,
) {
    let written = async {
        while let Some((index, frame)) = outbox.next().await {
            let mut at = 0;
            while at < frame.len() {
                let n = stream.write(&frame[at..]).await?;
                if n == 0 {
                    return Err(std::io::ErrorKind::WriteZero.into());
                }
                at += n;
                let _ = events.send(Sent::Bytes(n));
            }
            let _ = events.send(Sent::Frame(index));
        }
        stream.flush().await
    }
    .await;
    if written.is_err() {
        outbox.abandon(); // the transfer has failed: the other pumps stop too
    }
    let _ = events.send(Sent::Done(lane, stream, written));
}

/// What a receiving pump tells the transfer.
pub(super) enum Came {
    /// A whole frame, its header checked against the limits; `offset` is where it began
    /// in its stream; `room`, the share of the receive's byte budget it holds until the
    /// reassembly has taken it.
    Frame {
        lane: usize,
        header: FrameHeader,
        payload: Vec<u8>,
        offset: u64,
        room: OwnedSemaphorePermit,
    },
    /// The stream ended (`mid`: inside a frame) or failed.
    Ended {
        lane: usize,
        mid: bool,
        error: Option<GradientStreamError>,
    },
    /// Told to stop: its stream, back (`extra`: it held part of a frame, or a frame the
    /// transfer did not take).
    Back(usize, Counted, bool),
}

/// What the receiving pumps of a transfer read: the bytes, for the transfer's progress,
/// and a wake for each read, so that its timeout bounds each wait for bytes.
#[derive(Default)]
pub(super) struct Moved {
    pub(super) bytes: AtomicU64,
    pub(super) read: Notify,
}

impl Moved {
    fn add(&self, n: usize) {
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        self.read.notify_one();
    }
}

/// What a receiving pump shares with the transfer.
pub(super) struct Inlet {
    pub(super) frames: mpsc::Sender<Came>,
    pub(super) moved: Arc<Moved>,
    /// The payload bytes the pumps may hold at once (taken before a payload is read,
    /// given back once the reassembly took it).
    pub(super) room: Arc<Semaphore>,
    pub(super) limits: Limits,
    pub(super) stop: watch::Receiver<bool>,
}

/// Read whole frames from `stream` (stream `lane`), whose first bytes `begun` the
/// transfer read already, and hand them over, until told to stop.
pub(super) async fn receive_pump(lane: usize, mut stream: Counted, begun: Vec<u8>, inlet: Inlet) {
    let Inlet {
        frames,
        moved,
        room,
        limits,
        mut stop,
    } = inlet;
    let mut head = [0u8; HEADER_LEN];
    head[..begun.len()].copy_from_slice(&begun);
    let mut filled = begun.len();
    let mut offset = 0u64;
    let mut ended = false;
    loop {
        let step = async {
            if ended {
                return std::future::pending().await;
            }
            if filled < HEADER_LEN {
                // A header, read in steps that lose nothing when stopped between them.
                let n = stream.read(&mut head[filled..]).await?;
                if n == 0 {
                    return Ok(None);
                }
                moved.add(n);
                filled += n;
                if filled < HEADER_LEN {
                    return Ok(Some(None));
                }
            }
            let header = FrameHeader::from_bytes(&head);
            limits
                .check_header(&header, offset)
                .map_err(Failure::Rule)?;
            let want = header.payload_len;
            let permit = room
                .clone()
                .acquire_many_owned(want)
                .await
                .map_err(|_| Failure::Io(std::io::Error::other("the receive ended")))?;
            // Grow with what arrives, not with what the header claims (as `read_unit`).
            let want = want as usize;
            let mut payload = Vec::with_capacity(want.min(64 * 1024));
            while payload.len() < want {
                let left = want - payload.len();
                payload.reserve_exact(left.min(payload.len().max(64 * 1024)));
                let got = (&mut stream)
                    .take(left as u64)
                    .read_buf(&mut payload)
                    .await?;
                if got == 0 {
                    return Err(Failure::Cut);
                }
                moved.add(got);
            }
            Ok(Some(Some((header, payload, permit))))
        };
        let stepped = tokio::select! {
            biased;
            _ = stop.wait_for(|stop| *stop) => None,
            stepped = step => Some(stepped),
        };
        let came = match stepped {
            // Stopped between reads (or inside a payload, or with a header in: `extra`);
            // bytes already there past the transfer's end count as extra too.
            None => {
                let extra = filled > 0 || (!ended && bytes_waiting(&mut stream).await);
                let _ = frames.send(Came::Back(lane, stream, extra)).await;
                return;
            }
            Some(Ok(Some(None))) => continue,
            Some(Ok(Some(Some((header, payload, room))))) => {
                filled = 0;
                let at = offset;
                offset += (HEADER_LEN + payload.len()) as u64;
                Came::Frame {
                    lane,
                    header,
                    payload,
                    offset: at,
                    room,
                }
            }
            Some(Ok(None)) => {
                ended = true;
                Came::Ended {
                    lane,
                    mid: filled > 0,
                    error: None,
                }
            }
            Some(Err(failure)) => {
                ended = true;
                Came::Ended {
                    lane,
                    mid: true,
                    error: Some(failure.into()),
                }
            }
        };
        let is_frame = matches!(came, Came::Frame { .. });
        let sent = tokio::select! {
            biased;
            _ = stop.wait_for(|stop| *stop) => false,
            sent = frames.send(came) => sent.is_ok(),
        };
        if !sent {
            // A frame read and not taken is a frame past the transfer's end.
            let _ = frames.send(Came::Back(lane, stream, is_frame)).await;
            return;
        }
    }
}

/// Whether a read would give bytes at once (what it reads is dropped: it would be bytes
/// past a transfer's end).
async fn bytes_waiting(stream: &mut Counted) -> bool {
    let mut sink = [0u8; 64];
    std::future::poll_fn(|cx| {
        let mut buf = tokio::io::ReadBuf::new(&mut sink);
        let polled =
            tokio::io::AsyncRead::poll_read(std::pin::Pin::new(&mut *stream), cx, &mut buf);
        std::task::Poll::Ready(
            matches!(polled, std::task::Poll::Ready(Ok(()))) && !buf.filled().is_empty(),
        )
    })
    .await
}

/// Why a receiving pump's frame failed.
enum Failure {
    Io(std::io::Error),
    /// The stream ended inside a payload.
    Cut,
    /// The header broke a limit.
    Rule(GradientStreamError),
}

impl From<std::io::Error> for Failure {
    fn from(error: std::io::Error) -> Self {
        Self::Io(error)
    }
}

impl From<Failure> for GradientStreamError {
    fn from(failure: Failure) -> Self {
        match failure {
            Failure::Io(error) => error.into(),
            Failure::Rule(error) => error,
            Failure::Cut => std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the stream ended inside a frame's payload",
            )
            .into(),
        }
    }
}
