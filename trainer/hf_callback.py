"""`DeltaswarmCallback`: any transformers `Trainer` (TRL's GRPOTrainer, PPO, SFT, ...) feeds the
swarm, one version per optimizer step, from the model where it lives.

    from trainer.hf_callback import DeltaswarmCallback
    from trainer.publisher import Publisher

    pub = Publisher(chain_dir="/var/lib/deltaswarm/trainer/chain", key_path="trainer.key",
                    run="my-run", daemon_url="http://127.0.0.1:7600", token=token)
    GRPOTrainer(model=model, ..., callbacks=[DeltaswarmCallback(pub)]).train()

At `on_train_begin` the starting weights are published as v0 (or, when the chain already has a
head, checked bit-identical to it: a restart from the checkpoint saved with that version); at
each `on_step_end` (after the optimizer step and zero_grad, so once per gradient-accumulation
cycle) the weights are cast to `dtype` and published as head + 1, a sparse delta against the
previous version. Only the main process publishes. Config, generation config and tokenizer
files travel with every version, with config.json's dtype set to the published dtype, its
architectures filled in and use_cache back on, so the region's directory loads in transformers
and vLLM as is.

A PEFT model (TRL's `peft_config`, or `get_peft_model`) publishes its adapter only, to a
publisher made with `base=` the base's pin (trainer/lora.py): the LoRA tensors as PEFT saves
them and its adapter_config.json, every step; the base chain is published once, apart.

Where the model is sharded (FSDP2 DTensors), gathering it on one rank would need every rank;
that is the sharded publisher's job (trainer/sharded.py, issue 12: every rank encodes its own
shard, one manifest is signed). Give that publisher with `all_ranks=True`: every process then
calls `publish` with its own (DTensor) state dict. Without it, DTensors are refused with a
clear error; DDP and single-process models work as they are.
"""

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from chain.errors import ChainError
from trainer import lora


class DeltaswarmCallback(TrainerCallback):
    def __init__(self, publisher: Any, dtype: torch.dtype = torch.bfloat16, every: int = 1,
                 files: Mapping[str, bytes] | None = None, all_ranks: bool = False) -> None:
        """`publisher`: a trainer.publisher.Publisher (or anything with `head`, `resume` and
        `publish(version, state_dict, files)`). `every`: publish every this many optimizer
        steps. `files`: the non-weight files of a version (default: from the model's config
        and the trainer's tokenizer). `all_ranks`: every process publishes its shards (a
        sharded publisher); otherwise only the main process publishes."""
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.publisher = publisher
        self.dtype = dtype
        self.every = every
        self.files = dict(files) if files is not None else None
        self.all_ranks = all_ranks
        self.published: list[Any] = []
        """What each publish returned (trainer.publisher.Published), in order."""

    def weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        if lora.is_peft_model(model):
            return lora.adapter_state(model, self.dtype)
        out = {}
        for name, t in model.state_dict().items():
            if type(t).__name__ == "DTensor" and not self.all_ranks:
                raise ChainError(f"{name} is a sharded DTensor (FSDP2): publish from the shards "
                                 "with the sharded publisher, not DeltaswarmCallback")
            out[name] = t.detach().to(self.dtype).contiguous()
        return out

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       processing_class: Any = None, **kwargs: Any) -> None:
        if not (state.is_world_process_zero or self.all_ranks):
            return
        peft = lora.is_peft_model(model)
        if peft and getattr(self.publisher, "base", None) is None:
            raise ChainError("the model is a PEFT model: its adapter versions need a publisher "
                             "made with base=publish_base(base_publisher, model) "
                             "(trainer/lora.py), which pins the base they apply to")
        if not peft and getattr(self.publisher, "base", None) is not None:
            raise ChainError("this publisher publishes LoRA adapters (it has a base), but the "
                             "model is not a PEFT model; give the trainer a peft_config")
        if self.files is None:
            self.files = (lora.adapter_files(model) if peft
                          else hf_files(model, processing_class, self.dtype))
        weights = self.weights(model)
        if self.publisher.head is None:
            self.published.append(self.publisher.publish(0, weights, self.files))
        elif hasattr(self.publisher, "resume"):
            self.publisher.resume(weights)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    **kwargs: Any) -> None:
        if not (state.is_world_process_zero or self.all_ranks) or state.global_step % self.every:
            return
        version = self.publisher.head + 1
        self.published.append(self.publisher.publish(version, self.weights(model), self.files))


def hf_files(model: Any, tokenizer: Any, dtype: torch.dtype) -> dict[str, bytes]:
    """config.json (dtype set to `dtype`), generation_config.json and the tokenizer's files, as
    save_pretrained writes them."""
    with tempfile.TemporaryDirectory() as d:
        model.config.save_pretrained(d)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(d)
        if tokenizer is not None:
            tokenizer.save_pretrained(d)
        files = {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()
                 and p.stat().st_size > 0}
    config = json.loads(files["config.json"])
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    if "use_cache" in config:  # trainers turn it off for training; the rollouts generate
        config["use_cache"] = True
    files["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    return files
