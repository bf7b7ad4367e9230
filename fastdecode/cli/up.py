"""`fastdecode up` and `fastdecode demo`: the whole fleet as local processes."""

from __future__ import annotations

import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import click
from pydantic_settings import BaseSettings

from fastdecode.cli.common import write_state
from fastdecode.runtime.settings import (
    DenseSettings,
    SchedulerSettings,
    ShardSettings,
    is_emulated,
    parse_decode_steps,
)


def _setting(cls: type[BaseSettings], name: str, **extra: Any) -> Any:
    """A `fastdecode up` flag for one service setting: its default, choices and description are the
    settings class's (fastdecode.runtime.settings), as `fastdecode serve` derives its flags, so `up`
    and `serve` never disagree on a default."""
    field = cls.model_fields[name]
    choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is Literal else ()
    kind = click.Choice(list(choices)) if choices else extra.pop("type", field.annotation)
    if kind is int:  # its bounds checked here, not by a service that failed to start
        lo = next((m.ge for m in field.metadata if hasattr(m, "ge")), None)
        hi = next((m.le for m in field.metadata if hasattr(m, "le")), None)
        kind = click.IntRange(lo, hi)
    return click.option(
        "--" + name.replace("_", "-"),
        type=kind,
        default=field.default,
        show_default=True,
        help=extra.pop("help", field.description),
        **extra,
    )


class _DecodeSteps(click.ParamType):
    """--decode-steps (an int or auto: no click type of its own): refused at the flag with the
    scheduler settings' own line, not by a scheduler that failed to start."""

    name = "auto|K"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        try:
            return parse_decode_steps(value)
        except ValueError as e:
            self.fail(str(e).removeprefix("--decode-steps "), param, ctx)  # click names the flag


