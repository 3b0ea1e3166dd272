//! The session constructor's keywords, checked and turned into settings: `SettingArgs`
//! (what Python passed) parses into `Settings` (the core's `SessionConfig` and the
//! bindings' own keep_shape, keep_dtype and wire_dtype), with every refusal worded as
//! the reference words it; and a listener's own keywords (`ListenerArgs`).
//!
//! Uses `errors` and the core; used by `session` and `connection`.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use super::errors::{setting_error, type_name};
use gradstream_core::codec::{Compression, Layout};
use gradstream_core::connection::Admission;
use gradstream_core::dtype::WireDtype;
use gradstream_core::frame::Limits;
use gradstream_core::session::SessionConfig;

/// A session's settings, checked.
pub struct Settings {
    pub config: SessionConfig,
    /// Longest wait for a byte to move on a stream (the tokio I/O's argument; the core's
    /// settings have none).
    pub timeout: Option<std::time::Duration>,
    /// Longest a whole transfer may take from its first byte.
    pub deadline: Option<std::time::Duration>,
    /// Write each gradient's shape into its payloads (`gradient_shape`).
    pub keep_shape: bool,
    /// Take float16/bfloat16/float64 gradients and send them as they are.
    pub keep_dtype: bool,
    /// Cast every gradient to this dtype for transfer.
    pub wire_dtype: Option<WireDtype>,
}

/// The constructor's arguments as Python gave them (`GradientStreamSession(...)`).
pub struct SettingArgs<'a, 'py> {
    pub session_id: String,
    pub chunk_size: i64,
    pub max_payload_len: i64,
    pub max_gradient_len: i128,
    pub timeout: Option<&'a Bound<'py, PyAny>>,
    pub deadline: Option<&'a Bound<'py, PyAny>>,
    pub layout: &'a str,
    pub compression: Option<&'a Bound<'py, PyAny>>,
    pub keep_shape: Flag,
    pub keep_dtype: Flag,
    pub wire_dtype: Option<&'a Bound<'py, PyAny>>,
    pub seal: Flag,
    /// Hand bfloat16 gradients back as float32: Python has no bfloat16 dtype (ml_dtypes
    /// is not installed), as the Python session saw when it was made.
    pub bf16_as_f32: bool,
}

impl SettingArgs<'_, '_> {
    /// Check every argument, in the reference's order (the first refusal is raised, so a
    /// call with two bad arguments fails alike on both sides).
    pub fn parse(self, py: Python<'_>) -> PyResult<Settings> {
        let layout = layout_arg(py, self.layout)?;
        let chunk_size = usize::try_from(self.chunk_size).map_err(|_| {
            setting_error(
                py,
                "chunk_size",
                format!("chunk_size must be >= 0, got {}", self.chunk_size),
            )
        })?;
        let limits = limits_arg(py, self.max_payload_len, self.max_gradient_len)?;
        let timeout = seconds_arg(self.timeout, "timeout")?;
        let deadline = seconds_arg(self.deadline, "deadline")?;
        let compression = compression_arg(self.compression)?;
        let keep_shape = self.keep_shape.get("keep_shape")?;
        let keep_dtype = self.keep_dtype.get("keep_dtype")?;
        let wire_dtype = wire_dtype_arg(self.wire_dtype)?;
        int8_uncompressed(py, wire_dtype, compression)?;
        let seal = self.seal.get("seal")?;
        let mut config = SessionConfig::new(self.session_id, chunk_size);
        config.seal = seal;
        config.bf16_as_f32 = self.bf16_as_f32;
        config.limits = limits;
        config.layout = layout;
        config.compression = compression;
        Ok(Settings {
            config,
            timeout,
            deadline,
            keep_shape,
            keep_dtype,
            wire_dtype,
        })
    }
}

