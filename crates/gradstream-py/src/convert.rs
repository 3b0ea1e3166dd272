//! Plain Python values to and from the core's types. The public Python session
//! (`gradstream/_session.py`) has already normalised every input: a gradient arrives as
//! `GradientArgs` (its values' bytes, the dtype names, the shape to send), an `out=` array
//! as its bytes and dtype name (`LentArray`), and received values leave as a flat numpy
//! array with their dtype name and shape (`values_tuple`), which Python views and reshapes.
//! Nothing here imports a module of the package.
//!
//! Uses the core alone, no other file of this crate; `session`, `stream` and `complete`
//! all use it.

use std::ptr::NonNull;

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use gradstream_core::dtype::{Dtype, WireDtype};
use gradstream_core::encoder::{Gradient, GradientMeta};
use gradstream_core::output::{OutSlice, Output, Store};
use gradstream_core::shape::shape_text;

/// A dtype by its gradstream name ("float32", ...).
pub fn dtype_named(name: &str) -> PyResult<Dtype> {
    Dtype::from_name(name).ok_or_else(|| PyValueError::new_err(format!("unknown dtype {name:?}")))
}

/// A gradient as the Python session hands it over: `(values, dtype, wire, result, shape)`:
/// the values' memory as a 1-D uint8 array (a view of the caller's array where it allowed),
/// the values' dtype, the dtype they travel in, the dtype the receiver hands back (None:
/// the wire's), and the shape to write into the payloads (None: none).
#[derive(FromPyObject)]
pub struct GradientArgs<'py>(
    PyReadonlyArray1<'py, u8>,
    String,
    String,
    Option<String>,
    Option<Vec<usize>>,
);

/// A gradient taken for encoding: its values as raw bytes, their dtype, the dtype they
/// travel in, and what its payloads say about it (shape, dtype handed back).
pub struct Input<'py> {
    pub bytes: PyReadonlyArray1<'py, u8>,
    pub dtype: Dtype,
    pub wire: WireDtype,
    pub meta: GradientMeta,
}

impl<'py> TryFrom<GradientArgs<'py>> for Input<'py> {
    type Error = PyErr;

    fn try_from(args: GradientArgs<'py>) -> PyResult<Self> {
        let GradientArgs(bytes, dtype, wire, result, shape) = args;
        if !bytes.is_c_contiguous() {
            return Err(PyTypeError::new_err("gradient bytes must be C-contiguous"));
        }
        let dtype = dtype_named(&dtype)?;
        let wire = WireDtype::from_name(&wire)
            .ok_or_else(|| PyValueError::new_err(format!("unknown wire dtype {wire:?}")))?;
        let meta = GradientMeta {
            shape: shape.map(|dims| shape_text(&dims).into()),
            result: result
                .as_deref()
                .map(dtype_named)
                .transpose()?
                .filter(|&r| r != wire.carrier()),
            manifest: None,
        };
        Ok(Self {
            bytes,
            dtype,
            wire,
            meta,
        })
    }
}

impl Input<'_> {
    pub fn gradient(&self) -> PyResult<Gradient<'_>> {
        Ok(Gradient::new(self.bytes.as_slice()?, self.dtype)
            .travel_as(Some(self.wire))
            .with_meta(&self.meta))
    }
}

/// Received values as `(flat numpy array, dtype name, shape or None)`: float32 and float64
/// as themselves, bfloat16 as its uint16 bits (Python views them as `ml_dtypes.bfloat16`).
pub fn values_tuple(py: Python<'_>, values: Output) -> PyResult<Bound<'_, PyAny>> {
    let shape = values.shape.clone();
    let dtype = values.dtype().name();
    let flat = match values.into_store() {
        Some(Store::F32(v)) => PyArray1::from_vec(py, v).into_any(),
        Some(Store::F64(v)) => PyArray1::from_vec(py, v).into_any(),
        Some(Store::U16(v)) => PyArray1::from_vec(py, v).into_any(),
        None => PyArray1::<f32>::zeros(py, 0, false).into_any(),
    };
    (flat, dtype, shape).into_pyobject(py).map(Bound::into_any)
}

/// An `out=` (or `reduce_into=`) array as the Python session hands it over: its memory as
/// a writeable 1-D uint8 view, its dtype's name, and what is done with the values
/// (`"fill"`, or `"sum"` for a `reduce_into=`).
#[derive(FromPyObject)]
pub struct OutArgs<'py>(Bound<'py, PyAny>, String, String);

