"""A private Docker engine for the container tests, and what they build on it.

- `PrivateDockerd`: dockerd with its own root, data-root, exec-root and socket in
  a temporary directory; no iptables rules, no default bridge, nothing routed
  out. `stop()` removes every trace even after a failure: containers, the
  daemon and its containerd/shims, mounts, bridges and veths it created,
  iptables chains (should any appear) and the directory.
- `debootstrap_base_image`: where no image registry is reachable, a
  `debootstrap --variant=minbase` Debian with python3 and python3-venv, imported
  with `docker import` (the tarball is cached between runs).
- `build_wheelhouse`: the project's dependencies as wheels (torch from the local
  CPU wheel), built on the host with pip, so the image build needs no network.
- `build_image`: deploy/docker/Dockerfile with BASE_IMAGE and WHEELHOUSE, built
  with no network at all.

Every step takes a time limit. Used by tests/deploy/test_containers.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from ._tools import REPO, log, run

DEFAULT_CACHE = REPO / ".cache" / "docker-e2e"
WHEELHOUSE = REPO / ".wheelhouse"
DEBIAN_SUITE = "bookworm"  # python3.11, the interpreter the wheelhouse is built for
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_TAG = f"fastdecode-e2e-base:{DEBIAN_SUITE}-minbase-py311"
PYTHON_TAG = "311"
# Debian bookworm has glibc 2.36: every manylinux tag up to it (pip does not expand them itself).
_PLATFORMS = [
    *(f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
# Interfaces dockerd creates; only ones that appear during our run are removed.
_DOCKER_LINK = re.compile(r"^(docker0|br-[0-9a-f]{12}|veth[0-9a-f]+|fdd[0-9a-f]{8})$")


def cache_dir() -> Path:
    d = Path(os.environ.get("FASTDECODE_E2E_CACHE", DEFAULT_CACHE))
    d.mkdir(parents=True, exist_ok=True)
    return d


_IP_FORWARD = "/proc/sys/net/ipv4/ip_forward"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _links() -> set[str]:
    try:
        return set(os.listdir("/sys/class/net"))
    except OSError:
        return set()


def _iptables_rules(table: str) -> list[str]:
    if shutil.which("iptables") is None:
        return []
    proc = subprocess.run(
        ["iptables", "-w", "5", "-t", table, "-S"], capture_output=True, text=True, timeout=30, check=False
    )
    return proc.stdout.splitlines() if proc.returncode == 0 else []


class PrivateDockerd:
    """dockerd on a private root and socket; use as a context manager."""

    def __init__(self, start_timeout: float = 90.0) -> None:
        self.start_timeout = start_timeout
        # Short path: unix socket paths are limited to 108 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="fdd-", dir="/tmp"))
        self.socket = self.root / "docker.sock"
        self.host = f"unix://{self.socket}"
        self.log_path = self.root / "dockerd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.bridge: str | None = None
        self._ip_forward = _read(_IP_FORWARD)
        self.client: Any = None
        self._links_before = _links()
        self._rules_before = {t: set(_iptables_rules(t)) for t in ("filter", "nat")}
        self._forward_policy = next(
            (r for r in self._rules_before["filter"] if r.startswith("-P FORWARD ")), None
        )

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Any:
        import docker

        (self.root / "daemon.json").write_text("{}\n")
        if shutil.which("ip"):
            name = f"fdd{os.urandom(4).hex()}"
            if (
                subprocess.run(
                    ["ip", "link", "add", name, "type", "bridge"], capture_output=True, timeout=30
                ).returncode
                == 0
            ):
                self.bridge = name
        cmd = [
            "dockerd",
            f"--data-root={self.root / 'data'}",
            f"--exec-root={self.root / 'exec'}",
            f"--pidfile={self.root / 'dockerd.pid'}",
            f"--host={self.host}",
            f"--config-file={self.root / 'daemon.json'}",
            # Nothing routed in or out: host <-> containers only through ports
            # published on 127.0.0.1 (docker-proxy); no iptables rules. The default
            # bridge is our own (or none): another engine's docker0 stays untouched.
            f"--bridge={self.bridge or 'none'}",
            "--iptables=false",
            "--ip-masq=false",
            "--ip-forward=false",
            "--ip6tables=false",
            "--userland-proxy=true",
            "--log-level=warn",
        ]
        log(f"starting dockerd in {self.root}")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + self.start_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.socket.exists():
                try:
                    client = docker.DockerClient(base_url=self.host, version="auto", timeout=300)
                    client.ping()
                    self.client = client
                    return client
                except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
                    last = exc
            time.sleep(0.5)
        raise TimeoutError(f"dockerd not up after {self.start_timeout:.0f} s ({last}):\n{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def env(self) -> dict[str, str]:
        """Environment for docker / docker-compose talking to this daemon only."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "COMPOSE_"))}
        env["DOCKER_HOST"] = self.host
        return env

    def stop(self) -> None:
        """Stop everything this daemon started and remove its traces. Never raises."""
        steps = [
            self._remove_containers,
            self._stop_daemon,
            self._kill_leftovers,
            self._unmount,
            self._remove_links,
            self._clean_iptables,
            self._remove_root,
        ]
        for fn in steps:
            t0 = time.monotonic()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - cleanup goes on whatever happens
                log(f"cleanup step {fn.__name__} failed: {exc!r}")
            if time.monotonic() - t0 > 2:
                log(f"cleanup step {fn.__name__}: {time.monotonic() - t0:.1f} s")

    def __enter__(self) -> PrivateDockerd:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- cleanup steps -----------------------------------------------------------------------
    def _remove_containers(self) -> None:
        if self.client is None or self.proc is None or self.proc.poll() is not None:
            return
        for c in self.client.containers.list(all=True):
            with contextlib.suppress(Exception):
                c.remove(force=True)
        for n in self.client.networks.list():
            if n.name not in ("bridge", "host", "none"):
                with contextlib.suppress(Exception):
                    n.remove()
        self.client.close()

    def _stop_daemon(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def _kill_leftovers(self) -> None:
        """containerd and shims of this daemon: processes whose command line names our root."""
        marker = str(self.root).encode()
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
                continue
            try:
                cmdline = (pid_dir / "cmdline").read_bytes()
            except OSError:
                continue
            if marker in cmdline:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid_dir.name), signal.SIGKILL)

    def _unmount(self) -> None:
        prefix = str(self.root) + "/"
        targets = []
        with open("/proc/self/mounts") as f:
            for line in f:
                target = line.split()[1].replace("\\040", " ")
                if target.startswith(prefix) or target == str(self.root):
                    targets.append(target)
        for target in sorted(targets, key=len, reverse=True):
            if subprocess.run(["umount", target], capture_output=True, timeout=30).returncode != 0:
                subprocess.run(["umount", "-l", target], capture_output=True, timeout=30)

    def _remove_links(self) -> None:
        for name in sorted(_links() - self._links_before):
            if _DOCKER_LINK.match(name) or name == self.bridge:
                subprocess.run(["ip", "link", "delete", name], capture_output=True, timeout=30)
        if self._ip_forward is not None and _read(_IP_FORWARD) != self._ip_forward:
            Path(_IP_FORWARD).write_text(self._ip_forward + "\n")

    def _clean_iptables(self) -> None:
        """Drop DOCKER* chains and rules that appeared during this run (none with --iptables=false)."""
        for table in ("filter", "nat"):
            before = self._rules_before[table]
            new = [r for r in _iptables_rules(table) if r not in before]
            for rule in new:
                if rule.startswith("-A ") and ("DOCKER" in rule or "docker0" in rule or " br-" in rule):
                    subprocess.run(
                        ["iptables", "-w", "5", "-t", table, "-D", *rule[3:].split()],
                        capture_output=True,
                        timeout=30,
                    )
            chains = [r.split()[1] for r in new if r.startswith("-N DOCKER")]
            for chain in chains:
                subprocess.run(
                    ["iptables", "-w", "5", "-t", table, "-F", chain], capture_output=True, timeout=30
                )
            for chain in chains:
                subprocess.run(
                    ["iptables", "-w", "5", "-t", table, "-X", chain], capture_output=True, timeout=30
                )
        if self._forward_policy and self._forward_policy not in _iptables_rules("filter"):
            policy = self._forward_policy.split()[2]
            subprocess.run(["iptables", "-w", "5", "-P", "FORWARD", policy], capture_output=True, timeout=30)

    def _remove_root(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What is still around after stop() (for the test to assert on)."""
        out = []
        if self.root.exists():
            out.append(f"directory {self.root}")
        marker = str(self.root)
        with open("/proc/self/mounts") as f:
            out += [f"mount {ln.split()[1]}" for ln in f if marker in ln]
        out += [
            f"link {n}"
            for n in sorted(_links() - self._links_before)
            if _DOCKER_LINK.match(n) or n == self.bridge
        ]
        for table in ("filter", "nat"):
            out += [
                f"iptables {table} {r}" for r in _iptables_rules(table) if r not in self._rules_before[table]
            ]
        return out


# ---- base image ---------------------------------------------------------------------------------
def debootstrap_rootfs_tarball(timeout: float = 600, build: bool = False) -> Path:
    """A minbase Debian with python3 + python3-venv and gRPC C++'s runtime (the native exchange
    worker's) as a tarball (cached); with `build`, also g++, the Python headers and gRPC C++'s
    headers and protoc (the image's build stage compiles the attention kernel and the worker)."""
    packages = "python3,python3-venv,libgrpc++1.51"
    if build:
        packages += ",python3-dev,g++,libgrpc++-dev,libprotobuf-dev,protobuf-compiler,pkg-config"
    tarball = cache_dir() / f"rootfs-{DEBIAN_SUITE}-minbase-py311-grpc{'-build' if build else ''}.tar"
    if tarball.exists():
        log(f"using cached base rootfs {tarball}")
        return tarball
    mirror = os.environ.get("FASTDECODE_E2E_DEBIAN_MIRROR", DEBIAN_MIRROR)
    work = Path(tempfile.mkdtemp(prefix="fd-rootfs-", dir=cache_dir()))
    try:
        rootfs = work / "rootfs"
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={packages}",
                DEBIAN_SUITE,
                str(rootfs),
                mirror,
            ],
            timeout=timeout,
        )
        # Trim what an image does not need.
        for sub in (
            "var/cache/apt",
            "var/lib/apt/lists",
            "usr/share/doc",
            "usr/share/man",
            "usr/share/locale",
        ):
            p = rootfs / sub
            if p.is_dir():
                for child in p.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
        partial = work / "rootfs.tar"
        run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."], timeout=300)
        partial.rename(tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tarball


def debootstrap_base_image(client: Any, timeout: float = 600, build: bool = False) -> str:
    """Import the debootstrap rootfs as an image; returns its tag (BASE_TAG, or BASE_TAG-build)."""
    tarball = debootstrap_rootfs_tarball(timeout=timeout, build=build)
    tag = BASE_TAG + ("-build" if build else "")
    client.api.import_image(
        src=str(tarball),
        repository=tag.split(":")[0],
        tag=tag.split(":")[1],
        changes=[
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "ENV LANG=C.UTF-8",
            'CMD ["/bin/bash"]',
        ],
    )
    client.images.get(tag)
    return tag


def base_image(client: Any, timeout: float = 600, build: bool = False) -> str:
    """FASTDECODE_E2E_BASE_IMAGE (FASTDECODE_E2E_BUILD_IMAGE with `build`) if given (pulled when
    absent), else the debootstrap image (with a compiler and Python headers for `build`)."""
    given = os.environ.get("FASTDECODE_E2E_BUILD_IMAGE" if build else "FASTDECODE_E2E_BASE_IMAGE")
    if given:
        import docker

        try:
            client.images.get(given)
        except docker.errors.ImageNotFound:
            client.images.pull(given)
        return given
    return debootstrap_base_image(client, timeout=timeout, build=build)


# ---- wheelhouse ---------------------------------------------------------------------------------
def _requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    build = project["build-system"]["requires"]
    # The image installs `.[server]` (deploy/docker/Dockerfile): the SDK's dependencies and the server extra.
    server = project["project"]["optional-dependencies"]["server"]
    return [*project["project"]["dependencies"], *server, *build]


def build_wheelhouse(timeout: float = 600) -> Path:
    """Wheels for every dependency (and the build backend) for CPython 3.11 on manylinux x86_64.

    Built with the host's pip (its indexes: PyPI and the local torch CPU wheel),
    reused while pyproject.toml's requirements stay the same.
    """
    reqs = _requirements()
    key = hashlib.sha256(json.dumps([reqs, PYTHON_TAG]).encode()).hexdigest()[:16]
    stamp = WHEELHOUSE / ".fastdecode-e2e-stamp"
    if stamp.exists() and stamp.read_text().strip() == key and any(WHEELHOUSE.glob("torch-*.whl")):
        log(f"using cached wheelhouse {WHEELHOUSE}")
        return WHEELHOUSE
    WHEELHOUSE.mkdir(exist_ok=True)
    for old in WHEELHOUSE.glob("*.whl"):
        old.unlink()
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--only-binary=:all:",
            "--implementation=cp",
            f"--python-version={PYTHON_TAG}",
            f"--abi=cp{PYTHON_TAG}",
            *(f"--platform={p}" for p in _PLATFORMS),
            "--dest",
            str(WHEELHOUSE),
            *reqs,
        ],
        timeout=timeout,
    )
    torch = list(WHEELHOUSE.glob("torch-*.whl"))
    if not torch or not all("+cpu" in w.name for w in torch):
        raise RuntimeError(f"wheelhouse lacks the torch CPU wheel: {[w.name for w in torch]}")
    stamp.write_text(key + "\n")
    return WHEELHOUSE


