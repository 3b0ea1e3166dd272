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
//! Uses `codec` (to build and check templates) and `dtype`; used by `encoder`, `rules`
//! and `stream`.

use std::sync::{Arc, Mutex};

use crate::codec::{self, Layout};

/// Bytes copied and CRC'd at a time: well inside L1/L2, so the second touch is a hit.
const BLOCK: usize = 16 * 1024;
/// Values a cached template may hold: at most 8 MiB of template (seed layout).
const MAX_VALUES: usize = 1 << 20;
/// Templates kept of the sizes this process's senders chose (two sizes per gradient, full
/// chunks and the tail, per layout).
const MADE_SLOTS: usize = 8;
/// Templates kept of the sizes peers' payloads had (learned on receipt).
const LEARNED_SLOTS: usize = 4;

/// The process's templates, in two shelves. A template is a pure function of (layout,
/// value count), so one set serves every session; what a peer decides (the sizes of the
/// payloads it sends) can only fill the learned shelf: a peer cycling sizes evicts what
/// other peers taught, never the templates our own senders use. Learning costs two
/// encodes and two decodes of a payload's value count, which a peer paid for with at
/// least 4 bytes a value (see `learn`), so its work per byte received is bounded.
struct Cache {
    made: Shelf,
    learned: Shelf,
}

/// A bounded list of templates, oldest first out.
struct Shelf {
    slots: usize,
    list: Mutex<Vec<Arc<Template>>>,
}

static CACHE: Cache = Cache::new();

impl Shelf {
    const fn new(slots: usize) -> Self {
        Self {
            slots,
            list: Mutex::new(Vec::new()),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Vec<Arc<Template>>) -> T) -> T {
        // A panic while the lock was held cannot leave the list half-changed (push and
        // remove are whole), so a poisoned lock is taken as it is.
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut list)
    }

    fn find(&self, keep: impl Fn(&Template) -> bool) -> Vec<Arc<Template>> {
        self.with(|list| list.iter().filter(|t| keep(t)).cloned().collect())
    }

    fn put(&self, template: Arc<Template>) {
        self.with(|list| {
            if list.len() >= self.slots {
                list.remove(0);
            }
            list.push(template);
        });
    }
}

impl Cache {
    const fn new() -> Self {
        Self {
            made: Shelf::new(MADE_SLOTS),
            learned: Shelf::new(LEARNED_SLOTS),
        }
    }

    fn find(&self, keep: impl Fn(&Template) -> bool + Copy) -> Vec<Arc<Template>> {
        let mut found = self.made.find(keep);
        found.extend(self.learned.find(keep));
        found
    }

    fn known(&self, layout: Layout, values: usize) -> Option<Arc<Template>> {
        let found = self.find(|t| t.layout == layout && t.values == values);
        found.into_iter().next()
    }

    /// The template of (layout, values), from either shelf or built onto `shelf`.
    fn get_onto(&self, shelf: &Shelf, layout: Layout, values: usize) -> Option<Arc<Template>> {
        if values == 0 || values > MAX_VALUES {
            return None;
        }
        if let Some(found) = self.known(layout, values) {
            return Some(found);
        }
        let built = Arc::new(Template::build(layout, values)?);
        shelf.put(built.clone());
        Some(built)
    }

    fn learn(&self, values: usize, payload_len: usize) {
        // Any payload of ours is at least 4 bytes a value: a larger count is not ours.
        if values.saturating_mul(4) < payload_len {
            for layout in [Layout::Seed, Layout::Compact] {
                self.get_onto(&self.learned, layout, values);
            }
        }
    }
}

/// A payload with its value bytes marked out. See the module comment.
#[derive(Debug)]
pub struct Template {
    layout: Layout,
    values: usize,
    bytes: Vec<u8>,
    /// Where the value bytes start; they run for `4 * values` bytes.
    values_at: usize,
    /// CRC-32 of `bytes[..values_at]`.
    prefix_crc: u32,
}

impl Template {
    /// The template of `values`-value payloads in `layout`, from the cache or built now
    /// (for a sender: onto the shelf of sizes our senders chose). None when it is too large
    /// to keep or the writer's output has a shape we do not know (then the Arrow path is
    /// used, with the same result).
    pub fn get(layout: Layout, values: usize) -> Option<Arc<Self>> {
        CACHE.get_onto(&CACHE.made, layout, values)
    }

