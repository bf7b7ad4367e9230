"""TLS on the public endpoint, mutual TLS inside the fleet, and no secrets in logs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastdecode.client import Client, FastDecodeError
from fastdecode.runtime.rpc import TLSFiles, sync_channel
from fastdecode.tools.fleet import Fleet
from tests.support import make_tls

SECRET = "s3cr3t-bearer-value"


def health_status(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3).status


def test_tls_public_endpoint_and_mtls_inside(model_factory: Callable, tmp_path: Path) -> None:
    tls = make_tls(tmp_path / "pki")
    rogue = make_tls(tmp_path / "rogue", name="rogue")
    env = {
        "FASTDECODE_TLS_CERT": str(tls["cert"]),
        "FASTDECODE_TLS_KEY": str(tls["key"]),
        "FASTDECODE_TLS_CA": str(tls["ca"]),
    }
    with Fleet(
        model=model_factory("llama"),
        shards=1,
        device="cpu",
        kv_capacity=64 << 20,
        workdir=tmp_path / "w",
        env=env,
        auth_token=SECRET,
    ) as fleet:
        assert fleet.gateway and fleet.scheduler
        # Public endpoint: TLS (server-authenticated) plus the bearer token.
        with Client(fleet.gateway.address, token=SECRET, tls_ca=tls["ca"]) as client:
            assert client.generate(prompt="hello over TLS", max_tokens=4).token_ids
        with pytest.raises(FastDecodeError) as info:  # plaintext to a TLS port
            Client(fleet.gateway.address, token=SECRET, timeout=3).generate(prompt="x", max_tokens=1)
        assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

        # Internal services: mTLS only. Plaintext, an unknown client and a client without a cert are refused.
        for svc in (fleet.scheduler, fleet.kv[0]):
            good = TLSFiles(tls["cert"], tls["key"], tls["ca"])
            assert health_status(sync_channel(svc.address, good)) == health_pb2.HealthCheckResponse.SERVING
            for channel in (
                sync_channel(svc.address),
                sync_channel(svc.address, TLSFiles(rogue["cert"], rogue["key"], tls["ca"])),
                sync_channel(svc.address, TLSFiles(None, None, tls["ca"])),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    health_status(channel)
                assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "w").glob("*.log"))
    assert SECRET not in logs
    assert tls["key"].read_text().splitlines()[1] not in logs