impl OutArgs<'_> {
    pub fn lend(&self) -> PyResult<LentArray> {
        LentArray::new(&self.0, &self.1, &self.2)
    }

    /// Checked now, as before any byte moves, and kept to be lent afresh to each
    /// receiver: (the bytes, the dtype's name, the lending).
    pub fn checked(self) -> PyResult<(Py<PyAny>, String, String)> {
        let owner = self.lend()?.owner;
        Ok((owner, self.1, self.2))
    }
}

/// A caller's `out=` array, kept alive while values are written into it without the GIL.
pub struct LentArray {
    pub owner: Py<PyAny>,
    pub slice: OutSlice,
}

impl LentArray {
    /// `bytes` is the `out=` array as a writeable 1-D uint8 view (the Python session has
    /// checked it: C-contiguous, aligned, native-endian), `dtype` the name of its dtype,
    /// `lending` `"fill"` (`out=`) or `"sum"` (`reduce_into=`).
    pub fn new(bytes: &Bound<'_, PyAny>, dtype: &str, lending: &str) -> PyResult<Self> {
        let dtype = dtype_named(dtype)?;
        let summing = match lending {
            "fill" => false,
            "sum" => true,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "cannot lend a {} array to {lending:?}",
                    dtype.name()
                )))
            }
        };
        let array = bytes.cast::<PyArray1<u8>>()?;
        if !array.is_c_contiguous() {
            return Err(PyTypeError::new_err("out= bytes must be C-contiguous"));
        }
        let mut writable = array.try_readwrite()?;
        let raw = writable.as_slice_mut()?;
        if !raw.is_empty() && raw.as_ptr().align_offset(dtype.width()) != 0 {
            return Err(PyTypeError::new_err(
                "out= bytes must be aligned to the dtype",
            ));
        }
        let ptr = NonNull::new(raw.as_mut_ptr()).unwrap_or(NonNull::dangling());
        // SAFETY: `owner` keeps the array (and so its memory, which numpy never moves)
        // alive for as long as the OutSlice. It is C-contiguous, writeable and aligned
        // (checked above), `raw.len()` bytes of values of `dtype`. Exclusive access is the
        // caller's part of the out= contract, as for any buffer handed to recv_into: the
        // docs say not to touch `out` meanwhile.
        let slice = unsafe {
            if summing {
                OutSlice::summing_as(ptr, raw.len() / dtype.width(), dtype)
            } else {
                OutSlice::new(ptr, raw.len() / dtype.width(), dtype)
            }
        };
        drop(writable);
        Ok(Self {
            owner: bytes.clone().unbind(),
            slice,
        })
    }
}

/// A gradient array kept alive while a transfer runs without the GIL.
pub struct HeldGradient {
    _owner: Py<PyAny>,
    ptr: *const u8,
    len: usize,
    dtype: Dtype,
    wire: WireDtype,
    meta: GradientMeta,
}

// SAFETY: the pointer is into the array `_owner` keeps alive; it is only read. A Python
// thread writing the array meanwhile can tear values (as with any reader of a shared
// array) but cannot change its size or free it.
unsafe impl Send for HeldGradient {}
unsafe impl Sync for HeldGradient {}

impl HeldGradient {
    pub fn new(input: &Input<'_>) -> PyResult<Self> {
        let slice = input.bytes.as_slice()?;
        Ok(Self {
            ptr: slice.as_ptr(),
            len: slice.len(),
            dtype: input.dtype,
            wire: input.wire,
            meta: input.meta.clone(),
            _owner: input.bytes.as_any().clone().unbind(),
        })
    }

    pub fn gradient(&self) -> Gradient<'_> {
        // SAFETY: see the Send impl; `ptr`/`len` came from a live slice.
        Gradient::new(
            unsafe { std::slice::from_raw_parts(self.ptr, self.len) },
            self.dtype,
        )
        .travel_as(Some(self.wire))
        .with_meta(&self.meta)
    }
}
