//! `gradstream._native.Engine`: one session's settings (the core's `SessionConfig`, the
//! timeout, and what the Python session needs to take gradients: keep_shape, keep_dtype,
//! wire_dtype) and every native operation on them, each called once per public call by
//! `gradstream/_session.py`, with plain arguments: gradients as `GradientArgs`, `out=` as
//! checked bytes, sockets already checked. The GIL is released for every pass over
//! gradient data; nothing here calls back into the package's Python modules.
//!
//! Uses `settings` (the constructor's keywords), `convert` (gradients in, `out=`, values
//! out), `stream` (sockets, progress, the asyncio encoder and receiver), `fastpath` (the
//! socket transfers of small gradients), `complete`, `chunk`, `buffers` and `errors`;
//! used by `lib.rs` and `connection` (a link's settings), never the other way.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use super::buffers::{new_bytes_with, vec_to_pyarrow, ReadBuffer, WritableBytes};
use super::chunk::{HeldChunk, PyChunk};
use super::complete::{Completions, Outcome};
use super::convert::{values_tuple, GradientArgs, HeldGradient, Input, OutArgs};
use super::errors::IntoPyResult;
use super::fastpath::{self, SocketReceive};
use super::settings::{int8_uncompressed, seconds_arg, Flag, SettingArgs, Settings};
use super::stream::{
    progress_counters, Drivers, FrameEncoder, PyFrameReceiver, SocketStream, TransferProgress,
};
use super::tensors::{
    check_names, doing_named, set_list, HeldTensors, PyTensorSetReceiver, TensorArgs,
    TensorFrameEncoder,
};
use gradstream_core::codec::Compression;
use gradstream_core::dtype::{Dtype, WireDtype};
use gradstream_core::encoder::{Gradient, GradientMeta};
use gradstream_core::session::SessionConfig;
use gradstream_core::stream::{send_gradient, Waits};
use gradstream_core::tensors;

#[pyclass(name = "Engine", module = "gradstream._native", frozen)]
pub struct Engine {
    config: SessionConfig,
    /// Longest wait for a byte to move on a stream; None waits for ever.
    timeout: Option<std::time::Duration>,
    /// Longest a transfer may take from its first byte (a call's `deadline=` overrides it).
    deadline: Option<std::time::Duration>,
    /// Write each gradient's shape into its payloads (`gradient_shape`).
    keep_shape: bool,
    /// Take float16/bfloat16/float64 gradients and send them as they are.
    keep_dtype: bool,
    /// Cast every gradient to this dtype (or the int8 wire) for transfer.
    wire_dtype: Option<WireDtype>,
    drivers: Drivers,
}

impl From<Settings> for Engine {
    fn from(settings: Settings) -> Self {
        Self {
            config: settings.config,
            timeout: settings.timeout,
            deadline: settings.deadline,
            keep_shape: settings.keep_shape,
            keep_dtype: settings.keep_dtype,
            wire_dtype: settings.wire_dtype,
            drivers: Drivers::default(),
        }
    }
}

impl Engine {
    /// The session's settings (a connection's transfers use them).
    pub(crate) fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// The dtype every gradient is cast to for transfer, if any.
    pub(crate) fn wire(&self) -> Option<WireDtype> {
        self.wire_dtype
    }

    pub(crate) fn drivers(&self) -> Drivers {
        self.drivers
    }

    /// The waits of one transfer: the session's timeout, and the call's deadline (checked
    /// as the setting is) or else the session's.
    fn waits(&self, deadline: Option<&Bound<'_, PyAny>>) -> PyResult<Waits> {
        Ok(Waits {
            timeout: self.timeout,
            deadline: seconds_arg(deadline, "deadline")?.or(self.deadline),
        })
    }

    /// These settings but for `config` and `drivers`.
    fn with(&self, config: SessionConfig, drivers: Drivers) -> Self {
        Self {
            config,
            timeout: self.timeout,
            deadline: self.deadline,
            keep_shape: self.keep_shape,
            keep_dtype: self.keep_dtype,
            wire_dtype: self.wire_dtype,
            drivers,
        }
    }

