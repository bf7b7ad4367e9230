"""bench chaos's probes for grammars that used to stall the fleet, at a tiny size on one real `up` fleet: the
slow-building 44-byte schema is a 400 under load with gpu_dense's RSS flat and the streams
token-equal; specs up to the 256 KiB limit never answer INTERNAL; attackers looping on a heavy
schema get 400s while a victim's requests complete. (The keys probe runs on a lone gateway:
tests/integration/test_gateway_process.py. The timings are the bench's to report.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastdecode.benchmarks.chaos_grammar import (
    big_specs_probe,
    heavy_grammar_probe,
    slow_build_probe,
)
from fastdecode.tools.fleet import launch_up
from tests.support.load import stream_load

PROMPTS = [[0, 17, 300, 45], [0, 99, 5, 1200, 77]]
GEN_LEN = 24


_load = stream_load(PROMPTS, GEN_LEN)


def test_grammar_probes_on_a_tiny_fleet(model_factory: Callable[[str], Path], tmp_path: Path) -> None:
    model = model_factory("llama")
    up = launch_up(model, tmp_path, shards=2, kv_capacity=64 << 20)
    try:
        reference = _load(up)
        assert all(o.error is None and len(o.tokens) == GEN_LEN for o in reference.values())
        slow = slow_build_probe(up, _load, reference, GEN_LEN, sends=2)
        big = big_specs_probe(up)
        heavy = heavy_grammar_probe(up, attackers=2, seconds=2.0, rounds=2)
    finally:
        up.stop()
    assert slow["slow_inputs"] == slow["slow_refused_400"] == 2, slow
    assert slow["crashed"] == 0 and slow["tokens_equal_fault_free"] == len(PROMPTS), slow
    assert slow["gpu_dense_rss_growth_mib"] < 200, slow  # the build never reached it
    assert big["internal"] == 0 and big["crashed"] == 0, big
    assert set(big["codes"].values()) <= {"OK", "INVALID_ARGUMENT"}, big
    assert heavy["crashed"] == 0 and heavy["attacker_requests"] > 0, heavy
    assert set(heavy["attacker_codes"]) <= {"OK", "INVALID_ARGUMENT"}, heavy
