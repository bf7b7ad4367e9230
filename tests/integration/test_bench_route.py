"""`fastdecode bench route` on the tiny model: two replicas behind vllm-router per policy, 2 system
prompts x 2 users through the router, then a short kill phase on the cache_aware fleet (its
gateway's kill only)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fastdecode.benchmarks.route_bench import run_route_bench, system_prompts

pytestmark = pytest.mark.timeout(240)


def test_system_prompts_reach_the_asked_length_and_differ(model_factory: Callable) -> None:
    texts, counts = system_prompts(model_factory("llama"), 3, 64, seed=0)
    assert len(set(texts)) == 3 and min(counts) >= 64
    assert system_prompts(model_factory("llama"), 3, 64, seed=0)[0] == texts  # seeded


def test_bench_route_reports_hits_per_policy_and_survives_kills(model_factory: Callable) -> None:
    result = run_route_bench(
        model_factory("llama"),
        policies=("cache_aware", "round_robin"),
        prompts=2,
        users=2,
        system_tokens=64,
        max_tokens=2,
        concurrency=2,
        load=2,
        kill_max_tokens=2,
        request_timeout=30,
        settle_s=1.0,
        gap_s=2.0,
        kill_whole=False,
        kv_capacity=64 << 20,
    )
    for policy in ("cache_aware", "round_robin"):
        run = result["policies"][policy]
        assert run["requests"] == 4 and run["succeeded"] == 4 and run["hung"] == 0, run
        assert run["later_requests"] == 2 and run["ttft_ms_p50"] is not None
    assert result["cache_aware_cached_share"] == 1.0, result["policies"]["cache_aware"]
    kill = result["kill"]
    assert kill["hung"] == 0 and kill["router_alive"], kill
    assert kill["requests_sent"] > 0 and kill["succeeded"] > 0
    for event in kill["events"]:
        assert event["restored_s"] is not None, event  # `up` restarted what was killed
        assert event["router_notice_s"] is not None, event
