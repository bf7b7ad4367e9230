"""One typed settings class per service: the single source of every setting.

Values come from the command line first, then FASTDECODE_* environment variables, then the field
defaults. The `fastdecode serve ...` flags are derived from these fields (fastdecode.cli.common
.settings_options): a flag's name, type, choices, default and help all come from its field, so no
help text restates a default and no flag can disagree with its field. Per-field CLI extras ride in
`json_schema_extra`: {"cli": "hidden"} (a flag not shown), {"cli": "env"} (no flag: set by the
supervisor through the environment), {"path": "dir"} (a directory).

This module imports no gRPC (TLSFiles builds credentials only when asked).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fastdecode.protocol import MAX_DECODE_STEPS, MAX_DRAFTS
from fastdecode.runtime.fleet_secret import FleetSecret, load_fleet_secret
from fastdecode.runtime.logs import configure_logging

if TYPE_CHECKING:
    import grpc

DType = Literal["float32", "float16", "bfloat16"]
_HIDDEN = {"cli": "hidden"}
_ENV_ONLY = {"cli": "env"}
_DIR = {"path": "dir"}


# `--device emulated:NAME`: an emulated GPU (docs/emulated-gpu.md). Here, torch-free: `fastdecode up`
# picks its checks by it before any service starts.
EMULATED_PREFIX = "emulated:"


def is_emulated(device: str) -> bool:
    return device.startswith(EMULATED_PREFIX)


@dataclass(frozen=True)
class TLSFiles:
    """How a service proves itself to its peers and checks them: certificate files (with a CA, servers
    require client certificates: mutual TLS) and the fleet secret every internal call carries
    (fastdecode.runtime.fleet_secret; servers then refuse internal calls without it)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    secret: FleetSecret | None = field(default=None, repr=False, compare=False)

    @property
    def enabled(self) -> bool:
        return self.cert is not None and self.key is not None

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        import grpc

        assert self.cert and self.key
        ca = self.ca.read_bytes() if self.ca else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=bool(ca) and require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


