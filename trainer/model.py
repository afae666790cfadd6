"""The default policy: a tiny Llama causal LM built from a config, and its HF directory writer.

No download: the weights are a seeded random init, the tokenizer is character-level. Small
enough (about 0.5 M parameters) that an RL step takes about a second on two CPU cores, and in a
standard architecture so transformers and vLLM load the directory unchanged.
"""

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from trainer.tokenizer import build_char_tokenizer, tokenizer_files

WEIGHTS_FILE = "model.safetensors"


def default_config(tokenizer: PreTrainedTokenizerFast, *, hidden: int = 128, layers: int = 2,
                   heads: int = 4, kv_heads: int = 2, max_positions: int = 64) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )


def build_default_model(seed: int = 0, **shape: int) -> tuple[LlamaForCausalLM,
                                                               PreTrainedTokenizerFast]:
    """A freshly initialised fp32 model (same seed, same weights) and its tokenizer."""
    tokenizer = build_char_tokenizer()
    config = default_config(tokenizer, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.config.dtype = "bfloat16"
    model.generation_config = generation_config(tokenizer)
    return model, tokenizer


def generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )


def state_dict_as(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}


def hf_files(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
             dtype: torch.dtype = torch.bfloat16) -> dict[str, bytes]:
    """Every file of the HF directory except the weights: what a published version carries
    beside its tensors (config.json, generation_config.json, tokenizer files)."""
    config = model.config.to_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["architectures"] = [type(model).__name__]
    gen = generation_config(tokenizer).to_dict()
    files = {
        "config.json": (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(),
        "generation_config.json": (json.dumps(gen, indent=2, sort_keys=True) + "\n").encode(),
    }
    files.update(tokenizer_files(tokenizer))
    return files


def save_hf_dir(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: str | Path,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `path` as a loadable HF directory (weights cast to `dtype`), each file fsynced."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state_dict_as(model, dtype), str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    _fsync(path / WEIGHTS_FILE)
    for name, data in hf_files(model, tokenizer, dtype).items():
        (path / name).write_bytes(data)
        _fsync(path / name)
    return path


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
