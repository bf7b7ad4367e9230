"""Ports handed to a process that binds them later come from outside the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fastdecode.tools.fleet import free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE.exists(), reason="Linux reports its ephemeral range in /proc")
def test_free_ports_avoid_the_ephemeral_range() -> None:
    low, high = map(int, RANGE.read_text().split())
    if low <= 12_000:
        pytest.skip(f"ephemeral range starts at {low}: no room below it")
    ports = [free_port() for _ in range(50)]
    assert all(10_000 <= p < low for p in ports), ports
    with socket.socket() as s:  # and each is bindable right now
        s.bind(("127.0.0.1", ports[0]))


def test_a_taken_port_is_never_handed_out() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        taken = held.getsockname()[1]
        assert all(free_port() != taken for _ in range(200))
