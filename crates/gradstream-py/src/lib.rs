//! gradstream-py: the extension module `gradstream._native`, PyO3 bindings over
//! gradstream-core. Argument conversion, GIL release, errors to Python classes; the rules
//! live in the core (gradstream-core). Python calls in (`gradstream/_session.py` holds the
//! one `Engine` of a session); nothing here calls back into the package's modules, only
//! into `gradstream.errors` to build exceptions.
//!
//! The arrows point one way: `session` uses `settings`, `stream`, `fastpath`, `complete`,
//! `convert`, `chunk`; `fastpath` uses `stream`, `complete`, `convert` and `errors`;
//! `stream` and `complete` use `convert`; `stream` uses `handover`, which uses
//! `buffers`; `convert` uses no sibling; `chunk` uses
//! `buffers`; `tensors` uses `convert` and `stream`, `complete` uses `tensors`; `buffers` uses no
//! sibling; `settings`, `complete`, `stream`, `session`, `connection` and `protocol` use `errors`.
//!
//! Nothing here is process-wide but the tokio runtime the transfers run on
//! (`complete::runtime`), made on first use and made again in a forked child.

mod buffers;
mod chunk;
mod complete;
mod connection;
mod convert;
mod errors;
mod fastpath;
mod handover;
mod protocol;
mod session;
mod settings;
mod stream;
mod tensors;

use pyo3::prelude::*;

use gradstream_core::frame::{DEFAULT_MAX_GRADIENT_LEN, DEFAULT_MAX_PAYLOAD_LEN, HEADER_LEN};
use gradstream_core::session::DEFAULT_CHUNK_SIZE;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<session::Engine>()?;
    m.add_class::<stream::FrameEncoder>()?;
    m.add_class::<stream::PyFrameReceiver>()?;
    m.add_class::<tensors::TensorFrameEncoder>()?;
    m.add_class::<tensors::PyTensorSetReceiver>()?;
    m.add_class::<chunk::PyChunk>()?;
    m.add_class::<stream::TransferProgress>()?;
    m.add_class::<complete::Completions>()?;
    m.add_class::<complete::Driven>()?;
    m.add_class::<fastpath::SocketReceive>()?;
    m.add_class::<handover::Handover>()?;
    m.add_class::<connection::PyLink>()?;
    m.add_class::<connection::PyListener>()?;
    m.add("DEFAULT_CHUNK_SIZE", DEFAULT_CHUNK_SIZE)?;
    m.add("DEFAULT_MAX_PAYLOAD_LEN", DEFAULT_MAX_PAYLOAD_LEN)?;
    m.add("DEFAULT_MAX_GRADIENT_LEN", DEFAULT_MAX_GRADIENT_LEN)?;
    m.add("HEADER_LEN", HEADER_LEN)?;
    // The metadata keys, from their one definition in the core (the reference keeps its
    // own copy; tests/api/test_api.py compares them).
    m.add("SHAPE_KEY", gradstream_core::codec::SHAPE_KEY)?;
    m.add("DTYPE_KEY", gradstream_core::dtype::DTYPE_KEY)?;
    m.add("MANIFEST_KEY", gradstream_core::codec::MANIFEST_KEY)?;
    m.add("BF16_EXTENSION", gradstream_core::dtype::BF16_EXTENSION)?;
    m.add_function(wrap_pyfunction!(error_samples, m)?)?;
    m.add_function(wrap_pyfunction!(fastpath::fast_path_counts, m)?)?;
    m.add_function(wrap_pyfunction!(connection::open_link, m)?)?;
    m.add_function(wrap_pyfunction!(connection::open_listener, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_note, m)?)?;
    m.add_function(wrap_pyfunction!(read_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(manifest_json, m)?)?;
    protocol::add(m)?;
    Ok(())
}

/// One core error of every variant as (the Python exception it becomes, the core's own
/// `Display` text): the test that keeps the Rust and Python wordings equal.
#[pyfunction]
#[pyo3(name = "_error_samples")]
fn error_samples(py: Python<'_>) -> Vec<(Py<PyAny>, String)> {
    gradstream_core::GradientStreamError::samples()
        .into_iter()
        .map(|e| {
            let text = e.to_string();
            (errors::to_py_err(py, e).into_value(py).into_any(), text)
        })
        .collect()
}

/// The note an error met on tensor `k` of `n` carries:
/// `while encoding tensor "fc.weight" (3 of 100) of a tensor set` (for the conversion
/// errors the Python session meets itself).
#[pyfunction]
fn tensor_note(doing: &str, name: &str, k: usize, n: usize) -> PyResult<String> {
    Ok(gradstream_core::tensors::note(
        tensors::doing_named(doing)?,
        name,
        k,
        n,
    ))
}

/// A tensor set manifest's entries as `(name, dtype, shape)`, read by the core's rules
/// (receiver rule 2; `TensorSetError` for the first problem): the manifest reader on its
/// own, for the differential tests of the two implementations' readers.
#[pyfunction]
fn read_manifest(py: Python<'_>, text: &str) -> PyResult<Vec<(String, &'static str, Vec<usize>)>> {
    use errors::IntoPyResult;
    let entries = gradstream_core::tensors::read_manifest(text).py_err(py)?;
    Ok(entries
        .into_iter()
        .map(|e| (e.name, e.dtype.name(), e.shape))
        .collect())
}

/// The manifest text a sender writes for `(name, dtype, shape)` entries.
#[pyfunction]
fn manifest_json(entries: Vec<(String, String, Vec<usize>)>) -> PyResult<String> {
    let entries = entries
        .into_iter()
        .map(|(name, dtype, shape)| {
            Ok(gradstream_core::tensors::Entry::new(
                name,
                convert::dtype_named(&dtype)?,
                shape,
            ))
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(gradstream_core::tensors::manifest_json(&entries))
}
