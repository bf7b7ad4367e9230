"""`fastdecode bench spec`: speculative decoding through the split, against the same fleet without it.

One workload, run on a fleet started per mode (off, ngram, suffix: the scheduler's --speculative, each
planning one step at a time as drafts do; off-ahead: no drafts, planning ahead, the default without
them), one after the other on the same checkpoint: B concurrent greedy requests that quote and edit
a text they were given (a passage to repeat, code to rewrite with one name changed), the workloads
prompt-lookup drafting is made for. Reported per mode, with ratios to `off` measured in the same run:

- tokens/s end to end, and steps per generated token (the scheduler's plans);
- tau, the tokens a verified row yields (kept drafts + the target's own), and the share of drafts kept;
- KV bytes the shards read per generated token, and Attend round trips per generated token (what
  the split pays per token: one read of a sequence's KV and one round trip per layer per row);
- `same_tokens`: whether every request's greedy tokens equal the off run's (float32 KV, so they must).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from fastdecode.benchmarks.common import bench_workdir
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.metrics import metric_total, scrape

# off-ahead: no drafts, planning one step ahead (the default without drafts, which drafts turn off)
MODES = ("off", "off-ahead", "ngram", "suffix")

PASSAGE = (
    "FastDecode splits every transformer into a dense half and an attention half. The dense half "
    "runs the weights of all sequences as one batch on the accelerator; the attention half runs "
    "near the KV cache, on the CPUs of many hosts, each holding the keys and values of its share of "
    "the sequences. Every layer, the dense half sends each sequence's query, key and value to the "
    "host that holds its cache, and gets the attention output back."
)
CODE = '''def moving_average(values, window):
    """The mean of each window of consecutive values."""
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages
'''
TASKS = (
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this Python function with the parameter `window` renamed to `size`. Output only the code."
    f"\n\n{CODE}",
    f"Copy this text, then say how many sentences it has:\n\n{PASSAGE}",
    f"Add type hints to this Python function. Output only the code.\n\n{CODE}",
)


def load_prompts(model: Path, prompts_file: Path | None, batch: int) -> list[str]:
    """B prompt texts: the built-in quote-and-edit tasks, or the conversations of a JSONL file (each
    line {"messages": [...]} or a bare list of messages), rendered by the checkpoint's chat template
    and taken in turn."""
    from fastdecode.gateway.chat import ChatTemplate

    template = ChatTemplate.from_pretrained(model)
    if template is None:
        raise InvalidInput(f"{model} has no chat template: bench spec sends chat prompts")
    if prompts_file is None:
        convs: list[list[dict[str, Any]]] = [[{"role": "user", "content": t}] for t in TASKS]
    else:
        convs = []
        for n, line in enumerate(prompts_file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidInput(f"{prompts_file}:{n}: not JSON ({e.msg})") from None
            messages = item.get("messages") if isinstance(item, dict) else item
            if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
                raise InvalidInput(
                    f'{prompts_file}:{n}: want {{"messages": [{{"role": ..., "content": ...}}]}}'
                )
            convs.append(messages)
        if not convs:
            raise InvalidInput(f"{prompts_file}: no conversations")
    texts = [template.render(c) for c in convs]
    return [texts[i % len(texts)] for i in range(batch)]


async def _run(target: str, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float]:
    from fastdecode.client import AsyncClient

    async with AsyncClient(target) as client:
        await client.generate(prompt="Hello", max_tokens=2)  # warm the path
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(client.generate(prompt=p, max_tokens=max_tokens) for p in prompts))
        return [o.token_ids for o in outs], time.perf_counter() - t0


def _counters(fleet: Any) -> dict[str, float]:
    """The fleet's cumulative counts the bench reads before and after the workload."""
    from fastdecode.runtime.rpc import sync_channel
    from fastdecode.v1 import scheduler_pb2, scheduler_pb2_grpc

    stub = scheduler_pb2_grpc.SchedulerStub(sync_channel(fleet.scheduler.address, fleet.peer_credentials))
    st = stub.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=10)
    kv_bytes = sum(metric_total(scrape(s.metrics), "fastdecode_kv_bytes_read_total") for s in fleet.kv)
    trips = metric_total(scrape(fleet.dense.metrics), "fastdecode_dense_attend_items_total")
    return {
        "steps": st.steps,
        "spec_rows": st.spec_rows,
        "spec_drafts": st.spec_drafts,
        "spec_accepted": st.spec_accepted,
        "spec_emitted": st.spec_emitted,
        "offered_at": list(st.spec_offered_at),
        "kept_at": list(st.spec_kept_at),
        "kv_bytes": kv_bytes,
        "round_trips": trips,
    }


