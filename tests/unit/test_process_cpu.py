"""The benchmarks' per-process CPU reading is to the nanosecond on Linux: on /proc's 10 ms ticks, a
part that spends a few ms a second reads +-25% over a 5 s window."""

from __future__ import annotations

import os
import sys
import time

import pytest

from fastdecode.benchmarks.transport import process_cpu_seconds


@pytest.mark.skipif(sys.platform != "linux", reason="the process CPU clock is read this way on Linux")
def test_reads_the_process_cpu_clock_not_ticks() -> None:
    t = time.process_time()
    while time.process_time() - t < 0.03:  # some CPU of this process's own
        pass
    before = time.process_time()
    got = process_cpu_seconds(os.getpid())
    after = time.process_time()
    assert before <= got <= after + 1e-6  # the same clock as process_time (ticks are up to 10 ms off)
