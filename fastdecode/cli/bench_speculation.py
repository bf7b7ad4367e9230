"""The speculative options `bench pace` and `bench split` share: on an emulated GPU the drafts are
verified by the emulated device, which keeps them at the --acceptance rates (docs/speculative.md,
"At a GPU's pace"); `bench split` on cpu or cuda has the real model verify them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click


def _rates(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        rates = [float(x) for x in value.split(",")]
    except ValueError:
        rates = []
    if not rates or not all(0.0 <= r <= 1.0 for r in rates):
        raise click.BadParameter("comma-separated rates in [0, 1], one per draft position")
    return value


def split_device(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """bench split's --device: cpu, cuda or emulated:NAME (the profile is checked by the bench)."""
    if value in ("cpu", "cuda") or (value.startswith("emulated:") and len(value) > len("emulated:")):
        return value
    raise click.BadParameter(f"{value!r} is not one of 'cpu', 'cuda', or emulated:NAME")


def speculative_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--speculative, --num-speculative-tokens, --acceptance."""
    f = click.option(
        "--acceptance",
        default=None,
        callback=_rates,
        help="Emulated acceptance (an emulated device only): per draft position, the share of rows "
        "that keep their j-th draft (comma-separated; positions past the list keep the last). "
        "Default: what bench spec measured with ngram, 0.6528,0.5972,0.5,0.5 "
        "(docs/benchmarks/2026-12-05-speculative.json).",
    )(f)
    f = click.option(
        "--num-speculative-tokens",
        "-k",
        type=click.IntRange(1, 16),
        default=3,
        show_default=True,
        help="Most drafts a decode row carries.",
    )(f)
    return click.option(
        "--speculative",
        type=click.Choice(["off", "ngram", "suffix"]),
        default="off",
        show_default=True,
        help="Also run the fleet with speculative drafts (an emulated device verifies them at the "
        "--acceptance rates; bench split on cpu or cuda, the real model) and report tokens/s against "
        "it without, tau and round trips per token. bench split runs up to k drafts a row and the "
        "k the scheduler's controller chooses (auto) beside no drafts, steps alternating.",
    )(f)
