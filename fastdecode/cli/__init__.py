"""The `fastdecode` command line: serve the services, run the fleet, generate, benchmark, plan.

One module per command group; this is the one place where they are registered on the root group.
A new command: write it in its module (or a new one) and add it to COMMANDS.
"""

from __future__ import annotations

from fastdecode.cli import bench_kv, bench_pace, bench_route, bench_spec  # noqa: F401  (their commands join the bench group)
from fastdecode.cli.bench import bench
from fastdecode.cli.common import main
from fastdecode.cli.generate import generate_cmd
from fastdecode.cli.gguf import import_gguf_cmd
from fastdecode.cli.policy import plan_cmd, simulate_cmd
from fastdecode.cli.serve import serve
from fastdecode.cli.shards import shards
from fastdecode.cli.tools import health, make_model_cmd, run
from fastdecode.cli.up import demo, up

COMMANDS = [
    serve,
    health,
    make_model_cmd,
    run,
    up,
    demo,
    generate_cmd,
    bench,
    simulate_cmd,
    plan_cmd,
    import_gguf_cmd,
    shards,
]
for _command in COMMANDS:
    main.add_command(_command)

__all__ = ["COMMANDS", "main"]