    /// The cached templates `payload_len` bytes long (at most one per layout and shelf).
    pub fn for_payload(payload_len: usize) -> Vec<Arc<Self>> {
        CACHE.find(|t| t.bytes.len() == payload_len)
    }

    /// A payload of `payload_len` bytes decoded to `values` values the slow way: make the
    /// templates of that count (on the learned shelf), so later payloads like it take the
    /// fast path.
    pub fn learn(values: usize, payload_len: usize) {
        CACHE.learn(values, payload_len);
    }

    /// Encode two payloads whose values differ in every byte; the bytes that differ must
    /// be exactly one run of `4 * values`, the values, and the result must decode to them.
    fn build(layout: Layout, values: usize) -> Option<Self> {
        let ones = vec![f32::from_bits(0x0101_0101); values];
        let twos = vec![f32::from_bits(0x0202_0202); values];
        let a = codec::encode_payload(layout, &ones).ok()?;
        let b = codec::encode_payload(layout, &twos).ok()?;
        if a.len() != b.len() {
            return None;
        }
        let values_at = a.iter().zip(&b).position(|(x, y)| x != y)?;
        let end = values_at + 4 * values;
        let differs_only_there = a[end.min(a.len())..] == b[end.min(b.len())..]
            && a.get(values_at..end)?.iter().all(|&x| x == 0x01)
            && b.get(values_at..end)?.iter().all(|&x| x == 0x02);
        // Both must decode to their own values: the decoder reads the values from the run
        // that differs, not from some constant run that happens to look alike.
        let decodes_to = |payload: &[u8], bits: u32| {
            let mut decoded = Vec::with_capacity(values);
            codec::decode_payload(payload, &mut decoded, values).is_ok()
                && decoded.len() == values
                && decoded.iter().all(|v| v.to_bits() == bits)
        };
        let decodes_to_them = decodes_to(&a, 0x0101_0101) && decodes_to(&b, 0x0202_0202);
        if !(differs_only_there && decodes_to_them) {
            return None;
        }
        let prefix_crc = codec::checksum(&a[..values_at]);
        Some(Self {
            layout,
            values,
            bytes: a,
            values_at,
            prefix_crc,
        })
    }

