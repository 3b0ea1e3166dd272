//! The Python side of streaming: sockets handed to tokio, progress counters, the drivers
//! an engine may take, and the sans-I/O encoder/receiver that `gradstream._aio` drives for
//! asyncio streams.
//!
//! Uses `convert` (the gradient held across a transfer, the `out=` array, values out),
//! `handover` (an asyncio stream's socket with the bytes its reader held), `buffers` and
//! `errors`; used by `session`.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::buffers::ReadBuffer;
use super::convert::{values_tuple, HeldGradient, Input, LentArray};
use super::errors::IntoPyResult;
use super::handover::{Buffered, Handover};
use gradstream_core::error::{GradientStreamError, Result};
use gradstream_core::output::Output;
use gradstream_core::receiver::{Ended, FrameReceiver};
use gradstream_core::seal::Seal;
use gradstream_core::session::SessionConfig;
use gradstream_core::stream::{Progress, Waits};

/// The optional ways onto a socket an engine may take, all by default. A benchmark row
/// turns one off to measure it against the path that serves its case without it (each
/// stays only while it beats that path: docs/performance.md).
#[derive(Clone, Copy, Debug)]
pub struct Drivers {
    /// Small transfers tried on the caller's thread before tokio (`fastpath` for
    /// sockets, `Completions::run_or_spawn` for connections).
    pub caller_thread: bool,
}

impl Default for Drivers {
    fn default() -> Self {
        Self {
            caller_thread: true,
        }
    }
}

/// Progress counters of a transfer; what `progress=` was given, or fresh unobserved ones.
#[pyclass(name = "TransferProgress", module = "gradstream", frozen)]
pub struct TransferProgress {
    counters: Arc<Progress>,
}

#[pymethods]
impl TransferProgress {
    #[new]
    fn new() -> Self {
        Self {
            counters: Arc::default(),
        }
    }

    /// Wire bytes moved so far.
    #[getter]
    fn bytes(&self) -> u64 {
        self.counters.bytes.load(Ordering::Relaxed)
    }

    /// Frames sent or received so far.
    #[getter]
    fn chunks(&self) -> u64 {
        self.counters.chunks.load(Ordering::Relaxed)
    }

    /// total_chunks of the gradient in flight (0 until known).
    #[getter]
    fn total_chunks(&self) -> u64 {
        self.counters.total_chunks.load(Ordering::Relaxed)
    }

    fn __repr__(&self) -> String {
        format!(
            "TransferProgress(bytes={}, chunks={}, total_chunks={})",
            self.bytes(),
            self.chunks(),
            self.total_chunks()
        )
    }
}

/// A transfer's waits as (timeout, deadline) seconds, for the Python side's clock.
pub fn waits_in_seconds(waits: Waits) -> (Option<f64>, Option<f64>) {
    let seconds = |d: Option<std::time::Duration>| d.map(|d| d.as_secs_f64());
    (seconds(waits.timeout), seconds(waits.deadline))
}

/// The error of a wait that ran out after `seconds`: the deadline's when `late`, else the
/// timeout's; `at` is (chunks moved, total).
pub fn expired(
    seconds: f64,
    late: bool,
    (received, total): (usize, Option<u32>),
) -> GradientStreamError {
    if late {
        GradientStreamError::Deadline {
            deadline: seconds,
            received,
            total,
        }
    } else {
        GradientStreamError::Timeout {
            timeout: seconds,
            received,
            total,
        }
    }
}

pub fn progress_counters(progress: Option<&Bound<'_, TransferProgress>>) -> Arc<Progress> {
    progress.map_or_else(Arc::default, |p| p.get().counters.clone())
}

/// A connected Python socket, duplicated for tokio.
///
/// The duplicate shares the caller's open file, and with it the file's O_NONBLOCK flag,
/// so that flag is left as the caller set it: every read and write here asks the kernel
/// not to wait (`MSG_DONTWAIT`) and waits for readiness through tokio's epoll instead.
/// Nothing is kept per socket or per process (a table of borrowed flags would be state a
/// `fork` must be protected from, and would change a socket the caller may use meanwhile).
pub struct SocketStream {
    fd: OwnedFd,
    /// Bytes read before the socket's, for a socket handed over by an asyncio stream.
    buffered: Option<Arc<Buffered>>,
}

impl SocketStream {
    /// A connected stream socket (`socket.socket`, checked by the Python session: not
    /// TLS, not closed, SOCK_STREAM), or a `Handover` of one, duplicated; the Python
    /// socket stays open and usable, in the mode it had.
    pub fn from_socket(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let (obj, buffered) = Handover::unwrap(obj);
        let raw: i32 = obj.call_method0("fileno")?.extract()?;
        if raw < 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EBADF).into());
        }
        // SAFETY: `raw` is the open descriptor of `obj`, which outlives this call; we only
        // duplicate it.
        let borrowed = unsafe { BorrowedFd::borrow_raw(raw) };
        let fd = borrowed.try_clone_to_owned()?;
        Ok(Self { fd, buffered })
    }

    /// The tokio stream; call on the runtime (inside the transfer's future).
    pub fn open(self) -> Result<SocketIo> {
        // SAFETY: `self.fd` is an open descriptor the `OwnedFd` owns: it stays open on the
        // same open file until the `AsyncFd` drops it, and `as_raw_fd` always gives it.
        let fd = unsafe { AsyncFd::register(self.fd) }.map_err(std::io::Error::from)?;
        Ok(SocketIo {
            fd,
            buffered: self.buffered,
        })
    }
}

