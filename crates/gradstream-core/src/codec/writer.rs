//! The payload writer: `Layout` (which columns), `Compression` (Arrow IPC buffer
//! compression), `Encoding` (layout, compression, dtype and metadata of one payload),
//! the schemas, and `encode_payload*`, which write one chunk as an Arrow IPC file.
//!
//! Uses `shared`, `dtype`, `seal` (its key and text) and `error`; the reader and the guard never use it (its tests
//! decode, to round-trip).

use std::sync::{Arc, OnceLock};

use arrow_array::types::{Float16Type, Float32Type, Float64Type, UInt16Type};
use arrow_array::{
    ArrowPrimitiveType, Float32Array, Int32Array, Int8Array, ListArray, PrimitiveArray, RecordBatch,
};
use arrow_buffer::{Buffer, OffsetBuffer};
use arrow_ipc::writer::{FileWriter, IpcWriteOptions};
use arrow_ipc::CompressionType;
use arrow_schema::{DataType, Field, Schema, SchemaRef};

use super::shared::{
    arrow_err, borrowed_buffer, EXTENSION_METADATA_KEY, EXTENSION_NAME_KEY, MANIFEST_KEY, SHAPE_KEY,
};
use crate::dtype::{f32_bytes, Dtype, BF16_EXTENSION, DTYPE_KEY};
use crate::error::{GradientStreamError, Result};
use crate::int8;
use crate::seal::{SealText, SEAL_KEY};

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

    pub(super) fn ipc(self) -> CompressionType {
        match self {
            Self::Lz4 => CompressionType::LZ4_FRAME,
            Self::Zstd => CompressionType::ZSTD,
        }
    }
}

