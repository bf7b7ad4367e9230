"""Helpers shared by the deploy tests: paths, bounded commands, Debian packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
CHART_DIR = DEPLOY / "helm" / "fastdecode"
DOCKER_DIR = DEPLOY / "docker"


def log(msg: str) -> None:
    print(f"[deploy-test {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextmanager
def step(name: str, durations: dict[str, float] | None = None) -> Iterator[None]:
    """Log a step's start and its duration (and record it in `durations`)."""
    log(f"{name} ...")
    t0 = time.monotonic()
    try:
        yield
    finally:
        dt = time.monotonic() - t0
        if durations is not None:
            durations[name] = dt
        log(f"{name}: {dt:.1f} s")


def run(
    cmd: Sequence[str],
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run a command with a hard time limit; on failure raise with its output."""
    proc = subprocess.run(
        list(cmd),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def may_install() -> bool:
    """Install missing Debian packages only as root in CI (or when asked to)."""
    return (
        is_root()
        and shutil.which("apt-get") is not None
        and any(os.environ.get(v) for v in ("CI", "FASTDECODE_REQUIRE_DOCKER", "FASTDECODE_AUTO_INSTALL"))
    )


_apt_updated = False


def apt_install(packages: Sequence[str], timeout: float = 600) -> None:
    """`apt-get install -y` the packages (one `apt-get update` per process first)."""
    global _apt_updated
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if not _apt_updated:
        run(["apt-get", "update", "-q"], timeout=300, env=env)
        _apt_updated = True
    run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], timeout=timeout, env=env)


def ensure_commands(commands: dict[str, str]) -> list[str]:
    """Make sure each command exists, installing its Debian package where allowed.

    `commands` maps a command to the package that provides it. Returns the
    commands still missing afterwards.
    """
    missing = {c: p for c, p in commands.items() if shutil.which(c) is None}
    if missing and may_install():
        packages = sorted(set(missing.values()))
        with step(f"apt-get install {' '.join(packages)}"):
            apt_install(packages)
    return [c for c in commands if shutil.which(c) is None]


def venv_tool(name: str) -> str | None:
    """A console script installed next to this interpreter (the venv), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    return shutil.which(name)
