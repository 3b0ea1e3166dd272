//! A certificate's subject as text, the way both implementations write it (README "TLS
//! and authentication"; the reference reads Python's `ssl.getpeercert()`): attributes in
//! certificate order, `KEY=value` joined by `,`, the parts of a multi-valued RDN joined by
//! `+`; keys `CN O OU C ST L emailAddress` for their OIDs, any other OID dotted; a `\`, `,`
//! or `+` inside a value escaped with a `\` (so no value reads as a second attribute). Values are
//! decoded as OpenSSL's `ASN1_STRING_to_UTF8` decodes them (which is what Python sees):
//! UTF8String as UTF-8, the one-byte string types as Latin-1, BMPString as UCS-2 and
//! UniversalString as UCS-4, big-endian; any other value type is refused, as Python refuses it.
//!
//! The DER walker is small, strict and bounded: definite, shortest-form lengths of at most
//! 4 bytes, low tag numbers, no recursion, every length checked against what is left. It
//! reads only the path from the certificate to its subject.
//!
//! Uses nothing of the crate; used by `acceptor`.

const INTEGER: u8 = 0x02;
const OID: u8 = 0x06;
const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
/// `[0] EXPLICIT version`, optional at the start of a TBSCertificate.
const VERSION: u8 = 0xa0;

/// What is wrong with a certificate whose subject cannot be read.
pub type Malformed = &'static str;

/// DER elements one after another.
struct Elements<'a> {
    rest: &'a [u8],
}

impl<'a> Elements<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes }
    }

    fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }

    fn peek_tag(&self) -> Option<u8> {
        self.rest.first().copied()
    }

    /// The next element's tag and contents.
    fn next(&mut self) -> Result<(u8, &'a [u8]), Malformed> {
        let (&tag, rest) = self.rest.split_first().ok_or("a truncated element")?;
        if tag & 0x1f == 0x1f {
            return Err("a high tag number");
        }
        let (&first, mut rest) = rest.split_first().ok_or("a truncated length")?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let count = usize::from(first & 0x7f);
            if count == 0 {
                return Err("an indefinite length");
            }
            if count > 4 {
                return Err("a length of more than 4 bytes");
            }
            let (digits, after) = rest.split_at_checked(count).ok_or("a truncated length")?;
            rest = after;
            if digits[0] == 0 {
                return Err("a length not in its shortest form");
            }
            let len = digits
                .iter()
                .fold(0usize, |len, &digit| (len << 8) | usize::from(digit));
            if len < 0x80 {
                return Err("a length not in its shortest form");
            }
            len
        };
        let (contents, after) = rest
            .split_at_checked(len)
            .ok_or("a length past the end of its element")?;
        self.rest = after;
        Ok((tag, contents))
    }

    /// The next element's contents, which must have `tag`.
    fn expect(&mut self, tag: u8, what: Malformed) -> Result<&'a [u8], Malformed> {
        match self.next()? {
            (found, contents) if found == tag => Ok(contents),
            _ => Err(what),
        }
    }
}

/// The subject text of a DER certificate.
pub fn subject_text(certificate: &[u8]) -> Result<String, Malformed> {
    let mut outer = Elements::new(certificate);
    let body = outer.expect(SEQUENCE, "not a certificate")?;
    if !outer.is_empty() {
        return Err("bytes after the certificate");
    }
    let tbs = Elements::new(body).expect(SEQUENCE, "no TBSCertificate")?;
    let mut fields = Elements::new(tbs);
    if fields.peek_tag() == Some(VERSION) {
        fields.next()?;
    }
    fields.expect(INTEGER, "no serial number")?;
    fields.expect(SEQUENCE, "no signature algorithm")?;
    fields.expect(SEQUENCE, "no issuer")?;
    fields.expect(SEQUENCE, "no validity")?;
    let subject = fields.expect(SEQUENCE, "no subject")?;
    name_text(subject)
}

