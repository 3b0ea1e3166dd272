//! Tensor sets across the boundary: the tensors the Python session hands over
//! (`TensorArgs`, held across a transfer as `HeldTensors`), the sender's name checks on
//! Python strings, a received set as a list for Python, and the sans-I/O set encoder and
//! receiver that `gradstream._aio` drives for asyncio streams. The rules are the core's
//! (`gradstream_core::tensors`); nothing here decides what a set may hold.
//!
//! Uses `convert` (values out), `stream` (progress) and `errors`; used by `session` and
//! `complete`.

use std::collections::HashSet;
use std::sync::Arc;

use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};

use super::buffers::ReadBuffer;
use super::convert::{dtype_named, values_tuple};
use super::errors::{tensor_set_error, to_py_err, type_name, IntoPyResult};
use super::stream::{expired, waits_in_seconds};
use gradstream_core::dtype::WireDtype;
use gradstream_core::encoder::{Gradient, GradientMeta};
use gradstream_core::error::GradientStreamError;
use gradstream_core::seal::TransferId;
use gradstream_core::session::SessionConfig;
use gradstream_core::stream::{Progress, Waits};
use gradstream_core::tensors::encode::{
    check_tensors, set_transfer, tensor_gradient, tensor_meta, tensor_seal,
};
use gradstream_core::tensors::manifest::unencodable_name_detail;
use gradstream_core::tensors::{
    check_name, manifest_frame, note, Doing, Entry, TensorSet, TensorSetReceiver,
};

/// What was being done, by its word in the notes ("encoding", "sending", "receiving").
pub fn doing_named(word: &str) -> PyResult<Doing> {
    match word {
        "encoding" => Ok(Doing::Encoding),
        "sending" => Ok(Doing::Sending),
        "receiving" => Ok(Doing::Receiving),
        _ => Err(PyValueError::new_err(format!("unknown doing {word:?}"))),
    }
}

/// Check a set's names before any tensor is converted: each a `str` (else TypeError),
/// with a UTF-8 form, then the core's rules (non-empty, at most 1024 bytes, unique), in
/// order, the first refusal raised.
pub fn check_names(names: &Bound<'_, PyList>) -> PyResult<()> {
    let py = names.py();
    let mut texts = Vec::with_capacity(names.len());
    for item in names.iter() {
        let Ok(name) = item.cast::<PyString>() else {
            return Err(PyTypeError::new_err(format!(
                "tensor names must be str, not {}",
                type_name(&item)
            )));
        };
        match name.to_str() {
            Ok(text) => texts.push(text.to_owned()),
            Err(_) => {
                // The rules before this name come first, as one pass would meet them.
                check_texts(py, &texts)?;
                let units = name
                    .call_method1("encode", ("utf-16-le", "surrogatepass"))?
                    .cast_into::<PyBytes>()?;
                let units = units
                    .as_bytes()
                    .chunks_exact(2)
                    .map(|pair| u16::from_le_bytes([pair[0], pair[1]]));
                return Err(tensor_set_error(
                    py,
                    unencodable_name_detail(units),
                    name.as_any(),
                ));
            }
        }
    }
    check_texts(py, &texts)
}

fn check_texts(py: Python<'_>, texts: &[String]) -> PyResult<()> {
    let mut taken = HashSet::with_capacity(texts.len());
    for text in texts {
        check_name(text, &mut taken).py_err(py)?;
    }
    Ok(())
}

/// A tensor as the Python session hands it over: (name, its values' memory as a 1-D
/// uint8 array, their dtype, its shape).
#[derive(FromPyObject)]
pub struct TensorArgs<'py>(String, PyReadonlyArray1<'py, u8>, String, Vec<usize>);

/// A set's tensors kept alive while they are encoded or sent without the GIL.
pub struct HeldTensors {
    entries: Vec<Entry>,
    /// Each tensor's values: pointer and length in bytes, into the array kept in `_owners`.
    raws: Vec<(*const u8, usize)>,
    _owners: Vec<Py<PyAny>>,
}

// SAFETY: each pointer is into an array `_owners` keeps alive; they are only read. A
// Python thread writing an array meanwhile can tear values (as with any reader of a
// shared array) but cannot change its size or free it.
unsafe impl Send for HeldTensors {}
unsafe impl Sync for HeldTensors {}

impl HeldTensors {
    pub fn new(tensors: Vec<TensorArgs<'_>>) -> PyResult<Self> {
        let mut held = Self {
            entries: Vec::with_capacity(tensors.len()),
            raws: Vec::with_capacity(tensors.len()),
            _owners: Vec::with_capacity(tensors.len()),
        };
        for TensorArgs(name, bytes, dtype, shape) in tensors {
            if !bytes.is_c_contiguous() {
                return Err(PyTypeError::new_err("tensor bytes must be C-contiguous"));
            }
            let raw = bytes.as_slice()?;
            held.raws.push((raw.as_ptr(), raw.len()));
            held.entries
                .push(Entry::new(name, dtype_named(&dtype)?, shape));
            held._owners.push(bytes.as_any().clone().unbind());
        }
        Ok(held)
    }

