"""Start and stop fleet services as separate OS processes on loopback (`fastdecode up`, tests, benches).

Each service binds port 0 (or the port asked for) and announces what it bound through a
ready file, written only once its health is SERVING, so there is no port race. A service may
also report start-up progress (gpu_dense: weight bytes loaded) through a progress file next to
it; an optional observer hears both (`fastdecode up` draws them; this module draws nothing).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastdecode.runtime.errors import Unavailable
from fastdecode.runtime.fleet_secret import (
    FLEET_SECRET_ENV,
    FLEET_SECRET_FILE_ENV,
    generate_secret,
    load_fleet_secret,
    write_secret_file,
)
from fastdecode.runtime.progress import PROGRESS_ENV, READY, STARTING, WAITING_FOR_HEALTH, read_progress
from fastdecode.runtime.settings import SchedulerSettings, TLSFiles

# on_progress(service, phase, done, total), phases as in fastdecode.runtime.progress; total 0 = unknown.
ProgressObserver = Callable[[str, str, int, int], None]

MAX_RESTART_BACKOFF_S = 10.0  # `up` restarts a dead service after 0.5 s, doubling to this


@dataclass
class ServiceProcess:
    name: str
    proc: subprocess.Popen[bytes]
    address: str
    metrics: str | None
    log_path: Path
    args: list[str] = field(default_factory=list)  # `serve` arguments, kept for restart()
    env: dict[str, str] | None = None
    http: str | None = None  # the gateway's OpenAI-compatible HTTP address, when it serves one
    restarts: int = 0  # times the supervisor started this service again after it died

    @property
    def pid(self) -> int:
        return self.proc.pid

    def state(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "address": self.address,
            "metrics": self.metrics,
            "log": str(self.log_path),
            "restarts": self.restarts,
            "exit_code": self.proc.poll(),  # None while running (a drained shard exits with 0)
            "alive": self.proc.poll() is None,  # a dead pid is never listed as running
        }

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class _Pending:
    svc: ServiceProcess
    ready: Path
    host: str
    progress: Path


GATEWAY_ONLY_ENV = frozenset({"FASTDECODE_AUTH_TOKEN", "FASTDECODE_API_KEYS_FILE"})


def spawn_service(
    name: str,
    args: list[str],
    workdir: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics: bool = False,
    env: dict[str, str] | None = None,
    on_progress: ProgressObserver | None = None,
    prefix: list[str] | None = None,
) -> _Pending:
    """Spawn `fastdecode serve ...`; wait_ready() then blocks until it reports SERVING. `prefix`: a
    command the service starts under, e.g. taskset or `ip netns exec` (each execs it: same pid)."""
    ready = workdir / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    progress = workdir / f"{name}.progress.json"
    progress.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    cmd = [*(prefix or []), sys.executable, "-m", "fastdecode.cli", "serve", *args]
    cmd += ["--host", host, "--port", str(port)]
    cmd += ["--ready-file", str(ready)]
    if metrics:
        cmd += ["--metrics-port", "0"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            # The child stops by itself when this supervisor dies (see rpc.Server): no orphans. No
            # preexec_fn: forking a process that runs gRPC threads aborts in gRPC's fork handlers.
            env={
                k: v
                for k, v in {
                    **os.environ,
                    "FASTDECODE_SUPERVISOR_PID": str(os.getpid()),
                    PROGRESS_ENV: str(progress),
                    **(env or {}),
                }.items()
                # the public API's keys are the gateway's alone: no other service gets them
                if name == "gateway" or k not in GATEWAY_ONLY_ENV
            },
            start_new_session=True,
        )
    if on_progress is not None:
        on_progress(name, STARTING, 0, 0)
    return _Pending(ServiceProcess(name, proc, "", None, log_path, list(args), env), ready, host, progress)


def wait_ready(
    pending: _Pending, timeout: float = 120.0, on_progress: ProgressObserver | None = None
) -> ServiceProcess:
    svc, proc = pending.svc, pending.svc.proc

    def report(phase: str, done: int = 0, total: int = 0) -> None:
        if on_progress is not None:
            on_progress(svc.name, phase, done, total)

    report(WAITING_FOR_HEALTH)
    seen: tuple[str, int, int] | None = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Unavailable(
                f"{svc.name} exited with code {proc.returncode} during start:\n{svc.log_tail()}"
            )
        # Progress before ready: the final snapshot precedes the ready file, so a phase that ran
        # faster than one poll is still reported once.
        snapshot = read_progress(pending.progress) if on_progress is not None else None
        if snapshot is not None and snapshot != seen:
            seen = snapshot
            report(*snapshot)
            if snapshot[1] >= snapshot[2]:
                report(WAITING_FOR_HEALTH)
        if pending.ready.exists():
            info = json.loads(pending.ready.read_text())
            svc.address = f"{pending.host}:{info['port']}"
            if info.get("metrics_port"):
                svc.metrics = f"{pending.host}:{info['metrics_port']}"
            if info.get("http_port"):
                svc.http = f"{pending.host}:{info['http_port']}"
            report(READY)
            return svc
        time.sleep(0.05)
    stop_processes([svc], grace=2.0)
    raise Unavailable(f"{svc.name} did not become healthy within {timeout:.0f}s:\n{svc.log_tail()}")


def start_service(
    name: str,
    args: list[str],
    workdir: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    on_progress: ProgressObserver | None = None,
    prefix: list[str] | None = None,
) -> ServiceProcess:
    """Spawn `fastdecode serve ...` and wait until it reports SERVING through its ready file."""
    pending = spawn_service(
        name,
        args,
        workdir,
        host=host,
        port=port,
        metrics=metrics,
        env=env,
        on_progress=on_progress,
        prefix=prefix,
    )
    return wait_ready(pending, timeout, on_progress)


def stop_processes(services: list[ServiceProcess], grace: float = 25.0) -> None:
    """SIGTERM all, wait up to `grace`, then SIGKILL what is left."""
    for s in services:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for s in services:
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait(timeout=5)


CO_LOCATED_ENV = {"GOMP_SPINCOUNT": "1000"}


def co_located_env() -> dict[str, str]:
    """CO_LOCATED_ENV less what the user's environment already sets (theirs wins)."""
    return {k: v for k, v in CO_LOCATED_ENV.items() if k not in os.environ}


