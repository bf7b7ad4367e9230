"""What the service entry points share besides the server (which runs until SIGTERM in
fastdecode.runtime.rpc `Server`): the ready file that announces the bound ports (read by
`fastdecode up`), and the service adapters found by name.

The dependency between the two packages goes one way: `services` imports `fastdecode`, never the
reverse. What fastdecode's tools need of the adapters (`fastdecode serve NAME` runs a service's
`serve()`, `bench transport --breakdown` drives gpu_dense's shard links) they look up by name in the
entry points the distribution declares (pyproject.toml); see ARCHITECTURE.md, "Dependency direction".
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from fastdecode.runtime.errors import FailedPrecondition

# Entry-point groups (pyproject.toml [project.entry-points.*]):
SERVICES = "fastdecode.services"  # `serve` command name -> async serve(settings)
SHARD_PLANES = "fastdecode.shard_planes"  # name -> connect(addresses, concurrent=False) -> ShardPlane


def registered(group: str, name: str) -> Any:
    """The object registered as `name` in the entry-point `group`, loaded (its module imported now)."""
    for ep in entry_points(group=group, name=name):
        return ep.load()
    raise FailedPrecondition(
        f"nothing is registered as {name!r} in the entry points {group!r}: the installed package "
        "metadata is missing or stale; reinstall the project (pip install -e .)"
    )


def write_ready_file(path: Path | None, **info: object) -> None:
    """Atomically write {"pid", ...info} so a supervisor can read the ports a server bound."""
    if path is None:
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **info}))
    os.replace(tmp, path)


def die_with_parent(parent: int) -> None:
    """A child process (an exchange worker, a tensor-parallel rank) is killed when `parent`, the
    process that started it, ends (PR_SET_PDEATHSIG: when the thread that started it ends)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the child's other ties to the parent stop it
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)
