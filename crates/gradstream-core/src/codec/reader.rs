//! The payload reader: `decode_payload` reads one chunk's Arrow IPC file into a
//! `ValueSink`, in named steps (the guard's checks, the schema and its metadata into a
//! `Head`, then the `value` column of each batch), with a panic inside arrow-rs turned
//! into an error.
//!
//! Uses `guard`, `shared`, `output` (`Head`, `ValueSink`), `dtype`, `seal` (its key) and
//! `error`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float16Type, Float32Type, Float64Type, Int8Type, UInt16Type};
use arrow_array::{Array, ArrowPrimitiveType, PrimitiveArray};
use arrow_buffer::Buffer;
use arrow_ipc::reader::FileDecoder;
use arrow_schema::{DataType, Field, Schema};

use super::guard::{self, CheckedBlock};
use super::shared::{arrow_err, borrowed_buffer, EXTENSION_NAME_KEY, MANIFEST_KEY, SHAPE_KEY};
use crate::dtype::{f32_bytes, Dtype, BF16_EXTENSION, DTYPE_KEY};
use crate::error::{GradientStreamError, Result};
use crate::int8;
use crate::output::{Head, ValueSink};
use crate::seal::SEAL_KEY;

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

/// The error for a `value` column of a type gradstream does not read.
const NOT_A_FLOAT: &str =
    "'value' column is not Float16, Float32, Float64, gradstream.bfloat16 or a list of Int8";

/// The refusal of an int8-wire payload without its scales.
const NO_SCALE: &str = "an int8 'value' column needs a Float32 'scale' column";

/// Whether a `value` field is the int8 wire's: a list of Int8, a block a row.
fn is_int8(field: &Field) -> bool {
    matches!(field.data_type(), DataType::List(item) if item.data_type() == &DataType::Int8)
}

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

/// The steps of `decode_payload`, each a function of its own: the guard's checks on the
/// file's structure, the schema into a `Head` (which `out` may refuse), then each batch's
/// `value` column.
fn decode_buffer<S: ValueSink + ?Sized>(buf: &Buffer, out: &mut S, room: usize) -> Result<Head> {
    let (footer, footer_start) = guard::open_footer(buf)?;
    let checked = guard::check_blocks(buf, footer, footer_start, room)?;
    let (schema, columns, head) = read_head(footer)?;
    if head.int8 {
        // The list's offsets come right after its validity bitmap.
        if let Some(before) = buffers_before(&schema, columns[0]) {
            guard::check_offsets_width(&checked, before + 1)?;
        }
    }
    out.begin(&head)?;
    // Only the `value` column (and an int8 wire's `scale`) is decoded; the others (the
    // index) are skipped unread.
    let decoder = FileDecoder::new(Arc::new(schema), footer.version()).with_projection(columns);
    for block in checked {
        put_batch(&decoder, block, &head, out)?;
    }
    Ok(head)
}

/// The IPC buffers of the fields before field `index` (Arrow's layout: a validity
/// bitmap, then offsets and data as the type has them, then its children's), or None
/// when one of them is of a type whose count this reader does not know.
fn buffers_before(schema: &Schema, index: usize) -> Option<usize> {
    fn buffers(field: &Field) -> Option<usize> {
        use DataType::*;
        Some(match field.data_type() {
            Null => 0,
            Boolean | Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 | Float16
            | Float32 | Float64 | Date32 | Date64 | Time32(_) | Time64(_) | Timestamp(..)
            | Duration(_) | Interval(_) | Decimal32(..) | Decimal64(..) | Decimal128(..)
            | Decimal256(..) | FixedSizeBinary(_) | Dictionary(..) => 2,
            Utf8 | Binary | LargeUtf8 | LargeBinary => 3,
            List(item) | LargeList(item) | Map(item, _) => 2 + buffers(item)?,
            ListView(item) | LargeListView(item) => 3 + buffers(item)?,
            FixedSizeList(item, _) => 1 + buffers(item)?,
            Struct(fields) => 1 + fields.iter().map(|f| buffers(f)).sum::<Option<usize>>()?,
            RunEndEncoded(run_ends, values) => buffers(run_ends)? + buffers(values)?,
            _ => return None,
        })
    }
    schema.fields()[..index].iter().map(|f| buffers(f)).sum()
}

