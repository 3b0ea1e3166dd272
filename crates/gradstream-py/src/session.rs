//! `gradstream.GradientStreamSession`: argument conversion around `SessionConfig`, with the
//! GIL released for every pass over gradient data.
//!
//! Uses `settings` (the constructor's keywords), `convert` (gradients in, values out),
//! `stream` (sockets, progress, the asyncio encoder and receiver), `complete`, `chunk`,
//! `buffers` and `errors`; nothing in this crate uses it but `lib.rs`.

use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::buffers::{vec_to_pyarrow, ReadBuffer, WritableBytes};
use super::chunk::{HeldChunk, PyChunk};
use super::complete::Outcome;
use super::convert::{dtypes_attr, gradient_array, values_array, HeldGradient, Input, LentArray};
use super::errors::IntoPyResult;
use super::settings::{new_config, Flag, SettingArgs, Settings};
use super::stream::{
    aio, progress_counters, run_on_loop, FrameEncoder, PyFrameReceiver, SocketStream,
    TransferProgress,
};
use gradstream_core::codec::Compression;
use gradstream_core::dtype::Dtype;
use gradstream_core::encoder::{Gradient, GradientMeta};
use gradstream_core::frame::{DEFAULT_MAX_GRADIENT_LEN, DEFAULT_MAX_PAYLOAD_LEN};
use gradstream_core::receiver::Ended;
use gradstream_core::session::{SessionConfig, DEFAULT_CHUNK_SIZE};
use gradstream_core::shape::shape_text;
use gradstream_core::stream::{receive_gradient, send_gradient};

/// `gradstream._tensors.<name>`: the tensor-set layer, shared with the reference.
fn tensors_fn<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("gradstream._tensors")?.getattr(name)
}

#[pyclass(name = "GradientStreamSession", module = "gradstream", frozen)]
pub struct PySession {
    config: SessionConfig,
    /// Longest wait for a byte to move on a stream; None waits for ever.
    timeout: Option<std::time::Duration>,
    /// Write each gradient's shape into its payloads (`gradient_shape`).
    keep_shape: bool,
    /// Take float16/bfloat16/float64 gradients and send them as they are.
    keep_dtype: bool,
    /// Cast every gradient to this dtype for transfer.
    wire_dtype: Option<Dtype>,
}

impl From<Settings> for PySession {
    fn from(settings: Settings) -> Self {
        Self {
            config: settings.config,
            timeout: settings.timeout,
            keep_shape: settings.keep_shape,
            keep_dtype: settings.keep_dtype,
            wire_dtype: settings.wire_dtype,
        }
    }
}

impl PySession {
    /// Take a gradient as this session's settings say (README "Dtypes"): float32 alone by
    /// default (read in place when it can be), else through gradstream._dtypes.prepare,
    /// shared with the reference, which also makes the wire cast.
    fn input<'py>(&self, obj: &Bound<'py, PyAny>) -> PyResult<Input<'py>> {
        let py = obj.py();
        let mut meta = GradientMeta::default();
        let mut wire_cast = None;
        let (values, dtype) = if !self.keep_dtype && self.wire_dtype.is_none() {
            (gradient_array(obj)?.as_any().clone(), Dtype::F32)
        } else {
            let kwargs = pyo3::types::PyDict::new(py);
            kwargs.set_item("keep_dtype", self.keep_dtype)?;
            kwargs.set_item("wire_dtype", self.wire_dtype.map(Dtype::name))?;
            // The cast is ours, chunk by chunk as the frames are encoded (gradstream-core's dtype.rs).
            kwargs.set_item("cast_here", false)?;
            let prepared = dtypes_attr(py, "prepare")?.call((obj,), Some(&kwargs))?;
            let (values, wire, result, source): (Bound<'py, PyAny>, String, String, String) =
                prepared.extract()?;
            let dtype_named = |name: &str| {
                Dtype::from_name(name)
                    .ok_or_else(|| PyTypeError::new_err(format!("unknown dtype {name:?}")))
            };
            let (wire, source) = (dtype_named(&wire)?, dtype_named(&source)?);
            meta.result = Dtype::from_name(&result).filter(|&r| r != wire);
            wire_cast = Some(wire);
            (values, source)
        };
        if self.keep_shape {
            let shape: Vec<usize> = values.getattr("shape")?.extract()?;
            meta.shape = Some(shape_text(&shape).into());
        }
        // The values' memory as bytes: a view (the array is C-contiguous).
        let bytes = values
            .call_method1("reshape", (-1,))?
            .call_method1("view", ("uint8",))?
            .cast_into::<PyArray1<u8>>()?
            .try_readonly()?;
        Ok(Input {
            bytes,
            dtype,
            wire: wire_cast.unwrap_or(dtype),
            meta,
        })
    }
}

