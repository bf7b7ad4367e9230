"""KV-cache store and attention: the R-part core. Imports no gRPC.

memory (dtypes, huge pages, int8), blocks (the allocator, a sequence's block table), attend (one
Attend item: `AttendBatch`, the kernels), store (the pool: reservations, prefixes, migration)."""

from fastdecode.kv.attend import AttendBatch
from fastdecode.kv.blocks import BlockAllocator
from fastdecode.kv.memory import KV_DTYPES, huge_page_empty, huge_page_share, kv_bytes_per_element
from fastdecode.kv.store import BACKENDS, KVStore

__all__ = [
    "BACKENDS",
    "KV_DTYPES",
    "AttendBatch",
    "BlockAllocator",
    "KVStore",
    "huge_page_empty",
    "huge_page_share",
    "kv_bytes_per_element",
]
