//! A tensor set's manifest (docs/guides/tensor-sets.md): its entries, the JSON text a sender
//! writes (`manifest_json`, byte for byte what Python's `json.dumps(ensure_ascii=False)`
//! writes), the checks of a tensor name (`check_name`, the sender's and the receiver's),
//! and receiver rule 2 on a manifest's text (`read_manifest`): the same checks, in the same
//! order and words, as the reference's `gradstream.reference._manifest`.
//!
//! Uses `json`, `ascii`, `dtype`, `shape` and `error`; used by the set's sender and receiver.

use std::collections::HashSet;

use super::ascii::quote_str;
use super::json::{self, quote, Json};
use crate::dtype::Dtype;
use crate::error::{GradientStreamError, Result};
use crate::shape::{numpy_can_make, shape_text};

/// The manifest's `format`.
pub const FORMAT: &str = "gradstream.tensors";
/// The manifest's `version`, the only one read.
pub const VERSION: u32 = 1;
/// The longest tensor name, in UTF-8 bytes.
pub const MAX_NAME_BYTES: usize = 1024;
/// The most dimensions of a tensor's shape, as `gradient_shape` allows.
pub const MAX_DIMS: usize = 32;
/// The most digits of a dimension, as `gradient_shape` allows.
pub const DIM_DIGITS: usize = 18;

const TOP_KEYS: [&str; 3] = ["format", "version", "tensors"];
const ENTRY_KEYS: [&str; 3] = ["name", "dtype", "shape"];
const FOUR_DTYPES: &str = "float16, bfloat16, float32 or float64";

/// One tensor of a set as its manifest names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl Entry {
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>) -> Self {
        Self {
            name: name.into(),
            dtype,
            shape,
        }
    }

    /// Its element count: what its gradient may hold (max_gradient_len, at least 1, when
    /// it is received). A shape numpy cannot make saturates (`check_shape` refuses it).
    pub fn len(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        self.shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .unwrap_or(usize::MAX)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A sender's check of the shape: at most 32 dimensions (the sender's own message),
    /// then what a receiver would refuse in a manifest (dimensions of more than 18 digits,
    /// a shape numpy cannot make), in the receiver's words.
    pub fn check_shape(&self) -> Result<()> {
        let name = Some(self.name.as_str());
        if self.shape.len() > MAX_DIMS {
            return Err(GradientStreamError::tensor_set(
                format!(
                    "tensor {} has {} dimensions; a tensor set carries at most {MAX_DIMS}",
                    quote_str(&self.name),
                    self.shape.len()
                ),
                name,
            ));
        }
        let dims: Vec<Json> = self
            .shape
            .iter()
            .map(|d| Json::Int(d.to_string()))
            .collect();
        for dim in &dims {
            check_dim(dim, &self.name)?;
        }
        let wide: Vec<u64> = self.shape.iter().map(|&d| d as u64).collect();
        check_makeable(&wide, &Json::Array(dims), &self.name)
    }
}

/// The message for a sender's name that has no UTF-8 form (a Python `str` holding a lone
/// surrogate, which a Rust `String` cannot hold): `units` is the name as UTF-16 code units.
pub fn unencodable_name_detail(units: impl Iterator<Item = u16>) -> String {
    format!(
        "tensor name {} is not valid Unicode text (a lone surrogate): it has no UTF-8 form",
        super::ascii::clip(super::ascii::quote_units(units))
    )
}

/// A tensor name: non-empty, of at most 1024 UTF-8 bytes, not in `taken` (to which it is
/// then added). `TensorSet` carrying the name otherwise.
pub fn check_name<'n>(name: &'n str, taken: &mut HashSet<&'n str>) -> Result<()> {
    let refuse = |detail: String| Err(GradientStreamError::tensor_set(detail, Some(name)));
    if name.is_empty() {
        return refuse("a tensor name is empty; names are non-empty strings".into());
    }
    if name.len() > MAX_NAME_BYTES {
        return refuse(format!(
            "tensor name {} takes {} UTF-8 bytes, above the limit of {MAX_NAME_BYTES}",
            quote_str(name),
            name.len()
        ));
    }
    if !taken.insert(name) {
        return refuse(format!(
            "tensor name {} appears twice in the tensor set",
            quote_str(name)
        ));
    }
    Ok(())
}

