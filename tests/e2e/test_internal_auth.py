"""Every internal method of every internal service refuses a caller without the fleet secret
(UNAUTHENTICATED), with and without TLS; health and reflection stay open. The method list comes from
each running server's reflection, so a method added later is covered without editing this test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from fastdecode.client import Client
from fastdecode.runtime.fleet_secret import FleetSecret
from fastdecode.runtime.rpc import TLSFiles, sync_channel
from fastdecode.tools.fleet import Fleet
from tests.support import make_tls

GARBAGE = b"\xff\xff\xff\xff"  # never parsed when the caller is refused
OPEN = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")


def internal_methods(channel: grpc.Channel) -> Iterator[tuple[str, bool, bool]]:
    """(path, client_streaming, server_streaming) of every method the server reflects, open ones aside."""
    db = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(db)
    for name in db.get_services():
        if name in OPEN:
            continue
        for m in pool.FindServiceByName(name).methods:
            yield f"/{name}/{m.name}", m.client_streaming, m.server_streaming


def call_raw(
    channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool
) -> grpc.RpcError:
    kind = f"{'stream' if client_streaming else 'unary'}_{'stream' if server_streaming else 'unary'}"
    call = getattr(channel, kind)(path)  # raw bytes in and out
    try:
        out = call(iter([GARBAGE]) if client_streaming else GARBAGE, timeout=20)
        if server_streaming:
            list(out)
    except grpc.RpcError as e:
        return e
    raise AssertionError(f"{path} answered")


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mtls"])
def test_every_internal_method_needs_the_fleet_secret(
    tls: bool, model_factory: Callable, tmp_path: Path
) -> None:
    env: dict[str, str] = {}
    pki = make_tls(tmp_path / "pki") if tls else None
    if pki:
        env = {
            "FASTDECODE_TLS_CERT": str(pki["cert"]),
            "FASTDECODE_TLS_KEY": str(pki["key"]),
            "FASTDECODE_TLS_CA": str(pki["ca"]),
        }
    with Fleet(
        model=model_factory("llama"),
        shards=1,
        device="cpu",
        kv_capacity=32 << 20,
        workdir=tmp_path / "w",
        env=env,
    ) as f:
        assert f.gateway and f.scheduler and f.dense
        certs = TLSFiles(pki["cert"], pki["key"], pki["ca"]) if pki else TLSFiles()
        secret = f.peer_credentials.secret
        assert secret is not None
        bare = certs  # a valid fleet certificate where TLS runs, but no secret
        wrong = TLSFiles(certs.cert, certs.key, certs.ca, FleetSecret.parse("x" * 40, "test"))
        right = TLSFiles(certs.cert, certs.key, certs.ca, secret)
        refused: dict[str, list[str]] = {}
        for svc in (f.scheduler, f.dense, f.kv[0]):
            with sync_channel(svc.address, bare) as ch:
                health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING  # health stays open
                methods = list(internal_methods(ch))
                assert methods, svc.name
                for path, cs, ss in methods:
                    e = call_raw(ch, path, cs, ss)
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (path, e.code(), e.details())
                    refused.setdefault(svc.name, []).append(path)
            with sync_channel(svc.address, wrong) as ch:
                for path, cs, ss in methods:
                    assert call_raw(ch, path, cs, ss).code() == grpc.StatusCode.UNAUTHENTICATED, path
            with sync_channel(svc.address, right) as ch:  # with it, the call reaches the method
                for path, cs, ss in methods:
                    e = call_raw(ch, path, cs, ss)
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, e.code(), e.details())
        assert {"/fastdecode.v1.Scheduler/Submit", "/fastdecode.v1.KVAttention/Release"} <= {
            p for paths in refused.values() for p in paths
        }
        assert any(p.endswith("/Reserve") for p in refused[f.kv[0].name])
        # The fleet's own calls carry it: generation works end to end.
        client = Client(f.gateway.address, tls_ca=pki["ca"]) if pki else Client(f.gateway.address)
        with client:
            assert client.generate(token_ids=[0, 1, 2], max_tokens=3, timeout=60).token_ids
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "w").glob("*.log"))
    assert "Traceback" not in logs
    assert secret.send not in logs
    assert "refused" in logs  # one rate-limited line per service, not one per call
    assert logs.count("without the fleet credential") <= 3 * 2


def test_up_keeps_the_token_and_the_secret_out_of_ps(model_factory: Callable, tmp_path: Path) -> None:
    """`up --auth-token X` given on the command line: no process of the fleet shows X (nor the
    fleet secret) in its command line, and the gateway still requires X."""
    from fastdecode.client import FastDecodeError
    from fastdecode.tools.fleet import launch_up

    token = "ps-visible-token-0123456789"
    up = launch_up(model_factory("llama"), tmp_path, "--auth-token", token, shards=1, kv_capacity=32 << 20)
    try:
        secret = up.peer_credentials.secret
        assert secret is not None
        for pid in [up.proc.pid, *up.pids()]:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            assert token not in cmdline and secret.send not in cmdline, (pid, cmdline)
        with Client(up.target, token=token) as client:
            assert client.generate(token_ids=[0, 1], max_tokens=2, timeout=60).token_ids
        with pytest.raises(FastDecodeError) as info, Client(up.target, max_retries=0) as client:
            client.generate(token_ids=[0, 1], max_tokens=2, timeout=30)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert up.stop() == 0
