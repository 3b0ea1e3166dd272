"""Certificates for the TLS tests, made at test time with trustme (none are committed):
a CA, a server certificate for 127.0.0.1 (IP SAN), a client certificate for mutual TLS,
one for another name, and a second CA nobody trusts."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import gradstream as gs

CLIENT_CN = "worker-1"


@dataclass(frozen=True)
class Certificates:
    folder: pathlib.Path

    def path(self, name: str) -> pathlib.Path:
        return self.folder / name

    @property
    def server(self) -> gs.TLS:
        """A listener's TLS: the 127.0.0.1 certificate, no client certificates asked."""
        return gs.TLS(cert=self.path("server.pem"), key=self.path("server.key"))

    @property
    def mutual_server(self) -> gs.TLS:
        """A listener's TLS that requires a client certificate signed by the CA."""
        return gs.TLS(
            cert=self.path("server.pem"), key=self.path("server.key"), ca=self.path("ca.pem")
        )

    @property
    def wrong_name_server(self) -> gs.TLS:
        """A listener's certificate for another host (SAN example.org only)."""
        return gs.TLS(cert=self.path("other.pem"), key=self.path("other.key"))

    @property
    def client(self) -> gs.TLS:
        """A client's TLS: the CA only."""
        return gs.TLS(ca=self.path("ca.pem"))

    @property
    def mutual_client(self) -> gs.TLS:
        """A client's TLS that presents the worker-1 certificate."""
        return gs.TLS(
            cert=self.path("client.pem"), key=self.path("client.key"), ca=self.path("ca.pem")
        )

    @property
    def stranger_client(self) -> gs.TLS:
        """A client that trusts another CA (so refuses the server)."""
        return gs.TLS(ca=self.path("stranger.pem"))

    @property
    def tricky_client(self) -> gs.TLS:
        """A client whose certificate's names hold the subject text's separators."""
        return gs.TLS(
            cert=self.path("tricky.pem"), key=self.path("tricky.key"), ca=self.path("ca.pem")
        )

    @property
    def ca_file(self) -> pathlib.Path:
        return self.path("ca.pem")


def make_certificates(folder: pathlib.Path) -> Certificates:
    import trustme

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    issued = {
        "server": ca.issue_cert("127.0.0.1", "localhost"),
        "client": ca.issue_cert(f"{CLIENT_CN}@lab.example", common_name=CLIENT_CN),
        "other": ca.issue_cert("example.org"),
        "tricky": ca.issue_cert(
            "tricky@lab.example",
            common_name="a,O=lab+x\\y",
            organization_name="Lab, Inc.",
            organization_unit_name="ml+ops",
        ),
    }
    for name, leaf in issued.items():
        with open(folder / f"{name}.pem", "wb") as out:
            for blob in leaf.cert_chain_pems:
                out.write(blob.bytes())
        leaf.private_key_pem.write_to_path(str(folder / f"{name}.key"))
    trustme.CA().cert_pem.write_to_path(str(folder / "stranger.pem"))
    return Certificates(folder)
