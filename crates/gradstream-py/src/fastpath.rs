//! The socket path's small transfers on the caller's thread (docs/performance.md, bench
//! section 7 "driver caller_thread"; an asyncio stream's socket handed over by
//! `gradstream._handover` takes it too): a
//! transfer handed to tokio pays a fixed cost before a byte moves (a duplicated
//! descriptor, its mode, an epoll registration, a task, two thread hops), which is most
//! of the time of a small gradient's round trip. So a small send is encoded here and
//! written with one `send(MSG_DONTWAIT)`; only what the socket did not take goes on in
//! tokio. A receive peeks (`MSG_PEEK | MSG_DONTWAIT`) at what the socket holds and runs the
//! session's own receiver over it: a whole gradient there is taken (exactly its bytes)
//! and returned; nothing there yet means waiting for readability on the asyncio loop
//! (`gradstream._aio.receive_socket`) and peeking again; anything else (part of a
//! gradient, a large one, the end of the stream, an error) hands the receive to tokio
//! with nothing consumed, so the slow path sees the stream as it was.
//!
//! Neither changes the socket's blocking mode (MSG_DONTWAIT is per call). The system
//! calls, which never block, run with the GIL held, so that no other Python thread can
//! close the socket and reuse its descriptor number meanwhile; encoding and decoding run
//! without it.
//!
//! Uses `convert` (gradients in, `out=` arrays, values out), `stream` (sockets, progress,
//! the expiry error, the drivers), `handover` (a stream's socket with its reader's bytes),
//! `complete` and `errors`; used by `session` and `connection`.

use std::cell::RefCell;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use super::complete::{Completions, Outcome};
use super::convert::{values_tuple, Input, LentArray};
use super::errors::{to_py_err, IntoPyResult};
use super::handover::Handover;
use super::stream::{expired, Drivers, SocketStream};
use gradstream_core::at_hand::{receive_at_hand, send_rest, AtHand};
use gradstream_core::error::GradientStreamError;
use gradstream_core::frame::HEADER_LEN;
use gradstream_core::receiver::Ended;
use gradstream_core::session::SessionConfig;
use gradstream_core::stream::{receive_gradient, Progress, Waits};

/// Gradients of at most this many bytes of values are sent from the caller's thread.
/// Their frames are copied once into one buffer (a large gradient's are written from the
/// caller's memory by the tokio sender instead, never copied).
pub const SEND_MAX: usize = 128 * 1024;

/// Bytes one peek looks at: a gradient whose frames are longer is received by tokio.
pub const PEEK_MAX: usize = 256 * 1024;

/// Transfers that finished on the caller's thread (sends, receives), for the tests.
static SENT_HERE: AtomicU64 = AtomicU64::new(0);
static RECEIVED_HERE: AtomicU64 = AtomicU64::new(0);

/// `(sends, receives)` finished on the caller's thread so far in this process.
#[pyfunction]
pub fn fast_path_counts() -> (u64, u64) {
    (
        SENT_HERE.load(Ordering::Relaxed),
        RECEIVED_HERE.load(Ordering::Relaxed),
    )
}

fn fileno(socket: &Bound<'_, PyAny>) -> PyResult<RawFd> {
    let fd: RawFd = socket.call_method0("fileno")?.extract()?;
    if fd < 0 {
        return Err(std::io::Error::from_raw_os_error(libc::EBADF).into());
    }
    Ok(fd)
}

/// A system call's result as io::Result, EINTR retried.
fn retried(mut call: impl FnMut() -> isize) -> std::io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// A send's outcome: all of it went at once (the chunk count), or the rest goes on as a
/// tokio job.
pub enum Sent {
    Now(usize),
    Job(u64),
}

impl From<Sent> for (bool, u64) {
    fn from(sent: Sent) -> Self {
        match sent {
            Sent::Now(chunks) => (true, chunks as u64),
            Sent::Job(job) => (false, job),
        }
    }
}

