"""A PEFT LoRA adapter as weight changes: W' = W + (lora_alpha / r) · B @ A per adapted module.

What the built-in engine applies (TorchEngine.load_adapter) and what tests compare vLLM's
adapter serving with. The sum is done in fp32 and cast once to the engine's dtype. Only plain
LoRA on Linear weights is taken: other PEFT features (DoRA, per-module rank or alpha patterns,
bias training, embedding adapters) are refused by name rather than applied wrong.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from chain.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BadAdapter, check_config, check_doc

PREFIX = "base_model.model."


class UnsupportedAdapter(ValueError):
    """A PEFT adapter this module cannot turn into weight changes."""


def scale_of(config: dict) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (plain LoRA only:
    chain.adapters.check_config refuses the rest by name)."""
    try:
        check_doc(config)
    except BadAdapter as e:
        raise UnsupportedAdapter(str(e)) from None
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def weight_deltas(adapter: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """{base weight name: scale · B @ A in fp32} for every module the adapter touches."""
    scale = scale_of(config)
    out = {}
    for name, a in adapter.items():
        if not name.endswith(".lora_A.weight"):
            if not name.endswith(".lora_B.weight"):
                raise UnsupportedAdapter(f"adapter tensor {name!r} is not a LoRA A/B weight")
            continue
        module = name.removesuffix(".lora_A.weight")
        b = adapter.get(module + ".lora_B.weight")
        if b is None:
            raise UnsupportedAdapter(f"adapter has {name} but no {module}.lora_B.weight")
        out[module.removeprefix(PREFIX) + ".weight"] = scale * (b.float() @ a.float())
    return out


def read_adapter(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A PEFT adapter directory's tensors and config."""
    path = Path(path)
    try:
        config = check_config((path / ADAPTER_CONFIG).read_bytes())
        return load_file(str(path / ADAPTER_WEIGHTS)), config
    except (OSError, ValueError, BadAdapter) as e:
        raise UnsupportedAdapter(f"{path} is not a usable PEFT adapter directory: {e}") from None


def misfit(deltas: dict[str, torch.Tensor], shapes: dict[str, torch.Size]) -> str | None:
    """Why these weight changes cannot apply to a model with these weight shapes, or None."""
    for name, delta in sorted(deltas.items()):
        if name not in shapes:
            return f"the adapter changes {name}, which the base lacks"
        if delta.shape != shapes[name]:
            return (f"the adapter's {name} is {tuple(delta.shape)}, the base's "
                    f"{tuple(shapes[name])}")
    return None


def merged(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], config: dict
           ) -> dict[str, torch.Tensor]:
    """The base weights with the adapter folded in (each changed one cast back to its dtype)."""
    deltas = weight_deltas(adapter, config)
    if (why := misfit(deltas, {k: v.shape for k, v in base.items()})) is not None:
        raise UnsupportedAdapter(f"{why}: it was trained on another base")
    out = dict(base)
    for name, delta in deltas.items():
        out[name] = (base[name].float() + delta).to(base[name].dtype)
    return out
