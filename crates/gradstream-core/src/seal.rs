//! Sealed chunks (docs/spec/wire-format.md; the receiver's rule in
//! docs/spec/decoding-rules.md): the schema metadata `gradstream_seal` that puts
//! a chunk's transfer id, index, total and position under its CRC, so that headers swapped
//! between chunks, frames spliced from another transfer and tensors swapped inside a set
//! are refused. Here: `TransferId`, `Position` and `Seal` (what a sender attaches to a
//! gradient), the value's fixed-width text (`SealText`, written and strictly parsed), and
//! the receiving side: `SealCheck` (what a receiver expects) and `SealRule` (one
//! gradient's check, chunk by chunk), with the error texts both implementations share.
//!
//! Uses `error` only (and `getrandom` for standalone ids); used by `codec` (the key),
//! `template`, `encoder`, `rules`, `reassembler`, `receiver` and `tensors`.

use std::fmt;

use crate::error::{GradientStreamError, Result};

/// The schema metadata key of a sealed payload.
pub const SEAL_KEY: &str = "gradstream_seal";

/// Bytes of the seal's value: 32 + 1 + 8 + 1 + 8 + 1 + 8.
pub const SEAL_LEN: usize = 59;

/// The 16 bytes naming one transfer (a gradient, or a tensor set with its manifest).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TransferId(pub [u8; 16]);

impl TransferId {
    /// A fresh random id (a standalone `seal=True` sender's, per gradient or per set).
    pub fn random() -> Result<Self> {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).map_err(|e| {
            GradientStreamError::Io(std::io::Error::other(format!(
                "no random bytes for a transfer id: {e}"
            )))
        })?;
        Ok(Self(bytes))
    }

    /// The id of 32 hex digits (either case), or None.
    pub fn from_hex(text: &str) -> Option<Self> {
        let digits = text.as_bytes();
        if digits.len() != 32 {
            return None;
        }
        let mut bytes = [0u8; 16];
        for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
            *byte = (hex_value(pair[0])? << 4) | hex_value(pair[1])?;
        }
        Some(Self(bytes))
    }

    /// 32 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TransferId({self})")
    }
}

fn hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

/// Where a gradient stands in its transfer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Position {
    /// A gradient sent on its own: `ffffffff`.
    #[default]
    Lone,
    /// A tensor set's manifest: `fffffffe`.
    Manifest,
    /// Tensor k (from 0, in manifest order) of a tensor set: k.
    Tensor(u32),
}

impl Position {
    const LONE: u32 = 0xffff_ffff;
    const MANIFEST: u32 = 0xffff_fffe;

    /// The position's number on the wire.
    pub fn code(self) -> u32 {
        match self {
            Self::Lone => Self::LONE,
            Self::Manifest => Self::MANIFEST,
            Self::Tensor(k) => k,
        }
    }

    pub fn from_code(code: u32) -> Self {
        match code {
            Self::LONE => Self::Lone,
            Self::MANIFEST => Self::Manifest,
            k => Self::Tensor(k),
        }
    }

    /// What a receiver waiting for `expected` is told when the sender sent `read`
    /// instead: the call that receives it (a lone gradient where a set's manifest was
    /// expected, or the other way round), else nothing.
    fn mismatch_hint(read: Self, expected: Self) -> &'static str {
        match (read, expected) {
            (Self::Manifest, Self::Lone) => {
                ": the peer sent a tensor set (send_tensors); receive it with recv_tensors()"
            }
            (Self::Lone, Self::Manifest) => {
                ": the peer sent a lone gradient (send); receive it with recv()"
            }
            _ => "",
        }
    }

    /// How the error texts name it.
    fn described(self) -> String {
        match self {
            Self::Lone => "a lone gradient".into(),
            Self::Manifest => "a tensor set's manifest".into(),
            Self::Tensor(k) => format!("tensor position {k} of a tensor set"),
        }
    }
}

/// What a sender seals a gradient with; each chunk's seal adds its index and total.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seal {
    pub transfer: TransferId,
    pub position: Position,
}

impl Seal {
    /// A gradient sent on its own.
    pub fn lone(transfer: TransferId) -> Self {
        Self {
            transfer,
            position: Position::Lone,
        }
    }

    /// The value of chunk `index` of `total`.
    pub fn text(&self, index: u32, total: u32) -> SealText {
        let mut text = [0u8; SEAL_LEN];
        let id = self.transfer.to_hex();
        let fields = format!("{id}:{index:08x}:{total:08x}:{:08x}", self.position.code());
        text.copy_from_slice(fields.as_bytes());
        SealText(text)
    }
}

/// A seal's value as written: 59 ASCII bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SealText(pub [u8; SEAL_LEN]);

