"""Health on every server, the gateway's public one included: garbage is INVALID_ARGUMENT and
Health/List answers, both without a traceback in the log."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastdecode.runtime.rpc import Server


@pytest.mark.parametrize("guard_requests", [True, False], ids=["internal", "gateway"])
def test_health_garbage_and_list_are_quiet(guard_requests: bool, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        server = Server(["test.Svc"], "127.0.0.1", 0, guard_requests=guard_requests, internal=guard_requests)
        await server.start()
        await server.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                raw = ch.unary_unary("/grpc.health.v1.Health/Check")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await raw(b"\xff\xff\xff\xff", timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "HealthCheckRequest" in (info.value.details() or "")
                listed = await health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=5)
                assert listed.statuses["test.Svc"].status == health_pb2.HealthCheckResponse.SERVING
                assert listed.statuses["liveness"].status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.server.stop(0)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
