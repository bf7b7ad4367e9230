"""Domain errors. Cores raise these; fastdecode.rpc.status maps them to gRPC codes in one place.

This module imports no gRPC: the model, KV store, scheduling policy and sampling use it.
"""

from __future__ import annotations


class FastDecodeError(Exception):
    """Base of every domain error."""


class InvalidInput(FastDecodeError):
    """Bad input from a caller (maps to INVALID_ARGUMENT)."""


class OutOfRange(InvalidInput):
    """A value outside what the model supports, e.g. a context too long (OUT_OF_RANGE)."""


class ResourceExhausted(FastDecodeError):
    """A bounded resource is full: KV pool, waiting queue (RESOURCE_EXHAUSTED)."""


class NotFound(FastDecodeError):
    """An unknown handle, e.g. a sequence id the shard does not hold (NOT_FOUND)."""


class Unavailable(FastDecodeError):
    """Not ready, draining, or a peer is gone (UNAVAILABLE)."""


class FailedPrecondition(FastDecodeError):
    """The system is not in a state that allows the call (FAILED_PRECONDITION)."""


class ModelLoadError(FastDecodeError):
    """A checkpoint cannot be loaded: unsupported architecture, missing tensor, bad config."""