impl SealText {
    pub fn as_str(&self) -> &str {
        // Only `Seal::text` makes one, of ASCII hex digits and colons.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl fmt::Debug for SealText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SealText({})", self.as_str())
    }
}

/// A seal read from a payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadSeal {
    pub transfer: TransferId,
    pub index: u32,
    pub total: u32,
    pub position: Position,
}

/// A seal's value, strictly: exactly `<32 hex>:<8 hex>:<8 hex>:<8 hex>`, lowercase.
pub fn parse(text: &str) -> Option<ReadSeal> {
    let bytes = text.as_bytes();
    let lowercase_hex = |part: &[u8]| part.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if bytes.len() != SEAL_LEN || [32, 41, 50].iter().any(|&at| bytes[at] != b':') {
        return None;
    }
    let (id, index, total, position) = (&text[..32], &text[33..41], &text[42..50], &text[51..]);
    if ![id, index, total, position]
        .iter()
        .all(|part| lowercase_hex(part.as_bytes()))
    {
        return None;
    }
    let number = |part: &str| u32::from_str_radix(part, 16).ok();
    Some(ReadSeal {
        transfer: TransferId::from_hex(id)?,
        index: number(index)?,
        total: number(total)?,
        position: Position::from_code(number(position)?),
    })
}

/// What a receiver expects of the seals (docs/spec/decoding-rules.md, the seal rule).
///
/// There is no key: a seal is the transfer's id and the chunk's place in it, under the
/// chunk's CRC. Every receiver verifies a seal it finds; the modes differ in whether one
/// is required and which transfer id is expected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SealCheck {
    /// Any receiver without `seal=True` (ipfrs-transport's frames carry no seal): the first
    /// chunk taken decides. Unsealed, every chunk must be unsealed; sealed, every chunk
    /// must be sealed and is held to what `Consistent` holds it to.
    #[default]
    WhenPresent,
    /// A standalone `seal=True` receiver: every chunk sealed, all with the transfer id of
    /// the first chunk taken.
    Consistent,
    /// A connection's receiver, which knows the id of the transfer it expects next.
    Exact(TransferId),
    /// No chunk sealed: the tensors of a set whose manifest a `WhenPresent` receiver took
    /// unsealed.
    Absent,
}

/// One gradient's seal check: the expectation, the position the gradient must hold, and
/// the first chunk taken with the transfer id it was sealed with (None: unsealed).
#[derive(Clone, Copy, Debug, Default)]
pub struct SealRule {
    check: SealCheck,
    position: Position,
    first: Option<(u32, Option<TransferId>)>,
}

impl SealRule {
    pub fn new(check: SealCheck, position: Position) -> Self {
        Self {
            check,
            position,
            first: None,
        }
    }

    /// The transfer id the chunks taken so far carry (the expected one, for `Exact`; None
    /// before the first, or when they are unsealed).
    pub fn transfer(&self) -> Option<TransferId> {
        match self.check {
            SealCheck::Exact(id) => Some(id),
            _ => self.first.and_then(|(_, id)| id),
        }
    }

    /// The seal of chunk `index` of `total` (its header's), as its payload's schema
    /// carries it (`seal`, the first entry of the key), against what is expected.
    pub fn check(&mut self, index: u32, total: u32, seal: Option<&str>) -> Result<()> {
        let refused = |detail: String| GradientStreamError::frame(detail, Some(index));
        let Some(text) = seal else {
            return match (self.check, self.first) {
                (SealCheck::Consistent | SealCheck::Exact(_), _) => Err(refused(format!(
                    "chunk {index} is not sealed; this receiver expects sealed chunks"
                ))),
                (_, Some((first, Some(id)))) => Err(refused(format!(
                    "chunk {index} is not sealed; chunk {first} is sealed for transfer {id}"
                ))),
                _ => {
                    self.take(index, None);
                    Ok(())
                }
            };
        };
        let Some(read) = parse(text) else {
            return Err(refused(format!(
                "chunk {index} has a gradstream_seal that is not \
                 <32 hex>:<8 hex>:<8 hex>:<8 hex> in lowercase"
            )));
        };
        match (self.check, self.first) {
            (SealCheck::Absent, _) => {
                return Err(refused(format!(
                    "chunk {index} is sealed; the tensor set's manifest is not sealed"
                )));
            }
            (SealCheck::WhenPresent, Some((first, None))) => {
                return Err(refused(format!(
                    "chunk {index} is sealed; chunk {first} is not sealed"
                )));
            }
            (SealCheck::Exact(expected), _) if read.transfer != expected => {
                return Err(refused(format!(
                    "chunk {index} is sealed for transfer {}, expected transfer {expected}",
                    read.transfer
                )));
            }
            (_, Some((first, Some(expected)))) if read.transfer != expected => {
                return Err(refused(format!(
                    "chunk {index} is sealed for transfer {}; chunk {first} is sealed for \
                     transfer {expected}",
                    read.transfer
                )));
            }
            _ => {}
        }
        let expected = self.position;
        if read.position != expected {
            return Err(refused(format!(
                "chunk {index} is sealed for {}, expected {}{}",
                read.position.described(),
                expected.described(),
                Position::mismatch_hint(read.position, expected)
            )));
        }
        if (read.index, read.total) != (index, total) {
            return Err(refused(format!(
                "chunk {index} of {total} is sealed as chunk {} of {}",
                read.index, read.total
            )));
        }
        self.take(index, Some(read.transfer));
        Ok(())
    }

