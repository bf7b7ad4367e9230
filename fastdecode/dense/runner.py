"""The dense step: S-part layer by layer, attention on the shards, two mini-batches pipelined.

Each mini-batch loops over its layers (`_layers`, what it keeps from one layer to the next a
`LayerPass`: layer_pass.py): post_attention of layer l and pre_attention of l+1 (one compute call),
then the layer's items to all of its shards, and the answers back; while one mini-batch waits on its
shards (other processes, other hardware), the other computes. With the S-part on the host's CPU both
loops run on the event loop (a hop to a thread and back per layer cost more than it saved, `bench
transport --breakdown`, and threads would share its cores); off the host (a GPU, an emulated one),
with a plane that attends blocking, each runs on a thread of its own (layer_loop.py). Then the
step's sampling rows go through the LM head (head.py; rows with drafts are verified: verify.py).
Imports no gRPC: the shards and the device are the ones plane.py declares (the gRPC planes:
services/gpu_dense/exchange/).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar, cast

import torch

from fastdecode.contract import LAST_SAMPLE, PlannedSeq, TokenLogprob
from fastdecode.dense.emulated import EmulatedModel
from fastdecode.dense.engine import SeqChunk, pack
from fastdecode.dense.grammar import GrammarBank
from fastdecode.dense.handoff import Staging, copy_into
from fastdecode.dense.head import HeadRows, sample_head
from fastdecode.dense.layer_loop import Layers, LayerThreads, Meter, on_loop
from fastdecode.dense.layer_pass import Group, LayerPass, groups_of
from fastdecode.dense.loras import LoraBank, resolve_row, step_batch
from fastdecode.dense.outcome import Outcome, Timings
from fastdecode.dense.pipeline import PipelineChooser
from fastdecode.dense.plane import Answered, Device, LayerPlane, PlainPlane, ShardPlane, SyncDevice, declares
from fastdecode.dense.sampling import top_logprobs
from fastdecode.dense.verify import check_drafts, verify_rows
from fastdecode.kv import AttendBatch
from fastdecode.model.dense import DenseModel
from fastdecode.model.lora import LoraAdapter
from fastdecode.runtime.errors import FailedPrecondition, InvalidInput, NotFound

T = TypeVar("T")
NOTHING = Answered([])  # a layer with no items to send (every group failed): no answers
log = logging.getLogger("fastdecode.gpu_dense.runner")
# Token histories kept for penalized sequences: the least recently stepped go first past this many
# (a sequence that ends is dropped through `forget`; this bounds what a missed release can leave).
MAX_HISTORIES = 4096


@dataclass(slots=True)
class AttendItem:
    """One shard's share of one layer of one mini-batch: the shard's index and what it attends
    (built per layer and group: slots, and the batch's tensors are views of the layer's rows)."""

    shard: int
    batch: AttendBatch

    @staticmethod
    def of(g: Group, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttendItem:
        """A group's item of a layer: its rows of q, k and v (views, no copy)."""
        r = g.rows
        return AttendItem(g.shard, AttendBatch(g.seq_ids, g.num_tokens, g.start_pos, q[r], k[r], v[r]))


@dataclass(slots=True)
class _Admitted:
    """A step's rows once checked: each sequence's outcome so far (a refused row's: its error), the
    valid rows in the plan's order, and each one's token history (None: its sampling needs none)."""

    outcomes: dict[str, Outcome]
    valid: list[PlannedSeq]
    history: dict[str, list[int] | None]


