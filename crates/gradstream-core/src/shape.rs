//! `gradient_shape`: the shape a sender with `keep_shape` writes into every payload's
//! schema metadata, and the receiver's rules for it (docs/spec/decoding-rules.md): it must be
//! a list of at most 32 non-negative integers, the same in every chunk, and hold exactly
//! the gradient's values. The text is compared as it is, so both sides agree byte for byte.
//!
//! Uses `error` only; used by `rules` and `reassembler`.

use crate::error::{GradientStreamError, Result};

/// The most dimensions a shape may have (numpy allows 64; 32 is plenty for a tensor).
const MAX_DIMS: usize = 32;
/// Digits of one dimension: below 10^18, so every dimension fits numpy's signed 64-bit
/// sizes (a shape like [0, 10^19 - 1] holds 0 values but numpy cannot make it).
const MAX_DIGITS: usize = 18;

/// The compact text of a shape: "[768,3072]", "[]" for a scalar.
pub fn shape_text(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!("[{}]", dims.join(","))
}

/// The dimensions of a shape text, or None when it is not `[` zero to 32 non-negative
/// decimal integers (no sign, no leading zeros, spaces allowed around them) `]`.
pub fn parse(raw: &str) -> Option<Vec<u64>> {
    let inner = raw.strip_prefix('[')?.strip_suffix(']')?;
    if inner.trim_matches(' ').is_empty() {
        return Some(Vec::new());
    }
    let dims = inner
        .split(',')
        .map(|item| {
            let digits = item.trim_matches(' ');
            let well_formed = !digits.is_empty()
                && digits.len() <= MAX_DIGITS
                && digits.bytes().all(|b| b.is_ascii_digit())
                && (digits == "0" || !digits.starts_with('0'));
            well_formed.then(|| digits.parse::<u64>().ok()).flatten()
        })
        .collect::<Option<Vec<u64>>>()?;
    (dims.len() <= MAX_DIMS).then_some(dims)
}

/// Whether numpy can make an array of these dimensions (of any dtype gradstream hands
/// back, at most 8 bytes a value): it refuses when the non-zero dimensions multiply past
/// 2^63 bytes, even for an empty array (a zero dimension elsewhere). Only an empty
/// gradient can meet this, as a shape must otherwise hold exactly the values received.
pub fn numpy_can_make(dims: &[u64]) -> bool {
    dims.iter()
        .filter(|&&d| d != 0)
        .try_fold(1u64, |product, &d| {
            product.checked_mul(d).filter(|&p| p <= 1 << 60)
        })
        .is_some()
}

/// The product of `dims` in decimal, exactly (32 dimensions of 18 digits overflow any
/// machine integer, and the error message states the true product).
fn product_text(dims: &[u64]) -> String {
    // Little-endian base-10^9 limbs.
    let mut limbs: Vec<u64> = vec![1];
    for &d in dims {
        let (hi, lo) = (d / 1_000_000_000, d % 1_000_000_000);
        let times = |factor: u64| -> Vec<u64> {
            let mut out = Vec::with_capacity(limbs.len() + 1);
            let mut carry = 0u128;
            for &limb in &limbs {
                let v = u128::from(limb) * u128::from(factor) + carry;
                out.push((v % 1_000_000_000) as u64);
                carry = v / 1_000_000_000;
            }
            while carry > 0 {
                out.push((carry % 1_000_000_000) as u64);
                carry /= 1_000_000_000;
            }
            out
        };
        let low = times(lo);
        let mut high = times(hi);
        high.insert(0, 0); // times 10^9
        let mut sum = Vec::with_capacity(high.len().max(low.len()) + 1);
        let mut carry = 0u64;
        for i in 0..high.len().max(low.len()) {
            let v = high.get(i).unwrap_or(&0) + low.get(i).unwrap_or(&0) + carry;
            sum.push(v % 1_000_000_000);
            carry = v / 1_000_000_000;
        }
        if carry > 0 {
            sum.push(carry);
        }
        while sum.len() > 1 && sum.last() == Some(&0) {
            sum.pop();
        }
        limbs = sum;
    }
    let mut text = limbs.last().map_or_else(String::new, u64::to_string);
    for limb in limbs.iter().rev().skip(1) {
        text.push_str(&format!("{limb:09}"));
    }
    text
}

/// What the chunks of one gradient said about its shape so far.
#[derive(Debug, Default)]
pub struct ShapeCheck {
    /// The first chunk taken, and its `gradient_shape` text (None: it had none).
    first: Option<(u32, Option<String>)>,
}