/// The manifest's text: compact JSON, keys in the docs/spec/decoding-rules.md order, names as they
/// are (not
/// escaped to ASCII), as the Python implementations write it.
pub fn manifest_json(entries: &[Entry]) -> String {
    let mut out = format!("{{\"format\":\"{FORMAT}\",\"version\":{VERSION},\"tensors\":[");
    for (i, entry) in entries.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"name\":");
        push_json_string(&mut out, &entry.name);
        out.push_str(",\"dtype\":\"");
        out.push_str(entry.dtype.name());
        out.push_str("\",\"shape\":");
        out.push_str(&shape_text(&entry.shape));
        out.push('}');
    }
    out.push_str("]}");
    out
}

/// `text` as a JSON string the way `json.dumps(ensure_ascii=False)` writes it: `"` and
/// `\` escaped, the short escapes for `\n \r \t \b \f`, other characters below U+0020
/// as `\u00XX`, everything else as it is.
fn push_json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------- reading

fn refuse<T>(detail: String, name: Option<&str>) -> Result<T> {
    Err(GradientStreamError::tensor_set(detail, name))
}

/// Receiver rule 2 on a manifest's text: its entries, in order, or the `TensorSet` error
/// of the first problem met (`name` the tensor concerned, when there is one). The sum of
/// the element counts against max_gradient_len is the receiver's to check.
pub fn read_manifest(text: &str) -> Result<Vec<Entry>> {
    let document = json::parse(text)?;
    let tensors = header_fields(&document)?;
    let mut taken = HashSet::new();
    let count = tensors.len();
    tensors
        .iter()
        .enumerate()
        .map(|(k, item)| {
            let where_ = format!("tensor set manifest entry {} of {count}", k + 1);
            entry(item, &where_, &mut taken)
        })
        .collect()
}

/// Every key of `keys` present (the first missing one named), then no other.
fn keys_exactly(
    pairs: &[(String, Json)],
    keys: &[&str],
    what: &str,
    name: Option<&str>,
) -> Result<()> {
    if let Some(missing) = keys
        .iter()
        .find(|k| !pairs.iter().any(|(key, _)| key == *k))
    {
        return refuse(format!("{what} has no {} key", quote_str(missing)), name);
    }
    if let Some((extra, _)) = pairs.iter().find(|(key, _)| !keys.contains(&key.as_str())) {
        return refuse(
            format!(
                "{what} has an unexpected key {} (its keys are {})",
                quote_str(extra),
                keys.join(", ")
            ),
            name,
        );
    }
    Ok(())
}

/// The value of a key `keys_exactly` found.
fn field<'j>(pairs: &'j [(String, Json)], key: &str) -> &'j Json {
    const ABSENT: &Json = &Json::Null;
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map_or(ABSENT, |(_, v)| v)
}

/// The top-level object checked (format, version); its `tensors` array.
fn header_fields(document: &Json) -> Result<&[Json]> {
    let Json::Object(pairs) = document else {
        return refuse(
            format!(
                "tensor set manifest is a JSON {}, not an object",
                document.kind()
            ),
            None,
        );
    };
    keys_exactly(pairs, &TOP_KEYS, "tensor set manifest", None)?;
    let format = field(pairs, "format");
    if !matches!(format, Json::Str(f) if f == FORMAT) {
        return refuse(
            format!(
                "tensor set manifest format is {}, not {}",
                quote(format),
                quote_str(FORMAT)
            ),
            None,
        );
    }
    let version = field(pairs, "version");
    if !matches!(version, Json::Int(v) if *v == VERSION.to_string()) {
        return refuse(
            format!(
                "tensor set manifest version {} is not supported (this gradstream reads \
                 version {VERSION})",
                quote(version)
            ),
            None,
        );
    }
    match field(pairs, "tensors") {
        Json::Array(items) => Ok(items),
        other => refuse(
            format!(
                "tensor set manifest {} is a JSON {}, not an array",
                quote_str("tensors"),
                other.kind()
            ),
            None,
        ),
    }
}

