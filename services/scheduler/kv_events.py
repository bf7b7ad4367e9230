"""`--kv-events`: the scheduler's prefix registry as vLLM's KV event stream, for KV-aware routers.

vLLM's wire format (vllm/distributed/kv_events.py, `ZmqEventPublisher`): a ZMQ PUB socket sending
multipart [topic, seq (8 bytes, big-endian, from 0), payload], the payload a msgpack `EventBatch`
encoded as msgspec encodes its `array_like` tagged structs: [ts, [event, ...], data_parallel_rank],
each event an array led by its tag:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
     lora_name, extra_keys, group_idx]
    ["BlockRemoved", block_hashes, medium, group_idx]
    ["AllBlocksCleared"]

(msgspec writes every field of an array_like struct, defaults too; a decoder of an older layout
ignores the trailing fields it does not know, a newer one defaults those it misses). vLLM's newest
releases dropped array_like (map-encoded structs): a consumer of those decodes by field name and
needs this older, widely decoded layout configured.

Block hashes are vLLM's `sha256_cbor` (sha256 of the canonical CBOR of (parent hash, token ids, extra
keys), the first block's parent `sha256_cbor(PYTHONHASHSEED)`),
sent as vLLM sends them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the digest's low 64 bits
as an integer. A router that hashes a prompt with the same seed and block size finds the fleet's
blocks. A salted request's first block carries its salt as vLLM's extra key; the salt is the
gateway's hash of tenant and cache_salt, which no router can recompute (docs/prefix-caching.md).

The fleet is one endpoint to a router: a block is announced stored when the first shard holds it
and removed when the last one lets it go. Events of one event-loop turn (a scheduler step) go out as
one batch. The domain (fastdecode/scheduling/prefixes.py) knows nothing of ZMQ: it calls the
`PrefixListener` this module implements.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from typing import Any

import msgpack
import zmq

from fastdecode.runtime.endpoints import parse_pub_endpoint
from fastdecode.runtime.errors import InvalidInput
from fastdecode.scheduling.prefixes import PrefixListener, StoredBlocks

log = logging.getLogger("fastdecode.scheduler.kv_events")

MEDIUM_GPU = "GPU"  # vLLM's medium for its device cache: where a router looks first
HWM = 100_000  # batches queued on the socket before new ones are dropped (vLLM's default hwm)
HASH_CACHE = 1 << 17  # vLLM hashes kept by block name (~25 MB); one missing is rehashed from tokens
_MASK64 = (1 << 64) - 1


# ---- vLLM's block hashes -----------------------------------------------------------------------


def _head(major: int, n: int) -> bytes:
    """A CBOR item head in its shortest form (canonical CBOR, RFC 8949 4.2.1)."""
    if n < 24:
        return bytes((major << 5 | n,))
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes((major << 5 | extra,)) + n.to_bytes(size, "big")
    raise ValueError("integer too large for CBOR")


def cbor(obj: Any) -> bytes:
    """Canonical CBOR of the few types vLLM's block hash input holds (as cbor2.dumps(canonical=True))."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _head(0, obj) if obj >= 0 else _head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode()
        return _head(3, len(raw)) + raw
    if isinstance(obj, (tuple, list)):
        return _head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    raise TypeError(f"no CBOR encoding here for {type(obj).__name__}")


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's `sha256_cbor` (vllm/utils/hashing.py)."""
    return hashlib.sha256(cbor(obj)).digest()


def none_hash(seed: str) -> bytes:
    """vLLM's NONE_HASH, the first block's parent, for PYTHONHASHSEED=seed (`init_none_hash`)."""
    return sha256_cbor(seed)


def block_hash(parent: bytes, token_ids: list[int], extra_keys: tuple[Any, ...] | None) -> bytes:
    """vLLM's `hash_block_tokens` with sha256_cbor."""
    return sha256_cbor((parent, tuple(token_ids), extra_keys))


def external(h: bytes) -> int:
    """A hash as vLLM's events carry it by default (`maybe_convert_block_hash`)."""
    return int.from_bytes(h, "big") & _MASK64


