"""Loader for the shard's native attention kernel (fastdecode/kv/csrc/attention.cpp).

The extension is built at install time (setup.py). `load()` returns the module or raises
NativeUnavailable with one line saying why and how to build it; nothing falls back silently.

The kernel picks its ISA level from CPUID when it loads (scalar, avx2, avx512, avx512_vnni,
avx512_bf16, amx: AMX tiles where the OS grants them; docs/kernel.md). FASTDECODE_KERNEL_ISA=<level>
forces one for the process (A/B runs, or a host whose vector units throttle); a level the CPU lacks
stops `load()` with one clear line.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from fastdecode.runtime.errors import FailedPrecondition, InvalidInput

_BUILD_HINT = (
    "build it with `make setup` (or `pip install --no-build-isolation -e .` with torch installed), "
    "or run with --attention-backend torch"
)


class NativeUnavailable(FailedPrecondition):
    """The compiled kernel is not importable in this environment."""


class IsaUnavailable(InvalidInput):
    """An ISA level this CPU lacks (or that does not exist) was asked for."""


ISA_ENV = "FASTDECODE_KERNEL_ISA"


_module: ModuleType | None = None
_error: str | None = None


def load() -> ModuleType:
    global _module, _error
    if _module is not None:
        return _module
    if _error is None:
        try:
            module = importlib.import_module("fastdecode.kv._attention")
        except ImportError as e:  # missing, or built against another torch
            _error = f"native attention kernel unavailable ({e}); {_BUILD_HINT}"
        else:
            forced = os.environ.get(ISA_ENV)
            if forced:
                try:
                    module.set_isa(forced)
                except RuntimeError as e:
                    _error = f"{ISA_ENV}={forced}: {_first_line(e)}"
                    raise NativeUnavailable(_error) from None
            _module = module
            return module
    raise NativeUnavailable(_error)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def available() -> bool:
    try:
        load()
    except NativeUnavailable:
        return False
    return True


def isa() -> str:
    """The ISA level in use: the highest this CPU has unless set_isa or FASTDECODE_KERNEL_ISA chose."""
    return load().isa()


def isas() -> list[str]:
    """The ISA levels this CPU can run, lowest first (scalar always)."""
    return list(load().isas())


def set_isa(name: str) -> None:
    """Force an ISA level for every dtype (tests, A/B benches), or 'auto' (the CPUID pick, each
    dtype on the highest level kept for it); IsaUnavailable when the CPU lacks it."""
    try:
        load().set_isa(name)
    except RuntimeError as e:
        raise IsaUnavailable(_first_line(e)) from None


def forced() -> bool:
    """Whether set_isa (or FASTDECODE_KERNEL_ISA) forced the level."""
    return bool(load().forced())


def path(dtype: str, head_dim: int) -> str:
    """The level that attends a KV dtype (a KV_DTYPES name) at a head dim under the current ISA:
    picked from CPUID, a dtype runs on a level only where it measured faster than avx2 (on amx, a
    job with few query rows, group x new positions, still runs on avx2: attention.cpp's
    amx_min_rows); forced, on the forced level (a lower one where the head dim does not divide its
    loads)."""
    return load().path(dtype, head_dim)
