"""Emulated hosts on one machine for `bench split`: CPU sets, and network namespaces joined by veth.

A host is a set of CPUs. Every process of a host runs pinned to its set (`taskset`, applied
before the interpreter starts, so every thread it makes inherits it) with torch's and OpenMP's
threads sized to the set. Each shard host gets, where the kernel and our privileges allow,
its own network namespace joined to the dense host's (the root namespace) by a veth pair with
a private /30 created here, optionally shaped by a tbf qdisc; Attend traffic then crosses a
real network stack. Where namespaces cannot be made, the hosts share loopback, still pinned.
Namespaces are always deleted on the way out, on errors and Ctrl-C too, and stale ones of
earlier runs whose process is gone are deleted before new ones are made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from fastdecode.runtime.errors import InvalidInput

CpuSet = tuple[int, ...]
NETNS_PREFIX = "fdsplit"
# 10.213.<shard>.0/30 per shard host: root end .1, namespace end .2 (checked free before use)
_SUBNET = "10.213.{i}.0/30"
_RATE = re.compile(r"^\d+(\.\d+)?([kmg]?(bit|bps))$", re.IGNORECASE)


def parse_cpu_set(text: str) -> CpuSet:
    """One host's CPUs: ranges and single CPUs joined by '+', e.g. '0-3', '4', '0-1+6-7'."""
    cpus: set[int] = set()
    spec = text.strip()
    if not spec:
        raise InvalidInput("empty CPU set")
    for part in spec.split("+"):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", part)
        if not m:
            raise InvalidInput(f"bad CPU set {text!r}: expected ranges like 0-3, joined by '+'")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise InvalidInput(f"bad CPU range {part.strip()!r} in {text!r}: end before start")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def parse_hosts(text: str) -> tuple[CpuSet, ...]:
    """Several hosts' CPU sets separated by ',': '4-7,8-11' is two hosts of four CPUs each."""
    if not text.strip():
        raise InvalidInput("no shard hosts given")
    return tuple(parse_cpu_set(part) for part in text.split(","))


def cpu_list(cpus: CpuSet) -> str:
    """The kernel's cpulist form ('0-3,8'), as taskset -c reads it."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass(frozen=True)
class HostLayout:
    dense: CpuSet
    shards: tuple[CpuSet, ...]

    @property
    def dense_threads(self) -> int:
        return len(self.dense)

    def shard_threads(self, i: int) -> int:
        return len(self.shards[i])

    def describe(self) -> str:
        shards = "; ".join(f"shard host {i}: CPUs {cpu_list(s)}" for i, s in enumerate(self.shards))
        return f"dense host: CPUs {cpu_list(self.dense)}; {shards}"


def host_layout(
    dense: str | None = None, shards: str | None = None, available: set[int] | None = None
) -> HostLayout:
    """Dense host and shard hosts from their specs; defaults: the first available CPU for the dense
    host, the rest as one shard host. CPU sets must be available to this process and disjoint."""
    avail = sorted(available if available is not None else os.sched_getaffinity(0))
    d = parse_cpu_set(dense) if dense is not None else tuple(avail[:1])
    if shards is not None:
        s = parse_hosts(shards)
    else:
        rest = tuple(c for c in avail if c not in d)
        if not rest:
            raise InvalidInput(
                f"no CPU left for a shard host (this process may use CPUs {cpu_list(tuple(avail))}, "
                f"the dense host takes {cpu_list(d)}): give --shard-cpus"
            )
        s = (rest,)
    missing = sorted({c for cs in (d, *s) for c in cs} - set(avail))
    if missing:
        raise InvalidInput(
            f"CPUs {cpu_list(tuple(missing))} are not available here (allowed: {cpu_list(tuple(avail))})"
        )
    seen: set[int] = set()
    for cs in (d, *s):
        if seen & set(cs):
            raise InvalidInput(f"hosts overlap on CPUs {cpu_list(tuple(sorted(seen & set(cs))))}")
        seen |= set(cs)
    return HostLayout(d, s)


def pin_command(cpus: CpuSet, nice: int = 0) -> list[str]:
    """A prefix that starts a command on `cpus` only (every thread it makes inherits the set), at
    scheduling priority `nice` when not 0."""
    taskset = shutil.which("taskset")
    if taskset is None:
        raise InvalidInput("taskset (util-linux) is needed to pin the emulated hosts")
    prefix = [taskset, "-c", cpu_list(cpus)]
    if nice:
        prefix += ["nice", "-n", str(nice)]
    return prefix


def thread_env(cpus: CpuSet) -> dict[str, str]:
    """OpenMP and MKL threads sized to the host's set; short spin-waits (hosts share no cores, but
    a host's own services do)."""
    n = str(len(cpus))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "GOMP_SPINCOUNT": "1000"}


def _tasks() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")] if Path("/proc/self/task").is_dir() else [0]


@contextlib.contextmanager
def pinned_process(cpus: CpuSet, nice: int = 0) -> Iterator[None]:
    """Pin every thread of this process to `cpus` (threads made later inherit it), at nice value
    `nice` when not 0 (Linux keeps both per thread); both restored after."""
    before = os.sched_getaffinity(0)
    prio = os.getpriority(os.PRIO_PROCESS, 0)
    for t in _tasks():
        with contextlib.suppress(OSError):  # a thread may have ended meanwhile
            os.sched_setaffinity(t, cpus)
            if nice:
                os.setpriority(os.PRIO_PROCESS, t, nice)
    try:
        yield
    finally:
        for t in _tasks():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(t, before)
                if nice:
                    os.setpriority(os.PRIO_PROCESS, t, prio)


