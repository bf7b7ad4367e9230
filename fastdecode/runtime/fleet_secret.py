"""The fleet secret: what every internal call (scheduler, gpu_dense, kv_attention) carries so the callee
knows the caller is part of the fleet. Pure Python; the gRPC side is fastdecode.runtime.internal_auth.

A secret file holds one secret per line: the first is the one this process sends, every line is one
it accepts. Rotation is therefore two rollouts: add the new secret as a second line everywhere, then
make it the first and drop the old one (docs/internal-auth.md).
"""

from __future__ import annotations

import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from fastdecode.runtime.errors import InvalidInput

# The call metadata key (gRPC keys are lower-case ASCII). Never the gateway's public `authorization`.
FLEET_SECRET_KEY = "fastdecode-fleet-secret"
FLEET_SECRET_ENV = "FASTDECODE_FLEET_SECRET"
FLEET_SECRET_FILE_ENV = "FASTDECODE_FLEET_SECRET_FILE"
_MIN_CHARS = 16  # a guessable secret is no secret


@dataclass(frozen=True)
class FleetSecret:
    """The secret this process sends and the ones it accepts (never printed: see __repr__)."""

    send: str
    accepted: tuple[bytes, ...]

    def __repr__(self) -> str:
        return f"FleetSecret(**********, accepts {len(self.accepted)})"

    def matches(self, value: str | bytes | None) -> bool:
        """Constant-time against every accepted secret (no early exit, so timing says nothing)."""
        if value is None:
            return False
        given = value.encode(errors="replace") if isinstance(value, str) else bytes(value)
        ok = False
        for expected in self.accepted:
            ok |= hmac.compare_digest(given, expected)
        return ok

    @classmethod
    def parse(cls, text: str, source: str) -> FleetSecret:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            raise InvalidInput(f"the fleet secret from {source} is empty")
        for line in lines:
            if len(line) < _MIN_CHARS or not line.isascii() or not line.isprintable():
                raise InvalidInput(
                    f"a fleet secret from {source} is not at least {_MIN_CHARS} printable ASCII characters"
                )
        return cls(lines[0], tuple(line.encode() for line in lines))


def generate_secret() -> str:
    return secrets.token_urlsafe(32)


def load_fleet_secret(value: str | None, file: Path | None) -> FleetSecret | None:
    """The secret from the environment value or the file (the file wins: it is what rotation edits);
    None when neither is given."""
    if file is not None:
        try:
            text = Path(file).read_text()
        except OSError as e:
            raise InvalidInput(f"cannot read the fleet secret file {file}: {e.strerror or e}") from None
        return FleetSecret.parse(text, str(file))
    if value:
        return FleetSecret.parse(value.replace(",", "\n"), FLEET_SECRET_ENV)
    return None


def write_secret_file(path: Path, secret: str) -> Path:
    """A file only its owner can read, created with that mode (never briefly world-readable)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return path
