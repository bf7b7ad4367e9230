"""Loader for the shard's native attention kernel (fastdecode/kv/csrc/attention.cpp).

The extension is built at install time (setup.py). `load()` returns the module or raises
NativeUnavailable with one line saying why and how to build it; nothing falls back silently.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from fastdecode.runtime.errors import FailedPrecondition

_BUILD_HINT = (
    "build it with `make setup` (or `pip install --no-build-isolation -e .` with torch installed), "
    "or run with --attention-backend torch"
)


class NativeUnavailable(FailedPrecondition):
    """The compiled kernel is not importable in this environment."""


_module: ModuleType | None = None
_error: str | None = None


def load() -> ModuleType:
    global _module, _error
    if _module is not None:
        return _module
    if _error is None:
        try:
            _module = importlib.import_module("fastdecode.kv._attention")
            return _module
        except ImportError as e:  # missing, or built against another torch
            _error = f"native attention kernel unavailable ({e}); {_BUILD_HINT}"
    raise NativeUnavailable(_error)


def available() -> bool:
    try:
        load()
    except NativeUnavailable:
        return False
    return True


def isa() -> str:
    """The vector path the kernel picked on this CPU: 'avx2' or 'scalar'."""
    return load().isa()
