"""One mini-batch's pass through its layers in the dense step, as the runner's layer loop
(`StepRunner._layers`, runner.py) keeps it: the rows of each shard (a `Group`), the items a layer
sends them (the runner's `AttendItem`s), the answers taken back, and the S-part's compute between
two layers' attends. Imports no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from fastdecode.contract import PlannedSeq
from fastdecode.dense.emulated import EmulatedModel
from fastdecode.dense.handoff import Staging
from fastdecode.dense.plane import Answered, Stage
from fastdecode.model.dense import DenseModel
from fastdecode.model.lora import LoraBatch

Item = TypeVar("Item")  # the runner's AttendItem: the pass keeps a layer's items and never looks inside


@dataclass
class Group:
    """The rows of one shard in a mini-batch; the request fields are built once per step (each
    layer's item of them: the runner's `AttendItem.of`)."""

    shard: int
    rows: slice
    seqs: list[PlannedSeq]
    error: BaseException | None = None

    def finish(self) -> None:
        self.seq_ids = [s.seq_id for s in self.seqs]
        self.num_tokens = [len(s.token_ids) for s in self.seqs]
        self.start_pos = [s.start_pos for s in self.seqs]


@dataclass(slots=True)
class LayerPass(Generic[Item]):
    """One mini-batch's way through its layers: what every layer reads, read once (its rows'
    positions and LoRA batch, the plane's staging, whether the device's values are synthetic), and
    what the loop keeps from one layer to the next (the staging the plane lent it, the items built
    in it, the last layer's answers)."""

    model: DenseModel | EmulatedModel
    slot: int
    groups: list[Group]
    pos: torch.Tensor
    lora: LoraBatch | None
    num_layers: int
    stage: Stage | None  # the plane's staging (None: items of each layer's own tensors)
    synthetic: bool  # an emulated device's q, k, v and o: charged on its clock, no values read
    st: Staging | None = None
    items: list[Item] = field(default_factory=list)
    live: list[Group] = field(default_factory=list)  # the groups `items` are of
    verified: list[torch.Tensor] = field(default_factory=list)  # last answers found in order in st.o
    parts: list[tuple[slice, torch.Tensor]] = field(default_factory=list)  # each answered group's o
    whole: torch.Tensor | None = None  # st.o, when every group answered into its own rows of it

    def embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The hidden states, and layer 0's q, k, v."""
        h = self.model.embed(ids)
        return (h, *self.model.pre_attention(0, h, self.pos, self.lora))

    def take(self, answer: Answered) -> None:
        """A layer's answers: a group that failed is out of the step; the others' o go to `parts`,
        and to `whole` when all of them lie in their own rows of the staging's o."""
        if answer.repeated and self.whole is not None:
            return  # the very answers of the slot's last layer, as the plane says: taken as those were
        parts: list[tuple[slice, torch.Tensor]] = []
        for g, o in zip(self.live, answer.outs, strict=True):
            if isinstance(o, BaseException):
                g.error = o
            else:
                parts.append((g.rows, o))
        self.parts, self.whole = parts, None
        st = self.st
        if st is not None and len(parts) == len(self.groups):
            answers = [o for _, o in parts]
            # exchange workers answer a step's layers into the same views of the staging's o: their
            # places are checked once, and the same tensors need no check again
            if len(self.verified) == len(answers) and all(
                a is b for a, b in zip(answers, self.verified, strict=True)
            ):
                self.whole = st.o
            elif self._in_order(st, parts, len(self.groups)):
                self.whole, self.verified = st.o, answers

    @staticmethod
    def _in_order(st: Staging, parts: list[tuple[slice, torch.Tensor]], groups: int) -> bool:
        """Whether every group answered, each o lying in its own rows of the staging's o."""
        if len(parts) != groups:
            return False
        o = st.o
        row_bytes = o[0].nbytes if len(o) else 0
        for rows, part in parts:
            at = o.data_ptr() + rows.start * row_bytes
            if (
                part.dtype != o.dtype
                or part.nbytes != (rows.stop - rows.start) * row_bytes
                or part.data_ptr() != at
            ):
                return False
        return True

    def post(
        self, layer: int, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """post_attention of `layer` over the answers taken, and pre_attention of the next layer
        (one compute call); after the last layer, the hidden states alone."""
        model, parts, whole = self.model, self.parts, self.whole
        if whole is not None:  # every item answered into its rows of the staging's o
            # (an emulated device charges o's copy itself and reads no values: no meta op)
            attn = whole if self.synthetic else whole.to(device=h.device, dtype=h.dtype)
        elif len(parts) == 1 and parts[0][0] == slice(0, h.shape[0]):
            attn = parts[0][1].to(device=h.device, dtype=h.dtype)  # one shard answered all
        else:
            attn = torch.zeros(h.shape[0], model.q_size, dtype=h.dtype, device=h.device)
            for rows, o in parts:
                attn[rows] = o.to(device=h.device, dtype=h.dtype)
        h = model.post_attention(layer, h, attn, self.lora)
        if layer + 1 == self.num_layers:
            return h, None, None, None
        return (h, *model.pre_attention(layer + 1, h, self.pos, self.lora))


def groups_of(seqs: list[PlannedSeq]) -> list[Group]:
    """A mini-batch's rows (sorted by shard) as its shards' groups, each one's request fields built."""
    groups: list[Group] = []
    row = 0
    for s in seqs:
        n = len(s.token_ids)
        if groups and groups[-1].shard == s.shard:
            g = groups[-1]
            g.rows = slice(g.rows.start, row + n)
            g.seqs.append(s)
        else:
            groups.append(Group(s.shard, slice(row, row + n), [s]))
        row += n
    for g in groups:
        g.finish()
    return groups
