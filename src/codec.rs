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

use arrow_array::{Array, Float32Array, Int32Array, RecordBatch};
use arrow_buffer::Buffer;
use arrow_ipc::reader::{read_footer_length, FileDecoder};
use arrow_ipc::writer::FileWriter;
use arrow_ipc::{Block, MessageHeader};
use arrow_schema::{DataType, Field, Schema, SchemaRef};

use crate::error::{GradientStreamError, Result};
use crate::output::ValueSink;

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

/// Encode one chunk's values as an Arrow IPC file in `layout`.
pub fn encode_payload(layout: Layout, values: &[f32]) -> Result<Vec<u8>> {
    // Column data is 4 or 8 bytes a value; schema, footer and padding stay under 1 KiB.
    let mut out = Vec::with_capacity(values.len() * layout.bytes_per_value() + 1024);
    encode_to(layout, values, &mut out)?;
    Ok(out)
}

/// Append the file of `values` in `layout` to `out`.
pub fn append_payload(layout: Layout, values: &[f32], out: &mut Vec<u8>) -> Result<()> {
    encode_to(layout, values, out)
}

fn encode_to(layout: Layout, values: &[f32], out: impl std::io::Write) -> Result<()> {
    // SAFETY: the buffer borrows `values`; it lives in `batch`, which is dropped before
    // this function returns (the writer copies bytes out and keeps no reference).
    let value_bytes = unsafe { borrowed_buffer(f32_bytes(values)) };
    let value = Arc::new(Float32Array::new(value_bytes.into(), None));
    let batch = match layout {
        Layout::Seed => {
            let index = Arc::new(index_column(values.len())?);
            RecordBatch::try_new(seed_schema(), vec![index, value])
        }
        Layout::Compact => RecordBatch::try_new(compact_schema(), vec![value]),
    }
    .map_err(arrow_err)?;
    let mut writer = FileWriter::try_new(out, &batch.schema()).map_err(arrow_err)?;
    writer.write(&batch).map_err(arrow_err)?;
    writer.finish().map_err(arrow_err)?;
    Ok(())
}

/// Write the file of `values` in `layout` into `out`, which must be exactly its length
/// (as measured by an earlier `encode_payload` of as many values).
pub fn encode_payload_exact(layout: Layout, values: &[f32], out: &mut [u8]) -> Result<()> {
    let expected = out.len();
    let mut cursor = std::io::Cursor::new(out);
    encode_to(layout, values, &mut cursor)?;
    let written = cursor.position() as usize;
    if written != expected {
        return Err(GradientStreamError::arrow(format!(
            "payload of {} values took {written} bytes, {expected} were planned",
            values.len()
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
pub fn decode_payload<S: ValueSink + ?Sized>(payload: &[u8], out: &mut S) -> Result<()> {
    // SAFETY: `buffer` and all arrays decoded from it (batches)
    // live inside `decode_buffer` and are dropped before it returns, unwinding included;
    // only copied values leave it. Misaligned buffers are copied by arrow-rs itself.
    let buffer = unsafe { borrowed_buffer(payload) };
    match catch_unwind(AssertUnwindSafe(|| decode_buffer(&buffer, out))) {
        Ok(result) => result,
        Err(_) => Err(GradientStreamError::arrow(
            "malformed Arrow IPC file (the decoder rejected its layout)",
        )),
    }
}

fn arrow_err(e: arrow_schema::ArrowError) -> GradientStreamError {
    GradientStreamError::arrow(e.to_string())
}

fn decode_buffer<S: ValueSink + ?Sized>(buf: &Buffer, out: &mut S) -> Result<()> {
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
    let fb_schema = footer
        .schema()
        .ok_or_else(|| GradientStreamError::arrow("IPC footer has no schema"))?;
    if !fb_schema.endianness().equals_to_target_endianness() {
        return Err(GradientStreamError::arrow(
            "IPC file has the other byte order",
        ));
    }
    let schema = arrow_ipc::convert::try_fb_to_schema(fb_schema).map_err(arrow_err)?;

    let value_idx = schema
        .index_of("value")
        .map_err(|_| GradientStreamError::arrow("Arrow IPC block missing 'value' column"))?;
    if schema.field(value_idx).data_type() != &DataType::Float32 {
        return Err(GradientStreamError::arrow("'value' column is not Float32"));
    }

    // Only the `value` column is decoded; the others (the index) are skipped unread. The
    // value column is Float32, never dictionary-encoded, so the footer's dictionary blocks
    // are not read at all: decoding them would let a peer build arbitrary Arrow types.
    let decoder =
        FileDecoder::new(Arc::new(schema), footer.version()).with_projection(vec![value_idx]);
    let blocks = footer
        .recordBatches()
        .ok_or_else(|| GradientStreamError::arrow("IPC footer lists no record batches"))?;
    // Blocks must come in file order without overlapping, as every writer lays them out:
    // a footer naming one block many times would otherwise multiply its values, making a
    // small payload decode to gigabytes.
    let mut free_from = 8usize;
    for block in blocks {
        let data = block_data(buf, block, footer_start)?;
        let start = block.offset() as usize; // checked by block_data
        if start < free_from {
            return Err(GradientStreamError::arrow(format!(
                "IPC record batch block at offset {start} overlaps the one before it"
            )));
        }
        free_from = start + data.len();
        let declared_rows = check_batch_message(&data, block)?;
        // A block whose message is of type NONE decodes to "no batch" in arrow-rs; the
        // original would skip it silently, losing whatever the block was meant to hold.
        let batch = decoder
            .read_record_batch(block, &data)
            .map_err(arrow_err)?
            .ok_or_else(|| {
                GradientStreamError::arrow("IPC record batch block holds no record batch")
            })?;
        let column = batch
            .column(0)
            .as_any()
            .downcast_ref::<Float32Array>()
            .ok_or_else(|| GradientStreamError::arrow("'value' column is not Float32"))?;
        if declared_rows.is_some_and(|rows| rows != column.len() as i64) {
            return Err(GradientStreamError::arrow(format!(
                "'value' column holds {} values but its record batch declares {} rows",
                column.len(),
                declared_rows.unwrap_or_default()
            )));
        }
        if column.null_count() > 0 {
            return Err(GradientStreamError::arrow(format!(
                "'value' column has {} null value(s)",
                column.null_count()
            )));
        }
        out.put(column.values());
    }
    Ok(())
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
fn check_batch_message(data: &Buffer, block: &Block) -> Result<Option<i64>> {
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
    Ok(Some(batch.length()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Float64Array;
    use arrow_ipc::writer::StreamWriter;

    fn decode(payload: &[u8]) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        decode_payload(payload, &mut out).map(|()| out)
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
            RecordBatch::try_new(schema, vec![Arc::new(Float64Array::from(vec![1.0]))]).unwrap();
        let err = decode(&file_of(&[b])).unwrap_err();
        assert!(err.to_string().contains("not Float32"), "{err}");
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
            Err(GradientStreamError::ArrowIpc { .. })
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
    fn dictionary_columns_beside_the_values_are_skipped_unread() {
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
        assert_eq!(decode(&file_of(&[b])).unwrap(), vec![1.0, 2.0, 3.0]);
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
}
