"""Codec throughput: encode+decode GB/s at 64 KiB, 1 MiB and 16 MiB (fp32, bf16).

Beside each: a plain tensor.clone() of the same bytes (the memcpy yardstick, same run) and the
protobuf wire round trip (SerializeToString + FromString of the encoded Tensor message, which
is what gRPC adds on top). Medians over repeats; ratio = codec GB/s / clone GB/s.

    .venv/bin/python bench/codec_bench.py [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import time

import torch

from fastdecode.benchmarks.common import format_table, gbps, median
from fastdecode.runtime import codec
from fastdecode.v1 import tensor_pb2

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def timed(fn, inner):
    """Seconds per call: `inner` calls back to back (small sizes need several to be timeable)."""
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def bench_case(nbytes, dtype, repeats):
    itemsize = torch.empty((), dtype=dtype).element_size()
    t = torch.randn(nbytes // itemsize).to(dtype).reshape(-1, 64)  # rows of 64, like [tokens, head_dim]
    size = t.numel() * itemsize
    assert size == nbytes
    msg = codec.encode(t)
    wire = msg.SerializeToString()
    assert torch.equal(codec.decode(tensor_pb2.Tensor.FromString(wire)), t)
    inner = max(1, (4 << 20) // size)  # ~4 MiB of work per sample

    cases = {
        "clone": lambda: t.clone(),
        "encode": lambda: codec.encode(t),
        "decode": lambda: codec.decode(msg),
        "encode+decode": lambda: codec.decode(codec.encode(t)),
        "decode(copy)": lambda: codec.decode(msg, copy=True),
        "wire": lambda: tensor_pb2.Tensor.FromString(codec.encode(t).SerializeToString()),
        "full": lambda: codec.decode(tensor_pb2.Tensor.FromString(codec.encode(t).SerializeToString())),
    }
    for fn in cases.values():  # warm-up
        fn()
    samples = {name: [] for name in cases}
    names = list(cases)
    for _ in range(repeats):
        random.shuffle(names)  # interleaved, random order: every case sees the same noise
        for name in names:
            samples[name].append(timed(cases[name], inner))
    med = {name: median(v) for name, v in samples.items()}
    clone = gbps(size, med["clone"])
    codec_gbps = gbps(size, med["encode+decode"])
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "size": next(k for k, v in SIZES.items() if v == nbytes),
        "clone_GBps": clone,
        "encode_GBps": gbps(size, med["encode"]),
        "decode_GBps": gbps(size, med["decode"]),
        "enc+dec_GBps": codec_gbps,
        "ratio_vs_clone": codec_gbps / clone,
        "dec_copy_GBps": gbps(size, med["decode(copy)"]),
        "pb_wire_GBps": gbps(size, med["wire"]),
        "enc+pb+dec_GBps": gbps(size, med["full"]),
        "enc+dec_us": med["encode+decode"] * 1e6,
    }


def keep_freed_memory():
    """Stop glibc from handing freed big blocks back to the OS (mmap threshold, heap trim).

    Without this every 1-16 MiB buffer is fresh memory and each sample pays page faults (on a
    small VM: 2-15 ms per 16 MiB, and bimodal), which swamps the copies being measured.
    Returns False where mallopt is not available (not glibc).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_trim_threshold, 1 << 30)) and bool(libc.mallopt(m_mmap_threshold, 1 << 30))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument(
        "--default-malloc", action="store_true", help="leave glibc's trimming on (page faults included)"
    )
    args = p.parse_args()
    steady = False if args.default_malloc else keep_freed_memory()
    rows = [bench_case(nbytes, dtype, args.repeats) for dtype in DTYPES.values() for nbytes in SIZES.values()]
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"codec throughput, medians of {args.repeats} (torch threads: {torch.get_num_threads()}, "
        f"freed memory kept by malloc: {steady})"
    )
    print("  enc+dec: codec.encode then codec.decode (decode aliases the bytes: zero copy)")
    print("  pb_wire: encode + SerializeToString + FromString (the wire's cost, no decode)")
    print("  ratio_vs_clone: enc+dec GB/s over a tensor.clone() of the same bytes")
    print(format_table(rows))


if __name__ == "__main__":
    main()
