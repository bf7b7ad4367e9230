"""gpu_dense + 2 kv_attention shards as separate processes on loopback, driven with step plans; gpu_dense
with its Attend streams in process and in an exchange worker (--exchange-workers 1)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastdecode.contract import PlannedSeq, SamplingParams
from fastdecode.dense.engine import LocalEngine
from fastdecode.model import ModelConfig
from fastdecode.runtime import codec
from fastdecode.runtime.errors import InvalidInput, Unavailable
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import ServiceProcess, start_service, stop_processes
from fastdecode.v1 import dense_pb2, dense_pb2_grpc, kv_attention_pb2, kv_attention_pb2_grpc, tensor_pb2
from fastdecode.wire import dense as dense_wire
from tests.support import PROMPTS, metric_total, scrape

MAX_NEW = 24


class DataPlane:
    def __init__(self, model: Path, workdir: Path, workers: int = 0) -> None:
        self.model = model
        self.config = ModelConfig.from_pretrained(model)
        self.procs: list[ServiceProcess] = []
        for i in range(2):
            self.procs.append(
                start_service(
                    f"kv{i}",
                    ["kv-attention", "--shard-id", str(i), "--kv-capacity", str(64 << 20)],
                    workdir,
                    metrics=True,
                )
            )
        self.shard_addrs = [p.address for p in self.procs]
        self.dense_proc = start_service(
            "dense",
            [
                "gpu-dense",
                "--model",
                str(model),
                "--shards",
                ",".join(self.shard_addrs),
                "--device",
                "cpu",
                "--exchange-workers",
                str(workers),
            ],
            workdir,
        )
        self.procs.append(self.dense_proc)
        self.dense = dense_pb2_grpc.DenseStub(sync_channel(self.dense_proc.address))
        self.shards = [kv_attention_pb2_grpc.KVAttentionStub(sync_channel(a)) for a in self.shard_addrs]
        self._n = 0

    @property
    def geometry(self) -> kv_attention_pb2.KVGeometry:
        c = self.config
        return kv_attention_pb2.KVGeometry(
            num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim
        )

    def reserve(self, shard: int, seq_id: str, tokens: int) -> None:
        self.shards[shard].Reserve(
            kv_attention_pb2.ReserveRequest(
                geometry=self.geometry,
                sequences=[kv_attention_pb2.SequenceReservation(seq_id=seq_id, max_tokens=tokens)],
            ),
            timeout=10,
        )

    def greedy(
        self,
        prompts: list[list[int]],
        max_new: int = MAX_NEW,
        chunk: int = 5,
        pipeline: bool = True,
        on_step: Callable[[dense_pb2.StepResult], None] | None = None,
    ) -> list[list[int]]:
        """Drive gpu_dense like the scheduler would: chunked prefill, then decode, ignoring EOS."""
        self._n += 1
        ids = [f"t{self._n}-{i}" for i in range(len(prompts))]
        for i, (sid, p) in enumerate(zip(ids, prompts, strict=True)):
            self.reserve(i % 2, sid, len(p) + max_new)
        done = [0] * len(prompts)
        out: list[list[int]] = [[] for _ in prompts]

        def plans() -> Iterator[dense_pb2.StepPlan]:
            step = 0
            while True:
                seqs = []
                for i, (sid, p) in enumerate(zip(ids, prompts, strict=True)):
                    if len(out[i]) >= max_new:
                        continue
                    if done[i] < len(p):
                        toks, start = p[done[i] : done[i] + chunk], done[i]
                        done[i] += len(toks)
                    else:
                        toks, start = [out[i][-1]], len(p) + len(out[i]) - 1
                    mb, last = i % 2 if pipeline else 0, done[i] == len(p)
                    n = len(out[i])
                    seqs.append(PlannedSeq(sid, i % 2, mb, toks, start, sample=last, sample_index=n))
                if not seqs:
                    return
                yield dense_wire.plan_to_proto(step, seqs, pipeline)
                step += 1
                result = results.get()
                if on_step:
                    on_step(result)
                outcome = dense_wire.step_outcome_from_proto(result)
                assert outcome.error is None, outcome.error
                for r in outcome.rows():
                    assert r.error is None, r.error
                    if r.token_id >= 0:
                        out[ids.index(r.seq_id)].append(r.token_id)

        import queue

        results: queue.Queue[dense_pb2.StepResult] = queue.Queue()
        for res in self.dense.Run(plans(), timeout=120):
            results.put(res)
        for sid, i in zip(ids, range(len(ids)), strict=True):
            self.shards[i % 2].Release(kv_attention_pb2.ReleaseRequest(seq_ids=[sid]), timeout=10)
        return out

    def close(self) -> None:
        stop_processes(self.procs, grace=5)


@pytest.fixture(
    scope="module", params=[("llama", 0), ("mistral", 0), ("llama", 1)], ids=lambda p: f"{p[0]}-K{p[1]}"
)
def plane(request: pytest.FixtureRequest, model_factory: Callable, tmp_path_factory: pytest.TempPathFactory):
    arch, workers = request.param
    dp = DataPlane(model_factory(arch), tmp_path_factory.mktemp(f"plane-{arch}-{workers}"), workers)
    yield dp
    dp.close()


def test_greedy_equals_local_engine_and_transformers(plane: DataPlane, hf_greedy: Callable) -> None:
    fleet = plane.greedy(PROMPTS)
    local = LocalEngine.from_pretrained(plane.model).generate(PROMPTS, MAX_NEW, ignore_eos=True)
    assert fleet == [g.token_ids for g in local]
    for prompt, toks in zip(PROMPTS, fleet, strict=True):
        ref = hf_greedy(plane.model, tuple(prompt), MAX_NEW)
        assert toks[: len(ref)] == ref  # transformers stops at EOS; we ignored it


def test_sequences_land_on_both_shards_and_are_released(plane: DataPlane) -> None:
    seen: list[tuple[int, int]] = []

    def probe(_: dense_pb2.StepResult) -> None:
        seen.append(
            tuple(s.Stats(kv_attention_pb2.StatsRequest(), timeout=5).sequences for s in plane.shards)
        )

    plane.greedy(PROMPTS, max_new=4, on_step=probe)
    assert any(a > 0 and b > 0 for a, b in seen)
    after = [s.Stats(kv_attention_pb2.StatsRequest(), timeout=5) for s in plane.shards]
    assert [a.sequences for a in after] == [0, 0] and [a.tokens_held for a in after] == [0, 0]


def test_shard_kv_gauges_follow_every_step(plane: DataPlane) -> None:
    """The shard's kv_tokens_held gauge after each step equals its Stats and the tokens the plan fed it,
    while gpu_dense's Attend streams stay open (the gauge used to move only on Reserve/Release)."""
    max_new, chunk = 6, 5
    seen: list[tuple[list[float], list[int]]] = []

    def probe(_: dense_pb2.StepResult) -> None:
        gauges = [
            metric_total(scrape(p.metrics), "fastdecode_kv_tokens_held", shard=str(i))
            for i, p in enumerate(plane.procs[:2])
        ]
        held = [s.Stats(kv_attention_pb2.StatsRequest(), timeout=5).tokens_held for s in plane.shards]
        seen.append((gauges, held))

    plane.greedy(PROMPTS, max_new=max_new, chunk=chunk, on_step=probe)

    def fed(prompt: list[int], step: int) -> int:  # tokens of `prompt` in the KV after `step` steps
        prefill = -(-len(prompt) // chunk)
        if step <= prefill:
            return min(len(prompt), chunk * step)
        return min(len(prompt) + step - prefill, len(prompt) + max_new - 1)

    assert len(seen) > 3
    for step, (gauges, held) in enumerate(seen, start=1):
        want = [sum(fed(p, step) for i, p in enumerate(PROMPTS) if i % 2 == shard) for shard in (0, 1)]
        assert gauges == held == want, f"step {step}: gauges {gauges}, Stats {held}, fed {want}"


def test_pipeline_on_and_off_give_identical_tokens(plane: DataPlane) -> None:
    timings: list[dense_pb2.StepTimings] = []
    on = plane.greedy(PROMPTS, max_new=10, pipeline=True, on_step=lambda r: timings.append(r.timings))
    off = plane.greedy(PROMPTS, max_new=10, pipeline=False)
    assert on == off
    t = timings[-1]
    assert t.step_seconds > 0 and t.s_part_seconds > 0
    assert t.s_part_seconds + t.shard_wait_seconds == pytest.approx(t.step_seconds, rel=1e-6)
    assert t.attend_seconds > 0 and 0 <= t.overlap_ratio <= 1


def test_kv_exhaustion_is_resource_exhausted_and_shard_stays_healthy(plane: DataPlane) -> None:
    with pytest.raises(grpc.RpcError) as info:
        plane.reserve(0, "huge", 10**9)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    health = health_pb2_grpc.HealthStub(sync_channel(plane.shard_addrs[0]))
    assert (
        health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    assert plane.greedy(PROMPTS[:1], max_new=2)  # still serves


def test_malformed_attend_items_get_in_band_errors(plane: DataPlane) -> None:
    c = plane.config
    plane.reserve(0, "bad", 8)
    q = torch.randn(1, c.num_attention_heads, c.head_dim)
    kv = torch.randn(1, c.num_key_value_heads, c.head_dim)

    def item(**over: tensor_pb2.Tensor) -> kv_attention_pb2.AttendRequest:
        req = kv_attention_pb2.AttendRequest(layer=0, seq_ids=["bad"], num_tokens=[1], start_pos=[0])
        req.q.CopyFrom(over.get("q", codec.encode(q)))
        req.k.CopyFrom(over.get("k", codec.encode(kv)))
        req.v.CopyFrom(over.get("v", codec.encode(kv)))
        return req

    short = codec.encode(q)
    short.data = short.data[:-4]
    wrong_heads = codec.encode(torch.randn(1, c.num_key_value_heads + 1, c.head_dim))
    unknown = item()
    unknown.seq_ids[:] = ["nobody"]
    items = [item(q=short), item(q=codec.encode(q.long())), item(k=wrong_heads), unknown, item()]
    for i, it in enumerate(items):
        it.request_id = i
    replies = list(plane.shards[0].Attend(iter(items), timeout=30))
    codes = [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 3 + [grpc.StatusCode.NOT_FOUND.value[0], 0]
    assert [r.error.code for r in replies] == codes
    assert "needs" in replies[0].error.message and "floating point" in replies[1].error.message
    assert list(codec.decode(replies[-1].o).shape) == [
        1,
        c.num_attention_heads * c.head_dim,
    ]  # stream went on
    plane.shards[0].Release(kv_attention_pb2.ReleaseRequest(seq_ids=["bad"]), timeout=5)


def test_bad_plan_items_fail_alone(plane: DataPlane) -> None:
    plane.reserve(0, "ok", 8)
    plan = dense_wire.plan_to_proto(
        0,
        [
            PlannedSeq("ok", 0, 0, [1, 2], 0),
            PlannedSeq("v", 0, 0, [10**9], 0),
            PlannedSeq("s", 7, 0, [1], 0),
            PlannedSeq("t", 0, 0, [1], 0, SamplingParams(temperature=-1)),
        ],
        pipeline=True,
    )
    (result,) = list(plane.dense.Run(iter([plan]), timeout=30))
    by_id = {r.seq_id: r for r in dense_wire.step_outcome_from_proto(result).rows()}
    assert by_id["ok"].token_id >= 0 and by_id["ok"].error is None
    for sid in ("v", "s", "t"):
        assert isinstance(by_id[sid].error, InvalidInput), sid
    plane.shards[0].Release(kv_attention_pb2.ReleaseRequest(seq_ids=["ok"]), timeout=5)


@pytest.mark.parametrize("workers", [0, 1])
def test_dead_shard_fails_only_its_sequences(model_factory: Callable, tmp_path: Path, workers: int) -> None:
    dp = DataPlane(model_factory("llama"), tmp_path, workers)
    try:
        dp.reserve(0, "a", 8)
        dp.reserve(1, "b", 8)
        os.kill(dp.procs[1].pid, signal.SIGKILL)
        dp.procs[1].proc.wait(timeout=10)
        seqs = [PlannedSeq("a", 0, 0, [1, 5], 0), PlannedSeq("b", 1, 1, [1, 5], 0)]
        (result,) = list(dp.dense.Run(iter([dense_wire.plan_to_proto(0, seqs, pipeline=True)]), timeout=60))
        by_id = {r.seq_id: r for r in dense_wire.step_outcome_from_proto(result).rows()}
        assert by_id["a"].token_id >= 0 and by_id["a"].error is None
        assert isinstance(by_id["b"].error, Unavailable)
        assert f"shard 1 ({dp.shard_addrs[1]})" in by_id["b"].error.message
    finally:
        dp.close()