/// A Name (a sequence of RDNs, each a set of attributes) as text.
fn name_text(name: &[u8]) -> Result<String, Malformed> {
    let mut rdns = Elements::new(name);
    let mut parts = Vec::new();
    while !rdns.is_empty() {
        let mut attributes = Elements::new(rdns.expect(SET, "an RDN that is not a set")?);
        if attributes.is_empty() {
            return Err("an empty RDN");
        }
        let mut rdn = Vec::new();
        while !attributes.is_empty() {
            let mut attribute =
                Elements::new(attributes.expect(SEQUENCE, "an attribute that is not a sequence")?);
            let key = key(attribute.expect(OID, "an attribute without an OID")?)?;
            let (tag, value) = attribute.next()?;
            if !attribute.is_empty() {
                return Err("an attribute with more than a type and a value");
            }
            rdn.push(format!("{key}={}", escaped(&string_value(tag, value)?)));
        }
        parts.push(rdn.join("+"));
    }
    Ok(parts.join(","))
}

/// A value with the separators in it escaped: a commonName `a,O=lab` must not read as a
/// second attribute.
fn escaped(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        if matches!(c, '\\' | ',' | '+') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// An attribute type's key: its short name, or its OID dotted.
fn key(oid: &[u8]) -> Result<String, Malformed> {
    let dotted = dotted(oid)?;
    let name = match dotted.as_str() {
        "2.5.4.3" => "CN",
        "2.5.4.10" => "O",
        "2.5.4.11" => "OU",
        "2.5.4.6" => "C",
        "2.5.4.8" => "ST",
        "2.5.4.7" => "L",
        "1.2.840.113549.1.9.1" => "emailAddress",
        _ => return Ok(dotted),
    };
    Ok(name.to_string())
}

/// An OID's contents as dotted decimal (arcs of base-128 digits, shortest form, each
/// fitting a u64; the first byte's arc holds the first two).
fn dotted(oid: &[u8]) -> Result<String, Malformed> {
    if oid.is_empty() {
        return Err("an empty OID");
    }
    let mut arcs: Vec<u64> = Vec::new();
    let mut arc: u64 = 0;
    let mut at_start = true;
    for &byte in oid {
        if at_start && byte == 0x80 {
            return Err("an OID arc not in its shortest form");
        }
        arc = arc
            .checked_mul(128)
            .and_then(|a| a.checked_add(u64::from(byte & 0x7f)))
            .ok_or("an OID arc beyond 64 bits")?;
        at_start = byte & 0x80 == 0;
        if at_start {
            arcs.push(arc);
            arc = 0;
        }
    }
    if !at_start {
        return Err("a truncated OID");
    }
    let first = arcs[0];
    let (top, second) = match first {
        0..40 => (0, first),
        40..80 => (1, first - 40),
        _ => (2, first - 80),
    };
    let mut text = format!("{top}.{second}");
    for arc in &arcs[1..] {
        text.push('.');
        text.push_str(&arc.to_string());
    }
    Ok(text)
}

/// A value of one of the string types OpenSSL converts to UTF-8, decoded as it decodes it.
fn string_value(tag: u8, bytes: &[u8]) -> Result<String, Malformed> {
    match tag {
        // UTF8String
        0x0c => std::str::from_utf8(bytes)
            .map(str::to_string)
            .map_err(|_| "a UTF8String that is not UTF-8"),
        // NumericString, PrintableString, T61String, IA5String, VisibleString: one byte
        // a character, as OpenSSL reads them.
        0x12 | 0x13 | 0x14 | 0x16 | 0x1a => Ok(bytes.iter().map(|&b| char::from(b)).collect()),
        // BMPString: UCS-2, no surrogates.
        0x1e => units(bytes, 2, "a BMPString that is not UCS-2"),
        // UniversalString: UCS-4.
        0x1c => units(bytes, 4, "a UniversalString that is not UCS-4"),
        _ => Err("a value that is not a string"),
    }
}

/// Big-endian code points of `width` bytes each.
fn units(bytes: &[u8], width: usize, what: Malformed) -> Result<String, Malformed> {
    if !bytes.len().is_multiple_of(width) {
        return Err(what);
    }
    bytes
        .chunks_exact(width)
        .map(|unit| {
            let point = unit
                .iter()
                .fold(0u32, |point, &b| (point << 8) | u32::from(b));
            char::from_u32(point).ok_or(what)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DER element.
    fn tlv(tag: u8, contents: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        let len = contents.len();
        if len < 0x80 {
            out.push(len as u8);
        } else {
            let digits: Vec<u8> = len
                .to_be_bytes()
                .into_iter()
                .skip_while(|&d| d == 0)
                .collect();
            out.push(0x80 | digits.len() as u8);
            out.extend(digits);
        }
        out.extend_from_slice(contents);
        out
    }

    fn attribute(oid: &[u8], tag: u8, value: &[u8]) -> Vec<u8> {
        tlv(SEQUENCE, &[tlv(OID, oid), tlv(tag, value)].concat())
    }

    const CN: &[u8] = &[0x55, 0x04, 0x03];
    const O: &[u8] = &[0x55, 0x04, 0x0a];
    const EMAIL: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x09, 0x01];

    /// A certificate around `subject` (the fields before it minimal, nothing after it
    /// but what a walker that stops at the subject never reads).
    fn certificate(subject: &[u8]) -> Vec<u8> {
        let tbs = [
            tlv(VERSION, &tlv(INTEGER, &[2])),
            tlv(INTEGER, &[1]),
            tlv(SEQUENCE, &[]),
            tlv(SEQUENCE, &[]),
            tlv(SEQUENCE, &[]),
            tlv(SEQUENCE, subject),
            tlv(SEQUENCE, &[]),
        ]
        .concat();
        tlv(
            SEQUENCE,
            &[tlv(SEQUENCE, &tbs), tlv(SEQUENCE, &[])].concat(),
        )
    }

    fn rdn(attributes: &[Vec<u8>]) -> Vec<u8> {
        tlv(SET, &attributes.concat())
    }

    #[test]
    fn attributes_come_in_order_multi_valued_rdns_joined_by_plus() {
        let subject = [
            rdn(&[attribute(CN, 0x0c, b"worker-1")]),
            rdn(&[attribute(O, 0x13, b"lab"), attribute(EMAIL, 0x16, b"a@b.c")]),
            rdn(&[attribute(&[0x55, 0x04, 0x05], 0x13, b"42")]),
        ]
        .concat();
        assert_eq!(
            subject_text(&certificate(&subject)),
            Ok("CN=worker-1,O=lab+emailAddress=a@b.c,2.5.4.5=42".into())
        );
        assert_eq!(subject_text(&certificate(&[])), Ok(String::new()));
    }

    #[test]
    fn separators_inside_values_are_escaped() {
        let subject = [
            rdn(&[attribute(CN, 0x0c, b"a,O=lab")]),
            rdn(&[attribute(O, 0x0c, b"x+y\\z")]),
        ]
        .concat();
        assert_eq!(
            subject_text(&certificate(&subject)),
            Ok("CN=a\\,O=lab,O=x\\+y\\\\z".into())
        );
    }

    #[test]
    fn every_short_name_and_dotted_oids() {
        let names = [
            (&[0x55, 0x04, 0x03][..], "CN"),
            (&[0x55, 0x04, 0x0a], "O"),
            (&[0x55, 0x04, 0x0b], "OU"),
            (&[0x55, 0x04, 0x06], "C"),
            (&[0x55, 0x04, 0x08], "ST"),
            (&[0x55, 0x04, 0x07], "L"),
            (EMAIL, "emailAddress"),
            // domainComponent 0.9.2342.19200300.100.1.25: the first byte 9 is arcs 0.9.
            (
                &[0x09, 0x92, 0x26, 0x89, 0x93, 0xf2, 0x2c, 0x64, 0x01, 0x19],
                "0.9.2342.19200300.100.1.25",
            ),
            (&[0x88, 0x37], "2.999"),
            (&[0x28], "1.0"),
        ];
        for (oid, name) in names {
            let subject = rdn(&[attribute(oid, 0x0c, b"v")]);
            assert_eq!(
                subject_text(&certificate(&subject)),
                Ok(format!("{name}=v"))
            );
        }
    }

    #[test]
    fn values_decode_as_openssl_decodes_them() {
        let value =
            |tag, bytes: &[u8]| subject_text(&certificate(&rdn(&[attribute(CN, tag, bytes)])));
        assert_eq!(value(0x0c, "é,+".as_bytes()), Ok("CN=é\\,\\+".into()));
        assert_eq!(value(0x14, b"caf\xe9"), Ok("CN=café".into()));
        assert_eq!(value(0x1e, b"\x00h\x00\xe9\x4e\x2d"), Ok("CN=hé中".into()));
        assert_eq!(value(0x1c, b"\x00\x01\xf6\x00"), Ok("CN=\u{1f600}".into()));
        assert_eq!(value(0x0c, b"\xff"), Err("a UTF8String that is not UTF-8"));
        assert_eq!(
            value(0x1e, b"\xd8\x00"),
            Err("a BMPString that is not UCS-2")
        );
        assert_eq!(value(0x1e, b"\x00"), Err("a BMPString that is not UCS-2"));
        assert_eq!(
            value(0x1c, b"\x00\x11\x00\x00"),
            Err("a UniversalString that is not UCS-4")
        );
        assert_eq!(value(INTEGER, b"\x01"), Err("a value that is not a string"));
    }

    #[test]
    fn malformed_der_is_refused() {
        let good = certificate(&rdn(&[attribute(CN, 0x0c, b"x")]));
        let cases: [(Vec<u8>, Malformed); 8] = [
            (vec![], "a truncated element"),
            (vec![0x30, 0x80, 0, 0], "an indefinite length"),
            (vec![0x30, 0x81, 0x05], "a length not in its shortest form"),
            (
                vec![0x30, 0x82, 0x00, 0x80],
                "a length not in its shortest form",
            ),
            (
                vec![0x30, 0x85, 1, 1, 1, 1, 1],
                "a length of more than 4 bytes",
            ),
            (
                vec![0x30, 0x84, 0xff, 0xff, 0xff, 0xff],
                "a length past the end of its element",
            ),
            (vec![0x3f, 0x00], "a high tag number"),
            (
                [good.clone(), vec![0]].concat(),
                "bytes after the certificate",
            ),
        ];
        for (bytes, why) in cases {
            assert_eq!(subject_text(&bytes), Err(why), "{bytes:02x?}");
        }
        let bad_oids: [(&[u8], Malformed); 4] = [
            (&[], "an empty OID"),
            (&[0x55, 0x84], "a truncated OID"),
            (&[0x55, 0x80, 0x01], "an OID arc not in its shortest form"),
            (
                &[
                    0x55, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
                ],
                "an OID arc beyond 64 bits",
            ),
        ];
        for (oid, why) in bad_oids {
            let subject = rdn(&[attribute(oid, 0x0c, b"v")]);
            assert_eq!(subject_text(&certificate(&subject)), Err(why), "{oid:02x?}");
        }
        assert_eq!(
            subject_text(&certificate(&tlv(SET, &[]))),
            Err("an empty RDN")
        );
        let three = tlv(
            SEQUENCE,
            &[tlv(OID, CN), tlv(0x0c, b"a"), tlv(0x0c, b"b")].concat(),
        );
        assert_eq!(
            subject_text(&certificate(&tlv(SET, &three))),
            Err("an attribute with more than a type and a value")
        );
    }

    /// xorshift64*: the same hostile inputs on every run.
    fn noise(seed: u64) -> impl FnMut() -> u8 {
        let mut state = seed | 1;
        move || {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        }
    }

    #[test]
    fn truncated_mutated_and_random_inputs_never_panic() {
        let subject = [
            rdn(&[attribute(CN, 0x0c, b"worker-1")]),
            rdn(&[attribute(O, 0x1e, b"\x00l\x00a\x00b")]),
        ]
        .concat();
        let good = certificate(&subject);
        assert_eq!(subject_text(&good), Ok("CN=worker-1,O=lab".into()));
        // Every cut short of the whole is refused.
        for len in 0..good.len() {
            assert!(subject_text(&good[..len]).is_err(), "cut at {len}");
        }
        // Every byte flipped to a few values, and random bytes: any answer but a panic.
        let mut byte = noise(0x9e37_79b9_7f4a_7c15);
        for at in 0..good.len() {
            for value in [0x00, 0x7f, 0x80, 0x81, 0x84, 0xff, byte()] {
                let mut mutated = good.clone();
                mutated[at] = value;
                let _ = subject_text(&mutated);
            }
        }
        for round in 0..2000 {
            let len = usize::from(byte()) % 64 + round % 3;
            let mut bytes: Vec<u8> = (0..len).map(|_| byte()).collect();
            // Half of them start like a certificate, so that the walker goes deeper.
            if round % 2 == 0 && bytes.len() > 2 {
                bytes[0] = SEQUENCE;
                bytes[1] = (bytes.len() - 2).min(0x7f) as u8;
            }
            let _ = subject_text(&bytes);
        }
    }
}