# ---- image --------------------------------------------------------------------------------------
def build_image(
    client: Any, tag: str, base: str, wheelhouse: Path, timeout: float = 900, build_base: str | None = None
) -> list[str]:
    """Build deploy/docker/Dockerfile offline (network none); returns the build log lines.
    `build_base` is the build stage's image (it compiles the attention kernel: g++, Python headers)."""
    from docker.errors import BuildError

    lines: list[str] = []
    deadline = time.monotonic() + timeout
    stream = client.api.build(
        path=str(REPO),
        dockerfile="deploy/docker/Dockerfile",
        tag=tag,
        buildargs={
            "BASE_IMAGE": base,
            "BUILD_IMAGE": build_base or base,
            "WHEELHOUSE": str(wheelhouse.relative_to(REPO)),
        },
        network_mode="none",
        pull=False,
        rm=True,
        forcerm=True,
        decode=True,
    )
    try:
        for chunk in stream:
            if "stream" in chunk:
                lines += chunk["stream"].splitlines()
            if "error" in chunk:
                raise BuildError(chunk["error"] + "\n" + "\n".join(lines[-60:]), lines)
            if time.monotonic() > deadline:
                raise TimeoutError(f"image build over {timeout:.0f} s\n" + "\n".join(lines[-60:]))
    finally:
        with contextlib.suppress(Exception):
            stream.close()
    size = client.images.get(tag).attrs.get("Size", 0)
    log(f"built {tag} from {base}: {size / 2**20:.0f} MiB")
    return lines
