"""Chat templates rendered as transformers' `apply_chat_template` renders them (no transformers import).

The template is Jinja from the checkpoint: `chat_template` in tokenizer_config.json (a string, or a
list of named templates of which "default" is used), else chat_template.jinja or chat_template.json
beside it. Templates are untrusted code from a model hub, hence jinja2's ImmutableSandboxedEnvironment,
with the options and helpers transformers gives them (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fastdecode.runtime.errors import InvalidInput, ModelLoadError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
# The roles chat templates are written for (OpenAI's, less developer and function). A template writes
# the role outside the content, where a special-token string is a control token: another is refused.
ROLES = ("system", "user", "assistant", "tool")
_MARKER = re.compile("\ue000([0-9]+)\ue001")  # a message's content in render_spans' skeleton


# What chat_template_kwargs may not set: the variables the gateway itself passes to the template.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", *SPECIAL_TOKEN_KEYS})
MAX_TEMPLATE_KWARGS = 64


def check_template_kwargs(kwargs: Mapping[str, Any]) -> str | None:
    """Why a request's chat_template_kwargs cannot be passed to the template (None: they can)."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        return f"{len(kwargs)} entries; the limit is {MAX_TEMPLATE_KWARGS}"
    taken = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS)
    if taken:
        return f"{', '.join(taken)}: set by the gateway, not by chat_template_kwargs"
    bad = next((k for k in kwargs if not k.isidentifier()), None)
    return None if bad is None else f"{bad[:40]!r} is not a template variable name"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick(template: Any, source: Path) -> str | None:
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise ModelLoadError(f"{source}: chat_template is neither a string nor a list with a 'default' template")


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"the chat template does not compile: {e}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none."""
        path = Path(path)
        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"cannot read {config_file}: {e}") from None
        specials = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
        source = _pick(config.get("chat_template"), config_file)
        if source is None and (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if source is None and (path / "chat_template.json").is_file():
            data = json.loads((path / "chat_template.json").read_text(encoding="utf-8"))
            source = _pick(data.get("chat_template") if isinstance(data, dict) else None, path)
        return None if source is None else cls(source, specials)

    def render_spans(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[tuple[int, int]] | None]:
        """The prompt and where each message's content lies in it (character spans), so that its
        text can be tokenized as text (special-token strings included). The template is rendered
        with a marker in place of each content and once as is; None when the two disagree (a
        template that inspects or reshapes content): the caller then cannot tell content apart."""
        prompt = self.render(messages, add_generation_prompt, tools, extra)
        contents = [m.get("content") for m in messages]
        marked = [
            {**m, "content": f"\ue000{i}\ue001"} if isinstance(c, str) else m
            for i, (m, c) in enumerate(zip(messages, contents, strict=True))
        ]
        try:
            skeleton = self.render(marked, add_generation_prompt, tools, extra)
        except InvalidInput:
            return prompt, None
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        at = length = 0
        for part in _MARKER.finditer(skeleton):
            content = contents[int(part.group(1))]
            if not isinstance(content, str):
                return prompt, None
            out.append(skeleton[at : part.start()])
            length += part.start() - at
            spans.append((length, length + len(content)))
            out.append(content)
            length += len(content)
            at = part.end()
        out.append(skeleton[at:])
        return (prompt, spans) if "".join(out) == prompt else (prompt, None)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages` (and `tools`, for a template that renders them); `extra`:
        the request's chat_template_kwargs (e.g. enable_thinking), checked by check_template_kwargs.
        A template's own complaint (raise_exception, a missing key) is the request's fault: InvalidInput."""
        # As transformers: keys whose value is None are dropped (templates test for presence).
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(
                **(extra or {}),
                messages=plain,
                add_generation_prompt=add_generation_prompt,
                **({"tools": list(tools)} if tools else {}),
                **self.special_tokens,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:  # e.g. a message shape it does not expect
            raise InvalidInput(f"the model's chat template rejected the messages: {e}") from None
