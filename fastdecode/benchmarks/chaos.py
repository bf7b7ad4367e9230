"""`fastdecode bench chaos`: kill -9 fleet services under load and count what it cost.

A `fastdecode up` fleet (restart on-failure) serves a bounded load of concurrent greedy streams
while a seeded schedule kills one service at a time (a shard, gpu_dense, the scheduler), waiting
for `up` to bring each back before the next. Every request must still end with the tokens of a
fault-free run (measured first, on the same fleet); the report counts requests sent, completed,
failed and equal, the kills and how long each service took to come back, and the longest pause a
client saw between two chunks of its stream.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdecode.benchmarks.chaos_attacks import (
    grammar_crash_probe,
    huge_geometry_probe,
    pool_rebuild_probe,
    shards_down_probe,
)
from fastdecode.benchmarks.chaos_grammar import (
    big_specs_probe,
    empty_keys_probe,
    heavy_grammar_probe,
    slow_build_probe,
)
from fastdecode.benchmarks.chaos_limits import bad_words_probe
from fastdecode.benchmarks.chaos_probes import (
    _client,
    _Outcome,
    hostile_probe,
    probe_summary,
    stays_down_probe,
)
from fastdecode.benchmarks.fleet_bench import percentile, prompts_for
from fastdecode.benchmarks.transport import ensure_model
from fastdecode.tools.fleet import UpProcess, launch_up

TARGETS = ("kv_attention", "gpu_dense", "scheduler")


@dataclass
class Kill:
    service: str
    at_s: float  # since the load started
    back_after_s: float | None = None  # until `up` reported a new pid; None: not back in time


def _pid_of(state: dict[str, Any], service: str, rng: random.Random) -> tuple[str, int]:
    if service == "kv_attention":
        i = rng.randrange(len(state["kv_attention"]))
        return f"kv_attention-{i}", int(state["kv_attention"][i]["pid"])
    return service, int(state[service]["pid"])


def _killer(
    up: UpProcess, schedule: list[str], interval_s: float, seed: int, t0: float, done: threading.Event
) -> list[Kill]:
    rng = random.Random(seed)
    kills: list[Kill] = []
    for service in schedule:
        if done.wait(interval_s):
            break
        name, pid = _pid_of(up.reload(), service, rng)
        os.kill(pid, signal.SIGKILL)
        kill = Kill(name, time.monotonic() - t0)
        kills.append(kill)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < 120:
            state = up.reload()
            svc = (
                state["kv_attention"][int(name.rsplit("-", 1)[1])]
                if service == "kv_attention"
                else state[service]
            )
            if int(svc["pid"]) != pid:
                kill.back_after_s = time.monotonic() - killed_at
                break
            time.sleep(0.1)
    return kills


def run_chaos_bench(
    model: Path | None = None,
    *,
    clients: int = 6,
    requests_per_client: int = 3,
    prompt_len: int = 16,
    gen_len: int = 48,
    shards: int = 2,
    kills: int = 3,
    interval_s: float = 4.0,
    seed: int = 0,
    bound_s: float = 300.0,
    kv_capacity: int = 128 << 20,
    probes: bool = True,
    down_timeout_s: float = 3.0,
) -> dict[str, Any]:
    """Run the load twice on one fleet: fault-free (the reference), then under the kill schedule;
    with `probes`, also hostile internal calls under load and a gpu_dense that stays down
    (fastdecode.benchmarks.chaos_probes). Every probe reports the same figures (probe_summary)."""
    from fastdecode.model.config import ModelConfig

    model = model or ensure_model("llama", "tiny")
    vocab = ModelConfig.from_pretrained(model).vocab_size
    n = clients * requests_per_client
    prompts = prompts_for(n, prompt_len, vocab, seed)
    rng = random.Random(seed)
    # Every kind of service once, in a seeded order, then seeded picks.
    schedule = rng.sample(TARGETS, len(TARGETS)) + [rng.choice(TARGETS) for _ in range(max(0, kills - 3))]
    schedule = schedule[:kills]

    def load(up: UpProcess, until: threading.Event | None = None) -> dict[int, _Outcome]:
        """Every client its share of the prompts; with `until`, round after round until it is set."""
        out: dict[int, _Outcome] = {}
        per = requests_per_client
        threads = [
            threading.Thread(
                target=_client,
                args=(up.target, prompts[c * per : (c + 1) * per], gen_len, bound_s, out, c * per, until, n),
                daemon=True,
            )
            for c in range(clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(bound_s * per * (1 if until is None else 20) + 60)
        return out

    with tempfile.TemporaryDirectory(prefix="fastdecode-chaos-") as tmp:
        up = launch_up(model, Path(tmp), shards=shards, kv_capacity=kv_capacity)
        try:
            reference = load(up)
            done = threading.Event()
            t0 = time.monotonic()
            killed: list[Kill] = []
            kills_done = threading.Event()  # the load goes on, round after round, through every kill

            def kill_all() -> None:
                try:
                    killed.extend(_killer(up, schedule, interval_s, seed, t0, done))
                finally:
                    kills_done.set()

            killer = threading.Thread(target=kill_all, daemon=True)
            killer.start()
            chaos = load(up, kills_done)
            load_s = time.monotonic() - t0
            done.set()
            killer.join(150)
            restarts = {
                k: v["restarts"] for k, v in up.reload().items() if isinstance(v, dict) and "restarts" in v
            } | {f"kv_attention-{i}": s["restarts"] for i, s in enumerate(up.state["kv_attention"])}
            hostile: dict[str, Any] | None = None
            attacks: list[dict[str, Any]] = []
            if probes:
                hostile = hostile_probe(up, load, reference)
                attacks.append(grammar_crash_probe(up, load, reference, gen_len))
                attacks.append(pool_rebuild_probe(up, load, reference, gen_len))
                attacks.append(huge_geometry_probe(up, load, reference, gen_len))
                attacks.append(slow_build_probe(up, load, reference, gen_len))
                attacks.append(big_specs_probe(up))
                attacks.append(heavy_grammar_probe(up))
                attacks.append(bad_words_probe(up, load, reference, gen_len))
        finally:
            up.stop()
        stays_down: dict[str, Any] | None = None
        if probes:
            (Path(tmp) / "keys").mkdir()
            attacks.append(empty_keys_probe(model, Path(tmp) / "keys"))
            stays_down = stays_down_probe(
                model, Path(tmp) / "down", prompts, gen_len, shards, kv_capacity, down_timeout_s, clients
            )
            attacks.append(
                shards_down_probe(
                    model,
                    Path(tmp) / "shards-down",
                    prompts,
                    gen_len,
                    shards,
                    kv_capacity,
                    down_timeout_s,
                    clients,
                )
            )

    ref_tokens = {i: o.tokens for i, o in reference.items() if o.error is None}
    # A key's prompt is key % n (the load ran in rounds while the kills went on).
    equal = sum(o.error is None and o.tokens == ref_tokens.get(i % n) for i, o in chaos.items())
    errors = Counter(o.error for o in chaos.values() if o.error is not None)
    pauses = [o.longest_pause_s for o in chaos.values()]
    kill_probe = probe_summary(
        "repeated_kills", len(chaos), chaos, gen_len, kills=len(killed), tokens_equal_fault_free=equal
    )
    return {
        "probes": [p for p in (kill_probe, hostile, stays_down, *attacks) if p is not None],
        "requests_sent": len(chaos),
        "completed": sum(o.error is None for o in chaos.values()),
        "failed": sum(errors.values()) + max(0, n - len(chaos)),
        "failed_by_code": dict(errors),
        "tokens_equal_fault_free": equal,
        "reference_completed": len(ref_tokens),
        "kills": [vars(k) for k in killed],
        "restarts": restarts,
        "longest_pause_s": max(pauses, default=float("nan")),
        "median_longest_pause_s": percentile(pauses, 50),
        "load_s": load_s,
        "clients": clients,
        "gen_len": gen_len,
    }
