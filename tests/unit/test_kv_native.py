"""The native attention kernel (fastdecode/kv/csrc/attention.cpp) against an fp64 reference.

Two tolerances per KV dtype:
- KERNEL_TOL: the kernel's own arithmetic (fp32 online softmax, polynomial exp) against fp64
  attention over the values the pool actually holds (rounded to fp16/bf16, or int8/float8 * scale).
  The same for every float dtype and float8: the kernel widens in registers (exactly) and computes
  in fp32; on the avx512_bf16 and amx levels bf16 keys meet q split into three bf16 parts (q's 24
  bits), and on amx (bf16, float16, int8, float8 rows widened to bf16 exactly) the weights are
  rounded to bf16 hi + lo (16 bits) before they meet V: over 1,000 seeds of the ISA-level test one
  output sat at 2.27e-5 (bf16, 8 heads on 1 KV head of 128; every other under 1.7e-5), hence
  AMX_KERNEL_TOL on that level. int8 keys
  on the vector levels meet q rounded to int16 per row (an integer dot product; on amx q's three
  bf16 parts), an error that grows with the scores:
  ~3e-5 at unit variance, ~2e-4 with scores spread by 30; int8 storage itself costs 100x more.
- STORAGE_TOL: against fp64 attention over the original fp32 k, v, i.e. including what storing
  them in the pool's dtype costs (unit-variance random q, k, v; documented in docs/kernel.md).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdecode.kv import KV_DTYPES, AttendBatch, KVStore, native
from fastdecode.kv.memory import kv_bytes_per_element, quantize_float8
from fastdecode.runtime.errors import FailedPrecondition
from fastdecode.runtime.geometry import KVGeometry

kernel = native.load()  # the native backend's tests must run it: a missing build fails here

KERNEL_TOL = {"float32": 2e-5, "float16": 2e-5, "bfloat16": 2e-5, "int8": 5e-4, "float8_e4m3": 2e-5}
AMX_KERNEL_TOL = 3e-5
STORAGE_TOL = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2.5e-2, "int8": 4e-2, "float8_e4m3": 0.15}
DTYPES = list(KV_DTYPES)
VECTOR_ISAS = ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")


def _seed(*case: object) -> int:
    """A case's data seed, the same in every run (hash() of a str changes with each process)."""
    return zlib.crc32(repr(case).encode()) % 1000


@pytest.fixture
def isa_level(request: pytest.FixtureRequest) -> str:
    """Forces the kernel's ISA level for one test (skipped where the CPU lacks it), then puts back
    the level it picked."""
    level = request.param
    if level not in native.isas():
        pytest.skip(f"this CPU lacks ISA level {level} (it has {native.isas()})")
    before = "auto"  # the CPUID pick (no test runs forced)
    native.set_isa(level)
    yield level
    native.set_isa(before)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """fp64 causal attention. q [n, H, D] at positions start.., keys/values [L, KVH, D] -> [n, H*D]."""
    n, heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) / math.sqrt(dim)
    mask = torch.arange(keys.shape[0])[None, :] > torch.arange(start, start + n)[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).reshape(n, heads * dim)


