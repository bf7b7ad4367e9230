"""`fastdecode bench load`: many concurrent streaming clients against a fleet, bounded in time.

Every request must end in exactly one way: its tokens or a clear error status; a request that
does neither within the time bound counts as hung. Reports throughput, latency percentiles and
the peak RSS of every fleet process (VmHWM from /proc).

--chat sends requests as an OpenAI chat client without max_tokens does: max_tokens = the rest of
the context, EOS honoured. Each shard gets KV for --kv-contexts full contexts (what full-context
reservations would run per shard), and a watcher samples the scheduler and shards every 50 ms to
report peak running sequences, KV in use (blocks) and held (tokens) against capacity, and
preemptions. --context cuts the model's context (a copy with the same weights) so that a
random-weight model, which rarely says EOS, finishes in bench time.

--shared-prefix N: every request starts with the same N tokens (a system prompt), then its own
--prompt-len question. The same load runs twice in one invocation, on a fleet with prefix sharing
on and on one with it off (fp32 KV, greedy): the peaks of KV held, time to first token, throughput,
the cached tokens the gateway reported, and whether every request's tokens were equal.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fastdecode.benchmarks.common import bench_workdir, proc_status_bytes
from fastdecode.benchmarks.fleet_bench import percentile, prompts_for
from fastdecode.benchmarks.transport import ensure_model


def peak_rss_bytes(pid: int) -> int | None:
    """The process's resident-set high-water mark (Linux), None when it is gone."""
    return proc_status_bytes(pid, "VmHWM")


async def _load(
    target: str,
    clients: int,
    requests_per_client: int,
    prompts: list[list[int]],
    gen_len: int,
    bound_s: float,
    chat: bool = False,
    outputs: dict[tuple[int, int], list[int]] | None = None,
) -> dict[str, Any]:
    """gen_len tokens per request (EOS ignored); chat: max_tokens = gen_len, EOS honoured, and a
    request that ends with a finish reason is complete whatever its length. `outputs` collects each
    (client, request)'s tokens."""
    from fastdecode.client import AsyncClient, FastDecodeError

    outcomes: Counter[str] = Counter()
    latencies: list[float] = []
    ttft: list[float] = []
    itl: list[float] = []
    tokens = cached = 0

    async with AsyncClient(target) as client:

        async def one(i: int) -> None:
            nonlocal tokens, cached
            for r in range(requests_per_client):
                t0 = last = time.perf_counter()
                got = 0
                ids: list[int] = []
                finished: str | None = None
                try:
                    async for chunk in client.stream(
                        token_ids=prompts[(i + r) % len(prompts)],
                        max_tokens=gen_len,
                        ignore_eos=not chat,
                        timeout=bound_s,
                    ):
                        now = time.perf_counter()
                        if chunk.token_ids:
                            (ttft if got == 0 else itl).append(now - last)
                            got += len(chunk.token_ids)
                            ids += chunk.token_ids
                            last = now
                        finished = chunk.finish_reason or finished
                        if chunk.usage is not None:
                            cached += chunk.usage.cached_tokens
                    if outputs is not None:
                        outputs[(i, r)] = ids
                    ok = got == gen_len or (chat and bool(finished))
                    outcomes["ok" if ok else "short"] += 1
                    latencies.append(time.perf_counter() - t0)
                    tokens += got
                except FastDecodeError as e:
                    outcomes[e.code.name] += 1

        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(clients))), bound_s + 30)
        except TimeoutError:
            pass
        wall = time.perf_counter() - t0
    total = clients * requests_per_client
    hung = total - sum(outcomes.values())
    return {
        "requests": total,
        "completed": outcomes.get("ok", 0),
        "errors": {k: v for k, v in outcomes.items() if k != "ok"},
        "lost_or_hung": hung,
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "cached_tokens_total": cached,
        "itl_p99_ms": percentile(itl, 99) * 1e3,
    }


