"""Client SDK for the FastDecode gateway (fastdecode.v1.Gateway).

    from fastdecode.client import Client

    with Client("127.0.0.1:50051", token="...") as client:
        print(client.generate("Hello", max_tokens=32).text)
        for chunk in client.stream("Hello", stop=["\\n"]):
            print(chunk.text, end="", flush=True)

`AsyncClient` has the same methods for asyncio (`await`, `async for`) and behaves the same.

Deadlines: every call has one. A call's `timeout` wins, else the client's `timeout`, else
DEFAULT_GENERATE_TIMEOUT (generate/stream) or DEFAULT_UNARY_TIMEOUT (tokenize, model_info,
health). Retries and the waits between them spend the same deadline.

Errors: every gRPC failure surfaces as a subclass of `FastDecodeError` (one per status family,
see STATUS_FAMILIES) with `.code` (a grpc.StatusCode), `.details` and `.from_gateway`.

Retries: calls wait for a (re)starting gateway (wait_for_ready, reconnecting with backoff). On top
of that, a call that fails with UNAVAILABLE is re-issued after an exponential backoff with jitter,
at most `max_retries` times and only while the deadline leaves room for the wait:
- tokenize, model_info, health read state and change nothing: any UNAVAILABLE is retried, by the
  channel's gRPC retryPolicy (service config; gRPC allows at most 4 retries, so a larger
  max_retries falls back to the same retry done by hand).
- generate/stream is retried on UNAVAILABLE only before its first chunk reached the caller. That
  covers a transport failure (no gateway trailer: the connection could not be made or was lost; the
  gateway either never saw the call or, seeing it disappear, cancelled it and freed its KV) and an
  UNAVAILABLE the gateway answered itself (trailer `fastdecode-error-source: gateway`): it refuses
  before doing any work while it drains or cannot reach the scheduler, relays the scheduler's own
  refusal (draining, not ready), and for a backend lost mid-prefill it cancels the scheduler call
  before answering. In every case nothing was delivered and nothing is left running, so the repeat
  cannot duplicate output. After the first chunk nothing is retried: the caller has seen part of
  one generation and a second one would not continue it. This retry is hand code: the gateway
  sends response headers before it can refuse, which ends gRPC's own retries (gRFC A6).
- Nothing else is retried: RESOURCE_EXHAUSTED is back-pressure (retrying in a loop adds load),
  DEADLINE_EXCEEDED has no time left, the other codes would fail the same way again.
The token is sent as call metadata and never logged or shown in a repr.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastdecode.protocol import CHANNEL_OPTIONS, ERROR_SOURCE_KEY
from fastdecode.v1 import gateway_pb2 as pb
from fastdecode.v1 import gateway_pb2_grpc as pb_grpc

__all__ = [
    "DEFAULT_GENERATE_TIMEOUT",
    "DEFAULT_UNARY_TIMEOUT",
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "CancelledError",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceededError",
    "FastDecodeError",
    "InternalServerError",
    "InvalidRequestError",
    "ModelInfo",
    "NotFoundError",
    "ResourceExhaustedError",
    "Stream",
    "TokenLogprob",
    "Tokens",
    "UnavailableError",
    "Usage",
]

T = TypeVar("T")

# Deadlines when neither the call nor the client names one: no call can wait forever.
DEFAULT_GENERATE_TIMEOUT = 600.0
DEFAULT_UNARY_TIMEOUT = 30.0
# gRPC's retryPolicy allows at most 5 attempts: 4 retries.
MAX_POLICY_RETRIES = 4

# The gateway marks the error statuses it answers itself (fastdecode.protocol.ERROR_TRAILER) with
# ERROR_SOURCE_KEY. This module imports only grpc, protobuf and generated stubs (no server modules).


# ---- errors ----------------------------------------------------------------------------------------
class FastDecodeError(Exception):
    """A call failed: `.code` is the grpc.StatusCode, `.details` the server's message and
    `.from_gateway` whether the gateway answered the status itself (False: the transport, a proxy or
    this client produced it). Raised as the subclass of the code's family (STATUS_FAMILIES)."""

    def __init__(self, code: grpc.StatusCode, details: str, from_gateway: bool = False) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.from_gateway = from_gateway

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across processes despite the custom __init__
        return (type(self), (self.code, self.details, self.from_gateway))

    @classmethod
    def from_rpc_error(cls, e: grpc.RpcError) -> FastDecodeError:
        """The error of `e`'s status family (whichever class this is called on)."""
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = e.details() if hasattr(e, "details") else str(e)
        try:
            trailers = e.trailing_metadata() or ()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - this error kind carries no trailers
            trailers = ()
        from_gateway = any(key == ERROR_SOURCE_KEY for key, _ in trailers)
        return error_for(code or grpc.StatusCode.UNKNOWN, details or "", from_gateway)


