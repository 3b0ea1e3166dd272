//! One chunk's payload: an Arrow IPC *file* in the original's "seed layout", and its CRC-32.
//!
//! Encoding writes one record batch of `index: Int32` (0..n-1) and `value: Float32`, both
//! non-nullable, so that ipfrs-transport's decoder reads what we send. Decoding accepts
//! what the original accepts (any IPC file whose `value` column is Float32, other columns
//! ignored, batches concatenated) but treats the bytes as hostile: every block the footer
//! names is bounds-checked before arrow-rs slices it, only the `value` column is decoded,
//! and a panic inside arrow-rs becomes an error instead of unwinding into Python.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use arrow_array::types::{Float16Type, Float32Type, Float64Type, UInt16Type};
use arrow_array::{Array, ArrowPrimitiveType, Int32Array, PrimitiveArray, RecordBatch};
use arrow_buffer::Buffer;
use arrow_ipc::reader::{read_footer_length, FileDecoder};
use arrow_ipc::writer::{FileWriter, IpcWriteOptions};
use arrow_ipc::{Block, CompressionType, MessageHeader};
use arrow_schema::{DataType, Field, Schema, SchemaRef};

use crate::dtype::{Dtype, BF16_EXTENSION, DTYPE_KEY};
use crate::error::{GradientStreamError, Result};
use crate::output::{Head, ValueSink};

/// The magic an IPC file starts and ends with (padded to 8 bytes at the start).
const MAGIC: &[u8; 6] = b"ARROW1";
/// Trailer: footer length (i32) then the magic.
const TRAILER_LEN: usize = 10;
/// The smallest file: 8 bytes of padded magic plus the trailer.
const MIN_FILE_LEN: usize = 8 + TRAILER_LEN;

/// CRC-32 (IEEE 802.3), the checksum a frame header carries; equals `zlib.crc32`.
pub fn checksum(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

/// Which columns a payload carries. Both decode with the original's decoder, which only
/// looks up `value`; `Seed` is the original's byte layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// `index: Int32` (0..n-1) then `value: Float32`: 8 bytes a value, as the original.
    #[default]
    Seed,
    /// `value: Float32` alone: 4 bytes a value, half the wire.
    Compact,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Self::Seed => "seed",
            Self::Compact => "compact",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "seed" => Some(Self::Seed),
            "compact" => Some(Self::Compact),
            _ => None,
        }
    }

    /// Column bytes a value: a floor for a payload's size.
    pub fn bytes_per_value(self) -> usize {
        match self {
            Self::Seed => 8,
            Self::Compact => 4,
        }
    }
}

/// Arrow IPC buffer compression of a payload (the standard BodyCompression, which
/// pyarrow and arrow-rs read). The CRC covers the compressed bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    Lz4,
    Zstd,
}

impl Compression {
    pub fn name(self) -> &'static str {
        match self {
            Self::Lz4 => "lz4",
            Self::Zstd => "zstd",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "lz4" => Some(Self::Lz4),
            "zstd" => Some(Self::Zstd),
            _ => None,
        }
    }

    fn ipc(self) -> CompressionType {
        match self {
            Self::Lz4 => CompressionType::LZ4_FRAME,
            Self::Zstd => CompressionType::ZSTD,
        }
    }
}

/// The schema metadata key holding a gradient's shape (`keep_shape`), as a compact JSON
/// array of integers: "[768,3072]".
pub const SHAPE_KEY: &str = "gradient_shape";

/// The schema metadata key of a tensor set's manifest (README "Tensor sets").
pub const MANIFEST_KEY: &str = "gradstream_tensors";

/// The field metadata that makes a UInt16 `value` column bfloat16.
const EXTENSION_NAME_KEY: &str = "ARROW:extension:name";
const EXTENSION_METADATA_KEY: &str = "ARROW:extension:metadata";

/// How a payload is written: its columns, its compression, and the metadata.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Encoding {
    pub layout: Layout,
    pub compression: Option<Compression>,
    /// The `value` column's dtype.
    pub dtype: Dtype,
    /// `gradient_shape` metadata to write, when the sender keeps the shape.
    pub shape: Option<Arc<str>>,
    /// `gradient_dtype` metadata: the dtype the receiver hands back, when not `dtype`.
    pub result: Option<Dtype>,
    /// `gradstream_tensors` metadata: a tensor set's manifest.
    pub manifest: Option<Arc<str>>,
}

impl From<Layout> for Encoding {
    fn from(layout: Layout) -> Self {
        Self {
            layout,
            ..Self::default()
        }
    }
}

impl Encoding {
    /// Whether this writes the plain float32 payload that templates reproduce.
    pub fn is_plain(&self) -> bool {
        self.compression.is_none()
            && self.dtype == Dtype::F32
            && self.shape.is_none()
            && self.result.is_none()
            && self.manifest.is_none()
    }

