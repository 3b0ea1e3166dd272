//! `gradstream.GradientChunk`: one encoded chunk, its payload held as a Python `bytes`
//! object so that `arrow_ipc_bytes` and `payload` hand out the same memory with no copy;
//! and `HeldChunk`, any chunk-like object `decode_chunks` is given, held for the call.
//!
//! Uses `buffers`, `errors` (`type_name`) and the core (`codec`, `session`); used by `session`.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;

use super::buffers::{bytes_to_pyarrow, immutable_bytes, ReadBuffer};
use super::errors::type_name;
use gradstream_core::codec;
use gradstream_core::session::ChunkRef;

#[pyclass(name = "GradientChunk", module = "gradstream", frozen, eq)]
pub struct PyChunk {
    pub session_id: String,
    pub chunk_index: u32,
    pub total_chunks: u32,
    pub checksum: u32,
    pub payload: PyBackedBytes,
}

impl PartialEq for PyChunk {
    fn eq(&self, other: &Self) -> bool {
        self.session_id == other.session_id
            && self.chunk_index == other.chunk_index
            && self.total_chunks == other.total_chunks
            && self.checksum == other.checksum
            && *self.payload == *other.payload
    }
}

impl PyChunk {
    pub fn as_ref(&self) -> ChunkRef<'_> {
        ChunkRef {
            chunk_index: self.chunk_index,
            total_chunks: self.total_chunks,
            checksum: self.checksum,
            payload: &self.payload,
        }
    }
}

#[pymethods]
impl PyChunk {
    #[new]
    fn new(
        session_id: String,
        chunk_index: u32,
        total_chunks: u32,
        arrow_ipc_bytes: &Bound<'_, PyAny>,
        checksum: u32,
    ) -> PyResult<Self> {
        Ok(Self {
            session_id,
            chunk_index,
            total_chunks,
            checksum,
            payload: immutable_bytes(arrow_ipc_bytes)?,
        })
    }

    #[getter]
    fn session_id(&self) -> &str {
        &self.session_id
    }

    #[getter]
    fn chunk_index(&self) -> u32 {
        self.chunk_index
    }

    #[getter]
    fn total_chunks(&self) -> u32 {
        self.total_chunks
    }

    #[getter]
    fn checksum(&self) -> u32 {
        self.checksum
    }

    /// The Arrow IPC payload as `bytes` (the object itself, not a copy).
    #[getter]
    fn arrow_ipc_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        (&self.payload)
            .into_pyobject(py)
            .unwrap_or_else(|e| match e {})
    }

    /// The same payload as a `pyarrow.Buffer`, sharing its memory.
    #[getter]
    fn payload<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        bytes_to_pyarrow(&self.arrow_ipc_bytes(py))
    }

    /// Whether the payload's CRC-32 equals the stored checksum.
    fn verify_checksum(&self, py: Python<'_>) -> bool {
        let payload: &[u8] = &self.payload;
        py.detach(|| codec::checksum(payload)) == self.checksum
    }

    /// CRC-32 (IEEE) of any bytes-like object; equals `zlib.crc32(data)`.
    #[staticmethod]
    fn compute_checksum(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u32> {
        let bytes = ReadBuffer::get(data)?;
        Ok(py.detach(|| codec::checksum(bytes.as_slice())))
    }

    fn __repr__(&self) -> String {
        format!(
            "GradientChunk(session_id={:?}, chunk_index={}, total_chunks={}, payload_len={}, \
             checksum={:#010x})",
            self.session_id,
            self.chunk_index,
            self.total_chunks,
            self.payload.len(),
            self.checksum
        )
    }
}

/// A chunk to decode, its payload kept alive while the GIL is released.
pub struct HeldChunk {
    chunk_index: u32,
    total_chunks: u32,
    checksum: u32,
    payload: PyBackedBytes,
}

impl HeldChunk {
    pub fn from_py(item: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(chunk) = item.cast::<PyChunk>() {
            let c = chunk.get();
            return Ok(Self {
                chunk_index: c.chunk_index,
                total_chunks: c.total_chunks,
                checksum: c.checksum,
                payload: c.payload.clone_ref(item.py()),
            });
        }
        // Any object with the chunk's attributes (a gradstream.reference chunk, say).
        let field = |name: &str| {
            item.getattr(name).map_err(|_| {
                PyTypeError::new_err(format!(
                    "decode_chunks takes GradientChunk objects; {} has no attribute {name:?}",
                    type_name(item)
                ))
            })
        };
        Ok(Self {
            chunk_index: field("chunk_index")?.extract()?,
            total_chunks: field("total_chunks")?.extract()?,
            checksum: field("checksum")?.extract()?,
            payload: immutable_bytes(&field("arrow_ipc_bytes")?)?,
        })
    }

    pub fn as_ref(&self) -> ChunkRef<'_> {
        ChunkRef {
            chunk_index: self.chunk_index,
            total_chunks: self.total_chunks,
            checksum: self.checksum,
            payload: &self.payload,
        }
    }
}
