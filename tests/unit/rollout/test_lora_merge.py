"""The built-in engine applies a PEFT LoRA adapter as PEFT itself computes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from rollout import lora_merge
from rollout.engine_torch import EngineLoadError, TorchEngine
from trainer.lora import adapter_state
from trainer.model import build_default_model, save_hf_dir

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(seed: int, r: int = 8, targets: list[str] = TARGETS
                 ) -> tuple[torch.nn.Module, Path]:
    """The default model with a random (non-zero B) LoRA, fp32."""
    model, _ = build_default_model()
    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                            init_lora_weights=False))
    return peft.eval(), peft


def test_engine_with_adapter_matches_peft_and_replaces_the_last_adapter(tmp_path: Path):
    base, tok = build_default_model()
    save_hf_dir(base, tok, tmp_path / "base", dtype=torch.float32)
    ids = tok("12+7=", return_tensors="pt").input_ids
    engine = TorchEngine(str(tmp_path / "base"), 0)
    with torch.no_grad():
        base_logits = engine.model(ids).logits
    for seed, version in ((1, 5), (2, 6)):
        peft, _ = peft_adapter(seed)
        peft.save_pretrained(tmp_path / f"a{seed}")
        engine.load_adapter(tmp_path / f"a{seed}", version)
        with torch.no_grad():
            want = peft(input_ids=ids).logits
            got = engine.model(ids).logits
        assert engine.version == version
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        assert not torch.allclose(got, base_logits, atol=1e-3)  # the adapter did something


def test_weights_the_last_adapter_changed_and_this_one_does_not_go_back_to_the_base(
        tmp_path: Path):
    base, tok = build_default_model()
    save_hf_dir(base, tok, tmp_path / "base", dtype=torch.float32)
    engine = TorchEngine(str(tmp_path / "base"), 0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    for seed, targets in ((1, ["q_proj", "v_proj"]), (2, ["k_proj"])):
        peft, _ = peft_adapter(seed, targets=targets)
        peft.save_pretrained(tmp_path / f"a{seed}")
        engine.load_adapter(tmp_path / f"a{seed}", seed)
    now = engine.model.state_dict()
    changed = sorted(k for k in now if not torch.equal(now[k], before[k]))
    assert changed == [f"model.layers.{i}.self_attn.k_proj.weight" for i in range(2)]
    engine.load_version(tmp_path / "base", 3)  # a new base: nothing of the old one comes back
    peft, _ = peft_adapter(4, targets=["q_proj"])
    peft.save_pretrained(tmp_path / "a4")
    engine.load_adapter(tmp_path / "a4", 4)
    now = engine.model.state_dict()
    assert sorted(k for k in now if not torch.equal(now[k], before[k])) == \
        [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)]


def test_the_fp32_merge_is_what_peft_merges(tmp_path: Path):
    peft, _ = peft_adapter(3, r=4)
    base = {k: v.clone() for k, v in peft.get_base_model().state_dict().items()
            if ".lora_" not in k}
    base = {k.replace(".base_layer.", "."): v for k, v in base.items()}
    config = peft.peft_config["default"].to_dict()
    got = lora_merge.merged(base, adapter_state(peft, torch.float32), config)
    want = peft.merge_and_unload().state_dict()
    changed = [k for k in got if not torch.equal(got[k], base[k])]
    assert len(changed) == 2 * 7  # two layers, seven modules each
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-6), k


def test_adapters_it_cannot_apply_are_refused_by_name(tmp_path: Path):
    with pytest.raises(lora_merge.UnsupportedAdapter, match="use_dora"):
        lora_merge.scale_of({"r": 4, "lora_alpha": 8, "use_dora": True})
    with pytest.raises(lora_merge.UnsupportedAdapter, match="fan_in_fan_out"):
        lora_merge.scale_of({"r": 4, "lora_alpha": 8, "fan_in_fan_out": True})
    assert lora_merge.scale_of({"r": 4, "lora_alpha": 8, "use_rslora": True}) == 4.0
    with pytest.raises(lora_merge.UnsupportedAdapter, match=r"no x\.lora_B\.weight"):
        lora_merge.weight_deltas({"x.lora_A.weight": torch.ones(2, 2)}, {"r": 2, "lora_alpha": 2})
    big, tok = build_default_model(hidden=256)
    save_hf_dir(big, tok, tmp_path / "big", dtype=torch.float32)
    peft, _ = peft_adapter(4)
    peft.save_pretrained(tmp_path / "small-adapter")
    engine = TorchEngine(str(tmp_path / "big"), 0)
    with pytest.raises(EngineLoadError, match=r"the base's \(256, .*another base"):
        engine.load_adapter(tmp_path / "small-adapter", 1)