    fn schema(&self) -> SchemaRef {
        let base = match self.layout {
            Layout::Seed => seed_schema(),
            Layout::Compact => compact_schema(),
        };
        let mut metadata = std::collections::HashMap::new();
        if let Some(shape) = &self.shape {
            metadata.insert(SHAPE_KEY.to_string(), shape.to_string());
        }
        if let Some(result) = self.result {
            metadata.insert(DTYPE_KEY.to_string(), result.name().to_string());
        }
        if let Some(manifest) = &self.manifest {
            metadata.insert(MANIFEST_KEY.to_string(), manifest.to_string());
        }
        if self.dtype == Dtype::F32 && metadata.is_empty() {
            return base;
        }
        let value = Field::new("value", value_type(self.dtype), false);
        let value = if self.dtype == Dtype::BF16 {
            value.with_metadata(std::collections::HashMap::from([
                (EXTENSION_NAME_KEY.to_string(), BF16_EXTENSION.to_string()),
                (EXTENSION_METADATA_KEY.to_string(), String::new()),
            ]))
        } else {
            value
        };
        let fields: Vec<Field> = match self.layout {
            Layout::Seed => vec![Field::new("index", DataType::Int32, false), value],
            Layout::Compact => vec![value],
        };
        Arc::new(Schema::new_with_metadata(fields, metadata))
    }
}

/// The Arrow type of a `value` column of `dtype` (bfloat16: its UInt16 storage).
fn value_type(dtype: Dtype) -> DataType {
    match dtype {
        Dtype::F16 => DataType::Float16,
        Dtype::BF16 => DataType::UInt16,
        Dtype::F32 => DataType::Float32,
        Dtype::F64 => DataType::Float64,
    }
}

fn compact_schema() -> SchemaRef {
    static SCHEMA: OnceLock<SchemaRef> = OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            Arc::new(Schema::new(vec![Field::new(
                "value",
                DataType::Float32,
                false,
            )]))
        })
        .clone()
}

/// The schema of every seed-layout payload we write, built once.
fn seed_schema() -> SchemaRef {
    static SCHEMA: OnceLock<SchemaRef> = OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            Arc::new(Schema::new(vec![
                Field::new("index", DataType::Int32, false),
                Field::new("value", DataType::Float32, false),
            ]))
        })
        .clone()
}

/// Encode one chunk's float32 values as an Arrow IPC file.
pub fn encode_payload(encoding: impl Into<Encoding>, values: &[f32]) -> Result<Vec<u8>> {
    encode_payload_raw(encoding, f32_bytes(values))
}

/// Encode one chunk's values, given as the bytes of values of `encoding.dtype`.
pub fn encode_payload_raw(encoding: impl Into<Encoding>, raw: &[u8]) -> Result<Vec<u8>> {
    let encoding = encoding.into();
    // Column data is a few bytes a value; schema, footer and padding stay under 1 KiB
    // (plus the metadata).
    let n = raw.len() / encoding.dtype.width();
    let metadata = encoding.manifest.as_ref().map_or(0, |m| m.len());
    let mut out = Vec::with_capacity(
        raw.len() + n * (encoding.layout.bytes_per_value() - 4) + 1024 + metadata,
    );
    encode_to(encoding, raw, &mut out)?;
    Ok(out)
}

/// Append the file of `values` to `out`.
pub fn append_payload(encoding: impl Into<Encoding>, raw: &[u8], out: &mut Vec<u8>) -> Result<()> {
    encode_to(encoding.into(), raw, out)
}

/// A `value` column over `raw` without a copy.
///
/// # Safety
/// As for `borrowed_buffer`: the array must be dropped before `raw` is.
unsafe fn value_column(dtype: Dtype, raw: &[u8]) -> Result<arrow_array::ArrayRef> {
    fn typed<T: ArrowPrimitiveType>(buffer: Buffer) -> Result<arrow_array::ArrayRef> {
        let width = std::mem::size_of::<T::Native>();
        if !buffer.len().is_multiple_of(width) {
            return Err(GradientStreamError::arrow(
                "gradient bytes are not a whole number of values",
            ));
        }
        Ok(Arc::new(PrimitiveArray::<T>::new(buffer.into(), None)))
    }
    let aligned = raw.as_ptr().align_offset(dtype.width()) == 0;
    let buffer = if aligned && !raw.is_empty() {
        // SAFETY: by this function's contract.
        unsafe { borrowed_buffer(raw) }
    } else {
        // Arrow arrays need aligned values (an empty slice's pointer may be anything):
        // an aligned copy, which never happens for the arrays the bindings hand us.
        Buffer::from_slice_ref(raw)
    };
    match dtype {
        Dtype::F16 => typed::<Float16Type>(buffer),
        Dtype::BF16 => typed::<UInt16Type>(buffer),
        Dtype::F32 => typed::<Float32Type>(buffer),
        Dtype::F64 => typed::<Float64Type>(buffer),
    }
}

