"""The native exchange worker in tests: where it is not built, its tests skip, unless
FASTDECODE_REQUIRE_NATIVE_EXCHANGE is set (.ci/run sets it, and `make setup` builds it), which makes
an unbuilt worker a failure instead."""

from __future__ import annotations

import os

import pytest

from fastdecode.dense.handoff import native_worker


def require_native_worker() -> None:
    if native_worker() is not None:
        return
    reason = "the native exchange worker is not built (make setup, with gRPC C++ installed)"
    if os.environ.get("FASTDECODE_REQUIRE_NATIVE_EXCHANGE", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"FASTDECODE_REQUIRE_NATIVE_EXCHANGE is set but {reason}")
    pytest.skip(reason)
