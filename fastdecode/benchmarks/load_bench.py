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
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fastdecode.benchmarks.fleet_bench import percentile, prompts_for
from fastdecode.benchmarks.transport import ensure_model


def peak_rss_bytes(pid: int) -> int | None:
    """The process's resident-set high-water mark (Linux), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _load(
    target: str,
    clients: int,
    requests_per_client: int,
    prompts: list[list[int]],
    gen_len: int,
    bound_s: float,
    chat: bool = False,
) -> dict[str, Any]:
    """gen_len tokens per request (EOS ignored); chat: max_tokens = gen_len, EOS honoured, and a
    request that ends with a finish reason is complete whatever its length."""
    from fastdecode.client import AsyncClient, FastDecodeError

    outcomes: Counter[str] = Counter()
    latencies: list[float] = []
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0

    async with AsyncClient(target) as client:

        async def one(i: int) -> None:
            nonlocal tokens
            for r in range(requests_per_client):
                t0 = last = time.perf_counter()
                got = 0
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
                            last = now
                        finished = chunk.finish_reason or finished
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
        "ttft_p99_s": percentile(ttft, 99),
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
) -> dict[str, Any]:
    from fastdecode.model import ModelConfig
    from fastdecode.runtime.errors import InvalidInput
    from fastdecode.tools.fleet import launch_up

    path = model or ensure_model("llama", "small")
    workdir = Path(tempfile.mkdtemp(prefix="fastdecode-bench-load-"))
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
            "model": str(path),
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


def _pids(state: dict[str, Any]) -> list[tuple[str, int]]:
    out = [(n, state[n]["pid"]) for n in ("gateway", "scheduler", "gpu_dense")]
    return out + [(f"kv_attention_{i}", k["pid"]) for i, k in enumerate(state["kv_attention"])]
