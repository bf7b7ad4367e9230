"""`up --replicas 2`: two fleets behind vllm-router (cache-aware), one OpenAI endpoint. Requests that
share a system prompt go where it was served and find its KV blocks cached; kill -9 of one replica's
gateway costs no request sent after the router notices."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fastdecode.tools.fleet import UpProcess, free_port, launch_up
from fastdecode.tools.replicas import ROUTER_NOTICE_S

pytestmark = pytest.mark.timeout(400)
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar".split()


def _system(i: int) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(80))  # well past a 16-token block


def _replicas(model: Path, workdir: Path, policy: str) -> tuple[UpProcess, str]:
    port = free_port()
    up = launch_up(
        model,
        workdir,
        "--replicas",
        "2",
        "--http-port",
        str(port),
        "--router-policy",
        policy,
        shards=1,
        kv_capacity=64 << 20,
    )
    return up, f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def replicas(model_factory: Callable, tmp_path_factory: pytest.TempPathFactory) -> tuple[UpProcess, str]:
    up, base = _replicas(model_factory("llama"), tmp_path_factory.mktemp("replicas"), "cache_aware")
    yield up, base
    up.stop()


@pytest.fixture
def round_robin(model_factory: Callable, tmp_path: Path) -> tuple[UpProcess, str]:
    """Its own fleets (this test kills one's gateway), round-robin: every replica gets its turn."""
    up, base = _replicas(model_factory("llama"), tmp_path, "round_robin")
    yield up, base
    up.stop()


def test_the_router_sends_a_shared_prompt_where_it_is_cached(
    replicas: tuple[UpProcess, str], model_factory: Callable
) -> None:
    from openai import OpenAI

    up, base = replicas
    assert up.state["router"]["alive"] and len(up.state["replicas"]) == 2
    client = OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
    model = Path(model_factory("llama")).name
    order = [(p, u) for p in range(4) for u in range(3)]
    random.Random(7).shuffle(order)
    seen: set[int] = set()
    later, hits = 0, 0
    for p, u in order:
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": _system(p)}, {"role": "user", "content": f"user {u}"}],
            max_tokens=4,
        )
        cached = out.usage.prompt_tokens_details.cached_tokens if out.usage.prompt_tokens_details else 0
        if p in seen:
            later += 1
            hits += cached > 0
        seen.add(p)
    assert later == 8 and hits / later >= 0.9, (hits, later)


def test_a_killed_replica_gateway_costs_no_request_sent_after_the_router_notices(
    round_robin: tuple[UpProcess, str], model_factory: Callable
) -> None:
    import os
    import signal

    from openai import OpenAI

    up, base = round_robin
    client = OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
    model = Path(model_factory("llama")).name
    victim = up.reload()["replicas"][0]["gateway"]["pid"]
    http = up.state["replicas"][0]["gateway"]["http"]
    os.kill(int(victim), signal.SIGKILL)
    time.sleep(ROUTER_NOTICE_S)  # the router has noticed (or `up` has restarted the gateway)
    for i in range(10):
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=4
        )
        assert out.choices[0].finish_reason in ("length", "stop")
    deadline = time.monotonic() + 60
    while int(up.reload()["replicas"][0]["gateway"]["pid"]) == int(victim) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert int(up.state["replicas"][0]["gateway"]["pid"]) != int(victim)  # `up` restarted it
    # on the HTTP port the router knows it by, handed to the router afresh: it is routed to again
    assert up.state["replicas"][0]["gateway"]["http"] == http
    # `up` records the new pid when it spawns the gateway; on a loaded host it answers seconds later,
    # and the router takes it back at its next probe after that
    _wait_healthy(f"http://{http}/health", time.monotonic() + 60)
    time.sleep(ROUTER_NOTICE_S)
    served = _served_by_each(up, client, model, 12)
    assert all(k > 0 for k in served), served


def _wait_healthy(url: str, deadline: float) -> None:
    import urllib.error
    import urllib.request

    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() < deadline, f"{url} did not answer"
        time.sleep(0.25)


def _served_by_each(up: UpProcess, client: object, model: str, n: int) -> list[int]:
    """Requests each replica's gateway served of n sent through the router (its request counter)."""
    import re
    import urllib.request

    def counts() -> list[float]:
        out = []
        for r in up.reload()["replicas"]:
            url = f"http://{r['gateway']['metrics']}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            found = re.findall(r"^fastdecode_gateway_requests_total\{[^}]*\} (\S+)$", text, re.M)
            out.append(sum(map(float, found)))
        return out

    before = counts()
    for i in range(n):
        client.chat.completions.create(  # type: ignore[attr-defined]
            model=model, messages=[{"role": "user", "content": f"spread {i}"}], max_tokens=2
        )
    return [int(a - b) for a, b in zip(counts(), before, strict=True)]