#[pymethods]
impl PySession {
    #[new]
    #[pyo3(
        signature = (
            session_id,
            chunk_size = DEFAULT_CHUNK_SIZE as i64,
            *,
            max_payload_len = DEFAULT_MAX_PAYLOAD_LEN as i64,
            max_gradient_len = DEFAULT_MAX_GRADIENT_LEN as i128,
            timeout = None,
            layout = "seed",
            compression = None,
            keep_shape = Flag::Set(false),
            keep_dtype = Flag::Set(false),
            wire_dtype = None,
        ),
        text_signature = "(session_id, chunk_size=65536, *, max_payload_len=268435456, \
                          max_gradient_len=1073741824, timeout=None, layout='seed', \
                          compression=None, keep_shape=False, keep_dtype=False, \
                          wire_dtype=None)"
    )]
    // The constructor's keywords are the session's settings, one argument each.
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        session_id: String,
        chunk_size: i64,
        max_payload_len: i64,
        max_gradient_len: i128,
        timeout: Option<&Bound<'_, PyAny>>,
        layout: &str,
        compression: Option<&Bound<'_, PyAny>>,
        keep_shape: Flag,
        keep_dtype: Flag,
        wire_dtype: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let args = SettingArgs {
            session_id,
            chunk_size,
            max_payload_len,
            max_gradient_len,
            timeout,
            layout,
            compression,
            keep_shape,
            keep_dtype,
            wire_dtype,
        };
        Ok(args.parse(py)?.into())
    }

    /// A session with the default chunk size (65,536 values).
    #[staticmethod]
    fn with_defaults(py: Python<'_>, session_id: String) -> PyResult<Self> {
        Ok(Self {
            config: new_config(py, session_id, DEFAULT_CHUNK_SIZE)?,
            timeout: None,
            keep_shape: false,
            keep_dtype: false,
            wire_dtype: None,
        })
    }

    /// A new session, the same but for compression: "lz4" when enabled, else none.
    fn with_compression(&self, enabled: bool) -> Self {
        let mut config = self.config.clone();
        config.compression = enabled.then_some(Compression::Lz4);
        Self {
            config,
            timeout: self.timeout,
            keep_shape: self.keep_shape,
            keep_dtype: self.keep_dtype,
            wire_dtype: self.wire_dtype,
        }
    }

    /// Whether float16, bfloat16 and float64 gradients travel (and come back) as they are.
    #[getter]
    fn keep_dtype(&self) -> bool {
        self.keep_dtype
    }

    /// The dtype every gradient is cast to for transfer, or None.
    #[getter]
    fn wire_dtype(&self) -> Option<&'static str> {
        self.wire_dtype.map(Dtype::name)
    }

    /// Whether each gradient's shape travels with it (and comes back reshaped).
    #[getter]
    fn keep_shape(&self) -> bool {
        self.keep_shape
    }

    fn is_compression_enabled(&self) -> bool {
        self.config.compression.is_some()
    }

    /// None, "lz4" or "zstd": the payload compression this session writes.
    #[getter]
    fn compression(&self) -> Option<&'static str> {
        self.config.compression.map(Compression::name)
    }

    #[getter]
    fn session_id(&self) -> &str {
        &self.config.session_id
    }

    #[getter]
    fn chunk_size(&self) -> usize {
        self.config.chunk_size
    }

    #[getter]
    fn max_payload_len(&self) -> u32 {
        self.config.limits.max_payload_len
    }

    #[getter]
    fn max_gradient_len(&self) -> usize {
        self.config.limits.max_gradient_len
    }

    /// "seed" (index + value columns, as the original) or "compact" (values only).
    #[getter]
    fn layout(&self) -> &'static str {
        self.config.layout.name()
    }

    #[getter]
    fn timeout(&self) -> Option<f64> {
        self.timeout.map(|t| t.as_secs_f64())
    }

    /// Send one gradient over a socket or asyncio stream; awaits the number of chunks.
    #[pyo3(signature = (gradient, stream, *, progress = None))]
    fn stream_to<'py>(
        slf: &Bound<'py, Self>,
        gradient: &Bound<'py, PyAny>,
        stream: &Bound<'py, PyAny>,
        progress: Option<&Bound<'py, TransferProgress>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let counters = progress_counters(progress);
        if let Some(socket) = SocketStream::from_py(stream)? {
            let input = slf.get().input(gradient)?;
            let gradient = HeldGradient::new(&input)?;
            let (config, timeout) = (slf.get().config.clone(), slf.get().timeout);
            return run_on_loop(slf.py(), async move {
                let mut io = socket.open()?;
                send_gradient(&config, gradient.gradient(), &mut io, timeout, &counters)
                    .await
                    .map(Outcome::Chunks)
            });
        }
        aio(slf.py(), "stream_to")?.call1((slf, gradient, stream, progress))
    }

    /// Receive one gradient from a socket or asyncio stream; awaits a float32 array (`out`
    /// itself, filled, when given).
    #[pyo3(signature = (stream, *, progress = None, out = None))]
    fn receive_from<'py>(
        slf: &Bound<'py, Self>,
        stream: &Bound<'py, PyAny>,
        progress: Option<&Bound<'py, TransferProgress>>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::_receive(slf, stream, progress, false, out)
    }

    /// Receive gradients until the peer closes the connection between two of them.
    #[pyo3(signature = (stream, *, progress = None))]
    fn receive_iter<'py>(
        slf: &Bound<'py, Self>,
        stream: &Bound<'py, PyAny>,
        progress: Option<&Bound<'py, TransferProgress>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        aio(slf.py(), "receive_iter")?.call1((slf, stream, progress))
    }

    /// One gradient, or None when the stream ended before its first byte (`receive_iter`
    /// ends there; `receive_from` gives an empty array, as the original does).
    #[pyo3(signature = (stream, progress = None, none_at_end = true, out = None))]
    fn _receive<'py>(
        slf: &Bound<'py, Self>,
        stream: &Bound<'py, PyAny>,
        progress: Option<&Bound<'py, TransferProgress>>,
        none_at_end: bool,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let counters = progress_counters(progress);
        let lent = out.map(LentArray::new).transpose()?;
        let (config, timeout) = (slf.get().config.clone(), slf.get().timeout);
        if let Some(socket) = SocketStream::from_py(stream)? {
            return run_on_loop(slf.py(), async move {
                let (receiver, owner) = match lent {
                    Some(lent) => (config.receiver_into(lent.slice), Some(lent.owner)),
                    None => (config.receiver(), None),
                };
                let mut io = socket.open()?;
                let ended = receive_gradient(receiver, &mut io, timeout, &counters).await?;
                let values = match ended {
                    Ended::Gradient(values) => values,
                    Ended::BeforeFirstByte(_) if none_at_end => return Ok(Outcome::End),
                    // "No network": the empty gradient (which must fit `out`).
                    Ended::BeforeFirstByte(receiver) => receiver.finish()?,
                };
                Ok(match owner {
                    Some(owner) => Outcome::Filled(owner),
                    None => Outcome::Values(values),
                })
            });
        }
        let receiver = Bound::new(slf.py(), PyFrameReceiver::new(&config, counters, lent))?;
        aio(slf.py(), "receive")?.call1((slf, stream, receiver, none_at_end))
    }

    /// The frames of a gradient one at a time (the asyncio-streams sender).
    #[pyo3(signature = (gradient, progress = None))]
    fn _frame_encoder(
        &self,
        gradient: &Bound<'_, PyAny>,
        progress: Option<&Bound<'_, TransferProgress>>,
    ) -> PyResult<FrameEncoder> {
        FrameEncoder::new(
            self.config.clone(),
            self.input(gradient)?,
            progress_counters(progress),
        )
    }

    /// Split a gradient into Arrow IPC chunks, each with its CRC-32.
    fn encode_gradient(
        &self,
        py: Python<'_>,
        gradient: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<PyChunk>> {
        let input = self.input(gradient)?;
        let config = &self.config;
        let values = input.gradient()?;
        let plan = py.detach(|| config.plan_frames(values)).py_err(py)?;
        plan.chunks()
            .map(|(index, window, len)| {
                // Each payload is encoded straight into its `bytes`, with the GIL released.
                let mut checksum = 0;
                let payload = PyBytes::new_with(py, len as usize, |out| {
                    checksum = py
                        .detach(|| config.write_chunk(&plan, index, window, out))
                        .py_err(py)?;
                    Ok(())
                })?;
                Ok(PyChunk {
                    session_id: self.config.session_id.clone(),
                    chunk_index: index,
                    total_chunks: plan.total_chunks(),
                    checksum,
                    payload: payload.into(),
                })
            })
            .collect()
    }

    /// Reassemble chunks given in any order into a float32 array.
    fn decode_chunks<'py>(
        &self,
        py: Python<'py>,
        chunks: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let held = chunks
            .try_iter()?
            .map(|item| HeldChunk::from_py(&item?))
            .collect::<PyResult<Vec<_>>>()?;
        let config = &self.config;
        let values = py
            .detach(|| config.decode_chunks_output(held.iter().map(HeldChunk::as_ref).collect()))
            .py_err(py)?;
        values_array(py, values)
    }

    /// Bytes of the frames of a gradient of `n_values` values.
    fn frames_len(&self, py: Python<'_>, n_values: i64) -> PyResult<usize> {
        let n = usize::try_from(n_values)
            .map_err(|_| PyValueError::new_err(format!("n_values must be >= 0, got {n_values}")))?;
        if self.config.compression.is_some() {
            return Err(PyValueError::new_err(
                "frames_len is not known in advance for a compressed session: payload sizes \
                 depend on the values",
            ));
        }
        if self.keep_shape {
            return Err(PyValueError::new_err(
                "frames_len is not known in advance when keep_shape is set: the shape \
                 metadata's size depends on the shape",
            ));
        }
        if self.keep_dtype {
            return Err(PyValueError::new_err(
                "frames_len is not known in advance when keep_dtype is set: payload sizes \
                 depend on the gradient's dtype",
            ));
        }
        if let Some(wire) = self.wire_dtype.filter(|&d| d != Dtype::F32) {
            return Err(PyValueError::new_err(format!(
                "frames_len is not known in advance when wire_dtype is '{}': only float32 \
                 payload sizes are computed",
                wire.name()
            )));
        }
        self.config.frames_len(n).py_err(py)
    }

    /// The frames `stream_to` writes, as `bytes` (or a `pyarrow.Buffer` with no copy), or
    /// written into `out` (then the number of bytes written).
    #[pyo3(signature = (gradient, as_buffer = false, *, out = None))]
    fn encode_frames<'py>(
        &self,
        py: Python<'py>,
        gradient: &Bound<'py, PyAny>,
        as_buffer: bool,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if as_buffer && out.is_some() {
            return Err(PyValueError::new_err(
                "as_buffer=True and out= exclude each other: out= is the buffer",
            ));
        }
        let input = self.input(gradient)?;
        let config = &self.config;
        let values = input.gradient()?;
        if let Some(out) = out {
            let mut target = WritableBytes::new(out)?;
            let frames = target.as_mut_slice().as_ptr_range();
            let read = values.raw().as_ptr_range();
            let (read_start, read_end) = (read.start, read.end);
            if read_start < frames.end && frames.start < read_end {
                return Err(PyValueError::new_err(
                    "out= overlaps the gradient's memory: the frames would overwrite values \
                     before they are read",
                ));
            }
            let plan = py.detach(|| config.plan_frames(values)).py_err(py)?;
            let room = target.as_mut_slice().len();
            let Some(frames) = target.as_mut_slice().get_mut(..plan.len()) else {
                return Err(PyValueError::new_err(format!(
                    "out= holds {room} bytes; the frames of {} values take {}",
                    values.len(),
                    plan.len()
                )));
            };
            py.detach(|| config.write_frames(&plan, frames))
                .py_err(py)?;
            return Ok(plan.len().into_pyobject(py)?.into_any());
        }
        if as_buffer {
            let wire = py.detach(|| config.encode_frames(values)).py_err(py)?;
            return vec_to_pyarrow(py, wire);
        }
        // Size the `bytes` exactly, then encode straight into it with the GIL released: the
        // object is ours alone until it is returned, and no second copy of the stream exists.
        let plan = py.detach(|| config.plan_frames(values)).py_err(py)?;
        let wire = PyBytes::new_with(py, plan.len(), |out| {
            py.detach(|| config.write_frames(&plan, out)).py_err(py)
        })?;
        Ok(wire.into_any())
    }

    /// Parse a byte stream holding exactly one gradient's frames (into `out`, when given).
    #[pyo3(signature = (data, *, out = None))]
    fn decode_frames<'py>(
        &self,
        py: Python<'py>,
        data: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let lent = out.map(LentArray::new).transpose()?;
        let bytes = ReadBuffer::get(data)?;
        let config = &self.config;
        if let Some(lent) = lent {
            // The OutSlice points into the array `lent.owner` keeps alive for the call.
            py.detach(|| config.decode_frames_lent(bytes.as_slice(), lent.slice))
                .py_err(py)?;
            return Ok(lent.owner.into_bound(py));
        }
        let values = py
            .detach(|| config.decode_frames_output(bytes.as_slice()))
            .py_err(py)?;
        values_array(py, values)
    }

    /// The frames of a tensor set's manifest: an empty gradient whose payload carries
    /// `text` as its `gradstream_tensors` metadata (used by gradstream._tensors).
    fn _encode_manifest<'py>(&self, py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyBytes>> {
        let meta = GradientMeta {
            manifest: Some(text.into()),
            ..GradientMeta::default()
        };
        let nothing = Gradient::from(&[][..]).with_meta(&meta);
        let wire = self.config.encode_frames(nothing).py_err(py)?;
        Ok(PyBytes::new(py, &wire))
    }

    /// Decode frames as `decode_frames` does; the first chunk's `gradstream_tensors`
    /// metadata (None without one) and the number of values.
    fn _decode_manifest(
        &self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<(Option<String>, usize)> {
        let bytes = ReadBuffer::get(data)?;
        let config = &self.config;
        let values = py
            .detach(|| config.decode_frames_output(bytes.as_slice()))
            .py_err(py)?;
        let n = values.len();
        Ok((values.manifest, n))
    }

    /// A named set of tensors as frames (README "Tensor sets").
    #[pyo3(signature = (tensors, as_buffer = false))]
    fn encode_tensors<'py>(
        slf: &Bound<'py, Self>,
        tensors: &Bound<'py, PyAny>,
        as_buffer: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        tensors_fn(slf.py(), "encode_tensors")?.call1((slf, tensors, as_buffer))
    }

    /// The named tensors of a set's frames, in the sender's order.
    fn decode_tensors<'py>(
        slf: &Bound<'py, Self>,
        data: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        tensors_fn(slf.py(), "decode_tensors")?.call1((slf, data))
    }

    /// Send a named set of tensors; awaits the number of frames written.
    #[pyo3(signature = (tensors, stream, *, progress = None))]
    fn stream_tensors<'py>(
        slf: &Bound<'py, Self>,
        tensors: &Bound<'py, PyAny>,
        stream: &Bound<'py, PyAny>,
        progress: Option<&Bound<'py, TransferProgress>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kwargs = pyo3::types::PyDict::new(slf.py());
        kwargs.set_item("progress", progress)?;
        tensors_fn(slf.py(), "stream_tensors")?.call((slf, tensors, stream), Some(&kwargs))
    }

    /// Receive a named set of tensors; awaits a dict in the sender's order.
    #[pyo3(signature = (stream, *, progress = None))]
    fn receive_tensors<'py>(
        slf: &Bound<'py, Self>,
        stream: &Bound<'py, PyAny>,
        progress: Option<&Bound<'py, TransferProgress>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kwargs = pyo3::types::PyDict::new(slf.py());
        kwargs.set_item("progress", progress)?;
        tensors_fn(slf.py(), "receive_tensors")?.call((slf, stream), Some(&kwargs))
    }

    fn __repr__(&self) -> String {
        let c = &self.config;
        format!(
            "GradientStreamSession(session_id={:?}, chunk_size={}, max_payload_len={}, \
             max_gradient_len={}, timeout={}, layout={:?}, compression={}, keep_shape={}, \
             keep_dtype={}, wire_dtype={})",
            c.session_id,
            c.chunk_size,
            c.limits.max_payload_len,
            c.limits.max_gradient_len,
            self.timeout
                .map_or_else(|| "None".to_string(), |t| t.as_secs_f64().to_string()),
            c.layout.name(),
            c.compression
                .map_or_else(|| "None".to_string(), |c| format!("'{}'", c.name())),
            if self.keep_shape { "True" } else { "False" },
            if self.keep_dtype { "True" } else { "False" },
            self.wire_dtype
                .map_or_else(|| "None".to_string(), |d| format!("'{}'", d.name()))
        )
    }
}