class ServiceSettings(BaseSettings):
    """What every service shares."""

    model_config = SettingsConfigDict(env_prefix="FASTDECODE_", extra="ignore")

    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics port (off if unset)."
    )
    grace_seconds: float = Field(20.0, ge=0, description="Graceful stop period in seconds.")
    tls_cert: Path | None = Field(None, description="Server cert (PEM).")
    tls_key: Path | None = Field(None, description="Server key (PEM).")
    tls_ca: Path | None = Field(None, description="CA (PEM): enables mTLS.")
    fleet_secret: SecretStr | None = Field(
        None,
        description="Secret every internal call carries and checks (comma-separated: accepted ones).",
        json_schema_extra=_ENV_ONLY,  # environment only: argv shows in `ps`
    )
    fleet_secret_file: Path | None = Field(
        None, description="File with the fleet secret (first line sent, every line accepted)."
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads.")
    ready_file: Path | None = Field(
        None, description="Write the bound ports here once serving.", json_schema_extra=_HIDDEN
    )
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING.")
    log_json: bool = Field(False, description="JSON log lines.")
    # Set by `fastdecode up` for its children: a service stops when its supervisor is gone.
    supervisor_pid: int | None = Field(
        None, ge=1, description="Stop when this process exits.", json_schema_extra=_ENV_ONLY
    )

    @property
    def tls(self) -> TLSFiles:
        secret = self.fleet_secret.get_secret_value() if self.fleet_secret else None
        return TLSFiles(
            self.tls_cert, self.tls_key, self.tls_ca, load_fleet_secret(secret, self.fleet_secret_file)
        )

    def configure_logging(self, name: str) -> logging.Logger:
        return configure_logging(name, self.log_level, self.log_json)


class ShardSettings(ServiceSettings):
    """kv_attention: one KV-cache shard (the R-part)."""

    shard_id: int = Field(0, ge=0, description="This shard's index.")
    kv_capacity: int = Field(1 << 30, ge=0, description="KV pool budget in bytes.")
    kv_dtype: Literal["float32", "float16", "bfloat16", "int8", "float8_e4m3"] = Field(
        "float32", description="KV-cache element type (int8, float8_e4m3: a scale per token and KV head)."
    )
    attention_backend: Literal["native", "torch"] = Field(
        "native", description="native: the C++ kernel; torch: the SDPA reference."
    )
    block_size: int = Field(16, ge=1, le=4096, description="Tokens per KV block.")
    kv_dir: Path | None = Field(
        None,
        description="Keep the KV pool, its block tables and positions in a file here (tmpfs: survives a "
        "crash of this process; disk: also a full stop, for shared prefixes), mapped, not copied. A "
        "restarted shard re-attaches it and the scheduler resumes its sequences where they were "
        "(docs/reliability.md). Off if unset: anonymous memory, lost with the process.",
        json_schema_extra=_DIR,
    )

    @field_validator("kv_dir", mode="before")
    @classmethod
    def _empty_is_off(cls, v: object) -> object:
        """FASTDECODE_KV_DIR= (set, empty: how compose leaves a variable unset) means off, not '.'."""
        return None if v == "" else v


class DenseSettings(ServiceSettings):
    """gpu_dense: the S-part with all the weights."""

    model: Path = Field(..., description="HuggingFace checkpoint dir.", json_schema_extra=_DIR)
    shards: str = Field(..., description="HOST:PORT,HOST:PORT of the kv_attention shards in shard-id order.")
    device: str = Field(
        "auto",
        description="auto | cpu | cuda[:N] | emulated:h100|h200|a10|l4|PROFILE.json (no weights, synthetic "
        "tokens at that GPU's roofline pace: docs/emulated-gpu.md).",
    )
    geometry: str | None = Field(
        None,
        description="With an emulated device: a named model shape (llama-3-8b, llama-3-70b) over the "
        "checkpoint's.",
    )
    emulated_acceptance: str | None = Field(
        None,
        description="With an emulated device: per draft position, the share of rows that keep their j-th "
        "speculative draft (comma-separated; unset: the rates bench spec measured with ngram, "
        "docs/emulated-gpu.md).",
    )

    dtype: DType = Field("float32", description="Weight and activation type.")
    tensor_parallel: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks the S-part's weights are split over (Megatron's layout: docs/scaling.md): "
        "cuda:0..N-1 over NCCL, or CPU processes over gloo; one service to the scheduler. With an "
        "emulated device, the roofline of N GPUs and their all-reduces.",
    )
    shard_timeout: float = Field(60.0, gt=0, description="Seconds to wait for a shard's answer.")
    exchange_workers: int | None = Field(
        None,
        ge=0,
        description="Processes that own the shards' Attend streams (shared-memory handoff); 0: in "
        "process; unset: the cores beyond --threads, capped by the shard count.",
    )
    exchange_worker: Literal["auto", "native", "python"] = Field(
        "auto",
        description="Which exchange worker: native (C++, services/gpu_dense/exchange/native, built by make "
        "setup where gRPC C++ is installed), python, or auto: native when built, else python.",
    )
    host_shard: int | None = Field(
        None,
        ge=0,
        description="Index in --shards of a shard this process hosts: kv_attention served on that "
        "address's port, its Attend items attended here with no wire (the dense host's idle CPUs "
        "take a share of the attention). Off if unset.",
    )
    host_shard_kv_capacity: int = Field(1 << 30, ge=0, description="The hosted shard's KV pool in bytes.")
    host_shard_kv_dtype: Literal["float32", "float16", "bfloat16", "int8", "float8_e4m3"] = Field(
        "float32", description="The hosted shard's KV-cache element type."
    )
    grammar_wait: float = Field(
        1.0,
        gt=0,
        le=600,
        description="Seconds a step waits, at most, for the matchers of grammars it meets for the first "
        "time (built on their own threads from the plan's arrival); one not ready by then fails its "
        "sequence alone (INVALID_ARGUMENT). The gateway's --grammar-build-limit keeps builds under it.",
    )
    pipeline_mode: Literal["plan", "auto"] = Field(
        "plan",
        description="plan: two mini-batches whenever the step plan asks; auto: the plan allows, a "
        "measurement on live steps decides (fastdecode.dense.pipeline).",
    )
    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters (vLLM's --enable-lora): loaded at start (--lora-modules) or at "
        "run time (POST /v1/load_lora_adapter), picked per request by the `model` field (docs/lora.md).",
    )
    lora_modules: str = Field(
        "",
        description="NAME=PATH,NAME=PATH: PEFT adapter dirs loaded at start (needs --enable-lora).",
    )
    max_loras: int = Field(8, ge=1, le=1024, description="Most LoRA adapters loaded at once.")
    max_lora_rank: int = Field(64, ge=1, le=1024, description="Largest LoRA rank an adapter may have.")
    # Set by the supervisor: weight-loading progress for `fastdecode up`.
    progress_file: Path | None = Field(
        None, description="Weight-loading progress file.", json_schema_extra=_ENV_ONLY
    )


