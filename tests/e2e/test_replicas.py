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


@pytest.fixture(scope="module")
def replicas(model_factory: Callable, tmp_path_factory: pytest.TempPathFactory) -> tuple[UpProcess, str]:
    port = free_port()
    up = launch_up(
        model_factory("llama"),
        tmp_path_factory.mktemp("replicas"),
        "--replicas",
        "2",
        "--http-port",
        str(port),
        shards=1,
        kv_capacity=64 << 20,
    )
    yield up, f"http://127.0.0.1:{port}/v1"
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
    replicas: tuple[UpProcess, str], model_factory: Callable
) -> None:
    import os
    import signal

    from openai import OpenAI

    up, base = replicas
    client = OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
    model = Path(model_factory("llama")).name
    victim = up.reload()["replicas"][0]["gateway"]["pid"]
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
