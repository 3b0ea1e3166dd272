//! The constant part of a payload. Every payload our writer makes for a given layout and
//! value count has the same bytes but for the values themselves: the schema, the batch
//! metadata, the footer and (seed layout) the `index` column 0..n-1. A `Template` holds
//! those bytes once, with the CRC-32 of everything before the values, so that
//!
//! - encoding a chunk is three copies (prefix, values, suffix) and a CRC of the values and
//!   the short suffix, resumed from the prefix's CRC, instead of an Arrow writer run and a
//!   CRC of the whole payload (twice the bytes, in the seed layout);
//! - decoding a payload whose bytes equal the template outside the values (every payload
//!   of ours, whoever sends it) is a compare against the template, the same short CRC and
//!   one copy of the values, instead of an Arrow reader run and a full CRC.
//!
//! Both give bit for bit what the Arrow path gives: the template is built by the Arrow
//! writer itself, and checked through the full decoder before it is used (see `build`).
//!
//! A *sealed* template (docs/spec/wire-format.md, sealed chunks) also leaves out the seal's value, which
//! has one width whatever it says and sits twice in every payload: in the schema message
//! before the values and in the footer's copy of the schema after them. Writing a sealed
//! chunk patches both copies; its CRC is the CRC of the bytes before the first copy, then
//! the seal, then the constant bytes up to the values: recomputed when they are a few
//! hundred bytes (the compact layout), *combined* in (`Hasher::combine`, from their CRC
//! computed once) when they hold the seed layout's `index` column, as long as the values.
//! Measured with `benches/seal.py` (256 MiB, chunk 65536): recomputing the index column's
//! CRC per chunk made seed encodes 25 % slower, combining it costs a few microseconds a
//! chunk, more than recomputing a few hundred bytes. A received payload matches a sealed
//! template when it is the template's outside the values and the two copies, and the two
//! copies are the same text.
//!
//! The templates are kept per session, bounded (`cache`, `Templates`).
//!
//! Uses `codec` (to build and check templates), `seal` and `dtype`; used by `encoder`,
//! `rules` and `stream`, through the `Templates` of their session.

mod cache;

pub use cache::Templates;

use std::sync::Arc;

use crate::codec::{self, Encoding, Layout, Stores};
use crate::seal::{Position, Seal, SealText, TransferId, SEAL_LEN};

/// Values a template may hold: at most 8 MiB of template (seed layout).
const MAX_VALUES: usize = 1 << 20;
/// Constant bytes between a seal and the values from which their CRC is combined in rather
/// than recomputed per chunk (see the module comment).
const COMBINE_FROM: usize = 4096;

/// What a template is of: the payloads of `values` float32 values in `layout`, sealed or
/// not (a seal's text has one width, so every sealed payload of a count has one length),
/// carrying the `gradient_shape` text `shape` or none (a gradstream connection keeps
/// shapes by default: without it, every frame of a connection would go through the Arrow
/// writer and reader).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kind {
    pub layout: Layout,
    pub values: usize,
    pub sealed: bool,
    pub shape: Option<Arc<str>>,
}

/// Where a sealed template's seal sits: its copy in the schema message (before the
/// values) and its copy in the footer (after them).
#[derive(Clone, Copy, Debug)]
struct SealAt {
    message: usize,
    footer: usize,
}

/// A payload cut into what goes out, borrowed: the template's bytes with the seal's text
/// between them (`Template::parts`) and the values as they lie in memory; and its CRC-32.
// Read by the tokio sender alone (feature `tokio`), as `Template::pieces` is.
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub struct Pieces<'a> {
    pub parts: [&'a [u8]; 7],
    pub checksum: u32,
}

/// A payload that matched a template: its CRC-32, its value bytes and, sealed, its seal's
/// text (the same in both copies).
pub struct Matched<'p> {
    pub checksum: u32,
    pub raw: &'p [u8],
    pub seal: Option<&'p str>,
}

/// A payload with its value bytes (and, sealed, its seal's two copies) marked out. See
/// the module comment.
#[derive(Debug)]
pub struct Template {
    kind: Kind,
    /// A payload of the kind (sealed: with a placeholder seal).
    bytes: Vec<u8>,
    /// Where the value bytes start; they run for `4 * values` bytes.
    values_at: usize,
    seal_at: Option<SealAt>,
    /// The byte ranges that are the same in every payload of the kind: all but the values
    /// and the seal's copies.
    constant: Vec<(usize, usize)>,
    /// CRC-32 of the constant bytes up to the first thing that varies: `bytes[..values_at]`,
    /// or, sealed, the bytes before the seal's first copy.
    prefix_crc: u32,
    /// Sealed, when the constant bytes between the seal's first copy and the values are
    /// many (`COMBINE_FROM`): their CRC-32, to combine in after the seal.
    between: Option<crc32fast::Hasher>,
}