class StepRunner:
    def __init__(
        self,
        model: DenseModel | EmulatedModel,
        shards: LayerPlane[AttendItem] | ShardPlane[AttendItem],
        chooser: PipelineChooser | None = None,
        grammars: GrammarBank | None = None,
        loras: LoraBank | None = None,
    ) -> None:
        self.model = model
        self.loras = loras  # None: LoRA is off (a row naming an adapter fails FAILED_PRECONDITION)
        self._adapters: dict[str, LoraAdapter] = {}  # this step's rows that run with an adapter
        self.grammars = grammars  # None: requests with a grammar fail (no tokenizer here)
        self.shards = shards
        # what the plane and the device can do, as they declare it (one that declares nothing: none)
        self.plane: LayerPlane[AttendItem] = (
            cast(LayerPlane[AttendItem], shards) if declares(shards, LayerPlane) else PlainPlane(shards)
        )
        self.device = cast(Device, model) if declares(model, Device) else SyncDevice(model.settle)
        # None: follow each plan's pipeline flag; else the plan's flag allows, the chooser decides
        self.chooser = chooser
        self._meters: list[Meter] = []  # this step's: [the step's own, slot 0, slot 1]
        self._threads: LayerThreads | None = None  # the slots' layer loops, when threaded
        self._failures: dict[str, BaseException] = {}
        # prompt + generated tokens of each penalized sequence, rebuilt from the chunks it is fed: a
        # re-prefill (start_pos 0: recovery, preemption) starts it again, a re-run step truncates it
        self._history: OrderedDict[str, list[int]] = OrderedDict()
        self._prompt: dict[str, list[TokenLogprob]] = {}  # this step's prompt logprobs, per sequence
        self.mask_seconds = 0.0  # the last step's grammar mask time (on a worker thread)
        self._lock = asyncio.Lock()  # one step at a time: timings and failures are per step
        # per slot, the staging arena a synthetic (emulated) device's q, k, v were copied into, and rows
        self._staged: dict[int, tuple[object, int]] = {}
        # the tokens sampled in the last step run: a sequence planned one step ahead feeds its own
        self.last_samples: dict[str, int] = {}  # what a row planned ahead follows on from

    @property
    def num_shards(self) -> int:
        return self.shards.num_shards

    @staticmethod
    def _compute(fn: Callable[[], T], meter: Meter) -> T:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn()
        finally:
            meter.busy += time.perf_counter() - t0
            meter.busy_cpu += time.thread_time() - c0

    @staticmethod
    def _fill_last_sample(s: PlannedSeq, last: dict[str, int]) -> None:
        """A sequence planned one step ahead: its token is the one sampled for it in the step before."""
        if not (s.sample and s.token_ids == [LAST_SAMPLE]):
            raise InvalidInput("use_last_sample needs sample and no token ids of its own")
        tok = last.get(s.seq_id)
        if tok is None:
            raise FailedPrecondition(
                f"sequence {s.seq_id!r} was planned ahead, but the step before sampled nothing for it"
            )
        s.token_ids = [tok]

    def validate(self, s: PlannedSeq, checked: set[int] | None = None) -> None:
        c = self.model.config
        if not s.seq_id:
            raise InvalidInput("empty sequence id")
        if not 0 <= s.shard < self.num_shards:
            raise InvalidInput(f"shard {s.shard} outside [0, {self.num_shards})")
        if s.mini_batch not in (0, 1):
            raise InvalidInput(f"mini_batch must be 0 or 1, got {s.mini_batch}")
        if not s.token_ids:
            raise InvalidInput("no new tokens")
        if s.steps > 1 and not (s.sample and s.next_token is None):
            raise InvalidInput("several decode steps need a row that samples and scores no prompt")
        if min(s.token_ids) < 0 or max(s.token_ids) >= c.vocab_size:
            raise InvalidInput(f"token id outside the vocabulary [0, {c.vocab_size})")
        if s.start_pos < 0 or s.start_pos + len(s.token_ids) > c.max_position_embeddings:
            raise InvalidInput(f"positions outside [0, {c.max_position_embeddings})")
        if s.next_token is not None and not 0 <= s.next_token < c.vocab_size:
            raise InvalidInput(f"next_token_id outside the vocabulary [0, {c.vocab_size})")
        if s.drafts:
            check_drafts(s)
        if s.sampling.lora:  # resolved at validation: an unload mid-step changes no row of it
            self._adapters[s.seq_id] = resolve_row(self.loras, s)  # type: ignore[assignment]
        if checked is not None and id(s.sampling) in checked:
            return  # a step's sequences share their SamplingParams (wire/dense.py): checked once
        s.sampling.validate()
        named = s.sampling.token_ids()
        if named and (min(named) < 0 or max(named) >= c.vocab_size):
            raise InvalidInput(
                f"a sampling parameter names a token outside the vocabulary [0, {c.vocab_size})"
            )
        if checked is not None:
            checked.add(id(s.sampling))

    def forget(self, seq_ids: Iterable[str]) -> None:
        """These sequences ended: drop what the runner kept for them."""
        seq_ids = list(seq_ids)
        for sid in seq_ids:
            self._history.pop(sid, None)
        if self.grammars is not None:
            self.grammars.forget(seq_ids)

    def _track(self, s: PlannedSeq) -> list[int] | None:
        """The sequence's history after this step's tokens (None when its sampling needs none)."""
        if not s.sampling.needs_history:
            return None
        hist = [] if s.start_pos == 0 else self._history.get(s.seq_id)
        if hist is None or len(hist) < s.start_pos:
            raise FailedPrecondition(
                f"sequence {s.seq_id!r}: gpu_dense holds no token history up to position {s.start_pos}"
                " (it restarted): the penalties need the sequence prefilled again"
            )
        del hist[s.start_pos :]
        hist.extend(s.token_ids)
        self._history[s.seq_id] = hist
        self._history.move_to_end(s.seq_id)
        while len(self._history) > MAX_HISTORIES:
            self._history.popitem(last=False)
        return hist

    def _start_masks(
        self, seqs: Sequence[PlannedSeq], history: dict[str, list[int] | None]
    ) -> asyncio.Future[dict[str, torch.Tensor | BaseException]] | None:
        rows: list[tuple[str, str, list[int], list[int]]] = []
        failed: dict[str, torch.Tensor | BaseException] = {}
        if self.grammars is not None:  # builds start now, even for prefill chunks that sample later
            self.grammars.prepare(s.sampling.grammar for s in seqs if s.sampling.grammar)
        deadline = time.perf_counter() + (self.grammars.wait_s if self.grammars is not None else 0.0)
        for s in seqs:
            if not (s.sample and s.sampling.grammar):
                continue
            hist = history.get(s.seq_id) or []
            if self.grammars is None:
                failed[s.seq_id] = FailedPrecondition(
                    "structured outputs are off: gpu_dense has no tokenizer"
                )
            elif s.sample_index > len(hist):
                failed[s.seq_id] = InvalidInput(
                    f"sample_index {s.sample_index} exceeds the sequence's tokens"
                )
            else:  # the history ends with the row's drafts (a mask for each: verify.py)
                end = len(hist) - s.drafts
                rows.append((s.seq_id, s.sampling.grammar, hist[end - s.sample_index : end], hist[end:]))
        if not rows and not failed:
            return None
        bank = self.grammars

        def compute() -> dict[str, torch.Tensor | BaseException]:
            t0 = time.perf_counter()
            out = dict(failed)
            if rows and bank is not None:  # a row with drafts gets a mask per position, [d + 1, V]
                masks = bank.draft_masks(rows, deadline)
                for r, m in zip(rows, masks, strict=True):
                    out[r[0]] = m if isinstance(m, BaseException) or r[3] else m[0]
            self.mask_seconds = time.perf_counter() - t0
            return out

        return asyncio.ensure_future(asyncio.to_thread(compute))

    def _prompt_logprobs(self, s: PlannedSeq, hidden: torch.Tensor) -> list[TokenLogprob]:
        """Scores of the chunk's tokens after its first (and of next_token) from its rows' logits."""
        targets = list(s.token_ids[1:]) + ([s.next_token] if s.next_token is not None else [])
        if not targets:
            return []
        lp = torch.log_softmax(self.model.logits(hidden[: len(targets)]).float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None]).squeeze(1).tolist()
        tops = top_logprobs(lp, s.sampling.top_logprobs)
        return [TokenLogprob(t, c, top) for t, c, top in zip(targets, chosen, tops, strict=True)]

    def _staged_already(self, slot: int, st: Staging, rows: int) -> bool:
        """Whether an emulated device's q, k, v already lie in this staging: they are the same
        synthetic rows every layer and their device-to-host copy is charged on its clock, so they
        are copied once per arena, as a GPU's DMA would cost the host no CPU."""
        if not self.device.synthetic:
            return False
        done = self._staged.get(slot)
        if done is not None and done[0] is st.arena and done[1] >= rows:
            return True
        self._staged[slot] = (st.arena, rows)  # the copy that follows puts them there
        return False

    @staticmethod
    def _to_staging(st: Staging, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q, k, v into the plane's staging."""
        for dst, src in ((st.q, q), (st.k, k), (st.v, v)):
            copy_into(dst, src)

    async def _mini_batch(self, slot: int, seqs: list[PlannedSeq]) -> torch.Tensor:
        """All layers for one mini-batch (seqs sorted by shard); returns last-token hidden states.
        The layer loop (`_layers`) runs on the event loop, or on a thread of its own when the S-part
        is off the host (a GPU's, an emulated one's) and the plane attends blocking: there, a layer
        is one send and one read on the slot's own socket, with no event-loop turn, task wake-up or
        future between them (the loop's own work was ~half the dense process's CPU per layer at a
        GPU's pace). On the host's CPU the S-part stays on the loop (the other mini-batch computes
        while this one waits; threads would share its cores)."""
        meter = self._meters[slot + 1]
        blocking = self.plane.attend_layer_blocking
        if blocking is not None and self.model.device.type != "cpu":
            if self._threads is None:
                self._threads = LayerThreads()
            layers = self._layers(slot, seqs, meter, waits_for_device=True)
            return await self._threads.run(slot, layers, blocking, self.device, meter)
        layers = self._layers(slot, seqs, meter, waits_for_device=self.plane.attend_layer_at is not None)
        return await on_loop(slot, layers, self.plane, self.device, meter)

    def _layers(
        self, slot: int, seqs: list[PlannedSeq], meter: Meter, waits_for_device: bool
    ) -> Layers[AttendItem]:
        """The mini-batch's layer loop, without its waits (layer_loop.py drives it): it yields what it
        needs (a layer's items to the shards, or the device's results) and is sent the answer. The
        prompt logprobs a sequence asks for are scored here, from all of its chunk's rows.
        `waits_for_device`: the plane's attend, as the driver calls it, takes the time the layer's
        q, k, v are ready (attend_layer_at, or the blocking attend) and waits for the device itself."""
        model = self.model
        ids, pos, last = pack([SeqChunk(s.seq_id, s.token_ids, s.start_pos) for s in seqs], model.device)
        groups = groups_of(seqs)
        num_layers = model.config.num_hidden_layers
        lora = step_batch(seqs, self._adapters, model.device)
        device = self.device
        run: LayerPass[AttendItem] = LayerPass(
            model, slot, groups, pos, lora, num_layers, self.plane.staging, device.synthetic
        )
        hidden, q, k, v = self._compute(lambda: run.embed(ids), meter)
        # On a device whose results come later (an emulated one's clock), a plane that waits for the
        # device itself (exchange workers hold a layer's bytes until its q, k, v are ready) spares
        # this loop a timer and a wake-up per layer: the layer goes out, with its ready time, as soon
        # as its device work is queued. Else the loop waits for the device (the other mini-batch
        # runs meanwhile), then hands the layer over.
        ready_at = device.ready_at
        defer = ready_at is not None and waits_for_device
        if not defer:
            yield None
        for layer in range(num_layers):
            items = self._layer_items(run, q, k, v, meter)
            meter.trips += len(items)
            answer: Answered | None = NOTHING
            if items:
                answer = yield (layer, items, ready_at() if ready_at is not None and defer else None)
            assert answer is not None
            run.take(answer)
            hidden, q, k, v = self._compute(lambda h=hidden, lyr=layer: run.post(lyr, h), meter)  # type: ignore[assignment]
            if not defer or layer + 1 == num_layers:
                yield None
        return self._last_rows(seqs, groups, hidden, last, meter)

    def _layer_items(
        self, run: LayerPass[AttendItem], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meter: Meter
    ) -> list[AttendItem]:
        """The layer's items for the shards, one per group still in the step. A plane that offers
        staging (exchange workers) takes q, k, v in shared memory: the items are built once per step
        as row ranges of it (again only when a group fails), and each layer is one copy in (a DMA
        from a GPU) and o back in order, with no per-item copy or message. Else each layer's items
        are views of its own q, k, v."""
        if run.stage is not None:
            if run.st is None:
                run.st = run.stage(run.slot, q.shape[0], tuple(q.shape[1:]), tuple(k.shape[1:]), q.dtype)
            if not self._staged_already(run.slot, run.st, q.shape[0]):
                self._compute(partial(self._to_staging, run.st, q, k, v), meter)
        st = run.st
        if st is None:  # items of this layer's tensors
            run.live = [g for g in run.groups if g.error is None]
            run.items = [AttendItem.of(g, q, k, v) for g in run.live]
        elif not run.items or any(g.error is not None for g in run.live):  # the step's, in the staging
            run.live = [g for g in run.groups if g.error is None]
            run.items = [AttendItem.of(g, st.q, st.k, st.v) for g in run.live]
        return run.items

    def _last_rows(
        self,
        seqs: list[PlannedSeq],
        groups: list[Group],
        hidden: torch.Tensor,
        last: torch.Tensor,
        meter: Meter,
    ) -> torch.Tensor:
        """After the last layer: the groups' failures kept for the step, the prompt logprobs asked
        scored from each chunk's rows, and the hidden states the head reads: each sequence's last
        token's (a row with drafts: its last drafts + 1 positions)."""
        self._failures.update({s.seq_id: g.error for g in groups if g.error is not None for s in g.seqs})
        row = 0
        for s in seqs:
            if s.sampling.prompt_logprobs and s.seq_id not in self._failures:
                h, start = hidden, row
                self._prompt[s.seq_id] = self._compute(
                    lambda s=s, h=h, start=start: self._prompt_logprobs(
                        s, h[start : start + len(s.token_ids)]
                    ),
                    meter,
                )
            row += len(s.token_ids)
        if any(s.drafts for s in seqs):  # a row with drafts: its last drafts + 1 positions
            sel, row = [], 0
            for s in seqs:
                row += len(s.token_ids)
                sel += range(row - 1 - s.drafts, row)
            last = torch.tensor(sel, device=hidden.device)
        return hidden.index_select(0, last)

    async def run(
        self, seqs: Sequence[PlannedSeq], pipeline: bool = True
    ) -> tuple[dict[str, Outcome], Timings]:
        async with self._lock:
            return await self._run(seqs, pipeline)

    async def _run(self, seqs: Sequence[PlannedSeq], pipeline: bool) -> tuple[dict[str, Outcome], Timings]:
        """One step: its rows checked, the grammar masks started, the mini-batches through their
        layers (both at once when piped), the sampling rows through the head, the outcomes."""
        t0 = time.perf_counter()
        self._meters = [Meter(), Meter(), Meter()]
        self._failures = {}
        self._prompt = {}
        self._adapters = {}
        # (a step that fails leaves none: nothing follows on from it)
        last, self.last_samples = self.last_samples, {}
        admitted = self._admit(seqs, last)
        valid = admitted.valid
        # The grammar masks need only the tokens known now: computed on a worker thread (llguidance
        # drops the GIL) while the layers run, so their cost hides behind the step.
        masks = self._start_masks(valid, admitted.history)
        split = [[s for s in valid if s.mini_batch == mb] for mb in (0, 1)]
        piped = pipeline and all(split)  # one empty half: nothing to overlap
        if piped and self.chooser is not None:
            piped = self.chooser.choose()
        batches = split if piped else [valid]
        batches = [sorted(b, key=lambda s: s.shard) for b in batches if b]
        hiddens = await self._gather(batches)
        ordered = [s for b in batches for s in b]
        allowed = await self._allowed(masks)
        head_cpu = await self._sample(hiddens, ordered, admitted, allowed)
        outcomes = self._conclude(admitted.outcomes)
        elapsed = time.perf_counter() - t0
        if pipeline and all(split) and self.chooser is not None and valid:
            self._record(self.chooser, piped, elapsed, valid)
        return outcomes, self._timings(elapsed, piped, head_cpu)

    def _admit(self, seqs: Sequence[PlannedSeq], last: dict[str, int]) -> _Admitted:
        """The step's rows checked, each valid one's token history tracked; a row refused gets its
        error as its outcome and goes no further."""
        admitted = _Admitted({}, [], {})
        outcomes, valid, history = admitted.outcomes, admitted.valid, admitted.history
        checked: set[int] = set()  # ids of the SamplingParams found valid (alive: seqs holds them)
        for s in seqs:
            try:
                if s.seq_id in outcomes:
                    raise InvalidInput(f"sequence {s.seq_id!r} appears twice in one step")
                if s.use_last_sample:
                    self._fill_last_sample(s, last)
                self.validate(s, checked)
                history[s.seq_id] = self._track(s)
                valid.append(s)
                outcomes[s.seq_id] = Outcome()
            except (InvalidInput, FailedPrecondition, NotFound) as e:
                outcomes[s.seq_id] = Outcome(error=e)
        return admitted

    async def _gather(self, batches: list[list[PlannedSeq]]) -> list[torch.Tensor]:
        """Each mini-batch through its layers, the two at once; their last-token hidden states."""
        tasks = [asyncio.ensure_future(self._mini_batch(i, b)) for i, b in enumerate(batches)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:  # (a cancelled gather returns at once:) both mini-batches end first,
            for t in tasks:  # so that no slot's thread still reads its socket when the next step does
                t.cancel()
            await asyncio.wait(tasks)
            raise

    async def _allowed(
        self, masks: asyncio.Future[dict[str, torch.Tensor | BaseException]] | None
    ) -> dict[str, torch.Tensor]:
        """The tokens each row with a grammar allows; a row whose mask failed fails."""
        allowed: dict[str, torch.Tensor] = {}
        if masks is not None:
            for sid, m in (await masks).items():
                if isinstance(m, BaseException):
                    self._failures[sid] = m
                else:
                    allowed[sid] = m
        return allowed

    async def _sample(
        self,
        hiddens: list[torch.Tensor],
        ordered: list[PlannedSeq],
        admitted: _Admitted,
        allowed: dict[str, torch.Tensor],
    ) -> float:
        """The sampling rows still in the step (`ordered`: the mini-batches' rows, as `hiddens` hold
        them) at the head (rows with drafts are verified apart: verify.py), into their outcomes once
        the device has them; returns the head's CPU time."""
        outcomes = admitted.outcomes
        rows = [i for i, s in enumerate(ordered) if s.sample and s.seq_id not in self._failures]
        if not hiddens:  # no row was valid
            return 0.0
        hidden = torch.cat(hiddens) if len(hiddens) > 1 else hiddens[0]
        at = rows  # each sampling row's position in hidden
        if rows and any(s.drafts for s in ordered):  # rows with drafts are verified apart (verify.py)
            rows, at = verify_rows(self.model, hidden, ordered, rows, outcomes, self._meters[0], allowed)
        if not rows:
            return 0.0
        idx = torch.tensor(at, device=hidden.device)
        head = HeadRows(ordered, rows, admitted.history, allowed)
        c0 = time.process_time()  # every thread: torch's intra-op threads do the sampling's math
        toks, lps, tops = self._compute(lambda: sample_head(self.model, hidden, idx, head), self._meters[0])
        head_cpu = time.process_time() - c0
        await self.device.settle()
        for j, (i, tok, lp) in enumerate(zip(rows, toks, lps, strict=True)):
            outcomes[ordered[i].seq_id] = Outcome(tok, lp, top=tops.get(j, ()))
        return head_cpu

    def _conclude(self, outcomes: dict[str, Outcome]) -> dict[str, Outcome]:
        """The outcomes with the prompt logprobs scored and the step's failures; what the sequences
        sampled is what the next step's rows planned ahead follow on from."""
        for sid, scored in self._prompt.items():
            if sid in outcomes and sid not in self._failures:
                outcomes[sid].prompt = scored
        for sid, err in self._failures.items():
            outcomes[sid] = Outcome(error=err)
        self.last_samples = {
            sid: (o.after[-1] if o.after else o).token_id
            for sid, o in outcomes.items()
            if o.error is None and o.token_id >= 0
        }
        return outcomes

    @staticmethod
    def _record(chooser: PipelineChooser, piped: bool, step: float, valid: list[PlannedSeq]) -> None:
        """The step's time per sequence to the pipeline chooser (a step that could be piped); its
        choice logged once made."""
        decided = chooser.choice is not None
        # steps with prefill chunks cost far more per sequence: compared apart (pipeline.py)
        chooser.record(piped, step / len(valid), all(len(s.token_ids) == 1 for s in valid))
        if not decided and chooser.medians is not None and chooser.choice is not None:
            on, off = chooser.medians
            log.info(
                "pipeline auto: %s (median ms per sequence: piped %.2f, plain %.2f)",
                "on" if chooser.choice else "off",
                on * 1e3,
                off * 1e3,
            )

    def _timings(self, step: float, piped: bool, head_cpu: float) -> Timings:
        """Where the step's time went, summed over its meters (the step's own and each slot's)."""
        busy = sum(m.busy for m in self._meters)
        return Timings(
            busy,
            sum(m.busy_cpu for m in self._meters),
            max(0.0, step - busy),
            step,
            sum(m.attend for m in self._meters),
            piped,
            head_cpu,
            sum(m.trips for m in self._meters),
        )