def _zip_at(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[int, int, int, int]]:
    n = len(after["offered_at"])
    pad = [0] * n
    ob, kb = (before["offered_at"] or pad), (before["kept_at"] or pad)
    return list(zip(ob, after["offered_at"], kb, after["kept_at"], strict=True))


def run_spec_bench(
    model: Path,
    batch: int = 8,
    max_tokens: int = 96,
    k: int = 3,
    shards: int = 2,
    device: str = "cpu",
    modes: tuple[str, ...] = MODES,
    prompts_file: Path | None = None,
) -> dict[str, Any]:
    from fastdecode.tools.fleet import Fleet

    prompts = load_prompts(model, prompts_file, batch)
    result: dict[str, Any] = {"model": model.name, "batch": batch, "max_tokens": max_tokens, "k": k}
    tokens_off: list[list[int]] | None = None
    with bench_workdir("spec") as work:
        for mode in modes:
            # plan-ahead is off with drafts (a row in flight leaves its next position unknown): `off`
            # runs the same way, so its ratio is the drafts' alone; `off-ahead` is the default setup
            spec = "off" if mode == "off-ahead" else mode
            # K drafts on every row: the drafter's acceptance at each position is what is measured
            args = ["--speculative", spec, "--num-speculative-tokens", str(k), "--speculative-k", "fixed"]
            args += ["--plan-ahead", "on" if mode == "off-ahead" else "off"]
            fleet = Fleet(model, shards, device=device, kv_dtype="float32", scheduler_args=args)
            fleet.workdir = work / mode
            with fleet:
                assert fleet.gateway is not None
                before = _counters(fleet)
                tokens, seconds = asyncio.run(_run(fleet.gateway.address, prompts, max_tokens))
                after = _counters(fleet)
            at = [(o1 - o0, k1 - k0) for o0, o1, k0, k1 in _zip_at(before, after)]
            d = {key: after[key] - before[key] for key in after if not key.endswith("_at")}
            name = mode.replace("-", "_")  # off-ahead's keys: off_ahead_...
            n = sum(len(t) for t in tokens)
            result[f"{name}_tokens_per_s"] = n / seconds
            result[f"{name}_tokens"] = n
            result[f"{name}_steps_per_token"] = d["steps"] / n
            result[f"{name}_kv_bytes_per_token"] = d["kv_bytes"] / n
            result[f"{name}_round_trips_per_token"] = d["round_trips"] / n
            if spec != "off":
                result[f"{name}_tau"] = d["spec_emitted"] / max(d["spec_rows"], 1)
                result[f"{name}_drafts_kept"] = d["spec_accepted"] / max(d["spec_drafts"], 1)
                # the share of rows offering a j-th draft that kept it (a draft is kept only after
                # the ones before it were)
                result[f"{name}_kept_at_position"] = [round(k / o, 4) if o else None for o, k in at]
            if tokens_off is None and mode == "off":
                tokens_off = tokens
            elif tokens_off is not None:
                result[f"{name}_same_tokens"] = tokens == tokens_off
    if "off" in modes:
        for mode in (m.replace("-", "_") for m in modes if m != "off"):
            result[f"{mode}_speedup"] = result[f"{mode}_tokens_per_s"] / result["off_tokens_per_s"]
            if mode == "off_ahead":
                continue
            if "off-ahead" in modes:
                ahead = result["off_ahead_tokens_per_s"]
                result[f"{mode}_speedup_vs_off_ahead"] = result[f"{mode}_tokens_per_s"] / ahead
            for what in ("kv_bytes_per_token", "round_trips_per_token"):
                off = max(result[f"off_{what}"], 1e-12)
                result[f"{mode}_{what}_ratio"] = result[f"{mode}_{what}"] / off
    return result
