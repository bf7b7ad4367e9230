"""`bench chaos` probes for what used to take the fleet down (beside chaos_probes.py's):

- grammar_crash: while the load runs, structured outputs that crashed llguidance on the gateway's
  event loop (a 1,000-long `$ref` chain, 3,000 chained Lark rules) are sent in turn; each must be a
  400 (INVALID_ARGUMENT), no service may die, and the load must end with the fault-free tokens.
- pool_rebuild: after prefix hits, every idle shard gets a Reserve of a bogus geometry and its
  Release, with the fleet secret (the pool is rebuilt, its counters restart at 0), then the load
  runs again: no call may answer INTERNAL and every request must complete.
- shards_stay_down: a fleet that restarts nothing loses every shard; every request must end within
  the scheduler's shards_down_timeout (plus slack) with UNAVAILABLE naming the shards.
- huge_geometry: under load, every shard gets Reserves of the geometry (2^31-1)^3 with the fleet
  secret; each must be RESOURCE_EXHAUSTED at once, with the shard's RSS flat.

Each reports probe_summary's figures (completed, failed_clear, hung, lost) and `crashed`: services
whose process died or was restarted during the probe.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from fastdecode.benchmarks.chaos_probes import _client, _Outcome, probe_summary
from fastdecode.benchmarks.common import proc_status_bytes
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import UpProcess, launch_up, state_credentials
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from fastdecode.wire.kv_control import geometry_to_proto


def ref_chain(n: int = 1000) -> dict[str, Any]:
    """A JSON schema whose `$defs` chain n `$ref`s, each through an object's property (75 KB at 1,000)."""
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int = 3000) -> str:
    """A Lark grammar of n chained rules (90 KB at 3,000)."""
    return "\n".join(
        ["start: rule_0", *(f'rule_{i}: rule_{i + 1} "a" | "b"' for i in range(n)), f'rule_{n}: "c"']
    )


