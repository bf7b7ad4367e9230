"""`bench chaos` probes for structured outputs and keys that used to stall or open the fleet:

- slow_build: the 44-byte `{"type": "integer", "multipleOf": 123456789}`, whose matcher builds for
  minutes, sent while the load runs: each must be a 400 within the grammar limits, the load's
  streams must not pause for it, and gpu_dense's RSS must stay flat.
- big_specs: specs from ~60 KB up to the 256 KiB limit (an enum of 20,000 strings, a 20,000-word
  regex, 2,000 patterned properties, a 999-rule Lark grammar): answered or refused, never INTERNAL.
- heavy_grammar: attackers loop on a legal but heavy schema (300 `patternProperties`) while a
  victim's plain and small structured requests are timed; against the victim's unloaded times.
- empty_keys: a gateway started with a comments-only keys file admits nobody, survives SIGHUP, then
  admits the key it gained, and keeps it when the file is emptied again.

Each reports probe_summary's figures where a load ran. gRPC is imported inside the functions.
"""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # they speak gRPC: imported where a probe runs, so the inputs import without it
    from fastdecode.benchmarks.chaos_probes import _Outcome
    from fastdecode.tools.fleet import UpProcess

SLOW_BUILD = {"type": "integer", "multipleOf": 123456789}


def heavy_schema(n: int = 300) -> dict[str, Any]:
    """A legal schema of n patterned properties (~23 KB at 300): seconds to build its matcher."""
    return {
        "type": "object",
        "patternProperties": {
            f"^k{i}_[a-z]{{2,8}}[0-9]*$": {"type": "string", "pattern": f"^v{i}[a-z]+$"} for i in range(n)
        },
    }


def big_specs() -> dict[str, dict[str, str]]:
    """Specs of ~60 KB up to the 256 KiB limit, each of a different kind (gRPC `structured`)."""
    words = [f"w{i:05d}" for i in range(20_000)]
    lark = "\n".join(["start: r0", *(f'r{i}: "a{i}" r{i + 1} | "b"' for i in range(997)), 'r997: "c"'])
    return {
        "enum_20000": {"json_schema": json.dumps({"enum": words})},
        "regex_20000_words": {"regex": "(" + "|".join(words) + ")"},
        "pattern_properties_2000": {"json_schema": json.dumps(heavy_schema(2000))},
        "lark_999_rules": {"grammar": lark},
    }


def _rss_mib(pid: int) -> float:
    from fastdecode.benchmarks.common import proc_status_bytes

    rss = proc_status_bytes(pid)
    return float("nan") if rss is None else rss / (1 << 20)


def _send(target: str, structured: dict[str, str], max_tokens: int = 4) -> tuple[str, float]:
    """(status name, seconds) of one generation with `structured`."""
    from fastdecode.client import Client, FastDecodeError

    t0 = time.monotonic()
    with Client(target, timeout=120, max_retries=0) as client:
        try:
            client.generate(token_ids=[0, 5], max_tokens=max_tokens, structured=structured)
            code = "OK"
        except FastDecodeError as e:
            code = e.code.name
    return code, time.monotonic() - t0


def slow_build_probe(
    up: UpProcess,
    load: Callable[[UpProcess], dict[int, _Outcome]],
    reference: dict[int, _Outcome],
    gen_len: int,
    sends: int = 4,
) -> dict[str, Any]:
    from fastdecode.benchmarks.chaos_attacks import _crashed, _equal, _processes  # they import gRPC
    from fastdecode.benchmarks.chaos_probes import probe_summary

    before = _processes(up.reload())
    dense_pid = int(up.state["gpu_dense"]["pid"])
    rss_before = _rss_mib(dense_pid)
    sent: list[tuple[str, float]] = []

    def attack() -> None:
        time.sleep(0.3)  # mid-decode
        for i in range(sends):  # a distinct spec each time: none is answered from memory
            spec = {**SLOW_BUILD, "multipleOf": SLOW_BUILD["multipleOf"] + i}
            sent.append(_send(up.target, {"json_schema": json.dumps(spec)}))

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    out = load(up)
    attacker.join(sends * 120 + 30)
    seconds = [s for _, s in sent]
    return probe_summary(
        "slow_build",
        len(reference),
        out,
        gen_len,
        crashed=_crashed(before, up),
        slow_inputs=len(sent),
        slow_refused_400=sum(c == "INVALID_ARGUMENT" for c, _ in sent),
        slow_max_s=max(seconds, default=float("nan")),
        longest_pause_s=max((o.longest_pause_s for o in out.values()), default=float("nan")),
        reference_longest_pause_s=max((o.longest_pause_s for o in reference.values()), default=float("nan")),
        gpu_dense_rss_growth_mib=_rss_mib(dense_pid) - rss_before,
        tokens_equal_fault_free=_equal(out, reference),
    )


