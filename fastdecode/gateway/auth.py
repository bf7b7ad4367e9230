"""Bearer-token checks shared by the gateway's gRPC interceptor and its HTTP front."""

from __future__ import annotations

import hmac


def bearer_matches(header: str | bytes, expected: bytes) -> bool | None:
    """None when `header` is not a Bearer credential, else whether its token equals `expected`
    (constant-time)."""
    v = header.decode(errors="replace") if isinstance(header, bytes) else str(header)
    scheme, _, token = v.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return hmac.compare_digest(token.strip().encode(), expected)