/// How a payload is written: its columns, its compression, and the metadata.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Encoding {
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
    /// `gradstream_seal` metadata: this chunk's seal.
    pub seal: Option<SealText>,
    /// Write the values (float32, `dtype`) as the int8 wire: a `value` column of int8
    /// blocks and a `scale` column, whatever the layout (docs/spec/wire-format.md).
    pub int8: bool,
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
    /// Whether this writes a float32 payload that templates reproduce: no compression and
    /// no metadata but a seal (whose text has one width, so a template patches it in) and
    /// a shape (the same text in every payload of a gradient: a template of its own).
    pub fn is_templated(&self) -> bool {
        self.compression.is_none()
            && self.dtype == Dtype::F32
            && self.result.is_none()
            && self.manifest.is_none()
            && !self.int8
    }

    /// The same encoding with this chunk's seal.
    pub fn sealed(self, seal: Option<SealText>) -> Self {
        Self { seal, ..self }
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
        if let Some(seal) = &self.seal {
            metadata.insert(SEAL_KEY.to_string(), seal.as_str().to_string());
        }
        if self.int8 {
            return Arc::new(Schema::new_with_metadata(int8_fields(), metadata));
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

/// The columns of an int8-wire payload: each row a block, its int8 values and its scale.
fn int8_fields() -> Vec<Field> {
    vec![
        Field::new("value", int8_value_type(), false),
        Field::new("scale", DataType::Float32, false),
    ]
}

/// The item of an int8-wire `value` list: its non-null Int8 values.
fn int8_item() -> Arc<Field> {
    Arc::new(Field::new("item", DataType::Int8, false))
}

/// The Arrow type of an int8-wire `value` column: a list of non-null Int8 per block.
fn int8_value_type() -> DataType {
    DataType::List(int8_item())
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
pub(super) fn seed_schema() -> SchemaRef {
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
pub(crate) fn encode_payload(encoding: impl Into<Encoding>, values: &[f32]) -> Result<Vec<u8>> {
    encode_payload_raw(encoding, f32_bytes(values))
}

/// Encode one chunk's values, given as the bytes of values of `encoding.dtype`.
pub(crate) fn encode_payload_raw(encoding: impl Into<Encoding>, raw: &[u8]) -> Result<Vec<u8>> {
    let encoding = encoding.into();
    // Column data is a few bytes a value; schema, footer and padding stay under 1 KiB
    // (plus the metadata).
    let n = raw.len() / encoding.dtype.width();
    let metadata = encoding.manifest.as_ref().map_or(0, |m| m.len());
    let columns = if encoding.int8 {
        n + n.div_ceil(int8::BLOCK) * 8
    } else {
        raw.len() + n * (encoding.layout.bytes_per_value() - 4)
    };
    let mut out = Vec::with_capacity(columns + 1024 + metadata);
    encode_to(encoding, raw, &mut out)?;
    Ok(out)
}

/// Append the file of `values` to `out`.
pub(crate) fn append_payload(
    encoding: impl Into<Encoding>,
    raw: &[u8],
    out: &mut Vec<u8>,
) -> Result<()> {
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
    if encoding.int8 {
        let batch = int8_batch(&encoding, raw)?;
        return write_file(&encoding, &batch, out);
    }
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
    write_file(&encoding, &batch, out)
}

/// The record batch of an int8-wire payload: `raw` (float32 values) quantized by blocks.
fn int8_batch(encoding: &Encoding, raw: &[u8]) -> Result<RecordBatch> {
    if encoding.dtype != Dtype::F32 || !raw.len().is_multiple_of(4) {
        return Err(GradientStreamError::arrow(
            "the int8 wire quantizes float32 values",
        ));
    }
    // A compressed list column has no bound a receiver could hold its buffers to, so
    // every receiver refuses it. The bindings refuse the pair as a setting first; this
    // holds every other caller of the core to it.
    if let Some(codec) = encoding.compression {
        return Err(GradientStreamError::arrow(format!(
            "the int8 wire does not combine with compression {}: receivers refuse compressed \
             list columns",
            codec.name()
        )));
    }
    let values: std::borrow::Cow<'_, [f32]> = match crate::encoder::as_f32(raw) {
        Some(values) => values.into(),
        None => raw
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect::<Vec<f32>>()
            .into(),
    };
    let (mut q, mut scales) = (Vec::new(), Vec::new());
    int8::quantize(&values, &mut q, &mut scales);
    let ends = (0..values.len())
        .step_by(int8::BLOCK)
        .map(|start| (start + int8::BLOCK).min(values.len()));
    let offsets = std::iter::once(0)
        .chain(ends)
        .map(|end| {
            i32::try_from(end).map_err(|_| {
                GradientStreamError::arrow(format!(
                    "a chunk of {} values does not fit an int8 list column",
                    values.len()
                ))
            })
        })
        .collect::<Result<Vec<i32>>>()?;
    let list = ListArray::try_new(
        int8_item(),
        OffsetBuffer::new(offsets.into()),
        Arc::new(Int8Array::from(q)),
        None,
    )
    .map_err(arrow_err)?;
    let scale = Float32Array::from(scales);
    RecordBatch::try_new(encoding.schema(), vec![Arc::new(list), Arc::new(scale)])
        .map_err(arrow_err)
}

/// Write `batch` as an Arrow IPC file of one batch, compressed as `encoding` says.
fn write_file(encoding: &Encoding, batch: &RecordBatch, out: impl std::io::Write) -> Result<()> {
    let options = IpcWriteOptions::default()
        .try_with_compression(encoding.compression.map(Compression::ipc))
        .map_err(arrow_err)?;
    let mut writer =
        FileWriter::try_new_with_options(out, &batch.schema(), options).map_err(arrow_err)?;
    writer.write(batch).map_err(arrow_err)?;
    writer.finish().map_err(arrow_err)?;
    Ok(())
}

/// Write the file of `values` as `encoding` says (templated: float32, no compression, at
/// most a seal and a shape) into `out`, which must be exactly its length (as measured by
/// an earlier `encode_payload` of as many values).
pub(crate) fn encode_payload_exact(encoding: Encoding, raw: &[u8], out: &mut [u8]) -> Result<()> {
    let expected = out.len();
    let mut cursor = std::io::Cursor::new(out);
    encode_to(encoding, raw, &mut cursor)?;
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

#[cfg(test)]
mod tests {
    use super::super::shared::MAGIC;
    use super::*;
    use crate::codec::decode_payload;
    use crate::testing::{bits, decode};

    #[test]
    fn round_trip_keeps_every_bit() {
        let mut values = crate::testing::special_floats();
        values.push(1.0);
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
    fn the_int8_wire_is_written_uncompressed_or_not_at_all() {
        let values = [1.0f32, -2.0, 0.5];
        let int8 = Encoding {
            int8: true,
            ..Encoding::default()
        };
        let payload = encode_payload(int8.clone(), &values).unwrap();
        assert_eq!(decode(&payload).unwrap().len(), 3);
        for compression in [Compression::Lz4, Compression::Zstd] {
            let compressed = Encoding {
                compression: Some(compression),
                ..int8.clone()
            };
            let err = encode_payload(compressed, &values).unwrap_err();
            assert!(
                err.to_string()
                    .contains("does not combine with compression"),
                "{err}"
            );
        }
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
}
