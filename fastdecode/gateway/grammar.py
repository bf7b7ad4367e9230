"""The gateway's structured-output compiler: llguidance runs in worker processes, never on the event
loop, so a grammar that crashes it, outgrows its memory limit or runs past the time limit costs that
one request a 400 (InvalidInput) and the worker is replaced; every other stream goes on.

The limits (fastdecode/runtime/grammar.py `check_spec`) are checked here first, in process and
without llguidance, so the common refusals answer at once. Imports no gRPC.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time

from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.grammar import Structured, check_spec, load_llguidance

log = logging.getLogger("fastdecode.gateway.grammar")
WORKER_START_TIMEOUT_S = 60.0  # a worker that cannot start on a loaded host is a failed compile too


class GrammarCompiler:
    """compile(structured) -> llguidance grammar text, on up to `workers` worker processes."""

    def __init__(self, workers: int = 2, timeout: float = 10.0, memory_mb: int = 2048) -> None:
        self.timeout = timeout
        self.memory_bytes = memory_mb << 20
        self.workers = workers
        self._idle: list[asyncio.subprocess.Process] = []
        self._slots: asyncio.Semaphore | None = None
        self.crashed = 0  # workers lost to a grammar (crash, memory or time limit)

    async def compile(self, s: Structured) -> str:
        check_spec(s)
        load_llguidance()  # FailedPrecondition here, not a worker that dies at start
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            worker = await self._worker()
            started = time.perf_counter()
            try:
                assert worker.stdin is not None and worker.stdout is not None
                try:
                    worker.stdin.write((json.dumps({"kind": s.kind, "spec": s.spec}) + "\n").encode())
                    await worker.stdin.drain()
                except RuntimeError:  # uvloop: the pipe's transport is closed (asyncio: ConnectionError)
                    raise BrokenPipeError from None
                line = await asyncio.wait_for(worker.stdout.readline(), self.timeout)
            except TimeoutError:
                await self._lose(worker, f"ran past {self.timeout:g} s", s)
                raise InvalidInput(
                    f"the {s.kind} took longer than {self.timeout:g} s to compile; simplify it"
                ) from None
            except (ConnectionError, BrokenPipeError):
                line = b""
            except BaseException:  # cancelled mid-compile: its answer would be read by the next request
                await self._lose(worker, None, s)
                raise
            if not line:
                code = await self._lose(worker, "died", s)
                raise InvalidInput(
                    f"the {s.kind} could not be compiled: the compiler failed on it ({code}); "
                    "simplify it (fewer rules, less nesting)"
                )
            self._idle.append(worker)
            answer = json.loads(line)
            log.debug("compiled a %s in %.1f ms", s.kind, (time.perf_counter() - started) * 1e3)
            if "error" in answer:
                raise InvalidInput(answer["error"])
            return str(answer["grammar"])

    async def _worker(self) -> asyncio.subprocess.Process:
        while self._idle:
            worker = self._idle.pop()
            # alive, and its stdin still open: a worker that died idle may not be reaped yet
            if worker.returncode is None and worker.stdin is not None and not worker.stdin.is_closing():
                return worker
            if worker.returncode is None:
                worker.kill()
            await worker.wait()  # one that died idle (killed from outside) is replaced, unseen
        return await self._spawn()

    async def _spawn(self) -> asyncio.subprocess.Process:
        # a module of its own: the worker imports neither torch nor the gateway
        return await asyncio.wait_for(
            asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "fastdecode.runtime.grammar",
                str(self.memory_bytes),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,  # a crash's own report; the log line below says it
            ),
            WORKER_START_TIMEOUT_S,
        )

    async def _lose(self, worker: asyncio.subprocess.Process, why: str | None, s: Structured) -> str:
        """End a worker that cannot take another request; what ended it, in words."""
        if worker.returncode is None:
            worker.kill()
        try:
            code = await asyncio.wait_for(worker.wait(), 10.0)
        except TimeoutError:
            code = None
        if why is None:
            return "cancelled"
        self.crashed += 1
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit {code}"
        if why == "died":
            why = f"died ({how})"
        log.warning(
            "a grammar worker %s compiling a %s of %d characters; the request gets a 400",
            why,
            s.kind,
            len(s.spec),
        )
        return how

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for w in idle:
            if w.stdin is not None:
                w.stdin.close()
            try:
                await asyncio.wait_for(w.wait(), 5.0)
            except TimeoutError:
                w.kill()