    /// Each tensor's entry and values, as the core's set functions take them.
    pub fn gradients(&self) -> Vec<(Entry, Gradient<'_>)> {
        (0..self.entries.len())
            .filter_map(|k| self.tensor(k))
            .map(|(entry, values)| (entry.clone(), values))
            .collect()
    }

    /// Tensor `k`'s entry and values (a frame encoder's, without copying every entry).
    pub fn tensor(&self, k: usize) -> Option<(&Entry, Gradient<'_>)> {
        let entry = self.entries.get(k)?;
        let &(ptr, len) = self.raws.get(k)?;
        // SAFETY: see the Send impl; `ptr`/`len` came from a live slice.
        let raw = unsafe { std::slice::from_raw_parts(ptr, len) };
        Some((entry, Gradient::new(raw, entry.dtype)))
    }
}

/// A received set as `[(name, values tuple), ...]` in the sender's order.
pub fn set_list(py: Python<'_>, set: TensorSet) -> PyResult<Bound<'_, PyList>> {
    let items = set
        .into_iter()
        .map(|(entry, values)| Ok((entry.name, values_tuple(py, values)?)))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

/// Where a set's encoder stands: the manifest frame, or a frame of tensor `k`.
#[derive(Clone, Copy)]
enum Sending {
    Manifest,
    Tensor { k: usize, next: u32, total: u32 },
}

/// The frames of a tensor set, one `bytes` per `next()` (the asyncio-streams sender):
/// the manifest's, then each tensor's, encoded with the GIL released. Everything is
/// checked, and the manifest built, before the first frame is handed out.
#[pyclass(module = "gradstream._native", name = "TensorFrameEncoder")]
pub struct TensorFrameEncoder {
    config: SessionConfig,
    wire_dtype: Option<WireDtype>,
    tensors: HeldTensors,
    metas: Vec<GradientMeta>,
    /// The set's transfer id, when the session seals: every frame carries it.
    transfer: Option<TransferId>,
    manifest: Option<Vec<u8>>,
    progress: Arc<Progress>,
    waits: Waits,
    /// The frame last handed out, and the frames of it the stream has taken whole.
    at: Sending,
    written: u32,
}

impl TensorFrameEncoder {
    pub fn new(
        py: Python<'_>,
        config: SessionConfig,
        wire_dtype: Option<WireDtype>,
        tensors: HeldTensors,
        progress: Arc<Progress>,
        waits: Waits,
    ) -> PyResult<Self> {
        let gradients = tensors.gradients();
        check_tensors(&gradients, Doing::Sending).py_err(py)?;
        let entries: Vec<Entry> = gradients.into_iter().map(|(entry, _)| entry).collect();
        let transfer = set_transfer(&config).py_err(py)?;
        let manifest = manifest_frame(&config, &entries, transfer).py_err(py)?;
        let metas = entries
            .iter()
            .map(|entry| tensor_meta(entry, wire_dtype))
            .collect();
        Ok(Self {
            config,
            wire_dtype,
            tensors,
            metas,
            transfer,
            manifest: Some(manifest),
            progress,
            waits,
            at: Sending::Manifest,
            written: 0,
        })
    }

    /// The place after `at`: the next frame of the same tensor, or the first of the next
    /// one (its total announced to the progress counters); None after the last.
    fn advance(&self, at: Sending) -> Result<Option<Sending>, GradientStreamError> {
        let first = match at {
            Sending::Tensor { k, next, total } if next < total => {
                return Ok(Some(Sending::Tensor {
                    k,
                    next: next + 1,
                    total,
                }))
            }
            Sending::Tensor { k, .. } => k + 1,
            Sending::Manifest => 0,
        };
        let Some(entry) = self.tensors.entries.get(first) else {
            return Ok(None);
        };
        let total = self.config.chunk_count(entry.len())?;
        self.progress.add_total(total);
        Ok(Some(Sending::Tensor {
            k: first,
            next: 1,
            total,
        }))
    }

    fn current_note(&self) -> Option<String> {
        match self.at {
            Sending::Manifest => None,
            Sending::Tensor { k, .. } => {
                let entries = &self.tensors.entries;
                Some(note(Doing::Sending, &entries[k].name, k + 1, entries.len()))
            }
        }
    }

    fn noted(&self, error: GradientStreamError) -> GradientStreamError {
        match self.current_note() {
            Some(note) => GradientStreamError::Noted {
                error: Box::new(error),
                note,
            },
            None => error,
        }
    }
}

#[pymethods]
impl TensorFrameEncoder {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        if let Some(manifest) = self.manifest.take() {
            return Ok(Some(PyBytes::new(py, &manifest)));
        }
        let Some(at) = self.advance(self.at).py_err(py)? else {
            return Ok(None);
        };
        if !matches!((self.at, at), (Sending::Tensor { k: a, .. }, Sending::Tensor { k: b, .. }) if a == b)
        {
            self.written = 0;
        }
        self.at = at;
        let Sending::Tensor { k, next, .. } = at else {
            return Ok(None);
        };
        let Some((entry, values)) = self.tensors.tensor(k) else {
            return Ok(None);
        };
        let gradient = tensor_gradient(entry, &values, self.wire_dtype, &self.metas[k])
            .seal_with(tensor_seal(self.transfer, k));
        let config = &self.config;
        let frame = py
            .detach(|| config.encode_frame(gradient, next - 1))
            .map_err(|e| self.noted(e))
            .py_err(py)?;
        Ok(Some(PyBytes::new(py, &frame)))
    }

    /// Count bytes (and frames) the stream accepted; the manifest's are not counted.
    fn sent(&mut self, nbytes: usize, frames: u32) {
        if let Sending::Tensor { .. } = self.at {
            self.written += frames;
            self.progress.add(nbytes, u64::from(frames));
        }
    }

    /// The session's timeout and the set's deadline, in seconds (the Python clock's).
    #[getter]
    fn waits(&self) -> (Option<f64>, Option<f64>) {
        waits_in_seconds(self.waits)
    }

    /// Raise the timeout error (the deadline's when `late`) for where the set stands (the
    /// manifest: 0 of 1 chunks).
    #[pyo3(signature = (seconds, late = false))]
    fn timed_out(&self, py: Python<'_>, seconds: f64, late: bool) -> PyResult<()> {
        let (received, total) = match self.at {
            Sending::Manifest => (0, 1),
            Sending::Tensor { total, .. } => (self.written as usize, total),
        };
        let error = expired(seconds, late, (received, Some(total)));
        Err(to_py_err(py, self.noted(error)))
    }

    /// The note for an error met now: the tensor being sent, if any.
    fn note(&self) -> Option<String> {
        self.current_note()
    }
}

/// Receives one tensor set from bytes the caller reads: `want()` says how many next.
#[pyclass(module = "gradstream._native", name = "TensorSetReceiver")]
pub struct PyTensorSetReceiver {
    inner: Option<TensorSetReceiver>,
    progress: Arc<Progress>,
    waits: Waits,
}

impl PyTensorSetReceiver {
    pub fn new(config: &SessionConfig, progress: Arc<Progress>, waits: Waits) -> Self {
        Self {
            inner: Some(TensorSetReceiver::new(config)),
            progress,
            waits,
        }
    }

    fn inner(&self) -> PyResult<&TensorSetReceiver> {
        self.inner
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("this receiver has finished"))
    }

    fn take(&mut self) -> PyResult<TensorSetReceiver> {
        self.inner
            .take()
            .ok_or_else(|| PyValueError::new_err("this receiver has finished"))
    }
}

