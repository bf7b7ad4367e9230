"""The load `bench chaos`'s probes run beside them, for the e2e tests that call a probe: one greedy
stream per prompt, each on its own thread (fastdecode.benchmarks.chaos_probes._client)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from fastdecode.benchmarks.chaos_probes import _client, _Outcome
from fastdecode.tools.fleet import UpProcess


def stream_load(
    prompts: list[list[int]], gen_len: int, bound_s: float = 120.0
) -> Callable[[UpProcess], dict[int, _Outcome]]:
    """load(up): every prompt streamed at once for gen_len tokens; the outcomes by prompt index."""

    def load(up: UpProcess) -> dict[int, _Outcome]:
        out: dict[int, _Outcome] = {}
        threads = [
            threading.Thread(target=_client, args=(up.target, [p], gen_len, bound_s, out, i), daemon=True)
            for i, p in enumerate(prompts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * bound_s)
        return out

    return load
