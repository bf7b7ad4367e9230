"""`fastdecode bench spec`: speculative decoding through the split (fastdecode/benchmarks/spec_bench.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from fastdecode.cli.bench import bench, emit, json_option, run_bench


@bench.command("spec")
@json_option
@click.option("--model", type=click.Path(file_okay=False), default=None, help="Default: SmolLM2 (imported).")
@click.option("--batch", "-B", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1, 2048), default=96, show_default=True)
@click.option("-k", "k", type=click.IntRange(1, 15), default=3, show_default=True, help="Drafts a row.")
@click.option("--shards", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--modes",
    default="off,off-ahead,ngram,suffix",
    show_default=True,
    help="Comma-separated --speculative values; off is the baseline (one step at a time, as with drafts), "
    "off-ahead the default setup without drafts (planning ahead).",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help='JSONL of conversations ({"messages": [...]} a line), in turn; default: quote-and-edit tasks.',
)
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a PNG here.")
def spec_cmd(as_json: bool, model: str | None, modes: str, plot: str | None, **kw: Any) -> None:
    """Quote-and-edit requests on a fleet per --speculative mode: tokens/s, steps, tau, drafts kept, KV
    bytes and round trips per generated token, and whether greedy tokens equal the off run's."""
    from fastdecode.benchmarks.spec_bench import MODES, run_spec_bench
    from fastdecode.tools.gguf_import import default_model_dir

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    if not chosen or any(m not in MODES for m in chosen):
        raise click.BadParameter(f"modes must be among {', '.join(MODES)}", param_hint="--modes")
    path = Path(model) if model else default_model_dir()
    result = run_bench(lambda: run_spec_bench(path, modes=chosen, **kw))
    emit(result, as_json, "spec: speculative decoding against the same fleet without it")
    if plot:
        from fastdecode.benchmarks.plot import plot_spec_bench

        click.echo(f"plot written to {plot_spec_bench(result, plot)}", err=True)  # stdout stays JSON
    if any(v is False for k, v in result.items() if k.endswith("_same_tokens")):
        raise SystemExit(1)
