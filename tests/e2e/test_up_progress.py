"""`fastdecode up` draws start-up progress on a terminal, and nothing of it into a log or pipe."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

from fastdecode.tools.fleet import UpProcess, free_port

ANSI = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]")
PHASES = ("starting", "loading weights", "waiting for health")


def _read_until(fd: int, out: bytearray, done: Callable[[], bool], deadline: float) -> None:
    """Drain the terminal (a full pty would block the writer) until done() or the deadline."""
    while not done() and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:  # EIO: every writer closed its end
                return
            if not chunk:
                return
            out += chunk


def test_up_on_a_terminal_shows_progress(model_factory: Callable, tmp_path: Path) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, cols
    cmd = [sys.executable, "-m", "fastdecode.cli", "up", "--model", str(model_factory("llama"))]
    cmd += ["--shards", "1", "--device", "cpu", "--port", str(free_port()), "--kv-capacity", str(64 << 20)]
    cmd += ["--kv-dtype", "bfloat16"]
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE")}
    proc = subprocess.Popen(
        cmd,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**env, "TERM": "xterm-256color"},
        cwd=tmp_path,
        start_new_session=True,  # its own process group, killed as one below if it hangs
    )
    os.close(slave)
    out = bytearray()
    try:
        _read_until(master, out, lambda: b"gateway listening on" in out, time.monotonic() + 180)
        assert b"gateway listening on" in out, out.decode(errors="replace")[-3000:]
        proc.send_signal(signal.SIGTERM)
        _read_until(master, out, lambda: proc.poll() is not None, time.monotonic() + 60)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        os.close(master)
    text = ANSI.sub(b"", bytes(out)).decode(errors="replace")
    assert ANSI.search(bytes(out))  # drawn as a live display
    assert re.search(r"gpu_dense\s+loading weights.*MiB", text), text[-3000:]
    for service in ("kv_attention-0", "scheduler", "gateway"):
        assert re.search(rf"{service}\s+waiting for health", text), service
    assert "gateway listening on" in text


def test_up_without_a_terminal_prints_no_progress(fleet: UpProcess) -> None:
    # The session fleet runs `fastdecode up` with stdout and stderr going to a file.
    log = fleet.log.read_bytes()
    assert b"gateway listening on" in log
    assert b"\x1b" not in log
    assert not [p for p in PHASES if p.encode() in log], log.decode(errors="replace")
