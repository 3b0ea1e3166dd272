//! Bytes across the boundary without needless copies.
//!
//! `ReadBuffer` gives the bytes of any bytes-like Python object (bytes, bytearray,
//! memoryview, pyarrow.Buffer, numpy arrays) as a `&[u8]` that stays valid and unchanged
//! with the GIL released.
//! `FrameBytes` hands a Rust-built byte vector to Python through the buffer protocol, so
//! that `pyarrow.py_buffer` can wrap it with no copy. `WritableBytes` holds a caller's
//! `out=` buffer for `encode_frames` to write into.
//!
//! Uses pyo3 and the core's `output::advise_huge_pages`, no other file of this crate;
//! used by `session`, `stream` and `chunk`.

use std::mem::MaybeUninit;
use std::os::raw::c_int;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyMemoryView};

/// Bytes of a Python object that cannot change while we read them.
pub enum ReadBuffer {
    /// A `bytes` object: immutable, read in place.
    Bytes(PyBackedBytes),
    /// A copy of any other buffer (bytearray, memoryview, numpy, pyarrow.Buffer).
    Copied(Vec<u8>),
}

impl ReadBuffer {
    /// Borrow `bytes` in place; copy anything else once. A mutable buffer must not be read
    /// in place with the GIL released: another thread (a `socket.recv_into`, say) could
    /// rewrite it between our checks and our reads, and the Arrow metadata is verified once
    /// and then trusted. Its read-only flag proves nothing (`memoryview.toreadonly()`).
    pub fn get(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(bytes) = obj.cast::<PyBytes>() {
            return Ok(Self::Bytes(bytes.clone().into()));
        }
        let view = PyUntypedBuffer::get(obj)?;
        if !view.is_c_contiguous() {
            // A strided view (e.g. memoryview(x)[::2]): Python makes the contiguous copy.
            return Ok(Self::Bytes(immutable_bytes(obj)?));
        }
        let (ptr, len) = (view.buf_ptr() as usize, view.len_bytes());
        let copy = obj.py().detach(|| {
            let mut copy = Vec::<u8>::with_capacity(len);
            gradstream_core::output::advise_huge_pages(copy.as_ptr(), len);
            if len > 0 {
                // SAFETY: the exporter guarantees `len` readable bytes at `ptr` while the
                // view is held (until the end of this function); `copy` has room for them.
                unsafe {
                    std::ptr::copy_nonoverlapping(ptr as *const u8, copy.as_mut_ptr(), len);
                    copy.set_len(len);
                }
            }
            copy
        });
        drop(view);
        Ok(Self::Copied(copy))
    }

    pub fn as_slice(&self) -> &[u8] {
        match self {
            Self::Bytes(bytes) => bytes,
            Self::Copied(copy) => copy,
        }
    }
}

/// Any bytes-like object as immutable bytes: a `bytes` object is kept as it is, any other
/// buffer is copied once (in C order) into a new `bytes`.
pub fn immutable_bytes(obj: &Bound<'_, PyAny>) -> PyResult<PyBackedBytes> {
    if let Ok(bytes) = obj.cast::<PyBytes>() {
        return Ok(bytes.clone().into());
    }
    let bytes = PyMemoryView::from(obj)?
        .call_method0("tobytes")?
        .cast_into::<PyBytes>()?;
    Ok(bytes.into())
}