fn encode_to(encoding: Encoding, raw: &[u8], out: impl std::io::Write) -> Result<()> {
    // SAFETY: the column borrows `raw`; it lives in `batch`, which is dropped before
    // this function returns (the writer copies bytes out and keeps no reference).
    let value = unsafe { value_column(encoding.dtype, raw)? };
    let n = value.len();
    let schema = encoding.schema();
    let columns: Vec<arrow_array::ArrayRef> = match encoding.layout {
        Layout::Seed => vec![Arc::new(index_column(n)?), value],
        Layout::Compact => vec![value],
    };
    let batch = RecordBatch::try_new(schema, columns).map_err(arrow_err)?;
    let options = IpcWriteOptions::default()
        .try_with_compression(encoding.compression.map(Compression::ipc))
        .map_err(arrow_err)?;
    let mut writer =
        FileWriter::try_new_with_options(out, &batch.schema(), options).map_err(arrow_err)?;
    writer.write(&batch).map_err(arrow_err)?;
    writer.finish().map_err(arrow_err)?;
    Ok(())
}

/// Write the file of `values` in `layout` into `out`, which must be exactly its length
/// (as measured by an earlier `encode_payload` of as many values).
pub fn encode_payload_exact(layout: Layout, raw: &[u8], out: &mut [u8]) -> Result<()> {
    let expected = out.len();
    let mut cursor = std::io::Cursor::new(out);
    encode_to(layout.into(), raw, &mut cursor)?;
    let written = cursor.position() as usize;
    if written != expected {
        return Err(GradientStreamError::arrow(format!(
            "payload of {} values took {written} bytes, {expected} were planned",
            raw.len() / 4
        )));
    }
    Ok(())
}

/// The `index` column 0..n-1. Every full chunk of a gradient has the same one, so the
/// longest built so far (up to `INDEX_CACHE_MAX` values) is kept per thread and sliced:
/// an Arrow array slice is a refcount, not a copy.
fn index_column(n: usize) -> Result<Int32Array> {
    const INDEX_CACHE_MAX: usize = 1 << 22; // 16 MiB per thread at most
    thread_local! {
        static LONGEST: std::cell::RefCell<Option<Int32Array>> = const { std::cell::RefCell::new(None) };
    }
    let end = i32::try_from(n).map_err(|_| {
        GradientStreamError::arrow(format!(
            "a chunk of {n} values does not fit the Int32 index column"
        ))
    })?;
    if n > INDEX_CACHE_MAX {
        return Ok(Int32Array::from_iter_values(0..end));
    }
    Ok(LONGEST.with_borrow_mut(|longest| match longest {
        Some(column) if column.len() >= n => column.slice(0, n),
        _ => longest.insert(Int32Array::from_iter_values(0..end)).clone(),
    }))
}

/// The bytes of `values` as they lie in memory.
pub fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte pattern is a valid u8.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// An Arrow buffer over memory it does not own (no copy).
///
/// # Safety
/// The buffer, and every array or slice made from it, must be dropped before `bytes` is.
unsafe fn borrowed_buffer(bytes: &[u8]) -> Buffer {
    let ptr = NonNull::new(bytes.as_ptr().cast_mut()).unwrap_or(NonNull::dangling());
    // The owner is a no-op: the memory belongs to the caller.
    unsafe { Buffer::from_custom_allocation(ptr, bytes.len(), Arc::new(())) }
}

/// Decode a payload and append its `value` column to `out`.
///
/// On error `out` may hold part of the payload's values; callers discard it.
///
/// `room` is how many more values the gradient may take (max_gradient_len minus what came
/// before): a compressed batch declaring more rows is refused before anything is
/// decompressed, since Arrow readers allocate whatever uncompressed size a buffer declares.
///
/// Before any value, `out.begin` is told the payload's column dtype and metadata (and
/// may refuse them). Returns the same `Head`.
pub fn decode_payload<S: ValueSink + ?Sized>(
    payload: &[u8],
    out: &mut S,
    room: usize,
) -> Result<Head> {
    // SAFETY: `buffer` and all arrays decoded from it (batches)
    // live inside `decode_buffer` and are dropped before it returns, unwinding included;
    // only copied values leave it. Misaligned buffers are copied by arrow-rs itself.
    let buffer = unsafe { borrowed_buffer(payload) };
    match catch_unwind(AssertUnwindSafe(|| decode_buffer(&buffer, out, room))) {
        Ok(result) => result,
        Err(_) => Err(GradientStreamError::arrow(
            "malformed Arrow IPC file (the decoder rejected its layout)",
        )),
    }
}

fn arrow_err(e: arrow_schema::ArrowError) -> GradientStreamError {
    GradientStreamError::arrow(e.to_string())
}

/// The error for a `value` column of a type gradstream does not read.
const NOT_A_FLOAT: &str = "'value' column is not Float16, Float32, Float64 or gradstream.bfloat16";

/// The dtype of a `value` field: its Arrow type, and for UInt16 the bfloat16 extension name.
fn column_dtype(field: &Field) -> Result<Dtype> {
    match field.data_type() {
        DataType::Float16 => Ok(Dtype::F16),
        DataType::Float32 => Ok(Dtype::F32),
        DataType::Float64 => Ok(Dtype::F64),
        DataType::UInt16
            if field.metadata().get(EXTENSION_NAME_KEY).map(String::as_str)
                == Some(BF16_EXTENSION) =>
        {
            Ok(Dtype::BF16)
        }
        _ => Err(GradientStreamError::arrow(NOT_A_FLOAT)),
    }
}

