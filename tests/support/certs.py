"""Certificates generated for a test with the openssl CLI: a CA, a server certificate for
127.0.0.1/localhost and client certificates, all signed by that CA."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclasses.dataclass(frozen=True)
class Certs:
    dir: Path

    @property
    def ca(self) -> str:
        return str(self.dir / "ca.pem")

    @property
    def server_cert(self) -> str:
        return str(self.dir / "server.pem")

    @property
    def server_key(self) -> str:
        return str(self.dir / "server.key")

    def client(self, name: str) -> tuple[str, str]:
        return str(self.dir / f"{name}.pem"), str(self.dir / f"{name}.key")


def _leaf(d: Path, name: str, subject: str, ext: str, ca: str = "ca") -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-subj", subject,
             "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)


def make_certs(d: Path, clients: tuple[str, ...] = ("client",)) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to generate test certificates")
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    _leaf(d, "server", "/CN=localhost", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
          "extendedKeyUsage=serverAuth\n")
    for name in clients:
        _leaf(d, name, f"/O=tests/CN={name}", "extendedKeyUsage=clientAuth\n")
    # A second CA whose client certificates the server must reject.
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "rogue-ca.key", "-out", "rogue-ca.pem",
             "-days", "2", "-subj", "/CN=rogue-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    _leaf(d, "rogue", "/CN=tls-agent", "extendedKeyUsage=clientAuth\n", ca="rogue-ca")
    return Certs(d)
