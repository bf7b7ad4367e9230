"""The Responses API's store (`store: true` with `--responses-store N`): each tenant's last N responses
in memory, dropped after `--responses-store-ttl` seconds, never readable by another tenant (its ids
are looked up under the caller's tenant only, so another tenant's id is simply not there). A stored
response keeps the conversation that led to it (its input items, the earlier turns of a
previous_response_id chain included) for the next turn, and, while it runs, the callable that stops
it (POST /v1/responses/{id}/cancel). Pure: no web framework, no clock but the one it is given.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Stored:
    response: dict[str, Any]  # the Response object as last shown (in_progress until it ends)
    items: list[dict[str, Any]]  # the input items that led to it, earlier turns included
    cancel: Callable[[], Awaitable[None]] | None = None  # while it runs: stops it, returns once it has
    at: float = 0.0  # when it was stored (the store's clock)

    @property
    def running(self) -> bool:
        return self.cancel is not None and self.response.get("status") == "in_progress"


class ResponseStore:
    """Per tenant, the newest `per_tenant` responses younger than `ttl` seconds."""

    def __init__(self, per_tenant: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        if per_tenant < 1 or ttl <= 0:
            raise ValueError("a store holds at least one response for some time")
        self.per_tenant = per_tenant
        self.ttl = ttl
        self.clock = clock
        self._tenants: dict[str, OrderedDict[str, Stored]] = {}

    def __len__(self) -> int:
        return sum(len(t) for t in self._tenants.values())

    def _expire(self, tenant: str) -> OrderedDict[str, Stored]:
        held = self._tenants.get(tenant)
        if held is None:
            return OrderedDict()
        cutoff = self.clock() - self.ttl
        while held and next(iter(held.values())).at <= cutoff:  # oldest first
            held.popitem(last=False)
        if not held:
            del self._tenants[tenant]
        return held

    def put(self, tenant: str, response_id: str, stored: Stored) -> None:
        self._expire(tenant)
        held = self._tenants.setdefault(tenant, OrderedDict())
        stored.at = self.clock()
        held.pop(response_id, None)
        held[response_id] = stored
        while len(held) > self.per_tenant:
            held.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> Stored | None:
        return self._expire(tenant).get(response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        held = self._expire(tenant)
        found = held.pop(response_id, None) is not None
        if found and not held:
            self._tenants.pop(tenant, None)
        return found
