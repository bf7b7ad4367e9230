"""Shared gRPC plumbing for the services: the one error -> status mapping, server
bootstrap (health, reflection, message limits, TLS, graceful SIGTERM), and channels.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fastdecode import errors
from fastdecode.metrics import start_metrics_server
from fastdecode.serving import write_ready_file
from fastdecode.v1 import tensor_pb2

log = logging.getLogger("fastdecode.rpc")

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # activations of a large batch fit; anything bigger is a bug

_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (errors.OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (errors.InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),
]

_FROM_STATUS: dict[grpc.StatusCode, type[errors.FastDecodeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidInput,
    grpc.StatusCode.OUT_OF_RANGE: errors.OutOfRange,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place that maps domain errors to gRPC status codes.

    Unknown exceptions become INTERNAL with a generic message; the traceback goes to the log.
    """
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code, str(exc)
    log.error("internal error: %s", "".join(traceback.format_exception(exc)))
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})"


def error_from_status(code: grpc.StatusCode, message: str) -> errors.FastDecodeError:
    """A peer's status back into a domain error (for in-band and relayed errors)."""
    return _FROM_STATUS.get(code, errors.FastDecodeError)(message)


def item_error(exc: BaseException) -> tensor_pb2.ItemError:
    code, msg = status_for(exc)
    return tensor_pb2.ItemError(code=code.value[0], message=msg)


def code_from_int(value: int) -> grpc.StatusCode:
    for c in grpc.StatusCode:
        if c.value[0] == value:
            return c
    return grpc.StatusCode.UNKNOWN


# ---- request ids --------------------------------------------------------------------------------
# The gateway's request id rides in this metadata key on every call made for a request; a call made
# for several sequences at once (Reserve, Release) names them all, comma-separated.
REQUEST_ID_KEY = "x-request-id"


def request_metadata(*request_ids: str) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_KEY, ",".join(request_ids)),) if request_ids else ()


def request_id_of(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's request id from the call metadata, or None."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and isinstance(value, str) and value:
            return value
    return None


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, msg = status_for(exc)
    await context.abort(code, msg)


# ---- TLS --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TLSFiles:
    """Certificate files. With a CA, servers require client certificates (mutual TLS)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None and self.key is not None

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        assert self.cert and self.key
        ca = self.ca.read_bytes() if self.ca else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=bool(ca) and require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def aio_channel(target: str, tls: TLSFiles | None = None) -> grpc.aio.Channel:
    if tls is not None and (tls.enabled or tls.ca):
        return grpc.aio.secure_channel(target, tls.channel_credentials(), options=CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


def sync_channel(target: str, tls: TLSFiles | None = None) -> grpc.Channel:
    if tls is not None and (tls.enabled or tls.ca):
        return grpc.secure_channel(target, tls.channel_credentials(), options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)


# ---- server bootstrap ---------------------------------------------------------------------------
class Server:
    """A grpc.aio server with health (NOT_SERVING until ready), reflection and graceful stop."""

    def __init__(
        self,
        service_names: Sequence[str],
        host: str,
        port: int,
        tls: TLSFiles | None = None,
        grace_seconds: float = 20.0,
        require_client_cert: bool = True,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.server = grpc.aio.server(
            interceptors=list(interceptors) or None,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ],
        )
        self.service_names = list(service_names)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        address = f"{host}:{port}"
        if tls is not None and tls.enabled:
            self.port = self.server.add_secure_port(address, tls.server_credentials(require_client_cert))
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise errors.Unavailable(f"cannot bind {address}")
        self.grace_seconds = grace_seconds
        self.stopping = asyncio.Event()

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def announce(
        self, host: str, metrics_port: int | None, ready_file: Path | None, **extra: object
    ) -> int | None:
        """Ready: start /metrics, health SERVING, then the ready file a supervisor waits for
        (`extra`: more bound ports to announce, e.g. the gateway's http_port)."""
        bound = start_metrics_server(metrics_port, host)
        await self.set_serving(True)
        write_ready_file(ready_file, port=self.port, metrics_port=bound, **extra)
        return bound

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        supervisor = os.environ.get("FASTDECODE_SUPERVISOR_PID", "")
        if supervisor.isdigit():
            self._watchdog = asyncio.create_task(self._watch_supervisor(int(supervisor)))

    async def _watch_supervisor(self, pid: int) -> None:
        """Stop gracefully when the supervisor that started us (fastdecode up) is gone."""
        while not self.stopping.is_set():
            await asyncio.sleep(1.0)
            if os.getppid() != pid:
                log.warning("supervisor %d is gone: stopping", pid)
                self.stopping.set()

    async def stop(self, drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """Health NOT_SERVING, let `drain` finish in-flight work, then stop with the grace period."""
        await self.set_serving(False)
        if drain is not None:
            try:
                await asyncio.wait_for(drain(), self.grace_seconds)
            except TimeoutError:
                log.warning("drain did not finish within %.0fs", self.grace_seconds)
        await self.server.stop(self.grace_seconds)
