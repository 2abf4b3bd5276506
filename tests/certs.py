"""A throwaway CA and a certificate for 127.0.0.1/localhost (server and client use), made with openssl."""

from __future__ import annotations

import subprocess
from pathlib import Path

from serving.tls import TLSFiles


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path) -> tuple[TLSFiles, TLSFiles]:
    """Return (TLS files: cert, key and the CA to trust; the same requiring client certificates)
    for a certificate signed by a fresh CA."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=specserve-test-ca", cwd=directory)
    (directory / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr",
             "-subj", "/CN=localhost", cwd=directory)
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "node.pem", "-days", "2", "-extfile", "ext.cnf", cwd=directory)
    cert, key, ca = (str(directory / name) for name in ("node.pem", "node.key", "ca.pem"))
    return TLSFiles(cert=cert, key=key, ca=ca), TLSFiles(cert=cert, key=key, ca=ca, client_auth=True)
