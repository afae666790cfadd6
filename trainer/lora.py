"""LoRA runs from the trainer's side: publish the base once, then the adapter every step.

    from trainer.lora import publish_base
    base_pub = Publisher(chain_dir=".../base/chain", key_path="base.key", run="base",
                         daemon_url=BASE_DAEMON, token=token)
    pin = publish_base(base_pub, model, tokenizer)      # v0 of the base chain, or its head
    pub = Publisher(chain_dir=".../run-a/chain", key_path="run-a.key", run="run-a",
                    daemon_url=RUN_A_DAEMON, token=token, base=pin)
    GRPOTrainer(model=model, peft_config=LoraConfig(...), callbacks=[DeltaswarmCallback(pub)])

The base is an ordinary chain (one snapshot; regions follow it with an ordinary daemon and serve
it with `vllm serve --enable-lora`). Each run's chain carries only its adapter, exactly as PEFT's
`save_pretrained` writes it (`adapter_model.safetensors` tensors, `adapter_config.json`), each
manifest pinned to the base's state digest (chain/adapters.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from chain.adapters import ADAPTER_CONFIG, check_config, head_pin, pin_for
from chain.manifest import BasePin


def is_peft_model(model: Any) -> bool:
    """A PEFT-wrapped model (PeftModel or a subclass), without importing peft for others."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def adapter_state(model: Any, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names PEFT saves them with (adapter name stripped)."""
    from peft import get_peft_model_state_dict

    return {name: t.detach().to("cpu", dtype).contiguous()
            for name, t in get_peft_model_state_dict(model).items()}


def adapter_files(model: Any) -> dict[str, bytes]:
    """adapter_config.json exactly as PEFT's save_pretrained writes it."""
    with tempfile.TemporaryDirectory() as d:
        model.peft_config["default"].save_pretrained(d)
        raw = (Path(d) / ADAPTER_CONFIG).read_bytes()
    check_config(raw)
    return {ADAPTER_CONFIG: raw}


def base_state(model: Any, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The base model's own weights (for a PeftModel: without the LoRA layers, under the
    names the base checkpoint uses), as the base chain publishes them."""
    if is_peft_model(model):
        model = model.get_base_model()
        state = {name.replace(".base_layer.", "."): t for name, t in model.state_dict().items()
                 if ".lora_" not in name}
    else:
        state = model.state_dict()
    return {name: t.detach().to("cpu", dtype).contiguous() for name, t in state.items()}


def publish_base(publisher: Any, model: Any, tokenizer: Any = None,
                 dtype: torch.dtype = torch.bfloat16) -> BasePin:
    """Publish `model`'s base weights as v0 of the base chain, or, when the chain already has a
    head, check they are that head bit for bit (Publisher.resume); returns the pin the runs'
    publishers take as `base`."""
    from trainer.hf_callback import hf_files  # it imports this module for PEFT models

    weights = base_state(model, dtype)
    if publisher.head is None:
        base = model.get_base_model() if is_peft_model(model) else model
        published = publisher.publish(0, weights, hf_files(base, tokenizer, dtype))
        return pin_for(published.snapshot)
    publisher.resume(weights)  # the head must be these very weights
    return head_pin(publisher.store)