    /// Record the first chunk taken (a no-op for later ones).
    fn take(&mut self, index: u32, transfer: Option<TransferId>) {
        if self.first.is_none() {
            self.first = Some((index, transfer));
        }
    }

    /// Forget chunk `index` (it failed a later rule, so it was not taken).
    pub fn undo(&mut self, index: u32) {
        if matches!(self.first, Some((first, _)) if first == index) {
            self.first = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(byte: u8) -> TransferId {
        TransferId([byte; 16])
    }

    #[test]
    fn the_text_is_fixed_width_lowercase_and_parses_back() {
        let readme = TransferId::from_hex("fb1ea9060e8375d9842202a20885dc6b").unwrap();
        let text = Seal::lone(readme).text(0, 2);
        assert_eq!(
            text.as_str(),
            "fb1ea9060e8375d9842202a20885dc6b:00000000:00000002:ffffffff"
        );
        for position in [Position::Lone, Position::Manifest, Position::Tensor(7)] {
            let seal = Seal {
                transfer: id(0xab),
                position,
            };
            let text = seal.text(u32::MAX, 3);
            assert_eq!(text.0.len(), SEAL_LEN);
            let read = parse(text.as_str()).unwrap();
            assert_eq!(
                (read.transfer, read.index, read.total, read.position),
                (id(0xab), u32::MAX, 3, position)
            );
        }
        assert_eq!(
            Seal {
                transfer: id(1),
                position: Position::Manifest
            }
            .text(0, 1)
            .as_str()
            .rsplit(':')
            .next(),
            Some("fffffffe")
        );
    }

    #[test]
    fn the_parser_takes_nothing_but_the_grammar() {
        let good = Seal::lone(id(0x5c)).text(1, 2);
        let good = good.as_str();
        assert!(parse(good).is_some());
        let upper = good.to_uppercase();
        let bad = [
            &good[..58],
            &format!("{good}0"),
            &upper,
            &good.replacen(':', ";", 1),
            &format!("+{}", &good[1..]),
            &format!("{} ", &good[..58]),
            "",
        ];
        for text in bad {
            assert!(parse(text).is_none(), "{text:?}");
        }
        assert!(TransferId::from_hex("zz").is_none());
        assert_eq!(
            TransferId::from_hex(&id(0x0f).to_hex()).unwrap().to_hex(),
            "0f".repeat(16)
        );
    }

    fn text(seal: Seal, i: u32, n: u32) -> String {
        seal.text(i, n).as_str().to_string()
    }

    fn detail(r: Result<()>) -> (String, Option<u32>) {
        match r {
            Err(GradientStreamError::Frame {
                detail,
                chunk_index,
                ..
            }) => (detail, chunk_index),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn each_refusal_names_what_was_found_and_what_was_expected() {
        let mut exact = SealRule::new(SealCheck::Exact(id(1)), Position::Lone);
        assert_eq!(
            detail(exact.check(0, 2, None)),
            (
                "chunk 0 is not sealed; this receiver expects sealed chunks".into(),
                Some(0)
            )
        );
        assert!(detail(exact.check(0, 2, Some("x")))
            .0
            .contains("is not <32 hex>"));
        assert_eq!(
            detail(exact.check(0, 2, Some(&text(Seal::lone(id(2)), 0, 2)))).0,
            format!(
                "chunk 0 is sealed for transfer {}, expected transfer {}",
                id(2),
                id(1)
            )
        );
        let tensor = Seal {
            transfer: id(1),
            position: Position::Tensor(1),
        };
        assert_eq!(
            detail(exact.check(0, 2, Some(&text(tensor, 0, 2)))).0,
            "chunk 0 is sealed for tensor position 1 of a tensor set, expected a lone gradient"
        );
        assert_eq!(
            detail(exact.check(1, 2, Some(&text(Seal::lone(id(1)), 0, 2)))).0,
            "chunk 1 of 2 is sealed as chunk 0 of 2"
        );
        exact
            .check(1, 2, Some(&text(Seal::lone(id(1)), 1, 2)))
            .unwrap();

        let mut consistent = SealRule::new(SealCheck::Consistent, Position::Manifest);
        let manifest = |t| Seal {
            transfer: t,
            position: Position::Manifest,
        };
        consistent
            .check(3, 5, Some(&text(manifest(id(7)), 3, 5)))
            .unwrap();
        assert_eq!(consistent.transfer(), Some(id(7)));
        assert_eq!(
            detail(consistent.check(0, 5, Some(&text(manifest(id(8)), 0, 5)))).0,
            format!(
                "chunk 0 is sealed for transfer {}; chunk 3 is sealed for transfer {}",
                id(8),
                id(7)
            )
        );
        // A chunk that was not taken after all no longer fixes the id.
        consistent.undo(3);
        consistent
            .check(0, 5, Some(&text(manifest(id(8)), 0, 5)))
            .unwrap();
        assert_eq!(consistent.transfer(), Some(id(8)));
    }

    #[test]
    fn a_receiver_without_seal_true_verifies_a_seal_it_finds_in_the_same_words() {
        // Unsealed chunks, as ipfrs-transport sends them: taken, with no transfer id.
        let mut plain = SealRule::default();
        plain.check(1, 2, None).unwrap();
        plain.check(0, 2, None).unwrap();
        assert_eq!(plain.transfer(), None);
        // Sealed ones: held to what a seal=True receiver holds them to, in its words.
        for check in [SealCheck::WhenPresent, SealCheck::Consistent] {
            let mut rule = SealRule::new(check, Position::Lone);
            rule.check(1, 3, Some(&text(Seal::lone(id(4)), 1, 3)))
                .unwrap();
            assert_eq!(rule.transfer(), Some(id(4)));
            let spliced = detail(rule.check(0, 3, Some(&text(Seal::lone(id(5)), 0, 3))));
            let swapped = detail(rule.check(0, 3, Some(&text(Seal::lone(id(4)), 2, 3))));
            let malformed = detail(rule.check(0, 3, Some("anything")));
            let tensor = Seal {
                transfer: id(4),
                position: Position::Tensor(0),
            };
            let moved = detail(rule.check(0, 3, Some(&text(tensor, 0, 3))));
            assert_eq!(
                [spliced, swapped, malformed, moved].map(|(d, _)| d),
                [
                    format!(
                        "chunk 0 is sealed for transfer {}; chunk 1 is sealed for transfer {}",
                        id(5),
                        id(4)
                    ),
                    "chunk 0 of 3 is sealed as chunk 2 of 3".into(),
                    "chunk 0 has a gradstream_seal that is not <32 hex>:<8 hex>:<8 hex>:<8 hex> \
                     in lowercase"
                        .into(),
                    "chunk 0 is sealed for tensor position 0 of a tensor set, expected a lone \
                     gradient"
                        .into(),
                ],
                "{check:?}"
            );
        }
        // Once one chunk of a gradient is sealed, every chunk must be, and the other way.
        let mut sealed_first = SealRule::default();
        sealed_first
            .check(0, 2, Some(&text(Seal::lone(id(4)), 0, 2)))
            .unwrap();
        assert_eq!(
            detail(sealed_first.check(1, 2, None)),
            (
                format!(
                    "chunk 1 is not sealed; chunk 0 is sealed for transfer {}",
                    id(4)
                ),
                Some(1)
            )
        );
        let mut plain_first = SealRule::default();
        plain_first.check(1, 2, None).unwrap();
        let sealed = text(Seal::lone(id(4)), 0, 2);
        assert_eq!(
            detail(plain_first.check(0, 2, Some(&sealed))),
            ("chunk 0 is sealed; chunk 1 is not sealed".into(), Some(0))
        );
        // A first chunk that was not taken after all decides nothing.
        plain_first.undo(1);
        plain_first.check(0, 2, Some(&sealed)).unwrap();
        assert_eq!(plain_first.transfer(), Some(id(4)));
        // The tensors of a set whose manifest came unsealed.
        let mut absent = SealRule::new(SealCheck::Absent, Position::Tensor(0));
        absent.check(0, 1, None).unwrap();
        let tensor = Seal {
            transfer: id(4),
            position: Position::Tensor(0),
        };
        assert_eq!(
            detail(absent.check(0, 1, Some(&text(tensor, 0, 1)))).0,
            "chunk 0 is sealed; the tensor set's manifest is not sealed"
        );
    }

    #[test]
    fn random_ids_differ() {
        assert_ne!(TransferId::random().unwrap(), TransferId::random().unwrap());
    }
}