/// The bytes of a decoded `value` column of `dtype` (its nulls are checked by the caller).
fn column_bytes(column: &dyn Array, dtype: Dtype) -> Result<&[u8]> {
    fn typed<T: ArrowPrimitiveType>(column: &dyn Array) -> Option<&[u8]> {
        let values = column
            .as_any()
            .downcast_ref::<PrimitiveArray<T>>()?
            .values();
        // SAFETY: the primitive types here have no padding; every byte is initialised.
        Some(unsafe {
            std::slice::from_raw_parts(
                values.as_ptr().cast::<u8>(),
                std::mem::size_of_val(values.as_ref()),
            )
        })
    }
    match dtype {
        Dtype::F16 => typed::<Float16Type>(column),
        Dtype::BF16 => typed::<UInt16Type>(column),
        Dtype::F32 => typed::<Float32Type>(column),
        Dtype::F64 => typed::<Float64Type>(column),
    }
    .ok_or_else(|| GradientStreamError::arrow(NOT_A_FLOAT))
}

fn decode_buffer<S: ValueSink + ?Sized>(buf: &Buffer, out: &mut S, room: usize) -> Result<Head> {
    let len = buf.len();
    if len < MIN_FILE_LEN || &buf[..MAGIC.len()] != MAGIC {
        return Err(GradientStreamError::arrow(
            "not an Arrow IPC file (no ARROW1 magic at the start)",
        ));
    }
    let trailer: [u8; TRAILER_LEN] = buf[len - TRAILER_LEN..]
        .try_into()
        .map_err(|_| GradientStreamError::arrow("truncated Arrow IPC trailer"))?;
    let footer_len = read_footer_length(trailer).map_err(arrow_err)?;
    let footer_end = len - TRAILER_LEN;
    let footer_start = footer_end
        .checked_sub(footer_len)
        .filter(|&start| start >= 8)
        .ok_or_else(|| {
            GradientStreamError::arrow(format!(
                "footer length {footer_len} does not fit a {len}-byte file"
            ))
        })?;
    let footer = arrow_ipc::root_as_footer(&buf[footer_start..footer_end])
        .map_err(|e| GradientStreamError::arrow(format!("unreadable IPC footer: {e}")))?;
    // The structure first, in the reference's order (README "Decoding rules"): the
    // record-batch list, no dictionary batches, blocks in order without overlap, each
    // batch message checked (compressed ones bounded) before anything is decoded.
    let blocks = footer
        .recordBatches()
        .ok_or_else(|| GradientStreamError::arrow("IPC footer lists no record batches"))?;
    // A gradient payload has no dictionary batches. The reference's reader (pyarrow)
    // would decode, and decompress, every one before any record batch; refusing them in
    // both keeps the two alike and bounded.
    let dictionaries = footer.dictionaries().map_or(0, |d| d.len());
    if dictionaries > 0 {
        return Err(GradientStreamError::arrow(format!(
            "IPC footer lists {dictionaries} dictionary batch(es); a gradient payload has none"
        )));
    }
    // Blocks must come in file order without overlapping, as every writer lays them out:
    // a footer naming one block many times would otherwise multiply its values, making a
    // small payload decode to gigabytes.
    let mut free_from = 8usize;
    // The compressed batches of one payload share the room.
    let mut room = room;
    let mut checked = Vec::with_capacity(blocks.len());
    for block in blocks {
        let data = block_data(buf, block, footer_start)?;
        let start = block.offset() as usize; // checked by block_data
        if start < free_from {
            return Err(GradientStreamError::arrow(format!(
                "IPC record batch block at offset {start} overlaps the one before it"
            )));
        }
        free_from = start + data.len();
        let declared_rows = check_batch_message(&data, block, &mut room)?;
        checked.push((block, data, declared_rows));
    }

    let fb_schema = footer
        .schema()
        .ok_or_else(|| GradientStreamError::arrow("IPC footer has no schema"))?;
    if !fb_schema.endianness().equals_to_target_endianness() {
        return Err(GradientStreamError::arrow(
            "IPC file has the other byte order",
        ));
    }
    let schema = arrow_ipc::convert::try_fb_to_schema(fb_schema).map_err(arrow_err)?;
    // The first entry of a key, as pyarrow reads it (arrow-rs's map keeps the last): a
    // payload listing a key twice must not decode differently in the two.
    let first = |key: &str| {
        fb_schema.custom_metadata().and_then(|entries| {
            entries
                .iter()
                .find(|kv| kv.key() == Some(key))
                .map(|kv| kv.value().unwrap_or_default().to_string())
        })
    };

    let value_idx = schema
        .index_of("value")
        .map_err(|_| GradientStreamError::arrow("Arrow IPC block missing 'value' column"))?;
    let column = column_dtype(schema.field(value_idx))?;
    let dtype = match first(DTYPE_KEY) {
        None => None,
        Some(name) => Some(Dtype::from_name(&name).ok_or_else(|| {
            GradientStreamError::arrow(
                "gradient_dtype metadata is not float16, bfloat16, float32 or float64",
            )
        })?),
    };
    let head = Head {
        column,
        shape: first(SHAPE_KEY),
        dtype,
        manifest: first(MANIFEST_KEY),
    };
    out.begin(&head)?;

    // Only the `value` column is decoded; the others (the index) are skipped unread.
    let decoder =
        FileDecoder::new(Arc::new(schema), footer.version()).with_projection(vec![value_idx]);
    for (block, data, declared_rows) in checked {
        // A block whose message is of type NONE decodes to "no batch" in arrow-rs; the
        // original would skip it silently, losing whatever the block was meant to hold.
        let batch = decoder
            .read_record_batch(block, &data)
            .map_err(arrow_err)?
            .ok_or_else(|| {
                GradientStreamError::arrow("IPC record batch block holds no record batch")
            })?;
        let values = batch.column(0);
        let raw = column_bytes(values.as_ref(), column)?;
        if declared_rows.is_some_and(|rows| rows != values.len() as i64) {
            return Err(GradientStreamError::arrow(format!(
                "'value' column holds {} values but its record batch declares {} rows",
                values.len(),
                declared_rows.unwrap_or_default()
            )));
        }
        if values.null_count() > 0 {
            return Err(GradientStreamError::arrow(format!(
                "'value' column has {} null value(s)",
                values.null_count()
            )));
        }
        out.put_raw(raw, column);
    }
    Ok(head)
}

