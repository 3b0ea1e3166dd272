//! The compact ASCII JSON that tensor-set messages quote names and values in: Python's
//! `json.dumps(value, ensure_ascii=True, separators=(",", ":"))`, whose every string is
//! printable ASCII with `\\uXXXX` escapes (a character beyond the BMP as its surrogate
//! pair) and whose floats are Python's `repr`, and the cut of a quote to 80 characters.
//! The pieces a JSON value is written with (`json::quote` writes whole values).
//!
//! Uses nothing of the crate; used by `json` and `manifest`.

/// A quote longer than this is cut to its first 77 characters and `...`.
pub const QUOTE_LIMIT: usize = 80;

/// `text` cut to at most 80 characters (its first 77 and `...`); ASCII, so bytes are
/// characters.
pub(crate) fn clip(mut text: String) -> String {
    if text.len() > QUOTE_LIMIT {
        text.truncate(QUOTE_LIMIT - 3);
        text.push_str("...");
    }
    text
}

/// How a tensor-set message quotes a name: `"fc.weight"`, as `quote` does.
pub fn quote_str(text: &str) -> String {
    clip(quote_units(text.encode_utf16()))
}

/// A string of code units as an ASCII JSON string: printable ASCII as it is, the short
/// escapes Python writes, every other unit as `\uXXXX` (so a character beyond the BMP is
/// its surrogate pair).
pub(crate) fn quote_units(units: impl Iterator<Item = u16>) -> String {
    let mut out = String::from("\"");
    for unit in units {
        match unit {
            0x22 => out.push_str("\\\""),
            0x5c => out.push_str("\\\\"),
            0x0a => out.push_str("\\n"),
            0x0d => out.push_str("\\r"),
            0x09 => out.push_str("\\t"),
            0x08 => out.push_str("\\b"),
            0x0c => out.push_str("\\f"),
            0x20..=0x7e => out.push(char::from(unit as u8)),
            _ => out.push_str(&format!("\\u{unit:04x}")),
        }
    }
    out.push('"');
    out
}

/// `x` (finite) in exponent form with the fewest significant digits that read back as
/// `x`, as Python picks them. Rust's `{:e}` gives the shortest length ("-1.5e-5", "1e16",
/// "0e0"), but where two strings of that length are equally near `x` it may take the
/// upper one; Python takes `x` correctly rounded to that length (ties to even), which
/// Rust's exact formatting writes, whenever that reads back as `x`.
fn shortest_digits(x: f64) -> String {
    let shortest = format!("{x:e}");
    let digits = shortest
        .split('e')
        .next()
        .map_or(1, |m| m.bytes().filter(u8::is_ascii_digit).count());
    let rounded = format!("{x:.prec$e}", prec = digits.saturating_sub(1));
    if rounded.parse::<f64>().is_ok_and(|back| back == x) {
        rounded
    } else {
        shortest
    }
}

/// `x` as Python's `repr(float)` writes it: the shortest digits that read back as `x`,
/// positional when the decimal exponent is in [-4, 16) (with `.0` when integral), else
/// `d.ddde+XX` with at least two exponent digits; infinities as JSON's `Infinity`.
pub fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = shortest_digits(x);
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    if !(-4..16).contains(&exponent) {
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{mantissa}e{exp_sign}{:02}", exponent.unsigned_abs());
    }
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let body = if exponent < 0 {
        let zeros = "0".repeat(exponent.unsigned_abs() as usize - 1);
        format!("0.{zeros}{digits}")
    } else {
        let point = exponent as usize + 1;
        if digits.len() > point {
            format!("{}.{}", &digits[..point], &digits[point..])
        } else {
            format!("{digits}{}.0", "0".repeat(point - digits.len()))
        }
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_as_python_repr() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1234567890123456.7, "1234567890123456.8"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (0.0001, "0.0001"),
            (0.00015, "0.00015"),
            (1.5e-5, "1.5e-05"),
            (2.5e-320, "2.5e-320"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (1e100, "1e+100"),
            (-2.5, "-2.5"),
            // Two shortest strings equally near: the even one, as Python.
            (
                f64::from_bits(4_791_879_123_531_060_800),
                "2223007634874.7812",
            ),
            (
                f64::from_bits(4_835_063_612_438_788_517),
                "1801202974404201.2",
            ),
            (
                f64::from_bits(4_820_666_328_004_676_676),
                "197447698300514.12",
            ),
            (f64::INFINITY, "Infinity"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(python_float_repr(x), want, "{x:e}");
        }
    }

    #[test]
    fn strings_are_ascii_with_python_s_escapes() {
        let all: String = "q\"\\/\n\r\t\u{8}\u{c}\u{1}\u{1f}\u{7f}\u{e9}\u{20ac}\u{1f600}".into();
        assert_eq!(
            quote_str(&all),
            r#""q\"\\/\n\r\t\b\f\u0001\u001f\u007f\u00e9\u20ac\ud83d\ude00""#
        );
        assert_eq!(quote_units([0xd800u16].into_iter()), r#""\ud800""#);
        let fits = "d".repeat(78);
        assert_eq!(quote_str(&fits), format!("\"{fits}\""));
        let over = "d".repeat(79);
        assert_eq!(quote_str(&over), format!("\"{}...", &over[..76]));
    }
}
