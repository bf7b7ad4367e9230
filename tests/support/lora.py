"""LoRA adapters made with PEFT for the tests (the oracle saves them and generates with them)."""

from __future__ import annotations

from pathlib import Path

import torch

# Two adapters over different projections: together they touch every one the fleet applies.
TARGETS = {
    "sql": ["q_proj", "v_proj", "o_proj", "up_proj"],
    "poet": ["k_proj", "gate_proj", "down_proj", "q_proj"],
}


def make_adapters(model: torch.nn.Module, out: Path, targets: dict[str, list[str]], seed: int = 0) -> object:
    """PEFT adapters of `targets` (r 8, alpha 16) with random A and B (B small, so the tokens change
    but stay sane), saved with save_pretrained under `out` (adapter_dir finds each); returns the
    PeftModel holding them all (it wraps `model` in place)."""
    import peft

    torch.manual_seed(seed)
    pm = None
    for name, mods in targets.items():
        cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=mods, init_lora_weights=False)
        if pm is None:
            pm = peft.get_peft_model(model, cfg, adapter_name=name)
        else:
            pm.add_adapter(name, cfg)
    assert pm is not None
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_B." in n:
                p.normal_(0.0, 0.02)
            elif ".lora_A." in n:
                p.normal_(0.0, 0.05)
    for name in targets:
        pm.save_pretrained(str(out), selected_adapters=[name])
    return pm


def adapter_dir(out: Path, name: str) -> Path:
    """Where save_pretrained put adapter `name` (a named adapter goes into its own folder)."""
    return out / name if (out / name / "adapter_config.json").is_file() else out


def peft_greedy(pm: object, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    """PEFT's greedy tokens after `prompt` with `adapter` (None: the base model, adapters off)."""
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if adapter is None:
            with pm.disable_adapter():  # type: ignore[attr-defined]
                out = pm.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=mask)  # type: ignore[attr-defined]
        else:
            pm.set_adapter(adapter)  # type: ignore[attr-defined]
            out = pm.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=mask)  # type: ignore[attr-defined]
    return out[0, len(prompt) :].tolist()