def _processes(state: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(pid, restarts) of every service in an `up` state."""
    out = {
        name: (int(state[name]["pid"]), int(state[name].get("restarts", 0)))
        for name in ("gateway", "scheduler", "gpu_dense")
    }
    for i, k in enumerate(state["kv_attention"]):
        out[f"kv_attention-{i}"] = (int(k["pid"]), int(k.get("restarts", 0)))
    return out


def _crashed(before: dict[str, tuple[int, int]], up: UpProcess) -> int:
    after = _processes(up.reload())
    return sum(after.get(name) != was for name, was in before.items())


def _equal(out: dict[int, _Outcome], reference: dict[int, _Outcome]) -> int:
    ref = {i: o.tokens for i, o in reference.items() if o.error is None}
    return sum(o.error is None and o.tokens == ref.get(i) for i, o in out.items())


def grammar_crash_probe(
    up: UpProcess,
    load: Callable[[UpProcess], dict[int, _Outcome]],
    reference: dict[int, _Outcome],
    gen_len: int,
    sends: int = 20,
) -> dict[str, Any]:
    from fastdecode.client import Client, FastDecodeError

    before = _processes(up.reload())
    codes: list[str] = []
    seconds: list[float] = []
    specs = [{"json_schema": json.dumps(ref_chain())}, {"grammar": lark_chain()}]

    def attack() -> None:
        time.sleep(0.3)  # mid-decode
        with Client(up.target, timeout=60, max_retries=0) as client:
            for i in range(sends):
                t0 = time.monotonic()
                try:
                    client.generate(token_ids=[0, 5], max_tokens=4, structured=specs[i % 2])
                    codes.append("OK")
                except FastDecodeError as e:
                    codes.append(e.code.name)
                seconds.append(time.monotonic() - t0)

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    out = load(up)
    attacker.join(sends * 60 + 30)
    return probe_summary(
        "grammar_crash",
        len(reference),
        out,
        gen_len,
        crashed=_crashed(before, up),
        crash_inputs=len(codes),
        crash_inputs_refused_400=sum(c == "INVALID_ARGUMENT" for c in codes),
        crash_input_median_s=statistics.median(seconds) if seconds else float("nan"),
        crash_input_max_s=max(seconds, default=float("nan")),
        tokens_equal_fault_free=_equal(out, reference),
    )


def pool_rebuild_probe(
    up: UpProcess,
    load: Callable[[UpProcess], dict[int, _Outcome]],
    reference: dict[int, _Outcome],
    gen_len: int,
) -> dict[str, Any]:
    from fastdecode.client import Client

    state = up.reload()
    before = _processes(state)
    shared = [0, *range(100, 148)]  # three full blocks, served from the cache after the first
    with Client(up.target, timeout=120) as client:
        for _ in range(3):
            client.generate(token_ids=shared, max_tokens=2)
    creds = state_credentials(state)
    bogus = kv_pb.ReserveRequest(
        geometry=geometry_to_proto(KVGeometry(1, 1, 2)),
        sequences=[kv_pb.SequenceReservation(seq_id="chaos-rebuild", max_tokens=16)],
    )
    codes: list[str] = []
    for k in state["kv_attention"]:
        with sync_channel(k["address"], creds) as ch:
            stub = kv_grpc.KVAttentionStub(ch)
            release = kv_pb.ReleaseRequest(seq_ids=["chaos-rebuild"])
            for method, request in ((stub.Reserve, bogus), (stub.Release, release)):
                try:
                    method(request, timeout=10)
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(e.code().name)
    out = load(up)  # prompts unlike the shared one: new blocks on rebuilt pools
    return probe_summary(
        "pool_rebuild",
        len(reference),
        out,
        gen_len,
        crashed=_crashed(before, up),
        rebuild_calls=len(codes),
        rebuild_internal=sum(c == "INTERNAL" for c in codes),
        tokens_equal_fault_free=_equal(out, reference),
    )


def shards_down_probe(
    model: Path,
    workdir: Path,
    prompts: list[list[int]],
    gen_len: int,
    shards: int,
    kv_capacity: int,
    down_timeout_s: float,
    clients: int,
    client_bound_s: float = 120.0,
) -> dict[str, Any]:
    """Every shard killed in a fleet that restarts nothing: requests already running and new ones."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"FASTDECODE_SHARDS_DOWN_TIMEOUT": str(down_timeout_s)}  # the scheduler's setting, via `up`
    up = launch_up(model, workdir, "--restart", "no", shards=shards, kv_capacity=kv_capacity, env=env)
    try:
        before = _processes(up.reload())
        out: dict[int, _Outcome] = {}
        per = max(1, len(prompts) // clients)
        threads = [
            threading.Thread(
                target=_client,
                args=(up.target, prompts[c * per : (c + 1) * per], gen_len, client_bound_s, out, c * per),
                daemon=True,
            )
            for c in range(clients)
        ]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the first requests are decoding
        for k in up.state["kv_attention"]:
            os.kill(int(k["pid"]), signal.SIGKILL)
        for t in threads:
            t.join(client_bound_s * per + 30)
        sent = per * clients
        naming = sum(o.error == "UNAVAILABLE" and "kv_attention shard" in o.details for o in out.values())
        # the shards were killed on purpose: crashed counts the services that were not
        after = _processes(up.reload())
        crashed = sum(after.get(n) != was for n, was in before.items() if not n.startswith("kv_attention"))
    finally:
        up.stop()
    return probe_summary(
        "shards_stay_down",
        sent,
        out,
        bound_s=down_timeout_s,
        crashed=crashed,
        unavailable_naming_shards=naming,
    )


def _rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS), 0 when it is gone."""
    return proc_status_bytes(pid) or 0


def huge_geometry_probe(
    up: UpProcess,
    load: Callable[[UpProcess], dict[int, _Outcome]],
    reference: dict[int, _Outcome],
    gen_len: int,
    sends: int = 3,
) -> dict[str, Any]:
    """While the load runs, every shard gets `sends` Reserves of the geometry (2^31-1)^3 with the
    fleet secret (one used to allocate 23 GB until the OOM killer came): each must be
    RESOURCE_EXHAUSTED at once with the shard's RSS flat, and the load must end with the fault-free
    tokens. Reports the answers' codes and times and each shard's RSS before and after."""
    state = up.reload()
    before = _processes(state)
    creds = state_credentials(state)
    top = (1 << 31) - 1
    huge = kv_pb.ReserveRequest(
        geometry=geometry_to_proto(KVGeometry(top, top, top)),
        sequences=[kv_pb.SequenceReservation(seq_id="chaos-huge-geometry", max_tokens=16)],
    )
    shards = [(k["address"], int(k["pid"])) for k in state["kv_attention"]]
    rss_before = [_rss_bytes(pid) for _, pid in shards]
    codes: list[str] = []
    seconds: list[float] = []
    grown: list[int] = []  # RSS growth across one call
    answered: list[float] = []  # when each answer came (time.monotonic())

    def attack() -> None:
        time.sleep(0.3)  # mid-decode
        for _ in range(sends):
            for address, pid in shards:
                with sync_channel(address, creds) as ch:
                    stub = kv_grpc.KVAttentionStub(ch)
                    rss, t0 = _rss_bytes(pid), time.monotonic()
                    try:
                        stub.Reserve(huge, timeout=60)
                        codes.append("OK")
                        stub.Release(kv_pb.ReleaseRequest(seq_ids=["chaos-huge-geometry"]), timeout=10)
                    except grpc.RpcError as e:
                        codes.append(e.code().name)
                    answered.append(time.monotonic())
                    seconds.append(answered[-1] - t0)
                    grown.append(_rss_bytes(pid) - rss)

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    out = load(up)
    load_end = time.monotonic()
    attacker.join(sends * len(shards) * 70 + 30)
    mib = 1 << 20
    return probe_summary(
        "huge_geometry",
        len(reference),
        out,
        gen_len,
        crashed=_crashed(before, up),
        huge_reserves=len(codes),
        huge_answered_under_load=sum(t < load_end for t in answered),
        huge_refused_resource_exhausted=sum(c == "RESOURCE_EXHAUSTED" for c in codes),
        huge_accepted=sum(c == "OK" for c in codes),
        huge_answer_median_s=statistics.median(seconds) if seconds else float("nan"),
        huge_answer_max_s=max(seconds, default=float("nan")),
        shard_rss_before_mib=[round(b / mib, 1) for b in rss_before],
        shard_rss_after_mib=[round(_rss_bytes(pid) / mib, 1) for _, pid in shards],
        shard_rss_growth_per_call_max_mib=round(max(grown, default=0) / mib, 1),
        tokens_equal_fault_free=_equal(out, reference),
    )