fn entry<'j>(item: &'j Json, where_: &str, taken: &mut HashSet<&'j str>) -> Result<Entry> {
    let Json::Object(pairs) = item else {
        return refuse(
            format!("{where_} is a JSON {}, not an object", item.kind()),
            None,
        );
    };
    let name = match item.get("name") {
        Some(Json::Str(name)) => Some(name.as_str()),
        _ => None,
    };
    // The keys first, so a missing or extra key is named before a bad name.
    keys_exactly(pairs, &ENTRY_KEYS, where_, name)?;
    let Some(name) = name else {
        let kind = field(pairs, "name").kind();
        return refuse(
            format!("{where_}: its name is a JSON {kind}, not a string"),
            None,
        );
    };
    check_name(name, taken)?;
    let dtype = match field(pairs, "dtype") {
        Json::Str(d) => Dtype::from_name(d),
        _ => None,
    };
    let Some(dtype) = dtype else {
        return refuse(
            format!(
                "tensor {}: dtype {} is not {FOUR_DTYPES}",
                quote_str(name),
                quote(field(pairs, "dtype"))
            ),
            Some(name),
        );
    };
    let shape = dims(field(pairs, "shape"), name)?;
    Ok(Entry::new(name, dtype, shape))
}

/// One dimension: a JSON integer, not negative, of at most 18 digits.
fn check_dim(dim: &Json, name: &str) -> Result<u64> {
    match dim {
        Json::Int(digits) if !digits.starts_with('-') && digits.len() <= DIM_DIGITS => {
            digits.parse().map_err(|_| bad_dim(dim, name))
        }
        _ => Err(bad_dim(dim, name)),
    }
}

fn bad_dim(dim: &Json, name: &str) -> GradientStreamError {
    GradientStreamError::tensor_set(
        format!(
            "tensor {}: shape dimension {} is not an integer of at most {DIM_DIGITS} digits",
            quote_str(name),
            quote(dim)
        ),
        Some(name),
    )
}

/// What numpy can make an array of (its non-zero dimensions multiply to at most 2^60).
fn check_makeable(dims: &[u64], shape: &Json, name: &str) -> Result<()> {
    if numpy_can_make(dims) && dims.iter().all(|&d| usize::try_from(d).is_ok()) {
        return Ok(());
    }
    refuse(
        format!(
            "tensor {}: its shape {} is beyond what numpy can make (its non-zero dimensions \
             multiply past 2**60)",
            quote_str(name),
            quote(shape)
        ),
        Some(name),
    )
}

