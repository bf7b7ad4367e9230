"""An emulated accelerator: the S-part at a GPU's pace, with no weights and no arithmetic.

`--device emulated:h100` (h200, a10, l4, or a JSON profile file) gives gpu_dense an
EmulatedModel in place of DenseModel. It has the checkpoint's config (or a named `--geometry`'s
dims over it) and allocates no weights. Every S-part call charges a device timeline the time the
profile's roofline gives, and the caller waits for it (`await model.settle()`: the event loop runs
the other mini-batch and the network meanwhile). q, k, v and logits are synthetic tensors of the
right shapes and dtypes, so the shards attend real KV and sampling, logprobs, grammar masks and
stop rules run as on a GPU. Hidden states live on torch's `meta` device: they have shapes and no
storage, as tensors that stay on a GPU cost the host nothing.

The roofline (docs/emulated-gpu.md): a kernel group moving `bytes` and doing `flops` takes
    max(bytes / hbm_bandwidth, flops / peak_flops) / efficiency + kernels * kernel_floor.
A layer is two groups: before attention (norm, fused QKV GEMM, RoPE: 3 kernels) and after it (O
GEMM, residual and norm, gate/up GEMM, SiLU-mul, down GEMM: 5 kernels). Bytes are the weights
plus each kernel's activations in and out; FLOPs are 2 per weight per token. The LM head reads its
weights and writes fp32 logits (sampling on the device: 4 more kernels). The copies of q, k, v to
the host and of o back run on a copy engine at the profile's PCIe bandwidth, beside the compute
engine (the other mini-batch computes meanwhile); both are device time, never host CPU.

What stays on the host is what a GPU host runs on its CPU: everything else. One exception is
metered apart: sampling over the synthetic logits runs on the host's CPU (the real code on real
shapes), where a GPU would run it on the device; gpu_dense reports that CPU as
`fastdecode_dense_head_cpu_seconds`, so the benchmarks can count it as device work.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from fastdecode.contract import PlannedSeq
from fastdecode.dense.plane import Device
from fastdecode.model.config import ModelConfig, check_tensor_parallel
from fastdecode.model.lora import LoraBatch
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.geometry import GEOMETRIES, Geometry
from fastdecode.runtime.settings import EMULATED_PREFIX, is_emulated

GIB = 1 << 30


# What a profile's fields may be: a NaN, an infinity or an absurd figure would make every emulated
# step take no time or forever. Wide beside real parts (an L4's 300 GB/s to an H200's 4.8 TB/s of
# HBM, 121 to 989 dense TFLOP/s, PCIe gen4 to NVLink-C2C's 450 GB/s a way, 24 to 141 GiB).
PROFILE_RANGES: dict[str, tuple[float, float]] = {
    "hbm_gbps": (1.0, 100_000.0),
    "peak_tflops": (0.1, 100_000.0),
    "efficiency": (0.01, 1.0),
    "kernel_floor_us": (0.0, 10_000.0),
    "pcie_gbps": (0.1, 10_000.0),
    "memory_gib": (0.5, 65_536.0),
    "link_gbps": (0.1, 10_000.0),
}


@dataclass(frozen=True)
class GPUProfile:
    """What the roofline needs to know about one GPU (the datasheet's dense figures)."""

    name: str
    hbm_gbps: float  # device memory bandwidth, GB/s
    peak_tflops: float  # dense bf16/fp16 tensor-core TFLOP/s (no sparsity)
    efficiency: float  # share of the roofline real kernels reach
    kernel_floor_us: float  # per kernel: launch and tail that no size hides (CUDA graphs assumed)
    pcie_gbps: float  # host <-> device copies, GB/s achieved one way
    memory_gib: float  # device memory
    link_gbps: float = 450.0  # GPU to GPU (tensor parallelism), GB/s one way: NVLink 4's 450

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidInput(f"GPU profile: name must be a non-empty string, got {self.name!r}")
        for field, (lo, hi) in PROFILE_RANGES.items():
            value = getattr(self, field)
            # NaN fails every comparison, so `lo <= value <= hi` refuses it, and infinity is above hi
            ok = isinstance(value, int | float) and not isinstance(value, bool) and lo <= value <= hi
            if not ok:
                raise InvalidInput(
                    f"GPU profile {self.name!r}: {field} must be a finite number in [{lo:g}, {hi:g}], "
                    f"got {value!r}"
                )

    def kernel_seconds(self, nbytes: float, flops: float, kernels: int) -> float:
        """The roofline time of a group of `kernels` kernels moving `nbytes` and doing `flops`."""
        roof = max(nbytes / (self.hbm_gbps * 1e9), flops / (self.peak_tflops * 1e12))
        return roof / self.efficiency + kernels * self.kernel_floor_us * 1e-6

    def copy_seconds(self, nbytes: float) -> float:
        return nbytes / (self.pcie_gbps * 1e9)

    def link_seconds(self, nbytes: float, collectives: int) -> float:
        """`collectives` collectives between GPUs moving `nbytes` per GPU over the links."""
        return nbytes / (self.link_gbps * 1e9) + collectives * COLLECTIVE_FLOOR_US * 1e-6


# Datasheet figures: H100 SXM5 (3.35 TB/s HBM3, 989 TFLOP/s dense bf16, 80 GB), H200 (4.8 TB/s,
# 141 GB, same compute), A10 (600 GB/s, 125 TFLOP/s, 24 GB), L4 (300 GB/s, 121 TFLOP/s, 24 GB).
# PCIe: gen5 x16 ~55 GB/s achieved for H100/H200, gen4 x16 ~25 GB/s for A10 and L4. Efficiency
# 0.8 and a 3 us kernel floor are what decode GEMMs at this size reach with CUDA graphs; measure
# and correct them with `make gpu-check` on the real GPU.
# GPU to GPU: NVLink 4 (H100/H200 SXM) 450 GB/s a way; A10 and L4 have none, so PCIe's.
PROFILES: dict[str, GPUProfile] = {
    "h100": GPUProfile("h100", 3350, 989, 0.8, 3.0, 55, 80, 450),
    "h200": GPUProfile("h200", 4800, 989, 0.8, 3.0, 55, 141, 450),
    "a10": GPUProfile("a10", 600, 125, 0.8, 4.0, 25, 24, 25),
    "l4": GPUProfile("l4", 300, 121, 0.8, 4.0, 25, 24, 25),
}
# A collective's fixed cost (NCCL's small-message all-reduce over 4-8 NVLink GPUs: 10-20 us; less
# with CUDA graphs): what no size hides.
COLLECTIVE_FLOOR_US = 10.0


def load_profile(device: str) -> GPUProfile:
    """The profile `emulated:NAME` or `emulated:FILE.json` (GPUProfile's fields) names."""
    spec = device[len(EMULATED_PREFIX) :] if is_emulated(device) else device
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec)
    if not path.is_file():
        raise InvalidInput(
            f"unknown GPU profile {spec!r}: expected one of {', '.join(sorted(PROFILES))} "
            "or a JSON profile file"
        )
    try:
        fields = json.loads(path.read_text())
        if not isinstance(fields, dict):
            raise TypeError("a profile is one JSON object")
        return GPUProfile(**{"name": path.stem, **fields})
    except (ValueError, TypeError) as e:
        raise InvalidInput(
            f"GPU profile {path}: {e} (fields: {', '.join(GPUProfile.__annotations__)})"
        ) from None


