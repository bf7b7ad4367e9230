"""Helpers and constants shared by tests: `from tests.support import ...` (the repository root is on
sys.path: see pyproject's pythonpath). In-process fakes of the services live in tests.support.fakes."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from fastdecode.runtime.metrics import Samples as Samples  # re-exported: tests import these from here
from fastdecode.runtime.metrics import metric_total as metric_total
from fastdecode.runtime.metrics import scrape as scrape
from fastdecode.tools.fleet import UpProcess, launch_up

PROMPTS: list[list[int]] = [
    [1, 17, 300, 45],
    [1, 99, 5, 1200, 77, 640, 8, 13, 21, 34, 55],
    [1, 600],
    [1, 7, 7, 7, 250, 1800, 42, 3, 999, 1500, 64, 128, 256, 512, 1024, 2000, 11, 12, 13, 14, 15, 16],
]


TOKEN = "e2e-secret-token"

# tests/e2e/conftest.py's fleet_factory: (model, *up_args, env=, http=, private=, timeout=) -> a fleet
FleetFactory = Callable[..., UpProcess]


def start_up(
    model: Path, workdir: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = 180
) -> UpProcess:
    return launch_up(model, workdir, *extra, env=env, timeout=timeout)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except OSError:
        return False


def make_tls(directory: Path, name: str = "fleet") -> dict[str, Path]:
    """A throwaway CA and one leaf cert (server + client auth, SAN 127.0.0.1/localhost), PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = {"ca": directory / "ca.pem", "cert": directory / "cert.pem", "key": directory / "key.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return files
