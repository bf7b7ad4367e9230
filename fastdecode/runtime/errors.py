"""The one error model of the servers. Cores raise these; adapters map `Status` to the wire.

Every domain error carries a `Status` of our own. Exactly one table maps it to gRPC codes
(fastdecode.runtime.rpc.GRPC_CODE) and one to HTTP statuses (fastdecode.gateway.openai.HTTP_STATUS).
Per-sequence failures travel as typed errors (status and message), never as strings to parse.

This module imports no gRPC: the model, KV store, scheduling policy and sampling use it. The SDK
(fastdecode.client) has its own exception families for callers; this base is `ServiceError`.
"""

from __future__ import annotations

import enum
import logging
import traceback
from typing import Any, ClassVar

_log = logging.getLogger("fastdecode.runtime.errors")


class Status(enum.Enum):
    """What went wrong, in our words. Values are the gRPC status numbers, so an in-band item
    error (tensor.proto ItemError.code) carries `status.value` unchanged on the wire."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def from_value(cls, value: int) -> Status:
        """The status of a wire number; an unknown number is UNKNOWN."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


class ServiceError(Exception):
    """Base of every server-side domain error: a `status` and a message safe to show a caller.

    A subclass fixes the status; `ServiceError(message, status)` makes one for any status (e.g. a
    peer's relayed status without a domain meaning). `param` names the offending request field
    where known (the HTTP API reports it)."""

    status: ClassVar[Status] = Status.INTERNAL

    def __init__(self, message: str = "", status: Status | None = None, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status  # type: ignore[misc] - per-instance override of the class default

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.status, self.param))


def _rebuild(kind: type[ServiceError], message: str, status: Status, param: str | None) -> ServiceError:
    return kind(message, status, param=param)


class InvalidInput(ServiceError):
    """Bad input from a caller."""

    status = Status.INVALID_ARGUMENT


class OutOfRange(InvalidInput):
    """A value outside what the model supports, e.g. a context too long."""

    status = Status.OUT_OF_RANGE


class ResourceExhausted(ServiceError):
    """A bounded resource is full: KV pool, waiting queue, concurrency limit."""

    status = Status.RESOURCE_EXHAUSTED


class NotFound(ServiceError):
    """An unknown handle, e.g. a sequence id the shard does not hold."""

    status = Status.NOT_FOUND


class Unavailable(ServiceError):
    """Not ready, draining, or a peer is gone."""

    status = Status.UNAVAILABLE


class DependencyDown(Unavailable):
    """A service this one needs has stayed unreachable past its bound: the request ends now rather
    than wait, and resubmitting it to the same service does not help until that one is back."""


class FailedPrecondition(ServiceError):
    """The system is not in a state that allows the call."""

    status = Status.FAILED_PRECONDITION


class ModelLoadError(ServiceError):
    """A checkpoint cannot be loaded: unsupported architecture, missing tensor, bad config."""

    status = Status.FAILED_PRECONDITION


class DeadlineExceeded(ServiceError):
    """The request's deadline passed."""

    status = Status.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    """The request was cancelled (by its caller, or by a peer)."""

    status = Status.CANCELLED


class Unauthenticated(ServiceError):
    """Missing or wrong credentials."""

    status = Status.UNAUTHENTICATED


class InternalError(ServiceError):
    """A failure that is ours, not the caller's; the details belong in the log."""

    status = Status.INTERNAL


# A peer's status back into the domain error of the same meaning (relays, in-band item errors).
_ERROR_OF_STATUS: dict[Status, type[ServiceError]] = {
    Status.INVALID_ARGUMENT: InvalidInput,
    Status.OUT_OF_RANGE: OutOfRange,
    Status.RESOURCE_EXHAUSTED: ResourceExhausted,
    Status.NOT_FOUND: NotFound,
    Status.UNAVAILABLE: Unavailable,
    Status.FAILED_PRECONDITION: FailedPrecondition,
    Status.DEADLINE_EXCEEDED: DeadlineExceeded,
    Status.CANCELLED: Cancelled,
    Status.UNAUTHENTICATED: Unauthenticated,
    Status.INTERNAL: InternalError,
}


def error_for(status: Status, message: str) -> ServiceError:
    """The domain error for `status` (a status with no class of its own keeps its status)."""
    kind = _ERROR_OF_STATUS.get(status)
    return kind(message) if kind is not None else ServiceError(message, status)


def as_service_error(exc: BaseException, log: logging.Logger | None = None) -> ServiceError:
    """Any exception as a ServiceError: domain errors stay as they are; anything else is an
    InternalError with a generic message, and its traceback goes to the log (never to a caller)."""
    if isinstance(exc, ServiceError):
        return exc
    (log or _log).error("internal error: %s", "".join(traceback.format_exception(exc)))
    return InternalError(f"internal error ({type(exc).__name__})")


# Statuses a peer answers that mean the same to our caller (relayed with their message); any other
# status from a peer (INTERNAL, UNKNOWN, UNAUTHENTICATED between services, ...) is our failure.
_RELAYED = frozenset(
    {
        Status.INVALID_ARGUMENT,
        Status.OUT_OF_RANGE,
        Status.RESOURCE_EXHAUSTED,
        Status.NOT_FOUND,
        Status.UNAVAILABLE,
        Status.FAILED_PRECONDITION,
    }
)


def has_domain_meaning(status: Status) -> bool:
    """Whether a peer's `status` is relayed as it is (else it becomes INTERNAL at the relay)."""
    return status in _RELAYED