# ------------------------------------------------------------------------------------- network


@dataclass
class Isolation:
    """How the emulated hosts are kept apart, and where each one's services listen."""

    kind: str  # "netns+veth" | "pinned loopback"
    description: str
    dense_host: str  # the dense host's address (services there bind it)
    shard_hosts: list[str]  # per shard host: the address its shard binds
    shard_prefix: list[list[str]]  # per shard host: the command prefix that enters its namespace
    namespaces: list[str] = field(default_factory=list)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_stale_namespaces() -> list[str]:
    """Delete namespaces of earlier `bench split` runs whose process is gone (a SIGKILL skips
    cleanup); returns their names."""
    gone = []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for ns in _netns_list():
            m = re.fullmatch(rf"{NETNS_PREFIX}(\d+)s\d+", ns)
            if m and not _alive(int(m.group(1))):
                with contextlib.suppress(subprocess.SubprocessError):
                    _ip("netns", "delete", ns)
                    gone.append(ns)
    return gone


def _subnets_in_use() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True)
    nets = []
    for line in out.stdout.splitlines():
        with contextlib.suppress(ValueError, IndexError):
            word = line.split()[0]
            if word not in ("default", "broadcast", "local", "unreachable"):
                nets.append(ipaddress.ip_network(word, strict=False))
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network)]


def _make_namespaces(n: int, link_rate: str | None, made: list[str]) -> Isolation:
    pid = os.getpid()
    used = _subnets_in_use()
    dense_addrs, shard_addrs, prefixes = [], [], []
    for i in range(n):
        net = ipaddress.ip_network(_SUBNET.format(i=i))
        if any(net.overlaps(u) for u in used):
            raise OSError(f"subnet {net} is in use on this host")
        ns = f"{NETNS_PREFIX}{pid}s{i}"
        host_if, ns_if = f"fds{pid % 100000}h{i}", f"fds{pid % 100000}n{i}"
        _ip("netns", "add", ns)
        made.append(ns)
        root_ip, ns_ip = str(net.network_address + 1), str(net.network_address + 2)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", ns)
        _ip("addr", "add", f"{root_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if link_rate:
            for cmd in (["tc"], ["ip", "netns", "exec", ns, "tc"]):
                dev = host_if if len(cmd) == 1 else ns_if
                subprocess.run(
                    [*cmd, "qdisc", "add", "dev", dev, "root", "tbf", "rate", link_rate]
                    + ["burst", "256kb", "latency", "50ms"],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
        dense_addrs.append(root_ip)
        shard_addrs.append(ns_ip)
        prefixes.append(["ip", "netns", "exec", ns])
    rate = f", tbf rate {link_rate} each way" if link_rate else ", no rate limit"
    return Isolation(
        kind="netns+veth",
        description=(
            f"each shard host in its own network namespace, joined to the dense host (root namespace) "
            f"by a veth pair on a private /30{rate}; every host pinned to its CPU set"
        ),
        dense_host=dense_addrs[0],
        shard_hosts=shard_addrs,
        shard_prefix=prefixes,
        namespaces=list(made),
    )


def _loopback(n: int, reason: str) -> Isolation:
    return Isolation(
        kind="pinned loopback",
        description=(
            f"hosts share loopback (127.0.0.1), every host pinned to its CPU set; no namespaces: {reason}"
        ),
        dense_host="127.0.0.1",
        shard_hosts=["127.0.0.1"] * n,
        shard_prefix=[[] for _ in range(n)],
    )


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def isolated_hosts(shard_hosts: int, link_rate: str | None = None, netns: bool = True) -> Iterator[Isolation]:
    """Network isolation for `shard_hosts` shard hosts: namespaces + veth where permitted (as root,
    with iproute2), else pinned loopback (the Isolation says which and why). Namespaces are deleted
    on exit, on errors and on SIGINT/SIGTERM (turned into KeyboardInterrupt while inside)."""
    if link_rate is not None and not _RATE.match(link_rate):
        raise InvalidInput(f"--link-rate {link_rate!r}: expected a tc rate like 1gbit, 500mbit, 100mbps")
    made: list[str] = []
    old_term = signal.getsignal(signal.SIGTERM)
    in_main = _main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        iso: Isolation
        if not netns:
            iso = _loopback(shard_hosts, "not asked for (--isolation loopback)")
        elif os.geteuid() != 0 or shutil.which("ip") is None:
            iso = _loopback(shard_hosts, "needs root and iproute2")
        else:
            delete_stale_namespaces()
            try:
                iso = _make_namespaces(shard_hosts, link_rate, made)
            except (OSError, subprocess.SubprocessError) as e:
                _delete(made)
                made.clear()
                detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) and e.stderr else e
                iso = _loopback(shard_hosts, f"the kernel refused them ({detail})")
        yield iso
    finally:
        _delete(made)
        if in_main:
            signal.signal(signal.SIGTERM, old_term)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _delete(namespaces: list[str]) -> None:
    """Deleting a namespace deletes its end of the veth pair, and with it the root end."""
    for ns in namespaces:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _ip("netns", "delete", ns)
