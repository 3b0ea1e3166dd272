//! gradstream-py: the extension module `gradstream._native`, PyO3 bindings over
//! gradstream-core. Argument conversion, GIL release, errors to Python classes; the rules
//! live in the core (`gradstream_core::session`).

mod buffers;
mod chunk;
mod complete;
mod errors;
mod session;
mod stream;

use pyo3::prelude::*;

use gradstream_core::frame::{DEFAULT_MAX_GRADIENT_LEN, DEFAULT_MAX_PAYLOAD_LEN, HEADER_LEN};
use gradstream_core::session::DEFAULT_CHUNK_SIZE;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<session::PySession>()?;
    m.add_class::<chunk::PyChunk>()?;
    m.add_class::<stream::TransferProgress>()?;
    m.add_class::<complete::Completions>()?;
    m.add("DEFAULT_CHUNK_SIZE", DEFAULT_CHUNK_SIZE)?;
    m.add("DEFAULT_MAX_PAYLOAD_LEN", DEFAULT_MAX_PAYLOAD_LEN)?;
    m.add("DEFAULT_MAX_GRADIENT_LEN", DEFAULT_MAX_GRADIENT_LEN)?;
    m.add("HEADER_LEN", HEADER_LEN)?;
    m.add_function(wrap_pyfunction!(error_samples, m)?)?;
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
