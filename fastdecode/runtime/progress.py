"""Start-up progress a service reports to the supervisor that started it (`fastdecode up`).

A service started by fleet.spawn_service finds a path in FASTDECODE_PROGRESS_FILE and writes
small JSON snapshots there ({"phase", "done", "total"}), next to its ready file; the supervisor
polls both. A file rather than a pipe: the service's stdout is its log, and a file needs no
protocol beyond atomic replace.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from fastdecode.runtime.serving import write_ready_file

PROGRESS_ENV = "FASTDECODE_PROGRESS_FILE"

# A service's start-up phases as a supervisor reports them, in order. Only services that write a
# progress file (gpu_dense) have LOADING_WEIGHTS; the rest go straight to WAITING_FOR_HEALTH.
STARTING = "starting"
LOADING_WEIGHTS = "loading weights"
WAITING_FOR_HEALTH = "waiting for health"
READY = "ready"

# (done, total): units loaded so far and in all (bytes for weights).
ProgressCallback = Callable[[int, int], None]


class ProgressFile:
    """A ProgressCallback that writes {"phase", "done", "total"} to `path`, throttled.

    Writes at most every `interval` seconds, but always the first and the final (done >= total)
    snapshot, so a reader sees the phase begin and end however fast it runs.
    """

    def __init__(self, path: Path, phase: str, interval: float = 0.2) -> None:
        self.path = path
        self.phase = phase
        self.interval = interval
        self._last: float | None = None

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        final = done >= total
        if not final and self._last is not None and now - self._last < self.interval:
            return
        self._last = now
        write_ready_file(self.path, phase=self.phase, done=done, total=total)  # atomic: tmp + rename


def read_progress(path: Path) -> tuple[str, int, int] | None:
    """(phase, done, total) from a progress file, or None when it is absent or unreadable."""
    try:
        info = json.loads(path.read_text())
        return str(info["phase"]), int(info["done"]), int(info["total"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