class InvalidRequestError(FastDecodeError):
    """The request is wrong (bad argument, out of range, precondition): fix it, do not retry."""


class AuthenticationError(FastDecodeError):
    """Missing, invalid or insufficient bearer token."""


class NotFoundError(FastDecodeError):
    """The named thing (e.g. a health-check service) does not exist."""


class ResourceExhaustedError(FastDecodeError):
    """The fleet is full (queue or KV-cache) or the message too large: back off, then try again."""


class UnavailableError(FastDecodeError):
    """The gateway or a service behind it cannot serve now (down, restarting, draining)."""


class DeadlineExceededError(FastDecodeError):
    """The call's deadline passed before it finished."""


class CancelledError(FastDecodeError):
    """The call was cancelled (by the server side; a client's own cancel() ends quietly)."""


class InternalServerError(FastDecodeError):
    """A server-side failure or protocol mismatch; details are in the server's log."""


STATUS_FAMILIES: dict[type[FastDecodeError], tuple[grpc.StatusCode, ...]] = {
    InvalidRequestError: (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
    ),
    AuthenticationError: (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED),
    NotFoundError: (grpc.StatusCode.NOT_FOUND,),
    ResourceExhaustedError: (grpc.StatusCode.RESOURCE_EXHAUSTED,),
    UnavailableError: (grpc.StatusCode.UNAVAILABLE,),
    DeadlineExceededError: (grpc.StatusCode.DEADLINE_EXCEEDED,),
    CancelledError: (grpc.StatusCode.CANCELLED,),
    InternalServerError: (
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.ABORTED,
    ),
}
_ERROR_CLASS = {code: cls for cls, codes in STATUS_FAMILIES.items() for code in codes}


def error_for(code: grpc.StatusCode, details: str, from_gateway: bool = False) -> FastDecodeError:
    """The FastDecodeError subclass for `code` (a code outside every family is an internal error)."""
    return _ERROR_CLASS.get(code, InternalServerError)(code, details, from_gateway)


# ---- results ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the fleet's shared prefix cache


@dataclass(frozen=True)
class TokenLogprob:
    """One position's token, its logprob under the model (temperature-free) and the `top`
    alternatives as (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Chunk:
    """One streamed piece: the text delta and the new token ids; the last one has finish_reason."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt positions 1.., when asked


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]  # the generated ids only
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    tokens: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ModelInfo:
    model_type: str
    model_name: str
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]
    num_shards: int
    device: str