def stored(store: KVStore, layer: int, seq_id: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the pool holds for a sequence, as fp64 [length, KVH, D] (int8/float8 times its scales)."""
    seq = store.seqs[seq_id]
    pos = torch.arange(length)
    blocks = torch.tensor(seq.blocks)
    slots = blocks[pos // store.block_size] * store.block_size + pos % store.block_size
    out = []
    for pool, scales in ((store.k, store.k_scale), (store.v, store.v_scale)):
        x = pool[layer][:, slots].double()
        if store.quantized:
            x = x * scales[layer][:, slots, None].double()
        out.append(x.transpose(0, 1))
    return out[0], out[1]


def make(
    dtype: str,
    kv_heads: int,
    head_dim: int,
    tokens: int,
    backend: str = "native",
    block_size: int = 16,
    layers: int = 1,
) -> KVStore:
    per_token = 2 * layers * kv_heads * head_dim * kv_bytes_per_element(KV_DTYPES[dtype], head_dim)
    cap = int(per_token * (tokens + 64 * block_size)) + 4096
    return KVStore(KVGeometry(layers, kv_heads, head_dim), cap, KV_DTYPES[dtype], block_size, backend=backend)


def run_and_check(
    store: KVStore,
    calls: list[list[tuple[str, int, int]]],
    heads: int,
    history: dict[str, tuple[torch.Tensor, torch.Tensor]],
    dtype: str,
    gen: torch.Generator,
    layer: int = 0,
    storage: bool = True,
) -> None:
    """Each call is a list of (seq, start, n); checks every output row against both references
    (storage=False: only against the stored values, when the scores are too sharp for STORAGE_TOL)."""
    kvh, dim = store.num_kv_heads, store.head_dim
    tol = KERNEL_TOL[dtype]
    if native.isa() == "amx" and dtype != "int8":
        tol = max(tol, AMX_KERNEL_TOL)
    for call in calls:
        total = sum(n for *_, n in call)
        q = torch.randn(total, heads, dim, generator=gen)
        k = torch.cat([history[s][0][p : p + n] for s, p, n in call])
        v = torch.cat([history[s][1][p : p + n] for s, p, n in call])
        assert k.shape == (total, kvh, dim)
        o = store.attend(
            layer, AttendBatch([s for s, *_ in call], [n for *_, n in call], [p for _, p, _ in call], q, k, v)
        )
        assert o.shape == (total, heads * dim) and o.dtype == torch.float32
        row = 0
        for s, p, n in call:
            got = o[row : row + n].double()
            sk, sv = stored(store, layer, s, p + n)
            exact = reference(q[row : row + n], sk, sv, p)
            torch.testing.assert_close(got, exact, atol=tol, rtol=tol)
            if storage:
                orig = reference(q[row : row + n], history[s][0][: p + n], history[s][1][: p + n], p)
                torch.testing.assert_close(got, orig, atol=STORAGE_TOL[dtype], rtol=STORAGE_TOL[dtype])
            row += n


def fill(store: KVStore, lengths: dict[str, int], gen: torch.Generator, layer: int = 0) -> dict:
    """Reserve each sequence (room for a few more tokens), store length-1 tokens, return histories."""
    kvh, dim = store.num_kv_heads, store.head_dim
    hist = {}
    for sid, n in lengths.items():
        store.reserve(sid, n + 40)
        hist[sid] = (
            torch.randn(n + 40, kvh, dim, generator=gen),
            torch.randn(n + 40, kvh, dim, generator=gen),
        )
        if n > 1:
            store.write(layer, sid, 0, hist[sid][0][: n - 1], hist[sid][1][: n - 1])
    return hist


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (8, 1, 128), (4, 4, 64), (8, 2, 128)])
def test_mixed_lengths_one_decode_call(dtype: str, heads: int, kv_heads: int, head_dim: int) -> None:
    """One call, lengths from 1 to 8k (block and tile boundaries among them), GQA 8:2, MQA, MHA."""
    gen = torch.Generator().manual_seed(_seed(dtype, heads, kv_heads, head_dim))
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 100, 1023, 8192]
    store = make(dtype, kv_heads, head_dim, sum(lengths) + 40 * len(lengths))
    hist = fill(store, {f"s{i}": n for i, n in enumerate(lengths)}, gen)
    calls = [[(f"s{i}", n - 1, 1) for i, n in enumerate(lengths)]]
    calls.append([(f"s{i}", n, 1) for i, n in enumerate(lengths)])  # the next step: one token longer
    run_and_check(store, calls, heads, hist, dtype, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunks_and_decode_in_one_call(dtype: str) -> None:
    """Causal chunks (from 0 and from the middle of the cache) beside decodes; chunks > one job."""
    gen = torch.Generator().manual_seed(3)
    store = make(dtype, 2, 64, 4096)
    hist = fill(store, {"a": 1, "b": 1, "c": 300, "d": 40}, gen)
    calls = [
        [("a", 0, 37), ("c", 299, 1), ("b", 0, 5), ("d", 39, 1)],
        [("a", 37, 3), ("b", 5, 20), ("c", 300, 1), ("d", 40, 17)],
    ]
    run_and_check(store, calls, 8, hist, dtype, gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 3, 16, 48])
def test_scattered_reservations(dtype: str, block_size: int) -> None:
    """A fragmented pool hands out scattered blocks: the kernel follows each block table."""
    gen = torch.Generator().manual_seed(block_size)
    lens = {"x": 2 * block_size + 2, "y": 3}  # fill() reserves 40 more tokens than it stores
    need = sum(-(-(n + 40) // block_size) for n in lens.values())
    store = make(dtype, 2, 64, 4 * need * block_size, block_size=block_size)
    fillers = [f"f{i}" for i in range(2 * need + 2)]
    for f in fillers:
        store.reserve(f, block_size)
    store.reserve("tail", store.free_tokens)
    for f in fillers[::2]:
        store.release(f)  # every other block free: the next reservations scatter
    hist = fill(store, lens, gen)
    assert not store.seqs["x"].contiguous
    x = lens["x"]
    calls = [[("x", x - 1, 1), ("y", 2, 1)], [("x", x, 30), ("y", 3, 1)], [("x", x + 30, 1), ("y", 4, 1)]]
    run_and_check(store, calls, 4, hist, dtype, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_matches_torch_backend_over_steps(dtype: str) -> None:
    """The same prefill + decode steps through both backends: same outputs, same stored bytes."""
    gen = torch.Generator().manual_seed(11)
    stores = [make(dtype, 2, 32, 4096, backend=b, layers=2) for b in ("native", "torch")]
    lens = {"a": 45, "b": 3, "c": 130}
    for s in stores:
        for sid in lens:
            s.reserve(sid, 200)
    pos = dict.fromkeys(lens, 0)
    for step in range(4):
        ids = list(lens)
        n = [lens[i] if step == 0 else 1 for i in ids]
        total = sum(n)
        q, k, v = (torch.randn(total, h, 32, generator=gen) for h in (8, 2, 2))
        for layer in range(2):
            outs = [s.attend(layer, AttendBatch(ids, n, [pos[i] for i in ids], q, k, v)) for s in stores]
            tol = KERNEL_TOL[dtype] if dtype in ("float32", "int8") else 1e-2  # SDPA: in the half type
            torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
        for i, m in zip(ids, n, strict=True):
            pos[i] += m
    a, b = stores
    for layer in range(2):
        for sid, n in pos.items():
            for x, y in zip(stored(a, layer, sid, n), stored(b, layer, sid, n), strict=True):
                # int8: one quantizer in C++ and one in torch; a tie in x / scale may round apart
                # (float8: both round x / scale with c10's e4m3 cast, the same bits)
                torch.testing.assert_close(x, y, atol=0 if dtype != "int8" else 0.05, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_path_matches_vector_path(dtype: str) -> None:
    gen = torch.Generator().manual_seed(5)
    store = make(dtype, 2, 64, 4096)
    hist = fill(store, {"a": 500, "b": 20}, gen)
    q = torch.randn(2, 8, 64, generator=gen)
    k, v = hist["a"][0][499:500].repeat(2, 1, 1), hist["a"][1][499:500].repeat(2, 1, 1)
    outs = []
    before = "auto"  # the CPUID pick (no test runs forced)
    try:
        for isa in ("scalar", before):
            kernel.set_isa(isa)
            outs.append(store.attend(0, AttendBatch(["a", "b"], [1, 1], [499, 19], q, k, v)))
    finally:
        kernel.set_isa(before)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([8, 12, 16, 24, 64]),
    block_size=st.integers(1, 20),
    seqs=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 20)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(
    dtype: str, kv_heads: int, group: int, head_dim: int, block_size: int, seqs: list, seed: int
) -> None:
    """Random geometry (head_dim not a multiple of 8, or of 16 in bfloat16, takes the scalar path),
    new tokens per sequence: every row matches fp64."""
    gen = torch.Generator().manual_seed(seed)
    room = sum(c + 1 + 40 + block_size for c, _ in seqs)  # fill() reserves 40 tokens beyond each length
    store = make(dtype, kv_heads, head_dim, room, block_size=block_size)
    hist = fill(store, {f"s{i}": c + 1 for i, (c, _) in enumerate(seqs)}, gen)
    call = [(f"s{i}", c, min(n, 40)) for i, (c, n) in enumerate(seqs)]
    run_and_check(store, [call], kv_heads * group, hist, dtype, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_far_keys_weigh_zero_and_the_callers_float_mode_is_kept(dtype: str) -> None:
    """Scores 100+ below a row's max give denormal weights, which the kernel flushes to zero in its
    workers; the result still matches fp64, and the calling thread's own denormals still work after."""
    gen = torch.Generator().manual_seed(7)
    store = make(dtype, 2, 64, 600)
    hist = fill(store, {"a": 300, "b": 5}, gen)
    for sid, n in (("a", 300), ("b", 5)):  # keys x30: scores spread ~30, most weights below e^-87
        hist[sid][0].mul_(30)
        store.write(0, sid, 0, hist[sid][0][: n - 1], hist[sid][1][: n - 1])
    run_and_check(store, [[("a", 299, 1), ("b", 4, 1)]], 4, hist, dtype, gen, storage=False)
    tiny = 1e-38
    assert tiny * 1e-3 > 0.0  # a flush-to-zero mode left set would make this 0.0


def test_yardstick_reads_every_element() -> None:
    x = torch.arange(1 << 20, dtype=torch.float32) % 7
    assert kernel.stream_read(x) == pytest.approx(float(x.double().sum()), rel=1e-6)


def test_missing_extension_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native.importlib, "import_module", fail)
    with pytest.raises(FailedPrecondition) as e:
        KVStore(KVGeometry(1, 1, 8), 1 << 20, backend="native")
    msg = str(e.value)
    assert "\n" not in msg and "native attention kernel unavailable" in msg and "make setup" in msg
    KVStore(KVGeometry(1, 1, 8), 1 << 20, backend="torch")  # the reference still works


