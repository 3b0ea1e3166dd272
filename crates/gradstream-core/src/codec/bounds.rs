//! What each buffer of a compressed record batch may declare uncompressed: what its
//! column can need, read from the file's schema (docs/spec/decoding-rules.md, step 8). An
//! Arrow reader allocates whatever a compressed buffer declares, so without these bounds
//! a payload of kilobytes could make the receiver allocate gigabytes and read a gradient
//! of zeros out of it. The reference's `_guard` computes the same bounds.
//!
//! Uses `error`; used by `guard`.

use arrow_ipc::{Footer, Precision, Type};

use crate::error::{GradientStreamError, Result};

/// A top-level column of the schema, as far as the bounds go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Column {
    /// Bytes a row of its data buffer.
    width: i64,
    /// Whether it may carry a validity bitmap.
    nullable: bool,
}

/// The columns of the footer's schema (none without a schema), or the position of the
/// first one whose buffers have no bound: one that is not a flat integer or
/// floating-point column (nested, dictionary-encoded, variable-width, boolean...).
pub(super) fn columns(footer: &Footer<'_>) -> std::result::Result<Vec<Column>, usize> {
    let fields = footer.schema().and_then(|s| s.fields());
    let mut columns = Vec::new();
    for (position, field) in fields.iter().flatten().enumerate() {
        let width = match field.type_type() {
            Type::Int => field
                .type_as_int()
                .map(|t| t.bitWidth())
                .and_then(|bits| matches!(bits, 8 | 16 | 32 | 64).then_some(i64::from(bits / 8))),
            Type::FloatingPoint => {
                field
                    .type_as_floating_point()
                    .and_then(|t| match t.precision() {
                        Precision::HALF => Some(2),
                        Precision::SINGLE => Some(4),
                        Precision::DOUBLE => Some(8),
                        _ => None,
                    })
            }
            _ => None,
        };
        let nested = field.children().is_some_and(|c| !c.is_empty());
        match width {
            Some(width) if !nested && field.dictionary().is_none() => columns.push(Column {
                width,
                nullable: field.nullable(),
            }),
            _ => return Err(position),
        }
    }
    Ok(columns)
}

/// The refusal of a compressed batch whose schema has a column without a bound.
pub(super) fn unbounded_column(position: usize) -> GradientStreamError {
    GradientStreamError::arrow(format!(
        "compressed record batch has column {position} of a type other than integer or \
         floating point"
    ))
}

