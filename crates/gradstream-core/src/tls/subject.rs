//! A client certificate's subject as the text `Peer.tls_subject` gives (docs/guides/
//! connections.md): RFC 4514, as x509-cert's `Name` writes it. The RDNs come in reverse
//! certificate order (the most specific first: `CN=worker-1,O=lab` for a certificate whose
//! subject lists O, then CN), the attributes of a multi-valued RDN joined by `+`, the
//! standard attributes by their short names (`CN`, `O`, `OU`, `C`, `ST`, `L`, `DC`,
//! `UID`, `STREET`), and the characters RFC 4514 section 2.4 names escaped with a `\`, so
//! that no value reads as a second attribute. A value that is not a string x509-cert can
//! print (a BMPString, say), or an attribute it has no name for, is written `OID=#` and
//! the value's DER in hex, as RFC 4514 allows.
//!
//! This is the text of the `cryptography` package's `Name.rfc4514_string()` for
//! certificates of those attributes (tests/connection/test_tls_subject.py holds the two
//! together on certificates made at test time).
//!
//! Uses x509-cert; used by `acceptor`.

use x509_cert::der::Decode;
use x509_cert::Certificate;

/// Why a certificate's subject cannot be read: x509-cert's words for what is wrong.
pub type Malformed = String;

/// The subject of a DER certificate as RFC 4514 text.
pub fn subject_text(certificate: &[u8]) -> Result<String, Malformed> {
    let certificate = Certificate::from_der(certificate).map_err(|e| e.to_string())?;
    Ok(certificate.tbs_certificate().subject().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_that_are_no_certificate_are_refused_with_a_reason() {
        for bytes in [
            &b""[..],
            b"\x30",
            b"\x30\x03\x02\x01\x00",
            b"not DER at all",
        ] {
            let why = subject_text(bytes).unwrap_err();
            assert!(!why.is_empty(), "{bytes:?}");
        }
    }
}