/// The bytes of one block (metadata + body), after checking the footer's numbers fit the
/// file: arrow-rs slices with them and would panic on a lie.
fn block_data(buf: &Buffer, block: &Block, limit: usize) -> Result<Buffer> {
    let offset = usize::try_from(block.offset()).ok();
    let meta = usize::try_from(block.metaDataLength()).ok();
    let body = usize::try_from(block.bodyLength()).ok();
    let span = match (offset, meta, body) {
        (Some(o), Some(m), Some(b)) => m
            .checked_add(b)
            .and_then(|len| o.checked_add(len).map(|end| (o, len, end))),
        _ => None,
    };
    match span {
        Some((start, len, end)) if end <= limit && start >= 8 => {
            Ok(buf.slice_with_length(start, len))
        }
        _ => Err(GradientStreamError::arrow(format!(
            "IPC block (offset {}, metadata {}, body {}) lies outside the file",
            block.offset(),
            block.metaDataLength(),
            block.bodyLength()
        ))),
    }
}

/// Check a record batch message against its block before arrow-rs reads it: the body
/// length must be the block's, and every buffer must lie inside the body. Returns the
/// row count the message declares (None when the message is not a record batch).
fn check_batch_message(data: &Buffer, block: &Block, room: &mut usize) -> Result<Option<i64>> {
    let meta_len = usize::try_from(block.metaDataLength()).unwrap_or(usize::MAX);
    let body_len = data.len().saturating_sub(meta_len) as u64;
    let meta = data.get(..meta_len).unwrap_or(&[]);
    // The metadata is [0xFFFFFFFF continuation][i32 length][flatbuffer], or, before
    // Arrow 0.15, [i32 length][flatbuffer].
    let fb = match meta {
        [0xff, 0xff, 0xff, 0xff, l0, l1, l2, l3, rest @ ..] => {
            rest.get(..i32::from_le_bytes([*l0, *l1, *l2, *l3]).max(0) as usize)
        }
        [l0, l1, l2, l3, rest @ ..] => {
            rest.get(..i32::from_le_bytes([*l0, *l1, *l2, *l3]).max(0) as usize)
        }
        _ => None,
    }
    .ok_or_else(|| GradientStreamError::arrow("IPC message length lies outside its block"))?;
    let message = arrow_ipc::root_as_message(fb)
        .map_err(|e| GradientStreamError::arrow(format!("unreadable IPC message: {e}")))?;
    let Some(batch) = message
        .header_as_record_batch()
        .filter(|_| message.header_type() == MessageHeader::RecordBatch)
    else {
        return Ok(None); // the decoder reports the wrong message type itself
    };
    if message.bodyLength() != block.bodyLength() {
        return Err(GradientStreamError::arrow(format!(
            "IPC message declares a {}-byte body, its block {}",
            message.bodyLength(),
            block.bodyLength()
        )));
    }
    for b in batch.buffers().iter().flatten() {
        let fits = u64::try_from(b.offset())
            .ok()
            .zip(u64::try_from(b.length()).ok())
            .and_then(|(o, l)| o.checked_add(l))
            .is_some_and(|end| end <= body_len);
        if !fits {
            return Err(GradientStreamError::arrow(format!(
                "IPC buffer (offset {}, length {}) lies outside its {body_len}-byte body",
                b.offset(),
                b.length()
            )));
        }
    }
    if let Some(compression) = batch.compression() {
        let body = data.get(meta_len..).unwrap_or(&[]);
        let rows = check_compressed(&batch, compression, body, *room)?;
        *room -= rows;
    }
    Ok(Some(batch.length()))
}

