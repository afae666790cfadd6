"""The default model, its tokenizer and HF directory, and the supervised warm-up."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.grpo import token_logprobs
from trainer.model import build_default_model, save_hf_dir, state_dict_as
from trainer.warmup import _encode, resolve_task, warmup


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, _ = build_default_model(seed=3)
    b, _ = build_default_model(seed=3)
    c, _ = build_default_model(seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_hf_dir_loads_back_bit_identical_with_transformers(tmp_path: Path) -> None:
    model, tok = build_default_model(seed=0)
    save_hf_dir(model, tok, tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= names
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16
    ours, theirs = state_dict_as(model, torch.bfloat16), loaded.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    text = "17+25= 42 abc"
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    assert tok2.decode(tok2(text)["input_ids"], skip_special_tokens=True) == text
    assert (tok2.bos_token_id, tok2.eos_token_id, tok2.pad_token_id) == (1, 2, 0)


def _reference_loss(model: torch.nn.Module, tok, task) -> float:
    import random
    prompts = task.sample_prompts(random.Random(99), 64)
    pids, cids = _encode(tok, prompts, [task.reference(p) for p in prompts])
    with torch.no_grad():
        logp, _, mask = token_logprobs(model, pids, cids, tok.pad_token_id)
    return float(-logp.sum() / mask.sum())


def test_warmup_is_deterministic_and_lowers_reference_loss() -> None:
    task = resolve_task("rollout.tasks.arithmetic")
    a, tok = build_default_model(seed=0)
    b, _ = build_default_model(seed=0)
    start = _reference_loss(a, tok, task)
    warmup(a, tok, task, steps=15, batch=32, seed=5)
    warmup(b, tok, task, steps=15, batch=32, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert _reference_loss(a, tok, task) < 0.6 * start
