"""The gateway's structured-output compiler: llguidance runs in worker processes, never on the event
loop, so a grammar that crashes it, outgrows its memory limit or runs past the time limit costs that
one request a 400 (InvalidInput) and the worker is replaced; every other stream goes on.

A worker compiles the grammar and builds its matcher with the model's tokenizer (what gpu_dense
will build again) within `build_limit` seconds, so a spec whose matcher is slow to build (a large
`multipleOf`, hundreds of patterns) is a 400 here, never a stall of every stream at gpu_dense.

The limits (fastdecode/runtime/grammar.py `check_spec`) are checked here first, in process and
without llguidance, so the common refusals answer at once. Answers are remembered (a bounded LRU
of accepted grammars and refusals by spec), so a client looping on one heavy spec costs a worker
once; and a tenant holds at most half the workers, so another tenant's grammars still find one.
Imports no gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from fastdecode.gateway.auth import current_tenant
from fastdecode.runtime.errors import InvalidInput
from fastdecode.runtime.grammar import MAX_SPEC_CHARS, Structured, check_spec, load_llguidance

log = logging.getLogger("fastdecode.gateway.grammar")
WORKER_START_TIMEOUT_S = 60.0  # a worker that cannot start on a loaded host is a failed compile too
# A worker's answer line: a compiled grammar quotes its spec once more, JSON-escaped (asyncio's
# default 64 KiB limit turned specs from ~57 KB into 500s)
MAX_ANSWER_BYTES = 8 * MAX_SPEC_CHARS + (64 << 10)
CACHE_CHARS = 32 << 20  # accepted grammars and refusals remembered, in characters of grammar text


class GrammarCompiler:
    """compile(structured) -> llguidance grammar text, on up to `workers` worker processes."""

    def __init__(
        self,
        workers: int = 2,
        timeout: float = 10.0,
        memory_mb: int = 2048,
        *,
        build_limit: float = 0.0,
        tokenizer_json: Path | None = None,
        vocab_size: int = 0,
        eos_ids: Sequence[int] = (),
    ) -> None:
        self.timeout = timeout
        self.build_limit = build_limit  # 0: no limit on the matcher's build (nor a tokenizer needed)
        self.memory_bytes = memory_mb << 20
        self.workers = workers
        self.tokenizer = (str(tokenizer_json), vocab_size, list(eos_ids)) if tokenizer_json else None
        self._idle: list[asyncio.subprocess.Process] = []
        self._slots: asyncio.Semaphore | None = None
        self._tenants: dict[str, asyncio.Semaphore] = {}
        self._answers: OrderedDict[bytes, tuple[bool, str]] = OrderedDict()  # (accepted, grammar or why)
        self._answer_chars = 0
        self.crashed = 0  # workers lost to a grammar (crash, memory or time limit)

    async def compile(self, s: Structured) -> str:
        check_spec(s)
        load_llguidance()  # FailedPrecondition here, not a worker that dies at start
        key = hashlib.blake2b(f"{s.kind}\0{s.spec}".encode(), digest_size=16).digest()
        if (known := self._answers.get(key)) is not None:
            self._answers.move_to_end(key)
            if not known[0]:
                raise InvalidInput(known[1])
            return known[1]
        tenant = current_tenant()  # "" with auth off: one tenant, no share to keep
        if tenant and tenant not in self._tenants:
            self._tenants[tenant] = asyncio.Semaphore(max(1, self.workers // 2))
        try:
            grammar = await self._compile_as(s, self._tenants.get(tenant))
        except InvalidInput as e:
            self._remember(key, False, e.message)
            raise
        self._remember(key, True, grammar)
        return grammar

    def _remember(self, key: bytes, accepted: bool, text: str) -> None:
        if key in self._answers:
            return
        self._answers[key] = (accepted, text)
        self._answer_chars += len(text)
        while self._answer_chars > CACHE_CHARS:
            _, (_, old) = self._answers.popitem(last=False)
            self._answer_chars -= len(old)

    async def _compile_as(self, s: Structured, tenant_slots: asyncio.Semaphore | None) -> str:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with tenant_slots or contextlib.nullcontext(), self._slots:
            worker = await self._worker()
            started = time.perf_counter()
            try:
                assert worker.stdin is not None and worker.stdout is not None
                try:
                    ask = {"kind": s.kind, "spec": s.spec, "build_limit_s": self.build_limit}
                    worker.stdin.write((json.dumps(ask) + "\n").encode())
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
            except ValueError:  # past MAX_ANSWER_BYTES (LimitOverrunError): what is left is unread
                await self._lose(worker, "answered more than the limit", s)
                raise InvalidInput(f"the {s.kind} compiles to more than the limit; simplify it") from None
            except BaseException:  # cancelled mid-compile: its answer would be read by the next request
                await self._lose(worker, None, s)
                raise
            if not line:
                code = await self._lose(worker, "died", s)
                raise InvalidInput(
                    f"the {s.kind} could not be compiled: the compiler failed on it ({code}); "
                    "simplify it (fewer rules, less nesting)"
                )
            answer = json.loads(line)
            if answer.get("retire"):  # its build runs on: the process goes, and the answer stands
                await self._lose(worker, "ran past the build limit", s)
            else:
                self._idle.append(worker)
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
                *(
                    (self.tokenizer[0], str(self.tokenizer[1]), json.dumps(self.tokenizer[2]))
                    if self.tokenizer
                    else ()
                ),
                stdin=asyncio.subprocess.PIPE,
                limit=MAX_ANSWER_BYTES,
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