/// A new `bytes` of `len` bytes, which `fill` must initialise every one of (it should
/// release the GIL for heavy work; an error drops the object unseen). Unlike
/// `PyBytes::new_with`, nothing zeroes the whole object first, a pass over memory of its
/// own, and the memory is advised for huge pages before its first touch (see
/// `gradstream_core::output::advise_huge_pages`).
pub fn new_bytes_with<'py>(
    py: Python<'py>,
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> PyResult<()>,
) -> PyResult<Bound<'py, PyBytes>> {
    let size = ffi::Py_ssize_t::try_from(len)
        .map_err(|_| PyValueError::new_err(format!("{len} bytes do not fit a bytes object")))?;
    // SAFETY: a NULL source asks CPython for a bytes object of `size` uninitialised bytes
    // (or NULL with an exception set, which `from_owned_ptr_or_err` raises).
    let bytes = unsafe {
        Bound::from_owned_ptr_or_err(py, ffi::PyBytes_FromStringAndSize(std::ptr::null(), size))?
            .cast_into_unchecked::<PyBytes>()
    };
    // SAFETY: a bytes object holds `len` bytes at `PyBytes_AsString`, kept alive by
    // `bytes`; it is ours alone until returned (a new object, no other reference exists),
    // and seen only as possibly uninitialised bytes.
    let out = unsafe {
        let data = ffi::PyBytes_AsString(bytes.as_ptr()).cast::<MaybeUninit<u8>>();
        std::slice::from_raw_parts_mut(data, len)
    };
    gradstream_core::output::advise_huge_pages(out.as_ptr().cast::<u8>(), len);
    fill(out)?;
    Ok(bytes)
}

/// Immutable bytes made in Rust, exported through the buffer protocol.
#[pyclass(module = "gradstream._native", frozen)]
pub struct FrameBytes {
    data: Vec<u8>,
}

#[pymethods]
impl FrameBytes {
    fn __len__(&self) -> usize {
        self.data.len()
    }

    /// # Safety
    /// Called by CPython with a valid `view`; fills it over our immutable vector.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "gradstream frame bytes are read-only",
            ));
        }
        let data = &slf.get().data;
        // SAFETY: `data` is never mutated and lives as long as `slf`, which the view keeps
        // alive (PyBuffer_FillInfo takes a reference to it).
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                data.as_ptr() as *mut std::ffi::c_void,
                data.len() as ffi::Py_ssize_t,
                1,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}

/// `pyarrow.py_buffer`, looked up once: wraps any buffer-protocol object with no copy.
fn py_buffer(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static PY_BUFFER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    PY_BUFFER.import(py, "pyarrow", "py_buffer")
}

/// Wrap a Rust byte vector as a `pyarrow.Buffer`, no copy.
pub fn vec_to_pyarrow(py: Python<'_>, data: Vec<u8>) -> PyResult<Bound<'_, PyAny>> {
    let owner = Bound::new(py, FrameBytes { data })?;
    py_buffer(py)?.call1((owner,))
}

/// Wrap a Python `bytes` object as a `pyarrow.Buffer`, no copy.
pub fn bytes_to_pyarrow<'py>(bytes: &Bound<'py, PyBytes>) -> PyResult<Bound<'py, PyAny>> {
    py_buffer(bytes.py())?.call1((bytes,))
}

/// A caller's writeable buffer (`encode_frames(out=)`), held for the call. The Python
/// session has checked it (gradstream._convert.frame_buffer, which names the problem);
/// this only refuses what would be unsound to write.
pub struct WritableBytes {
    buffer: pyo3::buffer::PyBuffer<u8>,
}

impl WritableBytes {
    pub fn new(out: &Bound<'_, PyAny>) -> PyResult<Self> {
        let buffer = pyo3::buffer::PyBuffer::<u8>::get(out)?;
        if buffer.readonly() || !buffer.is_c_contiguous() {
            return Err(PyTypeError::new_err(
                "out= must be a writeable C-contiguous buffer",
            ));
        }
        Ok(Self { buffer })
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.buffer.len_bytes();
        if len == 0 {
            return &mut [];
        }
        // SAFETY: a writeable, C-contiguous buffer of `len` bytes, held (so neither freed
        // nor resized) while `self` lives. Writes from other threads meanwhile are the
        // caller's to avoid, as with socket.recv_into.
        unsafe { std::slice::from_raw_parts_mut(self.buffer.buf_ptr().cast::<u8>(), len) }
    }
}
