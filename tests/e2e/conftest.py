"""The end-to-end tier's fleets, started with `fastdecode up` through one factory.

`fleet_factory(model, *args)` starts a fleet the first time it is asked for one with these
arguments and hands the same one to every later test that asks alike; every fleet stops at the end
of the session. `private=True` gives a test a fleet of its own (one it stops, drains or breaks);
a private fleet stops at the end of its module at the latest, so no fleet idles to the session's end
for a file that is done with it.
`http=True` adds the OpenAI-compatible HTTP API on a free port. Two fleets are shared by name:
`fleet` (the tiny model, 2 shards, auth on, JSON logs) and `real_fleet` (SmolLM2-135M-Instruct with
the HTTP API, fp32 KV: the tests that compare with transformers).

Tests that stop and restart single services by hand (test_reliability.py, test_hostile_calls.py,
test_kv_on_demand.py) run a `fastdecode.tools.fleet.Fleet` instead: `up` would restart what they kill.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fastdecode.tools.fleet import UpProcess, free_port
from tests.support import TOKEN, FleetFactory, start_up


@pytest.fixture(scope="session")
def fleet_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetFactory]:
    shared: dict[tuple[object, ...], UpProcess] = {}
    started: list[UpProcess] = []
    private_fleets: list[UpProcess] = []

    def make(
        model: Path,
        *args: str,
        env: dict[str, str] | None = None,
        http: bool = False,
        private: bool = False,
        timeout: float = 300,
    ) -> UpProcess:
        key = (str(model), args, tuple(sorted((env or {}).items())), http)
        if not private and key in shared:
            return shared[key]
        extra = (*args, "--http-port", str(free_port())) if http else args
        up = start_up(model, tmp_path_factory.mktemp("fleet"), *extra, env=env, timeout=timeout)
        started.append(up)
        if private:
            private_fleets.append(up)
        else:
            shared[key] = up
        return up

    make.private = private_fleets  # type: ignore[attr-defined]
    yield make
    for up in started:
        up.stop()


@pytest.fixture(scope="module", autouse=True)
def _private_fleets_end_with_their_module(fleet_factory: FleetFactory) -> Iterator[None]:
    yield
    private = fleet_factory.private  # type: ignore[attr-defined]
    while private:
        private.pop().stop()  # a no-op for one its test stopped already


@pytest.fixture(scope="session")
def fleet(model_factory: Callable, fleet_factory: FleetFactory) -> UpProcess:
    return fleet_factory(
        model_factory("llama"),
        "--log-json",  # tests/e2e/test_observability.py follows one request through the JSON logs
        env={"FASTDECODE_AUTH_TOKEN": TOKEN},
        http=True,  # the OpenAI-compatible HTTP API: tests/e2e/test_openai.py
        timeout=180,
    )


@pytest.fixture(scope="session")
def real_fleet(smollm2: Path, fleet_factory: FleetFactory) -> UpProcess:
    return fleet_factory(smollm2, http=True)


E2E_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of this tier carries the `e2e` marker (`-m "not e2e"` leaves the fleets out)."""
    for item in items:
        if E2E_DIR in item.path.parents:
            item.add_marker(pytest.mark.e2e)
