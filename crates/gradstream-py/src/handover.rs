//! A socket handed over by an asyncio stream, with the bytes its `StreamReader` had
//! already read from it: the native receive reads those first, then the socket.
//!
//! `gradstream._handover` pauses the transport's reading, takes the reader's buffer and
//! wraps both in a `Handover`, which it passes where a receive takes a socket. The
//! receive never reads past the gradient's last frame (`read_unit` asks for exactly what
//! the receiver wants), so anything it leaves of the buffer (`unread`) is what followed
//! the gradient, for the Python side to put back in the reader.
//!
//! Uses `buffers` (the bytes given); used by `stream` (`SocketStream::from_socket`
//! unwraps a `Handover`, `SocketIo` reads its bytes first).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::io::ReadBuf;

use super::buffers::ReadBuffer;

/// Bytes already read from a socket, served before the socket's own.
pub struct Buffered {
    bytes: Vec<u8>,
    /// How many of `bytes` a receive has taken (read from the loop's thread afterwards).
    taken: AtomicUsize,
    /// Whether the socket said end of stream (the reader must then be at EOF too).
    ended: AtomicBool,
}

impl Buffered {
    /// A read of the socket through `read`, after these bytes: served from them while
    /// any are left, and an end of stream the socket gives noted.
    pub fn poll_read(
        &self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
        read: impl FnOnce(&mut Context<'_>, &mut ReadBuf<'_>) -> Poll<std::io::Result<()>>,
    ) -> Poll<std::io::Result<()>> {
        if self.serve(buf) {
            return Poll::Ready(Ok(()));
        }
        let (room, before) = (buf.remaining(), buf.filled().len());
        let polled = read(cx, buf);
        if room > 0 && buf.filled().len() == before && matches!(polled, Poll::Ready(Ok(()))) {
            self.ended.store(true, Ordering::Release);
        }
        polled
    }

    /// Copy as many of the bytes not yet taken as `buf` has room for; false when none
    /// are left (then the socket is read).
    fn serve(&self, buf: &mut ReadBuf<'_>) -> bool {
        let from = self.taken.load(Ordering::Acquire);
        let left = self.bytes.get(from..).unwrap_or_default();
        let n = left.len().min(buf.remaining());
        if n == 0 {
            return false;
        }
        buf.put_slice(&left[..n]);
        self.taken.store(from + n, Ordering::Release);
        true
    }

    /// Whether no bytes were read before the socket's: then the socket alone holds the
    /// stream, and the caller's thread may peek at it as at any socket.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn unread(&self) -> &[u8] {
        let from = self.taken.load(Ordering::Acquire);
        self.bytes.get(from..).unwrap_or_default()
    }
}

/// `Handover(socket, buffered)`: a socket an asyncio transport stopped reading, and the
/// bytes its reader held, for one native receive.
#[pyclass(module = "gradstream._native", name = "Handover", frozen)]
pub struct Handover {
    socket: Py<PyAny>,
    buffered: Arc<Buffered>,
}

impl Handover {
    /// The socket of `obj` and, when `obj` is a Handover, the bytes to read first.
    pub fn unwrap<'py>(obj: &Bound<'py, PyAny>) -> (Bound<'py, PyAny>, Option<Arc<Buffered>>) {
        match obj.cast::<Handover>() {
            Ok(handover) => {
                let handover = handover.get();
                let socket = handover.socket.bind(obj.py()).clone();
                (socket, Some(handover.buffered.clone()))
            }
            Err(_) => (obj.clone(), None),
        }
    }
}

#[pymethods]
impl Handover {
    #[new]
    fn new(socket: Bound<'_, PyAny>, buffered: &Bound<'_, PyAny>) -> PyResult<Self> {
        let bytes = ReadBuffer::get(buffered)?.as_slice().to_vec();
        Ok(Self {
            socket: socket.unbind(),
            buffered: Arc::new(Buffered {
                bytes,
                taken: AtomicUsize::new(0),
                ended: AtomicBool::new(false),
            }),
        })
    }

    /// The buffered bytes no receive has taken: what followed the gradient.
    fn unread<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.buffered.unread())
    }

    /// Whether a receive met the end of the stream on the socket.
    fn ended(&self) -> bool {
        self.buffered.ended.load(Ordering::Acquire)
    }

    /// The socket's descriptor (a receive on the caller's thread waits for it).
    fn fileno(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(self.socket.bind(py).call_method0("fileno")?.unbind())
    }
}
