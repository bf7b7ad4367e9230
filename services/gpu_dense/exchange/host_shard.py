"""A kv_attention shard hosted in gpu_dense's own process (`--host-shard N`).

Why: a dense host's cores idle whenever its S-part waits on the shards. On a CPU dense host at long
contexts `bench split` measured the dense core idle 145 of 396 ms per step; a GPU host's CPU cores
idle nearly all the time. A shard in gpu_dense's process puts them to work on the share of sequences
placed there, with no wire and no codec between the S-part and that share's attention.

To everyone else it is a real shard: the KVAttention service (Reserve, Release, Stats, Fill,
migration, health, fleet secret) on its own port of this process, on this process's event loop,
so the scheduler places sequences on it, measures its speed, drains and migrates it like any other.
Only its Attend items skip the wire: HostShardPlane hands them to the service's core in process
once the other shards' requests are out and before their answers are awaited, so the host's share
is attended while the remote shards attend theirs. Of the inner plane's capabilities it forwards
staging (the hosted share reads its rows of the staging as the workers read theirs) and declares
the other two absent: the hosted shard's core lives on the event loop (no slot's thread may attend
on it), and its share is attended when the layer is handed over, so the runner waits for the device
first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from fastdecode.dense import AttendItem, LayerPlane
from fastdecode.dense.plane import Stage
from fastdecode.kv import AttendBatch
from fastdecode.runtime.errors import InvalidInput, ServiceError, as_service_error, error_for
from fastdecode.runtime.settings import DenseSettings, ServiceSettings, ShardSettings
from services.gpu_dense.exchange.links import ShardLinks
from services.gpu_dense.exchange.plane import ExchangePlane
from services.gpu_dense.exchange.service import ShardEntry
from services.kv_attention.server import build

log = logging.getLogger("fastdecode.gpu_dense.host_shard")


class HostShard:
    """The hosted shard's service and its server on the port its address in --shards names."""

    def __init__(self, settings: DenseSettings, index: int, address: str) -> None:
        port = address.rsplit(":", 1)[-1] if ":" in address else ""
        if not port.isdigit() or int(port) == 0:
            raise InvalidInput(f"the hosted shard's address {address!r} needs a port (HOST:PORT)")
        self.index = index
        self.address = address
        # gpu_dense's own bind address, TLS, fleet secret and grace; the shard's port and pool
        common = settings.model_dump(include=set(ServiceSettings.model_fields))
        self.settings = ShardSettings(
            **{**common, "port": int(port), "metrics_port": None, "ready_file": None},
            shard_id=index,
            kv_capacity=settings.host_shard_kv_capacity,
            kv_dtype=settings.host_shard_kv_dtype,
        )
        self.server, self.service = build(self.settings)
        self.service.retire = self.retire

    def count_dense_busy(self, seconds: float) -> None:
        """gpu_dense's S-part ran this long on the cores this shard attends on (a piped step):
        it counts in the shard's measured speed (ShardStats.host_busy_seconds)."""
        self.service.core.host_busy_seconds += seconds

    async def retire(self) -> None:
        """Retire (the end of `shards drain`): this shard stops serving, gpu_dense goes on. Its port
        answers health NOT_SERVING until AddShard brings the address back (HostShardPlane.restore)."""
        await self.server.set_serving(False)
        log.info("hosted shard %d retired: NOT_SERVING until it is added again", self.index)

    async def start(self) -> None:
        await self.server.start()
        await self.server.set_serving(True)
        log.info(
            "hosting shard %d on %s:%d (capacity %d bytes, kv dtype %s)",
            self.index,
            self.settings.host,
            self.server.port,
            self.settings.kv_capacity,
            self.settings.kv_dtype,
        )

    async def stop(self) -> None:
        await self.server.stop()


class HostShardPlane(LayerPlane[AttendItem]):
    """gpu_dense's shard plane with one shard in process: items for it go to the hosted service,
    the rest to the inner plane (in-process links or exchange workers), which keeps an entry for
    every index, the hosted one included, so indices, Info, AddShard and RemoveShard stay as they are.
    Its capabilities: the inner plane's staging; no attend_layer_at, no attend_layer_blocking."""

    attend_layer_at = None  # the hosted share is attended when the layer is handed over
    attend_layer_blocking = None  # the hosted shard's core is the event loop's

    def __init__(self, inner: ShardLinks | ExchangePlane, host: HostShard) -> None:
        self.inner = inner
        self.host = host
        # the hosted items read their rows of the inner plane's staging in place (_attend)
        self.staging: Stage | None = inner.staging

    @property
    def num_shards(self) -> int:
        return self.inner.num_shards

    @property
    def links(self) -> Sequence[ShardEntry]:
        return self.inner.links

    async def add_shard(self, address: str) -> int:
        return await self.inner.add_shard(address)

    async def remove(self, index: int) -> None:
        await self.inner.remove(index)

    async def restore(self, index: int) -> None:
        await self.inner.restore(index)
        if index == self.host.index:  # serving again after a drain's Retire
            await self.host.server.set_serving(True)

    def _hosted(self, item: AttendItem) -> bool:
        # A removed hosted shard's items go to the inner plane, which fails them UNAVAILABLE.
        return item.shard == self.host.index and not self.links[item.shard].removed

    def _attend(self, layer: int, item: AttendItem) -> torch.Tensor | BaseException:
        cpu = torch.device("cpu")
        try:
            b = item.batch
            batch = AttendBatch(
                b.seq_ids,
                b.num_tokens,
                b.start_pos,
                b.q.to(cpu).contiguous(),
                b.k.to(cpu).contiguous(),
                b.v.to(cpu).contiguous(),
            )
            return self.host.service.attend_tensors(layer, batch)
        except ServiceError as e:
            return error_for(e.status, f"shard {self.host.index} (hosted): {e.message}")
        except Exception as e:  # noqa: BLE001 - one item fails, the step goes on
            return as_service_error(e, log)

    async def attend_layer(
        self,
        slot: int,
        layer: int,
        items: Sequence[AttendItem],
        between: Callable[[], None] | None = None,
    ) -> list[torch.Tensor | BaseException]:
        here = [i for i, item in enumerate(items) if self._hosted(item)]
        if not here:
            return await self.inner.attend_layer(slot, layer, items, between)
        out: list[torch.Tensor | BaseException] = [torch.empty(0)] * len(items)

        def attend_here() -> None:
            for i in here:
                out[i] = self._attend(layer, items[i])
            if between is not None:
                between()

        mine = set(here)
        away = [i for i in range(len(items)) if i not in mine]
        if away:
            answers = await self.inner.attend_layer(
                slot, layer, [items[i] for i in away], between=attend_here
            )
            for i, o in zip(away, answers, strict=True):
                out[i] = o
        else:
            attend_here()
        return out

    async def close(self) -> None:
        await self.inner.close()