impl ShapeCheck {
    /// Rule 1 for chunk `index`: a well-formed text, the same as the first chunk's.
    pub fn check(&mut self, index: u32, raw: Option<String>) -> Result<()> {
        if let Some(text) = &raw {
            let shown: String = text.chars().take(100).collect();
            let Some(dims) = parse(text) else {
                return Err(GradientStreamError::arrow(format!(
                    "gradient_shape metadata is not a list of at most 32 non-negative \
                     integers: {shown}"
                ))
                .in_chunk(index));
            };
            if !numpy_can_make(&dims) {
                return Err(GradientStreamError::arrow(format!(
                    "gradient_shape metadata {shown} is beyond what numpy can make: its \
                     non-zero dimensions multiply past 2^60"
                ))
                .in_chunk(index));
            }
        }
        match &self.first {
            None => {
                self.first = Some((index, raw));
                Ok(())
            }
            Some((_, first)) if *first == raw => Ok(()),
            Some((first_index, first)) => Err(GradientStreamError::frame(
                format!(
                    "chunks disagree on gradient_shape: chunk {first_index} says {}, chunk \
                     {index} says {}",
                    first.as_deref().unwrap_or("none"),
                    raw.as_deref().unwrap_or("none")
                ),
                Some(index),
            )),
        }
    }

    /// Rule 2 once the gradient is complete: the shape holds exactly `count` values.
    /// The dimensions to hand the values back in, when the sender kept the shape.
    pub fn finish(&self, count: usize) -> Result<Option<Vec<usize>>> {
        let Some((_, Some(text))) = &self.first else {
            return Ok(None);
        };
        let dims = parse(text).unwrap_or_default(); // checked in `check`
        let product = product_text(&dims);
        if product != count.to_string() {
            return Err(GradientStreamError::frame(
                format!("gradient_shape {text} holds {product} values; the gradient has {count}"),
                None,
            ));
        }
        // The product is `count`, so every dimension fits a usize (or one is 0 and the
        // others are below 10^18, which fit a 64-bit usize and numpy's sizes).
        Ok(Some(
            dims.iter()
                .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
                .collect(),
        ))
    }

    /// Forget the chunk just checked (it failed a later rule, so it was not taken).
    pub fn undo(&mut self, index: u32) {
        if matches!(self.first, Some((first, _)) if first == index) {
            self.first = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grammar_takes_lists_of_plain_integers_only() {
        assert_eq!(parse("[768,3072]"), Some(vec![768, 3072]));
        assert_eq!(parse("[ 1 , 2 ]"), Some(vec![1, 2]));
        assert_eq!(parse("[]"), Some(vec![]));
        assert_eq!(parse("[ ]"), Some(vec![]));
        assert_eq!(parse("[0,5]"), Some(vec![0, 5]));
        for bad in [
            "[1,-2]",
            "[01]",
            "[1.5]",
            "[true]",
            "1,2",
            "[1,2",
            "[1,,2]",
            "[+1]",
            "[1e3]",
            "[\t1]",
            "[12345678901234567890]",
            "",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
        let dims32 = format!("[{}]", vec!["1"; 32].join(","));
        let dims33 = format!("[{}]", vec!["1"; 33].join(","));
        assert!(parse(&dims32).is_some() && parse(&dims33).is_none());
        assert!(numpy_can_make(&[0, 1 << 30, 1 << 30]));
        assert!(!numpy_can_make(&[0, 1 << 31, 1 << 30]));
        assert!(!numpy_can_make(&[
            999_999_999_999_999_999,
            0,
            999_999_999_999_999_999
        ]));
        assert_eq!(shape_text(&[768, 3072]), "[768,3072]");
        assert_eq!(shape_text(&[]), "[]");
    }

    #[test]
    fn products_are_exact_however_large() {
        assert_eq!(product_text(&[]), "1");
        assert_eq!(product_text(&[0, 7]), "0");
        assert_eq!(product_text(&[768, 3072]), "2359296");
        let nines = 999_999_999_999_999_999u64;
        assert_eq!(
            product_text(&[nines, nines]),
            "999999999999999998000000000000000001"
        );
    }

    #[test]
    fn chunks_must_agree_and_the_product_must_be_the_count() {
        let mut check = ShapeCheck::default();
        check.check(0, Some("[2,3]".into())).unwrap();
        check.check(1, Some("[2,3]".into())).unwrap();
        let err = check.check(2, None).unwrap_err().to_string();
        assert_eq!(
            err,
            "chunks disagree on gradient_shape: chunk 0 says [2,3], chunk 2 says none"
        );
        assert_eq!(check.finish(6).unwrap(), Some(vec![2, 3]));
        assert_eq!(
            check.finish(7).unwrap_err().to_string(),
            "gradient_shape [2,3] holds 6 values; the gradient has 7"
        );
        assert_eq!(ShapeCheck::default().finish(9).unwrap(), None);
    }
}
