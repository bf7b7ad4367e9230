"""Helpers shared by the benchmarks: medians over repeats, a memory-bandwidth yardstick, the work
directory a run's services log to.

The machines these run on are shared and small, so every number is a median over repeats and
every headline number is a ratio against a baseline measured in the same run, interleaved with
the thing measured so both see the same noise.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from fastdecode.runtime.errors import InvalidInput

GIB = 1 << 30
T = TypeVar("T")


def proc_status_bytes(pid: int, field: str = "VmRSS") -> int | None:
    """A /proc/PID/status memory field in bytes (VmRSS: resident now; VmHWM: its high-water
    mark); None when the process is gone or the field is missing."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@contextlib.contextmanager
def bench_workdir(name: str) -> Iterator[Path]:
    """A fresh directory for one run's services (their logs, ready files, the fleet secret), under
    the system's temporary directory: removed once the run succeeds, kept and named on stderr when
    it fails after something was written there, since the services' logs are what says why."""
    workdir = Path(tempfile.mkdtemp(prefix=f"fastdecode-bench-{name}-"))
    try:
        yield workdir
    except BaseException as e:
        # the caller's arguments, or a failure before any service wrote a line: nothing to read
        if isinstance(e, InvalidInput) or not any(workdir.iterdir()):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"the services' logs of this run are kept in {workdir}", file=sys.stderr)
        raise
    shutil.rmtree(workdir, ignore_errors=True)


def time_once(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def memory_probe(nbytes: int = GIB) -> Callable[[], float]:
    """A plain torch.sum over an fp32 tensor of `nbytes`; each call returns one run's seconds.

    The tensor is written once up front (pages committed), so a call reads it from memory.
    """
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)

    def run() -> float:
        return time_once(lambda: x.sum())

    run.nbytes = x.numel() * 4  # type: ignore[attr-defined]
    return run


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def format_table(rows: list[dict[str, object]], columns: list[str] | None = None) -> str:
    """Plain aligned text table; floats with 4 significant digits."""
    if not rows:
        return ""
    cols = columns or list(rows[0])

    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def format_pairs(result: dict[str, object]) -> str:
    """One `key  value` line per scalar of a flat result dict."""
    scalars = {k: v for k, v in result.items() if not isinstance(v, dict | list)}
    width = max((len(k) for k in scalars), default=0)
    return "\n".join(
        f"{k.ljust(width)}  {f'{v:.4g}' if isinstance(v, float) else v}" for k, v in scalars.items()
    )


_RUNNER: asyncio.Runner | None = None


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on one event loop kept for the process: grpc.aio binds its poller to a loop, and
    channels of a closed loop then log "Event loop is closed" when a later loop runs."""
    global _RUNNER
    if _RUNNER is None:
        _RUNNER = asyncio.Runner()
    return _RUNNER.run(coro)