class SchedulerSettings(ServiceSettings):
    """scheduler: admission, placement, steps."""

    dense: str = Field(..., description="HOST:PORT of gpu_dense.")
    shards: str = Field(..., description="HOST:PORT,HOST:PORT of the shards, in gpu_dense's order.")
    admission: Literal["naive", "stabilized"] = Field("naive", description="Admission policy.")
    kv_lookahead: int = Field(
        64, ge=0, description="KV headroom: steps of growth admission leaves room for per running sequence."
    )
    prefix_sharing: Literal["on", "off"] = Field(
        "on",
        description="on: shards share the KV blocks of common prompt prefixes and prefill only what "
        "is new (docs/prefix-caching.md); off: every prompt is stored and prefilled whole.",
    )
    prefix_affinity: float = Field(
        0.5,
        ge=0,
        description="How much more loaded (relative share) than the best-balanced shard a shard "
        "holding a request's longest cached prefix may be and still get it; 0: balance only.",
    )
    kv_events: str | None = Field(
        None,
        description="Publish the prefix blocks the shards hold as vLLM's KV events (ZMQ PUB, msgpack) "
        "for KV-aware routers: tcp://*:PORT binds, tcp://HOST:PORT connects (docs/prefix-caching.md).",
    )
    kv_events_topic: str = Field("", description="ZMQ topic of the KV events (vLLM's default: none).")
    kv_events_seed: str = Field(
        "0", description="The KV events' block hash seed: the router's (vLLM's PYTHONHASHSEED)."
    )
    w_limit: float | None = Field(
        None, gt=0, description="W_lim in KV tokens for stabilized admission (derived if unset)."
    )
    micro_batch: int | None = Field(None, ge=1, description="Sequences per admitted micro-batch.")
    max_running: int = Field(256, ge=1, description="Most sequences decoding at once (the batch B).")
    max_waiting: int = Field(1024, ge=0, description="Waiting queue bound; full = RESOURCE_EXHAUSTED.")
    prefill_token_budget: int = Field(2048, ge=1, description="Prefill tokens per step (chunked prefill).")
    pipeline: bool = Field(True, description="Two-mini-batch pipeline.")
    plan_ahead: Literal["on", "off"] = Field(
        "on",
        description="on: plan step n+1 while gpu_dense runs step n, its decoding sequences fed the "
        "tokens gpu_dense sampled (the scheduler leaves the critical path); off: one step at a time.",
    )
    decode_steps: int | Literal["auto"] = Field(
        1,
        description=f"Decode steps (1..{MAX_DECODE_STEPS}) one plan runs each sampling sequence for at "
        "gpu_dense, each fed the token the one before sampled: the scheduler's work per plan is spread "
        "over them (vLLM's multi-step scheduling), its stop rules see them after the plan, new requests "
        "join between plans. auto: 8 while no request waits to be admitted or prefilled, 1 while one "
        "does (1 with --speculative).",
    )
    speculative: Literal["off", "ngram", "suffix"] = Field(
        "off",
        description="Speculative decoding without a draft model (docs/speculative.md): ngram drafts by "
        "prompt lookup over the request's tokens, suffix from suffix tries over them and its tenant's "
        "recent outputs; gpu_dense verifies a row's drafts in one step, the shards in one read of its "
        "KV. Greedy tokens are unchanged, sampled ones keep their distribution. Plans one step at a "
        "time (no plan-ahead); needs --decode-steps 1 or auto (then 1).",
    )
    num_speculative_tokens: int = Field(
        3, ge=1, le=MAX_DRAFTS, description="Most drafts a decode row carries (vLLM's meaning)."
    )
    speculative_k: Literal["auto", "fixed"] = Field(
        "auto",
        description="auto: offer each decode row the k in 0..--num-speculative-tokens drafts that "
        "yields the most tokens/s, from the step costs gpu_dense reports and the running acceptance, "
        "decided every few steps (a CPU S-part pays for every draft: k small or 0); fixed: always "
        "--num-speculative-tokens (docs/speculative.md).",
    )
    prompt_lookup_min: int = Field(1, ge=1, description="ngram: shortest n-gram looked up (vLLM's).")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: longest n-gram looked up (vLLM's).")
    health_interval: float = Field(1.0, gt=0, description="Seconds between shard health probes.")
    step_timeout: float = Field(120.0, gt=0, description="Seconds one step may take at gpu_dense.")
    startup_timeout: float = Field(300.0, gt=0, description="Seconds to wait for gpu_dense at start.")
    dense_down_timeout: float = Field(
        20.0,
        gt=0,
        description="Seconds requests wait for a lost gpu_dense (a restart is a few seconds of backoff "
        "plus its start); then they fail UNAVAILABLE and new ones are refused until it is back.",
    )
    shards_down_timeout: float = Field(
        20.0,
        gt=0,
        description="Seconds requests wait while no kv_attention shard serves (lost, removed); then they "
        "fail UNAVAILABLE naming the shards and new ones are refused until one is back.",
    )
    control_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds for a control call to a shard or gpu_dense (reserve, stats ...).",
    )
    probe_timeout: float = Field(2.0, gt=0, description="Seconds for one shard health or speed probe.")
    shard_restart_grace: float = Field(
        15.0,
        ge=0,
        description="Seconds the sequences of a lost shard whose KV pool outlives its process (--kv-dir) "
        "wait for it to come back and re-attach (they resume where it held them) before they are "
        "re-prefilled elsewhere; 0: never wait.",
    )
    drain_timeout: float = Field(
        600.0, gt=0, description="Seconds RemoveShard waits for a draining shard to empty."
    )
    migrate_timeout: float = Field(60.0, gt=0, description="Seconds one live KV migration may take.")
    max_concurrent_migrations: int = Field(
        2, ge=1, description="Live migrations under way at once (each pauses only its sequence)."
    )
    rebalance_factor: float = Field(
        1.1,
        ge=0,
        description="Migrate sequences off the busiest shard when its KV (per unit of measured speed) "
        "exceeds this times the mean; 0 turns rebalancing off.",
    )
    migrate_share: float = Field(
        0.3, gt=0, le=1, description="Most share of the wall time rebalancing moves may take."
    )

    @field_validator("decode_steps", mode="before")
    @classmethod
    def _decode_steps_parsed(cls, value: object) -> int | str:
        return parse_decode_steps(value)

    @model_validator(mode="after")
    def _speculation_fits(self) -> SchedulerSettings:
        if self.speculative != "off" and self.decode_steps not in (1, "auto"):
            raise ValueError("--speculative needs --decode-steps 1 or auto: both give a row several tokens")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("--prompt-lookup-min must not exceed --prompt-lookup-max")
        return self