/// The file's schema (in this machine's byte order), the columns to decode (`value`, and
/// an int8 wire's `scale` after it), and the `Head`: that column's dtype and the metadata
/// gradstream reads.
fn read_head(footer: arrow_ipc::Footer<'_>) -> Result<(Schema, Vec<usize>, Head)> {
    let fb_schema = footer
        .schema()
        .ok_or_else(|| GradientStreamError::arrow("IPC footer has no schema"))?;
    if !fb_schema.endianness().equals_to_target_endianness() {
        return Err(GradientStreamError::arrow(
            "IPC file has the other byte order",
        ));
    }
    let schema = arrow_ipc::convert::try_fb_to_schema(fb_schema).map_err(arrow_err)?;
    let first = |key: &str| first_metadata(fb_schema, key);
    let value_idx = schema
        .index_of("value")
        .map_err(|_| GradientStreamError::arrow("Arrow IPC block missing 'value' column"))?;
    let int8 = is_int8(schema.field(value_idx));
    let (column, columns) = if int8 {
        // The first field named `scale`, as for `value`.
        let scale_idx = schema
            .fields()
            .iter()
            .position(|f| f.name() == "scale")
            .filter(|&i| schema.field(i).data_type() == &DataType::Float32)
            .ok_or_else(|| GradientStreamError::arrow(NO_SCALE))?;
        (Dtype::F32, vec![value_idx, scale_idx])
    } else {
        (column_dtype(schema.field(value_idx))?, vec![value_idx])
    };
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
        int8,
        shape: first(SHAPE_KEY),
        dtype,
        manifest: first(MANIFEST_KEY),
        seal: first(SEAL_KEY),
    };
    Ok((schema, columns, head))
}

/// The first entry of a key, as pyarrow reads it (arrow-rs's map keeps the last): a
/// payload listing a key twice must not decode differently in the two.
fn first_metadata(fb_schema: arrow_ipc::Schema<'_>, key: &str) -> Option<String> {
    fb_schema.custom_metadata().and_then(|entries| {
        entries
            .iter()
            .find(|kv| kv.key() == Some(key))
            .map(|kv| kv.value().unwrap_or_default().to_string())
    })
}

/// Decode one checked block and hand its `value` column (of the head's dtype, or the int8
/// wire's values as float32) to `out`: as many rows as its message declares, none null.
fn put_batch<S: ValueSink + ?Sized>(
    decoder: &FileDecoder,
    checked: CheckedBlock<'_>,
    head: &Head,
    out: &mut S,
) -> Result<()> {
    let CheckedBlock {
        block,
        data,
        declared_rows,
        ..
    } = checked;
    // A block whose message is of type NONE decodes to "no batch" in arrow-rs; the
    // original would skip it silently, losing whatever the block was meant to hold.
    let batch = decoder
        .read_record_batch(block, &data)
        .map_err(arrow_err)?
        .ok_or_else(|| {
            GradientStreamError::arrow("IPC record batch block holds no record batch")
        })?;
    let values = batch.column(0);
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
    if head.int8 {
        return put_int8(values.as_ref(), batch.column(1).as_ref(), out);
    }
    out.put_raw(column_bytes(values.as_ref(), head.column)?, head.column);
    Ok(())
}

/// The values of an int8 wire's batch (its `value` list column and `scale` column, the
/// list's nulls checked by the caller), block by block as float32.
fn put_int8<S: ValueSink + ?Sized>(
    values: &dyn Array,
    scale: &dyn Array,
    out: &mut S,
) -> Result<()> {
    let lists = values
        .as_list_opt::<i32>()
        .ok_or_else(|| GradientStreamError::arrow(NOT_A_FLOAT))?;
    let scales = scale
        .as_primitive_opt::<Float32Type>()
        .ok_or_else(|| GradientStreamError::arrow(NO_SCALE))?;
    let items = lists
        .values()
        .as_primitive_opt::<Int8Type>()
        .ok_or_else(|| GradientStreamError::arrow(NOT_A_FLOAT))?;
    let nulls = [
        ("'scale'", scales.null_count()),
        ("'value' column's Int8", items.null_count()),
    ];
    if let Some((what, nulls)) = nulls.into_iter().find(|&(_, n)| n > 0) {
        return Err(GradientStreamError::arrow(format!(
            "{what} column has {nulls} null value(s)"
        )));
    }
    let q = items.values();
    let mut block = Vec::with_capacity(int8::BLOCK);
    for (window, &scale) in lists.offsets().windows(2).zip(scales.values().iter()) {
        // Offsets were validated against the child's length by the IPC reader.
        let (start, end) = (window[0] as usize, window[1] as usize);
        let row = q.get(start..end).ok_or_else(|| {
            GradientStreamError::arrow("int8 'value' list offsets lie outside its values")
        })?;
        block.clear();
        int8::dequantize(row, scale, &mut block);
        out.put_raw(f32_bytes(&block), Dtype::F32);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{decode, file_of};
    use arrow_array::{Float32Array, Float64Array, Int32Array, RecordBatch};

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
        assert_eq!(err.to_string(), format!("Arrow IPC error: {NOT_A_FLOAT}"));
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
}
