//! Python values to and from the core's types: a gradient taken for encoding (`Input`,
//! held across a transfer as `HeldGradient`), a caller's `out=` array (`LentArray`), the
//! dtype of a numpy array, and received values as a numpy array (`values_array`).
//!
//! Uses the core and `gradstream._convert`/`gradstream._dtypes` only, no other file of
//! this crate; `session`, `stream` and `complete` all use it.

use std::ptr::NonNull;

use numpy::{
    PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArray1, PyReadonlyArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use gradstream_core::dtype::Dtype;
use gradstream_core::encoder::{Gradient, GradientMeta};
use gradstream_core::output::{OutSlice, Output, Store};

/// `gradstream._dtypes.<name>` (shared with the reference).
pub fn dtypes_attr<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("gradstream._dtypes")?.getattr(name)
}

/// The dtype of a numpy array, by `gradstream._dtypes.dtype_name`.
pub fn dtype_of_array(array: &Bound<'_, PyAny>) -> PyResult<Dtype> {
    let name = dtypes_attr(array.py(), "dtype_name")?.call1((array.getattr("dtype")?,))?;
    let name: Option<String> = name.extract()?;
    name.as_deref()
        .and_then(Dtype::from_name)
        .ok_or_else(|| PyTypeError::new_err("not an array of a dtype gradstream moves"))
}

/// A gradient taken for encoding: its values as raw bytes (a view of the caller's array
/// where the memory allows), their dtype, the dtype they travel in, and what its payloads
/// say about it (shape, dtype handed back).
pub struct Input<'py> {
    pub bytes: PyReadonlyArray1<'py, u8>,
    /// The values' dtype, and the one they travel in.
    pub dtype: Dtype,
    pub wire: Dtype,
    pub meta: GradientMeta,
}

impl Input<'_> {
    pub fn gradient(&self) -> PyResult<Gradient<'_>> {
        Ok(Gradient::new(self.bytes.as_slice()?, self.dtype)
            .cast_to(self.wire)
            .with_meta(&self.meta))
    }
}

/// The gradient as a C-contiguous, aligned float32 array, read in place when it already is;
/// anything else goes through `gradstream._convert` (shared with the reference), which
/// copies once or refuses with a TypeError naming the dtype.
pub fn gradient_array<'py>(obj: &Bound<'py, PyAny>) -> PyResult<PyReadonlyArrayDyn<'py, f32>> {
    if let Ok(array) = obj.cast::<PyArrayDyn<f32>>() {
        if array.is_c_contiguous() && array.is_aligned() {
            return Ok(array.try_readonly()?);
        }
    }
    static CONVERT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let converted = CONVERT
        .import(obj.py(), "gradstream._convert", "as_float32_array")?
        .call1((obj,))?;
    Ok(converted.cast_into::<PyArrayDyn<f32>>()?.try_readonly()?)
}

/// Values as a numpy array of the dtype they come back in, in the shape the sender kept
/// (views, no copy).
pub fn values_array(py: Python<'_>, values: Output) -> PyResult<Bound<'_, PyAny>> {
    let shape = values.shape.clone();
    let dtype = values.dtype();
    let flat = match values.into_store() {
        Some(Store::F32(v)) => PyArray1::from_vec(py, v).into_any(),
        Some(Store::F64(v)) => PyArray1::from_vec(py, v).into_any(),
        Some(Store::U16(v)) => {
            let numpy_dtype = dtypes_attr(py, "numpy_dtype")?.call1((dtype.name(),))?;
            PyArray1::from_vec(py, v)
                .into_any()
                .call_method1("view", (numpy_dtype,))?
        }
        None => PyArray1::<f32>::zeros(py, 0, false).into_any(),
    };
    match shape {
        None => Ok(flat),
        Some(dims) => flat.call_method1("reshape", (dims,)),
    }
}

/// A caller's `out=` array, kept alive while values are written into it without the GIL.
pub struct LentArray {
    pub owner: Py<PyAny>,
    pub slice: OutSlice,
}

impl LentArray {
    /// Check `out` (gradstream._convert.value_buffer, shared with the reference) and
    /// take a pointer to its values.
    pub fn new(out: &Bound<'_, PyAny>) -> PyResult<Self> {
        static CHECK: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let checked = CHECK
            .import(out.py(), "gradstream._convert", "value_buffer")?
            .call1((out,))?;
        let dtype = dtype_of_array(&checked)?;
        // The same memory as raw bytes (checked C-contiguous: a view, not a copy).
        let bytes = checked
            .call_method1("reshape", (-1,))?
            .call_method1("view", ("uint8",))?;
        let array = bytes.cast::<PyArray1<u8>>()?;
        let mut writable = array.try_readwrite()?;
        let raw = writable.as_slice_mut()?;
        let ptr = NonNull::new(raw.as_mut_ptr()).unwrap_or(NonNull::dangling());
        // SAFETY: `owner` keeps the array (and so its memory, which numpy never moves)
        // alive for as long as the OutSlice. The checked array is C-contiguous, aligned
        // and writeable, `raw.len()` bytes of values of `dtype`. Exclusive access is the
        // caller's part of the out= contract, as for any buffer handed to recv_into: the
        // docs say not to touch `out` meanwhile.
        let slice = unsafe { OutSlice::new(ptr, raw.len() / dtype.width(), dtype) };
        drop(writable);
        Ok(Self {
            owner: checked.unbind(),
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
    wire: Dtype,
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
        .cast_to(self.wire)
        .with_meta(&self.meta)
    }
}