# ---- shared helpers ------------------------------------------------------------------------------
def _generate_args(
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    max_tokens: int | None = 16,
    temperature: float | None = 0.0,
    top_p: float | None = 1.0,
    top_k: int | None = 0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    timeout: float | None = None,
    *,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: bool = False,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    min_tokens: int = 0,
    structured: dict[str, Any] | None = None,
    logit_bias: Mapping[int, float] | None = None,
    min_p: float | None = None,
    allowed_token_ids: Sequence[int] | None = None,
    bad_words: Sequence[str] | None = None,
    cache_salt: str | None = None,
    lora: str | None = None,
) -> tuple[pb.GenerateRequest, float | None]:
    """The generate parameters, written once: `stream` and `generate` of both clients take these.
    Returns the request, with only what is given set, and the timeout. `logprobs`: each token's
    logprob and this many alternatives (0..20); `prompt_logprobs` scores the prompt too; the
    penalties are OpenAI's (presence, frequency) and vLLM's (repetition); min_tokens holds back EOS;
    `structured` constrains the output ({"json_schema": {...}}, {"json_object": True},
    {"regex": ...}, {"choice": [...]} or {"grammar": Lark text}). `logit_bias` adds a bias in
    [-100, 100] to token ids' logits; vLLM's `min_p` drops tokens below min_p x the top one's
    probability; `allowed_token_ids` limits sampling to those ids; `bad_words` are never generated;
    `cache_salt`: only requests with the same salt (and API key's tenant) share prefix-cache blocks;
    `lora`: a LoRA adapter the fleet holds, by name (docs/lora.md)."""
    if prompt is not None and token_ids is not None:
        raise ValueError("give prompt or token_ids, not both")
    req = pb.GenerateRequest(
        stop=[stop] if isinstance(stop, str) else list(stop or ()),
        stop_token_ids=list(stop_token_ids or ()),
        ignore_eos=ignore_eos,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        min_tokens=min_tokens,
        logit_bias=dict(logit_bias or {}),
        allowed_token_ids=list(allowed_token_ids or ()),
        bad_words=list(bad_words or ()),
    )
    if min_p is not None:
        req.min_p = min_p
    if logprobs is not None:
        req.logprobs = logprobs
    if repetition_penalty is not None:
        req.repetition_penalty = repetition_penalty
    if structured is not None:
        req.structured.CopyFrom(_structured(structured))
    if cache_salt is not None:
        req.cache_salt = cache_salt
    if lora is not None:
        req.lora = lora
    if prompt is not None:
        req.prompt = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if temperature is not None:
        req.temperature = temperature
    if top_p is not None:
        req.top_p = top_p
    if top_k is not None:
        req.top_k = top_k
    if seed is not None:
        req.seed = seed
    return req, timeout


_P = ParamSpec("_P")
_S = TypeVar("_S")
_R = TypeVar("_R")


def _taking(
    args: Callable[_P, tuple[pb.GenerateRequest, float | None]],
) -> Callable[[Callable[[_S, pb.GenerateRequest, float | None], _R]], Callable[Concatenate[_S, _P], _R]]:
    """A decorator: `method(self, request, timeout)` becomes callable as `method(self, <args'
    parameters>)`, and its signature (help(), IDEs, type checkers) is theirs."""
    params = list(inspect.signature(args).parameters.values())

    def wrap(
        method: Callable[[_S, pb.GenerateRequest, float | None], _R],
    ) -> Callable[Concatenate[_S, _P], _R]:
        call: Callable[..., Any]
        if inspect.iscoroutinefunction(method):

            async def call_async(self: _S, *a: Any, **kw: Any) -> Any:
                return await method(self, *args(*a, **kw))

            call = call_async
        else:

            def call_sync(self: _S, *a: Any, **kw: Any) -> Any:
                return method(self, *args(*a, **kw))

            call = call_sync
        functools.update_wrapper(call, method)
        attrs = vars(call)
        del attrs["__wrapped__"]
        this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ret = inspect.signature(method).return_annotation
        attrs["__signature__"] = inspect.Signature([this, *params], return_annotation=ret)
        return call

    return wrap


_takes_generate_args = _taking(_generate_args)


def _structured(spec: dict[str, Any]) -> pb.StructuredOutput:
    """{"json_schema": dict or JSON text} | {"json_object": True} | {"regex": str} | {"choice": [str]}
    | {"grammar": Lark text}: exactly one key."""
    if len(spec) != 1:
        raise ValueError("structured takes exactly one of json_schema, json_object, regex, choice, grammar")
    ((kind, value),) = spec.items()
    if kind == "json_schema":
        return pb.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    if kind == "json_object":
        return pb.StructuredOutput(json_object=bool(value))
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(value)))
    if kind in ("regex", "grammar"):
        return pb.StructuredOutput(**{kind: value})
    raise ValueError(f"unknown structured output {kind!r}")


