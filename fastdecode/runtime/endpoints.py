"""The address forms of a ZMQ PUB socket (the scheduler's `--kv-events`), checked where a flag is
read (`fastdecode up`, the scheduler's start) so a bad one is one clear line, not a failed service.
Pure Python: no zmq here (services/scheduler/kv_events.py opens the socket)."""

from __future__ import annotations

import re

from fastdecode.runtime.errors import InvalidInput

_ENDPOINT = re.compile(r"^tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def parse_pub_endpoint(address: str, flag: str = "--kv-events") -> tuple[str, bool]:
    """(endpoint, bind): vLLM's rule, bind a wildcard host (`tcp://*:5557`, `tcp://[::]:5557`), else
    connect (the subscriber binds, as llm-d's endpoint picker does). InvalidInput when malformed."""
    m = _ENDPOINT.match(address.strip())
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise InvalidInput(
            f"{flag} {address!r}: expected tcp://HOST:PORT (tcp://*:PORT to bind every interface)"
        )
    host = m.group(1)
    return address.strip(), host == "*" or host.startswith("[::")