/// The placeholder seals a sealed template is found with: two texts that differ in
/// every hex digit.
fn placeholder(byte: u8) -> SealText {
    let word = u32::from_ne_bytes([byte; 4]);
    Seal {
        transfer: TransferId([byte; 16]),
        position: Position::Tensor(word),
    }
    .text(word, word)
}

/// The offsets at which `text` occurs in `bytes`.
fn occurrences(bytes: &[u8], text: &[u8]) -> Vec<usize> {
    bytes
        .windows(text.len())
        .enumerate()
        .filter(|(_, w)| *w == text)
        .map(|(at, _)| at)
        .collect()
}

impl Template {
    /// Encode two payloads whose values differ in every byte (and, sealed, whose seals
    /// differ in every hex digit); the seal's text must be found exactly twice, at the
    /// same places in both, one copy before the values and one after; the other bytes
    /// that differ must be exactly one run of `4 * values`, the values; and each payload
    /// must decode to its own values and seal.
    fn build(kind: Kind) -> Option<Self> {
        let Kind {
            layout,
            values,
            sealed,
            ref shape,
        } = kind;
        let ones = vec![f32::from_bits(0x0101_0101); values];
        let twos = vec![f32::from_bits(0x0202_0202); values];
        let (seal_a, seal_b) = (placeholder(0x5a), placeholder(0xa5));
        let encoding = |seal| {
            Encoding {
                shape: shape.clone(),
                ..Encoding::from(layout)
            }
            .sealed(sealed.then_some(seal))
        };
        let a = codec::encode_payload(encoding(seal_a), &ones).ok()?;
        let mut b = codec::encode_payload(encoding(seal_b), &twos).ok()?;
        if a.len() != b.len() {
            return None;
        }
        let seal_at = if sealed {
            let (found_a, found_b) = (occurrences(&a, &seal_a.0), occurrences(&b, &seal_b.0));
            let [message, footer] = found_a[..] else {
                return None;
            };
            if found_b != found_a {
                return None;
            }
            // The seals told apart, the values are what is left to differ.
            for at in [message, footer] {
                b[at..at + SEAL_LEN].copy_from_slice(&seal_a.0);
            }
            Some(SealAt { message, footer })
        } else {
            None
        };
        let values_at = a.iter().zip(&b).position(|(x, y)| x != y)?;
        let end = values_at + 4 * values;
        let differs_only_there = a[end.min(a.len())..] == b[end.min(b.len())..]
            && a.get(values_at..end)?.iter().all(|&x| x == 0x01)
            && b.get(values_at..end)?.iter().all(|&x| x == 0x02);
        let around_the_values =
            seal_at.is_none_or(|at| at.message + SEAL_LEN <= values_at && at.footer >= end);
        if let Some(at) = seal_at {
            for at in [at.message, at.footer] {
                b[at..at + SEAL_LEN].copy_from_slice(&seal_b.0);
            }
        }
        // Both must decode to their own values (the decoder reads the values from the run
        // that differs, not from some constant run that happens to look alike) and seals.
        let decodes_to = |payload: &[u8], bits: u32, seal: SealText| {
            let mut decoded = Vec::with_capacity(values);
            let head = codec::decode_payload(payload, &mut decoded, values);
            let seal = sealed.then(|| seal.as_str().to_string());
            let expected = crate::output::Head {
                seal,
                shape: shape.as_deref().map(str::to_owned),
                ..crate::output::Head::default()
            };
            head.is_ok_and(|head| head == expected)
                && decoded.len() == values
                && decoded.iter().all(|v| v.to_bits() == bits)
        };
        let decodes_to_them =
            decodes_to(&a, 0x0101_0101, seal_a) && decodes_to(&b, 0x0202_0202, seal_b);
        if !(differs_only_there && around_the_values && decodes_to_them) {
            return None;
        }
        let first_varying = seal_at.map_or(values_at, |at| at.message);
        let prefix_crc = codec::checksum(&a[..first_varying]);
        let between = seal_at
            .map(|at| &a[at.message + SEAL_LEN..values_at])
            .filter(|gap| gap.len() >= COMBINE_FROM)
            .map(|gap| {
                let mut crc = crc32fast::Hasher::new();
                crc.update(gap);
                crc
            });
        let mut varying = vec![(values_at, end)];
        if let Some(at) = seal_at {
            varying.extend([at.message, at.footer].map(|at| (at, at + SEAL_LEN)));
        }
        varying.sort_unstable();
        let mut constant = Vec::with_capacity(varying.len() + 1);
        let mut from = 0;
        for (start, stop) in varying {
            constant.push((from, start));
            from = stop;
        }
        constant.push((from, a.len()));
        Some(Self {
            kind,
            bytes: a,
            values_at,
            seal_at,
            constant,
            prefix_crc,
            between,
        })
    }