def test_int8_wide_heads_do_not_overflow_the_integer_dot() -> None:
    """int8 keys are dotted on integers (q rounded to int16), exact in int32 up to head_dim 512;
    wider heads take the scalar path. q and k at full scale make an overflow visible: key 0's
    score would wrap from +23 to about -23 and the output would follow key 1's value instead."""
    dim = 528
    store = make("int8", 1, dim, 8)
    store.reserve("a", 8)
    k = torch.ones(3, 1, dim)
    k[1] = -1.0
    v = torch.randn(3, 1, dim, generator=torch.Generator().manual_seed(3))
    store.write(0, "a", 0, k[:2], v[:2])
    q = torch.ones(1, 1, dim)
    o = store.attend(0, AttendBatch(["a"], [1], [2], q, k[2:], v[2:]))
    sk, sv = stored(store, 0, "a", 3)
    exact = reference(q, sk, sv, 2)
    torch.testing.assert_close(o.double(), exact, atol=KERNEL_TOL["int8"], rtol=KERNEL_TOL["int8"])


@pytest.mark.parametrize("isa_level", VECTOR_ISAS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (8, 1, 128), (4, 4, 96), (2, 2, 48)])
def test_every_isa_level_matches_fp64_and_the_scalar_path(
    isa_level: str, dtype: str, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Each ISA level the CPU has, forced: decodes over lengths across tile and block boundaries,
    prefill chunks beside them, and keys x30 (sharp scores) match fp64 over the stored values
    within the dtype's tolerance, and the scalar path. Head dims the level's loads do not divide
    (48 at 512 bits for bf16, int8 and float8) go to a lower level, which must agree too."""
    gen = torch.Generator().manual_seed(_seed(dtype, heads, head_dim))
    lengths = {"a": 1, "b": 17, "c": 33, "d": 300, "e": 1100}
    store = make(dtype, kv_heads, head_dim, sum(lengths.values()) + 400)
    hist = fill(store, lengths, gen)
    if dtype != "int8":  # sharp scores (int8's q rounded to int16 is checked there in the far-keys test)
        hist["d"][0].mul_(30)
        store.write(0, "d", 0, hist["d"][0][:299], hist["d"][1][:299])
    calls = [[("a", 0, 20), ("b", 16, 1), ("c", 32, 1), ("d", 299, 1), ("e", 1099, 1)]]
    calls.append([("a", 20, 1), ("b", 17, 9), ("c", 33, 1), ("d", 300, 1), ("e", 1100, 1)])
    run_and_check(store, calls, heads, hist, dtype, gen, storage=False)
    assert native.path(dtype, head_dim) in VECTOR_ISAS + ("scalar",)
    q = torch.randn(2, heads, head_dim, generator=gen)
    k, v = hist["e"][0][1101:1102].repeat(2, 1, 1), hist["e"][1][1101:1102].repeat(2, 1, 1)
    outs = []
    for level in (isa_level, "scalar"):
        native.set_isa(level)
        outs.append(store.attend(0, AttendBatch(["c", "e"], [1, 1], [34, 1101], q, k, v)))
    native.set_isa(isa_level)
    torch.testing.assert_close(outs[0], outs[1], atol=KERNEL_TOL[dtype], rtol=KERNEL_TOL[dtype])


def test_isa_levels_and_paths() -> None:
    """The picked level is the highest the CPU has; each dtype's path is at or below it; an unknown
    level or one the CPU lacks is one clear error and leaves the level as it was."""
    levels = native.isas()
    assert levels[0] == "scalar" and native.isa() == levels[-1] and not native.forced()
    order = ("scalar",) + VECTOR_ISAS
    for dtype in DTYPES:
        assert order.index(native.path(dtype, 64)) <= order.index(native.isa())
        for level in levels:  # forced, every dtype runs on the level (64 divides every load)
            native.set_isa(level)
            assert native.path(dtype, 64) == level and native.forced()
        native.set_isa("auto")
        assert native.path(dtype, 36) == "scalar"  # no vector load steps by 4
    before = "auto"  # the CPUID pick (no test runs forced)
    for bad in ["avx9", "AVX2", ""] + [lvl for lvl in order if lvl not in levels]:
        with pytest.raises(native.IsaUnavailable) as e:
            native.set_isa(bad)
        assert "\n" not in str(e.value) and ("lacks" in str(e.value) or "must be one of" in str(e.value))
        assert native.isa() == levels[-1] and not native.forced()
    native.set_isa("scalar")
    try:
        assert all(native.path(d, 64) == "scalar" for d in DTYPES)
    finally:
        native.set_isa(before)


@pytest.mark.parametrize("level, ok", [("scalar", True), ("avx9", False)])
def test_isa_environment_override(monkeypatch: pytest.MonkeyPatch, level: str, ok: bool) -> None:
    """FASTDECODE_KERNEL_ISA forces a level when the kernel loads (a store attends on it, the
    scalar path a CPU without AVX2 gets); a level that does not exist, or that the CPU lacks, stops
    load() with one line naming it, as NativeUnavailable (a shard stops at start with it)."""
    before = "auto"  # the CPUID pick (no test runs forced)
    monkeypatch.setenv(native.ISA_ENV, level)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    try:
        if ok:
            store = KVStore(KVGeometry(1, 1, 64), 1 << 20)
            assert native.isa() == level and native.path("bfloat16", 64) == level
            store.reserve("a", 4)
            q, k, v = (torch.randn(3, 1, 64) for _ in range(3))
            o = store.attend(0, AttendBatch(["a"], [3], [0], q, k, v))
            torch.testing.assert_close(o.double(), reference(q, k, v, 0), atol=2e-5, rtol=2e-5)
        else:
            with pytest.raises(native.NativeUnavailable) as e:
                KVStore(KVGeometry(1, 1, 64), 1 << 20)
            msg = str(e.value)
            assert msg.startswith(f"{native.ISA_ENV}={level}: isa must be one of") and "\n" not in msg
    finally:
        kernel.set_isa(before)


def _wide_range_rows(n: int, kvh: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Rows whose elements span 2^-24 .. 1 of the row's largest (random signs): a third of each row
    falls below e4m3's smallest normal once scaled (x / scale < 2^-6, i.e. below ~3.5e-5 of absmax)."""
    mags = torch.exp2(-24 * torch.rand(n, kvh, dim, generator=gen))
    signs = torch.where(torch.rand(n, kvh, dim, generator=gen) < 0.5, -1.0, 1.0)
    return mags * signs * 3.0


def test_float8_codes_have_no_subnormals_and_both_stores_agree() -> None:
    """float8 codes below e4m3's smallest normal (2^-6 of the scale) round to 0 or +-2^-6 (the
    vector paths widen codes by bit shifts and flush denormals), the same in the native kernel's
    append and the torch reference's quantizer, bit for bit."""
    gen = torch.Generator().manual_seed(23)
    stores = [make("float8_e4m3", 2, 64, 256, backend=b) for b in ("native", "torch")]
    k, v = (_wide_range_rows(60, 2, 64, gen) for _ in range(2))
    q = torch.randn(60, 4, 64, generator=gen)
    for s in stores:
        s.reserve("a", 80)
        s.attend(0, AttendBatch(["a"], [60], [0], q, k, v))  # appended by each backend itself
    for x, y in zip(stored(stores[0], 0, "a", 60), stored(stores[1], 0, "a", 60), strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    for store in stores:
        blocks = torch.tensor(store.seqs["a"].blocks)
        pos = torch.arange(60)
        slots = blocks[pos // store.block_size] * store.block_size + pos % store.block_size
        for pool in (store.k, store.v):
            bits = pool[0][:, slots].view(torch.uint8) & 0x7F
            assert not ((bits > 0) & (bits < 0x08)).any()  # exponent field 0 only for zero
            assert (bits == 0x08).any()  # the flush's +-2^-6 is there, and so are zeros
    row = [448.0, 2**-6, 0.75 * 2**-6, 2**-7, 0.4 * 2**-6, -0.6 * 2**-6]
    codes, scale = quantize_float8(torch.tensor([row]))
    assert scale.item() == 1.0
    assert codes.float().tolist() == [[448.0, 2**-6, 2**-6, 0.0, 0.0, -(2**-6)]]


@pytest.mark.parametrize("isa_level", VECTOR_ISAS, indirect=True)
@pytest.mark.parametrize("q_scale", [1e-6, 1.0, 1e6])
def test_float8_wide_ranges_every_level(isa_level: str, q_scale: float) -> None:
    """float8 rows spanning 24 binades and q from 1e-6 to 1e6 (the vector paths scale q by a power
    of two and carry e4m3's exponent bias on q's factor and the scales): every level matches fp64
    over the stored values and the scalar path."""
    gen = torch.Generator().manual_seed(29)
    store = make("float8_e4m3", 2, 64, 700)
    hist = {"a": (_wide_range_rows(600, 2, 64, gen), _wide_range_rows(600, 2, 64, gen) * 1e-3)}
    store.reserve("a", 600)
    store.write(0, "a", 0, hist["a"][0][:499], hist["a"][1][:499])
    q = torch.randn(1, 8, 64, generator=gen) * q_scale
    k, v = hist["a"][0][499:500], hist["a"][1][499:500]
    outs = []
    for level in (isa_level, "scalar"):
        native.set_isa(level)
        outs.append(store.attend(0, AttendBatch(["a"], [1], [499], q, k, v)).double())
    native.set_isa(isa_level)
    sk, sv = stored(store, 0, "a", 500)
    exact = reference(q, sk, sv, 499)
    tol = KERNEL_TOL["float8_e4m3"] * 1e-3  # the values are 1e-3 of unit size
    for got in outs:
        torch.testing.assert_close(got, exact, atol=tol, rtol=KERNEL_TOL["float8_e4m3"])


@pytest.mark.parametrize("isa_level", ("scalar",) + VECTOR_ISAS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size",
    [(8, 2, 64, 16), (32, 8, 128, 16), (8, 1, 128, 3), (16, 2, 64, 48), (32, 1, 256, 32)],
)
def test_speculative_positions_every_level(
    isa_level: str, dtype: str, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """A verification step of speculative decoding: k + 1 new positions per sequence (2 to 8, and a
    plain decode beside them), causal among themselves, over caches across tile and block edges; the
    query rows of a KV head (group x positions: 4 to 256, so one or several blocks of 16 rows on the
    amx level) attend in one pass over its keys. Every level and dtype matches fp64, then a second
    step from where the accepted prefix left off (the rejected positions are written over)."""
    gen = torch.Generator().manual_seed(DTYPES.index(dtype) * 1000 + heads * 10 + block_size)
    lengths = {"a": 1, "b": 16, "c": 31, "d": 100, "e": 300}
    store = make(dtype, kv_heads, head_dim, sum(lengths.values()) + 400, block_size=block_size)
    hist = fill(store, lengths, gen)
    calls = [[("a", 0, 4), ("b", 15, 5), ("c", 30, 2), ("d", 99, 8), ("e", 299, 1)]]
    calls.append([("a", 2, 4), ("b", 17, 4), ("c", 31, 4), ("d", 101, 4), ("e", 300, 4)])
    # the kernel's arithmetic only: with up to 64 rows of 128 a call, float8's storage error alone
    # passes STORAGE_TOL somewhere in about 1 call of 30 (what storing costs is checked above)
    run_and_check(store, calls, heads, hist, dtype, gen, storage=False)
