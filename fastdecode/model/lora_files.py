"""A PEFT LoRA adapter directory read and checked against the model it is to run on: anything it
cannot apply exactly (a module the model lacks, a shape of another model, a rank past the limit, a
PEFT feature beyond plain LoRA) is refused as InvalidInput, in one line."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from fastdecode.model.dense import DenseModel
from fastdecode.model.lora import LoraAdapter, LoraPair
from fastdecode.runtime.errors import InvalidInput

# base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight, as save_pretrained names them
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def module_shapes(model: DenseModel, layer: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection an adapter may target in this layer (none of a fused or
    sparse block: its modules are not PEFT's Linear layers of these names)."""
    c = model.config
    hidden, q, kv = c.hidden_size, model.q_size, model.kv_size
    out: dict[str, tuple[int, int]] = {}
    if not c.fused_projections:
        out |= {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv)}
    out["o_proj"] = (q, hidden)
    w = model.layers[layer]
    if w.gate_up_w is not None and w.down_w is not None and not c.fused_projections:
        inter = w.down_w.shape[1]
        out |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return out


def _config(path: Path) -> dict:
    f = path / "adapter_config.json"
    if not f.is_file():
        raise InvalidInput(f"LoRA adapter {str(path)!r}: no adapter_config.json there")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise InvalidInput(f"LoRA adapter {str(path)!r}: adapter_config.json: {_line(e)}") from None
    if not isinstance(cfg, dict):
        raise InvalidInput(f"LoRA adapter {str(path)!r}: adapter_config.json is not an object")
    unsupported = {
        "peft_type": cfg.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(cfg.get("use_dora")),
        "bias": cfg.get("bias", "none") != "none",
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise InvalidInput(f"LoRA adapter {str(path)!r}: not supported: {', '.join(bad)}")
    return cfg


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    st, binf = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st))
        if binf.is_file():
            return torch.load(str(binf), map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: the load is refused, nothing else fails
        raise InvalidInput(f"LoRA adapter {str(path)!r}: weights unreadable: {_line(e)}") from None
    raise InvalidInput(f"LoRA adapter {str(path)!r}: no adapter_model.safetensors there")


def load_adapter(name: str, path: str | Path, model: DenseModel, max_rank: int) -> LoraAdapter:
    """Read a PEFT LoRA adapter and check it against the model; anything it cannot apply exactly (a
    module the model lacks, a shape of another model, a rank past `max_rank`) is InvalidInput, one line."""
    p = Path(path)
    if not p.is_dir():
        raise InvalidInput(f"LoRA adapter {name!r}: {str(p)!r} is not a directory")
    cfg = _config(p)
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, int | float):
        raise InvalidInput(f"LoRA adapter {name!r}: r and lora_alpha must be numbers, got {r!r}, {alpha!r}")
    if r > max_rank:
        raise InvalidInput(f"LoRA adapter {name!r}: rank {r} exceeds --max-lora-rank {max_rank}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    n = model.config.num_hidden_layers
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in _tensors(p).items():
        m = _KEY.match(key)
        if m is None:
            raise InvalidInput(f"LoRA adapter {name!r}: tensor {key!r} targets nothing this server applies")
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
        if layer >= n:
            raise InvalidInput(f"LoRA adapter {name!r}: layer {layer} of {key!r}, the model has {n}")
        pairs.setdefault((layer, module), {})[ab] = t
    if not pairs:
        raise InvalidInput(f"LoRA adapter {name!r}: no LoRA weights in {str(p)!r}")
    layers: list[dict[str, LoraPair]] = [{} for _ in range(n)]
    dev, dtype = model.device, model.dtype
    for (layer, module), ab in sorted(pairs.items()):
        shapes = module_shapes(model, layer)
        if module not in shapes:
            raise InvalidInput(
                f"LoRA adapter {name!r}: targets {module} of layer {layer}, which this "
                f"{model.config.model_type} model lacks (it has {', '.join(shapes)})"
            )
        if set(ab) != {"A", "B"}:
            raise InvalidInput(f"LoRA adapter {name!r}: {module} of layer {layer} lacks lora_A or lora_B")
        fin, fout = shapes[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, fin) or tuple(b.shape) != (fout, r):
            raise InvalidInput(
                f"LoRA adapter {name!r}: {module} of layer {layer} has A {tuple(a.shape)}, B "
                f"{tuple(b.shape)}; this model needs A ({r}, {fin}), B ({fout}, {r})"
            )
        layers[layer][module] = LoraPair(a.to(dev, dtype).contiguous(), b.to(dev, dtype).contiguous(), scale)
    return LoraAdapter(name, str(p), r, layers)


def _line(e: BaseException) -> str:
    """An exception's message as one line (a refusal is one line, whatever the reader said)."""
    return " ".join(str(e).split()) or type(e).__name__
