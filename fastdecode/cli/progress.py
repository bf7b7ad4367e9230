"""`fastdecode up`'s start-up progress, drawn with rich on a terminal and nowhere else.

fleet.Fleet.start reports phases per service (fastdecode.runtime.progress); this module turns them into
one live line per service on stderr: a byte bar while gpu_dense loads its weights, a pulsing bar
while a service waits for its health check. The display is transient (cleared once the fleet is
up), so the terminal keeps only the plain lines that logs and pipes also get.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from fastdecode.runtime.progress import LOADING_WEIGHTS, READY

Observer = Callable[[str, str, int, int], None]  # fleet.ProgressObserver, without importing fleet


def progress_wanted(stream: TextIO | None = None) -> bool:
    """Draw only on an interactive terminal: a log file or pipe gets no progress lines, no ANSI codes."""
    stream = stream or sys.stderr
    return stream.isatty() and os.environ.get("TERM") != "dumb"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


@contextmanager
def startup_progress() -> Iterator[Observer | None]:
    """Yield an on_progress observer for Fleet.start, or None when stderr is not a terminal."""
    if not progress_wanted():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    tasks: dict[str, TaskID] = {}
    phases: dict[str, str] = {}
    totals: dict[str, int] = {}

    def observe(service: str, phase: str, done: int, total: int) -> None:
        if service not in tasks:
            tasks[service] = progress.add_task("", total=None, detail="")
        task = tasks[service]
        description = f"{service:<16} {phase:<18}"  # fixed width: the bars do not jump
        if phase == LOADING_WEIGHTS and total > 0:
            totals[service] = total
            detail = f"{_mib(done)}/{_mib(total)} MiB"
            progress.update(task, description=description, total=total, completed=done, detail=detail)
        elif phase == READY:
            full = totals.get(service, 1)  # a finished task stops its pulse and its clock
            progress.update(task, description=description, total=full, completed=full)
        else:
            progress.update(task, description=description)
        if phases.get(service) != phase:
            phases[service] = phase
            progress.refresh()  # draw every phase, even one shorter than the refresh period

    with progress:
        yield observe
