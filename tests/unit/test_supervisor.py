"""The `fastdecode up` restart policy: on-failure with backoff and a budget per window, or never."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fastdecode.runtime.errors import Unavailable
from fastdecode.tools.fleet import MAX_RESTART_BACKOFF_S, Fleet
from fastdecode.tools.supervisor import RestartPolicy, Supervisor


@dataclass
class FakeProc:
    pid: int
    code: int | None = None

    def poll(self) -> int | None:
        return self.code


@dataclass
class FakeService:
    name: str
    proc: FakeProc
    address: str = "127.0.0.1:5000"
    restarts: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 30) -> str:
        return "last log line"


@dataclass
class FakeFleet:
    """Stands in for Fleet: `restart` starts a new (fake) process on the same address."""

    services: list[FakeService]
    fail_next: int = 0
    next_pid: int = 100
    restarted: list[str] = field(default_factory=list)

    def restart(self, svc: FakeService, timeout: float = 120.0) -> FakeService:
        self.restarted.append(svc.name)
        if self.fail_next:
            self.fail_next -= 1
            raise Unavailable(f"{svc.name} did not become healthy")
        self.next_pid += 1
        new = FakeService(svc.name, FakeProc(self.next_pid), svc.address, svc.restarts)
        self.services = [new if s is svc else s for s in self.services]
        return new


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _supervisor(fleet: FakeFleet, **policy: object) -> tuple[Supervisor, Clock]:
    clock = Clock()
    return Supervisor(fleet, RestartPolicy(**policy), clock=clock), clock  # type: ignore[arg-type]


def test_a_killed_service_comes_back_on_its_address_after_backoff() -> None:
    fleet = FakeFleet([FakeService("gpu_dense", FakeProc(1)), FakeService("kv_attention-0", FakeProc(2))])
    sup, clock = _supervisor(fleet, backoff=0.5)
    assert sup.poll() == []
    fleet.services[0].proc.code = -9
    events = sup.poll()
    assert [(e.service, e.kind) for e in events] == [("gpu_dense", "exited")]
    assert "code -9" in events[0].message and "last log line" in events[0].message
    assert fleet.restarted == []  # not before the backoff
    clock.now = 0.6
    (event,) = sup.poll()
    assert event.kind == "restarted" and "pid 1 -> 101" in event.message
    new = fleet.services[0]
    assert new.pid == 101 and new.address == "127.0.0.1:5000" and new.restarts == 1
    assert sup.poll() == []


def test_backoff_doubles_and_the_budget_per_window_is_kept() -> None:
    fleet = FakeFleet([FakeService("scheduler", FakeProc(1))])
    sup, clock = _supervisor(fleet, backoff=1.0, max_backoff=3.0, max_restarts=3, window=100.0)
    waits = []
    for _ in range(3):
        fleet.services[0].proc.code = 1
        sup.poll()
        start = clock.now
        while not [e for e in sup.poll() if e.kind == "restarted"]:
            clock.now += 0.25
        waits.append(clock.now - start)
    assert waits == [1.0, 2.0, 3.0]  # 1, 2, then capped at max_backoff
    assert fleet.services[0].restarts == 3
    fleet.services[0].proc.code = 1
    sup.poll()
    clock.now += 10
    (event,) = sup.poll()
    assert event.kind == "gave-up" and "3 times" in event.message
    clock.now += 1000
    assert sup.poll() == [] and len(fleet.restarted) == 3


def test_restarts_outside_the_window_do_not_count() -> None:
    fleet = FakeFleet([FakeService("gateway", FakeProc(1))])
    sup, clock = _supervisor(fleet, backoff=0.0, max_restarts=1, window=10.0)
    for _ in range(3):
        fleet.services[0].proc.code = 1
        assert [e.kind for e in sup.poll()] == ["exited", "restarted"]  # no backoff: at once
        clock.now += 11
    assert fleet.services[0].restarts == 3


def test_a_failed_restart_is_retried_and_counted() -> None:
    fleet = FakeFleet([FakeService("gpu_dense", FakeProc(1))], fail_next=1)
    sup, clock = _supervisor(fleet, backoff=0.0)
    fleet.services[0].proc.code = 1
    kinds = [e.kind for e in sup.poll()]
    assert kinds == ["exited", "restart-failed"]
    clock.now += 1
    assert [e.kind for e in sup.poll()] == ["restarted"]
    assert fleet.restarted == ["gpu_dense", "gpu_dense"]


@pytest.mark.parametrize(("mode", "code"), [("no", 1), ("on-failure", 0)])
def test_no_restart_when_the_policy_or_a_clean_exit_says_so(mode: str, code: int) -> None:
    fleet = FakeFleet([FakeService("kv_attention-1", FakeProc(1))])
    sup, clock = _supervisor(fleet, mode=mode, backoff=0.0)
    fleet.services[0].proc.code = code
    assert [e.kind for e in sup.poll()] == ["exited"]
    clock.now += 100
    assert sup.poll() == [] and fleet.restarted == []


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="on-failure"):
        RestartPolicy("always-ish")


def test_up_replaces_its_state_file_whole(tmp_path: Path) -> None:
    """`up` rewrites the state file after every restart while tests and tools poll it: the new
    content arrives by rename (a new inode), never by truncating the file readers have open."""
    from fastdecode.cli.common import write_state

    path = tmp_path / "fleet.json"
    write_state(path, {"gateway": {"pid": 1}})
    before = path.stat().st_ino
    write_state(path, {"gateway": {"pid": 2}})
    assert path.stat().st_ino != before
    assert json.loads(path.read_text()) == {"gateway": {"pid": 2}}
    assert [p.name for p in tmp_path.iterdir()] == ["fleet.json"]


def test_a_whole_fleet_killed_comes_back_dependencies_first() -> None:
    """gateway, scheduler, gpu_dense and a shard killed together (a whole replica): each restarts
    after what it calls, and none starts while one it needs is still waiting out its backoff."""
    names = ["gateway", "scheduler", "gpu_dense", "kv_attention-0", "kv_attention-1"]
    fleet = FakeFleet([FakeService(n, FakeProc(i)) for i, n in enumerate(names)])
    sup, clock = _supervisor(fleet, backoff=0.5)
    sup.poll()
    for s in fleet.services:
        s.proc.code = -9
    sup.poll()  # all exited; nothing is due yet
    assert fleet.restarted == []
    sup._due["kv_attention-1"] = 5.0  # one shard's backoff runs longer than the others'
    clock.now = 1.0
    sup.poll()
    assert fleet.restarted == ["kv_attention-0"]  # gpu_dense and the rest wait for the other shard
    clock.now = 6.0
    sup.poll()
    assert fleet.restarted == ["kv_attention-0", "kv_attention-1", "gpu_dense", "scheduler", "gateway"]


def test_the_schedulers_dense_down_bound_outlasts_a_restart_of_the_measured_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tensor-parallel gpu_dense took over 20 s to come back on a loaded host, and the paused
    requests failed mid-restart: `up` sizes the bound from gpu_dense's own start instead."""
    monkeypatch.delenv("FASTDECODE_DENSE_DOWN_TIMEOUT", raising=False)
    fleet = Fleet(Path("model"))
    assert fleet._dense_down_args({}, 2.0) == ["--dense-down-timeout", "20.0"]  # the default floor
    assert fleet._dense_down_args({}, 25.0) == ["--dense-down-timeout", f"{MAX_RESTART_BACKOFF_S + 50:.1f}"]
    assert RestartPolicy().max_backoff == MAX_RESTART_BACKOFF_S  # the backoff the bound counts on
    assert fleet._dense_down_args({"FASTDECODE_DENSE_DOWN_TIMEOUT": "3"}, 25.0) == []  # theirs wins
    monkeypatch.setenv("FASTDECODE_DENSE_DOWN_TIMEOUT", "3")
    assert fleet._dense_down_args({}, 25.0) == []
    monkeypatch.delenv("FASTDECODE_DENSE_DOWN_TIMEOUT")
    assert Fleet(Path("model"), scheduler_args=["--dense-down-timeout", "5"])._dense_down_args({}, 25.0) == []
