"""LoRA adapters served by a real fleet (SmolLM2, fp32): one adapter loaded at start (--lora-modules),
one loaded and unloaded at run time through vLLM's HTTP endpoints, requests picking them by the
OpenAI `model` field with the official SDK; the base and both adapters give transformers + PEFT's
greedy tokens each, a prompt's KV cached under one of them is never reused under another, an
adapter of the wrong shape is refused at load in one line (400) and the fleet serves on, and a
request for an adapter not loaded is a 404."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from fastdecode.client import Client
from fastdecode.tools.fleet import UpProcess
from tests.support import FleetFactory
from tests.support.lora import TARGETS, adapter_dir, make_adapters, peft_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NEW = 12
# 40 tokens: two full KV blocks (16 tokens each) a later request of the same prompt can find cached
PROMPT = [1, *range(1000, 1039)]


@pytest.fixture(scope="module")
def adapters(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("adapters")
    pm = make_adapters(base, out, TARGETS)
    return pm, out, AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def lora_fleet(smollm2: Path, adapters: tuple, fleet_factory: FleetFactory) -> Iterator[UpProcess]:
    _, out, _ = adapters
    modules = f"sql={adapter_dir(out, 'sql')}"
    yield fleet_factory(
        smollm2, "--enable-lora", "--lora-modules", modules, "--max-loras", "3", http=True, private=True
    )


def _client(fleet: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{fleet.http}/v1", api_key="x", timeout=300, max_retries=0)


def _load(oa: openai.OpenAI, name: str, path: Path) -> str:
    return oa.post("/load_lora_adapter", body={"lora_name": name, "lora_path": str(path)}, cast_to=str)


def _unload(oa: openai.OpenAI, name: str) -> str:
    return oa.post("/unload_lora_adapter", body={"lora_name": name}, cast_to=str)


def _complete(oa: openai.OpenAI, model: str) -> tuple[str, int]:
    r = oa.completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    details = r.usage.prompt_tokens_details if r.usage is not None else None
    return r.choices[0].text, (details.cached_tokens or 0) if details is not None else 0


def test_adapters_load_serve_and_unload_as_peft_computes(
    lora_fleet: UpProcess, adapters: tuple, model_factory: object, tmp_path: Path
) -> None:
    pm, out, tok = adapters
    with _client(lora_fleet) as oa:
        base = oa.models.list().data[0].id
        cards = {m.id: m for m in oa.models.list().data}
        assert set(cards) == {base, "sql"} and cards["sql"].parent == base  # type: ignore[attr-defined]

        r = _load(oa, "poet", adapter_dir(out, "poet"))
        assert r == "Success: LoRA adapter 'poet' added successfully.", r
        assert "poet" in {m.id for m in oa.models.list().data}

        want = {name: tok.decode(peft_greedy(pm, name, PROMPT, NEW)) for name in ("sql", "poet")}
        want[base] = tok.decode(peft_greedy(pm, None, PROMPT, NEW))
        assert len(set(want.values())) == 3  # each adapter changes the tokens
        # the base first, twice (the second finds the prompt's blocks cached), then the three at once:
        # an adapter's request never reads KV computed for the base or another adapter
        assert _complete(oa, base)[0] == want[base]
        assert _complete(oa, base)[1] >= 32
        with ThreadPoolExecutor(3) as pool:
            got = dict(zip(want, pool.map(lambda m: _complete(oa, m), want), strict=True))
        assert {m: text for m, (text, _) in got.items()} == want
        assert got["sql"][1] == 0 and got["poet"][1] == 0
        text, cached = _complete(oa, "sql")  # a second time: the adapter's own blocks
        assert text == want["sql"] and cached >= 32
        with Client(lora_fleet.target) as client:  # the gRPC API names it too
            done = client.generate(token_ids=PROMPT, max_tokens=NEW, ignore_eos=True, lora="poet")
        assert done.token_ids == peft_greedy(pm, "poet", PROMPT, NEW)

        chat = oa.chat.completions.create(
            model="poet", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert chat.model == "poet" and chat.choices[0].message.content

        # refusals, each one clear line, none of them hurting the fleet
        from transformers import AutoModelForCausalLM

        tiny = AutoModelForCausalLM.from_pretrained(model_factory("llama"), dtype=torch.float32)  # type: ignore[operator]
        make_adapters(tiny, tmp_path, {"tiny": ["q_proj"]})
        with pytest.raises(openai.BadRequestError) as bad:
            _load(oa, "tiny", adapter_dir(tmp_path, "tiny"))
        message = bad.value.body["message"]  # type: ignore[index]
        assert "this model needs A" in message and "\n" not in message, message
        _load(oa, "third", adapter_dir(out, "sql"))  # the same weights under another name: a third
        with pytest.raises(openai.BadRequestError) as bad:
            _load(oa, "fourth", adapter_dir(out, "sql"))
        assert "--max-loras" in bad.value.body["message"]  # type: ignore[index]
        assert _unload(oa, "third") == "Success: LoRA adapter 'third' removed successfully."
        with pytest.raises(openai.NotFoundError) as e:
            oa.completions.create(model="nope", prompt="Hi", max_tokens=2)
        assert e.value.code == "model_not_found"

        _unload(oa, "poet")
        assert {m.id for m in oa.models.list().data} == {base, "sql"}
        with pytest.raises(openai.NotFoundError):
            oa.completions.create(model="poet", prompt="Hi", max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            _unload(oa, "poet")
        assert _complete(oa, "sql")[0] == want["sql"]  # the fleet serves on
        assert _complete(oa, base)[0] == want[base]
