"""The gateway's request handling, behind an interface to the scheduler. Imports no gRPC.

`GatewayCore.generate` is the one request path of both public APIs (services/gateway: the gRPC
servicer and the OpenAI-compatible HTTP app are thin adapters over it): admission (draining, the
concurrency limit), validation, tokenizing, the scheduler call, detokenizing with stop strings,
metrics, logs and drain accounting. A scheduler lost mid-request (UNAVAILABLE) costs time, not the
request: once one answers again, the rest is resubmitted as prompt + the tokens generated so far,
with the remaining max_tokens and the next sample index, so greedy and seeded sampling continue
exactly where they stopped. The scheduler is reached through `SchedulerLink` (the gRPC one
is services/gateway/scheduler_link.py; unit tests use an in-process fake).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from fastdecode.contract import TokenLogprob
from fastdecode.gateway.auth import cache_salt, current_tenant
from fastdecode.gateway.grammar import GrammarCompiler
from fastdecode.gateway.text import (
    GenerateParams,
    Limits,
    OutputText,
    ValidRequest,
    check_params,
    resolve,
    tokenize_request,
)
from fastdecode.model import ModelConfig
from fastdecode.runtime.errors import (
    DeadlineExceeded,
    DependencyDown,
    InvalidInput,
    ModelLoadError,
    ResourceExhausted,
    ServiceError,
    Status,
    Unavailable,
    as_service_error,
)
from fastdecode.runtime.logs import request_context
from fastdecode.runtime.settings import GatewaySettings
from fastdecode.runtime.tokenizer import Tokenizer

log = logging.getLogger("fastdecode.gateway")

# Waiting for a lost scheduler: first pause, doubled after each failed look, up to the cap.
RESUBMIT_FIRST_WAIT_S = 0.1
RESUBMIT_MAX_WAIT_S = 2.0


class SchedulerLost(Unavailable):
    """The connection to the scheduler failed (not a status the scheduler answered itself)."""


# ---- the scheduler, as the core sees it ------------------------------------------------------------
@dataclass(frozen=True)
class UpstreamEvent:
    """One event of the scheduler's token stream for a request."""

    token_ids: list[int]
    finish_reason: str = ""
    logprobs: list[float] = field(default_factory=list)  # per token id
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # per token id, when asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # the prompt's next positions
    cached_tokens: int = 0  # prompt tokens a shard held cached (shared prefix)

    def then(self, later: UpstreamEvent) -> UpstreamEvent:
        """This event and the request's next as one (a link's, for a consumer that fell behind: one
        message to write, not several). Per-token lists stay aligned with token_ids."""
        n = len(self.token_ids)
        top = [*self.top, *[()] * (n - len(self.top)), *later.top] if self.top or later.top else []
        return UpstreamEvent(
            self.token_ids + later.token_ids,
            later.finish_reason,
            [*self.logprobs, *[0.0] * (n - len(self.logprobs)), *later.logprobs],
            top,
            self.prompt_logprobs + later.prompt_logprobs,
            max(self.cached_tokens, later.cached_tokens),
        )


@dataclass(frozen=True)
class BackendInfo:
    """What the scheduler says about the fleet behind it."""

    model_type: str
    vocab_size: int
    num_shards: int
    device: str


class SchedulerLink(Protocol):
    """The gateway's view of the scheduler. Every failure is raised as a ServiceError."""

    async def wait_connected(self, timeout: float) -> None:
        """Return once connected; Unavailable when not within `timeout` seconds."""

    def submit(
        self, request_id: str, request: ValidRequest, timeout: float | None, sample_offset: int = 0
    ) -> AsyncIterator[UpstreamEvent]:
        """The request's token events. Closing the iterator early cancels the request upstream."""

    async def model_info(self, timeout: float, wait_for_ready: bool = False) -> BackendInfo: ...

    async def not_ready_reason(self, timeout: float) -> str | None:
        """Why the scheduler (and the fleet behind it) cannot generate now; None when it can."""
        ...

    async def close(self) -> None: ...


class GatewayMetrics:
    """What the core reports; the no-op base is for tests, services/gateway/metrics.py exports it."""

    def answered(self, status: Status, api: str) -> None: ...
    def in_flight(self, delta: int) -> None: ...
    def accepted(self, prompt_tokens: int) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...
    def generated(self, tokens: int) -> None: ...
    def finished(self, reason: str, seconds: float) -> None: ...


