//! The PyO3 layer: argument conversion, GIL release, errors to Python classes. No logic of
//! its own beyond that; the rules live in `crate::session`.

mod buffers;
mod chunk;
mod complete;
mod errors;
mod session;
mod stream;

use pyo3::prelude::*;

use crate::frame::{DEFAULT_MAX_GRADIENT_LEN, DEFAULT_MAX_PAYLOAD_LEN, HEADER_LEN};
use crate::session::DEFAULT_CHUNK_SIZE;

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
    Ok(())
}
