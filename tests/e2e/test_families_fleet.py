"""Every family through a 2-shard fleet (`fastdecode up`, fp32 KV): greedy tokens equal
transformers' `generate` on tiny checkpoints transformers saved, on prompts longer than the
window (8 tokens): the shards apply each layer's window and the soft-cap."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fastdecode.client import Client
from tests.support import PROMPTS, start_up
from tests.support.families import FAMILIES, WINDOW

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore")]

NEW_TOKENS = 12


@pytest.mark.parametrize("family", FAMILIES)
def test_fleet_equals_transformers(
    family: str, family_factory: Callable, hf_greedy: Callable, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = family_factory(family)
    assert max(len(p) for p in PROMPTS) > WINDOW
    fleet = start_up(path, tmp_path_factory.mktemp(f"fleet-{family}"), timeout=300)
    try:
        with Client(fleet.target) as client:
            for prompt in PROMPTS:
                got = client.generate(token_ids=prompt, max_tokens=NEW_TOKENS, timeout=120)
                assert got.token_ids == hf_greedy(path, tuple(prompt), NEW_TOKENS), (family, len(prompt))
    finally:
        fleet.stop()