/// Check the uncompressed length buffer `index` of a `rows`-row batch declares against
/// what its column can need: the column's width times the rows for its data, the rows
/// over 8 rounded up for the validity bitmap of a nullable column, nothing for that of a
/// non-nullable one (it can hold no null) or for a buffer past the last column. The
/// buffers of flat columns come in pairs, validity bitmap then data, column by column.
pub(super) fn check_declared(
    columns: &[Column],
    index: usize,
    rows: i64,
    declared: i64,
) -> Result<()> {
    let (bound, what) = match columns.get(index / 2) {
        None => (0, "past the last column".to_string()),
        Some(c) if index % 2 == 1 => (
            rows.saturating_mul(c.width),
            format!("data of column {}", index / 2),
        ),
        Some(c) if c.nullable => (
            rows / 8 + i64::from(rows % 8 != 0),
            format!("validity bitmap of column {}", index / 2),
        ),
        Some(_) => (
            0,
            format!("validity bitmap of non-nullable column {}", index / 2),
        ),
    };
    if (0..=bound).contains(&declared) {
        return Ok(());
    }
    Err(GradientStreamError::arrow(format!(
        "compressed IPC buffer {index} ({what}) declares {declared} bytes uncompressed; \
         {rows} rows need at most {bound}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::file_of;
    use arrow_array::{new_empty_array, ArrayRef, RecordBatch};
    use arrow_ipc::reader::read_footer_length;
    use arrow_schema::{DataType, Field, Schema};
    use std::sync::Arc;

    /// The columns `columns` reads from the footer of a file of one batch of `fields`.
    fn columns_of(fields: Vec<Field>) -> std::result::Result<Vec<Column>, usize> {
        let arrays: Vec<ArrayRef> = fields
            .iter()
            .map(|f| new_empty_array(f.data_type()))
            .collect();
        let schema = Arc::new(Schema::new(fields));
        let file = file_of(&[RecordBatch::try_new(schema, arrays).unwrap()]);
        let len = file.len();
        let footer_len = read_footer_length(file[len - 10..].try_into().unwrap()).unwrap();
        let footer = arrow_ipc::root_as_footer(&file[len - 10 - footer_len..len - 10]).unwrap();
        columns(&footer)
    }

    #[test]
    fn integer_and_floating_point_columns_have_widths() {
        let got = columns_of(vec![
            Field::new("index", DataType::Int32, false),
            Field::new("value", DataType::Float16, true),
            Field::new("a", DataType::UInt8, true),
            Field::new("b", DataType::Int64, false),
            Field::new("c", DataType::Float32, false),
            Field::new("d", DataType::Float64, true),
        ]);
        let widths = [
            (4, false),
            (2, true),
            (1, true),
            (8, false),
            (4, false),
            (8, true),
        ];
        let want = widths.map(|(width, nullable)| Column { width, nullable });
        assert_eq!(got, Ok(want.to_vec()));
    }

    #[test]
    fn other_columns_have_none() {
        let value = Field::new("value", DataType::Float32, false);
        let others = [
            DataType::Utf8,
            DataType::Boolean,
            DataType::Null,
            DataType::Decimal128(10, 2),
            DataType::new_list(DataType::Float32, true),
            DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Float32)),
        ];
        for other in others {
            let fields = vec![value.clone(), Field::new("x", other.clone(), true)];
            assert_eq!(columns_of(fields), Err(1), "{other}");
        }
    }

    const NULLABLE_F16: Column = Column {
        width: 2,
        nullable: true,
    };
    const INDEX: Column = Column {
        width: 4,
        nullable: false,
    };

    fn detail(columns: &[Column], index: usize, rows: i64, declared: i64) -> Option<String> {
        check_declared(columns, index, rows, declared)
            .err()
            .map(|e| e.to_string())
    }

    #[test]
    fn data_may_declare_the_width_times_the_rows() {
        let columns = [INDEX, NULLABLE_F16];
        assert_eq!(detail(&columns, 1, 1000, 4000), None);
        assert_eq!(detail(&columns, 3, 1000, 2000), None);
        assert_eq!(detail(&columns, 3, 1000, 0), None);
        assert_eq!(
            detail(&columns, 3, 1000, 2001).as_deref(),
            Some(
                "Arrow IPC error: compressed IPC buffer 3 (data of column 1) declares 2001 \
                 bytes uncompressed; 1000 rows need at most 2000"
            )
        );
        assert!(detail(&columns, 1, 1000, -2).is_some());
        assert!(detail(&columns, 1, 1000, i64::MIN).is_some());
        // No overflow for the largest row counts.
        assert_eq!(detail(&columns, 1, i64::MAX, i64::MAX), None);
    }

    #[test]
    fn bitmaps_are_bounded_by_their_column() {
        let columns = [INDEX, NULLABLE_F16];
        assert_eq!(detail(&columns, 2, 1001, 126), None);
        assert_eq!(
            detail(&columns, 2, 1001, 127).as_deref(),
            Some(
                "Arrow IPC error: compressed IPC buffer 2 (validity bitmap of column 1) \
                 declares 127 bytes uncompressed; 1001 rows need at most 126"
            )
        );
        assert_eq!(detail(&columns, 2, 1000, 125), None);
        assert!(detail(&columns, 2, 1000, 126).is_some());
        assert_eq!(detail(&columns, 0, 1000, 0), None);
        assert_eq!(
            detail(&columns, 0, 1000, 1).as_deref(),
            Some(
                "Arrow IPC error: compressed IPC buffer 0 (validity bitmap of non-nullable \
                 column 0) declares 1 bytes uncompressed; 1000 rows need at most 0"
            )
        );
        assert_eq!(
            detail(&columns, 4, 1000, 8).as_deref(),
            Some(
                "Arrow IPC error: compressed IPC buffer 4 (past the last column) declares 8 \
                 bytes uncompressed; 1000 rows need at most 0"
            )
        );
    }
}
