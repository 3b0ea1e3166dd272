//! The JSON of a tensor set's manifest (docs/guides/tensor-sets.md, receiver rule 2): a small
//! strict reader, and the compact ASCII writer of the values it reads, which messages
//! quote them with.
//!
//! The reader follows the docs/spec/decoding-rules.md three steps, each error a `TensorSet` error:
//! a lexical
//! depth scan of the text before any parsing (deeper than 32 levels is refused, so the
//! recursive parser below never goes deeper); a parse of RFC 8259 JSON only (anything
//! else, integer literals of more than 4300 digits included, is "not valid JSON", with no
//! position), a key repeated in one object being found when that object closes; then,
//! after a whole parse, no string holding a lone surrogate. Strings are read as UTF-16
//! code units, which keeps a lone surrogate (from an escape such as `\ud800`) distinct
//! from every other text until that last step, as Python's `json` keeps it.
//!
//! The writer is Python's `json.dumps(value, ensure_ascii=True, separators=(",", ":"))`
//! for every value the reader produces (strings and floats written by `ascii`), so that
//! the Rust and Python implementations quote alike, byte for byte.
//!
//! Uses `ascii` and `error`; used by `manifest`.

use super::ascii::{clip, python_float_repr, quote_units, QUOTE_LIMIT};
use crate::error::{GradientStreamError, Result};

/// The deepest nesting of arrays and objects a manifest may have (its schema needs 3).
pub const MAX_DEPTH: usize = 32;
/// The most digits of an integer literal (Python 3.11's default limit for `int`).
pub const MAX_INT_DIGITS: usize = 4300;

const NOT_JSON: &str = "tensor set manifest is not valid JSON";

/// A JSON value, as the reader produces it.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    /// An integer literal, as its decimal text without a sign for zero (`-0` is `0`): any
    /// size, as Python reads it.
    Int(String),
    /// A literal with a fraction or an exponent; one too large is an infinity.
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    /// Keys in the text's order, each once.
    Object(Vec<(String, Json)>),
}

impl Json {
    /// What the value is, in JSON's words (as the manifest messages name it).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Null => "null",
            Self::Bool(_) => "boolean",
            Self::Int(_) => "integer",
            Self::Float(_) => "number",
            Self::Str(_) => "string",
            Self::Array(_) => "array",
            Self::Object(_) => "object",
        }
    }

    /// The value of `key`, when this is an object that has it.
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Self::Object(pairs) => pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
}

fn not_json() -> GradientStreamError {
    GradientStreamError::tensor_set(NOT_JSON, None)
}

/// Read a manifest's text: the depth scan, the strict parse, then no lone surrogate.
pub fn parse(text: &str) -> Result<Json> {
    check_depth(text)?;
    let mut parser = Parser {
        text: text.as_bytes(),
        pos: 0,
        lone_surrogate: false,
    };
    parser.skip_whitespace();
    let value = parser.value()?;
    parser.skip_whitespace();
    if parser.pos != parser.text.len() || parser.lone_surrogate {
        return Err(not_json());
    }
    Ok(value)
}

/// The depth scan: outside a string `[` and `{` go one level deeper and `]` and `}` one
/// back; `"` starts or ends a string; inside one a backslash skips the next character.
/// Bytes are as good as characters here: no byte of a multi-byte UTF-8 character is ASCII.
/// A closing bracket with none open takes the depth below zero, as the rule says.
fn check_depth(text: &str) -> Result<()> {
    let mut depth = 0isize;
    let mut in_string = false;
    let mut bytes = text.bytes();
    while let Some(b) = bytes.next() {
        match (in_string, b) {
            (true, b'\\') => {
                bytes.next();
            }
            (_, b'"') => in_string = !in_string,
            (false, b'[' | b'{') => {
                depth += 1;
                if depth > MAX_DEPTH as isize {
                    return Err(GradientStreamError::tensor_set(
                        format!(
                            "tensor set manifest nests arrays or objects deeper than \
                             {MAX_DEPTH} levels"
                        ),
                        None,
                    ));
                }
            }
            (false, b']' | b'}') => depth -= 1,
            _ => {}
        }
    }
    Ok(())
}