def _logprobs(entries: Iterable[pb.TokenLogprob]) -> list[TokenLogprob]:
    return [
        TokenLogprob(e.token_id, e.logprob, list(zip(e.top_token_ids, e.top_logprobs, strict=True)))
        for e in entries
    ]


def _chunk(r: pb.GenerateResponse) -> Chunk:
    lps, prompt_lps = _logprobs(r.logprobs), _logprobs(r.prompt_logprobs)
    if r.finish_reason:
        usage = Usage(r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens)
        return Chunk(r.text, list(r.token_ids), r.finish_reason, usage, lps, prompt_lps)
    return Chunk(r.text, list(r.token_ids), logprobs=lps, prompt_logprobs=prompt_lps)


def _collect(chunks: list[Chunk]) -> Completion:
    if not chunks or chunks[-1].finish_reason is None:
        raise InternalServerError(grpc.StatusCode.INTERNAL, "the stream ended without a finish reason")
    last = chunks[-1]
    return Completion(
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=last.finish_reason or "",
        usage=last.usage or Usage(0, 0),
        logprobs=[e for c in chunks for e in c.logprobs],
        prompt_logprobs=[e for c in chunks for e in c.prompt_logprobs],
    )


def _model_info(r: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_type=r.model_type,
        model_name=r.model_name,
        vocab_size=r.vocab_size,
        max_context=r.max_context,
        eos_token_ids=list(r.eos_token_ids),
        num_shards=r.num_shards,
        device=r.device,
    )


def _read_ca(tls_ca: str | Path | bytes | None) -> bytes | None:
    if tls_ca is None or isinstance(tls_ca, bytes):
        return tls_ca
    return Path(tls_ca).read_bytes()


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not 0 <= timeout < math.inf:
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")