def profile_dict(p: GPUProfile) -> dict[str, float | str]:
    return asdict(p)


def apply_geometry(config: ModelConfig, name: str | None) -> ModelConfig:
    """The checkpoint's config with a named geometry's dims over it (None: the checkpoint's own)."""
    if not name:
        return config
    g = GEOMETRIES.get(name)
    if g is None:
        raise InvalidInput(f"unknown geometry {name!r}; expected one of {', '.join(sorted(GEOMETRIES))}")
    return replace(
        config,
        hidden_size=g.hidden,
        num_attention_heads=g.heads,
        num_key_value_heads=g.kv_heads,
        head_dim=g.head_dim,
        num_hidden_layers=g.num_layers,
        intermediate_size=g.intermediate or config.intermediate_size,
        vocab_size=g.vocab or config.vocab_size,
    )


def geometry_of(c: ModelConfig, name: str = "") -> Geometry:
    return Geometry(
        name or "checkpoint",
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.num_hidden_layers,
        c.intermediate_size,
        c.vocab_size,
    )


@dataclass(frozen=True)
class Roofline:
    """Device times of one model's S-part pieces on one GPU at `itemsize` bytes per element; with
    `tensor_parallel` N, on each of N GPUs holding 1/N of every layer (fastdecode/model/
    tensor_parallel.py's layout), plus what its ranks exchange: each layer call's command and rows
    broadcast, q, k, v gathered to rank 0, two all-reduces after attention, the logits gathered."""

    profile: GPUProfile
    geometry: Geometry
    itemsize: int = 2
    tensor_parallel: int = 1

    @property
    def _dims(self) -> tuple[int, int, int, int]:
        g = self.geometry
        return g.hidden, g.heads * g.head_dim, g.kv_heads * g.head_dim, g.intermediate

    def layer_params(self) -> tuple[int, int]:
        """(before attention, after attention) weights of one layer on one GPU."""
        h, q, kv, inter = self._dims
        n = self.tensor_parallel
        return h * (q + 2 * kv) // n, (q * h + 3 * h * inter) // n

    def weight_bytes(self) -> int:
        """Weights on one GPU (rank 0: the whole embedding, its slice of the LM head)."""
        g, n = self.geometry, self.tensor_parallel
        pre, post = self.layer_params()
        return ((pre + post) * g.num_layers + g.hidden * g.vocab + g.hidden * g.vocab // n) * self.itemsize

    def _link(self, nbytes: float, collectives: int) -> float:
        n = self.tensor_parallel
        return 0.0 if n == 1 else self.profile.link_seconds(nbytes, collectives)

    def pre_seconds(self, tokens: int) -> float:
        """Norm, fused QKV GEMM, RoPE for `tokens` rows (TP: and the gather of q, k, v)."""
        h, q, kv, _ = self._dims
        n = self.tensor_parallel
        w, _ = self.layer_params()
        act = tokens * (2 * h + 2 * (q + 2 * kv) // n) * self.itemsize  # norm in/out, GEMM out, RoPE in/out
        sent = tokens * (h + (q + 2 * kv) * (n - 1) // n) * self.itemsize  # rows out, heads gathered
        return self.profile.kernel_seconds(w * self.itemsize + act, 2 * tokens * w, 3) + self._link(sent, 4)

    def post_seconds(self, tokens: int) -> float:
        """O GEMM, residual + norm, gate/up GEMM, SiLU-mul, down GEMM (TP: two all-reduces)."""
        h, q, _, inter = self._dims
        n = self.tensor_parallel
        _, w = self.layer_params()
        act = tokens * ((q + 5 * inter) // n + 6 * h) * self.itemsize
        # rows and attention out broadcast; a ring all-reduce moves 2 (N-1)/N of its tensor a GPU
        sent = tokens * (h + q + 2 * 2 * h * (n - 1) // n) * self.itemsize
        return self.profile.kernel_seconds(w * self.itemsize + act, 2 * tokens * w, 5) + self._link(sent, 4)

    def layer_seconds(self, tokens: int) -> float:
        return self.pre_seconds(tokens) + self.post_seconds(tokens)

    def head_seconds(self, rows: int) -> float:
        """Final norm, LM head (fp32 logits out) and sampling over them (TP: the logits gathered)."""
        g, n = self.geometry, self.tensor_parallel
        w = g.hidden * g.vocab // n
        nbytes = w * self.itemsize + rows * (g.hidden * self.itemsize + 3 * g.vocab * 4)
        sent = rows * (g.hidden * self.itemsize + g.vocab * 4 * (n - 1) // n)
        return self.profile.kernel_seconds(nbytes, 2 * rows * w, 6) + self._link(sent, 3)

    def qkv_copy_seconds(self, tokens: int) -> float:
        _, q, kv, _ = self._dims
        return self.profile.copy_seconds(tokens * (q + 2 * kv) * self.itemsize)

    def o_copy_seconds(self, tokens: int) -> float:
        _, q, _, _ = self._dims
        return self.profile.copy_seconds(tokens * q * self.itemsize)

    def step_seconds(self, batch: int, pipelined: bool = True) -> dict[str, float]:
        """A decode step of `batch` sequences: the compute engine's time (the GPU step), the copy
        engine's, and the pieces, in seconds. Piped: two mini-batches, each layer's weights read
        twice."""
        halves = [batch // 2, batch - batch // 2] if pipelined and batch > 1 else [batch]
        layers = self.geometry.num_layers
        compute = sum(layers * self.layer_seconds(t) for t in halves) + self.head_seconds(batch)
        copies = sum(layers * (self.qkv_copy_seconds(t) + self.o_copy_seconds(t)) for t in halves)
        return {
            "gpu_step_s": compute,
            "layer_s": self.layer_seconds(halves[0]),
            "head_s": self.head_seconds(batch),
            "copy_s": copies,
        }


def check_fits(roof: Roofline) -> None:
    """One clear line when the weights (and 10% for activations) exceed the GPU's memory."""
    need = roof.weight_bytes() * 1.1
    have = roof.profile.memory_gib * GIB
    if need > have:
        per = f" per GPU over {roof.tensor_parallel}" if roof.tensor_parallel > 1 else ""
        raise InvalidInput(
            f"geometry {roof.geometry.name} needs {need / GIB:.0f} GiB of weights and activations{per} "
            f"at {roof.itemsize} bytes per element; {roof.profile.name} has {roof.profile.memory_gib:g} GiB"
        )


# Speculative verification on the emulated device: per draft position j, the share of rows offering a
# j-th draft that keep it, as `bench spec` measured them with n-gram drafting (SmolLM2-135M-Instruct,
# B = 8, k = 4, quote-and-edit prompts through the chat template): `ngram_kept_at_position` in
# docs/benchmarks/2026-12-05-speculative.json (k4_chat_template; both runs read the same).
RECORDED_ACCEPTANCE = (0.6528, 0.5972, 0.5, 0.5)

# One verified row's tokens: (token, logprob, top alternatives) each
Emitted = list[tuple[int, float, tuple[tuple[int, float], ...]]]


@dataclass(frozen=True)
class EmulatedAcceptance:
    """Which drafts an emulated device keeps. rates[j]: the share of rows offering a (j + 1)-th draft
    that keep it (bench spec's "kept at draft position"); positions past the list keep the last rate.
    A row keeps its j-th draft only with every one before it, so a row keeps at least j drafts with
    the running minimum of rates[:j]: one uniform draw per row, from a hash of (seed, sequence,
    sample index), decides how many. Deterministic, and independent of the batch a row runs in."""

    rates: tuple[float, ...] = RECORDED_ACCEPTANCE
    seed: int = 0

    def __post_init__(self) -> None:
        ok = bool(self.rates) and all(isinstance(r, int | float) and 0.0 <= r <= 1.0 for r in self.rates)
        if not ok:
            raise InvalidInput(
                f"acceptance rates must be numbers in [0, 1], one per draft position, got {self.rates}"
            )

    @classmethod
    def parse(cls, text: str | None, seed: int = 0) -> EmulatedAcceptance:
        """'0.65,0.6,0.5' (None or empty: the recorded rates)."""
        if not text or not text.strip():
            return cls(seed=seed)
        try:
            rates = tuple(float(x) for x in text.split(","))
        except ValueError:
            raise InvalidInput(f"acceptance: comma-separated rates in [0, 1], got {text!r}") from None
        return cls(rates, seed)

    def floors(self, drafts: int) -> list[float]:
        """P(a row with `drafts` drafts keeps at least j + 1 of them), j = 0 .. drafts - 1."""
        out, low = [], 1.0
        for j in range(drafts):
            low = min(low, self.rates[min(j, len(self.rates) - 1)])
            out.append(low)
        return out

    def kept(self, seq_id: str, sample_index: int, drafts: int) -> int:
        """How many of a row's `drafts` drafts it keeps (0 .. drafts)."""
        digest = hashlib.blake2b(f"{self.seed}:{seq_id}:{sample_index}".encode(), digest_size=8).digest()
        u = int.from_bytes(digest, "little") / 2.0**64
        n = 0
        for low in self.floors(drafts):
            if u >= low:
                break
            n += 1
        return n

    def expected_tau(self, drafts: int) -> float:
        """Tokens a row with `drafts` drafts yields on average: 1 + the sum of the floors."""
        return 1.0 + sum(self.floors(drafts))


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class DeviceClock:
    """One compute engine and one copy engine, each serial. An operation starts when its engine is
    free and its inputs are ready; the caller's task remembers when its last result is ready
    (a context variable: each mini-batch is its own task, or its own thread's copy of the step's
    context) and `settle` (`wait` on a thread) sleeps until then. Times are time.monotonic()
    (CLOCK_MONOTONIC): an exchange worker waits for `ready_at` itself. The engines take a lock: two
    mini-batches' threads may queue work at once."""

    def __init__(self) -> None:
        self._compute_free = 0.0
        self._copy_free = 0.0
        self.compute_seconds = 0.0  # busy time so far, per engine
        self.copy_seconds = 0.0
        self._ready: contextvars.ContextVar[float] = contextvars.ContextVar("device_ready", default=0.0)
        self._lock = threading.Lock()

    def compute(self, seconds: float) -> None:
        with self._lock:
            start = max(time.monotonic(), self._ready.get(), self._compute_free)
            self._compute_free = end = start + seconds
            self.compute_seconds += seconds
        self._ready.set(end)

    def copy(self, seconds: float) -> None:
        with self._lock:
            start = max(time.monotonic(), self._ready.get(), self._copy_free)
            self._copy_free = end = start + seconds
            self.copy_seconds += seconds
        self._ready.set(end)

    def ready_at(self) -> float:
        """When the calling task's last device result is ready (time.monotonic())."""
        return self._ready.get()

    async def settle(self) -> None:
        wait = self._ready.get() - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)

    def wait(self) -> None:
        """settle, blocking (a mini-batch's layer loop on its own thread)."""
        wait = self._ready.get() - time.monotonic()
        if wait > 0:
            time.sleep(wait)


def _warm_meta() -> None:
    """torch registers its meta kernels on the first meta op: seconds of imports (py-spy: ~10 s of CPU
    on a loaded 2-core host) that would land in the first step. Paid here, at load, instead."""
    h = torch.empty(4, 8, device="meta")
    a = torch.zeros(4, 8, device="meta")
    a[0:2] = torch.ones(2, 8).to("meta")
    torch.cat([h, a]).index_select(0, torch.tensor([0, 1]).to("meta"))


class EmulatedModel(Device):
    """DenseModel's interface (embed, pre_attention, post_attention, logits, settle) on the clock,
    and the device it declares (plane.Device): results ready at the clock's time, synthetic."""

    def __init__(
        self,
        config: ModelConfig,
        profile: GPUProfile,
        dtype: torch.dtype = torch.bfloat16,
        geometry: str = "",
        token_limit: int | None = None,
        acceptance: EmulatedAcceptance | None = None,
        tensor_parallel: int = 1,
    ) -> None:
        self.config = config
        self.acceptance = acceptance or EmulatedAcceptance()
        self.profile = profile
        self.dtype = dtype
        self.device = torch.device("meta")  # hidden states: shapes, no storage
        self.label = f"{EMULATED_PREFIX}{profile.name}"
        # q, k, v are the same synthetic rows every layer and their copy off the device is charged on
        # the clock: the step runner stages them once per arena (fastdecode/dense/runner.py)
        self.synthetic = True
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.roofline = Roofline(profile, geometry_of(config, geometry), itemsize, tensor_parallel)
        check_fits(self.roofline)
        self.clock = DeviceClock()
        # when this task's last S-part result (q, k, v in host memory) is ready, and the blocking wait
        # for it: the clock's (settle, the awaiting one, is below)
        self.ready_at: Callable[[], float] | None = self.clock.ready_at
        self.wait: Callable[[], None] | None = self.clock.wait
        self._layer_times: dict[int, tuple[float, float, float, float]] = {}
        self.q_size = config.num_attention_heads * config.head_dim
        self.kv_size = config.num_key_value_heads * config.head_dim
        # Sampled ids stay inside the tokenizer's vocabulary (a named geometry's may be larger).
        self.token_limit = min(token_limit or config.vocab_size, config.vocab_size)
        self._gen = torch.Generator().manual_seed(0)
        self._q = self._k = self._v = torch.empty(0)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._logits = torch.empty(0)
        self._grow = threading.Lock()
        _warm_meta()

    def _pool(
        self, pool: torch.Tensor, rows: int, width: int, dtype: torch.dtype, scale: float
    ) -> torch.Tensor:
        if pool.shape[0] >= rows:
            return pool
        rows = max(rows, 2 * pool.shape[0], 64)
        need = rows * width * torch.empty((), dtype=dtype).element_size()
        if need > _host_available() // 2:
            raise InvalidInput(
                f"synthetic tensors of {need / GIB:.1f} GiB do not fit this host's free memory"
            )
        return (torch.randn(rows, width, generator=self._gen) * scale).to(dtype)

    # ---- the S-part, as DenseModel has it -------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.empty(token_ids.shape[0], self.config.hidden_size, dtype=self.dtype, device=self.device)

    def pre_attention(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, lora: LoraBatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Charges norm, QKV, RoPE and the copy of q, k, v to the host; returns host tensors
        (views of one synthetic pool: a copy off a GPU lands in fresh host memory, this costs none)."""
        t = hidden.shape[0]
        pre, qkv_copy, _, _ = self._times(t)
        self.clock.compute(pre)
        self.clock.copy(qkv_copy)
        views = self._views.get(t)
        if views is None:
            with self._grow:  # two mini-batches' threads: one grows the pools, the other waits
                views = self._make_views(t)
        return views

    def _make_views(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        views = self._views.get(t)
        if views is None:
            if self._q.shape[0] < t:  # three pools, so every row slice is contiguous
                self._q = self._pool(self._q, t, self.q_size, self.dtype, 0.5)
                self._k = self._pool(self._k, t, self.kv_size, self.dtype, 0.5)
                self._v = self._pool(self._v, t, self.kv_size, self.dtype, 0.5)
                self._views.clear()
            if len(self._views) > 4096:  # prefill chunks of every size: keep it bounded
                self._views.clear()
            # made once per row count: six tensor ops a layer were a tenth of the step loop's CPU
            views = self._views[t] = (
                self._q[:t].view(t, c.num_attention_heads, c.head_dim),
                self._k[:t].view(t, c.num_key_value_heads, c.head_dim),
                self._v[:t].view(t, c.num_key_value_heads, c.head_dim),
            )
        return views

    def post_attention(
        self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor, lora: LoraBatch | None = None
    ) -> torch.Tensor:  # no weights: no LoRA (gpu_dense refuses --enable-lora on an emulated device)
        _, _, o_copy, post = self._times(hidden.shape[0])
        self.clock.copy(o_copy)
        self.clock.compute(post)
        return hidden

    def _times(self, tokens: int) -> tuple[float, float, float, float]:
        """(pre, q/k/v copy, o copy, post) seconds of a layer at `tokens` rows, worked out once per
        row count: a step asks for them at every layer of both mini-batches."""
        times = self._layer_times.get(tokens)
        if times is None:
            if len(self._layer_times) > 4096:  # prefill chunks of every size: keep it bounded
                self._layer_times.clear()
            r = self.roofline
            times = self._layer_times[tokens] = (
                r.pre_seconds(tokens),
                r.qkv_copy_seconds(tokens),
                r.o_copy_seconds(tokens),
                r.post_seconds(tokens),
            )
        return times

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Synthetic fp32 logits [N, vocab]: the pool's first N rows (greedy draws repeat, so runs
        are reproducible; sampled draws vary)."""
        n, vocab = hidden.shape[0], self.config.vocab_size
        self.clock.compute(self.roofline.head_seconds(n))
        if self._logits.shape[0] < n:
            pool = self._pool(self._logits, n, vocab, torch.float32, 2.0)
            pool[:, self.token_limit :] = -1e4  # ids the tokenizer cannot decode are never drawn
            self._logits = pool
        return self._logits[:n]

    def verify(self, seqs: Sequence[PlannedSeq]) -> list[Emitted]:
        """Speculative rows (token_ids: the last token and `drafts` drafts), verified as the device
        would: the LM head and the sampling over every row's drafts + 1 positions on the clock (their
        layers were charged at drafts + 1 rows each already), the drafts kept drawn from the
        acceptance rates. Tokens are synthetic: a row yields its kept drafts and then the last of
        them (its own token where none was kept) as the target's token, so that a drafter sees text
        that repeats and keeps finding drafts; logprobs are 0. Waits for the device (the tokens
        are ready when the head is done)."""
        self.clock.compute(self.roofline.head_seconds(sum(s.drafts + 1 for s in seqs)))
        out: list[Emitted] = []
        for s in seqs:
            d = s.drafts
            kept = list(
                s.token_ids[
                    len(s.token_ids) - d : len(s.token_ids)
                    - d
                    + self.acceptance.kept(s.seq_id, s.sample_index, d)
                ]
            )
            bonus = kept[-1] if kept else s.token_ids[len(s.token_ids) - d - 1]
            out.append([(t, 0.0, ()) for t in [*kept, bonus]])
        self.clock.wait()
        return out

    async def settle(self) -> None:
        await self.clock.settle()

    @property
    def served_config(self) -> ModelConfig:
        """What gpu_dense reports (Info): the emulated shape, with the vocabulary the tokenizer has
        (the gateway checks they agree; the logits keep the geometry's width)."""
        return replace(self.config, vocab_size=self.token_limit)


def load_emulated(
    path: str | Path,
    device: str,
    dtype: torch.dtype,
    geometry: str | None = None,
    acceptance: str | None = None,
    tensor_parallel: int = 1,
) -> EmulatedModel:
    """The EmulatedModel for `--device emulated:...`: the checkpoint's config (and tokenizer range),
    a named geometry's dims over it, no weights; `acceptance` the rates its verification keeps
    drafts at ('0.65,0.6,...'; None: RECORDED_ACCEPTANCE); `tensor_parallel` GPUs sharing it."""
    profile = load_profile(device)
    rates = EmulatedAcceptance.parse(acceptance)
    base = ModelConfig.from_pretrained(path)
    config = apply_geometry(base, geometry)
    check_tensor_parallel(config, tensor_parallel)
    return EmulatedModel(config, profile, dtype, geometry or "", base.vocab_size, rates, tensor_parallel)