def big_specs_probe(up: UpProcess) -> dict[str, Any]:
    from fastdecode.benchmarks.chaos_attacks import _crashed, _processes  # they import gRPC

    before = _processes(up.reload())
    answers = {name: _send(up.target, spec) for name, spec in big_specs().items()}
    return {
        "name": "big_specs",
        "crashed": _crashed(before, up),
        "codes": {name: code for name, (code, _) in answers.items()},
        "internal": sum(code in ("INTERNAL", "UNKNOWN") for code, _ in answers.values()),
        "max_answer_s": max(s for _, s in answers.values()),
    }


def heavy_grammar_probe(
    up: UpProcess, attackers: int = 4, seconds: float = 10.0, rounds: int = 5
) -> dict[str, Any]:
    """The victim's median latency, plain and with a small schema, unloaded and under attackers
    looping on heavy_schema() (each its own spec variant per loop: nothing is answered from memory
    but the first of each)."""
    from fastdecode.benchmarks.chaos_attacks import _crashed, _processes  # they import gRPC

    before = _processes(up.reload())
    small = {"json_schema": json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}})}

    def victim() -> tuple[float, float]:
        from fastdecode.client import Client

        plain, structured = [], []
        with Client(up.target, timeout=120) as client:
            for _ in range(rounds):
                t0 = time.monotonic()
                client.generate(token_ids=[0, 5, 9], max_tokens=8)
                plain.append(time.monotonic() - t0)
                structured.append(_send(up.target, small, 8)[1])
        return statistics.median(plain), statistics.median(structured)

    plain0, struct0 = victim()
    stop = threading.Event()
    codes: list[str] = []

    def attack(k: int) -> None:
        heavy = {"json_schema": json.dumps(heavy_schema())}
        while not stop.is_set():
            codes.append(_send(up.target, heavy)[0])

    threads = [threading.Thread(target=attack, args=(k,), daemon=True) for k in range(attackers)]
    for t in threads:
        t.start()
    time.sleep(min(2.0, seconds / 4))  # the attack under way
    plain1, struct1 = victim()
    stop.set()
    for t in threads:
        t.join(150)
    return {
        "name": "heavy_grammar",
        "crashed": _crashed(before, up),
        "attacker_requests": len(codes),
        "attacker_codes": {c: codes.count(c) for c in set(codes)},
        "victim_plain_unloaded_s": plain0,
        "victim_plain_loaded_s": plain1,
        "victim_plain_ratio": plain1 / plain0,
        "victim_structured_unloaded_s": struct0,
        "victim_structured_loaded_s": struct1,
        "victim_structured_ratio": struct1 / struct0,
    }


def empty_keys_probe(model: Path, workdir: Path) -> dict[str, Any]:
    """A lone gateway (no scheduler: Tokenize needs none) with a comments-only keys file."""
    import grpc

    from fastdecode.tools.fleet import free_port, start_service, stop_processes
    from fastdecode.v1 import gateway_pb2 as pb

    keys = workdir / "api-keys"
    keys.write_text("# tenant key\n\n")
    proc = start_service(
        "gateway-keys",
        [
            "gateway",
            "--scheduler",
            f"127.0.0.1:{free_port()}",
            "--model",
            str(model),
            "--api-keys-file",
            str(keys),
        ],
        workdir,
        env={"FASTDECODE_CONNECT_TIMEOUT": "0.2"},
        timeout=60,
    )
    key = (("authorization", "Bearer probe-key-0001"),)

    def code(ch: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> str:
        tokenize = ch.unary_unary(
            "/fastdecode.v1.Gateway/Tokenize",
            request_serializer=pb.TokenizeRequest.SerializeToString,
            response_deserializer=pb.TokenizeResponse.FromString,
        )
        try:
            tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata, timeout=10)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name

    report: dict[str, Any] = {"name": "empty_keys"}
    try:
        with grpc.insecure_channel(proc.address) as ch:
            report["at_start"] = [
                code(ch, m) for m in [(), (("authorization", "Bearer any-thing-at-all"),), key]
            ]
            keys.write_text("probe probe-key-0001\n")
            proc.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while code(ch, key) != "OK" and time.monotonic() < deadline:
                time.sleep(0.2)
            report["after_keys_added"] = code(ch, key)
            keys.write_text("")  # emptied: the key stays, auth stays on
            proc.proc.send_signal(signal.SIGHUP)
            time.sleep(1.0)
            report["after_emptied"] = [code(ch, key), code(ch, ())]
        report["alive"] = proc.proc.poll() is None
    finally:
        stop_processes([proc], grace=10)
    report["opened"] = int("OK" in report["at_start"] or report["after_emptied"][1] == "OK")
    report["warnings"] = proc.log_path.read_text().count("holds no keys")
    report["log"] = str(proc.log_path)
    return report
