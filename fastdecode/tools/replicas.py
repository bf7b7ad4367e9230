"""Several fleets behind one router (`fastdecode up --replicas N`): each replica is a whole fleet
(its gateway, scheduler, gpu_dense and shards), and a router people already run in front of vLLM
serves one OpenAI-compatible endpoint over their gateways' HTTP ports. The router is vllm-router (a
Rust binary in a wheel, the `router` extra), started with the cache-aware policy: requests whose
prompts share a prefix go to the replica that served it, where the prefix's KV blocks are cached.
Not code of ours: its routing, health checks, retries and circuit breakers are the router's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from fastdecode.runtime.errors import InvalidInput, Unavailable
from fastdecode.tools.fleet import Fleet, free_port

ROUTERS = ("vllm-router",)
POLICIES = ("cache_aware", "round_robin", "power_of_two", "consistent_hash", "random")
ROUTER_NOTICE_S = 2.0  # at most this long after a replica's gateway dies, the router routes around it


def router_binary(name: str) -> str:
    """The router's executable: beside this Python's (the venv's bin), else on PATH."""
    if name not in ROUTERS:
        raise InvalidInput(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise InvalidInput(f"{name} is not installed: pip install 'fastdecode-fleet[router]'")
    return found


@dataclass
class Replicas:
    """N fleets (each with an HTTP port) and the router on `host:port` in front of them."""

    fleets: list[Fleet]
    port: int
    router: str = "vllm-router"
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    workdir: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    metrics_port: int = 0  # the router's Prometheus port (its default, 29000, is one per host)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "router.log"

    def worker_urls(self) -> list[str]:
        return [f"http://{f.gateway.http}" for f in self.fleets if f.gateway is not None and f.gateway.http]

    def start(self, timeout: float = 120) -> Replicas:
        if self.policy not in POLICIES:
            raise InvalidInput(f"router policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        binary = router_binary(self.router)
        for f in self.fleets:
            f.start()
        urls = self.worker_urls()
        if len(urls) != len(self.fleets):
            raise InvalidInput("every replica needs its gateway's HTTP port (http_port=0 picks one)")
        self.workdir = self.workdir or self.fleets[0].workdir
        cmd = [binary, "--host", self.host, "--port", str(self.port), "--policy", self.policy]
        # a port of its own for the router's metrics: with its default two routers on one host
        # (two `up --replicas`) collide and the second panics at start
        self.metrics_port = self.metrics_port or free_port(self.host)
        cmd += ["--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port)]
        # a replica restarted by `up` is back within seconds: probe every second and take one failed
        # probe as down (ROUTER_NOTICE_S), so requests go around a dead gateway about a second after
        # it died and come back to it as soon as it answers again
        cmd += [
            "--worker-urls",
            *urls,
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "1",
        ]
        cmd += ["--health-success-threshold", "1", "--log-level", "warning"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.stop()
                raise Unavailable(f"{self.router} did not become healthy on {self.address}:\n{tail}")
            time.sleep(0.2)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def router_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=grace)
        for f in self.fleets:
            f.stop()

    def state(self) -> dict[str, object]:
        return {
            "router": {
                "name": self.router,
                "policy": self.policy,
                "http": self.address,
                "pid": self.proc.pid if self.proc is not None else None,
                "alive": self.router_alive(),
                "metrics": f"{self.host}:{self.metrics_port}",
                "log": str(self.log_path) if self.workdir is not None else None,
            },
            "replicas": [f.state() for f in self.fleets],
        }