/// A recursive-descent parser; `check_depth` has bounded how deep it can recurse.
struct Parser<'t> {
    text: &'t [u8],
    pos: usize,
    /// A string held a lone surrogate: refused once the whole text has parsed.
    lone_surrogate: bool,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.pos).copied()
    }

    fn next(&mut self) -> Result<u8> {
        let b = self.peek().ok_or_else(not_json)?;
        self.pos += 1;
        Ok(b)
    }

    fn expect(&mut self, b: u8) -> Result<()> {
        if self.next()? == b {
            Ok(())
        } else {
            Err(not_json())
        }
    }

    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn literal(&mut self, word: &[u8], value: Json) -> Result<Json> {
        if self.text[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(value)
        } else {
            Err(not_json())
        }
    }

    fn value(&mut self) -> Result<Json> {
        match self.peek().ok_or_else(not_json)? {
            b'{' => self.object(),
            b'[' => self.array(),
            b'"' => {
                let units = self.string()?;
                Ok(Json::Str(self.text_of(&units)))
            }
            b't' => self.literal(b"true", Json::Bool(true)),
            b'f' => self.literal(b"false", Json::Bool(false)),
            b'n' => self.literal(b"null", Json::Null),
            b'-' | b'0'..=b'9' => self.number(),
            _ => Err(not_json()),
        }
    }

    /// A string's UTF-16 code units as text; a lone surrogate is noted (the parse goes
    /// on, as Python's does) and stands as U+FFFD meanwhile.
    fn text_of(&mut self, units: &[u16]) -> String {
        String::from_utf16(units).unwrap_or_else(|_| {
            self.lone_surrogate = true;
            String::from_utf16_lossy(units)
        })
    }

    fn array(&mut self) -> Result<Json> {
        self.expect(b'[')?;
        let mut items = Vec::new();
        self.skip_whitespace();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Json::Array(items));
        }
        loop {
            self.skip_whitespace();
            items.push(self.value()?);
            self.skip_whitespace();
            match self.next()? {
                b',' => {}
                b']' => return Ok(Json::Array(items)),
                _ => return Err(not_json()),
            }
        }
    }

    fn object(&mut self) -> Result<Json> {
        self.expect(b'{')?;
        let mut pairs: Vec<(Vec<u16>, Json)> = Vec::new();
        self.skip_whitespace();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Json::Object(Vec::new()));
        }
        loop {
            self.skip_whitespace();
            if self.peek() != Some(b'"') {
                return Err(not_json());
            }
            let key = self.string()?;
            self.skip_whitespace();
            self.expect(b':')?;
            self.skip_whitespace();
            let value = self.value()?;
            pairs.push((key, value));
            self.skip_whitespace();
            match self.next()? {
                b',' => {}
                b'}' => break,
                _ => return Err(not_json()),
            }
        }
        // Closed: the first key (in order) that repeats an earlier one.
        let mut seen = std::collections::HashSet::with_capacity(pairs.len());
        if let Some((key, _)) = pairs.iter().find(|(key, _)| !seen.insert(key.as_slice())) {
            return Err(GradientStreamError::tensor_set(
                format!(
                    "tensor set manifest repeats the key {} in one JSON object",
                    clip(quote_units(key.iter().copied()))
                ),
                None,
            ));
        }
        let pairs = pairs
            .into_iter()
            .map(|(key, value)| (self.text_of(&key), value))
            .collect();
        Ok(Json::Object(pairs))
    }

    /// A string's code units, the opening quote next.
    fn string(&mut self) -> Result<Vec<u16>> {
        self.expect(b'"')?;
        let mut units = Vec::new();
        loop {
            // A run of plain characters at once: the text is UTF-8 and the run stops at
            // ASCII bytes only, so it is whole characters.
            let start = self.pos;
            while matches!(self.peek(), Some(b) if b != b'"' && b != b'\\' && b >= 0x20) {
                self.pos += 1;
            }
            let run = std::str::from_utf8(&self.text[start..self.pos]).map_err(|_| not_json())?;
            units.extend(run.encode_utf16());
            match self.next()? {
                b'"' => return Ok(units),
                b'\\' => units.push(self.escape()?),
                _ => return Err(not_json()), // a control character
            }
        }
    }

    /// The code unit of an escape, its backslash read.
    fn escape(&mut self) -> Result<u16> {
        Ok(match self.next()? {
            b'"' => 0x22,
            b'\\' => 0x5c,
            b'/' => 0x2f,
            b'b' => 0x08,
            b'f' => 0x0c,
            b'n' => 0x0a,
            b'r' => 0x0d,
            b't' => 0x09,
            b'u' => {
                let hex = self.text.get(self.pos..self.pos + 4).ok_or_else(not_json)?;
                if !hex.iter().all(u8::is_ascii_hexdigit) {
                    return Err(not_json());
                }
                self.pos += 4;
                let hex = std::str::from_utf8(hex).map_err(|_| not_json())?;
                u16::from_str_radix(hex, 16).map_err(|_| not_json())?
            }
            _ => return Err(not_json()),
        })
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`
    fn number(&mut self) -> Result<Json> {
        let start = self.pos;
        let negative = self.peek() == Some(b'-');
        self.pos += usize::from(negative);
        let digits = self.digits();
        let int_part = &self.text[start + usize::from(negative)..self.pos];
        if digits == 0 || (int_part[0] == b'0' && digits > 1) {
            return Err(not_json());
        }
        let mut float = false;
        if self.peek() == Some(b'.') {
            self.pos += 1;
            float = true;
            if self.digits() == 0 {
                return Err(not_json());
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            float = true;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(not_json());
            }
        }
        let literal = std::str::from_utf8(&self.text[start..self.pos]).map_err(|_| not_json())?;
        if float {
            return literal.parse().map(Json::Float).map_err(|_| not_json());
        }
        if digits > MAX_INT_DIGITS {
            return Err(not_json());
        }
        Ok(Json::Int(
            if literal == "-0" { "0" } else { literal }.to_owned(),
        ))
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        self.pos - start
    }
}

/// How a tensor-set message quotes a value: compact ASCII JSON, cut to 80 characters.
pub fn quote(value: &Json) -> String {
    let mut out = String::new();
    write_ascii(value, &mut out, QUOTE_LIMIT);
    clip(out)
}

/// `value` as Python's `json.dumps(value, ensure_ascii=True, separators=(",", ":"))`.
pub fn to_ascii_json(value: &Json) -> String {
    let mut out = String::new();
    write_ascii(value, &mut out, usize::MAX);
    out
}

/// `value` as compact ASCII JSON appended to `out`, stopping soon after `out` holds more
/// than `limit` bytes (a quote is cut there anyway; a manifest's value can be megabytes).
fn write_ascii(value: &Json, out: &mut String, limit: usize) {
    let units = limit.saturating_add(1);
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Int(digits) => out.push_str(digits),
        Json::Float(x) => out.push_str(&python_float_repr(*x)),
        Json::Str(s) => out.push_str(&quote_units(s.encode_utf16().take(units))),
        Json::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if out.len() > limit {
                    return;
                }
                if i > 0 {
                    out.push(',');
                }
                write_ascii(item, out, limit);
            }
            out.push(']');
        }
        Json::Object(pairs) => {
            out.push('{');
            for (i, (key, item)) in pairs.iter().enumerate() {
                if out.len() > limit {
                    return;
                }
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&quote_units(key.encode_utf16().take(units)));
                out.push(':');
                write_ascii(item, out, limit);
            }
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::ascii::quote_str;
    use super::*;

    fn message(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    const TOO_DEEP: &str = "tensor set manifest nests arrays or objects deeper than 32 levels";

    #[test]
    fn the_depth_scan_comes_first_and_skips_strings() {
        let nest = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(parse(&nest(32)).is_ok());
        assert_eq!(message(&nest(33)), TOO_DEEP);
        assert_eq!(message(&"[{".repeat(17)), TOO_DEEP);
        assert_eq!(message(&"[{".repeat(16)), NOT_JSON);
        assert_eq!(
            message(&format!("{{\"a\":1,\"a\":2,\"b\":{}", "[".repeat(40))),
            TOO_DEEP
        );
        // Brackets in strings, escaped quotes and backslashes.
        assert!(parse(&format!("[\"{}\"]", "[{".repeat(40))).is_ok());
        assert!(parse(&format!("[\"\\\"{}\"]", "[".repeat(40))).is_ok());
        let escaped_backslash = format!("[\"\\\\\"{}{}]", "[".repeat(40), "]".repeat(40));
        assert_eq!(message(&escaped_backslash), TOO_DEEP);
        assert_eq!(message(&format!("[\"{}", "[".repeat(40))), NOT_JSON);
        assert_eq!(message("[\"abc\\"), NOT_JSON);
        assert_eq!(message(&format!("\\{}", "[".repeat(33))), TOO_DEEP);
        // Closing brackets give the depth back, stray ones below zero.
        assert!(parse(&format!("[{}[]]", "[],".repeat(40))).is_ok());
        assert_eq!(message(&format!("]]{}", nest(33))), NOT_JSON);
        assert_eq!(message(&format!("]]{}", nest(35))), TOO_DEEP);
    }

    #[test]
    fn only_rfc_8259_json_is_read() {
        for bad in [
            "",
            " ",
            "{",
            "nul",
            "TRUE",
            "\u{feff}{}",
            "{}\u{c}",
            "{} x",
            "{}{}",
            "[1,]",
            "{\"a\":1,}",
            "{'a':1}",
            "{\"a\" 1}",
            "[01]",
            "[-01]",
            "[1.]",
            "[.5]",
            "[+1]",
            "[-]",
            "[1e]",
            "[1e+]",
            "[0x10]",
            "[NaN]",
            "[Infinity]",
            "[-Infinity]",
            "[\"a\tb\"]",
            "[\"a\u{0}\"]",
            "[\"\\x41\"]",
            "[\"\\u12\"]",
            "[\"\\u12g4\"]",
            "[\"\\U0041\"]",
            "[\"\\'\"]",
            "[\"abc]",
            "{1:2}",
            "[1 2]",
            "{\"a\"}",
        ] {
            assert_eq!(message(bad), NOT_JSON, "{bad:?}");
        }
        let doc = parse(
            " \t\n\r{\"a\" : [ 1 , -0, 2.5E-3, true, false, null, \"\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\uD83D\\uDE00\u{7f}\" ] }\r\n",
        )
        .unwrap();
        let items = vec![
            Json::Int("1".into()),
            Json::Int("0".into()),
            Json::Float(2.5e-3),
            Json::Bool(true),
            Json::Bool(false),
            Json::Null,
            Json::Str("\"\\/\u{8}\u{c}\n\r\t\u{e9}\u{1f600}\u{7f}".into()),
        ];
        assert_eq!(doc, Json::Object(vec![("a".into(), Json::Array(items))]));
    }

    #[test]
    fn integers_keep_their_digits_up_to_4300() {
        let ones = "1".repeat(4300);
        assert_eq!(parse(&ones).unwrap(), Json::Int(ones.clone()));
        assert_eq!(
            parse(&format!("-{ones}")).unwrap(),
            Json::Int(format!("-{ones}"))
        );
        assert_eq!(message(&format!("{ones}1")), NOT_JSON);
        assert_eq!(message(&format!("[-{ones}1]")), NOT_JSON);
        // Floats have no such limit; too large a one is infinite, too small a zero.
        let long = format!("1.{}", "0".repeat(5000));
        assert_eq!(parse(&long).unwrap(), Json::Float(1.0));
        assert_eq!(parse("1e400").unwrap(), Json::Float(f64::INFINITY));
        assert_eq!(
            parse("-1e99999999999999999999").unwrap(),
            Json::Float(f64::NEG_INFINITY)
        );
        assert_eq!(parse("1e-400").unwrap(), Json::Float(0.0));
    }

    #[test]
    fn lone_surrogates_are_refused_after_the_whole_parse() {
        for bad in [
            "[\"\\ud800\"]",
            "[\"a\\udc00\"]",
            "[\"\\ud83d\\u0041\"]",
            "[\"\\ude00\\ud83d\"]",
            "{\"\\ud800\":1}",
            "{\"\\ud800\":1,\"\\udc00\":2}",
        ] {
            assert_eq!(message(bad), NOT_JSON, "{bad}");
        }
        // A repeated key in an object closed before comes first; its quote keeps the
        // surrogate.
        assert_eq!(
            message("[{\"\\ud800\":1,\"\\ud800\":2}, \"\\udc00\"]"),
            "tensor set manifest repeats the key \"\\ud800\" in one JSON object"
        );
        assert_eq!(
            parse("\"\\ud83d\\ude00\"").unwrap(),
            Json::Str("\u{1f600}".into())
        );
    }

    #[test]
    fn a_repeated_key_is_found_when_its_object_closes() {
        let repeats =
            |k: &str| format!("tensor set manifest repeats the key \"{k}\" in one JSON object");
        for (text, want) in [
            ("[{\"a\":1,\"a\":2}] x", repeats("a")),
            ("[{\"a\":1,\"a\":2 x", NOT_JSON.into()),
            ("{\"a\":{\"b\":1,\"b\":2},\"a\":3}", repeats("b")),
            ("{\"x\":1,\"y\":2,\"y\":3,\"x\":4}", repeats("y")),
            ("{\"x\":1,\"y\":2,\"x\":3,\"y\":4}", repeats("x")),
            ("{\"\\u00e9\":1,\"\u{e9}\":2}", repeats("\\u00e9")),
        ] {
            assert_eq!(message(text), want, "{text}");
        }
        let keys = parse("{\"b\":1,\"a\":2,\"A\":3}").unwrap();
        assert_eq!(keys.get("a"), Some(&Json::Int("2".into())));
        assert_eq!(to_ascii_json(&keys), "{\"b\":1,\"a\":2,\"A\":3}");
    }

    #[test]
    fn quotes_are_python_json_dumps_ascii_compact() {
        // (JSON text read, then written back as Python writes it)
        for (text, want) in [
            (
                "\"\u{e9}\u{20ac}\u{1f600}\"",
                "\"\\u00e9\\u20ac\\ud83d\\ude00\"",
            ),
            (
                "\"a\\u0001\\u001f\u{7f}\\n\\/\"",
                "\"a\\u0001\\u001f\\u007f\\n/\"",
            ),
            ("\"q\\\"\\\\\\b\\f\\r\\t\"", "\"q\\\"\\\\\\b\\f\\r\\t\""),
            (
                " [ 1 , {\"b\" : [ ] , \"a\":null} ] ",
                "[1,{\"b\":[],\"a\":null}]",
            ),
            ("[true,false,-0,-5]", "[true,false,0,-5]"),
            (
                "123456789012345678901234567890",
                "123456789012345678901234567890",
            ),
        ] {
            assert_eq!(to_ascii_json(&parse(text).unwrap()), want, "{text}");
        }
        let fits = format!("\"{}\"", "d".repeat(78));
        assert_eq!(quote(&parse(&fits).unwrap()), fits);
        let over = format!("\"{}\"", "d".repeat(79));
        assert_eq!(quote(&parse(&over).unwrap()), format!("{}...", &over[..77]));
        let escaped = quote_str(&"\u{e9}".repeat(20));
        assert_eq!(
            escaped,
            format!("{}...", &format!("\"{}", "\\u00e9".repeat(20))[..77])
        );
        let big = Json::Array(vec![Json::Str("x".repeat(1 << 20)); 1000]);
        assert_eq!(quote(&big).len(), 80);
    }
}