    /// Length of each payload made from this template.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    fn suffix(&self) -> &[u8] {
        &self.bytes[self.values_at + 4 * self.values..]
    }

    /// The payload of `values` (exactly as many as the template was made for) into `out` (exactly
    /// `self.len()` bytes); its CRC-32.
    pub fn write(&self, values: &[f32], out: &mut [u8]) -> u32 {
        assert_eq!(values.len(), self.values, "template of another size");
        let raw = crate::dtype::f32_bytes(values);
        let (prefix, rest) = out.split_at_mut(self.values_at);
        let (body, suffix) = rest.split_at_mut(raw.len());
        prefix.copy_from_slice(&self.bytes[..self.values_at]);
        suffix.copy_from_slice(self.suffix());
        let mut crc = crc32fast::Hasher::new_with_initial(self.prefix_crc);
        // Copy and CRC one cache-sized block at a time: the CRC reads what the copy just
        // brought into cache, instead of a second pass over memory.
        for (from, to) in raw.chunks(BLOCK).zip(body.chunks_mut(BLOCK)) {
            to.copy_from_slice(from);
            crc.update(from);
        }
        crc.update(self.suffix());
        crc.finalize()
    }

    /// The pieces of the payload of `values`, for a vectored write: the prefix, the
    /// values as they lie in memory, the suffix; and its CRC-32.
    // Only the tokio sender (feature `tokio`) writes vectored.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub fn pieces<'a>(&'a self, values: &'a [f32]) -> ([&'a [u8]; 3], u32) {
        assert_eq!(values.len(), self.values, "template of another size");
        let raw = crate::dtype::f32_bytes(values);
        (
            [&self.bytes[..self.values_at], raw, self.suffix()],
            self.checksum_of(raw),
        )
    }

    fn checksum_of(&self, raw: &[u8]) -> u32 {
        let mut crc = crc32fast::Hasher::new_with_initial(self.prefix_crc);
        crc.update(raw);
        crc.update(self.suffix());
        crc.finalize()
    }

    /// When `payload` is this template's but for its values: its CRC-32 and its value
    /// bytes. Then decoding it through Arrow would give exactly those values. (The CRC
    /// comes first and the copy after, as on the Arrow path: fusing the two per block, as
    /// `write` does, measured no faster here, and a corrupt payload's values are then
    /// never handed on.)
    pub fn matches<'p>(&self, payload: &'p [u8]) -> Option<(u32, &'p [u8])> {
        let end = self.values_at + 4 * self.values;
        if payload.len() != self.bytes.len()
            || payload[..self.values_at] != self.bytes[..self.values_at]
            || payload[end..] != *self.suffix()
        {
            return None;
        }
        let raw = &payload[self.values_at..end];
        Some((self.checksum_of(raw), raw))
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

    #[test]
    fn writes_what_the_arrow_writer_writes_with_its_crc() {
        for layout in [Layout::Seed, Layout::Compact] {
            for n in [1, 2, 3, 7, 8, 1000, 4096, 65_537] {
                let values = sample(n);
                let t = Template::get(layout, n).expect("a template for our own writer");
                let expected = codec::encode_payload(layout, &values).unwrap();
                let mut out = vec![0u8; t.len()];
                let crc = t.write(&values, &mut out);
                assert_eq!(out, expected, "{layout:?} n={n}");
                assert_eq!(crc, codec::checksum(&expected));
                let ([a, b, c], crc2) = t.pieces(&values);
                assert_eq!([a, b, c].concat(), expected);
                assert_eq!(crc2, crc);
                let (crc3, raw) = t.matches(&expected).expect("our payload matches");
                assert_eq!(crc3, crc);
                assert_eq!(raw, crate::dtype::f32_bytes(&values));
            }
        }
    }

    #[test]
    fn a_payload_that_differs_outside_the_values_does_not_match() {
        let t = Template::get(Layout::Seed, 100).unwrap();
        let payload = codec::encode_payload(Layout::Seed, &sample(100)).unwrap();
        for i in (0..payload.len()).step_by(7) {
            let mut bad = payload.clone();
            bad[i] ^= 0x40;
            let inside_values = i >= t.values_at && i < t.values_at + 400;
            assert_eq!(t.matches(&bad).is_some(), inside_values, "byte {i}");
        }
        assert!(t.matches(&payload[1..]).is_none());
        // The other layout's payload of as many values is not this template's.
        let compact = codec::encode_payload(Layout::Compact, &sample(100)).unwrap();
        assert!(t.matches(&compact).is_none());
    }

    #[test]
    fn what_peers_teach_never_evicts_what_senders_made() {
        // A cache of its own: the process's is shared with the tests running beside.
        let cache = Cache::new();
        let made = cache.get_onto(&cache.made, Layout::Compact, 300).unwrap();
        // A peer cycling through 20 payload sizes, each learned in both layouts.
        for n in 1..=20 {
            cache.learn(1000 + n, 8 * (1000 + n) + 600);
        }
        let again = cache
            .known(Layout::Compact, 300)
            .expect("still on its shelf");
        assert!(Arc::ptr_eq(&made, &again));
        assert_eq!(cache.learned.find(|_| true).len(), LEARNED_SLOTS);
        assert_eq!(cache.made.find(|_| true).len(), 1);
        // A count no payload of ours could carry in that many bytes is not learned.
        let before = cache.learned.find(|_| true);
        cache.learn(5000, 5000);
        let after = cache.learned.find(|_| true);
        assert!(before.iter().zip(&after).all(|(a, b)| Arc::ptr_eq(a, b)));
        // What was learned serves a payload of that size.
        let last = cache.learned.find(|t| t.values == 1020);
        assert_eq!(last.len(), 2);
    }

    #[test]
    fn no_template_for_nothing_or_for_huge_chunks() {
        assert!(Template::get(Layout::Seed, 0).is_none());
        assert!(Template::get(Layout::Compact, MAX_VALUES + 1).is_none());
    }
}
