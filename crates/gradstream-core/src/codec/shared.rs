//! What the payload writer and reader share: the CRC-32, the file magic, the schema
//! metadata keys, an Arrow buffer over borrowed memory, and the error conversion.
//! Uses only `error`; used by `writer`, `reader` and `guard`.

use std::ptr::NonNull;
use std::sync::Arc;

use arrow_buffer::Buffer;

use crate::error::GradientStreamError;

/// The magic an IPC file starts and ends with (padded to 8 bytes at the start).
pub(super) const MAGIC: &[u8; 6] = b"ARROW1";

/// CRC-32 (IEEE 802.3), the checksum a frame header carries; equals `zlib.crc32`.
pub fn checksum(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

/// The schema metadata key holding a gradient's shape (`keep_shape`), as a compact JSON
/// array of integers: "[768,3072]".
pub const SHAPE_KEY: &str = "gradient_shape";

/// The schema metadata key of a tensor set's manifest (docs/guides/tensor-sets.md).
pub const MANIFEST_KEY: &str = "gradstream_tensors";

/// The field metadata that makes a UInt16 `value` column bfloat16.
pub(super) const EXTENSION_NAME_KEY: &str = "ARROW:extension:name";
pub(super) const EXTENSION_METADATA_KEY: &str = "ARROW:extension:metadata";

/// An Arrow buffer over memory it does not own (no copy).
///
/// # Safety
/// The buffer, and every array or slice made from it, must be dropped before `bytes` is.
pub(super) unsafe fn borrowed_buffer(bytes: &[u8]) -> Buffer {
    let ptr = NonNull::new(bytes.as_ptr().cast_mut()).unwrap_or(NonNull::dangling());
    // SAFETY: `ptr` and `bytes.len()` describe memory valid for reads for as long as
    // `bytes` lives, which the caller guarantees outlasts the buffer (this function's
    // contract); the owner is a no-op because the memory belongs to the caller, and arrow
    // only reads through it. A dangling pointer is used only with length 0.
    unsafe { Buffer::from_custom_allocation(ptr, bytes.len(), Arc::new(())) }
}

pub(super) fn arrow_err(e: arrow_schema::ArrowError) -> GradientStreamError {
    GradientStreamError::arrow(e.to_string())
}