#[pymethods]
impl PyTensorSetReceiver {
    fn want(&self) -> PyResult<usize> {
        Ok(self.inner()?.want())
    }

    /// Take exactly `want()` bytes; True once the set is complete. Progress counts the
    /// tensors' bytes and frames, not the manifest's.
    fn feed(&mut self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<bool> {
        let bytes = ReadBuffer::get(data)?;
        let progress = self.progress.clone();
        let receiver = self
            .inner
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("this receiver has finished"))?;
        if receiver.in_tensors() {
            progress.add(bytes.as_slice().len(), 0);
        }
        let (frames, announced) = (receiver.frames_received(), receiver.frames_announced());
        let done = py.detach(|| receiver.feed(bytes.as_slice())).py_err(py)?;
        let new_total = receiver.frames_announced() - announced;
        progress
            .total_chunks
            .fetch_add(new_total, std::sync::atomic::Ordering::Relaxed);
        progress.add(0, receiver.frames_received() - frames);
        Ok(done)
    }

    /// The stream ended after `got` bytes of what `want()` asked: the set (empty when it
    /// ended before the first byte) or the error the rules give.
    fn end<'py>(&mut self, py: Python<'py>, got: usize) -> PyResult<Bound<'py, PyList>> {
        let set = self.take()?.end_of_stream(got).py_err(py)?;
        set_list(py, set)
    }

    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let set = self.take()?.finish().py_err(py)?;
        set_list(py, set)
    }

    /// The session's timeout and the set's deadline, in seconds (the Python clock's).
    #[getter]
    fn waits(&self) -> (Option<f64>, Option<f64>) {
        waits_in_seconds(self.waits)
    }

    /// Raise the timeout error (the deadline's when `late`) for where the set stands,
    /// noted with its tensor.
    #[pyo3(signature = (seconds, late = false))]
    fn timed_out(&self, py: Python<'_>, seconds: f64, late: bool) -> PyResult<()> {
        let receiver = self.inner()?;
        let error = expired(seconds, late, receiver.at());
        Err(to_py_err(py, receiver.annotate(error)))
    }

    /// The note for an error met now: the tensor being received, if any.
    fn note(&self) -> PyResult<Option<String>> {
        Ok(self.inner()?.note())
    }
}
