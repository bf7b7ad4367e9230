"""`fastdecode bench route`: `up --replicas 2` behind vllm-router per router policy, prefix hits and
time to first token through the router, then kills under load (fastdecode/benchmarks/route_bench.py;
registered on the `bench` group of fastdecode.cli.bench)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from fastdecode.cli.bench import bench, json_option, run_bench


@bench.command("route")
@json_option
@click.option("--model", type=click.Path(file_okay=False), default=None, help="Default: SmolLM2 (imported).")
@click.option(
    "--policies",
    default="cache_aware,round_robin",
    show_default=True,
    help="Comma-separated router policies, one `up --replicas 2` each, same requests in the same order.",
)
@click.option("--prompts", type=click.IntRange(1, 64), default=4, show_default=True, help="System prompts.")
@click.option("--users", type=click.IntRange(1, 256), default=8, show_default=True, help="Users per prompt.")
@click.option(
    "--system-tokens",
    type=click.IntRange(1, 8192),
    default=256,
    show_default=True,
    help="Each system prompt's least length in the model's tokens.",
)
@click.option("--max-tokens", type=click.IntRange(1, 2048), default=16, show_default=True)
@click.option("--concurrency", type=click.IntRange(1, 64), default=4, show_default=True, help="In flight.")
@click.option("--seed", type=int, default=0, show_default=True, help="Prompts' words and the send order.")
@click.option(
    "--kill/--no-kill",
    default=True,
    show_default=True,
    help="On the cache_aware fleet, under load: kill -9 one replica's gateway, then every process of the "
    "other replica (`up` restarts them); failures, hangs and the router's notice time.",
)
@click.option("--load", type=click.IntRange(1, 32), default=3, show_default=True, help="Kill phase streams.")
@click.option("--kill-max-tokens", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option(
    "--request-timeout",
    type=click.FloatRange(1, 600),
    default=60.0,
    show_default=True,
    help="Every request's deadline; one past it counts as hung.",
)
@click.option(
    "--whole-replica/--gateway-only",
    "kill_whole",
    default=True,
    show_default=True,
    help="After the gateway kill, also kill every process of the other replica at once.",
)
@click.option(
    "--restore-limit",
    type=click.FloatRange(1, 600),
    default=60.0,
    show_default=True,
    help="Seconds to wait for `up` to restore what a kill took down.",
)
@click.option("--gap-seconds", "gap_s", type=click.FloatRange(0, 120), default=5.0, show_default=True)
def route_cmd(as_json: bool, model: str | None, policies: str, kill: bool, **kw: Any) -> None:
    """Two replicas behind vllm-router per policy: share of prompt-sharing requests that found the prefix
    cached, TTFT p50/p90, total seconds, cache_aware against round_robin; then kills under load."""
    from fastdecode.benchmarks.common import format_pairs, format_table
    from fastdecode.benchmarks.route_bench import run_route_bench
    from fastdecode.tools.gguf_import import ensure_default_model

    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    path = Path(model) if model else ensure_default_model()
    kill_policy = "cache_aware" if "cache_aware" in chosen else (chosen[0] if chosen else "")
    result = run_bench(
        lambda: run_route_bench(path, policies=chosen, kill=kill, kill_policy=kill_policy, **kw)
    )
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo("route: replicas behind vllm-router, per policy")
    click.echo(format_pairs(result))
    rows = [
        {"policy": p, **{k: v for k, v in r.items() if k != "errors"}} for p, r in result["policies"].items()
    ]
    click.echo(format_table(rows))
    if "kill" in result:
        k = result["kill"]
        click.echo(f"kill phase: whole replica = {k['whole_replica']}")
        click.echo(format_table([{k2: v for k2, v in e.items() if k2 != "killed_pids"} for e in k["events"]]))
        click.echo(
            "requests each replica finished in the gap after the gateway's restart: "
            f"{k['served_per_replica_after_restore']}"
        )
        click.echo(f"each replica asked directly at the end: {k['direct_probe_at_end']}")
        for err in k["errors"]:
            click.echo(f"  error seen: {err}")