/// An entry's shape: an array of at most 32 integers of at most 18 digits, which numpy
/// can make an array of (as gradient_shape allows).
fn dims(shape: &Json, name: &str) -> Result<Vec<usize>> {
    let Json::Array(items) = shape else {
        return refuse(
            format!(
                "tensor {}: its shape is a JSON {}, not an array of integers",
                quote_str(name),
                shape.kind()
            ),
            Some(name),
        );
    };
    if items.len() > MAX_DIMS {
        return refuse(
            format!(
                "tensor {}: its shape has {} dimensions, more than {MAX_DIMS}",
                quote_str(name),
                items.len()
            ),
            Some(name),
        );
    }
    let dims = items
        .iter()
        .map(|dim| check_dim(dim, name))
        .collect::<Result<Vec<u64>>>()?;
    check_makeable(&dims, shape, name)?;
    // check_makeable saw every dimension fit a usize.
    Ok(dims.iter().map(|&d| d as usize).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEAD: &str = r#"{"format":"gradstream.tensors","version":1,"tensors":"#;

    /// A manifest of the given entries' JSON texts.
    fn doc(entries: &[&str]) -> String {
        format!("{HEAD}[{}]}}", entries.join(","))
    }

    fn refused(text: &str) -> (String, Option<String>) {
        match read_manifest(text) {
            Err(GradientStreamError::TensorSet { detail, name }) => (detail, name),
            other => panic!("{text}: {other:?}"),
        }
    }

    #[test]
    fn the_documented_form_is_written_and_read() {
        let entries = vec![
            Entry::new("fc.weight", Dtype::F32, vec![768, 3072]),
            Entry::new("s", Dtype::BF16, vec![]),
            Entry::new("e", Dtype::F64, vec![0, 999_999_999_999_999_999]),
        ];
        let text = manifest_json(&entries);
        assert_eq!(
            text,
            r#"{"format":"gradstream.tensors","version":1,"tensors":[{"name":"fc.weight","dtype":"float32","shape":[768,3072]},{"name":"s","dtype":"bfloat16","shape":[]},{"name":"e","dtype":"float64","shape":[0,999999999999999999]}]}"#
        );
        assert_eq!(read_manifest(&text).unwrap(), entries);
        assert_eq!(entries[0].len(), 768 * 3072);
        assert_eq!((entries[1].len(), entries[2].len()), (1, 0));
        let loose = format!(
            r#"{{ "tensors" : [ {{"shape":[{}], "dtype":"float16", "name":"\u00e9"}} ], "version":1, "format":"gradstream.tensors" }}"#,
            vec!["1"; 32].join(",")
        );
        assert_eq!(
            read_manifest(&loose).unwrap(),
            [Entry::new("\u{e9}", Dtype::F16, vec![1; 32])]
        );
        assert_eq!(read_manifest(&doc(&[])).unwrap(), []);
    }

    #[test]
    fn names_are_written_as_python_writes_them() {
        let name = "q\"\\/\n\r\t\u{8}\u{c}\u{1}\u{1f}\u{7f}\u{e9}\u{1f600}";
        let text = manifest_json(&[Entry::new(name, Dtype::F16, vec![2])]);
        assert_eq!(
            text,
            format!(
                "{HEAD}[{{\"name\":\"q\\\"\\\\/\\n\\r\\t\\b\\f\\u0001\\u001f\u{7f}\u{e9}\u{1f600}\",\
                 \"dtype\":\"float16\",\"shape\":[2]}}]}}"
            )
        );
        assert_eq!(read_manifest(&text).unwrap()[0].name, name);
    }

    #[test]
    fn the_top_level_object_is_checked_in_the_references_words() {
        let cases = [
            (
                "[1]".to_string(),
                "tensor set manifest is a JSON array, not an object",
            ),
            (
                r#"{"format":"gradstream.tensors","version":1}"#.into(),
                r#"tensor set manifest has no "tensors" key"#,
            ),
            (
                format!(r#"{HEAD}[],"extra":1}}"#),
                r#"tensor set manifest has an unexpected key "extra" (its keys are format, version, tensors)"#,
            ),
            (
                r#"{"format":"gradstream.gradients","version":1,"tensors":[]}"#.into(),
                r#"tensor set manifest format is "gradstream.gradients", not "gradstream.tensors""#,
            ),
            (
                format!(r#"{HEAD}{{"w":1}}}}"#),
                r#"tensor set manifest "tensors" is a JSON object, not an array"#,
            ),
        ];
        for (text, detail) in cases {
            assert_eq!(refused(&text), (detail.to_string(), None), "{text}");
        }
        for version in ["true", "1.0", r#""1""#, "2", "-1"] {
            let text =
                format!(r#"{{"format":"gradstream.tensors","version":{version},"tensors":[]}}"#);
            let detail = format!(
                "tensor set manifest version {version} is not supported (this gradstream reads version 1)"
            );
            assert_eq!(refused(&text), (detail, None));
        }
    }

    #[test]
    fn entries_are_checked_in_the_references_words() {
        let w = |extra: &str| format!(r#"{{"name":"w","dtype":"float32","shape":[2]{extra}}}"#);
        let entry = |name: &str, dtype: &str, shape: &str| {
            format!(r#"{{"name":{name},"dtype":{dtype},"shape":{shape}}}"#)
        };
        let none = None::<&str>;
        let cases: Vec<(String, String, Option<&str>)> = vec![
            (doc(&["5"]), "tensor set manifest entry 1 of 1 is a JSON integer, not an object".into(), none),
            (
                doc(&[&w(""), r#"{"name":"v","dtype":"float32"}"#]),
                r#"tensor set manifest entry 2 of 2 has no "shape" key"#.into(),
                Some("v"),
            ),
            (
                doc(&[&w(r#","layout":"seed""#)]),
                r#"tensor set manifest entry 1 of 1 has an unexpected key "layout" (its keys are name, dtype, shape)"#.into(),
                Some("w"),
            ),
            (
                doc(&[&entry("7", r#""float32""#, "[]")]),
                "tensor set manifest entry 1 of 1: its name is a JSON integer, not a string".into(),
                none,
            ),
            (
                doc(&[&entry("null", r#""float32""#, "[]")]),
                "tensor set manifest entry 1 of 1: its name is a JSON null, not a string".into(),
                none,
            ),
            (
                doc(&[&entry(r#""""#, r#""float32""#, "[]")]),
                "a tensor name is empty; names are non-empty strings".into(),
                Some(""),
            ),
            (doc(&[&w(""), &w("")]), r#"tensor name "w" appears twice in the tensor set"#.into(), Some("w")),
        ];
        for (text, detail, name) in cases {
            assert_eq!(refused(&text), (detail, name.map(str::to_owned)), "{text}");
        }
        let long = "n".repeat(1025);
        let text = doc(&[&entry(&format!("\"{long}\""), r#""float32""#, "[]")]);
        assert_eq!(
            refused(&text),
            (
                format!(
                    r#"tensor name "{}... takes 1025 UTF-8 bytes, above the limit of 1024"#,
                    &long[..76]
                ),
                Some(long.clone())
            )
        );
    }

    #[test]
    fn dtypes_and_shapes_are_checked_in_the_references_words() {
        let entry = |name: &str, dtype: &str, shape: &str| {
            format!(r#"{{"name":{name},"dtype":{dtype},"shape":{shape}}}"#)
        };
        let cases: Vec<(String, String, Option<&str>)> = vec![
            (
                doc(&[&entry(r#""w""#, r#""int8""#, "[]")]),
                r#"tensor "w": dtype "int8" is not float16, bfloat16, float32 or float64"#.into(),
                Some("w"),
            ),
            (
                doc(&[&entry(r#""w""#, r#"["float32"]"#, "[]")]),
                r#"tensor "w": dtype ["float32"] is not float16, bfloat16, float32 or float64"#.into(),
                Some("w"),
            ),
            (
                doc(&[&entry(r#""w""#, r#""float32""#, r#""[2]""#)]),
                r#"tensor "w": its shape is a JSON string, not an array of integers"#.into(),
                Some("w"),
            ),
            (
                doc(&[&entry(r#""w""#, r#""float32""#, &format!("[{}]", vec!["1"; 33].join(",")))]),
                r#"tensor "w": its shape has 33 dimensions, more than 32"#.into(),
                Some("w"),
            ),
            (
                doc(&[&entry(r#""e""#, r#""float32""#, "[0, 2147483648, 1073741824]")]),
                r#"tensor "e": its shape [0,2147483648,1073741824] is beyond what numpy can make (its non-zero dimensions multiply past 2**60)"#.into(),
                Some("e"),
            ),
        ];
        for (text, detail, name) in cases {
            assert_eq!(refused(&text), (detail, name.map(str::to_owned)), "{text}");
        }
        for dim in ["-1", "2.0", "true", "1000000000000000000"] {
            let text = doc(&[&entry(r#""w""#, r#""float32""#, &format!("[{dim}]"))]);
            let detail = format!(
                r#"tensor "w": shape dimension {dim} is not an integer of at most 18 digits"#
            );
            assert_eq!(refused(&text), (detail, Some("w".into())));
        }
        // -0 is the dimension 0; a shape numpy can make passes.
        let ok = doc(&[&entry(
            r#""e""#,
            r#""float32""#,
            "[-0, 1073741824, 1073741824]",
        )]);
        assert_eq!(read_manifest(&ok).unwrap()[0].shape, [0, 1 << 30, 1 << 30]);
    }

    #[test]
    fn the_sender_checks_names_and_shapes_in_the_same_words() {
        let mut taken = HashSet::new();
        check_name("a", &mut taken).unwrap();
        let err = check_name("a", &mut taken).unwrap_err().to_string();
        assert_eq!(err, r#"tensor name "a" appears twice in the tensor set"#);
        let long = "\u{e9}".repeat(513);
        assert_eq!(
            check_name(&long, &mut taken).unwrap_err().to_string(),
            format!(
                r#"tensor name "{}\u00... takes 1026 UTF-8 bytes, above the limit of 1024"#,
                r"\u00e9".repeat(12)
            )
        );
        let deep = Entry::new("deep", Dtype::F32, vec![1; 33]);
        assert_eq!(
            deep.check_shape().unwrap_err().to_string(),
            r#"tensor "deep" has 33 dimensions; a tensor set carries at most 32"#
        );
        let wide = Entry::new("x", Dtype::F32, vec![0, 1_000_000_000_000_000_000]);
        assert_eq!(
            wide.check_shape().unwrap_err().to_string(),
            r#"tensor "x": shape dimension 1000000000000000000 is not an integer of at most 18 digits"#
        );
        let huge = Entry::new("x", Dtype::F32, vec![1 << 31, 1 << 30]);
        assert!(huge
            .check_shape()
            .unwrap_err()
            .to_string()
            .contains("beyond what numpy"));
        assert_eq!(huge.len(), 1 << 61);
        Entry::new("ok", Dtype::F64, vec![]).check_shape().unwrap();
    }
}
