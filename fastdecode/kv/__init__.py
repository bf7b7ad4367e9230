"""KV-cache store and attention: the R-part core. Imports no gRPC."""

from fastdecode.kv.store import (
    BACKENDS,
    KV_DTYPES,
    BlockAllocator,
    KVStore,
    huge_page_empty,
    huge_page_share,
    kv_bytes_per_element,
)

__all__ = [
    "BACKENDS",
    "KV_DTYPES",
    "BlockAllocator",
    "KVStore",
    "huge_page_empty",
    "huge_page_share",
    "kv_bytes_per_element",
]
