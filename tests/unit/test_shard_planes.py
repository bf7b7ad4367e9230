"""gpu_dense's three shard planes implement the one declared ShardPlaneService (services/gpu_dense/
exchange/service.py): every member, with the Protocol's parameters, and each of the step runner's
LayerPlane capabilities declared on the class; the exchange-worker messages cross the control socket
(exchange.proto) and come back as the named types they are."""

from __future__ import annotations

import inspect
import re

import pytest

from fastdecode.dense import LayerPlane
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.fleet_secret import FleetSecret
from services.gpu_dense.exchange import messages as m
from services.gpu_dense.exchange.host_shard import HostShardPlane
from services.gpu_dense.exchange.links import ShardLinks
from services.gpu_dense.exchange.plane import ExchangePlane
from services.gpu_dense.exchange.service import ShardPlaneService

MEMBERS = [n for n in vars(ShardPlaneService) if not n.startswith("_")]


@pytest.mark.parametrize("plane", [ShardLinks, ExchangePlane, HostShardPlane])
def test_every_plane_implements_the_protocol(plane: type) -> None:
    assert {"num_shards", "links", "add_shard", "remove", "restore", "attend_layer", "close"} <= set(MEMBERS)
    for name in MEMBERS:
        want = getattr(ShardPlaneService, name)
        got = getattr(plane, name, None)
        if isinstance(want, property):  # a property, or an attribute every instance sets
            init = inspect.getsource(plane.__init__)
            assert isinstance(got, property) or re.search(rf"self\.{name}\b[^=\n]*=", init), (
                plane.__name__,
                name,
            )
            continue
        assert got is not None, f"{plane.__name__} lacks {name}"
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), (plane.__name__, name)
        params = list(inspect.signature(want).parameters)
        assert list(inspect.signature(got).parameters)[: len(params)] == params, (plane.__name__, name)


CAPABILITIES = ["attend_layer_at", "attend_layer_blocking", "staging"]


def test_every_plane_declares_the_layer_planes_capabilities() -> None:
    """The runner reads each capability as an attribute (None: the plane has none), so every plane
    declares LayerPlane and sets each one, on the class or in __init__; the exchange plane has all."""
    assert sorted(n for n in LayerPlane.__annotations__ if n != "num_shards") == CAPABILITIES
    for plane in (ShardLinks, ExchangePlane, HostShardPlane):
        assert LayerPlane in plane.__mro__, plane.__name__
        init = inspect.getsource(plane.__init__)
        for name in CAPABILITIES:
            assert name in vars(plane) or re.search(rf"self\.{name}\b[^=\n]*=", init), (plane.__name__, name)
    assert all(vars(ShardLinks)[name] is None for name in CAPABILITIES)
    assert all(callable(vars(ExchangePlane)[name]) for name in CAPABILITIES)
    assert HostShardPlane.attend_layer_at is None and HostShardPlane.attend_layer_blocking is None


def test_messages_travel_as_named_types() -> None:
    item = m.ItemSlices(
        2,
        ["a", "b"],
        [1, 3],
        [0, 9],
        (0, (2, 2), "bfloat16"),
        (8, (2, 1), "bfloat16"),
        (16, (2, 1), "bfloat16"),
        24,
        8,
    )
    to_worker = [
        m.Attend(7, 1, 3, "arena", [item]),
        m.Attend(8, 1, 4, "arena", None),  # the slot's last items again
        m.Attend(9, 0, 0, "arena", []),
        m.Attend(10, 1, 5, "arena", None, 123_456_789_012_345),  # held till the device is done
        m.Cancel(7),
        m.AddShard(3, "127.0.0.1:5"),
        m.RemoveShard(3),
        m.RestoreShard(3),
        m.Sync(2**40),
        m.Secret(None),
    ]
    for msg in to_worker:
        data = m.pack(msg)
        assert int.from_bytes(data[:4], "little") == len(data) - 4
        back = m.unpack_to_worker(data[4:])
        assert type(back) is type(msg) and back == msg, msg
    secret = m.unpack_to_worker(m.pack(m.Secret(FleetSecret.parse("s" * 20, "test")))[4:])
    assert isinstance(secret, m.Secret) and secret.secret is not None and secret.secret.send == "s" * 20
    for msg in (m.Done(7, [m.Ok((24, (2, 2), "bfloat16")), m.Err(14, "gone")]), m.Synced(9), m.Ready(123)):
        back = m.unpack_to_dense(m.pack(msg)[4:])
        assert type(back) is type(msg) and back == msg
    assert isinstance(back, m.Ready)


def test_attend_frame_is_the_protobuf_encoding_of_an_attend_without_items() -> None:
    """The per-layer frame the blocking path writes by hand is byte for byte what protobuf writes (so
    both workers parse it), zero fields left out as proto3 does, varints of every width."""
    for rid, slot, layer, arena, not_before in [
        (1, 0, 0, "a", 0),
        (127, 1, 31, "fastdecode-arena-0123", 123_456_789_012_345),
        (128, 0, 1, "x" * 200, 1),
        (2**40 + 5, 1, 300, "arena", 2**63 - 1),
    ]:
        frame = m.attend_frame(rid, slot, layer, arena, not_before)
        assert frame == m.pack(m.Attend(rid, slot, layer, arena, None, not_before))
        assert m.unpack_to_worker(frame[4:]) == m.Attend(rid, slot, layer, arena, None, not_before)


def test_an_unknown_message_is_refused() -> None:
    with pytest.raises(InvalidInput):
        m.unpack_to_worker(b"")
    with pytest.raises(InvalidInput):
        m.unpack_to_dense(b"")


def test_the_done_reader_reuses_answers_it_has_seen_and_keeps_each_rid() -> None:
    oks = [m.Ok((24, (2, 2), "bfloat16")), m.Ok((32, (1, 2), "bfloat16"))]
    read = m.DoneReader(size=2)
    first = read(m.pack(m.Done(5, oks))[4:])
    assert first == m.Done(5, oks)
    for rid in (6, 300, 1 << 40):  # one- to six-byte varints
        again = read(m.pack(m.Done(rid, list(oks)))[4:])
        assert again == m.Done(rid, oks) and again.results is first.results  # no parse, same tuples
    other = [m.Ok((24, (2, 2), "bfloat16")), m.Ok((40, (1, 2), "bfloat16"))]
    assert read(m.pack(m.Done(7, other))[4:]) == m.Done(7, other)  # other slices: parsed
    failed = [m.Err(14, "gone"), oks[1]]
    for rid in (8, 9):  # errors are parsed every time (never memoised)
        back = read(m.pack(m.Done(rid, failed))[4:])
        assert back == m.Done(rid, failed)
    assert read(m.pack(m.Ready(42))[4:]) == m.Ready(42)
    with pytest.raises(InvalidInput):
        read(b"")