    /// Why the frames' length is not known before encoding, if it is not.
    fn sizes_unknown(&self) -> Option<String> {
        if self.config.compression.is_some() {
            return Some(
                "frames_len is not known in advance for a compressed session: payload sizes \
                 depend on the values"
                    .into(),
            );
        }
        if self.keep_shape {
            return Some(
                "frames_len is not known in advance when keep_shape is set: the shape \
                 metadata's size depends on the shape"
                    .into(),
            );
        }
        if self.keep_dtype {
            return Some(
                "frames_len is not known in advance when keep_dtype is set: payload sizes \
                 depend on the gradient's dtype"
                    .into(),
            );
        }
        self.wire_dtype
            .filter(|&d| d != WireDtype::Float(Dtype::F32))
            .map(|wire| {
                format!(
                    "frames_len is not known in advance when wire_dtype is '{}': only float32 \
                 payload sizes are computed",
                    wire.name()
                )
            })
    }

    /// `encode_frames(gradient, out=out)`: the frames written into the caller's buffer.
    fn encode_frames_into(
        &self,
        py: Python<'_>,
        input: &Input<'_>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let config = &self.config;
        let values = input.gradient()?;
        let mut target = WritableBytes::new(out)?;
        let frames = target.as_mut_slice().as_ptr_range();
        let read = values.raw().as_ptr_range();
        if read.start < frames.end && frames.start < read.end {
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
        Ok(plan.len())
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (
        session_id, chunk_size, *, max_payload_len, max_gradient_len, timeout, deadline,
        layout, compression, keep_shape, keep_dtype, wire_dtype, seal,
        bf16_as_f32,
    ))]
    // The constructor's keywords are the session's settings, one argument each.
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        session_id: String,
        chunk_size: i64,
        max_payload_len: i64,
        max_gradient_len: i128,
        timeout: Option<&Bound<'_, PyAny>>,
        deadline: Option<&Bound<'_, PyAny>>,
        layout: &str,
        compression: Option<&Bound<'_, PyAny>>,
        keep_shape: Flag,
        keep_dtype: Flag,
        wire_dtype: Option<&Bound<'_, PyAny>>,
        seal: Flag,
        bf16_as_f32: bool,
    ) -> PyResult<Self> {
        let args = SettingArgs {
            session_id,
            chunk_size,
            max_payload_len,
            max_gradient_len,
            timeout,
            deadline,
            layout,
            compression,
            keep_shape,
            keep_dtype,
            wire_dtype,
            seal,
            bf16_as_f32,
        };
        Ok(args.parse(py)?.into())
    }

    /// The same settings but for compression: "lz4" when enabled, else none.
    fn with_compression(&self, py: Python<'_>, enabled: bool) -> PyResult<Self> {
        let mut config = self.config.clone();
        config.compression = enabled.then_some(Compression::Lz4);
        int8_uncompressed(py, self.wire_dtype, config.compression)?;
        Ok(self.with(config, self.drivers))
    }

    /// The same settings, with only the drivers said (the benchmark's seam: every
    /// driver is on otherwise).
    fn with_drivers(&self, caller_thread: bool) -> Self {
        let drivers = Drivers { caller_thread };
        self.with(self.config.clone(), drivers)
    }

    #[getter]
    fn keep_dtype(&self) -> bool {
        self.keep_dtype
    }

    #[getter]
    fn wire_dtype(&self) -> Option<&'static str> {
        self.wire_dtype.map(WireDtype::name)
    }

    #[getter]
    fn keep_shape(&self) -> bool {
        self.keep_shape
    }

    /// Whether each gradient (or set) is sealed with a fresh random transfer id, and
    /// receivers expect every chunk sealed alike (docs/spec/wire-format.md).
    #[getter]
    fn seal(&self) -> bool {
        self.config.seal
    }

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

    #[getter]
    fn layout(&self) -> &'static str {
        self.config.layout.name()
    }

    #[getter]
    fn timeout(&self) -> Option<f64> {
        self.timeout.map(|t| t.as_secs_f64())
    }

    #[getter]
    fn deadline(&self) -> Option<f64> {
        self.deadline.map(|t| t.as_secs_f64())
    }

    /// Send one gradient over a checked stream socket under the loop's `completions`:
    /// `(True, chunks)` when it all went at once from this thread (a small one), else
    /// `(False, job)` (the job's result: the number of chunks).
    #[pyo3(signature = (completions, gradient, socket, progress, deadline))]
    fn stream_to_socket(
        &self,
        completions: &Bound<'_, Completions>,
        gradient: GradientArgs<'_>,
        socket: &Bound<'_, PyAny>,
        progress: Option<&Bound<'_, TransferProgress>>,
        deadline: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(bool, u64)> {
        let counters = progress_counters(progress);
        let waits = self.waits(deadline)?;
        let input = Input::try_from(gradient)?;
        let config = &self.config;
        if self.drivers.caller_thread {
            let sent = fastpath::send(config, completions, &input, socket, &counters, waits)?;
            if let Some(sent) = sent {
                return Ok(sent.into());
            }
        }
        let socket = SocketStream::from_socket(socket)?;
        let gradient = HeldGradient::new(&input)?;
        let config = self.config.clone();
        let job = completions.get().spawn(async move {
            let mut io = socket.open()?;
            send_gradient(&config, gradient.gradient(), &mut io, waits, &counters)
                .await
                .map(Outcome::Chunks)
        });
        Ok((false, job))
    }

    /// Receive one gradient from a checked stream socket: a `SocketReceive` to poll
    /// (tried on this thread first, then under the loop's `completions`). Its result: the
    /// values tuple, `out`'s bytes when `out` was given, or None when the stream ended
    /// before its first byte and `none_at_end` (else the empty gradient, as the
    /// original's "no network").
    #[pyo3(signature = (socket, progress, none_at_end, out, deadline))]
    fn receive_from_socket(
        &self,
        socket: &Bound<'_, PyAny>,
        progress: Option<&Bound<'_, TransferProgress>>,
        none_at_end: bool,
        out: Option<OutArgs<'_>>,
        deadline: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<SocketReceive> {
        let counters = progress_counters(progress);
        let waits = self.waits(deadline)?;
        // Checked now, as before any byte moves; lent afresh to each receiver.
        let out = match out {
            Some(out) => Some(out.checked()?),
            None => None,
        };
        let config = self.config.clone();
        Ok(SocketReceive::new(
            config,
            self.drivers,
            socket,
            counters,
            waits,
            none_at_end,
            out,
        ))
    }

    /// The frames of a gradient one at a time (the asyncio-streams sender).
    #[pyo3(signature = (gradient, progress, deadline))]
    fn frame_encoder(
        &self,
        gradient: GradientArgs<'_>,
        progress: Option<&Bound<'_, TransferProgress>>,
        deadline: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<FrameEncoder> {
        let waits = self.waits(deadline)?;
        FrameEncoder::new(
            self.config.clone(),
            Input::try_from(gradient)?,
            progress_counters(progress),
            waits,
        )
    }

    /// A receiver for one gradient fed by the asyncio-streams reader.
    #[pyo3(signature = (progress, out, deadline))]
    fn frame_receiver(
        &self,
        progress: Option<&Bound<'_, TransferProgress>>,
        out: Option<OutArgs<'_>>,
        deadline: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyFrameReceiver> {
        let waits = self.waits(deadline)?;
        let lent = out.as_ref().map(OutArgs::lend).transpose()?;
        Ok(PyFrameReceiver::new(
            &self.config,
            progress_counters(progress),
            lent,
            waits,
        ))
    }

    /// Split a gradient into Arrow IPC chunks, each with its CRC-32.
    fn encode_gradient(
        &self,
        py: Python<'_>,
        gradient: GradientArgs<'_>,
    ) -> PyResult<Vec<PyChunk>> {
        let input = Input::try_from(gradient)?;
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

    /// Reassemble chunks given in any order; the values tuple.
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
        values_tuple(py, values)
    }

    /// Bytes of the frames of a gradient of `n_values` values.
    fn frames_len(&self, py: Python<'_>, n_values: i64) -> PyResult<usize> {
        let n = usize::try_from(n_values)
            .map_err(|_| PyValueError::new_err(format!("n_values must be >= 0, got {n_values}")))?;
        if let Some(why) = self.sizes_unknown() {
            return Err(PyValueError::new_err(why));
        }
        self.config.frames_len(n).py_err(py)
    }

    /// The frames `stream_to` writes, as `bytes` (or a `pyarrow.Buffer` with no copy), or
    /// written into `out` (a checked writeable buffer; then the number of bytes written).
    #[pyo3(signature = (gradient, as_buffer, out))]
    fn encode_frames<'py>(
        &self,
        py: Python<'py>,
        gradient: GradientArgs<'py>,
        as_buffer: bool,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let input = Input::try_from(gradient)?;
        if let Some(out) = out {
            let written = self.encode_frames_into(py, &input, out)?;
            return Ok(written.into_pyobject(py)?.into_any());
        }
        let config = &self.config;
        let values = input.gradient()?;
        if as_buffer {
            let wire = py.detach(|| config.encode_frames(values)).py_err(py)?;
            return vec_to_pyarrow(py, wire);
        }
        // Size the `bytes` exactly, then encode straight into its fresh memory with the GIL
        // released: the object is ours alone until it is returned, and no second copy of
        // the stream exists.
        let plan = py.detach(|| config.plan_frames(values)).py_err(py)?;
        let wire = new_bytes_with(py, plan.len(), |out| {
            py.detach(|| config.write_new_frames(&plan, out)).py_err(py)
        })?;
        Ok(wire.into_any())
    }

    /// Parse a byte stream holding exactly one gradient's frames: the values tuple, or
    /// None once they are written into `out`.
    #[pyo3(signature = (data, out))]
    fn decode_frames<'py>(
        &self,
        py: Python<'py>,
        data: &Bound<'py, PyAny>,
        out: Option<OutArgs<'py>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let lent = out.as_ref().map(OutArgs::lend).transpose()?;
        let bytes = ReadBuffer::get(data)?;
        let config = &self.config;
        if let Some(lent) = lent {
            // The OutSlice points into the array `lent.owner` keeps alive for the call.
            py.detach(|| config.decode_frames_lent(bytes.as_slice(), lent.slice))
                .py_err(py)?;
            return Ok(None);
        }
        let values = py
            .detach(|| config.decode_frames_output(bytes.as_slice()))
            .py_err(py)?;
        values_tuple(py, values).map(Some)
    }

    /// Check a tensor set's names (str, UTF-8, the core's rules) before any tensor is
    /// converted.
    fn check_tensor_names(&self, names: &Bound<'_, PyList>) -> PyResult<()> {
        check_names(names)
    }

    /// The checks `encode_tensors` makes first, on the tensors of a set of `of` converted
    /// so far: the first error among them, noted with `doing` ("encoding" or "sending").
    fn check_tensors(
        &self,
        py: Python<'_>,
        tensors: Vec<TensorArgs<'_>>,
        doing: &str,
        of: usize,
    ) -> PyResult<()> {
        let held = HeldTensors::new(tensors)?;
        let doing = doing_named(doing)?;
        tensors::encode::check_first_tensors(&held.gradients(), doing, of).py_err(py)
    }

    /// A tensor set's frames, as `bytes` or a `pyarrow.Buffer`.
    fn encode_tensors<'py>(
        &self,
        py: Python<'py>,
        tensors: Vec<TensorArgs<'py>>,
        as_buffer: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let held = HeldTensors::new(tensors)?;
        let (config, wire) = (&self.config, self.wire_dtype);
        let frames = py
            .detach(|| tensors::encode_tensors(config, wire, &held.gradients()))
            .py_err(py)?;
        if as_buffer {
            return vec_to_pyarrow(py, frames);
        }
        Ok(PyBytes::new(py, &frames).into_any())
    }

    /// The tensors of a set's frames: `[(name, values tuple), ...]` in the sender's order.
    fn decode_tensors<'py>(
        &self,
        py: Python<'py>,
        data: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let bytes = ReadBuffer::get(data)?;
        let config = &self.config;
        let set = py
            .detach(|| tensors::decode_tensors(config, bytes.as_slice()))
            .py_err(py)?;
        set_list(py, set)
    }

    /// Send a tensor set over a checked stream socket; the job number (its result: the
    /// frames written, the manifest's included).
    fn stream_tensors_socket(
        &self,
        completions: &Bound<'_, Completions>,
        tensors: Vec<TensorArgs<'_>>,
        socket: &Bound<'_, PyAny>,
        progress: Option<&Bound<'_, TransferProgress>>,
        deadline: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let counters = progress_counters(progress);
        let waits = self.waits(deadline)?;
        let socket = SocketStream::from_socket(socket)?;
        let held = HeldTensors::new(tensors)?;
        let (config, wire) = (self.config.clone(), self.wire_dtype);
        Ok(completions.get().spawn(async move {
            let mut io = socket.open()?;
            let gradients = held.gradients();
            tensors::send_tensors(&config, wire, &gradients, &mut io, waits, &counters)
                .await
                .map(Outcome::Chunks)
        }))
    }

    /// Receive a tensor set from a checked stream socket; the job number (its result:
    /// `[(name, values tuple), ...]`).
    fn receive_tensors_socket(
        &self,
        completions: &Bound<'_, Completions>,
        socket: &Bound<'_, PyAny>,
        progress: Option<&Bound<'_, TransferProgress>>,
        deadline: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let counters = progress_counters(progress);
        let waits = self.waits(deadline)?;
        let socket = SocketStream::from_socket(socket)?;
        let config = self.config.clone();
        Ok(completions.get().spawn(async move {
            let mut io = socket.open()?;
            tensors::receive_tensors(&config, &mut io, waits, &counters)
                .await
                .map(Outcome::Tensors)
        }))
    }

    /// The frames of a tensor set one at a time (the asyncio-streams sender).
    fn tensor_frame_encoder(
        &self,
        py: Python<'_>,
        tensors: Vec<TensorArgs<'_>>,
        progress: Option<&Bound<'_, TransferProgress>>,
        deadline: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<TensorFrameEncoder> {
        let waits = self.waits(deadline)?;
        TensorFrameEncoder::new(
            py,
            self.config.clone(),
            self.wire_dtype,
            HeldTensors::new(tensors)?,
            progress_counters(progress),
            waits,
        )
    }

    /// A receiver for one tensor set fed by the asyncio-streams reader.
    fn tensor_set_receiver(
        &self,
        progress: Option<&Bound<'_, TransferProgress>>,
        deadline: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyTensorSetReceiver> {
        let waits = self.waits(deadline)?;
        Ok(PyTensorSetReceiver::new(
            &self.config,
            progress_counters(progress),
            waits,
        ))
    }

    /// The frames of a tensor set's manifest: an empty gradient whose payload carries
    /// `text` as its `gradstream_tensors` metadata, unsealed (a test's seam, whatever the
    /// session's `seal`).
    fn encode_manifest<'py>(&self, py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyBytes>> {
        let meta = GradientMeta {
            manifest: Some(text.into()),
            ..GradientMeta::default()
        };
        let nothing = Gradient::from(&[][..]).with_meta(&meta);
        let mut unsealed = self.config.clone();
        unsealed.seal = false;
        let wire = unsealed.encode_frames(nothing).py_err(py)?;
        Ok(PyBytes::new(py, &wire))
    }

    /// Decode frames as `decode_frames` does; the first chunk's `gradstream_tensors`
    /// metadata (None without one) and the number of values.
    fn decode_manifest(
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
}