class _Watch:
    """Samples the scheduler and the shards while the load runs: the peaks the chat mode reports."""

    def __init__(self, state: dict[str, Any]) -> None:
        from fastdecode.runtime.rpc import sync_channel
        from fastdecode.tools.fleet import state_credentials
        from fastdecode.v1 import kv_attention_pb2_grpc, scheduler_pb2_grpc

        creds = state_credentials(state)
        self.sched = scheduler_pb2_grpc.SchedulerStub(sync_channel(state["scheduler"]["address"], creds))
        self.shards = [
            kv_attention_pb2_grpc.KVAttentionStub(sync_channel(k["address"], creds))
            for k in state["kv_attention"]
        ]
        self.peak_running = self.peak_waiting = self.peak_in_use = self.peak_held = 0
        self.capacity = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        from fastdecode.v1 import kv_attention_pb2, scheduler_pb2

        st = self.sched.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=5)
        self.peak_running = max(self.peak_running, st.running)
        self.peak_waiting = max(self.peak_waiting, st.waiting)
        in_use = held = capacity = 0
        for shard in self.shards:
            kv = shard.Stats(kv_attention_pb2.StatsRequest(), timeout=5)
            in_use += kv.tokens_reserved  # tokens of the blocks held (reserved up front before on-demand)
            held += kv.tokens_held
            capacity += kv.tokens_reserved + kv.free_tokens
        self.peak_in_use, self.peak_held = max(self.peak_in_use, in_use), max(self.peak_held, held)
        self.capacity = max(self.capacity, capacity)

    def _run(self) -> None:
        import grpc

        while not self._stop.is_set():
            try:
                self.sample()
            except grpc.RpcError:
                pass  # a slow answer under load: the next sample counts
            self._stop.wait(0.05)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def preemptions(self) -> int:
        from fastdecode.v1 import scheduler_pb2

        return int(self.sched.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=5).preemptions)


