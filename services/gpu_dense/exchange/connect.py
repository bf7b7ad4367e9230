"""gpu_dense's shard plane for a fleet: the Attend streams in this process (links.py) or in exchange
worker processes (plane.py), as the settings say."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastdecode.runtime.rpc import TLSFiles
from fastdecode.runtime.settings import DenseSettings
from services.gpu_dense.exchange.links import AttendLink, ShardLinks
from services.gpu_dense.exchange.plane import ExchangePlane
from services.gpu_dense.exchange.process import auto_workers

log = logging.getLogger("fastdecode.gpu_dense.shards")


def connect(
    addresses: Sequence[str],
    tls: TLSFiles | None = None,
    timeout: float = 60.0,
    concurrent: bool = False,
    workers: int = 0,
    worker_kind: str = "auto",
) -> ShardLinks | ExchangePlane:
    """gpu_dense's shard plane to these shards, shard i at addresses[i] (registered in pyproject.toml
    as the `grpc` shard plane, for the benchmarks in fastdecode): links in process, or with
    `workers` > 0 an ExchangePlane whose worker processes own them (plane.py; started by its
    start(), or by its first layer)."""
    if workers:
        return ExchangePlane(addresses, workers, tls, timeout, kind=worker_kind)
    links = [AttendLink(i, a, tls, timeout) for i, a in enumerate(addresses)]
    return ShardLinks(links, concurrent, tls, timeout)


async def make_plane(
    settings: DenseSettings, addresses: Sequence[str], remote: int | None = None
) -> ShardLinks | ExchangePlane:
    """gpu_dense's shard plane: in process (exchange_workers 0) or K started exchange workers;
    auto K counts the `remote` shards (all but a hosted one)."""
    k = settings.exchange_workers
    if k is None:
        k = auto_workers(len(addresses) if remote is None else remote, settings.threads, settings.device)
    if k == 0:
        return connect(addresses, settings.tls, settings.shard_timeout)
    plane = ExchangePlane(addresses, k, settings.tls, settings.shard_timeout, kind=settings.exchange_worker)
    await plane.start()
    log.info("%d %s exchange workers for %d shards", k, plane.workers[0].kind, len(addresses))
    return plane