/// A duplicated socket under tokio; dropping it closes the duplicate only.
pub struct SocketIo {
    fd: AsyncFd<OwnedFd>,
    buffered: Option<Arc<Buffered>>,
}

/// What one non-waiting system call gave: a count, or an error (`WouldBlock` included).
fn counted(n: libc::ssize_t) -> std::io::Result<usize> {
    usize::try_from(n).map_err(|_| std::io::Error::last_os_error())
}

/// Read what the socket holds into `buf` without waiting; `WouldBlock` when it holds none.
fn recv_now(fd: &OwnedFd, buf: &mut ReadBuf<'_>) -> std::io::Result<()> {
    // SAFETY: the kernel writes at most `unfilled.len()` bytes into the unfilled part,
    // and only the `n` it reports are marked initialised and filled below.
    let n = unsafe {
        let unfilled = buf.unfilled_mut();
        let flags = libc::MSG_DONTWAIT;
        counted(libc::recv(
            fd.as_raw_fd(),
            unfilled.as_mut_ptr().cast(),
            unfilled.len(),
            flags,
        ))?
    };
    // SAFETY: `recv` initialised the first `n` bytes of the unfilled part.
    unsafe { buf.assume_init(n) };
    buf.advance(n);
    Ok(())
}

/// Write what the socket takes of `bufs` without waiting; `WouldBlock` when it takes none.
/// `MSG_NOSIGNAL`: a closed peer is an `EPIPE` error, not a SIGPIPE to the process.
fn send_now(fd: &OwnedFd, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
    // SAFETY: a zeroed msghdr is valid (no name, no control data); its iovec array is
    // `bufs`, whose `IoSlice` has iovec's layout, alive and unchanged for the call.
    let n = unsafe {
        let mut message: libc::msghdr = std::mem::zeroed();
        message.msg_iov = bufs.as_ptr().cast_mut().cast();
        message.msg_iovlen = bufs.len().min(IOV_MAX) as _;
        libc::sendmsg(
            fd.as_raw_fd(),
            &message,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    counted(n)
}

/// The most slices one `sendmsg` takes (Linux's UIO_MAXIOV).
const IOV_MAX: usize = 1024;

impl SocketIo {
    fn poll_recv(&self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        loop {
            let mut ready = std::task::ready!(self.fd.poll_read_ready(cx))?;
            match ready.try_io(|fd| recv_now(fd.get_ref(), buf)) {
                Ok(done) => return Poll::Ready(done),
                // Nothing there after all: readiness is cleared, wait for the next.
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        loop {
            let mut ready = std::task::ready!(self.fd.poll_write_ready(cx))?;
            match ready.try_io(|fd| send_now(fd.get_ref(), bufs)) {
                Ok(done) => return Poll::Ready(done),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncRead for SocketIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let read = |cx: &mut Context<'_>, buf: &mut ReadBuf<'_>| this.poll_recv(cx, buf);
        match &this.buffered {
            Some(buffered) => buffered.poll_read(cx, buf, read),
            None => read(cx, buf),
        }
    }
}

impl AsyncWrite for SocketIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.poll_send(cx, &[std::io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.poll_send(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // Nothing is buffered here: each write went to the kernel.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // SAFETY: shutdown on a descriptor this stream owns.
        let done = unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_WR) };
        Poll::Ready(if done == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        })
    }
}

/// The frames of one gradient, one `bytes` per `next()` (encoded with the GIL released).
#[pyclass(module = "gradstream._native", name = "FrameEncoder")]
pub struct FrameEncoder {
    config: SessionConfig,
    gradient: HeldGradient,
    /// The gradient's seal, when the session seals.
    seal: Option<Seal>,
    progress: Arc<Progress>,
    waits: Waits,
    /// Frames encoded so far, and those the stream has taken whole (`sent`).
    next: u32,
    written: u32,
    total: u32,
}

impl FrameEncoder {
    pub fn new(
        config: SessionConfig,
        input: Input<'_>,
        progress: Arc<Progress>,
        waits: Waits,
    ) -> PyResult<Self> {
        let py = input.bytes.py();
        let gradient = HeldGradient::new(&input)?;
        let total = config.chunk_count(gradient.gradient().len()).py_err(py)?;
        // One seal for all the gradient's frames, drawn before the first.
        let seal = config.draw_seal().py_err(py)?;
        progress.add_total(total);
        Ok(Self {
            config,
            gradient,
            seal,
            progress,
            waits,
            next: 0,
            written: 0,
            total,
        })
    }
}

#[pymethods]
impl FrameEncoder {
    #[getter]
    fn total_chunks(&self) -> u32 {
        self.total
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        if self.next >= self.total {
            return Ok(None);
        }
        let (config, gradient, index) = (&self.config, &self.gradient, self.next);
        let sealed = gradient.gradient().seal_with(self.seal);
        let frame = py
            .detach(|| config.encode_frame(sealed, index))
            .py_err(py)?;
        self.next += 1;
        Ok(Some(PyBytes::new(py, &frame)))
    }

    /// Count bytes (and frames) the stream accepted.
    fn sent(&mut self, nbytes: usize, frames: u32) {
        self.written += frames;
        self.progress.add(nbytes, u64::from(frames));
    }

    /// The session's timeout and the transfer's deadline, in seconds (the Python clock's).
    #[getter]
    fn waits(&self) -> (Option<f64>, Option<f64>) {
        waits_in_seconds(self.waits)
    }

    /// Raise the timeout error (the deadline's when `late`) for the frames written so far.
    #[pyo3(signature = (seconds, late = false))]
    fn timed_out(&self, py: Python<'_>, seconds: f64, late: bool) -> PyResult<()> {
        let at = (self.written as usize, Some(self.total));
        Err(super::errors::to_py_err(py, expired(seconds, late, at)))
    }

    /// The note for an error met now: none for a single gradient.
    fn note(&self) -> Option<String> {
        None
    }
}

/// Receives one gradient from bytes the caller reads: `want()` says how many next.
#[pyclass(module = "gradstream._native", name = "FrameReceiver")]
pub struct PyFrameReceiver {
    inner: Option<FrameReceiver>,
    progress: Arc<Progress>,
    waits: Waits,
    /// The caller's `out=` array the receiver writes into, returned by `finish`.
    out: Option<Py<PyAny>>,
}

impl PyFrameReceiver {
    pub fn new(
        config: &SessionConfig,
        progress: Arc<Progress>,
        out: Option<LentArray>,
        waits: Waits,
    ) -> Self {
        let (inner, out) = match out {
            Some(lent) => (config.receiver_into(lent.slice), Some(lent.owner)),
            None => (config.receiver(), None),
        };
        Self {
            inner: Some(inner),
            progress,
            waits,
            out,
        }
    }

    fn result<'py>(&self, py: Python<'py>, values: Output) -> PyResult<Bound<'py, PyAny>> {
        match &self.out {
            Some(out) => Ok(out.bind(py).clone()),
            None => values_tuple(py, values),
        }
    }

    fn inner(&mut self) -> PyResult<&mut FrameReceiver> {
        self.inner
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("this receiver has finished"))
    }

    fn take(&mut self) -> PyResult<FrameReceiver> {
        self.inner
            .take()
            .ok_or_else(|| PyValueError::new_err("this receiver has finished"))
    }
}

#[pymethods]
impl PyFrameReceiver {
    fn want(&mut self) -> PyResult<usize> {
        Ok(self.inner()?.want())
    }

    #[getter]
    fn received(&mut self) -> PyResult<usize> {
        Ok(self.inner()?.received())
    }

    #[getter]
    fn total(&mut self) -> PyResult<Option<u32>> {
        Ok(self.inner()?.total())
    }

    /// Take exactly `want()` bytes; True once the gradient is complete.
    fn feed(&mut self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<bool> {
        let bytes = ReadBuffer::get(data)?;
        let progress = self.progress.clone();
        let receiver = self.inner()?;
        let (before, known) = (receiver.received(), receiver.total().is_some());
        let done = py.detach(|| receiver.feed(bytes.as_slice())).py_err(py)?;
        if let (false, Some(total)) = (known, receiver.total()) {
            progress.add_total(total);
        }
        progress.add(
            bytes.as_slice().len(),
            (receiver.received() - before) as u64,
        );
        Ok(done)
    }

    /// The stream ended after `got` bytes of what `want()` asked: None when it ended
    /// before the gradient's first byte (then `finish` gives the empty gradient), else
    /// the gradient or the error the decoding rules give.
    fn end<'py>(&mut self, py: Python<'py>, got: usize) -> PyResult<Option<Bound<'py, PyAny>>> {
        let receiver = self.take()?;
        match receiver.end_of_stream(got).py_err(py)? {
            Ended::Gradient(values) => Ok(Some(self.result(py, values)?)),
            Ended::BeforeFirstByte(receiver) => {
                self.inner = Some(*receiver);
                Ok(None)
            }
        }
    }

    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let values = self.take()?.finish().py_err(py)?;
        self.result(py, values)
    }

    /// The note for an error met now: none for a single gradient.
    fn note(&self) -> Option<String> {
        None
    }

    /// The session's timeout and the transfer's deadline, in seconds (the Python clock's).
    #[getter]
    fn waits(&self) -> (Option<f64>, Option<f64>) {
        waits_in_seconds(self.waits)
    }

    /// Raise the timeout error (the deadline's when `late`) for this receiver's state.
    #[pyo3(signature = (seconds, late = false))]
    fn timed_out(&mut self, py: Python<'_>, seconds: f64, late: bool) -> PyResult<()> {
        let receiver = self.inner()?;
        let at = (receiver.received(), receiver.total());
        Err(super::errors::to_py_err(py, expired(seconds, late, at)))
    }
}
