"""The probes of `fastdecode bench chaos` beyond kill -9 under load (fastdecode.benchmarks.chaos):

- hostile_internal_calls: while the load runs, a caller without the fleet secret sends Submit around
  the gateway, Release of every sequence, a Reserve of a bogus geometry and garbage bytes to every
  method each internal service reflects; every one must be refused and the load must end with the
  tokens of the fault-free run.
- gpu_dense_stays_down: a fleet that does not restart its services loses gpu_dense; every request
  must end within the scheduler's dense_down_timeout (plus slack) with UNAVAILABLE naming gpu_dense.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import UpProcess, launch_up
from fastdecode.v1 import kv_attention_pb2 as kv_pb
from fastdecode.v1 import kv_attention_pb2_grpc as kv_grpc
from fastdecode.v1 import scheduler_pb2, scheduler_pb2_grpc
from fastdecode.wire.kv_control import geometry_to_proto


@dataclass
class _Outcome:
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    details: str = ""
    longest_pause_s: float = 0.0  # the longest wait for a chunk, the first one included
    ended: bool = False  # the client got its answer (tokens to the end, or a status)
    answer_s: float = 0.0  # from sending to the answer


# A status that says what happened; the client's own deadline passing (or no status) does not.
UNCLEAR = ("DEADLINE_EXCEEDED", "UNKNOWN")


def probe_summary(
    name: str, sent: int, outcomes: dict[int, _Outcome], expected_tokens: int | None = None, **extra: Any
) -> dict[str, Any]:
    """One probe's figures: of `sent` requests, those completed, failed with a clear status, hung
    (ended by the client's deadline, or never), and lost (no trace of them at all)."""
    ended = [o for o in outcomes.values() if o.ended]
    whole = [
        o for o in ended if o.error is None and (expected_tokens is None or len(o.tokens) == expected_tokens)
    ]
    return {
        "name": name,
        "requests": sent,
        "completed": len(whole),
        "failed_clear": sum(o.error is not None and o.error not in UNCLEAR for o in ended),
        "hung": sum(o.error in UNCLEAR for o in ended) + sum(not o.ended for o in outcomes.values()),
        # no trace of it, or an answer that ended "well" short of its tokens (ignore_eos streams)
        "lost": sent - len(outcomes) + sum(o.error is None for o in ended) - len(whole),
        "max_answer_s": max((o.answer_s for o in ended), default=0.0),
        **extra,
    }


def _client(
    target: str,
    prompts: list[list[int]],
    gen_len: int,
    bound_s: float,
    out: dict[int, _Outcome],
    first: int,
    until: threading.Event | None = None,
    total: int = 0,
) -> None:
    """Stream `prompts` in turn; with `until`, round after round until it is set (request keys
    round * total + first + offset, so key % total names the prompt)."""
    from fastdecode.client import Client, FastDecodeError

    with Client(target, timeout=bound_s) as client:
        for round_ in itertools.count():
            for offset, prompt in enumerate(prompts):
                outcome = out[round_ * total + first + offset] = _Outcome()
                start = last = time.monotonic()
                try:
                    for chunk in client.stream(token_ids=prompt, max_tokens=gen_len, ignore_eos=True):
                        now = time.monotonic()
                        outcome.longest_pause_s = max(outcome.longest_pause_s, now - last)
                        last = now
                        outcome.tokens += chunk.token_ids
                except FastDecodeError as e:
                    outcome.error, outcome.details = e.code.name, e.details or ""
                outcome.ended, outcome.answer_s = True, time.monotonic() - start
            if until is None or until.is_set():
                return


OPEN = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")
GARBAGE = b"\xff\xff\xff\xff"


def internal_methods(channel: grpc.Channel) -> Iterator[tuple[str, bool, bool]]:
    """(path, client_streaming, server_streaming) of every method the server reflects, open ones aside."""
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    db = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(db)
    for name in db.get_services():
        if name not in OPEN:
            for m in pool.FindServiceByName(name).methods:
                yield f"/{name}/{m.name}", m.client_streaming, m.server_streaming


def _code(call: Callable[[], Any]) -> str:
    try:
        call()
    except grpc.RpcError as e:
        return e.code().name  # type: ignore[no-any-return]
    return "OK"


def _raw(channel: grpc.Channel, path: str, cs: bool, ss: bool) -> Callable[[], Any]:
    method = getattr(channel, f"{'stream' if cs else 'unary'}_{'stream' if ss else 'unary'}")(path)

    def call() -> Any:
        out = method(iter([GARBAGE]) if cs else GARBAGE, timeout=10)
        return list(out) if ss else out

    return call


def hostile_calls(state: dict[str, Any]) -> list[str]:
    """Every hostile call once, without the fleet secret; the status codes they got."""
    codes = []
    sched = state["scheduler"]["address"]
    with sync_channel(sched) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        codes.append(
            _code(lambda: list(stub.Submit(scheduler_pb2.SubmitRequest(prompt_token_ids=[0, 1]), timeout=10)))
        )
    bogus = kv_pb.ReserveRequest(
        geometry=geometry_to_proto(KVGeometry(1, 1, 2)),
        sequences=[kv_pb.SequenceReservation(seq_id="intruder", max_tokens=16)],
    )
    for k in state["kv_attention"]:
        with sync_channel(k["address"]) as ch:
            stub = kv_grpc.KVAttentionStub(ch)
            codes.append(_code(functools.partial(stub.Release, kv_pb.ReleaseRequest(all=True), timeout=10)))
            codes.append(_code(functools.partial(stub.Reserve, bogus, timeout=10)))
    for svc in [state["scheduler"], state["gpu_dense"], *state["kv_attention"]]:
        with sync_channel(svc["address"]) as ch:
            for path, cs, ss in internal_methods(ch):
                codes.append(_code(_raw(ch, path, cs, ss)))
    return codes


def hostile_probe(
    up: UpProcess, load: Callable[[UpProcess], dict[int, _Outcome]], reference: dict[int, _Outcome]
) -> dict[str, Any]:
    """The load again, with the hostile calls sent (in a loop) while it runs."""
    codes: list[str] = []
    done = threading.Event()

    def attack() -> None:
        time.sleep(0.3)  # mid-decode
        while not done.is_set():
            codes.extend(hostile_calls(up.reload()))
            done.wait(0.5)

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    out = load(up)
    done.set()
    attacker.join(60)
    ref = {i: o.tokens for i, o in reference.items() if o.error is None}
    return probe_summary(
        "hostile_internal_calls",
        len(reference),
        out,
        len(next(iter(ref.values()), [])) or None,
        hostile_calls=len(codes),
        hostile_refused=sum(c == "UNAUTHENTICATED" for c in codes),
        tokens_equal_fault_free=sum(o.error is None and o.tokens == ref.get(i) for i, o in out.items()),
    )


def stays_down_probe(
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
    """gpu_dense killed in a fleet that restarts nothing: requests already running and new ones."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"FASTDECODE_DENSE_DOWN_TIMEOUT": str(down_timeout_s)}  # the scheduler's setting, via `up`
    up = launch_up(model, workdir, "--restart", "no", shards=shards, kv_capacity=kv_capacity, env=env)
    try:
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
        os.kill(int(up.state["gpu_dense"]["pid"]), signal.SIGKILL)
        for t in threads:
            t.join(client_bound_s * per + 30)
        sent = per * clients
        naming = sum(o.error == "UNAVAILABLE" and "gpu_dense" in o.details for o in out.values())
    finally:
        up.stop()
    return probe_summary(
        "gpu_dense_stays_down", sent, out, bound_s=down_timeout_s, unavailable_naming_gpu_dense=naming
    )