# ---- results ---------------------------------------------------------------------------------------
@dataclass
class GenerationChunk:
    """One piece of a generation as both APIs send it; the last one has finish_reason and usage."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0  # on every chunk (a stream's running usage)
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those served from a shared prefix cache
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # the prompt's, when asked
    # With prompt logprobs, on the first chunk: the prompt's first token (it has no logprob)
    prompt_first_token: int | None = None


@dataclass(frozen=True)
class ModelCard:
    model_type: str
    model_name: str
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]
    num_shards: int
    device: str


# ---- request ids --------------------------------------------------------------------------------
# A client's id is kept when it is 1-128 printable ASCII characters without spaces or commas (commas
# separate ids in x-request-id metadata: fastdecode.runtime.rpc.request_metadata); otherwise the
# gateway makes one.
_SANE_REQUEST_ID = re.compile(r"[!-+\--~]{1,128}")


def new_request_id() -> str:
    return f"gw-{uuid.uuid4().hex}"


def sane_request_id(candidate: str | None) -> str | None:
    return candidate if candidate and _SANE_REQUEST_ID.fullmatch(candidate) else None


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the request's deadline passed")
    return left


@dataclass
class _Call:
    """One generate call's bookkeeping: the status it is counted with, whether it was admitted (is
    counted in flight) and whether its last chunk went out."""

    api: str
    arrival: float = field(default_factory=time.perf_counter)
    status: Status = Status.OK
    entered: bool = False
    done: bool = False


class GatewayCore:
    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer: Tokenizer,
        config: ModelConfig,
        scheduler: SchedulerLink,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.config = config
        self.scheduler = scheduler
        self.metrics = metrics or GatewayMetrics()
        self.model_id = settings.served_model_name or settings.model.name  # the HTTP API's model id
        self.limits = Limits(
            vocab_size=config.vocab_size,
            max_context=config.max_position_embeddings,
            max_prompt_chars=settings.max_prompt_chars,
            max_stop=settings.max_stop,
            max_stop_chars=settings.max_stop_chars,
        )
        self.eos_ids = frozenset(config.eos_token_ids)
        self.grammars = GrammarCompiler(
            settings.grammar_workers,
            settings.grammar_timeout,
            settings.grammar_memory_mb,
            build_limit=settings.grammar_build_limit,
            tokenizer_json=settings.model / "tokenizer.json",
            vocab_size=config.vocab_size,
            eos_ids=config.eos_token_ids,
        )
        self.ready = False  # set once announced; the HTTP /health reads it
        self.draining = False
        self.backend_problem: str | None = None  # the scheduler's not-ready reason, last looked at
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.active_ids: set[str] = set()
        self._tasks: set[asyncio.Task[object]] = set()  # tasks running a generation, for cut_off()
        self._cut_off = False

    @contextlib.contextmanager
    def request_scope(self, candidate: str | None) -> Iterator[str]:
        """The request's id (the client's when sane, else a new one), bound for logging while inside.

        The id also names the sequence at the scheduler, which refuses duplicates: a client id already
        in flight here gets a suffix."""
        rid = sane_request_id(candidate) or new_request_id()
        if rid in self.active_ids:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        self.active_ids.add(rid)
        try:
            with request_context(rid):
                yield rid
        finally:
            self.active_ids.discard(rid)

    @staticmethod
    def public_id(candidate: str | None, rid: str) -> str:
        """The id the caller is shown: its own when sane, as sent, even where the gateway names the
        request otherwise (a suffix for an id already in flight would tell it someone else uses it)."""
        return sane_request_id(candidate) or rid

    def rejected(self, api: str, err: ServiceError) -> None:
        """Count and log a generation request refused before it entered `generate`."""
        self.metrics.answered(err.status, api)
        log.info("failed: %s: %s", err.status.name, err.message)

    async def _validate(self, params: GenerateParams) -> ValidRequest:
        check_params(params, self.limits)
        allowed = self.settings.chat_special_tokens
        tokenize = functools.partial(tokenize_request, params, self.tokenizer, allowed)
        # off the event loop (a worker thread) where there is text to tokenize: a prompt, bad words
        text = params.prompt or params.bad_words
        prompt_ids, bad = await asyncio.to_thread(tokenize) if text else tokenize()
        # never on this thread: llguidance can crash a process on a grammar (a worker's, here)
        grammar = await self.grammars.compile(params.structured) if params.structured is not None else ""
        salt = cache_salt(current_tenant(), params.cache_salt, self.settings.tenant_cache_isolation)
        return resolve(params, prompt_ids, self.limits, grammar, bad, salt)

    async def _connected(self, remaining: float | None) -> None:
        connect = self.settings.connect_timeout
        await self.scheduler.wait_connected(connect if remaining is None else min(remaining, connect))

    # -- the one request path of both APIs
    async def generate(
        self, params: GenerateParams, request_id: str, deadline: float | None, api: str
    ) -> AsyncIterator[GenerationChunk]:
        """`deadline`: time.monotonic() by which the request must end (None: no deadline). Yields
        chunks with new text or token ids; the last carries finish_reason and usage. Every failure
        raises a ServiceError (already counted and logged); a consumer that stops early counts as
        CANCELLED and must close the generator (contextlib.aclosing), which cancels the upstream call.
        """
        call = _Call(api)
        try:
            self._admit(call)
            valid, out = await self._accept(params, deadline, api)
            last: float | None = None
            async with contextlib.aclosing(self._resubmitting(request_id, valid, out, deadline)) as chunks:
                async for chunk in chunks:
                    last = self._time_tokens(chunk, call.arrival, last)
                    if chunk.finish_reason:
                        self._finished(call, chunk)
                        yield chunk
                        return
                    yield chunk
            raise RuntimeError("the scheduler ended the token stream without a finish reason")
        except (asyncio.CancelledError, GeneratorExit) as e:
            cut = self._stopped(call, e)
            if cut is not None:
                raise cut from None
            raise
        except Exception as e:  # noqa: BLE001 - every failure leaves as a ServiceError
            raise self._failed(call, e) from None
        finally:
            self._leave(call)

    # -- its pieces: admission, acceptance, the resubmit loop, the exits
    def _admit(self, call: _Call) -> None:
        """Refuse while draining or at the concurrency limit; otherwise count the call in flight."""
        if self.draining:
            raise Unavailable("gateway is draining")
        if self.inflight >= self.settings.max_concurrent_requests:
            raise ResourceExhausted(f"{self.inflight} requests in flight at the gateway")
        self.inflight += 1
        call.entered = True
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)  # for cut_off()
        self.idle.clear()
        self.metrics.in_flight(+1)

    async def _accept(
        self, params: GenerateParams, deadline: float | None, api: str
    ) -> tuple[ValidRequest, OutputText]:
        """Validate and tokenize; wait for the scheduler's connection; count the request accepted."""
        valid = await self._validate(params)
        hidden = set(valid.stop_token_ids) | (set() if valid.ignore_eos else set(self.eos_ids))
        out = OutputText(self.tokenizer, valid.stop, hidden, valid.prompt_ids)
        await self._connected(_remaining(deadline))
        n_prompt = len(valid.prompt_ids)
        log.info("accepted (%s): %d prompt tokens, max_tokens %d", api, n_prompt, valid.max_tokens)
        self.metrics.accepted(n_prompt)
        return valid, out

    async def _resubmitting(
        self, request_id: str, valid: ValidRequest, out: OutputText, deadline: float | None
    ) -> AsyncIterator[GenerationChunk]:
        """The request's chunks from the scheduler, up to the one with finish_reason. A lost scheduler
        costs time, not the request: once it answers again, the rest is resubmitted as prompt + the
        tokens received so far (the remaining max_tokens, the next sample index)."""
        received: list[int] = []  # every token the scheduler sent, held-back ones included
        scored: list[TokenLogprob] = []  # prompt logprobs sent so far (positions 1..)
        lost_at: float | None = None
        while True:
            rest = valid
            if received:  # a resubmission: continue from what was generated
                rest = replace(
                    valid,
                    prompt_ids=valid.prompt_ids + received,
                    max_tokens=valid.max_tokens - len(received),
                    prompt_logprobs=False,  # the prompt was scored in full before any token came
                )
            events = self.scheduler.submit(request_id, rest, _remaining(deadline), len(received))
            before = len(received)
            try:
                first = valid.prompt_ids[0] if valid.prompt_logprobs and not (received or scored) else None
                relay = self._relay(
                    events, out, received, len(valid.prompt_ids), valid.logprobs is not None, scored, first
                )
                async with contextlib.aclosing(relay) as chunks:
                    async for chunk in chunks:
                        yield chunk
                        if chunk.finish_reason:
                            return
            except DependencyDown:
                raise  # the scheduler's dependency stayed down: it would refuse a resubmission
            except Unavailable as e:
                # Resubmit when the scheduler was lost (the connection failed, or it failed a request
                # it had taken). A live scheduler refusing a new request (draining, not ready) answers
                # the client at once, unless we are already waiting for a lost one to come back.
                if not (isinstance(e, SchedulerLost) or len(received) > before or lost_at is not None):
                    raise
                if lost_at is None or len(received) > before:
                    lost_at = time.monotonic()
                await self._await_scheduler(e, lost_at, deadline, len(received))
                continue
            return  # the stream ended without a finish reason: generate() raises

    def _finished(self, call: _Call, last: GenerationChunk) -> None:
        elapsed = time.perf_counter() - call.arrival
        self.metrics.finished(last.finish_reason or "", elapsed)
        log.info(
            "finished: %s, %d completion tokens in %.3fs", last.finish_reason, last.completion_tokens, elapsed
        )
        call.done = True

    def _stopped(self, call: _Call, e: asyncio.CancelledError | GeneratorExit) -> Unavailable | None:
        """A call stopped from outside before its end: by the drain's cut-off (UNAVAILABLE, the client
        may retry) or by the client (CANCELLED; gone, or its deadline passed). Returns the error to
        end it with instead of `e`: the cut-off's, when its cancel landed here. A close (GeneratorExit:
        the adapter's own wait took the cancel) stays a close; the adapter answers the cut-off."""
        if call.done:
            return None
        elapsed = time.perf_counter() - call.arrival
        if not self._cut_off:
            call.status = Status.CANCELLED
            log.info("cancelled after %.3fs", elapsed)
            return None
        call.status = Status.UNAVAILABLE
        log.info("ended by the drain after %.3fs", elapsed)
        return self.cut_off_error() if isinstance(e, asyncio.CancelledError) else None

    def _failed(self, call: _Call, e: Exception) -> ServiceError:
        failed = as_service_error(e, log)
        call.status = failed.status
        log.info("failed: %s: %s", failed.status.name, failed.message)
        return failed

    def _leave(self, call: _Call) -> None:
        """Every call, admitted or not, is counted once as answered."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.discard(task)
        self.metrics.answered(call.status, call.api)
        if call.entered:
            self.inflight -= 1
            self.metrics.in_flight(-1)
            if self.inflight == 0:
                self.idle.set()

    async def _relay(
        self,
        events: AsyncIterator[UpstreamEvent],
        out: OutputText,
        received: list[int],
        n_prompt: int,
        logprobs: bool = False,
        scored: list[TokenLogprob] | None = None,
        first_prompt_token: int | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """The scheduler's token events as text chunks (stop strings applied); each event's ids are
        appended to `received`, its prompt logprobs to `scored` (a resubmission re-scores nothing).
        The last chunk carries finish_reason and usage."""
        scored = [] if scored is None else scored
        cached = 0
        async with contextlib.aclosing(events):  # closing cancels the scheduler call
            async for ev in events:
                cached = max(cached, min(ev.cached_tokens, n_prompt))
                received += ev.token_ids
                delta = out.push(ev.token_ids)
                finish = "stop" if delta.stopped else ev.finish_reason
                chunk = GenerationChunk(delta.text, list(delta.token_ids), prompt_tokens=n_prompt)
                if logprobs:  # taken ids are a prefix of the event's
                    chunk.logprobs = [
                        TokenLogprob(t, ev.logprobs[i], ev.top[i] if i < len(ev.top) else ())
                        for i, t in enumerate(delta.token_ids)
                    ]
                if ev.prompt_logprobs and len(scored) < n_prompt - 1:
                    chunk.prompt_logprobs = ev.prompt_logprobs[: n_prompt - 1 - len(scored)]
                    scored += chunk.prompt_logprobs
                chunk.prompt_first_token, first_prompt_token = first_prompt_token, None
                if finish:
                    if not delta.stopped:
                        tail = out.finish()
                        chunk.text += tail.text
                        finish = "stop" if tail.stopped else finish
                    chunk.finish_reason = finish
                    chunk.prompt_tokens = n_prompt
                    chunk.completion_tokens = out.num_tokens
                    chunk.cached_tokens = cached
                    yield chunk
                    return
                if chunk.text or chunk.token_ids or chunk.prompt_logprobs:
                    yield chunk

    def _time_tokens(self, chunk: GenerationChunk, arrival: float, last: float | None) -> float | None:
        """TTFT / inter-token metrics for a chunk's tokens; returns when the last token arrived."""
        if not chunk.token_ids:
            return last
        now = time.perf_counter()
        if last is None:
            self.metrics.first_token(now - arrival)
        else:
            self.metrics.inter_token(now - last)
        self.metrics.generated(len(chunk.token_ids))
        return now

    async def _await_scheduler(
        self, error: Unavailable, lost_at: float, deadline: float | None, generated: int
    ) -> None:
        """Wait, with backoff, until the scheduler is reachable again; re-raise `error` once the
        recovery timeout (counted from `lost_at`) or the request's deadline is spent."""
        give_up = lost_at + self.settings.scheduler_recovery_timeout
        if deadline is not None:
            give_up = min(give_up, deadline)
        log.warning(
            "scheduler lost after %d tokens (%s); resubmitting once it is back", generated, error.message
        )
        wait = RESUBMIT_FIRST_WAIT_S
        while True:
            left = give_up - time.monotonic()
            if left <= 0:
                raise error
            await asyncio.sleep(min(wait, left))
            wait = min(RESUBMIT_MAX_WAIT_S, wait * 2)
            try:
                left = give_up - time.monotonic()
                await self.scheduler.wait_connected(max(0.01, min(self.settings.connect_timeout, left)))
                return
            except Unavailable:
                continue

    async def tokenize(self, text: str) -> tuple[list[int], list[str]]:
        if len(text) > self.limits.max_prompt_chars:
            raise InvalidInput(
                f"text has {len(text)} characters; the limit is {self.limits.max_prompt_chars}"
            )
        ids = await asyncio.to_thread(self.tokenizer.encode, text)
        return ids, [self.tokenizer.id_to_token(i) or "" for i in ids]

    async def model_card(self, timeout: float | None) -> ModelCard:
        info = await self.scheduler.model_info(timeout or self.settings.connect_timeout)
        return ModelCard(
            model_type=info.model_type or self.config.model_type,
            model_name=self.model_id,
            vocab_size=self.config.vocab_size,
            max_context=self.limits.max_context,
            eos_token_ids=list(self.config.eos_token_ids),
            num_shards=info.num_shards,
            device=info.device,
        )

    # -- lifecycle
    def not_ready_reason(self) -> str | None:
        """Why generations cannot be served now (None: they can): readiness, for health and /health."""
        if not self.ready:
            return "gateway is starting"
        if self.draining:
            return "gateway is draining"
        return self.backend_problem

    async def check_readiness(self) -> str | None:
        """Ask the scheduler whether the fleet can generate (no scheduler, no gpu_dense, no healthy
        shard: it cannot), and return the gateway's readiness reason."""
        if self.ready and not self.draining:
            self.backend_problem = await self.scheduler.not_ready_reason(self.settings.connect_timeout)
        return self.not_ready_reason()

    async def check_scheduler(self) -> None:
        """The scheduler must serve the same model geometry the gateway tokenizes for."""
        try:
            info = await self.scheduler.model_info(self.settings.connect_timeout, wait_for_ready=True)
        except ServiceError as e:
            log.warning(
                "scheduler %s not answering yet (%s); serving anyway", self.settings.scheduler, e.status.name
            )
            return
        if info.vocab_size != self.config.vocab_size:
            raise ModelLoadError(
                f"the scheduler's model has vocab_size {info.vocab_size}, "
                f"the gateway's {self.config.vocab_size}"
            )

    async def drain(self) -> None:
        """New generation requests get UNAVAILABLE; wait for the ones in flight."""
        self.draining = True
        await self.idle.wait()

    def cut_off(self) -> None:
        """The drain's grace period is over: every generation still running ends with UNAVAILABLE.
        The cancel lands wherever the task waits: in `generate` (which raises Unavailable) or in the
        adapter's write to its client, which answers `cut_off_error()` the same way."""
        self._cut_off = True
        for task in list(self._tasks):
            task.cancel()

    def cut_off_error(self) -> Unavailable | None:
        """What a generation the cut-off cancelled ends with (None: no cut-off yet)."""
        return Unavailable("gateway is draining: retry the request") if self._cut_off else None

    async def close(self) -> None:
        await self.grammars.close()
        await self.scheduler.close()


__all__ = [
    "BackendInfo",
    "GatewayCore",
    "GatewayMetrics",
    "GenerationChunk",
    "ModelCard",
    "SchedulerLink",
    "SchedulerLost",
    "UpstreamEvent",
    "new_request_id",
    "sane_request_id",
]
