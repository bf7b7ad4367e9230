"""Grammars that used to kill the gateway (llguidance overflowed the event loop's stack: SIGSEGV, and
every other stream failed) now get a 400 through every door: HTTP response_format (a 1,000-long
`$ref` chain, 75 KB), HTTP guided_grammar (3,000 chained Lark rules, 78 KB) and the gRPC
`structured` field; while streams run, which complete token-equal, the gateway keeps its pid, and
twenty in a row leave the fleet serving, structured outputs included."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fastdecode.benchmarks.chaos_attacks import lark_chain, ref_chain
from fastdecode.benchmarks.common import proc_status_bytes  # the crash inputs bench chaos sends
from fastdecode.client import Client, InvalidRequestError
from fastdecode.tools.fleet import Fleet
from tests.support import pid_alive

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[0, 17, 300, 45], [0, 99, 5, 1200, 77], [0, 600], [0, 7, 250, 1800]]


@pytest.fixture(scope="module")
def fleet(model_factory: Callable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(
        model=model_factory("llama"),
        shards=2,
        device="cpu",
        kv_capacity=64 << 20,
        http_port=0,
        workdir=tmp_path_factory.mktemp("grammar-crash"),
    )
    f.start()
    yield f
    f.stop()


def _post(fleet: Fleet, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"http://{fleet.gateway.http}{path}",  # type: ignore[union-attr]
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _crashers(fleet: Fleet) -> list[Callable[[], int]]:
    """Each sends one crash input and returns its HTTP status (a gRPC refusal counts as 400)."""
    schema = ref_chain()
    assert 70_000 < len(json.dumps(schema)) < 256 * 1024
    assert 70_000 < len(lark_chain()) < 256 * 1024
    chat = {"model": fleet.model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    rf = {"type": "json_schema", "json_schema": {"name": "chain", "schema": schema}}

    def grpc_call(structured: dict[str, Any]) -> int:
        with Client(fleet.gateway.address, timeout=60) as c:  # type: ignore[union-attr]
            try:
                c.generate(token_ids=[0, 5], max_tokens=4, structured=structured)
            except InvalidRequestError:
                return 400
        return 200

    return [
        lambda: _post(fleet, "/v1/chat/completions", {**chat, "response_format": rf})[0],
        lambda: _post(
            fleet,
            "/v1/completions",
            {"model": fleet.model.name, "prompt": "a", "guided_grammar": lark_chain()},
        )[0],
        lambda: grpc_call({"json_schema": schema}),
        lambda: grpc_call({"grammar": lark_chain()}),
    ]


def test_crash_inputs_are_400s_and_the_fleet_serves_on(fleet: Fleet) -> None:
    assert fleet.gateway is not None
    pid = fleet.gateway.pid
    with Client(fleet.gateway.address, timeout=120) as client:
        expected = [client.generate(token_ids=p, max_tokens=40).token_ids for p in PROMPTS]
        crashers = _crashers(fleet)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            # streams in flight while every crash input arrives
            streams = [
                pool.submit(
                    lambda p=p: [t for ch in client.stream(token_ids=p, max_tokens=40) for t in ch.token_ids]
                )
                for p in PROMPTS
            ]
            seconds = []
            for send in crashers:
                t = time.perf_counter()
                assert send() == 400
                seconds.append(time.perf_counter() - t)
            got = [s.result(timeout=120) for s in streams]
        assert got == expected
        assert max(seconds) < 5.0, seconds  # refused by the limits, before any compile
        for i in range(20):
            assert crashers[i % len(crashers)]() == 400
        assert fleet.gateway.pid == pid and pid_alive(pid) and fleet.gateway.proc.poll() is None
        # still serving: plain and structured generations
        assert client.generate(token_ids=PROMPTS[0], max_tokens=40).token_ids == expected[0]
        out = client.generate(token_ids=[0, 5], max_tokens=8, structured={"choice": ["yes", "no"]})
        assert out.text in ("yes", "no")


def test_a_grpc_refusal_names_the_limit(fleet: Fleet) -> None:
    assert fleet.gateway is not None
    with Client(fleet.gateway.address, timeout=60) as c, pytest.raises(InvalidRequestError) as e:
        c.generate(token_ids=[0, 5], max_tokens=4, structured={"grammar": lark_chain()})
    assert "3002 rules" in str(e.value) and "limit is 1000" in str(e.value)
    status, body = _post(
        fleet,
        "/v1/chat/completions",
        {
            "model": fleet.model.name,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": ref_chain()}},
        },
    )
    assert status == 400 and "$ref" in body["error"]["message"], body


@pytest.mark.parametrize("kind", ["json_schema", "grammar"])
def test_the_inputs_crash_llguidance_on_a_main_thread(kind: str) -> None:
    """What the gateway used to do with them, in a process of its own: they are real crashers."""
    build = (
        "g = lg.LLMatcher.grammar_from_json_schema(ref_chain())"
        if kind == "json_schema"
        else "g = lg.LLMatcher.grammar_from_lark(lark_chain())"
    )
    code = (
        "import llguidance as lg\n"
        "from tests.e2e.test_grammar_crash import lark_chain, ref_chain\n"
        f"{build}\nlg.LLMatcher.validate_grammar(g)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGSEGV, done.stderr[-500:]


SLOW_BUILD = {"type": "integer", "multipleOf": 123456789}  # 44 bytes; its matcher builds for minutes


def test_a_slow_matcher_build_is_a_400_through_every_door_and_stalls_no_stream(fleet: Fleet) -> None:
    """The schema compiles in milliseconds without a tokenizer, but its matcher (the lexer over the
    tokenizer) builds for minutes: the gateway's worker builds it under the build limit and answers
    400, so gpu_dense never builds it inside a step; the streams around it go on."""
    assert fleet.gateway is not None
    dense = next(s for s in fleet.services if s.name == "gpu_dense")
    chat = {"model": fleet.model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"n": SLOW_BUILD}}},
    }
    doors: list[Callable[[], int]] = [
        lambda: _post(
            fleet,
            "/v1/chat/completions",
            {
                **chat,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SLOW_BUILD},
                },
            },
        )[0],
        lambda: _post(
            fleet, "/v1/completions", {"model": fleet.model.name, "prompt": "a", "guided_json": SLOW_BUILD}
        )[0],
        lambda: _post(
            fleet,
            "/v1/chat/completions",
            {**chat, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        )[0],
    ]

    def grpc_door() -> int:
        with Client(fleet.gateway.address, timeout=60) as c:  # type: ignore[union-attr]
            try:
                c.generate(token_ids=[0, 5], max_tokens=4, structured={"json_schema": json.dumps(SLOW_BUILD)})
            except InvalidRequestError as e:
                assert "build its matcher" in str(e)
                return 400
        return 200

    doors.append(grpc_door)
    with Client(fleet.gateway.address, timeout=120) as client:
        expected = [client.generate(token_ids=p, max_tokens=40).token_ids for p in PROMPTS]
        rss = proc_status_bytes(dense.pid) or 0
        gaps: list[float] = []

        def stream(p: list[int]) -> list[int]:
            out, last = [], time.perf_counter()
            for ch in client.stream(token_ids=p, max_tokens=40):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                out.extend(ch.token_ids)
            return out

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            streams = [pool.submit(stream, p) for p in PROMPTS]
            seconds = []
            for send in doors:
                t = time.perf_counter()
                assert send() == 400
                seconds.append(time.perf_counter() - t)
            got = [s.result(timeout=120) for s in streams]
        assert got == expected
        assert max(gaps) < 10.0, max(gaps)  # a bound far from any host's noise: the build took minutes
        assert max(seconds) < 30.0, seconds  # the build limit (1 s) and a worker's start, on a shared host
        # (the build alone would take minutes, and gpu_dense's step would have waited on it)
        assert (proc_status_bytes(dense.pid) or 0) - rss < 200 << 20
        assert dense.proc.poll() is None
