"""Every family through a 2-shard fleet (`fastdecode up`, fp32 KV): greedy tokens equal
transformers' `generate` on tiny checkpoints transformers saved, on prompts longer than the
window (8 tokens). Families with windows or a soft-cap need shards that apply them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from fastdecode.client import Client
from fastdecode.model import ModelConfig
from fastdecode.runtime.geometry import KVGeometry
from tests.support import PROMPTS, start_up
from tests.support.families import FAMILIES, WINDOW

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore")]

NEW_TOKENS = 12
# The shards learn a model's windows and soft-cap through KVGeometry; without those fields they
# attend every cached token, uncapped.
SHARDS_APPLY_WINDOWS = "layer_windows" in {f.name for f in dataclasses.fields(KVGeometry)}


@pytest.mark.parametrize("family", FAMILIES)
def test_fleet_equals_transformers(
    family: str, family_factory: Callable, hf_greedy: Callable, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = family_factory(family)
    config = ModelConfig.from_pretrained(path)
    if (any(config.layer_windows) or config.attn_logit_softcap) and not SHARDS_APPLY_WINDOWS:
        pytest.skip(f"{family}: the shards do not apply sliding windows and soft-caps yet")
    assert max(len(p) for p in PROMPTS) > WINDOW
    fleet = start_up(path, tmp_path_factory.mktemp(f"fleet-{family}"), timeout=300)
    try:
        with Client(fleet.target) as client:
            for prompt in PROMPTS:
                got = client.generate(token_ids=prompt, max_tokens=NEW_TOKENS, timeout=120)
                assert got.token_ids == hf_greedy(path, tuple(prompt), NEW_TOKENS), (family, len(prompt))
    finally:
        fleet.stop()
