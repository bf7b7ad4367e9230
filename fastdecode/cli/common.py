"""The root `fastdecode` group and the helpers the `serve` commands share: flags derived from the
services' settings classes (fastdecode.runtime.settings), and running a service with them."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from pydantic_settings import BaseSettings

from fastdecode.cli.errors import ErrorReportingGroup
from fastdecode.runtime.loop import run_loop


def write_state(path: Path, state: dict[str, Any]) -> None:
    """`up`'s state file, whole or not at all: readers poll it while `up` rewrites it after a
    restart, and a truncate-then-write let them read it empty."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)


def settings_kwargs(**flags: Any) -> dict[str, Any]:
    """Only flags given on the command line; pydantic-settings fills the rest from FASTDECODE_*."""
    return {k: v for k, v in flags.items() if v is not None}


def _flag_type(annotation: Any, extra: dict[str, Any]) -> tuple[Any, bool]:
    """The click type of a settings field, and whether it is a boolean on/off flag."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Literal:
        return click.Choice([str(a) for a in typing.get_args(annotation)]), False
    if annotation is bool:
        return None, True
    if annotation is Path:
        return (
            click.Path(file_okay=False) if extra.get("path") == "dir" else click.Path(dir_okay=False)
        ), False
    return {int: int, float: float}.get(annotation, str), False


def settings_options(settings_cls: type[BaseSettings]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """One flag per field of `settings_cls` (fastdecode.runtime.settings), derived from the field:
    --name-with-dashes, its type or choices, and help = description + default + environment variable.
    Flags default to None so that a flag not given leaves the value to the environment, then to the
    field's default."""
    prefix = str(settings_cls.model_config.get("env_prefix", ""))

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        options = []
        for name, field in settings_cls.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if extra.get("cli") == "env":
                continue
            kind, is_bool = _flag_type(field.annotation, extra)
            flag = "--" + name.replace("_", "-")
            notes = [] if field.is_required() or field.default is None else [f"default: {field.default}"]
            notes.append(f"env: {prefix}{name.upper()}")
            text = f"{field.description or ''} [{'; '.join(notes)}]".strip()
            hidden = extra.get("cli") == "hidden"
            if is_bool:
                options.append(
                    click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=text, hidden=hidden)
                )
            else:
                options.append(click.option(flag, name, type=kind, default=None, help=text, hidden=hidden))
        for opt in reversed(options):
            f = opt(f)
        return f

    return decorate


def run_service(serve: Callable[[Any], Any], settings_cls: type, flags: dict[str, Any]) -> None:
    from pydantic import ValidationError

    try:
        settings = settings_cls(**settings_kwargs(**flags))
    except ValidationError as e:
        raise click.UsageError(str(e)) from None
    run_loop(serve(settings), fast=settings_cls.__name__ == "DenseSettings")


@click.group(
    cls=ErrorReportingGroup,  # one-line errors, no tracebacks, for user input and broken checkpoints
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click.version_option(package_name="fastdecode-fleet")
def main() -> None:
    """FastDecode fleet: LLM decoding split into a batched dense half and sharded attention on CPUs."""