def _check_kv_events(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A bad address is refused at its flag, not by a scheduler that fails to start."""
    from fastdecode.runtime.endpoints import parse_pub_endpoint
    from fastdecode.runtime.errors import InvalidInput

    if value is not None:
        try:
            parse_pub_endpoint(value)
        except InvalidInput as e:
            raise click.BadParameter(e.message.split(": ", 1)[1], param_hint="'--kv-events'") from None
    return value


def _fleet_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(
        [
            click.option(
                "--model",
                type=click.Path(),
                default=None,
                help="Checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct, fetched and imported "
                "on first use).",
            ),
            click.option("--shards", type=click.IntRange(1, 64), default=2, show_default=True),
            _setting(
                DenseSettings,
                "device",
                help="gpu_dense device: auto, cpu, cuda[:N], or emulated:h100|h200|a10|l4|PROFILE.json "
                "(no weights; synthetic tokens at that GPU's pace, docs/emulated-gpu.md).",
            ),
            click.option(
                "--geometry",
                default=None,
                help="With an emulated device: the model shape to emulate (llama-3-8b, llama-3-70b).",
            ),
            _setting(DenseSettings, "tensor_parallel"),
            _setting(ShardSettings, "kv_capacity", help="KV bytes per shard."),
            _setting(
                ShardSettings,
                "kv_dtype",
                help="Shard KV-cache storage: float32 gives tokens equal to transformers' fp32; bfloat16 "
                "holds twice the tokens and `bench fleet` measured it faster end to end (int8, float8_e4m3: "
                "a scale per token and KV head).",
            ),
            _setting(
                ShardSettings,
                "kv_dir",
                type=click.Path(file_okay=False),
                help="Each shard keeps its KV pool in a file here: a crashed shard comes back with its "
                "sequences where they were (no re-prefill), and on disk shared prefixes outlive a stop of "
                "the fleet (docs/reliability.md).",
            ),
            _setting(SchedulerSettings, "admission"),
            _setting(SchedulerSettings, "prefix_sharing"),
            _setting(SchedulerSettings, "plan_ahead"),
            _setting(SchedulerSettings, "decode_steps", type=_DecodeSteps()),
            _setting(SchedulerSettings, "speculative"),
            _setting(SchedulerSettings, "num_speculative_tokens"),
            _setting(SchedulerSettings, "speculative_k"),
            click.option(
                "--kv-events",
                default=None,
                metavar="tcp://HOST:PORT",
                callback=_check_kv_events,
                help=SchedulerSettings.model_fields["kv_events"].description,
            ),
            click.option(
                "--host-shard",
                is_flag=True,
                help="One more shard, in gpu_dense's own process: the dense host's CPUs attend the "
                "share the scheduler places there, with no network hop (docs/split-hosts.md).",
            ),
            click.option(
                "--enable-lora", is_flag=True, help=DenseSettings.model_fields["enable_lora"].description
            ),
            _setting(DenseSettings, "lora_modules"),
            _setting(DenseSettings, "max_loras"),
            _setting(DenseSettings, "max_lora_rank"),
            click.option(
                "--pipeline",
                type=click.Choice(["auto", "on", "off"]),
                default="auto",
                show_default=True,
                help="Two-mini-batch pipeline. auto: gpu_dense measures piped and plain steps on the live "
                "load and keeps the faster (it pays when the halves run on separate hardware).",
            ),
        ]
    ):
        f = opt(f)
    return f


def _hide_token_from_ps(ctx: click.Context) -> None:
    """`--auth-token X` on the command line shows in `ps` for as long as `up` runs: start this
    command again with the token in the environment instead (the services get it from there too)."""
    import os

    if ctx.get_parameter_source("auth_token") is not click.core.ParameterSource.COMMANDLINE:
        return
    argv, token, i = list(sys.orig_argv), None, 1
    while i < len(argv):
        if argv[i] == "--auth-token" and i + 1 < len(argv):
            token = argv[i + 1]
            del argv[i : i + 2]
            continue
        if argv[i].startswith("--auth-token="):
            token = argv.pop(i).partition("=")[2]
            continue
        i += 1
    if token is None:
        return
    click.echo(
        "note: --auth-token moved into the environment (FASTDECODE_AUTH_TOKEN) to keep it out of ps", err=True
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], {**os.environ, "FASTDECODE_AUTH_TOKEN": token})


def _read_token_file(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise click.UsageError(f"cannot read --auth-token-file {path}: {e.strerror or e}") from None
    if not token:
        raise click.UsageError(f"--auth-token-file {path} is empty")
    return token


def _check_kv_capacity(kv_capacity: int, kv_dtype: str, config: Any) -> None:
    """--kv-capacity refused at its flag (exit 2), as --shards is, when a shard could hold too little
    of the geometry served (the scheduler keeps one block back, so two blocks at least) or more than
    this host has: otherwise the scheduler or the shards stop the fleet during start."""
    from fastdecode.runtime.geometry import host_available_bytes, kv_row_bytes

    try:
        block = ShardSettings().block_size  # FASTDECODE_BLOCK_SIZE reaches the shards too
    except ValueError as e:  # pydantic's ValidationError: a bad FASTDECODE_* variable
        raise click.UsageError(f"shard settings: {' '.join(str(e).split())}") from None
    g = config.kv_geometry
    per_token = 2 * g.num_layers * g.num_kv_heads * kv_row_bytes(kv_dtype, g.head_dim)
    need, have = 2 * block * per_token, host_available_bytes()
    if kv_capacity < need:
        raise click.BadParameter(
            f"{kv_capacity} bytes hold no KV: a shard needs at least {need} bytes here (two blocks of "
            f"{block} tokens, {per_token} bytes each: {g.num_layers} layers, {g.num_kv_heads} KV heads, "
            f"head dim {g.head_dim}, {kv_dtype})",
            param_hint="'--kv-capacity'",
        )
    if kv_capacity > have:
        raise click.BadParameter(
            f"{kv_capacity} bytes per shard is more than this host's available memory ({have} bytes)",
            param_hint="'--kv-capacity'",
        )


def _lora_args(enable: bool, modules: str, max_loras: int, max_rank: int) -> list[str]:
    """gpu_dense's LoRA flags (docs/lora.md); --lora-modules without --enable-lora is refused here."""
    if modules and not enable:
        raise click.BadParameter("needs --enable-lora", param_hint="'--lora-modules'")
    if not enable:
        return []
    modules_arg = ["--lora-modules", modules] if modules else []
    return ["--enable-lora", *modules_arg, "--max-loras", str(max_loras), "--max-lora-rank", str(max_rank)]


def _make_fleet(
    model: str | None,
    shards: int,
    port: int,
    device: str,
    kv_capacity: int,
    kv_dtype: str,
    admission: str,
    pipeline: str = "auto",
    auth_token: str | None = None,
    http_port: int | None = None,
    env: dict[str, str] | None = None,
    prefix_sharing: str = "on",
    host_shard: bool = False,
    geometry: str | None = None,
    tensor_parallel: int = 1,
    plan_ahead: str = "on",
    decode_steps: int | str = 1,
    kv_events: str | None = None,
    speculative: str = "off",
    num_speculative_tokens: int = 3,
    speculative_k: str = "auto",
    lora: Sequence[str] = (),
    kv_dir: Path | None = None,
) -> Any:
    from fastdecode.cli.gguf import resolve_model
    from fastdecode.runtime.errors import InvalidInput
    from fastdecode.tools.fleet import Fleet

    if speculative != "off" and decode_steps not in (1, "auto"):
        raise InvalidInput("--speculative needs --decode-steps 1 or auto: both give a row several tokens")
    path = resolve_model(model)  # before any service starts: a bad model is one clear line
    dense_args: list[str] = []
    if is_emulated(device):  # an unknown profile or a geometry that does not fit: one line, now
        import torch

        from fastdecode.dense.emulated import load_emulated

        emulated = load_emulated(path, device, torch.bfloat16, geometry, tensor_parallel=tensor_parallel)
        _check_kv_capacity(kv_capacity, kv_dtype, emulated.config)
        dense_args = ["--dtype", "bfloat16", *(["--geometry", geometry] if geometry else [])]
        click.echo(
            f"device {device} is EMULATED: no weights, synthetic tokens at {emulated.profile.name}'s "
            f"roofline pace ({geometry or 'the checkpoint'}'s shape, bfloat16); the scheduler, gateway "
            "and shards are real",
            err=True,
        )
    elif geometry:
        raise InvalidInput("--geometry needs an emulated device (--device emulated:NAME)")
    else:
        from fastdecode.model.config import ModelConfig, check_tensor_parallel

        config = ModelConfig.from_pretrained(path)
        _check_kv_capacity(kv_capacity, kv_dtype, config)
        check_tensor_parallel(config, tensor_parallel)
    if tensor_parallel > 1:
        dense_args += ["--tensor-parallel", str(tensor_parallel)]
    return Fleet(
        model=path,
        shards=shards,
        port=port,
        device=device,
        kv_capacity=kv_capacity,
        kv_dtype=kv_dtype,
        kv_dir=Path(kv_dir) if kv_dir else None,
        auth_token=auth_token,
        http_port=http_port,
        pipeline={"auto": None, "on": True, "off": False}[pipeline],
        host_shard=host_shard,
        scheduler_args=[
            "--admission",
            admission,
            "--prefix-sharing",
            prefix_sharing,
            "--plan-ahead",
            plan_ahead,
            "--decode-steps",
            str(decode_steps),
            *(["--kv-events", kv_events] if kv_events else []),
            "--speculative",
            speculative,
            "--num-speculative-tokens",
            str(num_speculative_tokens),
            "--speculative-k",
            speculative_k,
        ],
        dense_args=[*dense_args, *lora],
        env=dict(env or {}),
    )


@click.command()
@_fleet_options
@click.option("--port", type=int, default=50051, show_default=True, help="Gateway port on 127.0.0.1.")
@click.option(
    "--state-file", type=click.Path(dir_okay=False), default=None, help="Write pids and addresses here."
)
@click.option(
    "--auth-token",
    envvar="FASTDECODE_AUTH_TOKEN",
    default=None,
    help="Require this bearer token (better: the env var or --auth-token-file; given here, `up` moves it "
    "into its environment so `ps` does not show it).",
)
@click.option(
    "--auth-token-file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Read the bearer token from this file.",
)
@click.option(
    "--fleet-secret-file",
    type=click.Path(dir_okay=False, exists=True),
    envvar="FASTDECODE_FLEET_SECRET_FILE",
    default=None,
    help="The secret internal calls carry (first line sent, every line accepted); default: "
    "FASTDECODE_FLEET_SECRET, else a fresh one in the logs dir (docs/internal-auth.md).",
)
@click.option("--log-json", is_flag=True, help="Services log JSON lines (sets FASTDECODE_LOG_JSON).")
@click.option(
    "--http-port", type=int, default=None, help="Gateway's OpenAI-compatible HTTP port on 127.0.0.1 (0: any)."
)
@click.option(
    "--restart",
    type=click.Choice(["on-failure", "no"]),
    default="on-failure",
    show_default=True,
    help="Restart a service that dies, on the same address with backoff (at most 5 times in 5 minutes).",
)
@click.option(
    "--replicas",
    type=click.IntRange(1, 16),
    default=1,
    show_default=True,
    help="Fleets behind one router (docs/routing.md): --http-port is then the router's, each replica's "
    "gateway takes ports of its own.",
)
@click.option("--router", type=click.Choice(["vllm-router"]), default="vllm-router", show_default=True)
@click.option(
    "--router-policy",
    type=click.Choice(["cache_aware", "round_robin", "power_of_two", "consistent_hash", "random"]),
    default="cache_aware",
    show_default=True,
    help="cache_aware: a prompt goes where its prefix was served (its KV blocks cached there).",
)
def up(
    model: str | None,
    shards: int,
    device: str,
    geometry: str | None,
    tensor_parallel: int,
    kv_capacity: int,
    kv_dtype: str,
    kv_dir: Path | None,
    admission: str,
    prefix_sharing: str,
    plan_ahead: str,
    decode_steps: int | str,
    speculative: str,
    num_speculative_tokens: int,
    speculative_k: str,
    kv_events: str | None,
    host_shard: bool,
    enable_lora: bool,
    lora_modules: str,
    max_loras: int,
    max_lora_rank: int,
    pipeline: str,
    port: int,
    state_file: str | None,
    auth_token: str | None,
    auth_token_file: str | None,
    fleet_secret_file: str | None,
    log_json: bool,
    http_port: int | None,
    restart: str,
    replicas: int,
    router: str,
    router_policy: str,
) -> None:
    """Start gateway, scheduler, gpu_dense and N kv_attention shards as processes; stop on SIGINT/SIGTERM."""
    import signal
    import threading

    from fastdecode.cli.progress import startup_progress
    from fastdecode.runtime.errors import ServiceError
    from fastdecode.tools.supervisor import RestartPolicy, Supervisor

    _hide_token_from_ps(click.get_current_context())
    auth_token = _read_token_file(auth_token_file) or auth_token
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    options = {
        "env": {"FASTDECODE_LOG_JSON": "1"} if log_json else None,  # the services' ServiceSettings.log_json
        "prefix_sharing": prefix_sharing,
        "host_shard": host_shard,
        "geometry": geometry,
        "tensor_parallel": tensor_parallel,
        "plan_ahead": plan_ahead,
        "decode_steps": decode_steps,
        "kv_events": kv_events,
        "speculative": speculative,
        "num_speculative_tokens": num_speculative_tokens,
        "speculative_k": speculative_k,
        "lora": _lora_args(enable_lora, lora_modules, max_loras, max_lora_rank),
        "kv_dir": kv_dir,
    }
    args = (model, shards, port, device, kv_capacity, kv_dtype, admission, pipeline, auth_token)
    if replicas > 1:  # N fleets, each on ports of its own, and the router on --http-port
        from fastdecode.cli.replicas import serve_replicas

        made = iter(range(replicas))

        def replica() -> Any:
            n = next(made, replicas)  # each replica's shards keep their pools apart
            dirs = {"kv_dir": Path(kv_dir) / f"replica-{n}"} if kv_dir else {}
            f = _make_fleet(*args[:2], 0, *args[3:], 0, **{**options, **dirs})
            f.secret_file = Path(fleet_secret_file) if fleet_secret_file else None
            return f

        serve_replicas(replica, replicas, router, router_policy, http_port, state_file, restart, stop)
        return
    fleet = _make_fleet(*args, http_port, **options)
    fleet.secret_file = Path(fleet_secret_file) if fleet_secret_file else None
    try:
        with startup_progress() as on_progress:  # None (no output) when stderr is not a terminal
            fleet.start(on_progress=on_progress)
    except ServiceError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    failed = False
    try:
        if state_file:
            write_state(Path(state_file), fleet.state())
        click.echo(f"gateway listening on {fleet.gateway.address}", err=False)
        if fleet.gateway.http:
            click.echo(f"OpenAI-compatible HTTP on http://{fleet.gateway.http}/v1", err=False)
        click.echo(f"logs in {fleet.workdir}; Ctrl-C to stop", err=True)
        sys.stdout.flush()
        supervisor = Supervisor(fleet, RestartPolicy(restart))
        while not stop.wait(0.5):
            events = supervisor.poll()
            for event in events:
                click.echo(f"{'' if event.kind == 'restarted' else 'warning: '}{event.message}", err=True)
            if events and state_file:
                write_state(Path(state_file), fleet.state())
            gave_up = [e for e in events if e.kind == "gave-up"]
            if gave_up:
                # The restart budget is spent: the fleet cannot be what the state file says. Stop it
                # and exit non-zero with the reason rather than serve requests that cannot finish.
                click.echo(f"error: {gave_up[0].message}; stopping the fleet", err=True)
                failed = True
                break
    finally:
        click.echo("stopping the fleet", err=True)
        fleet.stop()
        if state_file:
            Path(state_file).unlink(missing_ok=True)
    if failed:
        sys.exit(1)


@click.command()
@click.option("--question", default="What is the capital of France?", show_default=True)
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option(
    "--model", type=click.Path(), default=None, help="Checkpoint dir or .gguf file (default: SmolLM2)."
)
def demo(question: str, max_tokens: int, model: str | None) -> None:
    """Start the fleet on a real instruct model, stream the answer to one chat question, stop."""
    import time

    from fastdecode.cli.gguf import chat_token_ids
    from fastdecode.client import Client
    from fastdecode.runtime.errors import ServiceError

    t0 = time.monotonic()
    fleet = _make_fleet(model, 2, 0, "auto", 256 << 20, "float32", "naive")
    ids = chat_token_ids(fleet.model, [{"role": "user", "content": question}])
    try:
        fleet.start()
    except ServiceError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    try:
        click.echo(
            f"fleet up in {time.monotonic() - t0:.1f}s: model {fleet.model.name}, gateway "
            f"{fleet.gateway.address}, {len(fleet.kv)} kv_attention shards",
            err=True,
        )
        click.echo(f"user: {question}")
        click.echo("assistant: ", nl=False)
        with Client(fleet.gateway.address) as client:
            last = None
            for chunk in client.stream(token_ids=ids, max_tokens=max_tokens):
                click.echo(chunk.text, nl=False)
                last = chunk
            click.echo()
        if last is not None:
            click.echo(f"[finish_reason={last.finish_reason}, usage={last.usage}]", err=True)
    finally:
        fleet.stop()
    click.echo(f"fleet stopped; demo took {time.monotonic() - t0:.1f}s", err=True)