/// The `layout=` argument: "seed" or "compact".
fn layout_arg(py: Python<'_>, layout: &str) -> PyResult<Layout> {
    if let Some(known) = Layout::from_name(layout) {
        return Ok(known);
    }
    // Named by its Python repr, as the reference names it ('bad', not Rust's "bad").
    let shown = pyo3::types::PyString::new(py, layout).repr()?;
    Err(setting_error(
        py,
        "layout",
        format!(
            "layout must be 'seed' (the original's payload) or 'compact' (values only), \
             got {shown}"
        ),
    ))
}

/// The `max_payload_len=` and `max_gradient_len=` arguments, as the session's limits.
fn limits_arg(py: Python<'_>, max_payload_len: i64, max_gradient_len: i128) -> PyResult<Limits> {
    // payload_len is a u32 on the wire: no larger limit could be reached.
    let max_payload_len = positive(py, "max_payload_len", max_payload_len, |n| {
        format!("max_payload_len must be in 1..{}, got {n}", u32::MAX)
    })?;
    let max_gradient_len = positive(py, "max_gradient_len", max_gradient_len, |n| {
        format!(
            "max_gradient_len must be between 1 and {}, got {n}",
            usize::MAX
        )
    })?;
    Ok(Limits {
        max_payload_len,
        max_gradient_len,
    })
}

/// `value` as a `T` above zero, else the setting error `name` with `detail(value)`.
fn positive<T, V>(
    py: Python<'_>,
    name: &str,
    value: V,
    detail: impl FnOnce(V) -> String,
) -> PyResult<T>
where
    T: TryFrom<V> + PartialOrd + Default + Copy,
    V: Copy,
{
    T::try_from(value)
        .ok()
        .filter(|&n| n > T::default())
        .ok_or_else(|| setting_error(py, name, detail(value)))
}

/// A keyword that must be a real `bool` (None and 1 are refused). Taken as any object so
/// that the TypeError is ours, worded as the reference words it.
pub enum Flag {
    Set(bool),
    /// Something else, by its type's name.
    Not(String),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Flag {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(match obj.cast::<pyo3::types::PyBool>() {
            Ok(flag) => Self::Set(flag.is_true()),
            Err(_) => Self::Not(type_name(&obj)),
        })
    }
}

impl Flag {
    pub fn get(self, name: &str) -> PyResult<bool> {
        match self {
            Self::Set(flag) => Ok(flag),
            Self::Not(type_name) => Err(PyTypeError::new_err(format!(
                "{name} must be a bool, got {type_name}"
            ))),
        }
    }
}

/// The `compression=` argument: None or False (none), True or "lz4", "zstd".
fn compression_arg(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Compression>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    if let Ok(flag) = value.cast::<pyo3::types::PyBool>() {
        return Ok(flag.is_true().then_some(Compression::Lz4));
    }
    if let Ok(name) = value.cast::<pyo3::types::PyString>() {
        let name = name.to_cow()?;
        return Compression::from_name(&name).map(Some).ok_or_else(|| {
            setting_error(
                value.py(),
                "compression",
                format!(
                    "compression must be None, True, False, 'lz4' or 'zstd', got {}",
                    value
                        .repr()
                        .map_or_else(|_| name.to_string(), |r| r.to_string())
                ),
            )
        });
    }
    Err(PyTypeError::new_err(format!(
        "compression must be None, a bool, 'lz4' or 'zstd', got {}",
        type_name(value)
    )))
}

/// int8 payloads travel uncompressed: receivers refuse compressed list columns.
pub fn int8_uncompressed(
    py: Python<'_>,
    wire: Option<WireDtype>,
    compression: Option<Compression>,
) -> PyResult<()> {
    let (Some(WireDtype::Int8), Some(codec)) = (wire, compression) else {
        return Ok(());
    };
    Err(setting_error(
        py,
        "wire_dtype",
        format!(
            "wire_dtype='int8' does not combine with compression='{}': int8 payloads travel \
             uncompressed (receivers refuse compressed list columns); drop one of the two",
            codec.name()
        ),
    ))
}