def vllm_block_hashes(token_ids: list[int], block_size: int, seed: str = "0", salt: str = "") -> list[int]:
    """The event hashes vLLM gives the full blocks of a prompt: what a router computes for it."""
    parent, out = none_hash(seed), []
    for i in range(len(token_ids) // block_size):
        extra = (salt,) if i == 0 and salt else None
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(external(parent))
    return out


# ---- events --------------------------------------------------------------------------------------


def block_stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> list:
    # lora_id, medium, lora_name, extra_keys, group_idx: msgspec writes defaults too in array form
    return ["BlockStored", hashes, parent, token_ids, block_size, None, MEDIUM_GPU, None, None, None]


def block_removed(hashes: list[int]) -> list:
    return ["BlockRemoved", hashes, MEDIUM_GPU, None]  # group_idx


def all_blocks_cleared() -> list:
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: list[list], data_parallel_rank: int = 0) -> bytes:
    """An EventBatch as msgspec encodes vLLM's (array_like): [ts, events, data_parallel_rank]."""
    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


class KVEventPublisher(PrefixListener):
    """The prefix registry's listener: vLLM block hashes for the scheduler's block names, a count of
    the shards holding each block, and a PUB socket the batches leave on."""

    def __init__(self, address: str, topic: str = "", seed: str = "0") -> None:
        endpoint, bind = parse_pub_endpoint(address)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(endpoint) if bind else self._pub.connect(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise InvalidInput(f"--kv-events {address!r}: {e}") from None
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._root = none_hash(seed)
        self._vhash: OrderedDict[bytes, bytes] = OrderedDict()  # block name -> vLLM hash (32 bytes)
        self._held: dict[bytes, tuple[int, set[int]]] = {}  # block name -> (event hash, shards)
        self._pending: list[list] = []
        self._seq = 0
        self._flush_soon = False
        self._dropped = 0
        self._pending.append(all_blocks_cleared())  # a restarted scheduler: forget what it said before

    # -- PrefixListener
    def stored(self, blocks: StoredBlocks) -> None:
        new: list[int] = []
        for i in blocks.blocks:
            name = blocks.names[i]
            held = self._held.get(name)
            if held is None:
                self._held[name] = (external(self._hash(blocks, i)), {blocks.shard})
                new.append(i)
            else:
                held[1].add(blocks.shard)
        bs = blocks.block_size
        run: list[int] = []
        for i in new:  # consecutive blocks: one event with the parent of the first (as vLLM sends)
            if run and i != run[-1] + 1:
                self._stored_run(blocks, run, bs)
                run = []
            run.append(i)
        if run:
            self._stored_run(blocks, run, bs)

    def removed(self, shard: int, names: list[bytes]) -> None:
        gone: list[int] = []
        for name in names:
            held = self._held.get(name)
            if held is None:
                continue
            held[1].discard(shard)
            if not held[1]:
                del self._held[name]
                gone.append(held[0])
        if gone:
            self._queue(block_removed(gone))

    # -- hashes and batches
    def _hash(self, blocks: StoredBlocks, i: int) -> bytes:
        """vLLM's hash of block i of the sequence, hashing forward from the nearest known ancestor."""
        names, bs = blocks.names, blocks.block_size
        j = i
        while j >= 0 and names[j] not in self._vhash:
            j -= 1
        parent = self._vhash[names[j]] if j >= 0 else self._root
        for k in range(j + 1, i + 1):
            extra = (blocks.salt,) if k == 0 and blocks.salt else None
            parent = block_hash(parent, list(blocks.tokens[k * bs : (k + 1) * bs]), extra)
            self._vhash[names[k]] = parent
        self._vhash.move_to_end(names[i])
        while len(self._vhash) > HASH_CACHE:
            self._vhash.popitem(last=False)
        return self._vhash[names[i]]

    def _stored_run(self, blocks: StoredBlocks, run: list[int], bs: int) -> None:
        first = run[0]
        parent = external(self._hash(blocks, first - 1)) if first > 0 else None
        hashes = [self._held[blocks.names[i]][0] for i in run]
        tokens = [int(t) for t in blocks.tokens[first * bs : (run[-1] + 1) * bs]]
        self._queue(block_stored(hashes, parent, tokens, bs))

    def _queue(self, event: list) -> None:
        self._pending.append(event)
        if not self._flush_soon:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
                self._flush_soon = True
            except RuntimeError:  # no loop (a test driving the core by hand): flush() sends
                pass

    def flush(self) -> None:
        """Send what the listener queued as one batch."""
        self._flush_soon = False
        if not self._pending:
            return
        payload = encode_batch(time.time(), self._pending)
        self._pending = []
        try:
            self._pub.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:  # no subscriber keeping up: drop, as a PUB socket at its HWM does
            self._dropped += 1
            if self._dropped == 1:
                log.warning("KV events dropped: the subscribers at %s do not keep up", self.endpoint)
        self._seq += 1

    def close(self) -> None:
        self._pub.close(linger=0)
        self._ctx.term()
