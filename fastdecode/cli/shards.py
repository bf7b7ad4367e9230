"""`fastdecode shards`: change a running fleet's shards through its scheduler (list, add, drain)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click


def _target_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(
        [
            click.option(
                "--target",
                envvar="FASTDECODE_SCHEDULER",
                default=None,
                help="HOST:PORT of the scheduler (env FASTDECODE_SCHEDULER, as in the Helm pods).",
            ),
            click.option(
                "--state-file",
                type=click.Path(dir_okay=False, exists=True),
                default=None,
                help="`fastdecode up --state-file`'s file: its scheduler is the target.",
            ),
            click.option(
                "--tls-cert", envvar="FASTDECODE_TLS_CERT", default=None, help="Client cert (mTLS)."
            ),
            click.option("--tls-key", envvar="FASTDECODE_TLS_KEY", default=None, help="Client key (mTLS)."),
            click.option("--tls-ca", envvar="FASTDECODE_TLS_CA", default=None, help="CA of the server cert."),
        ]
    ):
        f = opt(f)
    return f


def _call(opts: dict[str, Any], method: str, request: Any, timeout: float) -> Any:
    """One unary call to the scheduler; a failure is one line on stderr and exit 1."""
    import grpc

    from fastdecode.runtime.rpc import sync_channel
    from fastdecode.runtime.settings import ServiceSettings, TLSFiles
    from fastdecode.tools.fleet import state_credentials
    from fastdecode.v1 import scheduler_pb2_grpc

    # The fleet secret the scheduler checks: the state file's (it names the file `up` wrote), else
    # FASTDECODE_FLEET_SECRET(_FILE) from the environment, as a pod's preStop hook has it.
    secret = ServiceSettings().tls.secret
    target = opts["target"]
    if opts["state_file"]:
        state = json.loads(Path(opts["state_file"]).read_text())
        target = state["scheduler"]["address"]
        secret = state_credentials(state).secret or secret
    if not target:
        click.echo("error: give --target HOST:PORT (or --state-file)", err=True)
        sys.exit(2)
    paths = (Path(p) if p else None for p in (opts["tls_cert"], opts["tls_key"], opts["tls_ca"]))
    tls = TLSFiles(*paths, secret=secret)
    try:
        with sync_channel(target, tls) as ch:
            return getattr(scheduler_pb2_grpc.SchedulerStub(ch), method)(request, timeout=timeout)
    except grpc.RpcError as e:
        hint = ""
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            hint = (
                " (the scheduler needs the fleet secret: give --state-file F, the file `fastdecode up"
                " --state-file F` writes, or set FASTDECODE_FLEET_SECRET_FILE to the secret's file)"
            )
        click.echo(f"error: {target}: {e.code().name}: {e.details()}{hint}", err=True)
        sys.exit(1)


@click.group()
def shards() -> None:
    """List, add and drain the kv_attention shards of a running fleet."""


@shards.command("list")
@_target_options
def list_cmd(**opts: Any) -> None:
    """Print each shard's index, address, state and load as JSON lines."""
    from fastdecode.v1 import scheduler_pb2

    st = _call(opts, "GetStats", scheduler_pb2.SchedulerStatsRequest(), 10.0)
    for sh in st.shards:
        state = sh.state or ("serving" if sh.healthy else "lost")
        row = {"shard": sh.shard, "address": sh.address, "state": state, "sequences": sh.sequences}
        click.echo(json.dumps({**row, "tokens": sh.tokens, "capacity_tokens": sh.capacity_tokens}))


@shards.command("add")
@_target_options
@click.option("--address", required=True, help="HOST:PORT of the new kv_attention shard.")
def add_cmd(address: str, **opts: Any) -> None:
    """Add a running shard to the fleet: gpu_dense dials it, new sequences go there."""
    from fastdecode.v1 import dense_pb2

    resp = _call(opts, "AddShard", dense_pb2.AddShardRequest(address=address), 30.0)
    click.echo(json.dumps({"shard": resp.shard, "address": address}))


@shards.command("drain")
@_target_options
@click.option(
    "--shard",
    type=int,
    envvar="FASTDECODE_SHARD_ID",
    default=None,
    help="Index of the shard (env FASTDECODE_SHARD_ID, a Helm shard pod's own).",
)
@click.option("--address", default="", help="The shard's HOST:PORT, instead of --shard.")
@click.option(
    "--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for it to empty."
)
def drain_cmd(shard: int | None, address: str, timeout: float, **opts: Any) -> None:
    """Drain a shard and take it out: its sequences move with their KV to the other shards (those
    that do not fit wait there and finish), then it leaves gpu_dense and the scheduler and exits.
    Prints the outcome as one JSON line; exit 1 if it did not empty within --timeout."""
    from fastdecode.v1 import scheduler_pb2

    if shard is None and not address:
        click.echo("error: give --shard ID or --address HOST:PORT", err=True)
        sys.exit(2)
    req = scheduler_pb2.RemoveShardRequest(
        shard=shard if shard is not None else 0, address=address, timeout_seconds=timeout
    )
    r = _call(opts, "RemoveShard", req, timeout + 30.0)
    out = {
        "shard": r.shard,
        "migrated_sequences": r.migrated_sequences,
        "reprefilled_sequences": r.reprefilled_sequences,
        "drain_s": round(r.seconds, 3),
        "migrated_bytes": r.bytes,
    }
    click.echo(json.dumps(out))
