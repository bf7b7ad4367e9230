"""Structured logs for every service: one format, text or JSON (`--log-json`), and the id of the
request being served on each line, so one request can be followed through the whole fleet.

The id enters at the gateway and travels as gRPC metadata (`x-request-id`, see fastdecode.runtime.rpc); a
handler binds it with `request_context`, and every log line from that task carries it. Lines about
one sequence inside a batched step name it explicitly: `log.info(..., extra={"request_id": sid})`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

REQUEST_ID: ContextVar[str | None] = ContextVar("fastdecode_request_id", default=None)

TEXT_FORMAT = "%(asctime)s %(service)s %(levelname)s %(name)s%(request_tag)s: %(message)s"
JSON_FIELDS = "%(levelname)s %(service)s %(name)s %(request_id)s %(message)s"


class _Context(logging.Filter):
    """Stamps the service name and the current request id (unless the call named one) on records."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        record.request_tag = f" [{record.request_id}]" if record.request_id else ""
        return True


class Throttle:
    """At most one log line per `key` every `seconds`, saying how many were held back: a condition
    that repeats every step (a shard refusing every reservation) must not flood the log."""

    def __init__(self, seconds: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self._last: dict[object, float] = {}
        self._held: dict[object, int] = {}

    def __call__(self, key: object) -> int | None:
        """None: stay quiet; else log now, and this many like it were held back since the last."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.seconds:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)


def log_formatter(json_logs: bool) -> logging.Formatter:
    if json_logs:
        return JsonFormatter(
            JSON_FIELDS,
            rename_fields={"levelname": "level", "name": "logger"},
            timestamp="time",  # ISO 8601, UTC, microseconds: lines of several services sort by it
            json_ensure_ascii=False,
            reserved_attrs=[*RESERVED_ATTRS, "request_tag"],
        )
    return logging.Formatter(TEXT_FORMAT)


def configure_logging(service: str, level: str = "INFO", json_logs: bool = False) -> logging.Logger:
    """Root logging for a service process: stderr, the service name and request id on every line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Context(service))
    handler.setFormatter(log_formatter(json_logs))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    return logging.getLogger(f"fastdecode.{service}")


@contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
    """Log lines written inside carry `request_id` (a no-op for None)."""
    if request_id is None:
        yield
        return
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


def bind_request_id(request_id: str | None) -> None:
    """For the rest of the current task (a gRPC handler runs in its own), log with `request_id`.

    Use it in async-generator handlers, where a `with request_context(...)` would span yields."""
    REQUEST_ID.set(request_id)
