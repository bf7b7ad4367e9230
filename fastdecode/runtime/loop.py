"""The event loop every service and exchange worker runs on.

gpu_dense and its exchange workers run on uvloop (libuv) where it is installed: the step wakes its
loop several times per layer and mini-batch (the device clock, the workers' answers, the shards'
streams), and at a GPU's pace those wake-ups are a large share of the dense process's CPU. The
other services keep asyncio's loop: the gateway's grammar workers, spawned from a uvloop loop,
were seen to crash (SIGSEGV) on plain grammars, which they never did from asyncio's.
`FASTDECODE_EVENT_LOOP=uvloop|asyncio` sets every service's loop (the A/B of `bench pace`).
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastdecode.runtime.errors import InvalidInput

T = TypeVar("T")
LOOPS = ("auto", "uvloop", "asyncio")


def loop_kind(fast: bool = True) -> str:
    """The loop FASTDECODE_EVENT_LOOP names, `auto` resolved: for a `fast` service (gpu_dense and
    its exchange workers) uvloop when it is installed, else asyncio's."""
    kind = os.environ.get("FASTDECODE_EVENT_LOOP", "auto").strip().lower() or "auto"
    if kind not in LOOPS:
        raise InvalidInput(f"FASTDECODE_EVENT_LOOP={kind!r}: expected one of {', '.join(LOOPS)}")
    have = importlib.util.find_spec("uvloop") is not None
    if kind == "uvloop" and not have:
        raise InvalidInput("FASTDECODE_EVENT_LOOP=uvloop but uvloop is not installed")
    if kind == "auto":
        kind = "uvloop" if have and fast else "asyncio"
    return kind


def run_loop(main: Coroutine[Any, Any, T], fast: bool = True) -> T:
    """asyncio.run(main) on the configured loop."""
    try:
        kind = loop_kind(fast)
    except InvalidInput:
        main.close()
        raise
    if kind == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)


# The youngest generation's threshold (CPython's default: 700 net container allocations). A step
# makes a few objects per sequence that live until it is applied: at 700 the collector ran every
# step at B=256 and walked them all (0.11 ms of the scheduler's 1.3 a step); at this threshold
# they are gone before it runs, and cycles are still collected.
GEN0_THRESHOLD = 20_000


def settle_heap() -> int:
    """Freeze what start-up made (modules, a model, a tokenizer: ~190k objects in the scheduler)
    out of the cyclic collector: it lives as long as the process, and a full collection walked all
    of it each time (85-93 ms a pause in the scheduler, 2-2.5 frozen: `bench scheduler-step`'s gc_*);
    and collect the youngest generation less often (GEN0_THRESHOLD). Call once, when ready to
    serve. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])
    return gc.get_freeze_count()
