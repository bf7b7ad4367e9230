"""`bench chaos` probe for requests far over the gateway's list limits (beside chaos_attacks.py's):

- bad_words: while the load runs, requests whose `bad_words` are far over the limits are sent in turn,
  over gRPC and, where the fleet serves it, HTTP: 256 words of 15 KB (3.75 MiB: tokenized on the
  gateway's event loop, they once stalled every stream for 2.6-2.9 s), one word of 3.75 MiB, and
  257 short words. Each must be a 400 (INVALID_ARGUMENT) within moments, no service may die, and the
  load must end with the fault-free tokens; the longest pause any of its streams saw is reported
  beside the fault-free run's.

It reports probe_summary's figures (completed, failed_clear, hung, lost) and `crashed`.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # they speak gRPC: imported where the probe runs, so the inputs import without it
    from fastdecode.benchmarks.chaos_probes import _Outcome
    from fastdecode.tools.fleet import UpProcess

WORD_UNIT = "ab cd "  # tokenizes into many tokens: the costly case for the tokenizer


def huge_bad_words(words: int = 256, word_chars: int = 15 * 1024) -> list[str]:
    """`words` bad words of `word_chars` ASCII characters each (3.75 MiB at the defaults)."""
    word = (WORD_UNIT * (word_chars // len(WORD_UNIT) + 1))[:word_chars]
    return [word] * words


def oversized_bad_words() -> list[list[str]]:
    """The probe's inputs: 256 words of 15 KB, one word of 3.75 MiB, 257 one-letter words."""
    return [huge_bad_words(), huge_bad_words(1, 256 * 15 * 1024), ["w"] * 257]


def _http_code(address: str, words: list[str]) -> str:
    body = json.dumps({"prompt": "a", "max_tokens": 1, "bad_words": words}).encode()
    req = urllib.request.Request(
        f"http://{address}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return "OK" if r.status == 200 else f"HTTP_{r.status}"
    except urllib.error.HTTPError as e:
        return "INVALID_ARGUMENT" if e.code == 400 else f"HTTP_{e.code}"
    except OSError as e:  # refused, reset, timed out: the gateway did not answer
        return f"NO_ANSWER ({type(e).__name__})"


def bad_words_probe(
    up: UpProcess,
    load: Callable[[UpProcess], dict[int, _Outcome]],
    reference: dict[int, _Outcome],
    gen_len: int,
    sends: int = 12,
) -> dict[str, Any]:
    """The load again, with `sends` oversized bad_words requests (the inputs in turn, alternating
    gRPC and HTTP where the fleet serves HTTP) sent while it runs."""
    from fastdecode.benchmarks.chaos_attacks import _crashed, _equal, _processes
    from fastdecode.benchmarks.chaos_probes import probe_summary
    from fastdecode.client import Client, FastDecodeError

    before = _processes(up.reload())
    inputs = oversized_bad_words()
    codes: list[str] = []
    seconds: list[float] = []

    def attack() -> None:
        time.sleep(0.3)  # mid-decode
        with Client(up.target, timeout=60, max_retries=0) as client:
            for i in range(sends):
                words = inputs[i % len(inputs)]
                t0 = time.monotonic()
                if up.http is not None and i % 2:
                    codes.append(_http_code(up.http, words))
                else:
                    try:
                        client.generate(token_ids=[0, 5], max_tokens=1, bad_words=words)
                        codes.append("OK")
                    except FastDecodeError as e:
                        codes.append(e.code.name)
                seconds.append(time.monotonic() - t0)

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    out = load(up)
    attacker.join(sends * 60 + 30)
    return probe_summary(
        "bad_words",
        len(reference),
        out,
        gen_len,
        crashed=_crashed(before, up),
        oversized_inputs=len(codes),
        oversized_refused_400=sum(c == "INVALID_ARGUMENT" for c in codes),
        oversized_median_s=statistics.median(seconds) if seconds else float("nan"),
        oversized_max_s=max(seconds, default=float("nan")),
        longest_pause_s=max((o.longest_pause_s for o in out.values()), default=float("nan")),
        reference_longest_pause_s=max((o.longest_pause_s for o in reference.values()), default=float("nan")),
        tokens_equal_fault_free=_equal(out, reference),
    )
