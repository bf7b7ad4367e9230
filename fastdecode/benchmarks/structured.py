"""`fastdecode bench structured`: what a JSON-schema grammar mask costs per decode step at batch B.

Two sets of B sequences decode in the real dense step (StepRunner, the KV on an in-process KVStore
behind the ShardPlane interface, as the shard would hold it), steps interleaved so both see the same
noise: set A samples freely, set B under a JSON schema (nested objects, enums, arrays, numbers),
temperature 0.8. Reported, medians over the steps: the plain step, the structured step, the mask
computation itself (all B matchers advanced and masked, on the worker thread) and its share of the
plain step, and the exposed cost (structured - plain step), which is lower when the masks overlap
the layers.
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fastdecode.benchmarks.common import median
from fastdecode.contract import PlannedSeq, SamplingParams
from fastdecode.dense import AttendItem, StepRunner
from fastdecode.dense.grammar import GrammarBank
from fastdecode.kv import KVStore
from fastdecode.model.dense import DenseModel
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.grammar import Structured, compile_grammar
from fastdecode.runtime.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number"},
        "role": {"enum": ["engineer", "artist", "doctor"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "height_m", "role", "address", "skills"],
}
PROMPT = "<|im_start|>user\nInvent a person and describe them as JSON.<|im_end|>\n<|im_start|>assistant\n"


class _LocalShard:
    """One KVStore in this process behind the ShardPlane interface."""

    num_shards = 1

    def __init__(self, store: KVStore) -> None:
        self.store = store

    async def attend_layer(
        self, slot: int, layer: int, items: Sequence[AttendItem]
    ) -> list[torch.Tensor | BaseException]:
        return [self.store.attend(layer, it.batch) for it in items]


def run(model_dir: Path, batch: int = 32, steps: int = 24, device: str = "cpu") -> dict[str, Any]:
    model = DenseModel.from_pretrained(model_dir, device, torch.float32)
    c = model.config
    tok = Tokenizer.from_pretrained(model_dir)
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    store = KVStore(
        KVGeometry(c.num_hidden_layers, c.num_key_value_heads, c.head_dim), 1 << 30, torch.float32
    )
    bank = GrammarBank(model_dir / "tokenizer.json", c.vocab_size, c.eos_token_ids)
    runner = StepRunner(model, _LocalShard(store), grammars=bank)
    grammar = compile_grammar(Structured("json_schema", json.dumps(SCHEMA)))
    sets = {
        "plain": SamplingParams(temperature=0.8, seed=1),
        "structured": SamplingParams(temperature=0.8, seed=1, grammar=grammar),
    }
    hist: dict[str, list[int]] = {}
    for name in sets:
        for i in range(batch):
            store.reserve(f"{name}-{i}", len(prompt) + steps + 2)
            hist[f"{name}-{i}"] = list(prompt)
    eos = set(c.eos_token_ids)
    times: dict[str, list[float]] = {name: [] for name in sets}
    mask_s: list[float] = []
    finished = 0

    async def one(name: str, step: int) -> float:
        nonlocal finished
        seqs = []
        for i in range(batch):
            sid = f"{name}-{i}"
            h = hist[sid]
            fresh = step == 0 or len(h) == len(prompt)  # first step, or an answer started over
            new = h if fresh else h[-1:]
            start = 0 if fresh else len(h) - 1
            seqs.append(PlannedSeq(sid, 0, i % 2, list(new), start, sets[name], True, len(h) - len(prompt)))
        t0 = time.perf_counter()
        outcomes, _ = await runner.run(seqs, pipeline=False)
        seconds = time.perf_counter() - t0
        for s in seqs:
            o = outcomes[s.seq_id]
            if o.error is not None:
                raise o.error
            if o.token_id in eos and name == "structured":
                finished += 1
                # a finished answer starts over (same KV positions are rewritten): the batch stays B
                hist[s.seq_id] = list(prompt)
                runner.forget([s.seq_id])
            else:
                hist[s.seq_id].append(o.token_id)
        return seconds

    async def main() -> None:
        for step in range(steps + 1):
            order = list(sets) if step % 2 else list(reversed(sets))  # neither always goes first
            for name in order:
                seconds = await one(name, step)
                if step > 0:  # step 0 is the prefill
                    times[name].append(seconds)
                    if name == "structured":
                        mask_s.append(runner.mask_seconds)

    asyncio.run(main())
    plain, structured, mask = median(times["plain"]), median(times["structured"]), median(mask_s)
    return {
        "host": f"{platform.machine()} {torch.get_num_threads()} torch threads, {device}",
        "batch": batch,
        "steps": steps,
        "plain_step_ms": round(plain * 1e3, 3),
        "structured_step_ms": round(structured * 1e3, 3),
        "mask_ms": round(mask * 1e3, 3),
        "mask_share_of_step": round(mask / plain, 4),
        "exposed_share_of_step": round((structured - plain) / plain, 4),
        "answers_finished": finished,
    }
