"""The supervisor of a started fleet (`fastdecode up`): a service that exits unexpectedly is
restarted on its address per a restart policy, and what happened is reported to the caller."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastdecode.runtime.errors import Unavailable
from fastdecode.tools.fleet import MAX_RESTART_BACKOFF_S, Fleet

RESTART_POLICIES = ("on-failure", "no")


@dataclass
class RestartPolicy:
    """Restart a service that exits unexpectedly, like compose's `restart: on-failure` or a kubelet:
    on the same address (its peers keep dialling it), with exponential backoff, at most
    `max_restarts` times in any `window` seconds; past that the service stays down and is reported."""

    mode: str = "on-failure"
    max_restarts: int = 5
    window: float = 300.0
    backoff: float = 0.5
    max_backoff: float = MAX_RESTART_BACKOFF_S

    def __post_init__(self) -> None:
        if self.mode not in RESTART_POLICIES:
            raise ValueError(
                f"restart policy must be one of {', '.join(RESTART_POLICIES)}, got {self.mode!r}"
            )


@dataclass
class SupervisorEvent:
    service: str
    kind: str  # "exited", "restarted", "restart-failed", "gave-up"
    message: str


@dataclass
class Supervisor:
    """Watches a started Fleet; `poll()` (called every fraction of a second by `fastdecode up`) restarts
    what died per the policy and returns what happened, for the caller to print and record."""

    fleet: Fleet
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    clock: Callable[[], float] = time.monotonic
    _history: dict[str, list[float]] = field(default_factory=dict)  # restart attempt times per service
    _due: dict[str, float] = field(default_factory=dict)  # service -> when its next restart may run
    _given_up: set[str] = field(default_factory=set)

    def poll(self, ready_timeout: float = 120.0) -> list[SupervisorEvent]:
        events: list[SupervisorEvent] = []
        # Dependencies first (shards, gpu_dense, scheduler, gateway: Fleet.services reversed): a
        # service becomes ready only once what it calls serves, so when several died together (a
        # whole replica) each is restarted after what it needs. While one that others need is down
        # and not yet due, they wait for it instead of waiting out their ready timeout.
        waiting = False
        for svc in reversed(self.fleet.services):
            code = svc.proc.poll()
            if code is None or svc.name in self._given_up:
                continue
            if svc.name not in self._due:
                events.append(
                    SupervisorEvent(
                        svc.name, "exited", f"{svc.name} exited with code {code}:\n{svc.log_tail(10)}"
                    )
                )
                if self.policy.mode == "no" or code == 0:
                    # on-failure: a clean exit (code 0) was asked for by someone; leave it down.
                    self._given_up.add(svc.name)
                    continue
                self._due[svc.name] = self.clock() + self._backoff(svc.name)
            needs_others = not svc.name.startswith("kv_attention")  # shards need nothing of the fleet
            if self.clock() < self._due[svc.name] or (waiting and needs_others):
                waiting = True
                continue
            now = self.clock()
            recent = [t for t in self._history.get(svc.name, []) if now - t < self.policy.window]
            if len(recent) >= self.policy.max_restarts:
                self._given_up.add(svc.name)
                self._due.pop(svc.name)
                events.append(
                    SupervisorEvent(
                        svc.name,
                        "gave-up",
                        # It died once more than it was restarted: say what was counted.
                        f"{svc.name} was restarted {len(recent)} times in {self.policy.window:.0f}s and "
                        f"died again (exit code {code}); not restarting it",
                    )
                )
                continue
            self._history[svc.name] = [*recent, now]
            try:
                new = self.fleet.restart(svc, timeout=ready_timeout)
            except Unavailable as e:
                # Try again after a longer backoff; the failed attempt counts against the budget.
                self._due[svc.name] = self.clock() + self._backoff(svc.name)
                waiting = True
                events.append(
                    SupervisorEvent(svc.name, "restart-failed", f"restarting {svc.name} failed: {e}")
                )
                continue
            self._due.pop(svc.name)
            new.restarts = svc.restarts + 1
            events.append(
                SupervisorEvent(
                    svc.name,
                    "restarted",
                    f"restarted {svc.name} on {new.address} "
                    f"(pid {svc.pid} -> {new.pid}, restart {new.restarts})",
                )
            )
        return events

    def _backoff(self, name: str) -> float:
        n = len(self._history.get(name, []))
        return min(self.policy.max_backoff, self.policy.backoff * 2**n)
