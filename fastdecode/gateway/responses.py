"""The OpenAI-compatible API's response side: response objects (whole, or chunk by chunk as SSE
events), logprobs in OpenAI's shapes, usage, tool calls (fastdecode.gateway.tools), and the merge of n
choices' streams. Imports no gRPC and no web framework: services/gateway/openai_api.py serves these.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Sequence
from typing import Any

from fastdecode.contract import TokenLogprob
from fastdecode.gateway.core import GenerationChunk
from fastdecode.gateway.reasoning import ReasoningStream
from fastdecode.gateway.tools import ToolCallStream


# ---- responses ---------------------------------------------------------------------------------
def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_event(name: str, obj: dict[str, Any]) -> bytes:
    """A named server-sent event (Anthropic's Messages and OpenAI's Responses name theirs)."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n".encode()


def _usage(*lasts: GenerationChunk) -> dict[str, Any]:
    """As OpenAI counts n choices: the prompt once, the completions' tokens summed. The prompt,
    counted once, was cached as far as the choice that found least of it cached (the one that
    computed it); `choices_cached_tokens` (extension, n > 1) shows each choice's, so the siblings'
    reuse of the prompt's full blocks is visible."""
    prompt = lasts[0].prompt_tokens
    completion = sum(c.completion_tokens for c in lasts)
    details: dict[str, Any] = {"cached_tokens": min(c.cached_tokens for c in lasts)}
    if len(lasts) > 1:
        details["choices_cached_tokens"] = [c.cached_tokens for c in lasts]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }


