"""A tensor-parallel S-part: the weights of each layer split over N ranks as Megatron-LM lays them
out, the ranks talking over torch.distributed (NCCL between GPUs, gloo between CPU processes).

- q, k, v (column-parallel): rank r computes heads [r H/N, (r+1) H/N) and KV heads
  [r KVH/N, (r+1) KVH/N): a rank's query heads read only its own KV heads, as GQA groups them.
- o and down (row-parallel): each rank multiplies its slice of the input features; an all-reduce
  sums the partial outputs, then the bias, the norms and the residual apply once, on every rank.
- gate and up (column-parallel) and each expert's gate, up and down split by the intermediate
  size; the router is whole on every rank.
- The LM head is vocabulary-parallel: each rank scores a slice of the vocabulary, rank 0 gathers.

The R-part stays per sequence (the FastDecode paper, section 5.3): rank 0 is the one gpu_dense the
scheduler and the shards see. It gathers every rank's q, k, v heads into the rows the shards
attend, and with each layer call it broadcasts the rows the ranks need (hidden states, attention
outputs). Megatron keeps hidden states replicated and sends none of that; here the broadcast is
what lets one runner drive the ranks without their own copy of the step's batching: B x hidden
elements a call (4 MiB at B = 256 of an 8K-hidden bf16 model, ~10 us over NVLink).

Rank 0 drives: each call it makes on the model (pre_attention, post_attention, logits) first
broadcasts a command, and the other ranks, in `follow`, run the same call on their slices; a lock
keeps one call's collectives together when the two mini-batches' threads call at once. Pure torch,
no gRPC; the processes are services/gpu_dense/ranks.py's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import fields
from enum import IntEnum
from pathlib import Path

import torch
import torch.distributed as dist

from fastdecode.model.config import ModelConfig, check_tensor_parallel
from fastdecode.model.dense import DenseModel, Experts, Layer, resolve_device
from fastdecode.model.lora import LoraBatch
from fastdecode.model.weights import load_weights
from fastdecode.runtime.errors import InvalidInput


class Op(IntEnum):
    STOP = 0
    PRE = 1
    POST = 2
    LOGITS = 3


class RankGroup:
    """This process's place in the ranks and the collectives the model needs; rank 0 leads."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.lock = threading.Lock()  # one call's collectives at a time (two mini-batches' threads)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def send(self, op: Op, layer: int, *tensors: torch.Tensor) -> None:
        """Rank 0: a command, then its tensors, to every rank."""
        rows = tensors[0].shape[0] if tensors else 0
        dist.broadcast(torch.tensor([int(op), layer, rows], dtype=torch.int64, device=self.device), 0)
        for t in tensors:
            dist.broadcast(t.contiguous(), 0)

    def command(self) -> tuple[Op, int, int]:
        header = torch.empty(3, dtype=torch.int64, device=self.device)
        dist.broadcast(header, 0)
        op, layer, rows = header.tolist()
        return Op(op), layer, rows

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(t, 0)
        return t

    def gather(self, part: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `part` (same shape everywhere) on rank 0, in rank order; None elsewhere."""
        part = part.contiguous()
        parts = [torch.empty_like(part) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(part, parts, dst=0)
        return parts


class TensorParallelModel(DenseModel):
    """DenseModel's interface over one rank's slices. On rank 0 every S-part call leads the other
    ranks through it; `follow` is the loop the other ranks run."""

    group: RankGroup

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str,
        dtype: torch.dtype,
        group: RankGroup,
        progress: Callable[[int, int], None] | None = None,
    ) -> TensorParallelModel:
        """The checkpoint's weights, read on the CPU and this rank's slices moved to `device`."""
        config = ModelConfig.from_pretrained(path)
        check_tensor_parallel(config, group.world)
        dev = resolve_device(device)
        required, optional = cls.tensor_names(config)
        tensors = load_weights(
            path, required, dtype=dtype, device="cpu", optional=optional, progress=progress
        )
        model = cls(config, tensors, torch.device("cpu"), dtype)
        del tensors
        model.group = group
        model._split(group.rank, group.world)
        model._to(dev)
        model.reduce = group.all_reduce
        return model

    def _split(self, rank: int, world: int) -> None:
        c, d = self.config, self.config.head_dim
        self.heads, self.kv_heads = c.num_attention_heads // world, c.num_key_value_heads // world
        q, kv = self.heads * d, self.kv_heads * d
        heads = [(rank * q, q), (self.q_size + rank * kv, kv), (self.q_size + self.kv_size + rank * kv, kv)]
        for w in self.layers:
            w.qkv_w = _rows(w.qkv_w, heads)
            w.qkv_b = None if w.qkv_b is None else _rows(w.qkv_b, heads)
            w.o_w = w.o_w[:, rank * q : (rank + 1) * q].clone()
            if w.experts is not None:
                w.experts = _split_experts(w.experts, rank, world)
            else:
                inter = w.gate_up_w.shape[0] // 2  # type: ignore[union-attr]
                part = inter // world
                halves = [(rank * part, part), (inter + rank * part, part)]
                w.gate_up_w = _rows(w.gate_up_w, halves)  # type: ignore[arg-type]
                w.gate_up_b = None if w.gate_up_b is None else _rows(w.gate_up_b, halves)
                w.down_w = w.down_w[:, rank * part : (rank + 1) * part].clone()  # type: ignore[index]
        # The vocabulary in equal slices (the last padded with zero rows), so the gather is even.
        vocab = self.lm_head_w.shape[0]
        chunk = -(-vocab // world)
        head = self.lm_head_w[rank * chunk : (rank + 1) * chunk]
        if head.shape[0] < chunk:
            head = torch.cat([head, head.new_zeros(chunk - head.shape[0], head.shape[1])])
        self.lm_head_w = head.clone()
        if rank:  # only rank 0 embeds
            self.embed_w = self.embed_w[:0].clone()

    def _to(self, device: torch.device) -> None:
        self.device = device
        for w in self.layers:
            for f in fields(Layer):
                value = getattr(w, f.name)
                if isinstance(value, torch.Tensor):
                    setattr(w, f.name, value.to(device))
                elif isinstance(value, Experts):
                    setattr(
                        w,
                        f.name,
                        Experts(*(t.to(device) for t in (value.router_w, value.gate_up_w, value.down_w))),
                    )
        self.embed_w, self.lm_head_w = self.embed_w.to(device), self.lm_head_w.to(device)
        self.final_norm = self.final_norm.to(device)
        if self.embed_scale is not None:
            self.embed_scale = self.embed_scale.to(device)
        for r in self.ropes:
            r.inv_freq = r.inv_freq.to(device)
            r.long_inv_freq = None if r.long_inv_freq is None else r.long_inv_freq.to(device)
        self.inv_freq = self.inv_freq.to(device)

    # ---- rank 0: each call leads the other ranks through it --------------------------------
    def pre_attention(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, lora: LoraBatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if lora is not None:
            raise InvalidInput("LoRA adapters are not served with --tensor-parallel")
        positions = positions.to(self.device)
        with self.group.lock:
            self.group.send(Op.PRE, layer, hidden, positions)
            return self._pre(layer, hidden, positions)

    def post_attention(
        self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor, lora: LoraBatch | None = None
    ) -> torch.Tensor:
        if lora is not None:
            raise InvalidInput("LoRA adapters are not served with --tensor-parallel")
        rows = torch.cat([hidden, attn_out.to(device=hidden.device, dtype=hidden.dtype)], dim=1)
        with self.group.lock:
            self.group.send(Op.POST, layer, rows)
            return self._post(layer, rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.group.lock:
            self.group.send(Op.LOGITS, 0, hidden)
            return super().logits(hidden)

    def close(self) -> None:
        """Rank 0: the other ranks leave `follow`."""
        with self.group.lock:
            self.group.send(Op.STOP, 0)

    # ---- every rank ------------------------------------------------------------------------
    def _pre(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().pre_attention(layer, hidden, positions)
        t, d = q.shape[0], self.config.head_dim
        parts = self.group.gather(torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1))
        if parts is None:
            return q, k, v
        qs, ks = self.heads * d, (self.heads + self.kv_heads) * d
        full = [torch.cat([p[:, lo:hi] for p in parts], dim=1) for lo, hi in ((0, qs), (qs, ks), (ks, None))]
        c = self.config
        return (
            full[0].view(t, c.num_attention_heads, d),
            full[1].view(t, c.num_key_value_heads, d),
            full[2].view(t, c.num_key_value_heads, d),
        )

    def _post(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        h, q = self.config.hidden_size, self.heads * self.config.head_dim
        lo = h + self.group.rank * q
        return super().post_attention(layer, rows[:, :h], rows[:, lo : lo + q])

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        part = super()._lm_head(x)
        parts = self.group.gather(part)
        if parts is None:
            return part
        return torch.cat(parts, dim=1)[:, : self.config.vocab_size]

    def follow(self) -> None:
        """Ranks 1..N-1: run what rank 0 leads until it says stop."""
        g, c = self.group, self.config
        while True:
            op, layer, rows = g.command()
            if op == Op.STOP:
                return
            if op == Op.PRE:
                hidden = g.receive((rows, c.hidden_size), self.dtype)
                self._pre(layer, hidden, g.receive((rows,), torch.int64))
            elif op == Op.POST:
                self._post(layer, g.receive((rows, c.hidden_size + self.q_size), self.dtype))
            else:
                super().logits(g.receive((rows, c.hidden_size), self.dtype))


def _rows(t: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The rows (dim 0) of each (start, length) span of `t`, in order, as one new tensor."""
    return torch.cat([t[lo : lo + n] for lo, n in spans]).contiguous()


def _split_experts(e: Experts, rank: int, world: int) -> Experts:
    inter = e.gate_up_w.shape[1] // 2
    part = inter // world
    lo = rank * part
    gate_up = torch.cat(
        [e.gate_up_w[:, lo : lo + part], e.gate_up_w[:, inter + lo : inter + lo + part]], dim=1
    )
    return Experts(e.router_w, gate_up.contiguous(), e.down_w[:, :, lo : lo + part].contiguous())
