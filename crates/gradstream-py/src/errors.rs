//! Rust errors to the Python classes of `gradstream.errors`.
//!
//! The classes are plain Python (so the pure-Python reference raises the same ones without
//! loading this extension); they are looked up once and instantiated with the error's fields.
//!
//! Uses the core's `error` alone; every file that raises uses it.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use pyo3::exceptions::PyValueError;

use gradstream_core::error::{ArrowIpcDetail, GradientStreamError, PeerAt};

static ARROW_IPC: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static CHECKSUM: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INCOMPLETE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static FRAME: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static SIZE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DTYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static STREAM_IO: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static TIMEOUT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DEADLINE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static TENSOR_SET: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static PROTOCOL: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static AUTHENTICATION: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static TLS: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DELIVERY: PyOnceLock<Py<PyType>> = PyOnceLock::new();

const MODULE: &str = "gradstream.errors";

/// The Python exception of `err`, built from its fields. One match with an arm a variant
/// (over 60 lines only because each arm spreads its fields over lines): the whole mapping
/// of variants to classes reads in one place.
fn instantiate(py: Python<'_>, err: GradientStreamError) -> PyResult<PyErr> {
    let instance = match err {
        GradientStreamError::ArrowIpc(ArrowIpcDetail {
            detail,
            chunk_index,
        }) => ARROW_IPC
            .import(py, MODULE, "ArrowIpcError")?
            .call1((detail, chunk_index))?,
        GradientStreamError::ChecksumMismatch {
            chunk_index,
            expected,
            actual,
        } => CHECKSUM
            .import(py, MODULE, "ChecksumMismatchError")?
            .call1((chunk_index, expected, actual))?,
        GradientStreamError::IncompleteStream { received, total } => INCOMPLETE
            .import(py, MODULE, "IncompleteStreamError")?
            .call1((received, total))?,
        GradientStreamError::Frame {
            detail,
            chunk_index,
            offset,
        } => FRAME
            .import(py, MODULE, "FrameError")?
            .call1((detail, chunk_index, offset))?,
        GradientStreamError::GradientSize {
            expected,
            received,
            chunk_index,
        } => SIZE.import(py, MODULE, "GradientSizeError")?.call1((
            expected,
            received,
            chunk_index,
        ))?,
        GradientStreamError::GradientDtype {
            expected,
            received,
            chunk_index,
        } => DTYPE.import(py, MODULE, "GradientDtypeError")?.call1((
            expected,
            received,
            chunk_index,
        ))?,
        GradientStreamError::Io(e) => stream_io_error(py, e.raw_os_error(), e.to_string())?,
        GradientStreamError::Timeout {
            timeout,
            received,
            total,
        } => TIMEOUT
            .import(py, MODULE, "StreamTimeoutError")?
            .call1((timeout, received, total))?,
        GradientStreamError::Deadline {
            deadline,
            received,
            total,
        } => DEADLINE
            .import(py, MODULE, "StreamDeadlineError")?
            .call1((deadline, received, total))?,
        GradientStreamError::TensorSet { detail, name } => TENSOR_SET
            .import(py, MODULE, "TensorSetError")?
            .call1((detail, name))?,
        // The inner error's own class, with the note added (`exc.add_note`), as the
        // Python set layers raise it.
        GradientStreamError::Noted { error, note } => {
            let inner = instantiate(py, *error)?
                .into_value(py)
                .into_bound(py)
                .into_any();
            inner.call_method1("add_note", (note,))?;
            inner
        }
        GradientStreamError::Protocol {
            expected,
            seen,
            peer,
        } => PROTOCOL.import(py, MODULE, "ProtocolError")?.call1((
            expected,
            seen,
            peer_object(py, peer)?,
        ))?,
        GradientStreamError::Authentication { detail, peer } => AUTHENTICATION
            .import(py, MODULE, "AuthenticationError")?
            .call1((detail, peer_object(py, peer)?))?,
        GradientStreamError::Tls { detail, peer } => TLS
            .import(py, MODULE, "TlsError")?
            .call1((detail, peer_object(py, peer)?))?,
        GradientStreamError::Delivery {
            detail,
            reason,
            peer,
        } => DELIVERY.import(py, MODULE, "DeliveryError")?.call1((
            detail,
            peer_object(py, peer)?,
            reason,
        ))?,
        // The core adds variants; each needs its class here (the samples test sees one
        // that has none).
        other => PyValueError::new_err(other.to_string())
            .into_value(py)
            .into_bound(py)
            .into_any(),
    };
    Ok(PyErr::from_value(instance))
}

/// A peer as the errors' `peer` holds it: `(host, port)` as Python's socket module
/// gives it, or `"unix:PATH"`.
fn peer_object(py: Python<'_>, peer: Option<PeerAt>) -> PyResult<Option<Bound<'_, PyAny>>> {
    Ok(match peer {
        None => None,
        Some(PeerAt::Tcp(p)) => Some((p.ip().to_string(), p.port()).into_pyobject(py)?.into_any()),
        Some(PeerAt::Unix(path)) => Some(
            format!("unix:{}", path.display())
                .into_pyobject(py)?
                .into_any(),
        ),
    })
}

/// `StreamIOError(errno, strerror)` (which fills `.errno` and `.strerror`), or
/// `StreamIOError(message)` without an OS error code.
pub fn stream_io_error(
    py: Python<'_>,
    errno: Option<i32>,
    message: String,
) -> PyResult<Bound<'_, PyAny>> {
    let class = STREAM_IO.import(py, MODULE, "StreamIOError")?;
    match errno {
        Some(errno) => class.call1((errno, message)),
        None => class.call1((message,)),
    }
}

/// `TensorSetError(detail, name)` with `name` a Python object: a sender's name that Rust
/// cannot hold (a `str` with a lone surrogate).
pub fn tensor_set_error(py: Python<'_>, detail: String, name: &Bound<'_, PyAny>) -> PyErr {
    match TENSOR_SET
        .import(py, MODULE, "TensorSetError")
        .and_then(|class| class.call1((detail, name)))
    {
        Ok(instance) => PyErr::from_value(instance),
        Err(e) => e,
    }
}

static SETTING: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `gradstream.errors.SettingError(setting, detail)`: a session keyword out of range.
pub fn setting_error(py: Python<'_>, setting: &str, detail: String) -> PyErr {
    match SETTING
        .import(py, MODULE, "SettingError")
        .and_then(|class| class.call1((setting, detail)))
    {
        Ok(instance) => PyErr::from_value(instance),
        Err(e) => e,
    }
}

/// The Python exception for a core error (or the error met while building it).
pub fn to_py_err(py: Python<'_>, err: GradientStreamError) -> PyErr {
    instantiate(py, err).unwrap_or_else(|e| e)
}

/// `result.py_err(py)?` in binding code.
pub trait IntoPyResult<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for gradstream_core::error::Result<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py_err(py, e))
    }
}

/// The name of `value`'s type, for the messages of argument errors.
pub fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map_or_else(|_| "this object".into(), |n| n.to_string())
}