    /// The `gradient_shape` text every payload of this template carries, if any.
    pub fn shape(&self) -> Option<&str> {
        self.kind.shape.as_deref()
    }

    /// Length of each payload made from this template.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    fn values_end(&self) -> usize {
        self.values_at + 4 * self.kind.values
    }

    /// The template's bytes cut around the seal's copies and the values, for a payload
    /// sealed with `seal` (sealed templates) holding `raw`: before the first copy, the
    /// seal, up to the values, the values, up to the second copy, the seal, the rest. An
    /// unsealed template's cuts are empty but for the prefix, the values and the suffix.
    fn parts<'a>(&'a self, seal: Option<&'a SealText>, raw: &'a [u8]) -> [&'a [u8]; 7] {
        let (end, bytes) = (self.values_end(), &self.bytes[..]);
        match (self.seal_at, seal) {
            (Some(at), Some(seal)) => [
                &bytes[..at.message],
                &seal.0,
                &bytes[at.message + SEAL_LEN..self.values_at],
                raw,
                &bytes[end..at.footer],
                &seal.0,
                &bytes[at.footer + SEAL_LEN..],
            ],
            _ => [
                &bytes[..self.values_at],
                &[],
                &[],
                raw,
                &bytes[end..],
                &[],
                &[],
            ],
        }
    }

    /// The CRC-32 of the template's bytes before the values with `seal` (its text, when
    /// the template is sealed) in place, ready to take the values.
    fn crc_of_prefix(&self, seal: Option<&[u8]>) -> crc32fast::Hasher {
        let mut crc = crc32fast::Hasher::new_with_initial(self.prefix_crc);
        if let (Some(seal), Some(at)) = (seal, self.seal_at) {
            crc.update(seal);
            match &self.between {
                Some(between) => crc.combine(between),
                None => crc.update(&self.bytes[at.message + SEAL_LEN..self.values_at]),
            }
        }
        crc
    }

    /// The CRC-32 of a payload of the template's prefix (with the seal text `seal`, when
    /// sealed), `raw` then `suffix`.
    fn checksum_of(&self, seal: Option<&[u8]>, raw: &[u8], suffix: &[u8]) -> u32 {
        let mut crc = self.crc_of_prefix(seal);
        crc.update(raw);
        crc.update(suffix);
        crc.finalize()
    }

    /// Check that `seal` is given exactly when the template is sealed, and `values` is
    /// its count.
    fn check_args(&self, values: &[f32], seal: Option<&SealText>) {
        assert_eq!(values.len(), self.kind.values, "template of another size");
        assert_eq!(seal.is_some(), self.kind.sealed, "template of another kind");
    }

    /// The payload of `values` (exactly as many as the template was made for), sealed
    /// with `seal` (exactly when the template is sealed), into `out` (exactly
    /// `self.len()` bytes); its CRC-32.
    /// `stores` says how: streaming into a destination larger than the caches
    /// (`codec::Stores::for_destination`).
    pub fn write(
        &self,
        values: &[f32],
        seal: Option<&SealText>,
        out: &mut [u8],
        stores: Stores,
    ) -> u32 {
        self.check_args(values, seal);
        let raw = crate::dtype::f32_bytes(values);
        let end = self.values_end();
        stores.copy(&self.bytes[..self.values_at], &mut out[..self.values_at]);
        stores.copy(&self.bytes[end..], &mut out[end..]);
        if let (Some(at), Some(seal)) = (self.seal_at, seal) {
            for at in [at.message, at.footer] {
                out[at..at + SEAL_LEN].copy_from_slice(&seal.0);
            }
        }
        let mut crc = self.crc_of_prefix(seal.map(|s| &s.0[..]));
        // Copy and CRC one cache-sized block at a time: one read of the values from memory.
        codec::copy_and_crc(&mut crc, raw, &mut out[self.values_at..end], stores);
        // The suffix as the template holds it (the same bytes but for a seal, which
        // streaming stores have sent past the cache): a read of `out` would go to memory.
        match (self.seal_at, seal) {
            (Some(at), Some(seal)) => {
                crc.update(&self.bytes[end..at.footer]);
                crc.update(&seal.0);
                crc.update(&self.bytes[at.footer + SEAL_LEN..]);
            }
            _ => crc.update(&self.bytes[end..]),
        }
        crc.finalize()
    }

    /// The pieces of the payload of `values` sealed with `seal` (as for `write`), for a
    /// vectored write: the template's bytes, the seal and the values as they lie in
    /// memory, nothing copied; and its CRC-32.
    // Only the tokio sender (feature `tokio`) writes vectored.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub fn pieces<'a>(&'a self, values: &'a [f32], seal: Option<&'a SealText>) -> Pieces<'a> {
        self.check_args(values, seal);
        let raw = crate::dtype::f32_bytes(values);
        let parts = self.parts(seal, raw);
        let mut crc = self.crc_of_prefix(seal.map(|s| &s.0[..]));
        for part in &parts[3..] {
            crc.update(part);
        }
        Pieces {
            parts,
            checksum: crc.finalize(),
        }
    }

    /// When `payload` is this template's but for its values (and, sealed, its seal, the
    /// same UTF-8 text in both copies): its CRC-32, value bytes and seal. Then decoding
    /// it through Arrow would give exactly those values and that seal. (The CRC comes
    /// first and the copy after, as on the Arrow path: fusing the two per block, as
    /// `write` does, measured no faster here, and a corrupt payload's values are then
    /// never handed on.)
    pub fn matches<'p>(&self, payload: &'p [u8]) -> Option<Matched<'p>> {
        let end = self.values_end();
        if payload.len() != self.bytes.len() {
            return None;
        }
        let seal_bytes = match self.seal_at {
            None => None,
            Some(at) => {
                let message = &payload[at.message..at.message + SEAL_LEN];
                if payload[at.footer..at.footer + SEAL_LEN] != *message {
                    return None;
                }
                Some(message)
            }
        };
        let seal = seal_bytes.map(std::str::from_utf8).transpose().ok()?;
        if !self
            .constant
            .iter()
            .all(|&(from, to)| payload[from..to] == self.bytes[from..to])
        {
            return None;
        }
        let raw = &payload[self.values_at..end];
        // The constant bytes are the template's (compared above): their CRC is too.
        let checksum = self.checksum_of(seal_bytes, raw, &payload[end..]);
        Some(Matched {
            checksum,
            raw,
            seal,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| f32::from_bits((i as u32).wrapping_mul(2_654_435_761)))
            .collect()
    }

    fn kind(layout: Layout, values: usize, sealed: bool) -> Kind {
        Kind {
            layout,
            values,
            sealed,
            shape: None,
        }
    }

    /// The template of `kind`, from a cache of the test's own.
    fn get(kind: Kind) -> Option<std::sync::Arc<Template>> {
        Templates::new().get(kind)
    }

    fn a_seal(index: u32, total: u32) -> SealText {
        let id = TransferId::from_hex("fb1ea9060e8375d9842202a20885dc6b").unwrap();
        Seal::lone(id).text(index, total)
    }

    #[test]
    fn writes_what_the_arrow_writer_writes_with_its_crc() {
        for layout in [Layout::Seed, Layout::Compact] {
            for sealed in [false, true] {
                for n in [1, 2, 3, 7, 8, 1000, 4096, 65_537] {
                    let values = sample(n);
                    let seal = sealed.then(|| a_seal(3, 9));
                    let t = get(kind(layout, n, sealed)).expect("a template of ours");
                    let encoding = Encoding::from(layout).sealed(seal);
                    let expected = codec::encode_payload(encoding, &values).unwrap();
                    for stores in [Stores::Cached, Stores::Streaming] {
                        let mut out = vec![0u8; t.len()];
                        let crc = t.write(&values, seal.as_ref(), &mut out, stores);
                        assert_eq!(out, expected, "{layout:?} n={n} sealed={sealed}");
                        assert_eq!(crc, codec::checksum(&expected));
                    }
                    let crc = codec::checksum(&expected);
                    let pieces = t.pieces(&values, seal.as_ref());
                    assert_eq!(pieces.parts.concat(), expected);
                    assert_eq!(pieces.checksum, crc);
                    let matched = t.matches(&expected).expect("our payload matches");
                    assert_eq!(matched.checksum, crc);
                    assert_eq!(matched.raw, crate::dtype::f32_bytes(&values));
                    assert_eq!(matched.seal, seal.as_ref().map(SealText::as_str));
                }
            }
        }
    }

    #[test]
    fn a_payload_that_differs_outside_the_values_does_not_match() {
        for sealed in [false, true] {
            let t = get(kind(Layout::Seed, 100, sealed)).unwrap();
            let seal = sealed.then(|| a_seal(0, 1));
            let encoding = Encoding::from(Layout::Seed).sealed(seal);
            let payload = codec::encode_payload(encoding, &sample(100)).unwrap();
            let seals = t.seal_at.map_or(vec![], |at| vec![at.message, at.footer]);
            for i in (0..payload.len()).step_by(7) {
                let mut bad = payload.clone();
                bad[i] ^= 0x40;
                let inside_values = i >= t.values_at && i < t.values_at + 400;
                let in_a_seal = seals.iter().any(|&at| i >= at && i < at + SEAL_LEN);
                // A seal changed in one copy only is not the template's (the Arrow path
                // reads the footer's); changed in both, it is, with the new text.
                assert_eq!(t.matches(&bad).is_some(), inside_values, "byte {i}");
                if in_a_seal {
                    let at = seals
                        .iter()
                        .find(|&&at| i >= at && i < at + SEAL_LEN)
                        .unwrap();
                    for &other in &seals {
                        bad[other + (i - at)] = bad[i];
                    }
                    let matched = t.matches(&bad).expect("the same seal in both copies");
                    assert_ne!(matched.seal, seal.as_ref().map(SealText::as_str));
                }
            }
            assert!(t.matches(&payload[1..]).is_none());
            // The other layout's payload of as many values is not this template's.
            let compact = Encoding::from(Layout::Compact).sealed(seal);
            let compact = codec::encode_payload(compact, &sample(100)).unwrap();
            assert!(t.matches(&compact).is_none());
        }
        // A seal copy that is not UTF-8 is left to the Arrow path, which refuses it.
        let t = get(kind(Layout::Compact, 10, true)).unwrap();
        let encoding = Encoding::from(Layout::Compact).sealed(Some(a_seal(0, 1)));
        let mut payload = codec::encode_payload(encoding, &sample(10)).unwrap();
        let at = t.seal_at.unwrap();
        payload[at.message] = 0xff;
        payload[at.footer] = 0xff;
        assert!(t.matches(&payload).is_none());
    }

    #[test]
    fn a_shape_is_part_of_its_template() {
        let values = sample(100);
        for layout in [Layout::Seed, Layout::Compact] {
            for sealed in [false, true] {
                let seal = sealed.then(|| a_seal(1, 2));
                let encoding = |shape: &str| {
                    Encoding {
                        shape: Some(Arc::from(shape)),
                        ..Encoding::from(layout)
                    }
                    .sealed(seal)
                };
                let shaped = Kind {
                    shape: Some(Arc::from("[4,25]")),
                    ..kind(layout, 100, sealed)
                };
                let t = get(shaped).expect("a template of ours");
                assert_eq!(t.shape(), Some("[4,25]"));
                let expected = codec::encode_payload(encoding("[4,25]"), &values).unwrap();
                let mut out = vec![0u8; t.len()];
                let crc = t.write(&values, seal.as_ref(), &mut out, Stores::Cached);
                assert_eq!((out, crc), (expected.clone(), codec::checksum(&expected)));
                assert_eq!(t.pieces(&values, seal.as_ref()).parts.concat(), expected);
                assert!(t.matches(&expected).is_some());
                // Another shape of the same length, or none: not this template's payload,
                // and the shapeless template does not take this one.
                let other = codec::encode_payload(encoding("[5,20]"), &values).unwrap();
                assert_eq!(other.len(), expected.len());
                assert!(t.matches(&other).is_none());
                let bare = get(kind(layout, 100, sealed)).unwrap();
                assert!(bare.shape().is_none() && bare.matches(&expected).is_none());
            }
        }
    }

    #[test]
    fn no_template_for_nothing_or_for_huge_chunks() {
        assert!(get(kind(Layout::Seed, 0, false)).is_none());
        assert!(get(kind(Layout::Compact, MAX_VALUES + 1, true)).is_none());
    }
}
