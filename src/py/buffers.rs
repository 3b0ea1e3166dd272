//! Bytes across the boundary without needless copies.
//!
//! `ReadBuffer` borrows any bytes-like Python object (bytes, bytearray, memoryview,
//! pyarrow.Buffer, numpy arrays) as a `&[u8]` that may be used with the GIL released.
//! `FrameBytes` hands a Rust-built byte vector to Python through the buffer protocol, so
//! that `pyarrow.py_buffer` can wrap it with no copy.

use std::os::raw::c_int;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyMemoryView};

/// Read-only bytes borrowed from a Python object.
pub enum ReadBuffer {
    /// A C-contiguous buffer exported by the object itself.
    View(PyUntypedBuffer),
    /// A `bytes` object, or a contiguous copy of a strided buffer.
    Bytes(PyBackedBytes),
}

impl ReadBuffer {
    pub fn get(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(bytes) = obj.cast::<PyBytes>() {
            return Ok(Self::Bytes(bytes.clone().into()));
        }
        let view = PyUntypedBuffer::get(obj)?;
        if view.is_c_contiguous() {
            return Ok(Self::View(view));
        }
        // A strided view (e.g. memoryview(x)[::2]): one contiguous copy, in C order.
        let bytes = PyMemoryView::from(obj)?
            .call_method0("tobytes")?
            .cast_into::<PyBytes>()?;
        Ok(Self::Bytes(bytes.into()))
    }

    /// The bytes. Safe to use without the GIL: the view stays exported (and `bytes` alive)
    /// for as long as `self` lives. A writer mutating a bytearray from another thread
    /// meanwhile is a data race the caller owns, as with any buffer consumer.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Self::View(view) => {
                let len = view.len_bytes();
                if len == 0 {
                    return &[];
                }
                // SAFETY: the exporter guarantees `len` readable, C-contiguous bytes at
                // `buf_ptr` until the view is released, which happens when `self` drops.
                unsafe { std::slice::from_raw_parts(view.buf_ptr() as *const u8, len) }
            }
            Self::Bytes(bytes) => bytes,
        }
    }
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
