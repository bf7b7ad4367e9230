"""Undecodable bytes sent to every internal method of a running fleet come back INVALID_ARGUMENT
naming the message type, with one WARNING line and no traceback in any log; the fleet goes on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc

from fastdecode.client import Client
from fastdecode.runtime.rpc import sync_channel
from fastdecode.tools.fleet import Fleet
from fastdecode.v1 import dense_pb2, kv_attention_pb2, scheduler_pb2

GARBAGE = b"\xff\xff\xff\xff"  # field 31 with a truncated varint: the wire format is corrupt


def _call(channel: grpc.Channel, service: str, method: object) -> grpc.RpcError:
    path = f"/{service}/{method.name}"  # type: ignore[attr-defined]
    kind = (
        ("stream" if method.client_streaming else "unary")
        + "_"
        + (  # type: ignore[attr-defined]
            "stream" if method.server_streaming else "unary"  # type: ignore[attr-defined]
        )
    )
    call = getattr(channel, kind)(path)  # raw bytes in and out
    try:
        if method.client_streaming:  # type: ignore[attr-defined]
            out = call(iter([GARBAGE]), timeout=20)
        else:
            out = call(GARBAGE, timeout=20)
        if method.server_streaming:  # type: ignore[attr-defined]
            list(out)
    except grpc.RpcError as e:
        return e
    raise AssertionError(f"{path} accepted garbage")


def test_garbage_to_every_internal_method_is_invalid_argument(
    model_factory: Callable, tmp_path: Path
) -> None:
    services = {
        "kv": kv_attention_pb2.DESCRIPTOR.services_by_name["KVAttention"],
        "dense": dense_pb2.DESCRIPTOR.services_by_name["Dense"],
        "scheduler": scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"],
    }
    with Fleet(
        model=model_factory("llama"), shards=1, device="cpu", kv_capacity=32 << 20, workdir=tmp_path
    ) as f:
        assert f.gateway and f.scheduler and f.dense
        addresses = {"kv": f.kv[0].address, "dense": f.dense.address, "scheduler": f.scheduler.address}
        checked = 0
        for key, desc in services.items():
            with sync_channel(addresses[key], f.peer_credentials) as channel:
                for method in desc.methods:
                    e = _call(channel, desc.full_name, method)
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                        method.full_name,
                        e.code(),
                        e.details(),
                    )
                    assert method.input_type.full_name in (e.details() or ""), e.details()
                    checked += 1
        assert checked >= 9
        with Client(f.gateway.address) as client:  # every server went on
            assert client.generate(token_ids=[0, 1, 2], max_tokens=3, timeout=60).token_ids
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
    assert logs and not [name for name, text in logs.items() if "Traceback" in text]
    assert sum(text.count("is not a valid fastdecode.v1.") for text in logs.values()) == checked
