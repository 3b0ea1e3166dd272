//! The hostile-input guard: the checks on a payload's trailer, footer, blocks and
//! compressed buffers, made before arrow-rs sees them (arrow-rs slices with the file's
//! numbers and would panic on a lie, and allocates whatever a compressed buffer declares).
//! The reference's `_guard` makes the same checks in the same order.
//!
//! Uses `bounds`, `shared` and `error`; used by `reader`.

use arrow_buffer::Buffer;
use arrow_ipc::reader::read_footer_length;
use arrow_ipc::{Block, CompressionType, Footer, MessageHeader};

use super::bounds::{self, Column};
use super::shared::{arrow_err, MAGIC};
use crate::error::{GradientStreamError, Result};

/// Trailer: footer length (i32) then the magic.
const TRAILER_LEN: usize = 10;
/// The smallest file: 8 bytes of padded magic plus the trailer.
const MIN_FILE_LEN: usize = 8 + TRAILER_LEN;

/// A record batch block that passed the checks: the footer's entry, its bytes (metadata
/// and body), and the row count its message declares (None when the message is not a
/// record batch).
pub(super) struct CheckedBlock<'f> {
    pub block: &'f Block,
    pub data: Buffer,
    pub declared_rows: Option<i64>,
    /// The length of each of the batch's buffers, in the message's order (empty when
    /// the message is not a record batch).
    pub buffer_lens: Vec<i64>,
}

/// The footer of the IPC file in `buf`, and where it starts: after checking the magic at
/// the start and that the trailer's footer length fits the file.
pub(super) fn open_footer(buf: &Buffer) -> Result<(Footer<'_>, usize)> {
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
    Ok((footer, footer_start))
}

/// The structure first, in the reference's order (docs/spec/decoding-rules.md): the
/// record-batch list, no dictionary batches, blocks in order without overlap, each
/// batch message checked (compressed ones bounded by `room`, the values the gradient may
/// still take, and each of their buffers by what its column of the schema can need)
/// before anything is decoded.
pub(super) fn check_blocks<'f>(
    buf: &Buffer,
    footer: Footer<'f>,
    footer_start: usize,
    room: usize,
) -> Result<Vec<CheckedBlock<'f>>> {
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
    // The compressed batches of one payload share the room; their buffers are bounded by
    // the columns of the footer's schema, which the decoder reads them with.
    let mut bounds = Bounds {
        room,
        columns: bounds::columns(&footer),
    };
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
        let (declared_rows, buffer_lens) = check_batch_message(&data, block, &mut bounds)?;
        checked.push(CheckedBlock {
            block,
            data,
            declared_rows,
            buffer_lens,
        });
    }
    Ok(checked)
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

/// What a compressed batch is held to: the values the gradient may still take, and the
/// schema's columns (or the position of the first without a bound, see `bounds`).
struct Bounds {
    room: usize,
    columns: std::result::Result<Vec<Column>, usize>,
}

/// Check a record batch message against its block before arrow-rs reads it: the body
/// length must be the block's, and every buffer must lie inside the body. Returns the
/// row count the message declares (None when the message is not a record batch) and
/// its buffers' lengths.
fn check_batch_message(
    data: &Buffer,
    block: &Block,
    bounds: &mut Bounds,
) -> Result<(Option<i64>, Vec<i64>)> {
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
        return Ok((None, Vec::new())); // the decoder reports the wrong message type itself
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
        let rows = check_compressed(&batch, compression, body, bounds)?;
        bounds.room -= rows;
    }
    let lens = batch
        .buffers()
        .iter()
        .flatten()
        .map(|b| b.length())
        .collect();
    Ok((Some(batch.length()), lens))
}

/// Refuse an int8 `value` list whose offsets buffer (buffer `at` of each batch) is not a
/// whole number of 4-byte offsets, which arrow-rs would assert on (a panic, caught, but
/// its message printed for every such frame).
pub(super) fn check_offsets_width(checked: &[CheckedBlock<'_>], at: usize) -> Result<()> {
    for block in checked {
        if let Some(&len) = block.buffer_lens.get(at).filter(|&&len| len % 4 != 0) {
            return Err(GradientStreamError::arrow(format!(
                "int8 'value' list offsets take {len} bytes: not a whole number of 4-byte \
                 offsets"
            )));
        }
    }
    Ok(())
}

/// A compressed batch, before anything is decompressed: a known codec, no more rows than
/// the gradient has room for, columns whose buffers have a bound, no buffer declaring
/// more bytes than its column can need, nor all of them together more than 16 bytes a
/// row. Its row count.
fn check_compressed(
    batch: &arrow_ipc::RecordBatch<'_>,
    compression: arrow_ipc::BodyCompression<'_>,
    body: &[u8],
    bounds: &Bounds,
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
    let room = bounds.room;
    let Some(count) = usize::try_from(rows).ok().filter(|&r| r <= room) else {
        return Err(GradientStreamError::arrow(format!(
            "compressed record batch declares {rows} rows, more than the {room} values \
             max_gradient_len still allows"
        )));
    };
    let columns = bounds
        .columns
        .as_deref()
        .map_err(|&c| bounds::unbounded_column(c))?;
    let total = declared_bytes(batch, body, rows, columns)?;
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

/// The uncompressed bytes a compressed batch's buffers declare in all, each checked to
/// have a length prefix and to declare no more than its column of `columns` can need
/// in `rows` rows.
fn declared_bytes(
    batch: &arrow_ipc::RecordBatch<'_>,
    body: &[u8],
    rows: i64,
    columns: &[Column],
) -> Result<i64> {
    let mut total = 0i64;
    for (index, b) in batch.buffers().iter().flatten().enumerate() {
        let length = b.length();
        if length == 0 {
            continue;
        }
        // In the body, as check_batch_message checked.
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
        bounds::check_declared(columns, index, rows, declared)?;
        total = total.saturating_add(declared);
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::super::writer::seed_schema;
    use super::*;
    use crate::codec::{decode_payload, encode_payload, Compression, Encoding, Layout};
    use crate::testing::{decode, file_of};
    use arrow_array::{Array, Float32Array, Int32Array, RecordBatch};
    use arrow_ipc::writer::StreamWriter;
    use arrow_schema::{DataType, Field, Schema};
    use std::sync::Arc;

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
            err.ends_with(
                "compressed IPC buffer 1 (data of column 0) declares 1099511627776 bytes \
                 uncompressed; 1000 rows need at most 4000"
            ),
            "{err}"
        );
        // The column's width times the rows is the most its data can declare: one byte
        // more is refused before decompressing, as 8 bytes a row (once the bound) is.
        for declared in [4001i64, 8000] {
            bomb[at..at + 8].copy_from_slice(&declared.to_le_bytes());
            let err = decode(&bomb).unwrap_err().to_string();
            assert!(err.contains("1000 rows need at most 4000"), "{err}");
        }
        // Exactly that passes the check (and decodes: it is what the writer declared).
        bomb[at..at + 8].copy_from_slice(&4000i64.to_le_bytes());
        assert_eq!(decode(&bomb).unwrap(), values);
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
