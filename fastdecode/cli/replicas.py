"""`fastdecode up --replicas N`: N fleets behind one router (fastdecode/tools/replicas.py), each fleet
supervised as `up` supervises one (a service that dies is restarted on its address; meanwhile the
router routes around the replica it belonged to)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

import click

from fastdecode.cli.common import write_state
from fastdecode.tools.fleet import Fleet


def serve_replicas(
    make_fleet: Callable[[], Fleet],
    n: int,
    router: str,
    policy: str,
    http_port: int | None,
    state_file: str | None,
    restart: str,
    stop: threading.Event,
) -> None:
    from fastdecode.runtime.errors import ServiceError
    from fastdecode.tools.replicas import Replicas
    from fastdecode.tools.supervisor import RestartPolicy, Supervisor

    if http_port is None:
        raise click.UsageError("--replicas needs --http-port: the router's port, the one endpoint")
    group = Replicas([make_fleet() for _ in range(n)], http_port, router, policy)
    try:
        group.start()
    except ServiceError as e:
        click.echo(f"error: {e}", err=True)
        group.stop()
        sys.exit(1)
    failed = False
    try:
        if state_file:
            write_state(Path(state_file), group.state())
        for i, f in enumerate(group.fleets):
            assert f.gateway is not None
            click.echo(f"replica {i}: gateway {f.gateway.address}, HTTP http://{f.gateway.http}/v1", err=True)
        click.echo(f"{router} ({policy}) on http://{group.address}/v1", err=False)
        sys.stdout.flush()
        supervisors = [Supervisor(f, RestartPolicy(restart)) for f in group.fleets]
        while not stop.wait(0.5):
            changed = False
            for i, sup in enumerate(supervisors):
                for event in sup.poll():
                    changed = True
                    warn = "" if event.kind == "restarted" else "warning: "
                    click.echo(f"{warn}replica {i}: {event.message}", err=True)
                    if event.kind == "gave-up":
                        click.echo(f"error: replica {i} cannot be restored; stopping", err=True)
                        failed = True
            if not group.router_alive():
                click.echo(f"error: {router} exited (log: {group.log_path}); stopping", err=True)
                failed = True
            if changed and state_file:
                write_state(Path(state_file), group.state())
            if failed:
                break
    finally:
        click.echo("stopping the replicas", err=True)
        group.stop()
        if state_file:
            Path(state_file).unlink(missing_ok=True)
    if failed:
        sys.exit(1)
