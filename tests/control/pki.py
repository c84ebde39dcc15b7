"""Throwaway certificate authorities for the TLS tests (the openssl CLI)."""

from __future__ import annotations

import subprocess
from pathlib import Path

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


class Authority:
    """A throwaway CA that signs certificates for names (DNS and IP alternative names)."""

    def __init__(self, directory: Path, name: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.cert, self.key = directory / f"{name}-ca.pem", directory / f"{name}-ca.key"
        openssl("req", "-x509", *EC, "-keyout", str(self.key), "-out", str(self.cert),
                "-subj", f"/CN={name}-ca", "-days", "2")

    def issue(self, name: str, alt_names: str) -> tuple[Path, Path]:
        key, csr, cert, ext = (self.dir / f"{name}.{x}" for x in ("key", "csr", "pem", "ext"))
        ext.write_text(f"subjectAltName={alt_names}\n")
        openssl("req", *EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
                "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))
        return cert, key