class LogprobsShape:
    """OpenAI's logprobs objects: completions' parallel lists (`tokens`, `token_logprobs`,
    `top_logprobs`, `text_offset`) or chat's `content` list. Tokens the output hides (EOS, stop ids)
    are left out, as their text is; a token's string is its own decoded text."""

    def __init__(self, chat: bool, decode: Callable[[int], str], hidden: Collection[int]) -> None:
        self.chat = chat
        self.decode = decode
        self.hidden = frozenset(hidden)
        self.offset = 0  # completions' text_offset of the next token

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def of(self, entries: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        """`None` stands for a position with no logprob (the first prompt token, with echo)."""
        shown = [e for e in entries if e is None or e.token_id not in self.hidden]
        if self.chat:
            content = [
                self._chat_entry(e.token_id, e.logprob)
                | {"top_logprobs": [self._chat_entry(t, lp) for t, lp in e.top]}
                for e in shown
                if e is not None
            ]
            return {"content": content, "refusal": None}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in shown:
            if e is None:
                continue
            text = self.decode(e.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self.decode(t): lp for t, lp in e.top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def first_prompt_token(self, token_id: int) -> dict[str, Any]:
        """Completions' echo: the prompt's first token, which has no logprob (null)."""
        text = self.decode(token_id)
        self.offset += len(text)
        return {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}


def join_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One logprobs object of several (completions' lists or chat's content), in order."""
    out: dict[str, Any] = {}
    for p in parts:
        for k, v in p.items():
            if isinstance(v, list):
                out.setdefault(k, []).extend(v)
            else:
                out[k] = v
    return out


class ResponseShape:
    """Response objects of one request: completions or chat, whole or as stream chunks."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        include_usage: bool,
        logprobs: LogprobsShape | None = None,
        echo: str | None = None,
        index: int = 0,
        tools: ToolCallStream | None = None,
    ) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs  # None: the request asked for none
        self.echo = echo  # completions' echo: the prompt text, sent before the completion
        self.index = index  # the choice this shape writes (n > 1)
        self.tools = tools  # chat with tools: the text becomes content and tool_calls
        # stream_options.continuous_usage_stats: the usage so far on every chunk (as vLLM)
        self.continuous_usage = False
        self.reasoning: ReasoningStream | None = None  # chat with a reasoning parser: reasoning_content
        self.prompt_tokens = 0
        self._completion_tokens = 0
        self._parts: list[str] = []  # a whole answer's text, logprobs and last chunk (take)
        self._logprobs: list[dict[str, Any]] = []
        self._last: GenerationChunk | None = None

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(
        self, text: str, last: GenerationChunk, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        thought = None
        if self.chat and self.reasoning is not None:
            thought, text = self.reasoning.split(text)
        shown = {"reasoning_content": thought} if thought is not None else {}
        if self.chat and self.tools is not None:
            self.tools.feed(text)
            self.tools.finish()
            reason = self.tools.finish_reason(last.finish_reason or "")
            return {
                "index": self.index,
                "message": self.tools.message() | shown,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        if self.chat:
            choice = {"index": self.index, "message": {"role": "assistant", "content": text} | shown}
        else:
            choice = {"index": self.index, "text": (self.echo or "") + text}
        return choice | {"logprobs": logprobs, "finish_reason": last.finish_reason}

    def whole(
        self, text: str, last: GenerationChunk, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self.response([self.choice(text, last, logprobs)], [last])

    def response(self, choices: list[dict[str, Any]], lasts: Sequence[GenerationChunk]) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": _usage(*lasts)}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str = "",
    ) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": self.index, "delta": delta}
        else:
            choice = {"index": self.index, "text": text or ""}
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = {**self._head(obj), "choices": [choice]}
        if self.continuous_usage:
            out["usage"] = self.running_usage()
        elif self.include_usage:
            out["usage"] = None  # as OpenAI: every chunk has it, null but in the last one
        return sse(out)

    def role_chunk(self, first: GenerationChunk) -> bytes:
        """A chat stream's first chunk (the role), its running usage from the first generation chunk."""
        self.prompt_tokens = first.prompt_tokens
        return self.chunk(None, None, role=True)

    def running_usage(self) -> dict[str, int]:
        """This choice's usage so far: the prompt and the tokens generated up to this chunk."""
        p, c = self.prompt_tokens, self._completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def count(self, c: GenerationChunk) -> None:
        """Advance the running usage by one generation chunk (before its events are written)."""
        self.prompt_tokens = c.prompt_tokens or self.prompt_tokens
        done = c.completion_tokens if c.finish_reason else self._completion_tokens + len(c.token_ids)
        self._completion_tokens = done

    def usage_chunk(self, *lasts: GenerationChunk) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": _usage(*lasts)})

    # -- from generation chunks
    def logprobs_of(self, c: GenerationChunk) -> list[dict[str, Any]]:
        """The logprobs objects of one chunk: the prompt's first (echo), then its tokens'."""
        lp = self.logprobs
        if lp is None:
            return []
        out = []
        if c.prompt_first_token is not None:
            out.append(lp.first_prompt_token(c.prompt_first_token))
        if c.prompt_logprobs:
            out.append(lp.of(c.prompt_logprobs))
        out.append(lp.of(c.logprobs))
        return out

    def take(self, c: GenerationChunk) -> None:
        """One chunk of a whole (non-streamed) answer."""
        self._parts.append(c.text)
        self._logprobs += self.logprobs_of(c)
        self._last = c

    def collected(self) -> tuple[dict[str, Any], GenerationChunk]:
        """The whole answer's choice, after the last chunk (it has the finish reason)."""
        last = self._last
        assert last is not None and last.finish_reason, "generate() ends with a finish reason"
        whole = join_logprobs(self._logprobs) if self.logprobs is not None else None
        return self.choice("".join(self._parts), last, whole), last

    def wants_event(self, c: GenerationChunk) -> bool:
        has_lp = self.logprobs is not None and bool(c.logprobs or c.prompt_logprobs or c.prompt_first_token)
        return bool(c.text or c.finish_reason or has_lp)

    def event(self, c: GenerationChunk) -> bytes:
        """The SSE event(s) of one streamed chunk."""
        self.count(c)
        text = c.text
        if self.echo is not None:  # the prompt leads the first chunk
            text, self.echo = self.echo + text, None
        lp = join_logprobs(self.logprobs_of(c)) if self.logprobs is not None else None
        thought = ""
        if self.chat and self.reasoning is not None:  # the thinking apart; tools see the content only
            thought, text = self.reasoning.feed(text)
            if c.finish_reason:
                more_thought, more = self.reasoning.finish()
                thought, text = thought + more_thought, text + more
            if not (thought or text or lp or c.finish_reason):
                return b""  # all held back (maybe part of a tag)
        if self.tools is not None:
            content, calls = self.tools.feed(text)
            if c.finish_reason:
                more, more_calls = self.tools.finish()
                content, calls = content + more, calls + more_calls
            out = b""
            if content or calls or lp or thought:
                out = self.chunk(
                    content or None, None, logprobs=lp, tool_calls=calls or None, reasoning=thought
                )
            if c.finish_reason:
                out += self.chunk(None, self.tools.finish_reason(c.finish_reason))
            return out
        if self.chat and (text or thought) and c.finish_reason:  # OpenAI sends the finish on an empty delta
            return self.chunk(text, None, logprobs=lp, reasoning=thought) + self.chunk(None, c.finish_reason)
        return self.chunk(text, c.finish_reason, logprobs=lp, reasoning=thought)


async def merge_choices(
    firsts: list[GenerationChunk], producers: list[AsyncGenerator[GenerationChunk]]
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """(choice, chunk) as each choice's chunks arrive, the first ones first."""
    for i, f in enumerate(firsts):
        yield i, f
    if len(producers) == 1:  # in this task, as before n: the drain's cut-off lands here
        async with contextlib.aclosing(producers[0]) as chunks:
            async for c in chunks:
                yield 0, c
        return
    queue: asyncio.Queue[tuple[int, GenerationChunk | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, producer: AsyncGenerator[GenerationChunk]) -> None:
        try:
            async with contextlib.aclosing(producer) as chunks:
                async for c in chunks:
                    await queue.put((i, c))
            await queue.put((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(producers)]
    try:
        left = len(tasks)
        while left:
            i, c = await queue.get()
            if c is None:
                left -= 1
            elif isinstance(c, BaseException):
                raise c
            else:
                yield i, c
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
