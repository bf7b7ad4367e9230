"""tensor.proto's ItemError: a per-item failure carried in-band (the stream goes on), built from and
read back into the domain errors of fastdecode.runtime.errors by their Status, never parsed from
text."""

from __future__ import annotations

import logging

from fastdecode.runtime import errors
from fastdecode.runtime.errors import ServiceError, Status
from fastdecode.v1 import tensor_pb2

# an unexpected exception's traceback is logged where the gRPC adapters log theirs
log = logging.getLogger("fastdecode.runtime.rpc")


def item_error(exc: BaseException) -> tensor_pb2.ItemError:
    """A per-item failure for an in-band ItemError: a domain error keeps its status; anything else
    is INTERNAL with a generic message, and its traceback goes to the log (never to the caller)."""
    err = errors.as_service_error(exc, log)
    return tensor_pb2.ItemError(code=err.status.value, message=err.message)


def error_from_item(item: tensor_pb2.ItemError, prefix: str = "") -> ServiceError:
    """An in-band ItemError back into a typed domain error."""
    return errors.error_for(Status.from_value(item.code), f"{prefix}{item.message}")
