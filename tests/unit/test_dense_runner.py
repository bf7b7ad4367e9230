"""The dense step runner against in-process shards (real KV stores behind the ShardPlane interface):
token-exact with LocalEngine, pipeline on/off identical, a failing shard fails only its sequences,
and the pipeline chooser's measurement."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fastdecode.contract import PlannedSeq
from fastdecode.dense import AttendItem, PipelineChooser, StepRunner
from fastdecode.dense.engine import LocalEngine
from fastdecode.kv import KVStore
from fastdecode.model.dense import DenseModel
from fastdecode.runtime.errors import Unavailable
from fastdecode.runtime.geometry import KVGeometry


class InProcessShards:
    """ShardPlane over KV stores in this process; `dead` shards fail every item."""

    def __init__(self, model: DenseModel, n: int) -> None:
        c = model.config
        self.num_shards = n
        self.stores = [
            KVStore(
                KVGeometry(c.num_hidden_layers, c.num_key_value_heads, c.head_dim), 64 << 20, torch.float32
            )
            for _ in range(n)
        ]
        self.dead: set[int] = set()
        self.slots_seen: set[int] = set()

    async def attend_layer(
        self, slot: int, layer: int, items: Sequence[AttendItem]
    ) -> list[torch.Tensor | BaseException]:
        self.slots_seen.add(slot)
        await asyncio.sleep(0)  # a real plane yields here: the other mini-batch runs
        out: list[torch.Tensor | BaseException] = []
        for it in items:
            if it.shard in self.dead:
                out.append(Unavailable(f"shard {it.shard} unavailable"))
                continue
            store = self.stores[it.shard]
            out.append(store.attend(layer, it.batch))
        return out


PROMPTS = [[1, 5, 9, 3], [1, 7, 2], [1, 4, 4, 8, 6], [1, 3]]


def _decode(
    model_dir: Path,
    pipeline: bool,
    steps: int = 4,
    dead: int | None = None,
    chooser: PipelineChooser | None = None,
) -> dict[str, list]:
    model = DenseModel.from_pretrained(model_dir, "cpu", torch.float32)
    shards = InProcessShards(model, 2)
    for i, _ in enumerate(PROMPTS):
        shards.stores[i % 2].reserve(f"s{i}", 64)
    runner = StepRunner(model, shards, chooser)
    out: dict[str, list] = {f"s{i}": [] for i in range(len(PROMPTS))}
    seqs = [PlannedSeq(f"s{i}", i % 2, (i // 2) % 2, p, 0) for i, p in enumerate(PROMPTS)]

    async def run() -> None:
        nonlocal seqs
        for step in range(steps):
            if step == 1 and dead is not None:
                shards.dead.add(dead)
            outcomes, t = await runner.run(seqs, pipeline)
            assert (chooser is not None or t.pipelined == pipeline) and t.step_seconds > 0
            nxt = []
            for s in seqs:
                o = outcomes[s.seq_id]
                out[s.seq_id].append(o.error if o.error is not None else o.token_id)
                if o.error is None:
                    nxt.append(
                        PlannedSeq(
                            s.seq_id, s.shard, s.mini_batch, [o.token_id], s.start_pos + len(s.token_ids)
                        )
                    )
            seqs = nxt

    asyncio.run(run())
    assert chooser is not None or shards.slots_seen == ({0, 1} if pipeline else {0})
    return out


def test_runner_is_token_exact_with_local_engine_piped_or_not(model_factory: Callable) -> None:
    path = model_factory("llama")
    engine = LocalEngine.from_pretrained(path)
    ref = engine.generate(PROMPTS, 4, ignore_eos=True)
    want = {f"s{i}": g.token_ids for i, g in enumerate(ref)}
    assert _decode(path, pipeline=True) == want
    assert _decode(path, pipeline=False) == want


def test_a_failing_shard_fails_only_its_sequences(model_factory: Callable) -> None:
    out = _decode(model_factory("llama"), pipeline=True, dead=1)
    for sid in ("s0", "s2"):  # shard 0
        assert all(isinstance(t, int) for t in out[sid]) and len(out[sid]) == 4
    for sid in ("s1", "s3"):  # shard 1 dies before step 1
        assert isinstance(out[sid][1], Unavailable) and len(out[sid]) == 2


def test_pipeline_chooser_keeps_the_faster_and_probes_again() -> None:
    c = PipelineChooser(probes=2, every=3)
    tried = []
    while c.choice is None:
        piped = c.choose()
        tried.append(piped)
        c.record(piped, 1.0 if piped else 2.0)
    assert tried == [True, False, True, False] and c.choice is True
    assert [c.choose() for _ in range(2)] == [True, True]
    c.choose()  # the third step after the decision starts a new probe
    assert c.choice is None
    while c.choice is None:
        piped = c.choose()
        c.record(piped, 3.0 if piped else 2.0)
    assert c.choice is False
    with pytest.raises(ValueError):
        PipelineChooser(probes=0)


def test_pipeline_chooser_compares_prefill_steps_apart_from_decode_steps() -> None:
    c = PipelineChooser(probes=2)
    # an admission wave: its prefill steps cost several decode steps; counted with the decode
    # steps they would tie the two modes here (medians 5.0 and 5.0) and pick plain
    c.record(True, 9.0, decode_only=False)
    c.record(False, 8.0, decode_only=False)
    c.record(True, 1.0)
    c.record(False, 2.0)
    assert c.choice is None  # one probe a mode of each kind so far
    c.record(True, 1.0)
    c.record(False, 2.0)
    assert c.choice is True and c.medians == (1.0, 2.0)
    # under steady arrivals most steps carry a chunk: those decide among themselves
    c = PipelineChooser(probes=2)
    for piped, sec in [(True, 3.0), (False, 2.0), (True, 3.0), (False, 2.0)]:
        c.record(piped, sec, decode_only=False)
    assert c.choice is False


class RecordingChooser(PipelineChooser):
    def __init__(self) -> None:
        super().__init__(probes=2)
        self.recorded: list[tuple[bool, bool]] = []

    def record(self, piped: bool, seconds_per_seq: float, decode_only: bool = True) -> None:
        self.recorded.append((piped, decode_only))
        super().record(piped, seconds_per_seq, decode_only)


def test_the_runner_tells_the_chooser_which_steps_prefill(model_factory: Callable) -> None:
    # Step 0 prefills every prompt (several tokens a sequence); steps 1-3 decode one token each.
    chooser = RecordingChooser()
    _decode(model_factory("llama"), pipeline=True, steps=4, chooser=chooser)
    assert chooser.recorded == [(True, False), (False, True), (True, True), (False, True)]
    assert chooser.choice is None  # decode steps: one piped, two plain; prefill: one piped


def test_penalties_keep_the_history_a_re_prefill_restarts_and_a_lost_one_is_refused(
    model_factory: Callable,
) -> None:
    """The runner's penalized draw equals LocalEngine's logits through `penalize` over the same
    history; a sequence prefilled again from start_pos 0 (recovery, preemption) gets the same next
    token; a runner without the history (gpu_dense restarted) refuses the sequence, not the step."""
    from fastdecode.contract import SamplingParams
    from fastdecode.dense.engine import SeqChunk
    from fastdecode.dense.sampling import penalize
    from fastdecode.runtime.errors import FailedPrecondition

    path = model_factory("llama")
    model = DenseModel.from_pretrained(path, "cpu", torch.float32)
    sp = SamplingParams(repetition_penalty=5.0, frequency_penalty=1.5, presence_penalty=0.5)
    engine = LocalEngine.from_pretrained(path)
    prompt, steps = [1, 2], 20  # its greedy run repeats token 826 at step 17: the penalties change it
    engine.kv.reserve("ref", 64)
    hist, want = list(prompt), []
    for i in range(steps):
        new = hist if i == 0 else hist[-1:]
        logits = engine.forward([SeqChunk("ref", list(new), len(hist) - len(new))])
        tok = int(penalize(logits, [sp], [i], [hist], model.config.eos_token_ids).argmax(-1))
        want.append(tok)
        hist.append(tok)

    shards = InProcessShards(model, 1)
    for sid in ("a", "b"):
        shards.stores[0].reserve(sid, 64)
    runner = StepRunner(model, shards)

    async def run() -> tuple[list[int], int, BaseException | None]:
        got: list[int] = []
        toks = list(prompt)
        for i in range(steps):
            new = toks if i == 0 else toks[-1:]
            out, _ = await runner.run([PlannedSeq("a", 0, 0, list(new), len(toks) - len(new), sp, True, i)])
            got.append(out["a"].token_id)
            toks.append(out["a"].token_id)
        # the whole history prefilled again under another id from start_pos 0: the same last token
        out, _ = await runner.run([PlannedSeq("b", 0, 0, toks[:-1], 0, sp, True, steps - 1)])
        again = out["b"].token_id
        fresh = StepRunner(model, shards)
        out, _ = await fresh.run([PlannedSeq("a", 0, 0, [toks[-1]], len(toks) - 1, sp, True, steps)])
        return got, again, out["a"].error

    got, again, refused = asyncio.run(run())
    plain = LocalEngine.from_pretrained(path).generate([prompt], steps, ignore_eos=True)[0].token_ids
    assert want != plain  # the penalties change this greedy run: the comparison below can fail
    assert got == want
    assert again == want[-1]
    assert isinstance(refused, FailedPrecondition)
    runner.forget(["a", "b"])
    assert not runner._history


def test_bad_words_follow_the_generated_tokens_and_foreign_ids_fail_only_their_sequence(
    model_factory: Callable,
) -> None:
    """A two-token bad word taken from the greedy run: the run is the same up to its first token and
    then avoids its second; a sequence whose processors name a token outside the vocabulary fails
    alone (InvalidInput), the step goes on."""
    from fastdecode.contract import SamplingParams
    from fastdecode.runtime.errors import InvalidInput

    path = model_factory("llama")
    model = DenseModel.from_pretrained(path, "cpu", torch.float32)
    prompt, steps = [1, 5, 9], 8
    plain = LocalEngine.from_pretrained(path).generate([prompt], steps, ignore_eos=True)[0].token_ids
    k = 3
    sp = SamplingParams(bad_words=((plain[k], plain[k + 1]),))
    shards = InProcessShards(model, 1)
    shards.stores[0].reserve("a", 64)
    shards.stores[0].reserve("x", 64)
    runner = StepRunner(model, shards)
    foreign = SamplingParams(allowed_token_ids=(model.config.vocab_size,))

    async def run() -> tuple[list[int], BaseException | None]:
        got: list[int] = []
        toks = list(prompt)
        error = None
        for i in range(k + 2):
            new = toks if i == 0 else toks[-1:]
            seqs = [PlannedSeq("a", 0, 0, list(new), len(toks) - len(new), sp, True, i)]
            if i == 0:
                seqs.append(PlannedSeq("x", 0, 0, [1, 2], 0, foreign, True, 0))
            out, _ = await runner.run(seqs)
            if i == 0:
                error = out["x"].error
            got.append(out["a"].token_id)
            toks.append(out["a"].token_id)
        return got, error

    got, error = asyncio.run(run())
    assert got[: k + 1] == plain[: k + 1] and got[k + 1] != plain[k + 1]
    assert isinstance(error, InvalidInput) and "vocabulary" in str(error)


def test_a_sequence_planned_ahead_is_fed_the_token_sampled_for_it_in_the_step_before(
    model_factory: Callable,
) -> None:
    """use_last_sample: the scheduler planned the step before that step's results came back; the
    runner feeds each such sequence the token it sampled for it last step (tokens equal LocalEngine's
    greedy run). A sequence whose last step failed, or that the last step did not sample, fails alone."""
    from fastdecode.contract import LAST_SAMPLE
    from fastdecode.runtime.errors import FailedPrecondition, InvalidInput

    path = model_factory("llama")
    want = {
        f"s{i}": g.token_ids
        for i, g in enumerate(LocalEngine.from_pretrained(path).generate(PROMPTS, 4, ignore_eos=True))
    }
    model = DenseModel.from_pretrained(path, "cpu", torch.float32)
    shards = InProcessShards(model, 2)
    for i, _ in enumerate(PROMPTS):
        shards.stores[i % 2].reserve(f"s{i}", 64)
    runner = StepRunner(model, shards)

    def ahead(i: int, pos: int, index: int) -> PlannedSeq:
        return PlannedSeq(f"s{i}", i % 2, i % 2, [LAST_SAMPLE], pos, sample_index=index, use_last_sample=True)

    async def run() -> tuple[dict[str, list[int]], dict[str, BaseException | None]]:
        got: dict[str, list[int]] = {f"s{i}": [] for i in range(len(PROMPTS))}
        seqs = [PlannedSeq(f"s{i}", i % 2, i % 2, p, 0) for i, p in enumerate(PROMPTS)]
        for step in range(4):
            out, _ = await runner.run(seqs)
            for sid, o in out.items():
                assert o.error is None, o.error
                got[sid].append(o.token_id)
            seqs = [ahead(i, len(p) + step, step + 1) for i, p in enumerate(PROMPTS)]
        # s0's next chunk is not sampled this step; s1 is fed a token of its own: neither is
        # carried on; s2 planned ahead twice in a row is fed what this step sampled for it
        mixed = [
            PlannedSeq("s0", 0, 0, [5], len(PROMPTS[0]) + 3, sample=False),
            PlannedSeq("s1", 1, 1, [LAST_SAMPLE], len(PROMPTS[1]) + 3, sample=False, use_last_sample=True),
            ahead(2, len(PROMPTS[2]) + 3, 4),
        ]
        out, _ = await runner.run(mixed)
        errors = {sid: o.error for sid, o in out.items()}
        out, _ = await runner.run([ahead(0, len(PROMPTS[0]) + 4, 5), ahead(2, len(PROMPTS[2]) + 4, 5)])
        errors.update({f"{sid} next": o.error for sid, o in out.items()})
        return got, errors

    got, errors = asyncio.run(run())
    assert got == want
    assert errors["s0"] is None and errors["s2"] is None and errors["s2 next"] is None
    assert isinstance(errors["s1"], InvalidInput)
    assert isinstance(errors["s0 next"], FailedPrecondition)  # the step before sampled nothing for it


def test_rows_run_several_decode_steps_in_one_plan_and_a_plan_ahead_follows_each_on(
    model_factory: Callable,
) -> None:
    """run_steps (--decode-steps): rows ask for 4, 2, 1 and 3 decode steps of one plan; each step
    feeds a row the token the one before sampled. Every row's tokens equal LocalEngine's greedy run,
    and a plan ahead of it follows each row on from its own last token, whichever step sampled it. A
    row whose shard fails in a later step fails whole."""
    from fastdecode.contract import LAST_SAMPLE
    from fastdecode.dense.multistep import run_steps

    path = model_factory("llama")
    want = {
        f"s{i}": g.token_ids
        for i, g in enumerate(LocalEngine.from_pretrained(path).generate(PROMPTS, 6, ignore_eos=True))
    }
    model = DenseModel.from_pretrained(path, "cpu", torch.float32)
    shards = InProcessShards(model, 2)
    for i, _ in enumerate(PROMPTS):
        shards.stores[i % 2].reserve(f"s{i}", 64)
    runner = StepRunner(model, shards)
    steps = [4, 2, 1, 3]

    async def run() -> tuple[dict[str, list[int]], dict[str, list[int]], BaseException | None]:
        seqs = [PlannedSeq(f"s{i}", i % 2, i % 2, p, 0, steps=steps[i]) for i, p in enumerate(PROMPTS)]
        out, t = await run_steps(runner, seqs)
        assert len(t) == 4 and all(each.step_seconds > 0 for each in t)  # one timing per decode step
        first = {sid: [o.token_id, *(a.token_id for a in o.after)] for sid, o in out.items()}
        ahead = [
            PlannedSeq(
                f"s{i}",
                i % 2,
                i % 2,
                [LAST_SAMPLE],
                len(p) + steps[i] - 1,
                sample_index=steps[i],
                use_last_sample=True,
                steps=2,
            )
            for i, p in enumerate(PROMPTS)
        ]
        plain_run, calls = runner.run, 0

        async def shard_1_lost_after_one_step(seqs: Sequence[PlannedSeq], pipeline: bool = True) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:  # s1 and s3 sampled in this plan's first step, then their shard is gone
                shards.dead.add(1)
            return await plain_run(seqs, pipeline)

        runner.run = shard_1_lost_after_one_step  # type: ignore[method-assign]
        out, _ = await run_steps(runner, ahead)
        assert calls == 2
        second = {
            sid: [o.token_id, *(a.token_id for a in o.after)] for sid, o in out.items() if o.error is None
        }
        return first, second, out["s3"].error

    first, second, failed = asyncio.run(run())
    for i in range(len(PROMPTS)):
        assert first[f"s{i}"] == want[f"s{i}"][: steps[i]]
    for i in (0, 2):
        assert second[f"s{i}"] == want[f"s{i}"][steps[i] : steps[i] + 2]
    assert isinstance(failed, Unavailable) and set(second) == {"s0", "s2"}
