"""Process lifecycle shared by the service entry points: run a server until SIGTERM,
announce the bound ports through a ready file (used by `fastdecode up`)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_ready_file(path: Path | None, **info: object) -> None:
    """Atomically write {"pid", ...info} so a supervisor can read the ports a server bound."""
    if path is None:
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **info}))
    os.replace(tmp, path)
