"""Tenants: API keys from a file (each with its tenant, reloaded on SIGHUP), prefix-cache blocks
salted apart per tenant so `cached_tokens` never shows another tenant's prompt (the same tenant,
or the same `cache_salt`, still shares), per-tenant request metrics, and the keys in the gateway's
environment only."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fastdecode.client import AuthenticationError, Client
from fastdecode.tools.fleet import Fleet

KEYS = {"alice": "alice-key-0001", "bob": "bob-key-00002"}
TOKEN = "the-default-token"
PROMPT = [0, *range(300, 364)]  # 65 tokens: four full 16-token blocks to share


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in KEYS.items()))
    return path


@pytest.fixture(scope="module")
def fleet(
    model_factory: Callable, tmp_path_factory: pytest.TempPathFactory, keys_file: Path
) -> Iterator[Fleet]:
    f = Fleet(
        model=model_factory("llama"),
        shards=1,  # one shard: whether blocks are shared is not a matter of placement
        device="cpu",
        kv_capacity=64 << 20,
        http_port=0,
        workdir=tmp_path_factory.mktemp("tenants"),
        gateway_args=["--api-keys-file", str(keys_file)],
        env={"FASTDECODE_AUTH_TOKEN": TOKEN},  # given to the whole fleet: only the gateway may keep it
    )
    f.start()
    yield f
    f.stop()


def _complete(fleet: Fleet, key: str, prompt: list[int], **extra: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": fleet.model.name, "prompt": prompt, "max_tokens": 2, **extra}
    req = urllib.request.Request(
        f"http://{fleet.gateway.http}/v1/completions",  # type: ignore[union-attr]
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _cached(fleet: Fleet, key: str, prompt: list[int], **extra: Any) -> int:
    status, body = _complete(fleet, key, prompt, **extra)
    assert status == 200, body
    return int((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def test_tenants_never_share_blocks_but_a_tenant_and_a_salt_do(fleet: Fleet) -> None:
    p = [*PROMPT]
    assert _cached(fleet, KEYS["alice"], p) == 0
    assert _cached(fleet, KEYS["bob"], p) == 0  # alice's blocks are not bob's
    assert _cached(fleet, KEYS["alice"], p) == 64  # alice's own, again
    assert _cached(fleet, KEYS["bob"], p) == 64  # bob computed his own the first time
    # a salt is a namespace of its own, within the tenant: new at first, then shared
    assert _cached(fleet, KEYS["alice"], p, cache_salt="s1") == 0
    assert _cached(fleet, KEYS["alice"], p, cache_salt="s1") == 64
    assert _cached(fleet, KEYS["bob"], p, cache_salt="s1") == 0  # the same salt, another tenant
    # the guessing attack: bob probes alice's prompt block by block and learns nothing
    secret = [0, *range(500, 564)]
    assert _cached(fleet, KEYS["alice"], secret) == 0
    for blocks in (1, 2, 3, 4):
        # a right guess of block k finds only the k - 1 blocks bob's own last probe computed (with
        # one shared cache it found alice's k: 16 more than a wrong guess)
        right = _cached(fleet, KEYS["bob"], [*secret[: 16 * blocks], 7])
        wrong = _cached(fleet, KEYS["bob"], [*secret[: 16 * (blocks - 1)], *[9] * 16, 7])
        assert right == wrong == 16 * (blocks - 1), (blocks, right, wrong)


def test_grpc_keys_name_their_tenant_and_the_default_token_works(fleet: Fleet) -> None:
    assert fleet.gateway
    with Client(fleet.gateway.address, token=KEYS["alice"], timeout=60) as c:
        assert c.generate(token_ids=[0, 5, 6], max_tokens=2).token_ids
        # the gRPC cache_salt: alice's salted blocks are found by alice's same salt over HTTP
        prompt = [0, *range(700, 764)]
        assert c.generate(token_ids=prompt, max_tokens=2, cache_salt="g1").usage.cached_tokens == 0
        assert c.generate(token_ids=prompt, max_tokens=2, cache_salt="g1").usage.cached_tokens == 64
        assert _cached(fleet, KEYS["alice"], prompt, cache_salt="g1") == 64
        assert _cached(fleet, KEYS["alice"], prompt) == 0
    with Client(fleet.gateway.address, token=TOKEN, timeout=60) as c:
        assert c.generate(token_ids=[0, 5, 6], max_tokens=2).token_ids
    with (
        Client(fleet.gateway.address, token="nobody-key-123", timeout=60) as c,
        pytest.raises(AuthenticationError),
    ):
        c.generate(token_ids=[0, 5, 6], max_tokens=2)
    assert _complete(fleet, "nobody-key-123", [0, 5])[0] == 401


def test_per_tenant_metrics(fleet: Fleet) -> None:
    assert fleet.gateway and fleet.gateway.metrics
    _cached(fleet, KEYS["bob"], [0, 9, 9])
    with urllib.request.urlopen(f"http://{fleet.gateway.metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    ok = {
        t: float(line.split()[-1])
        for line in text.splitlines()
        for t in ("alice", "bob", "default")
        if line.startswith(f'fastdecode_gateway_tenant_requests_total{{status="OK",tenant="{t}"}}')
    }
    assert ok.get("bob", 0) >= 1 and "alice" in ok and "default" in ok, ok
    assert 'fastdecode_gateway_tenant_tokens_total{kind="generated",tenant="bob"}' in text


def test_the_keys_live_in_the_gateway_alone(fleet: Fleet) -> None:
    for svc in fleet.services:
        env = Path(f"/proc/{svc.pid}/environ").read_bytes().split(b"\0")
        has = any(e.startswith(b"FASTDECODE_AUTH_TOKEN=") for e in env)
        assert has == (svc.name == "gateway"), svc.name


def test_sighup_reloads_the_keys(fleet: Fleet, keys_file: Path) -> None:
    assert fleet.gateway
    old = keys_file.read_text()
    try:
        keys_file.write_text(old + "carol carol-key-003\n")
        os.kill(fleet.gateway.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while _complete(fleet, "carol-key-003", [0, 5])[0] != 200:
            assert time.monotonic() < deadline, "carol's key never worked"
            time.sleep(0.2)
        keys_file.write_text("this is not a keys file\n")  # a bad file keeps the keys there were
        os.kill(fleet.gateway.pid, signal.SIGHUP)
        time.sleep(1.0)
        assert _complete(fleet, "carol-key-003", [0, 5])[0] == 200
        assert fleet.gateway.proc.poll() is None
    finally:
        keys_file.write_text(old)
        os.kill(fleet.gateway.pid, signal.SIGHUP)