class _Policy:
    """Deadlines, metadata, channel options and retry decisions shared by both clients."""

    def __init__(
        self,
        target: str,
        token: str | None,
        tls_ca: str | Path | bytes | None,
        tls: bool | None,
        timeout: float | None,
        max_retries: int,
        backoff: float,
        max_backoff: float,
    ) -> None:
        if max_retries < 0 or backoff <= 0 or max_backoff < backoff:
            raise ValueError("need max_retries >= 0 and 0 < backoff <= max_backoff")
        _check_timeout(timeout)
        self.target = target
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.ca = _read_ca(tls_ca)
        self.tls = bool(tls) or self.ca is not None
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff

    def credentials(self) -> grpc.ChannelCredentials | None:
        return grpc.ssl_channel_credentials(root_certificates=self.ca) if self.tls else None

    def channel_options(self) -> list[tuple[str, int | str]]:
        """fastdecode.protocol's limits, with reconnect backoff from `backoff` / `max_backoff`, and
        the service config whose retryPolicy retries the read-only unary calls."""
        reconnect = {
            "grpc.initial_reconnect_backoff_ms": max(1, int(self.backoff * 1000)),
            "grpc.min_reconnect_backoff_ms": max(1, int(self.backoff * 1000)),
            "grpc.max_reconnect_backoff_ms": max(1, int(self.max_backoff * 1000)),
        }
        options: list[tuple[str, int | str]] = [o for o in CHANNEL_OPTIONS if o[0] not in reconnect]
        options += list(reconnect.items())
        if self.policy_retries:
            options += [("grpc.enable_retries", 1), ("grpc.service_config", self.service_config())]
        return options

    @property
    def policy_retries(self) -> bool:
        """Whether the channel's retryPolicy does the unary retries: gRPC caps maxAttempts at 5, so
        more than 4 retries stay with the hand loop in Client._unary / AsyncClient._unary."""
        return 0 < self.max_retries <= MAX_POLICY_RETRIES

    def service_config(self) -> str:
        """gRPC's retryPolicy for tokenize, model_info and health: UNAVAILABLE is retried with
        exponential backoff and jitter, up to max_retries times, within the call's deadline.

        Generate is left out on purpose: the gateway sends its initial metadata (x-request-id) before
        it can refuse a request, and gRPC's retries end once response headers arrive (gRFC A6), so
        the policy would not retry a gateway-answered UNAVAILABLE before the first chunk. Stream and
        AsyncStream keep that retry by hand."""
        names = [
            {"service": pb.DESCRIPTOR.services_by_name["Gateway"].full_name, "method": "Tokenize"},
            {"service": pb.DESCRIPTOR.services_by_name["Gateway"].full_name, "method": "GetModelInfo"},
            {"service": "grpc.health.v1.Health", "method": "Check"},
        ]
        policy = {
            "maxAttempts": self.max_retries + 1,
            "initialBackoff": f"{self.backoff:.6f}s",
            "maxBackoff": f"{self.max_backoff:.6f}s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
        return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})

    def deadline(self, timeout: float | None, default: float) -> float:
        """Monotonic deadline: the call's timeout, else the client's, else `default`."""
        _check_timeout(timeout)
        if timeout is None:
            timeout = default if self.timeout is None else self.timeout
        return time.monotonic() + timeout

    @staticmethod
    def remaining(deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    def backoff_delay(self, attempt: int) -> float:
        """Wait before retry number attempt+1: backoff * 2**attempt capped at max_backoff, scaled by
        a random factor in [0.5, 1] so clients refused together do not come back together."""
        return min(self.max_backoff, self.backoff * 2**attempt) * (0.5 + random.random() / 2)

    def retry_delay(self, error: FastDecodeError, attempt: int, deadline: float) -> float | None:
        """Seconds to wait before re-issuing a call that failed with `error` after `attempt` retries,
        or None to give up: only UNAVAILABLE is retried (the module docstring says why), at most
        max_retries times, and only when the deadline outlasts the wait."""
        if error.code != grpc.StatusCode.UNAVAILABLE or attempt >= self.max_retries:
            return None
        delay = self.backoff_delay(attempt)
        return delay if self.remaining(deadline) > delay else None


# ---- synchronous client --------------------------------------------------------------------------
class Stream:
    """The chunks of one Generate call; iterate it. `cancel()` (or `close()`) stops the request
    at the gateway, which frees its KV-cache; iteration then ends quietly. Safe from another thread."""

    def __init__(self, client: Client, request: pb.GenerateRequest, deadline: float) -> None:
        self._client = client
        self._request = request
        self._deadline = deadline
        self._call: Any = None
        self._attempt = 0
        self._started = False
        self._done = False
        self._cancelled = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        p = self._client._p
        while True:
            if self._done or self._cancelled:
                raise StopIteration
            if self._call is None:
                self._call = self._client._stub.Generate(
                    self._request,
                    timeout=p.remaining(self._deadline),
                    metadata=p.metadata,
                    wait_for_ready=True,
                )
                if self._cancelled:  # cancel() raced with the call's creation
                    self._call.cancel()
            try:
                resp = next(self._call)
            except StopIteration:
                self._done = True
                raise
            except grpc.RpcError as e:
                self._call = None
                if self._cancelled:
                    raise StopIteration from None
                error = FastDecodeError.from_rpc_error(e)
                # Never after the first chunk: the caller has seen part of this generation.
                delay = None if self._started else p.retry_delay(error, self._attempt, self._deadline)
                if delay is None:
                    self._done = True
                    raise error from None
                time.sleep(delay)
                self._attempt += 1
                continue
            self._started = True
            return _chunk(resp)

    def cancel(self) -> None:
        self._cancelled = True
        call = self._call
        if call is not None:
            call.cancel()

    close = cancel

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Client:
    """Blocking client. `token` is sent as `authorization: Bearer <token>`; `tls_ca` (a PEM path or
    bytes) or `tls=True` (system roots) turns TLS on; `timeout` is the default per-call deadline in
    seconds (None: DEFAULT_GENERATE_TIMEOUT for generate/stream, DEFAULT_UNARY_TIMEOUT otherwise).
    Calls wait for the gateway to be reachable (reconnecting with backoff .. max_backoff seconds)
    and retry UNAVAILABLE up to max_retries times as the module docstring describes."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        *,
        tls_ca: str | Path | bytes | None = None,
        tls: bool | None = None,
        timeout: float | None = None,
        max_retries: int = 3,
        backoff: float = 0.2,
        max_backoff: float = 2.0,
    ) -> None:
        self._p = _Policy(target, token, tls_ca, tls, timeout, max_retries, backoff, max_backoff)
        creds = self._p.credentials()
        options = self._p.channel_options()
        if creds is not None:
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.GatewayStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __repr__(self) -> str:
        return f"Client({self._p.target!r}, tls={self._p.tls})"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _unary(self, method: Callable[..., T], request: Any, timeout: float | None) -> T:
        """One read-only call, retried on UNAVAILABLE within the deadline: by the channel's
        retryPolicy (_Policy.service_config), or here when more retries are asked than it allows."""
        deadline = self._p.deadline(timeout, DEFAULT_UNARY_TIMEOUT)
        attempt = 0
        while True:
            try:
                return method(
                    request,
                    timeout=self._p.remaining(deadline),
                    metadata=self._p.metadata,
                    wait_for_ready=True,
                )
            except grpc.RpcError as e:
                error = FastDecodeError.from_rpc_error(e)
                delay = None if self._p.policy_retries else self._p.retry_delay(error, attempt, deadline)
                if delay is None:
                    raise error from None
            time.sleep(delay)
            attempt += 1

    @_takes_generate_args
    def stream(self, request: pb.GenerateRequest, timeout: float | None) -> Stream:
        """Chunks as tokens arrive (text delta, new token ids; the last has finish_reason and usage).
        The deadline starts now and covers the whole stream."""
        return Stream(self, request, self._p.deadline(timeout, DEFAULT_GENERATE_TIMEOUT))

    @_takes_generate_args
    def generate(self, request: pb.GenerateRequest, timeout: float | None) -> Completion:
        """The whole completion: text, generated token ids, finish_reason, usage."""
        with Stream(self, request, self._p.deadline(timeout, DEFAULT_GENERATE_TIMEOUT)) as stream:
            return _collect(list(stream))

    def tokenize(self, text: str, timeout: float | None = None) -> Tokens:
        r = self._unary(self._stub.Tokenize, pb.TokenizeRequest(text=text), timeout)
        return Tokens(list(r.token_ids), list(r.tokens))

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return _model_info(self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    def health(self, service: str = "", timeout: float | None = None) -> bool:
        """gRPC health check (grpc.health.v1.Health/Check) of the gateway: True when it reports
        SERVING, False when it answers NOT_SERVING (starting or draining). `service` "" asks about
        the whole server. No token needed. An unknown service raises NotFoundError."""
        request = health_pb2.HealthCheckRequest(service=service)
        r = self._unary(self._health.Check, request, timeout)
        return r.status == health_pb2.HealthCheckResponse.SERVING


# ---- asyncio client ------------------------------------------------------------------------------
class AsyncStream:
    """The chunks of one Generate call for `async for`; `cancel()` stops the request."""

    def __init__(self, client: AsyncClient, request: pb.GenerateRequest, deadline: float) -> None:
        self._client = client
        self._request = request
        self._deadline = deadline
        self._call: Any = None
        self._attempt = 0
        self._started = False
        self._done = False
        self._cancelled = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        p = self._client._p
        while True:
            if self._done or self._cancelled:
                raise StopAsyncIteration
            if self._call is None:
                self._call = self._client._stub.Generate(
                    self._request,
                    timeout=p.remaining(self._deadline),
                    metadata=p.metadata,
                    wait_for_ready=True,
                )
            try:
                resp = await self._call.read()
            except asyncio.CancelledError:
                if self._cancelled:  # our own cancel() while a read was pending
                    raise StopAsyncIteration from None
                self.cancel()
                raise
            except grpc.RpcError as e:
                self._call = None
                if self._cancelled:
                    raise StopAsyncIteration from None
                error = FastDecodeError.from_rpc_error(e)
                # Never after the first chunk: the caller has seen part of this generation.
                delay = None if self._started else p.retry_delay(error, self._attempt, self._deadline)
                if delay is None:
                    self._done = True
                    raise error from None
                await asyncio.sleep(delay)
                self._attempt += 1
                continue
            if resp is grpc.aio.EOF:
                self._done = True
                raise StopAsyncIteration
            self._started = True
            return _chunk(resp)

    def cancel(self) -> None:
        self._cancelled = True
        call = self._call
        if call is not None:
            call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class AsyncClient:
    """The asyncio twin of Client (grpc.aio): `await c.generate(...)`, `async for x in c.stream(...)`.
    Same arguments, defaults, deadlines, retries and errors as Client. Create it inside the event
    loop that uses it (grpc.aio channels belong to one loop)."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        *,
        tls_ca: str | Path | bytes | None = None,
        tls: bool | None = None,
        timeout: float | None = None,
        max_retries: int = 3,
        backoff: float = 0.2,
        max_backoff: float = 2.0,
    ) -> None:
        self._p = _Policy(target, token, tls_ca, tls, timeout, max_retries, backoff, max_backoff)
        creds = self._p.credentials()
        options = self._p.channel_options()
        if creds is not None:
            self._channel = grpc.aio.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._stub = pb_grpc.GatewayStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __repr__(self) -> str:
        return f"AsyncClient({self._p.target!r}, tls={self._p.tls})"

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _unary(self, method: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        """One read-only call, retried on UNAVAILABLE within the deadline (as Client._unary)."""
        deadline = self._p.deadline(timeout, DEFAULT_UNARY_TIMEOUT)
        attempt = 0
        while True:
            try:
                return await method(
                    request,
                    timeout=self._p.remaining(deadline),
                    metadata=self._p.metadata,
                    wait_for_ready=True,
                )
            except grpc.RpcError as e:
                error = FastDecodeError.from_rpc_error(e)
                delay = None if self._p.policy_retries else self._p.retry_delay(error, attempt, deadline)
                if delay is None:
                    raise error from None
            await asyncio.sleep(delay)
            attempt += 1

    @_takes_generate_args
    def stream(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncStream:
        """Chunks as tokens arrive, for `async for`. The deadline starts now."""
        return AsyncStream(self, request, self._p.deadline(timeout, DEFAULT_GENERATE_TIMEOUT))

    @_takes_generate_args
    async def generate(self, request: pb.GenerateRequest, timeout: float | None) -> Completion:
        """The whole completion: text, generated token ids, finish_reason, usage."""
        stream = AsyncStream(self, request, self._p.deadline(timeout, DEFAULT_GENERATE_TIMEOUT))
        async with stream:
            return _collect([c async for c in stream])

    async def tokenize(self, text: str, timeout: float | None = None) -> Tokens:
        r = await self._unary(self._stub.Tokenize, pb.TokenizeRequest(text=text), timeout)
        return Tokens(list(r.token_ids), list(r.tokens))

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        return _model_info(await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    async def health(self, service: str = "", timeout: float | None = None) -> bool:
        """Like Client.health: True when the gateway reports SERVING."""
        request = health_pb2.HealthCheckRequest(service=service)
        r = await self._unary(self._health.Check, request, timeout)
        return r.status == health_pb2.HealthCheckResponse.SERVING