def _cut_context(model: Path, context: int, workdir: Path) -> Path:
    """A copy of the checkpoint whose context is `context` tokens (same weights and tokenizer)."""
    out = workdir / f"{model.name}-ctx{context}"
    shutil.copytree(model, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = context
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def run_load_bench(
    model: Path | None = None,
    clients: int = 128,
    requests_per_client: int = 1,
    prompt_len: int = 32,
    gen_len: int = 32,
    shards: int = 2,
    device: str = "cpu",
    bound_s: float = 300.0,
    chat: bool = False,
    context: int | None = None,
    kv_contexts: float = 2.0,
    shared_prefix: int = 0,
) -> dict[str, Any]:
    from fastdecode.model import ModelConfig
    from fastdecode.runtime.errors import InvalidInput
    from fastdecode.tools.fleet import launch_up

    path = model or ensure_model("llama", "small")
    if shared_prefix:
        if chat or shared_prefix < 0:
            raise InvalidInput("--shared-prefix needs N > 0 and no --chat")
        return run_shared_prefix_bench(
            path, clients, requests_per_client, shared_prefix, prompt_len, gen_len, shards, device, bound_s
        )
    source = path  # what the result names: a cut copy lives in the work directory, removed after
    with bench_workdir("load") as workdir:
        if chat and context is not None:
            path = _cut_context(path, context, workdir)
        cfg = ModelConfig.from_pretrained(path)
        ctx = cfg.max_position_embeddings
        if chat:
            if not 0 < prompt_len < ctx or kv_contexts <= 0:
                raise InvalidInput(f"chat needs 0 < prompt_len < the context ({ctx}) and kv_contexts > 0")
            gen_len = ctx - prompt_len  # what a chat request without max_tokens asks for
            kv_capacity = int(kv_contexts * ctx * cfg.kv_bytes_per_token(4))
        else:
            kv_capacity = int(
                (prompt_len + gen_len + 16) * cfg.kv_bytes_per_token(4) * clients / shards * 1.25
            ) + (64 << 20)
        prompts = prompts_for(min(clients, 64), prompt_len, cfg.vocab_size, seed=1)
        up = launch_up(
            path, workdir, "--admission", "naive", shards=shards, device=device, kv_capacity=kv_capacity
        )
        try:
            with _Watch(up.state) as watch:
                result = asyncio.run(
                    _load(up.target, clients, requests_per_client, prompts, gen_len, bound_s, chat)
                )
            preemptions = watch.preemptions()
            rss = {name: peak_rss_bytes(pid) for name, pid in _pids(up.state)}
        finally:
            up.stop()
    result.update(
        {
            "clients": clients,
            "shards": shards,
            "prompt_len": prompt_len,
            "gen_len": gen_len,
            "model": str(source),
        }
    )
    if chat:
        result.update(
            {
                "mode": "chat (max_tokens = rest of the context)",
                "context": ctx,
                "kv_full_contexts_per_shard": kv_contexts,
                "peak_running": watch.peak_running,
                "peak_waiting": watch.peak_waiting,
                "kv_capacity_tokens": watch.capacity,
                "peak_kv_in_use_tokens": watch.peak_in_use,
                "peak_kv_in_use_ratio": round(watch.peak_in_use / max(1, watch.capacity), 3),
                "peak_kv_held_tokens": watch.peak_held,
                "preemptions": preemptions,
            }
        )
    for name, value in rss.items():
        result[f"peak_rss_mib_{name}"] = round(value / 2**20, 1) if value else None
    return result


def run_shared_prefix_bench(
    path: Path,
    clients: int,
    requests_per_client: int,
    prefix_len: int,
    question_len: int,
    gen_len: int,
    shards: int,
    device: str,
    bound_s: float,
) -> dict[str, Any]:
    """The same shared-prefix load on a fleet with prefix sharing on, then on one with it off."""
    from fastdecode.model import ModelConfig
    from fastdecode.runtime.errors import InvalidInput
    from fastdecode.tools.fleet import launch_up

    cfg = ModelConfig.from_pretrained(path)
    prompt_len = prefix_len + question_len
    if prompt_len + gen_len > cfg.max_position_embeddings or question_len < 1:
        raise InvalidInput(
            f"--shared-prefix {prefix_len} + --prompt-len {question_len} + --gen-len {gen_len} must fit "
            f"the context ({cfg.max_position_embeddings}), with a question of at least one token"
        )
    prefix = prompts_for(1, prefix_len, cfg.vocab_size, seed=7)[0]
    questions = prompts_for(min(clients, 64), question_len + 1, cfg.vocab_size, seed=1)
    prompts = [prefix + q[1:] for q in questions]  # each question without its own BOS
    # room for every request's whole prompt, as without sharing: the off run must not preempt either
    kv_capacity = int((prompt_len + gen_len + 16) * cfg.kv_bytes_per_token(4) * clients / shards * 1.25) + (
        64 << 20
    )
    runs: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[tuple[int, int], list[int]]] = {}
    for mode in ("on", "off"):
        with bench_workdir(f"prefix-{mode}") as workdir:
            up = launch_up(
                path,
                workdir,
                "--admission",
                "naive",
                "--prefix-sharing",
                mode,
                shards=shards,
                device=device,
                kv_capacity=kv_capacity,
            )
            outputs[mode] = {}
            try:
                with _Watch(up.state) as watch:
                    runs[mode] = asyncio.run(
                        _load(
                            up.target,
                            clients,
                            requests_per_client,
                            prompts,
                            gen_len,
                            bound_s,
                            outputs=outputs[mode],
                        )
                    )
                runs[mode]["kv_tokens_held_peak"] = watch.peak_held
                runs[mode]["preemptions"] = watch.preemptions()
            finally:
                up.stop()
    on, off = runs["on"], runs["off"]
    done = on["completed"] == off["completed"] == clients * requests_per_client
    return {
        "mode": "shared prefix (same load with prefix sharing on, then off; fp32 KV, greedy)",
        "clients": clients,
        "shards": shards,
        "shared_prefix": prefix_len,
        "question_len": question_len,
        "gen_len": gen_len,
        "model": str(path),
        "completed": on["completed"],
        "completed_off": off["completed"],
        "errors": on["errors"],
        "errors_off": off["errors"],
        "lost_or_hung": on["lost_or_hung"] + off["lost_or_hung"],
        "preemptions": on["preemptions"],
        "preemptions_off": off["preemptions"],
        "kv_tokens_held_peak": on["kv_tokens_held_peak"],
        "kv_tokens_held_peak_off": off["kv_tokens_held_peak"],
        "kv_peak_ratio": round(on["kv_tokens_held_peak"] / max(1, off["kv_tokens_held_peak"]), 3),
        "ttft_p50_s": on["ttft_p50_s"],
        "ttft_p50_s_off": off["ttft_p50_s"],
        "ttft_p50_ratio": round(on["ttft_p50_s"] / off["ttft_p50_s"], 3) if off["ttft_p50_s"] else None,
        "tokens_per_s": on["tokens_per_s"],
        "tokens_per_s_off": off["tokens_per_s"],
        "cached_tokens_total": on["cached_tokens_total"],
        "cached_tokens_total_off": off["cached_tokens_total"],
        "equal_to_off": done and outputs["on"] == outputs["off"],
    }


def _pids(state: dict[str, Any]) -> list[tuple[str, int]]:
    out = [(n, state[n]["pid"]) for n in ("gateway", "scheduler", "gpu_dense")]
    return out + [(f"kv_attention_{i}", k["pid"]) for i, k in enumerate(state["kv_attention"])]
