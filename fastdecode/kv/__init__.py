"""KV-cache store and attention: the R-part core. Imports no gRPC."""

from fastdecode.kv.store import BlockAllocator, KVStore

__all__ = ["BlockAllocator", "KVStore"]