def shard_threads(shards: int) -> int:
    """torch threads per co-located shard: the host's cores split between the shards."""
    return max(1, (os.cpu_count() or 1) // shards)


@dataclass
class Fleet:
    """The four services plus N shards, started in dependency order."""

    model: Path
    shards: int = 2
    port: int = 0
    device: str = "auto"
    kv_capacity: int = 1 << 30
    kv_dtype: str = "float32"
    kv_dir: Path | None = None  # --kv-dir of every shard: pools that outlive their processes
    metrics: bool = True
    auth_token: str | None = None
    http_port: int | None = None  # the gateway's OpenAI-compatible HTTP port (0: any free one)
    # Two-mini-batch pipeline. None = auto: the scheduler plans two mini-batches and gpu_dense runs
    # them pipelined or as one batch, whichever its measurement on live steps finds faster here.
    pipeline: bool | None = None
    # One more shard, in gpu_dense's own process (--host-shard): the dense host's CPUs attend the
    # share the scheduler places there, with no wire (services/gpu_dense/exchange/host_shard.py). Last index.
    host_shard: bool = False
    scheduler_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    dense_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None
    # The fleet secret's file (FASTDECODE_FLEET_SECRET_FILE to every service). Unset: the one the
    # environment names, else a file holding FASTDECODE_FLEET_SECRET, else a fresh secret's file.
    secret_file: Path | None = None
    kv: list[ServiceProcess] = field(default_factory=list)
    dense: ServiceProcess | None = None
    scheduler: ServiceProcess | None = None
    gateway: ServiceProcess | None = None
    _hosted: str | None = field(default=None, repr=False)

    @property
    def services(self) -> list[ServiceProcess]:
        return [s for s in (self.gateway, self.scheduler, self.dense) if s] + self.kv

    def _resolve_secret(self, workdir: Path) -> Path:
        """Where the services read the fleet secret (never argv: `ps` shows it)."""
        given = {**os.environ, **self.env}
        if self.secret_file is None and given.get(FLEET_SECRET_FILE_ENV):
            self.secret_file = Path(given[FLEET_SECRET_FILE_ENV])
        if self.secret_file is None:
            secret = given.get(FLEET_SECRET_ENV) or generate_secret()
            self.secret_file = write_secret_file(workdir / "fleet.secret", secret.replace(",", "\n"))
        load_fleet_secret(None, self.secret_file)  # a bad one is one clear error before anything starts
        return self.secret_file

    @property
    def peer_credentials(self) -> TLSFiles:
        """What a caller needs for the internal services of this fleet (tests, benchmarks, probes);
        add certificate files where the fleet runs TLS."""
        return TLSFiles(secret=load_fleet_secret(None, self.secret_file) if self.secret_file else None)

    def start(self, timeout: float = 180.0, on_progress: ProgressObserver | None = None) -> Fleet:
        """Start every service in dependency order; `on_progress` hears each one's start-up phases."""
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="fastdecode-fleet-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        w = self.workdir
        # The services share this host's cores: OpenMP workers that spin after every parallel region
        # steal them from the other processes (measured: 3.4x slower decode on 2 cores). Spin briefly.
        env = {**co_located_env(), **self.env, FLEET_SECRET_FILE_ENV: str(self._resolve_secret(w))}
        env.pop(FLEET_SECRET_ENV, None)  # the file is the one source: rotation edits it
        try:
            pending = [
                spawn_service(
                    f"kv_attention-{i}",
                    self._kv_args(i),
                    w,
                    metrics=self.metrics,
                    env=env,
                    on_progress=on_progress,
                )
                for i in range(self.shards)
            ]
            for p in pending:  # shards start in parallel: each one imports torch
                self.kv.append(wait_ready(p, timeout, on_progress))
            addresses = [s.address for s in self.kv] + ([self.hosted_address] if self.host_shard else [])
            shard_list = ",".join(addresses)
            t0 = time.monotonic()
            self.dense = start_service(
                "gpu_dense",
                [
                    "gpu-dense",
                    "--model",
                    str(self.model),
                    "--shards",
                    shard_list,
                    "--device",
                    self.device,
                    *(["--pipeline-mode", "auto"] if self.pipeline is None else []),
                    *(self._host_shard_args() if self.host_shard else []),
                    *self.dense_args,
                ],
                w,
                metrics=self.metrics,
                env=env,
                timeout=timeout,
                on_progress=on_progress,
            )
            self.scheduler = start_service(
                "scheduler",
                [
                    "scheduler",
                    "--dense",
                    self.dense.address,
                    "--shards",
                    shard_list,
                    self._pipeline_flag(),
                    *self._dense_down_args(env, time.monotonic() - t0),
                    *self.scheduler_args,
                ],
                w,
                metrics=self.metrics,
                env=env,
                timeout=timeout,
                on_progress=on_progress,
            )
            gw_env = dict(env)
            if self.auth_token:
                gw_env["FASTDECODE_AUTH_TOKEN"] = self.auth_token  # env, not argv: keep it out of `ps`
            self.gateway = start_service(
                "gateway",
                [
                    "gateway",
                    "--scheduler",
                    self.scheduler.address,
                    "--model",
                    str(self.model),
                    *(["--http-port", str(self.http_port)] if self.http_port is not None else []),
                    *self.gateway_args,
                ],
                w,
                port=self.port,
                metrics=self.metrics,
                env=gw_env,
                timeout=timeout,
                on_progress=on_progress,
            )
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def hosted_address(self) -> str:
        """The address of the shard gpu_dense hosts (fixed once chosen: a restart binds it again)."""
        if self._hosted is None:
            self._hosted = f"127.0.0.1:{free_port()}"
        return self._hosted

    def _host_shard_args(self) -> list[str]:
        return [
            "--host-shard",
            str(self.shards),
            "--host-shard-kv-capacity",
            str(self.kv_capacity),
            "--host-shard-kv-dtype",
            self.kv_dtype,
        ]

    def _dense_down_args(self, env: dict[str, str], dense_start_s: float) -> list[str]:
        """The scheduler's --dense-down-timeout, unless the caller set one: the longest restart
        backoff plus two of gpu_dense's measured starts (a restart loads the weights again, on a host
        as busy as now), never under the default. Tensor-parallel ranks or a big checkpoint start
        slower than the default's 20 s allow, and paused requests would fail mid-restart."""
        named = any(a.startswith("--dense-down-timeout") for a in self.scheduler_args)
        if named or "FASTDECODE_DENSE_DOWN_TIMEOUT" in {**os.environ, **env}:
            return []
        default = SchedulerSettings.model_fields["dense_down_timeout"].default
        return ["--dense-down-timeout", f"{max(default, MAX_RESTART_BACKOFF_S + 2 * dense_start_s):.1f}"]

    def _pipeline_flag(self) -> str:
        return "--no-pipeline" if self.pipeline is False else "--pipeline"

    def _kv_args(self, i: int) -> list[str]:
        # Co-located shards split this host's cores between them instead of each taking all of them.
        threads = shard_threads(self.shards)
        return [
            "kv-attention",
            "--shard-id",
            str(i),
            "--kv-capacity",
            str(self.kv_capacity),
            "--kv-dtype",
            self.kv_dtype,
            "--threads",
            str(threads),
            *(["--kv-dir", str(self.kv_dir)] if self.kv_dir else []),
        ]

    def restart(self, svc: ServiceProcess, timeout: float = 120.0) -> ServiceProcess:
        """Start a stopped (or killed) service again on the same address, as an orchestrator would."""
        if svc.proc.poll() is None:
            stop_processes([svc])
        host, port = svc.address.rsplit(":", 1)
        args = list(svc.args)
        if svc.http and "--http-port" in args:
            # the HTTP port it had, not "any free one" again: a router's worker URL names it
            args[args.index("--http-port") + 1] = svc.http.rsplit(":", 1)[1]
        new = start_service(
            svc.name,
            args,
            self.workdir or Path(tempfile.gettempdir()),
            host=host,
            port=int(port),
            metrics=self.metrics,
            env=svc.env,
            timeout=timeout,
        )
        new.restarts = svc.restarts
        new.http = new.http or svc.http
        for attr in ("gateway", "scheduler", "dense"):
            if getattr(self, attr) is svc:
                setattr(self, attr, new)
        self.kv = [new if k is svc else k for k in self.kv]
        return new

    def state(self) -> dict[str, object]:
        return {
            "gateway": {**self.gateway.state(), "http": self.gateway.http} if self.gateway else None,
            "scheduler": self.scheduler.state() if self.scheduler else None,
            "gpu_dense": self.dense.state() if self.dense else None,
            "kv_attention": [s.state() for s in self.kv],
            "host_shard": self.hosted_address if self.host_shard else None,  # in gpu_dense's process
            "logs": str(self.workdir) if self.workdir else None,
            "fleet_secret_file": str(self.secret_file) if self.secret_file else None,
        }

    def stop(self, grace: float = 25.0) -> None:
        # Front to back: the gateway drains first, shards go last.
        for group in ([self.gateway], [self.scheduler], [self.dense], self.kv):
            stop_processes([s for s in group if s is not None], grace)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def state_credentials(state: dict) -> TLSFiles:
    """The fleet secret for calls to the internal services of the fleet a state file describes (it
    names the secret's file, never the secret)."""
    path = state.get("fleet_secret_file")
    return TLSFiles(secret=load_fleet_secret(None, Path(path)) if path else None)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a process that binds it later. Drawn below the kernel's ephemeral range
    where there is room: a port the kernel hands out (bind to 0) can go to another process's
    outgoing connection before ours binds it, which failed a start-up 20 s later."""
    low = _ephemeral_low()
    for _ in range(64) if low > 12_000 else ():
        port = random.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class UpProcess:
    """A `fastdecode up` process (the user-facing supervisor) and the state file it wrote."""

    proc: subprocess.Popen[bytes]
    state: dict
    model: Path
    log: Path
    state_file: Path | None = None

    def reload(self) -> dict:
        """Read the state file again (`up` rewrites it when it restarts a service)."""
        if self.state_file is not None:
            self.state = json.loads(self.state_file.read_text())
        return self.state

    @property
    def target(self) -> str:
        return str(self.state["gateway"]["address"])

    @property
    def peer_credentials(self) -> TLSFiles:
        return state_credentials(self.state)

    @property
    def http(self) -> str | None:
        """HOST:PORT of the gateway's OpenAI-compatible HTTP API (None when off)."""
        return self.state["gateway"].get("http")

    def pids(self) -> list[int]:
        s = self.state
        return [s["gateway"]["pid"], s["scheduler"]["pid"], s["gpu_dense"]["pid"]] + [
            k["pid"] for k in s["kv_attention"]
        ]

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def launch_up(
    model: Path,
    workdir: Path,
    *extra: str,
    shards: int = 2,
    device: str = "cpu",
    kv_capacity: int = 128 << 20,
    kv_dtype: str = "float32",
    env: dict[str, str] | None = None,
    timeout: float = 180,
) -> UpProcess:
    """Run `fastdecode up` in the background and wait for its state file (the fleet is healthy then).

    KV is float32 (`up`'s default) unless asked: tests and benchmarks compare tokens with
    transformers' fp32 output or with a fault-free run, which only fp32 KV reproduces exactly."""
    state_file = workdir / "fleet.json"
    log = workdir / "up.log"
    cmd = [
        sys.executable,
        "-m",
        "fastdecode.cli",
        "up",
        "--model",
        str(model),
        "--shards",
        str(shards),
        "--device",
        device,
        "--port",
        str(free_port()),
        "--kv-capacity",
        str(kv_capacity),
        "--kv-dtype",
        kv_dtype,
        "--state-file",
        str(state_file),
        *extra,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise Unavailable(f"fastdecode up failed:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return UpProcess(proc, json.loads(state_file.read_text()), model, log, state_file)
