"""gpu_dense's three shard planes implement the one declared ShardPlaneService (services/gpu_dense/
plane.py): every member, with the Protocol's parameters; the exchange-worker messages pickle as the
named types they are (the control socket's frames)."""

from __future__ import annotations

import inspect
import pickle
import re

import pytest

from fastdecode.dense.handoff import frame
from services.gpu_dense import exchange_messages as m
from services.gpu_dense.exchange import ExchangePlane
from services.gpu_dense.host_shard import HostShardPlane
from services.gpu_dense.plane import ShardPlaneService
from services.gpu_dense.shards import ShardLinks

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


def test_messages_travel_as_named_types() -> None:
    item = m.ItemSlices(0, ["a"], [1], [0], (0, 1, (2,)), (8, 1, (2,)), (16, 1, (2,)), 24, 8)
    for msg in (m.Attend(7, 1, 3, "arena", [item]), m.Done(7, [m.Ok((24, 1, (2,))), m.Err(14, "gone")])):
        back = pickle.loads(frame(msg)[4:])
        assert type(back) is type(msg) and back == msg
    assert back.results[1].text == "gone" and isinstance(back.results[0], m.Ok)