class GatewaySettings(ServiceSettings):
    """gateway: the public API."""

    scheduler: str = Field(..., description="HOST:PORT of the scheduler.")
    model: Path = Field(
        ..., description="Checkpoint dir with tokenizer.json and config.json.", json_schema_extra=_DIR
    )
    auth_token: SecretStr | None = Field(
        None,
        description="Bearer token clients must send (off if unset). Prefer the env var (argv shows in ps).",
    )
    api_keys_file: Path | None = Field(
        None,
        description="File of API keys, one 'TENANT KEY' a line (# comments); reloaded on SIGHUP. "
        "Each key's requests count and cache as that tenant (--auth-token is tenant 'default').",
    )
    tenant_cache_isolation: bool = Field(
        True,
        description="Salt each tenant's prefix-cache blocks apart (cached_tokens never shows another "
        "tenant's prompt); off: tenants share blocks, as requests of one cache_salt do.",
    )
    chat_special_tokens: bool = Field(
        False,
        description="Let special-token strings typed in chat message content (<|im_start|>...) act as "
        "control tokens; off (default): they are tokenized as text, so no turn can be forged.",
    )
    max_concurrent_requests: int = Field(
        4096, ge=1, description="Generate calls in flight; more = RESOURCE_EXHAUSTED."
    )
    max_prompt_chars: int = Field(1 << 20, ge=1, description="Longest prompt text.")
    max_stop: int = Field(16, ge=0, description="Most stop strings per request.")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop string.")
    connect_timeout: float = Field(5.0, gt=0, description="Seconds to wait for an unconnected scheduler.")
    lora_load_timeout: float = Field(
        120.0, gt=0, description="Seconds POST /v1/load_lora_adapter may take (gpu_dense reads the adapter)."
    )
    readiness_interval: float = Field(
        1.0, gt=0, description="Seconds between looks at whether the fleet can generate (readiness)."
    )
    scheduler_recovery_timeout: float = Field(
        30.0,
        ge=0,
        description="Seconds a request waits for a lost scheduler to come back before it fails "
        "(it is then resubmitted from its tokens so far); 0: fail at once.",
    )
    max_message_bytes: int = Field(4 << 20, ge=1024, description="Largest request the public ports accept.")
    http_port: int | None = Field(
        None, ge=0, le=65535, description="OpenAI-compatible HTTP API port (off if unset; 0 picks one)."
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Model id of the HTTP API (default: the checkpoint dir name).",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto",
        description="How chat answers become tool_calls; auto: from the chat template and the model family.",
    )
    reasoning_parser: Literal["auto", "qwen3", "deepseek_r1", "none"] = Field(
        "auto",
        description="How chat answers split into reasoning_content (<think>...</think>) and content; "
        "auto: qwen3 for the Qwen3 family, deepseek_r1 for DeepSeek-R1's template, else none.",
    )
    responses_store: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Responses kept per tenant for /v1/responses' store: true (GET, cancel, delete, "
        "previous_response_id); 0 (default): off, store is taken as false.",
    )
    responses_store_ttl: float = Field(
        3600.0, gt=0, description="Seconds a stored response is kept (with --responses-store)."
    )
    grammar_workers: int = Field(
        2,
        ge=1,
        le=64,
        description="Worker processes compiling structured outputs (a crash there costs one request).",
    )
    grammar_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a structured output may take to compile; longer = 400, the worker is replaced.",
    )
    grammar_memory_mb: int = Field(
        2048, ge=0, description="Address-space limit of a grammar worker, MiB (0: none); past it = 400."
    )
    grammar_build_limit: float = Field(
        1.0,
        ge=0,
        le=600,
        description="Seconds a structured output may take to compile and build its matcher with the "
        "model's tokenizer (gpu_dense builds it again and waits for it no longer than its "
        "--grammar-wait); longer = 400. 0: no limit.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        le=64,
        description="Tokens per stream message after a request's first (which goes at once): more cuts "
        "the gateway's CPU per token at large batches, at the cost of smoothness. Whatever waited while "
        "a message was written goes in the next one, whatever this says.",
    )


class LocalSettings(BaseSettings):
    """Settings of the local tools (`fastdecode run`, `up`, `demo`), not of a service."""

    model_config = SettingsConfigDict(env_prefix="FASTDECODE_", extra="ignore")

    models_dir: Path = Field(Path(".models"), description="Where the embedded default model is made.")
    debug: bool = Field(False, description="CLI errors keep their traceback (FASTDECODE_DEBUG=1).")


def parse_decode_steps(value: object) -> int | Literal["auto"]:
    """--decode-steps as a flag, an environment variable or a value in code gives it: auto, or a
    whole number in [1, MAX_DECODE_STEPS]; anything else is one ValueError naming the flag."""
    text = value.strip() if isinstance(value, str) else value
    if text == "auto":
        return "auto"
    if isinstance(text, str) and text.isdecimal():
        text = int(text)
    if type(text) is int and 1 <= text <= MAX_DECODE_STEPS:
        return text
    raise ValueError(
        f"--decode-steps must be auto or a whole number in [1, {MAX_DECODE_STEPS}], got {value!r}"
    )


def split_addresses(value: str | list[str]) -> list[str]:
    if isinstance(value, list):
        return [v.strip() for v in value if v.strip()]
    return [v.strip() for v in value.split(",") if v.strip()]
