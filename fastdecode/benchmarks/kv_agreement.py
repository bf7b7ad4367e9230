"""What a KV storage dtype costs in tokens: greedy decodes and logits against fp32 KV.

The same model and prompts on LocalEngine (the shard's KVStore and native kernel, in process) once
per KV dtype. Greedy agreement: each dtype's greedy tokens against fp32 KV's (whole sequences
equal, positions equal before a sequence's first difference, and where each first differs).
Logit error: every dtype decodes fp32 KV's tokens (teacher-forced, so the inputs stay equal) and
its logits are compared with fp32 KV's at each step (max and mean |difference|, and the largest
difference relative to the step's logit spread). Prompts are random token ids from a seed.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import torch

from fastdecode.dense.engine import LocalEngine, SeqChunk
from fastdecode.kv import KV_DTYPES
from fastdecode.runtime.errors import InvalidInput

DEFAULT_DTYPES = ("bfloat16", "int8", "float8_e4m3")


def _engine(model: Path, kv_dtype: str) -> LocalEngine:
    return LocalEngine.from_pretrained(model, kv_dtype=KV_DTYPES[kv_dtype])


def _teacher_forced_logits(
    engine: LocalEngine, prompts: list[list[int]], tokens: list[list[int]]
) -> torch.Tensor:
    """Logits [steps, B, vocab] of decoding `tokens` after `prompts` (the first from the prefill)."""
    ids = [f"tf-{i}" for i in range(len(prompts))]
    steps = len(tokens[0])
    for sid, p in zip(ids, prompts, strict=True):
        engine.kv.reserve(sid, len(p) + steps)
    try:
        out = [engine.forward([SeqChunk(s, list(p), 0) for s, p in zip(ids, prompts, strict=True)])]
        for t in range(steps - 1):
            chunks = [
                SeqChunk(s, [tok[t]], len(p) + t) for s, p, tok in zip(ids, prompts, tokens, strict=True)
            ]
            out.append(engine.forward(chunks))
        return torch.stack(out)
    finally:
        for sid in ids:
            engine.kv.release(sid)


def run_kv_agreement(
    model: Path,
    kv_dtypes: tuple[str, ...] = DEFAULT_DTYPES,
    prompts: int = 8,
    prompt_len: int = 32,
    tokens: int = 64,
    seed: int = 0,
) -> dict[str, object]:
    """Greedy agreement and logit error of each KV dtype against fp32 KV (flat dict, per dtype keys)."""
    if min(prompts, prompt_len, tokens) < 1:
        raise InvalidInput("prompts, prompt_len and tokens must be >= 1")
    bad = [d for d in kv_dtypes if d not in KV_DTYPES]
    if bad:
        raise InvalidInput(f"unknown KV dtypes {bad}; choose from {sorted(KV_DTYPES)}")
    torch.manual_seed(seed)
    with torch.inference_mode():
        ref = _engine(model, "float32")
        vocab = ref.model.config.vocab_size
        rng = random.Random(seed)
        ps = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(prompts)]
        want = [g.token_ids for g in ref.generate(ps, tokens, ignore_eos=True)]
        ref_logits = _teacher_forced_logits(ref, ps, want)
        del ref
        result: dict[str, object] = {
            "model": str(model),
            "prompts": prompts,
            "prompt_len": prompt_len,
            "tokens": tokens,
            "seed": seed,
        }
        for name in kv_dtypes:
            engine = _engine(model, name)
            got = [g.token_ids for g in engine.generate(ps, tokens, ignore_eos=True)]
            first = [
                next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), tokens)
                for x, y in zip(got, want, strict=True)
            ]
            logits = _teacher_forced_logits(engine, ps, want)
            diff = (logits - ref_logits).abs()
            spread = (ref_logits.amax(-1) - ref_logits.amin(-1)).clamp_min(1e-9)
            result |= {
                f"{name}_sequences_equal": sum(f == tokens for f in first),
                f"{name}_positions_before_first_difference": sum(first),
                f"{name}_first_difference_median": statistics.median(first),
                f"{name}_logit_max_abs_error": float(diff.max()),
                f"{name}_logit_mean_abs_error": float(diff.mean()),
                f"{name}_logit_max_error_of_spread": float((diff.amax(-1) / spread).max()),
            }
            del engine
    return result
