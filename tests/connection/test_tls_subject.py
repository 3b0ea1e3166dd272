"""``Peer.tls_subject`` (docs/guides/connections.md): the subject of the client certificate
a mutual-TLS listener verified, as RFC 4514 text, held to the ``cryptography`` package's
``Name.rfc4514_string()`` for certificates made here with several RDNs: the usual C, ST,
L, O, OU, CN; a multi-valued RDN; values that need RFC 4514's escapes; non-ASCII; DC,
UID and STREET. Where the two write different (equally valid) RFC 4514 text, the test
pins what the listener writes: emailAddress and serialNumber by name where
``cryptography`` writes their OIDs, and a control character as ``\\XX``."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import pathlib
from dataclasses import dataclass

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import gradstream as gs
from support.connections import LOCAL, run

A = x509.NameAttribute
RDN = x509.RelativeDistinguishedName

SUBJECTS = {
    "usual": x509.Name(
        [
            A(NameOID.COUNTRY_NAME, "NZ"),
            A(NameOID.STATE_OR_PROVINCE_NAME, "Otago"),
            A(NameOID.LOCALITY_NAME, "Dunedin"),
            A(NameOID.ORGANIZATION_NAME, "lab"),
            A(NameOID.ORGANIZATIONAL_UNIT_NAME, "ml"),
            A(NameOID.COMMON_NAME, "worker-1"),
        ]
    ),
    "common name only": x509.Name([A(NameOID.COMMON_NAME, "worker-1")]),
    "multi-valued": x509.Name(
        [
            RDN([A(NameOID.ORGANIZATION_NAME, "lab")]),
            RDN([A(NameOID.ORGANIZATIONAL_UNIT_NAME, "ml"), A(NameOID.COMMON_NAME, "w-2")]),
        ]
    ),
    "separators": x509.Name(
        [
            A(NameOID.ORGANIZATION_NAME, "Lab, Inc."),
            A(NameOID.ORGANIZATIONAL_UNIT_NAME, 'ml+ops;"q"<a>'),
            A(NameOID.COMMON_NAME, "a,O=lab+x\\y"),
        ]
    ),
    "leading and trailing": x509.Name(
        [
            A(NameOID.ORGANIZATION_NAME, "#hash"),
            A(NameOID.ORGANIZATIONAL_UNIT_NAME, " spaced "),
            A(NameOID.COMMON_NAME, "x=y"),
        ]
    ),
    "non-ascii": x509.Name([A(NameOID.COMMON_NAME, "Zoë Łódź 😀")]),
    "domain components": x509.Name(
        [
            A(NameOID.DOMAIN_COMPONENT, "org"),
            A(NameOID.DOMAIN_COMPONENT, "example"),
            A(NameOID.USER_ID, "u1"),
            A(NameOID.STREET_ADDRESS, "1 Main St"),
        ]
    ),
}

# Where the listener's text (x509-cert's) and cryptography's differ: (subject, the
# listener's text, cryptography's).
DIFFERENT = {
    "email": (
        x509.Name([A(NameOID.EMAIL_ADDRESS, "w@lab.example"), A(NameOID.COMMON_NAME, "w")]),
        "CN=w,EMAIL=w@lab.example",
        "CN=w,1.2.840.113549.1.9.1=w@lab.example",
    ),
    "serial number": (
        x509.Name([A(NameOID.SERIAL_NUMBER, "123"), A(NameOID.COMMON_NAME, "w")]),
        "CN=w,SERIALNUMBER=123",
        "CN=w,2.5.4.5=123",
    ),
    "control character": (
        x509.Name([A(NameOID.COMMON_NAME, "a\x01b")]),
        "CN=a\\01b",
        "CN=a\x01b",
    ),
}

NOW = datetime.datetime.now(datetime.UTC)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _certificate(
    subject: x509.Name,
    public: ec.EllipticCurvePublicKey,
    issuer: x509.Name,
    signer: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    ip: str | None = None,
) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - datetime.timedelta(days=1))
        .not_valid_after(NOW + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip is not None:
        names = [x509.IPAddress(ipaddress.ip_address(ip))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write(folder: pathlib.Path, name: str, cert: x509.Certificate, key: object) -> None:
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    (folder / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@dataclass(frozen=True)
class Authority:
    """A CA made here, the listener's certificate (127.0.0.1) and key signed by it."""

    folder: pathlib.Path
    name: x509.Name
    key: ec.EllipticCurvePrivateKey

    @property
    def listener(self) -> gs.TLS:
        f = self.folder
        return gs.TLS(cert=f / "server.pem", key=f / "server.key", ca=f / "ca.pem")

    def client(self, label: str, subject: x509.Name) -> tuple[gs.TLS, x509.Name]:
        """A client's TLS with a certificate of ``subject``, and the subject as it reads
        back from the certificate's PEM."""
        key = _key()
        name = label.replace(" ", "-")
        _write(self.folder, name, _certificate(subject, key.public_key(), self.name, self.key), key)
        pem = (self.folder / f"{name}.pem").read_bytes()
        written = x509.load_pem_x509_certificate(pem).subject
        f = self.folder
        return gs.TLS(cert=f / f"{name}.pem", key=f / f"{name}.key", ca=f / "ca.pem"), written


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    folder = tmp_path_factory.mktemp("subjects")
    key = _key()
    name = x509.Name([A(NameOID.COMMON_NAME, "subject test CA")])
    _write(folder, "ca", _certificate(name, key.public_key(), name, key, ca=True), key)
    server_key = _key()
    server = _certificate(
        x509.Name([A(NameOID.COMMON_NAME, "server")]),
        server_key.public_key(),
        name,
        key,
        ip="127.0.0.1",
    )
    _write(folder, "server", server, server_key)
    return Authority(folder, name, key)


def subject_seen(authority: Authority, client: gs.TLS) -> str | None:
    """The tls_subject a mutual-TLS listener gives the peer that connected with
    ``client``."""

    async def main() -> str | None:
        async with await gs.listen(LOCAL, tls=authority.listener) as listener:
            accepting = asyncio.create_task(listener.accept())
            async with await gs.connect(listener.address, tls=client):
                async with await accepting as theirs:
                    assert theirs.peer.authenticated
                    return theirs.peer.tls_subject

    return run(main)


@pytest.mark.parametrize("label", list(SUBJECTS))
def test_the_subject_is_cryptographys_rfc_4514_text(authority: Authority, label: str) -> None:
    client, written = authority.client(label, SUBJECTS[label])
    assert subject_seen(authority, client) == written.rfc4514_string()


def test_the_most_specific_attribute_comes_first(authority: Authority) -> None:
    client, _ = authority.client("order", SUBJECTS["usual"])
    assert subject_seen(authority, client) == "CN=worker-1,OU=ml,O=lab,L=Dunedin,ST=Otago,C=NZ"


@pytest.mark.parametrize("label", list(DIFFERENT))
def test_where_cryptography_writes_otherwise(authority: Authority, label: str) -> None:
    subject, ours, theirs = DIFFERENT[label]
    client, written = authority.client(label, subject)
    assert written.rfc4514_string() == theirs
    assert subject_seen(authority, client) == ours
