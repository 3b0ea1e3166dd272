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
use tokio::sync::{mpsc, watch, Notify};
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
    frames: Mutex<VecDeque<Vec<u8>>>,
    closed: std::sync::atomic::AtomicBool,
    ready: Notify,
}

impl Outbox {
    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Vec<u8>>> {
        self.frames.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn len(&self) -> usize {
        self.queue().len()
    }

    pub(super) fn push(&self, frame: Vec<u8>) {
        self.queue().push_back(frame);
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

    async fn next(&self) -> Option<Vec<u8>> {
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
    /// A whole frame went.
    Frame,
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
        while let Some(frame) = outbox.next().await {
            let mut at = 0;
            while at < frame.len() {
                let n = stream.write(&frame[at..]).await?;
                if n == 0 {
                    return Err(std::io::ErrorKind::WriteZero.into());
                }
                at += n;
                let _ = events.send(Sent::Bytes(n));
            }
            let _ = events.send(Sent::Frame);
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
    /// in its stream.
    Frame {
        lane: usize,
        header: FrameHeader,
        payload: Vec<u8>,
        offset: u64,
    },
    /// The stream ended (`mid`: inside a frame) or failed.
    Ended {
        lane: usize,
        mid: bool,
        error: Option<GradientStreamError>,
    },
    /// Told to stop: its stream, back (`mid`: it held part of a frame).
    Back(usize, Counted, bool),
}

/// The bytes the receiving pumps of a transfer read, for the transfer's progress.
pub(super) type Bytes = Arc<AtomicU64>;

/// Read whole frames from `stream` (stream `lane`) and hand them over, until `stop`.
pub(super) async fn receive_pump(
    lane: usize,
    mut stream: Counted,
    limits: Limits,
    frames: mpsc::Sender<Came>,
    bytes: Bytes,
    mut stop: watch::Receiver<bool>,
) {
    let mut head = [0u8; HEADER_LEN];
    let mut filled = 0usize;
    let mut offset = 0u64;
    let mut ended = false;
    loop {
        let step = async {
            if ended {
                return std::future::pending().await;
            }
            // A header, read in steps that lose nothing when stopped between them.
            let n = stream.read(&mut head[filled..]).await?;
            if n == 0 {
                return Ok(None);
            }
            bytes.fetch_add(n as u64, Ordering::Relaxed);
            filled += n;
            if filled < HEADER_LEN {
                return Ok(Some(None));
            }
            let header = FrameHeader::from_bytes(&head);
            limits
                .check_header(&header, offset)
                .map_err(Failure::Rule)?;
            // Grow with what arrives, not with what the header claims (as `read_unit`).
            let want = header.payload_len as usize;
            let mut payload = Vec::with_capacity(want.min(64 * 1024));
            while payload.len() < want {
                let room = want - payload.len();
                payload.reserve(room.min(payload.len().max(64 * 1024)));
                let got = (&mut stream)
                    .take(room as u64)
                    .read_buf(&mut payload)
                    .await?;
                if got == 0 {
                    return Err(Failure::Cut);
                }
                bytes.fetch_add(got as u64, Ordering::Relaxed);
            }
            Ok(Some(Some((header, payload))))
        };
        let stepped = tokio::select! {
            biased;
            _ = stop.wait_for(|stop| *stop) => None,
            stepped = step => Some(stepped),
        };
        let came = match stepped {
            // Stopped between reads (or inside a payload: `mid`).
            None => {
                let _ = frames.send(Came::Back(lane, stream, filled > 0)).await;
                return;
            }
            Some(Ok(Some(None))) => continue,
            Some(Ok(Some(Some((header, payload))))) => {
                filled = 0;
                let at = offset;
                offset += (HEADER_LEN + payload.len()) as u64;
                Came::Frame {
                    lane,
                    header,
                    payload,
                    offset: at,
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
        let sent = tokio::select! {
            biased;
            _ = stop.wait_for(|stop| *stop) => false,
            sent = frames.send(came) => sent.is_ok(),
        };
        if !sent {
            let _ = frames.send(Came::Back(lane, stream, filled > 0)).await;
            return;
        }
    }
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