/// The `wire_dtype=` argument: None, a dtype name or `int8`.
fn wire_dtype_arg(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<WireDtype>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    let Ok(name) = value.cast::<pyo3::types::PyString>() else {
        return Err(PyTypeError::new_err(format!(
            "wire_dtype must be None or a dtype name (str), not {}",
            type_name(value)
        )));
    };
    let name = name.to_cow()?;
    WireDtype::from_name(&name).map(Some).ok_or_else(|| {
        setting_error(
            value.py(),
            "wire_dtype",
            format!(
                "wire_dtype must be None, 'float16', 'bfloat16', 'float32', 'float64' or 'int8', \
                 got {}",
                value
                    .repr()
                    .map_or_else(|_| name.to_string(), |r| r.to_string())
            ),
        )
    })
}

/// The `timeout=` or `deadline=` argument (`name`): None, or a positive finite number of
/// seconds (named by its repr when refused, as the reference names it). Also what a
/// per-call `deadline=` is checked by.
pub fn seconds_arg(
    value: Option<&Bound<'_, PyAny>>,
    name: &str,
) -> PyResult<Option<std::time::Duration>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    // A str is refused although float() would parse it, as the reference refuses it.
    let seconds = match value.extract::<f64>() {
        Ok(seconds) if !value.is_instance_of::<pyo3::types::PyString>() => seconds,
        _ => {
            return Err(PyTypeError::new_err(format!(
                "{name} must be None or a number, not {}",
                type_name(value)
            )))
        }
    };
    if seconds.is_finite() && seconds > 0.0 {
        return Ok(Some(saturating_seconds(seconds)));
    }
    Err(setting_error(
        value.py(),
        name,
        format!(
            "{name} must be None or a positive number of seconds, got {}",
            value.repr()?
        ),
    ))
}

/// A listener's own keywords, as `gradstream._connection.listen` checked them (the
/// caps, the first byte's bound and the online-guessing limit: docs/guides/limits.md "A
/// listener under a flood"), apart from what each connection is made with (`LinkArgs`).
#[derive(FromPyObject)]
pub struct ListenerArgs {
    #[pyo3(item)]
    max_connections: usize,
    #[pyo3(item)]
    max_pending_handshakes: usize,
    #[pyo3(item)]
    max_pending_per_source: usize,
    #[pyo3(item)]
    hello_timeout: f64,
    #[pyo3(item)]
    max_auth_failures: u64,
    #[pyo3(item)]
    auth_failure_window: f64,
    /// Streams one connection may open (1 to 255, checked by `gradstream._checks`).
    #[pyo3(item)]
    max_streams: u8,
    /// How long a resumable connection's link waits for its streams to come back, in
    /// seconds (0: no resumes).
    #[pyo3(item)]
    resume_window: f64,
}

/// A listener's settings, checked.
pub struct ListenerSettings {
    pub max_connections: usize,
    pub admission: Admission,
    pub max_streams: u8,
    pub resume_window: std::time::Duration,
}

impl ListenerArgs {
    pub fn parse(self) -> ListenerSettings {
        ListenerSettings {
            max_connections: self.max_connections,
            max_streams: self.max_streams,
            resume_window: saturating_seconds(self.resume_window),
            admission: Admission {
                max_pending_handshakes: self.max_pending_handshakes,
                max_pending_per_source: self.max_pending_per_source,
                hello_timeout: saturating_seconds(self.hello_timeout),
                max_auth_failures: u32::try_from(self.max_auth_failures).unwrap_or(u32::MAX),
                auth_failure_window: saturating_seconds(self.auth_failure_window),
            },
        }
    }
}

/// Positive, finite seconds (as `listen` checked them) as a `Duration`, the longest one
/// past its range: `from_secs_f64` panics on 1e300.
pub(crate) fn saturating_seconds(seconds: f64) -> std::time::Duration {
    std::time::Duration::try_from_secs_f64(seconds).unwrap_or(std::time::Duration::MAX)
}