/// A compressed batch, before anything is decompressed: a known codec, no more rows than
/// the gradient has room for, and no buffer (nor all of them together) declaring more
/// bytes than its rows can hold. Its row count.
fn check_compressed(
    batch: &arrow_ipc::RecordBatch<'_>,
    compression: arrow_ipc::BodyCompression<'_>,
    body: &[u8],
    room: usize,
) -> Result<usize> {
    let codec = compression.codec();
    if codec != CompressionType::LZ4_FRAME && codec != CompressionType::ZSTD {
        return Err(GradientStreamError::arrow(format!(
            "unknown IPC compression codec {}",
            codec.0
        )));
    }
    let method = compression.method();
    if method != arrow_ipc::BodyCompressionMethod::BUFFER {
        return Err(GradientStreamError::arrow(format!(
            "unknown IPC compression method {}",
            method.0
        )));
    }
    let rows = batch.length();
    let Some(count) = usize::try_from(rows).ok().filter(|&r| r <= room) else {
        return Err(GradientStreamError::arrow(format!(
            "compressed record batch declares {rows} rows, more than the {room} values \
             max_gradient_len still allows"
        )));
    };
    let mut total = 0i64;
    for b in batch.buffers().iter().flatten() {
        let length = b.length();
        if length == 0 {
            continue;
        }
        // In the body, as checked above.
        let start = b.offset() as usize;
        let prefix: Option<[u8; 8]> = body
            .get(start..start + 8)
            .filter(|_| length >= 8)
            .and_then(|p| p.try_into().ok());
        let Some(prefix) = prefix else {
            return Err(GradientStreamError::arrow(format!(
                "compressed IPC buffer of {length} bytes has no length prefix"
            )));
        };
        let declared = i64::from_le_bytes(prefix);
        if declared == -1 {
            continue;
        }
        if !(0..=rows.saturating_mul(8)).contains(&declared) {
            return Err(GradientStreamError::arrow(format!(
                "compressed IPC buffer declares {declared} bytes uncompressed, more than its \
                 {rows}-row batch can hold"
            )));
        }
        total = total.saturating_add(declared);
    }
    // All buffers together, too: a schema of many columns must not multiply the bound
    // (a seed float64 batch has 12 bytes a row).
    if total > rows.saturating_mul(16) {
        return Err(GradientStreamError::arrow(format!(
            "compressed IPC buffers declare {total} bytes uncompressed in all, more than their \
             {rows}-row batch can hold"
        )));
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Float32Array, Float64Array};
    use arrow_ipc::writer::StreamWriter;

    fn decode(payload: &[u8]) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        decode_payload(payload, &mut out, usize::MAX).map(|_| out)
    }

    fn file_of(batches: &[RecordBatch]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut w = FileWriter::try_new(&mut out, &batches[0].schema()).unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
        drop(w);
        out
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn round_trip_keeps_every_bit() {
        let values: Vec<f32> = [
            0x7fc0_0001u32,
            0xffff_ffff,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x0000_0001,
            0x3f80_0000,
        ]
        .iter()
        .map(|b| f32::from_bits(*b))
        .collect();
        let payload = encode_payload(Layout::Seed, &values).unwrap();
        assert_eq!(bits(&decode(&payload).unwrap()), bits(&values));
    }

    #[test]
    fn misaligned_values_encode_as_their_aligned_copy() {
        // value_column copies values that are not aligned to their dtype (Arrow arrays need
        // alignment); the payload must be the one the aligned values make.
        let values: Vec<f64> = vec![1.5, -0.0, f64::from_bits(0x7ff8_0000_0000_0001)];
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let mut shifted = vec![0u8; raw.len() + 8];
        // An offset that leaves the f64 values misaligned, whatever the allocation's own.
        let at = (1..8)
            .find(|&k| shifted[k..].as_ptr().align_offset(8) != 0)
            .unwrap();
        shifted[at..at + raw.len()].copy_from_slice(&raw);
        let encoding = Encoding {
            dtype: Dtype::F64,
            ..Encoding::default()
        };
        let payload = encode_payload_raw(encoding.clone(), &shifted[at..at + raw.len()]).unwrap();
        assert_eq!(payload, encode_payload_raw(encoding, &raw).unwrap());
        let mut back: Vec<f32> = Vec::new();
        decode_payload(&payload, &mut back, usize::MAX).unwrap();
        assert_eq!(back.len(), 3);
    }

    #[test]
    fn payload_is_the_seed_layout() {
        let payload = encode_payload(Layout::Seed, &[1.0, 2.0, 3.0]).unwrap();
        assert_eq!(&payload[..6], MAGIC);
        let reader =
            arrow_ipc::reader::FileReader::try_new(std::io::Cursor::new(&payload), None).unwrap();
        assert_eq!(reader.schema(), seed_schema());
        let batches: Vec<_> = reader.map(|b| b.unwrap()).collect();
        assert_eq!(batches.len(), 1);
        let index = batches[0]
            .column(0)
            .as_any()
            .downcast_ref::<Int32Array>()
            .unwrap();
        assert_eq!(index.values(), &[0, 1, 2]);
    }

    #[test]
    fn empty_chunk_is_a_valid_file() {
        let payload = encode_payload(Layout::Seed, &[]).unwrap();
        assert!(decode(&payload).unwrap().is_empty());
    }

    #[test]
    fn value_column_alone_and_several_batches_decode() {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "value",
            DataType::Float32,
            true,
        )]));
        let b1 = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Float32Array::from(vec![1.0, 2.0]))],
        )
        .unwrap();
        let b2 =
            RecordBatch::try_new(schema, vec![Arc::new(Float32Array::from(vec![3.0]))]).unwrap();
        assert_eq!(decode(&file_of(&[b1, b2])).unwrap(), vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn missing_or_mistyped_value_column_is_refused() {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Float32, false)]));
        let b =
            RecordBatch::try_new(schema, vec![Arc::new(Float32Array::from(vec![1.0]))]).unwrap();
        let err = decode(&file_of(&[b])).unwrap_err();
        assert!(err.to_string().contains("missing 'value' column"), "{err}");

        let schema = Arc::new(Schema::new(vec![Field::new(
            "value",
            DataType::Float64,
            false,
        )]));
        let b =
            RecordBatch::try_new(schema, vec![Arc::new(Float64Array::from(vec![1.5]))]).unwrap();
        // float64 is a dtype gradstream moves (here cast to the float32 `decode` makes).
        assert_eq!(decode(&file_of(&[b])).unwrap(), [1.5]);

        let schema = Arc::new(Schema::new(vec![Field::new(
            "value",
            DataType::Int32,
            false,
        )]));
        let b = RecordBatch::try_new(schema, vec![Arc::new(Int32Array::from(vec![1]))]).unwrap();
        let err = decode(&file_of(&[b])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Arrow IPC error: 'value' column is not Float16, Float32, Float64 or \
             gradstream.bfloat16"
        );
    }

    #[test]
    fn nulls_are_refused() {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "value",
            DataType::Float32,
            true,
        )]));
        let b = RecordBatch::try_new(
            schema,
            vec![Arc::new(Float32Array::from(vec![Some(1.0), None]))],
        )
        .unwrap();
        let err = decode(&file_of(&[b])).unwrap_err();
        assert!(err.to_string().contains("1 null value(s)"), "{err}");
    }

    #[test]
    fn stream_format_is_refused() {
        let schema = seed_schema();
        let b = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int32Array::from(vec![0])),
                Arc::new(Float32Array::from(vec![1.0])),
            ],
        )
        .unwrap();
        let mut out = Vec::new();
        let mut w = StreamWriter::try_new(&mut out, &schema).unwrap();
        w.write(&b).unwrap();
        w.finish().unwrap();
        drop(w);
        assert!(matches!(
            decode(&out),
            Err(GradientStreamError::ArrowIpc(_))
        ));
    }

    #[test]
    fn every_truncation_and_byte_flip_is_an_error_or_a_value_change_never_a_panic() {
        let payload = encode_payload(Layout::Seed, &[1.5, -2.25, 3.0, 4.0, 5.0]).unwrap();
        for cut in 0..payload.len() {
            assert!(decode(&payload[..cut]).is_err(), "cut at {cut}");
        }
        for i in 0..payload.len() {
            for mask in [0x01u8, 0x80, 0xff] {
                let mut bad = payload.clone();
                bad[i] ^= mask;
                // Either an error, or a vector (the flip hit values or padding).
                let _ = decode(&bad);
            }
        }
    }

    fn two_batch_file() -> Vec<u8> {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "value",
            DataType::Float32,
            false,
        )]));
        let b = RecordBatch::try_new(schema, vec![Arc::new(Float32Array::from(vec![7.0; 64]))])
            .unwrap();
        file_of(&[b.clone(), b])
    }

    fn footer_range(file: &[u8]) -> std::ops::Range<usize> {
        let len = file.len();
        let footer_len = read_footer_length(file[len - 10..].try_into().unwrap()).unwrap();
        len - 10 - footer_len..len - 10
    }

    #[test]
    fn a_block_listed_twice_is_refused_not_decoded_twice() {
        // The amplification attack: a footer naming the same block many times would
        // multiply a small payload's values.
        let mut file = two_batch_file();
        assert_eq!(decode(&file).unwrap().len(), 128);
        let range = footer_range(&file);
        let footer = arrow_ipc::root_as_footer(&file[range.clone()]).unwrap();
        let blocks = footer.recordBatches().unwrap();
        let (first, second) = (blocks.get(0).offset(), blocks.get(1).offset());
        let at = range.start
            + file[range]
                .windows(8)
                .position(|w| w == second.to_le_bytes())
                .unwrap();
        file[at..at + 8].copy_from_slice(&first.to_le_bytes());
        let err = decode(&file).unwrap_err();
        assert!(err.to_string().contains("overlaps"), "{err}");
    }

    #[test]
    fn dictionary_batches_are_refused() {
        use arrow_array::{types::Int32Type, DictionaryArray};
        let dict: DictionaryArray<Int32Type> = vec!["a", "b", "a"].into_iter().collect();
        let b = RecordBatch::try_from_iter([
            ("tag", Arc::new(dict) as Arc<dyn Array>),
            (
                "value",
                Arc::new(Float32Array::from(vec![1.0, 2.0, 3.0])) as _,
            ),
        ])
        .unwrap();
        let err = decode(&file_of(&[b])).unwrap_err().to_string();
        assert!(
            err.contains("IPC footer lists 1 dictionary batch(es); a gradient payload has none"),
            "{err}"
        );
    }

    #[test]
    fn lying_block_offsets_are_caught_before_slicing() {
        // Corrupt every 4-byte word of the footer in turn with huge numbers.
        let payload = encode_payload(Layout::Seed, &[1.0; 16]).unwrap();
        let footer_len = i32::from_le_bytes(
            payload[payload.len() - 10..payload.len() - 6]
                .try_into()
                .unwrap(),
        ) as usize;
        let start = payload.len() - 10 - footer_len;
        for at in (start..payload.len() - 10).step_by(4) {
            let mut bad = payload.clone();
            bad[at..at + 4].copy_from_slice(&0x7fff_fff0u32.to_le_bytes());
            let _ = decode(&bad);
        }
    }

    /// Where the first compressed buffer's 8-byte length prefix of the value column lies
    /// in `payload`, and the batch's row count.
    fn value_prefix(payload: &[u8]) -> (usize, i64) {
        let len = payload.len();
        let footer_len = read_footer_length(payload[len - 10..].try_into().unwrap()).unwrap();
        let footer = arrow_ipc::root_as_footer(&payload[len - 10 - footer_len..len - 10]).unwrap();
        let block = footer.recordBatches().unwrap().get(0);
        let start = block.offset() as usize;
        let meta = &payload[start..start + block.metaDataLength() as usize];
        let fb_len = i32::from_le_bytes(meta[4..8].try_into().unwrap()) as usize;
        let message = arrow_ipc::root_as_message(&meta[8..8 + fb_len]).unwrap();
        let batch = message.header_as_record_batch().unwrap();
        let buffers = batch.buffers().unwrap();
        let last = buffers.get(buffers.len() - 1);
        let body = start + block.metaDataLength() as usize;
        (body + last.offset() as usize, batch.length())
    }

    #[test]
    fn compressed_payloads_round_trip_in_both_layouts_and_codecs() {
        let mut values: Vec<f32> = vec![0.0; 5000];
        values[17] = f32::from_bits(0x7fc0_0001);
        values[4999] = -0.0;
        for layout in [Layout::Seed, Layout::Compact] {
            let plain = encode_payload(layout, &values).unwrap();
            for compression in [Compression::Lz4, Compression::Zstd] {
                let encoding = Encoding {
                    layout,
                    compression: Some(compression),
                    ..Encoding::default()
                };
                let payload = encode_payload(encoding.clone(), &values).unwrap();
                // Zeros compress; the seed layout's index column 0..n-1 hardly does.
                let factor = if layout == Layout::Compact { 4 } else { 1 };
                assert!(
                    payload.len() * factor < plain.len(),
                    "{encoding:?}: {} bytes against {} plain",
                    payload.len(),
                    plain.len()
                );
                assert_eq!(bits(&decode(&payload).unwrap()), bits(&values));
            }
        }
    }

    #[test]
    fn a_compressed_buffer_declaring_too_much_is_refused_before_decompressing() {
        let values = vec![1.5f32; 1000];
        let encoding = Encoding {
            layout: Layout::Compact,
            compression: Some(Compression::Lz4),
            ..Encoding::default()
        };
        let payload = encode_payload(encoding, &values).unwrap();
        let (at, rows) = value_prefix(&payload);
        assert_eq!(rows, 1000);
        assert_eq!(
            i64::from_le_bytes(payload[at..at + 8].try_into().unwrap()),
            4000
        );
        let mut bomb = payload.clone();
        bomb[at..at + 8].copy_from_slice(&(1i64 << 40).to_le_bytes());
        let err = decode(&bomb).unwrap_err().to_string();
        assert!(
            err.contains("declares 1099511627776 bytes uncompressed, more than its 1000-row"),
            "{err}"
        );
        // 8 bytes a row is the most a buffer of ours can take; exactly that passes the
        // check (and then fails to decompress to that size, an ordinary Arrow error).
        bomb[at..at + 8].copy_from_slice(&8000i64.to_le_bytes());
        assert!(decode(&bomb).is_err());
        // More rows than the gradient has room for: refused, whatever the buffers say.
        let mut out = Vec::new();
        let err = decode_payload(&payload, &mut out, 999)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("declares 1000 rows, more than the 999 values max_gradient_len"),
            "{err}"
        );
        assert!(decode_payload(&payload, &mut out, 1000).is_ok());
    }
}
