"""gpu_dense's tensor-parallel ranks (--tensor-parallel N): rank 0 is the service's own process,
ranks 1..N-1 are child processes (`python -m services.gpu_dense.ranks`) that load their slices of the
weights and follow rank 0 (fastdecode/model/tensor_parallel.py). They meet over a TCPStore on
loopback; rank r uses cuda:r (NCCL) or the CPU (gloo).

One service, one fate: a rank that exits takes gpu_dense down at once (its supervisor, `up` or
Kubernetes, restarts it, and the scheduler re-prefills as for any gpu_dense loss), and a rank whose
gpu_dense dies is killed with it (PR_SET_PDEATHSIG). No collective is left waiting on a dead peer.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastdecode.model.dense import resolve_device
from fastdecode.model.tensor_parallel import RankGroup, TensorParallelModel
from fastdecode.runtime import codec
from fastdecode.runtime.serving import die_with_parent
from fastdecode.runtime.settings import DenseSettings

log = logging.getLogger("fastdecode.gpu_dense.ranks")

# Ranks wait for rank 0's next command as long as the fleet is idle: no collective timeout may fire
# then. A dead peer ends the wait at once (its sockets close); this bounds anything else.
IDLE_TIMEOUT = datetime.timedelta(days=7)
LOOPBACK = "127.0.0.1"
EXIT_RANK_LOST = 70  # gpu_dense's exit code when a rank is gone


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:base+r on GPUs, the CPU otherwise."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        return str(dev)
    return f"cuda:{(dev.index or 0) + rank}"


def _join(rank: int, world: int, store: dist.Store, device: str) -> RankGroup:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks on one host talk over loopback only
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=IDLE_TIMEOUT)
    return RankGroup(rank, world, dev)


class Ranks:
    """Rank 0's side: starts the other ranks, watches them, stops them."""

    def __init__(self, settings: DenseSettings) -> None:
        self.settings = settings
        self.world = settings.tensor_parallel
        self.procs: list[subprocess.Popen[bytes]] = []
        self.model: TensorParallelModel | None = None
        self._closing = False
        self._store: dist.TCPStore | None = None

    def spawn(self) -> None:
        """Start ranks 1..N-1. Called from the thread that lives as long as the process (the event
        loop's): PR_SET_PDEATHSIG fires when the starting thread ends."""
        s = self.settings
        self._store = dist.TCPStore(LOOPBACK, 0, self.world, is_master=True, wait_for_workers=False)
        for rank in range(1, self.world):
            cmd = [sys.executable, "-m", "services.gpu_dense.ranks", "--rank", str(rank)]
            cmd += ["--world", str(self.world), "--port", str(self._store.port), "--parent", str(os.getpid())]
            cmd += ["--model", str(s.model), "--device", rank_device(s.device, rank), "--dtype", s.dtype]
            cmd += ["--threads", str(s.threads or 0)]
            self.procs.append(subprocess.Popen(cmd))
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"rank-{rank}", daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._closing:
            log.error("tensor-parallel rank %d exited (code %s): gpu_dense stops with it", rank, code)
            logging.shutdown()
            os._exit(EXIT_RANK_LOST)

    def load(self, progress: Callable[[int, int], None] | None = None) -> TensorParallelModel:
        """Join the ranks and load rank 0's slices (blocking: run it off the event loop)."""
        s = self.settings
        assert self._store is not None, "spawn() first"
        group = _join(0, self.world, self._store, rank_device(s.device, 0))
        self.model = TensorParallelModel.load(
            s.model, str(group.device), codec.DTYPE_NAMES[s.dtype], group, progress
        )
        dist.barrier()  # every rank holds its slices
        log.info("tensor parallel over %d ranks (%s)", self.world, dist.get_backend())
        return self.model

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        if self.model is not None:
            self.model.close()
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="A tensor-parallel rank of gpu_dense (started by gpu_dense).")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    store = dist.TCPStore(LOOPBACK, args.port, args.world, is_master=False)
    group = _join(args.rank, args.world, store, args.device)
    model = TensorParallelModel.load(args.model, args.device, codec.DTYPE_NAMES[args.dtype], group)
    dist.barrier()
    model.follow()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
