"""API keys and tenants, shared by the gateway's gRPC interceptor and its HTTP front.

A key names its tenant: `--auth-token` is tenant "default", and `--api-keys-file` holds one
"TENANT KEY" a line (reloaded on SIGHUP). The tenant of a request is bound in a context variable
for the request's duration (`tenant_scope`): the core salts its prefix-cache blocks with it
(`cache_salt`) and the metrics count per tenant. Imports no gRPC.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import logging
import re
from collections.abc import Iterator
from pathlib import Path

from fastdecode.runtime.errors import InvalidInput

log = logging.getLogger("fastdecode.gateway.auth")
_TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("fastdecode_tenant", default="")
_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_KEYS = 10_000


def bearer_token(header: str | bytes) -> bytes | None:
    """The token of a Bearer credential, or None when `header` is not one."""
    v = header.decode(errors="replace") if isinstance(header, bytes) else str(header)
    scheme, _, token = v.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip().encode()


def bearer_matches(header: str | bytes, expected: bytes) -> bool | None:
    """None when `header` is not a Bearer credential, else whether its token equals `expected`
    (constant-time)."""
    token = bearer_token(header)
    return None if token is None else hmac.compare_digest(token, expected)


def read_keys(path: Path) -> dict[bytes, str]:
    """key -> tenant from a keys file; InvalidInput naming the line that is wrong (never the key)."""
    keys: dict[bytes, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or not _TENANT_NAME.fullmatch(parts[0]) or len(parts[1]) < 8:
            raise InvalidInput(
                f"{path}:{n}: want 'TENANT KEY' (tenant: 1-64 of A-Z a-z 0-9 _ . -; key: 8+ characters)"
            )
        if parts[1].encode() in keys:
            raise InvalidInput(f"{path}:{n}: a key given twice")
        keys[parts[1].encode()] = parts[0]
    if len(keys) > MAX_KEYS:
        raise InvalidInput(f"{path}: {len(keys)} keys; the limit is {MAX_KEYS}")
    return keys


class Tenants:
    """Who a bearer token is. Off (every caller is the anonymous tenant "") only when neither a token
    nor a keys file is set: auth is an explicit setting, never the result of a file that read as
    empty. A keys file that yields no keys keeps the keys there were, or, at start, admits nobody
    until it has keys and SIGHUP reloads it (fail closed), with a WARNING either way."""

    def __init__(self, token: bytes | None = None, keys_file: Path | None = None) -> None:
        self.token = token
        self.keys_file = keys_file
        self._keys: dict[bytes, str] = {}
        self.reload()

    @property
    def enabled(self) -> bool:
        return self.token is not None or self.keys_file is not None

    def names(self) -> list[str]:
        return sorted(set(self._keys.values()))

    def reload(self) -> None:
        """Read the keys again (SIGHUP); a file that does not read, or reads as no keys, keeps the
        keys there were."""
        keys = {self.token: "default"} if self.token else {}
        if self.keys_file is not None:
            try:
                from_file = read_keys(self.keys_file)
            except (OSError, InvalidInput) as e:
                if self._keys:
                    log.error("API keys not reloaded, the old ones stay: %s", e)
                    return
                raise InvalidInput(f"API keys: {e}") from None
            if not from_file:  # emptied, or comments only: a truncate-then-write, or "revoke all"
                if self._keys:
                    log.warning(
                        "API keys not reloaded: %s holds no keys; the old ones stay (auth stays on; "
                        "to revoke a tenant, leave the others' keys in the file)",
                        self.keys_file,
                    )
                    return
                log.warning(
                    "API keys: %s holds no keys; no request is admitted until it has keys and the "
                    "gateway gets SIGHUP",
                    self.keys_file,
                )
            keys.update(from_file)
        self._keys = keys
        log.info("API keys: %d keys of %d tenants", len(keys), len(set(keys.values())))

    def tenant_of(self, header: str | bytes) -> str | None:
        """The tenant of an `Authorization` header's bearer token; None: refuse it. Every key is
        compared (constant time each), so timing tells nothing of which one came close."""
        if not self.enabled:
            return ""
        token = bearer_token(header)
        if token is None:
            return None
        found = None
        for key, tenant in self._keys.items():
            if hmac.compare_digest(token, key):
                found = tenant
        return found


def current_tenant() -> str:
    return _TENANT.get()


@contextlib.contextmanager
def tenant_scope(tenant: str) -> Iterator[None]:
    token = _TENANT.set(tenant)
    try:
        yield
    finally:
        _TENANT.reset(token)


def cache_salt(tenant: str, salt: str | None, isolate_tenants: bool = True) -> str:
    """The prefix-cache namespace of a request: its tenant's (unless isolation is off) and its own
    cache_salt. "" (the shared namespace) when neither applies. Hashed: neither travels as given."""
    tenant = tenant if isolate_tenants else ""
    if not tenant and not salt:
        return ""
    return hashlib.blake2b(f"{tenant}\0{salt or ''}".encode(), digest_size=16).hexdigest()