/// Send a small gradient from the caller's thread; None when it is not small (the tokio
/// sender takes it whole).
pub fn send(
    config: &SessionConfig,
    completions: &Bound<'_, Completions>,
    input: &Input<'_>,
    socket: &Bound<'_, PyAny>,
    progress: &Arc<Progress>,
    waits: Waits,
) -> PyResult<Option<Sent>> {
    let py = socket.py();
    let values = input.gradient()?;
    if values.raw().len() > SEND_MAX {
        return Ok(None);
    }
    let fd = fileno(socket)?;
    // The frames the tokio sender would write (a sealing session's fresh id included),
    // with the same errors.
    let (frames, ends) = py
        .detach(|| -> gradstream_core::error::Result<_> {
            let plan = config.plan_frames(values)?;
            let mut frames = vec![0u8; plan.len()];
            config.write_frames(&plan, &mut frames)?;
            let ends = plan
                .chunks()
                .scan(0, |end, (_, _, len)| {
                    *end += HEADER_LEN + len as usize;
                    Some(*end)
                })
                .collect::<Vec<_>>();
            Ok((frames, ends))
        })
        .py_err(py)?;
    progress.add_total(ends.len() as u32);
    // SAFETY: `frames` is a live buffer of its length; `fd` is the socket's open
    // descriptor (the GIL is held, so its object cannot close it meanwhile).
    let written = retried(|| unsafe {
        libc::send(
            fd,
            frames.as_ptr().cast(),
            frames.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    });
    let written = match written {
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
        Err(e) => return Err(to_py_err(py, GradientStreamError::Io(e))),
    };
    let chunks = ends.iter().take_while(|&&end| end <= written).count();
    progress.add(written, chunks as u64);
    if written == frames.len() {
        SENT_HERE.fetch_add(1, Ordering::Relaxed);
        return Ok(Some(Sent::Now(ends.len())));
    }
    let socket = SocketStream::from_socket(socket)?;
    let progress = progress.clone();
    Ok(Some(Sent::Job(completions.get().spawn(async move {
        let mut io = socket.open()?;
        send_rest(&mut io, &frames, &ends, written, waits, &progress)
            .await
            .map(Outcome::Chunks)
    }))))
}

/// Take the first `n` bytes the socket holds (peeked before, so they are there).
fn consume(fd: RawFd, buffer: &mut [u8], n: usize) -> std::io::Result<()> {
    let mut taken = 0;
    while taken < n {
        let into = &mut buffer[..n - taken];
        // SAFETY: `into` is a live writable buffer of its length; `fd` is open (GIL held).
        let got = retried(|| unsafe {
            libc::recv(fd, into.as_mut_ptr().cast(), into.len(), libc::MSG_DONTWAIT)
        })?;
        if got == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        taken += got;
    }
    Ok(())
}

thread_local! {
    /// The peek buffer of this thread (an event loop's): made once, reused by every peek.
    static PEEKED: RefCell<Box<[u8]>> = RefCell::new(vec![0u8; PEEK_MAX].into_boxed_slice());
}

/// What `SocketReceive.poll` says next: the result is here, wait for readability, or
/// hand the receive to tokio (`hand_over`).
const DONE: u8 = 0;
const WAIT: u8 = 1;
const SLOW: u8 = 2;

/// One receive from a socket, tried on the caller's thread (`poll`) until it is done,
/// must wait for readability, or goes to tokio.
#[pyclass(module = "gradstream._native", name = "SocketReceive")]
pub struct SocketReceive {
    config: SessionConfig,
    socket: Py<PyAny>,
    progress: Arc<Progress>,
    waits: Waits,
    none_at_end: bool,
    /// The `out=` or `reduce_into=` array's bytes, dtype name and lending (`OutArgs`),
    /// lent afresh to each receiver.
    out: Option<(Py<PyAny>, String, String)>,
    /// When the receive began: nothing has arrived since (a byte that arrives ends the
    /// waiting here), so the timeout runs from it.
    began: Instant,
    /// False without the caller-thread driver, and for a socket an asyncio stream handed
    /// over with bytes its reader held (`handover`): they come first, and a peek would
    /// not see them, so tokio takes it at once. Handed over with none, the socket is
    /// peeked as any (its transport's reading is paused meanwhile).
    peekable: bool,
}

impl SocketReceive {
    pub fn new(
        config: SessionConfig,
        drivers: Drivers,
        socket: &Bound<'_, PyAny>,
        progress: Arc<Progress>,
        waits: Waits,
        none_at_end: bool,
        out: Option<(Py<PyAny>, String, String)>,
    ) -> Self {
        Self {
            config,
            socket: socket.clone().unbind(),
            progress,
            waits,
            none_at_end,
            out,
            began: Instant::now(),
            peekable: drivers.caller_thread
                && Handover::unwrap(socket)
                    .1
                    .is_none_or(|held| held.is_empty()),
        }
    }

    fn lend(&self, py: Python<'_>) -> PyResult<Option<LentArray>> {
        self.out
            .as_ref()
            .map(|(bytes, dtype, lending)| LentArray::new(bytes.bind(py), dtype, lending))
            .transpose()
    }

    /// The time left to wait for a first byte; the timeout error once none is left.
    fn wait_left(&self, py: Python<'_>) -> PyResult<Option<f64>> {
        let Some(timeout) = self.waits.timeout else {
            return Ok(None);
        };
        let left = timeout.saturating_sub(self.began.elapsed());
        if left == Duration::ZERO {
            let error = expired(timeout.as_secs_f64(), false, (0, None));
            return Err(to_py_err(py, error));
        }
        Ok(Some(left.as_secs_f64()))
    }
}

#[pymethods]
impl SocketReceive {
    /// The receive as a job of the loop's `completions`, from the stream as it is
    /// (nothing is consumed here before). Its result is what `poll` would have given.
    fn hand_over(&self, py: Python<'_>, completions: &Bound<'_, Completions>) -> PyResult<u64> {
        let lent = self.lend(py)?;
        let socket = SocketStream::from_socket(self.socket.bind(py))?;
        let (config, waits) = (self.config.clone(), self.waits);
        let (progress, none_at_end) = (self.progress.clone(), self.none_at_end);
        Ok(completions.get().spawn(async move {
            let (receiver, owner) = match lent {
                Some(lent) => (config.receiver_into(lent.slice), Some(lent.owner)),
                None => (config.receiver(), None),
            };
            let mut io = socket.open()?;
            let received = receive_gradient(receiver, &mut io, waits, &progress);
            let values = match received.await? {
                Ended::Gradient(values) => values,
                Ended::BeforeFirstByte(_) if none_at_end => return Ok(Outcome::End),
                // "No network": the empty gradient (which must fit `out`).
                Ended::BeforeFirstByte(receiver) => receiver.finish()?,
            };
            Ok(match owner {
                Some(owner) => Outcome::Filled(owner),
                None => Outcome::Values(values),
            })
        }))
    }

    /// One try: `(0, result)` when the gradient was taken here (the values tuple, or the
    /// `out=` array), `(1, seconds or None)` to wait that long at most for readability and
    /// poll again, `(2, None)` when tokio is to take the receive over (`hand_over`). Raises
    /// what the receive raises (the timeout error when the wait ran out with nothing
    /// there).
    fn poll<'py>(&self, py: Python<'py>) -> PyResult<(u8, Bound<'py, PyAny>)> {
        if !self.peekable {
            return Ok((SLOW, py.None().into_bound(py)));
        }
        let fd = fileno(self.socket.bind(py))?;
        PEEKED.with_borrow_mut(|buffer| {
            // SAFETY: `buffer` is a live writable buffer of its length; `fd` is open.
            let peeked = retried(|| unsafe {
                let flags = libc::MSG_PEEK | libc::MSG_DONTWAIT;
                libc::recv(fd, buffer.as_mut_ptr().cast(), buffer.len(), flags)
            });
            let held = match peeked {
                Ok(n) if n > 0 => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let left = self.wait_left(py)?;
                    return Ok((WAIT, left.into_pyobject(py)?.into_any()));
                }
                // The end of the stream, or an error: the tokio receiver says what it means.
                _ => return Ok((SLOW, py.None().into_bound(py))),
            };
            let lent = self.lend(py)?;
            let (receiver, owner) = match lent {
                Some(lent) => (self.config.receiver_into(lent.slice), Some(lent.owner)),
                None => (self.config.receiver(), None),
            };
            let bytes = &buffer[..held];
            match py.detach(|| receive_at_hand(receiver, bytes)) {
                AtHand::Short => Ok((SLOW, py.None().into_bound(py))),
                AtHand::Taken { counted, got } => {
                    consume(fd, buffer, counted.bytes).map_err(|e| to_py_err(py, e.into()))?;
                    counted.add_to(&self.progress);
                    let values = got.py_err(py)?;
                    RECEIVED_HERE.fetch_add(1, Ordering::Relaxed);
                    let result = match owner {
                        Some(owner) => owner.into_bound(py),
                        None => values_tuple(py, values)?,
                    };
                    Ok((DONE, result))
                }
            }
        })
    }
}
