"""gpu_dense's layer loop alone: its CPU per decode step with the layers answered at a chosen pace.

The real StepRunner on the emulated GPU (Llama-3-8B shapes, bf16, emulated H100) hands each layer
to a real ExchangePlane, whose one worker process is a stand-in here (this file run with
`--worker`): it answers every layer with o where a worker puts it, at the layer's not_before time
plus `--answer-after` seconds, and talks to no shard. So the dense process runs exactly as in the
fleet, and the pace of the answers is set: 0 is a GPU's (a layer comes back as soon as the device
has it), 0.008 is `bench pace`'s on a 2-core host (one-core shards answer a layer every ~8 ms).
Both layer loops in one run: `thread` (each mini-batch on its own thread, the slot's own socket;
what gpu_dense runs when the S-part is off the host) and `loop` (the event loop, the same plane
without its blocking path). Printed per point: the dense process's CPU per step (all threads,
process_time) and its wall step; medians of `--repeats` runs of `--steps` steps.

    .venv/bin/python bench/dense_loop.py [--batch 256] [--steps 40] [--repeats 3]
        [--answer-after 0 0.008] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_LEN = struct.Struct("<I")


# ---- the stand-in worker (a process of its own, as the real one is) -------------------------
def _frames(sock: socket.socket) -> Iterator[bytes]:
    buf = b""
    while True:
        while len(buf) < 4 or len(buf) < 4 + _LEN.unpack_from(buf)[0]:
            data = sock.recv(1 << 16)
            if not data:
                return
            buf += data
        n = _LEN.unpack_from(buf)[0]
        yield buf[4 : 4 + n]
        buf = buf[4 + n :]


def _worker(args: argparse.Namespace) -> None:
    from fastdecode.v1 import exchange_pb2 as pb

    last: dict[int, list[Any]] = {}
    lock = threading.Lock()
    delay = float(os.environ.get("DENSE_LOOP_ANSWER_AFTER", "0"))

    def send(sock: socket.socket, msg: Any) -> None:
        body = msg.SerializeToString()
        with lock:
            sock.sendall(_LEN.pack(len(body)) + body)

    def answer(sock: socket.socket, a: Any) -> None:
        wait = max((a.not_before_ns - time.monotonic_ns()) / 1e9, 0.0) + delay
        if wait > 0:
            time.sleep(wait)
        out = pb.ToDense()
        out.done.rid = a.rid
        for it in last[a.slot]:
            r = out.done.results.add()
            r.o.offset = it.o_offset
            r.o.shape.extend([it.q.shape[0], it.q.shape[1] * it.q.shape[2]])
            r.o.dtype = it.q.dtype
        send(sock, out)

    def serve(sock: socket.socket, inline: bool) -> None:
        for body in _frames(sock):
            m = pb.ToWorker.FromString(body)
            if m.WhichOneof("kind") != "attend":
                continue
            if m.attend.has_items:
                last[m.attend.slot] = list(m.attend.items)
            if inline:  # a slot's own socket: its layers in order
                answer(sock, m.attend)
            else:  # the control socket carries both slots: each layer answered on a thread
                threading.Thread(target=answer, args=(sock, m.attend), daemon=True).start()

    control = socket.socket(fileno=int(args.fd))
    frames = _frames(control)
    next(frames)  # the fleet secret
    ready = pb.ToDense()
    ready.ready = os.getpid()
    send(control, ready)
    for fd in filter(None, args.layer_fds.split(",")):
        threading.Thread(target=serve, args=(socket.socket(fileno=int(fd)), True), daemon=True).start()
    serve(control, False)


# ---- the dense side -------------------------------------------------------------------------
def _on_the_loop(plane: Any) -> Any:
    """The plane without its blocking path: the runner keeps the layer loop on the event loop (with
    the plane's attend_layer_at and staging, as before)."""
    from fastdecode.dense import LayerPlane

    class OnTheLoop(LayerPlane):
        attend_layer_blocking = None

        def __init__(self) -> None:
            self.attend_layer = plane.attend_layer
            self.attend_layer_at = plane.attend_layer_at
            self.staging = plane.staging

        @property
        def num_shards(self) -> int:
            return plane.num_shards

    return OnTheLoop()


async def _point(model_dir: Path, batch: int, steps: int, mode: str, answer_after: float) -> dict[str, float]:
    import torch

    from fastdecode.contract import PlannedSeq, SamplingParams
    from fastdecode.dense import StepRunner
    from fastdecode.dense.emulated import load_emulated
    from services.gpu_dense.exchange.plane import ExchangePlane

    os.environ["DENSE_LOOP_ANSWER_AFTER"] = repr(answer_after)
    model = load_emulated(model_dir, "emulated:h100", torch.bfloat16, "llama-3-8b")
    plane = ExchangePlane([f"127.0.0.1:{i}" for i in range(1, 5)], 1)  # never dialled: a stand-in
    for w in plane.workers:
        w.command = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    await plane.start()
    try:
        runner = StepRunner(model, plane if mode == "thread" else _on_the_loop(plane))
        params = SamplingParams()
        seqs = lambda: [  # noqa: E731 - 4 shards, 2 mini-batches, 1 token each, nothing sampled
            PlannedSeq(f"s{i}", (i // 2) % 4, i % 2, [5], 10, params, sample=False) for i in range(batch)
        ]
        for _ in range(3):
            await runner.run(seqs())
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            out, timings = await runner.run(seqs())
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        if any(o.error for o in out.values()):
            raise SystemExit(f"dense_loop: a step failed: {next(o.error for o in out.values() if o.error)}")
        return {
            "cpu_ms_per_step": cpu / steps * 1e3,
            "wall_step_ms": wall / steps * 1e3,
            "round_trips_per_step": timings.round_trips,
        }
    finally:
        await plane.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--answer-after", type=float, nargs="+", default=[0.0, 0.008])
    p.add_argument("--model", type=Path, default=ROOT / ".models" / "tiny-llama")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--fd", "--parent", "--index", "--timeout", "--shards", "--layer-fds"):
        p.add_argument(flag, default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.worker:
        _worker(args)
        return
    import torch

    torch.set_num_threads(1)  # gpu_dense on an emulated GPU: the host does no math
    points = []
    for after in args.answer_after:
        runs: dict[str, list[dict[str, float]]] = {"thread": [], "loop": []}
        for _ in range(args.repeats):
            for mode in runs:  # alternated, so both see the same host
                runs[mode].append(asyncio.run(_point(args.model, args.batch, args.steps, mode, after)))
        point: dict[str, Any] = {"batch": args.batch, "answer_after_ms": after * 1e3}
        for mode, rs in runs.items():
            for key in ("cpu_ms_per_step", "wall_step_ms"):
                point[f"{mode}_{key}"] = statistics.median(r[key] for r in rs)
        point["round_trips_per_step"] = runs["thread"][0]["round_trips_per_step"]
        point["thread_vs_loop_cpu"] = point["thread_cpu_ms_per_step"] / point["loop_cpu_ms_per_step"]
        points.append(point)
        if not args.json:
            print(
                f"B={args.batch} answers after {after * 1e3:g} ms: dense CPU a step "
                f"thread {point['thread_cpu_ms_per_step']:.2f} ms, "
                f"loop {point['loop_cpu_ms_per_step']:.2f} ms "
                f"({point['thread_vs_loop_cpu']:.2f}x); wall thread {point['thread_wall_step_ms']:.1f} ms, "
                f"loop {point['loop_wall_step_ms']:.1f} ms"
            )
    print(json.dumps({"points": points}))


if __name__ == "__main__":
    main()
