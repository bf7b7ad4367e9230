"""vLLM's `POST /tokenize` and `POST /detokenize` bodies and their checks: a prompt (or a chat,
rendered by the checkpoint's template as /v1/chat/completions renders it) to token ids, and ids back
to text. Imports no web framework: services/gateway/openai_api.py serves these.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fastdecode.gateway.chat import ChatTemplate
from fastdecode.gateway.openai import APIError, ChatBody, ChatMessage, RequestBody, cannot_chat, chat_request
from fastdecode.gateway.text import GenerateParams
from fastdecode.runtime.errors import Status


class TokenizeBody(RequestBody):
    """Either `prompt` (completions' form) or `messages` (chat's form), as vLLM takes them."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # None: vLLM's defaults, True for a prompt, False for a chat (its template writes BOS itself)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int] = Field(...)


def _invalid(message: str, param: str) -> APIError:
    return APIError(Status.INVALID_ARGUMENT, message, param)


def tokenize_params(
    body: TokenizeBody, template: ChatTemplate | None, template_error: str, model_id: str, max_context: int
) -> GenerateParams:
    """The request as GenerateParams, so that its ids are those a generation would be given (the same
    checks, the same special-token handling of chat content)."""
    if (body.prompt is None) == (body.messages is None):
        raise _invalid("send one of prompt (a string) and messages (a chat)", "prompt")
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        return GenerateParams(prompt=body.prompt, add_special_tokens=add)
    if template is None:
        raise cannot_chat(model_id, template_error)
    chat = ChatBody(
        messages=body.messages or [],
        tools=body.tools,
        chat_template_kwargs=body.chat_template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
    )
    params, _ = chat_request(chat, template, max_context)
    return params


def leading_specials(body: TokenizeBody) -> bool:
    """A chat asked with add_special_tokens: the tokenizer's BOS goes before the template's text
    (which is tokenized by its spans, content as text, so not through encode's own flag)."""
    return body.messages is not None and bool(body.add_special_tokens)


def check_detokenize(body: DetokenizeBody, vocab_size: int, max_context: int) -> list[int]:
    if len(body.tokens) > max_context:
        raise _invalid(
            f"tokens has {len(body.tokens)} ids; the limit is the context, {max_context}", "tokens"
        )
    bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _invalid(f"tokens holds {bad}, outside the vocabulary [0, {vocab_size})", "tokens")
    return list(body.tokens)


def tokenize_response(ids: list[int], max_context: int, strs: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_context, "tokens": ids}
    if strs is not None:
        out["token_strs"] = strs
    return out
