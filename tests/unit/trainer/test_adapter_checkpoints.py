"""`deltaswarm publish` takes PEFT adapter checkpoints for a LoRA run (`base_chain` set): the
adapter and its config travel, each version pinned to the base chain's head; a checkpoint of
the other kind, or a config that is not LoRA, is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from chain import keys
from chain.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, pin_for
from chain.store import ChainStore
from chain.weights import WeightsDir
from daemon.cli import main as cli_main
from trainer.checkpoints import Refused, inspect_checkpoint
from trainer.lora import publish_base
from trainer.model import build_default_model, save_hf_dir
from trainer.publisher import Publisher


def lora_checkpoint(path: Path, seed: int) -> Path:
    """A TRL/transformers-style checkpoint dir of a PEFT model: adapter, config, and training
    state that must not travel."""
    model, tok = build_default_model()
    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    peft.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "optimizer.pt").write_bytes(b"\0" * 64)
    (path / "trainer_state.json").write_text("{}")
    return path


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    keys.generate(tmp_path / "k")
    model, tok = build_default_model()
    base = Publisher(tmp_path / "base-chain", tmp_path / "k", run="base")
    publish_base(base, model, tok)
    (tmp_path / "lora.yaml").write_text(
        "run: run-a\nchain_dir: chain\nkey: k\nstate_dir: pub\nbase_chain: base-chain\n"
        "watch: {settle_s: 0}\n")
    return tmp_path, tmp_path / "lora.yaml"


def test_adapter_checkpoints_publish_pinned_to_the_base_head(setup, capsys):
    tmp, config = setup
    for step in (1, 2):
        d = lora_checkpoint(tmp / f"checkpoint-{step}", seed=step)
        ckpt = inspect_checkpoint(d)
        assert ckpt.adapter and ckpt.weights == (ADAPTER_WEIGHTS,)
        assert ckpt.files == (ADAPTER_CONFIG,)  # not the tokenizer, not training state
        assert cli_main(["publish", str(d), "--config", str(config)]) == 0
        assert f"as v{step - 1}" in capsys.readouterr().out
    base_pin = pin_for(ChainStore(tmp / "base-chain").get(0, "snapshot"))
    store = ChainStore(tmp / "chain", keys.load_private(tmp / "k").public_key())
    assert {m.base for m in store.manifests().values()} == {base_pin}
    cur = WeightsDir(tmp / "w").apply(store.plan(None, 1),
                                      lambda b: store.blocks.get(b.id, b.size))
    got, want = load_file(str(cur.path / "model.safetensors")), \
        load_file(str(tmp / "checkpoint-2" / ADAPTER_WEIGHTS))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert json.loads((cur.path / ADAPTER_CONFIG).read_bytes())["r"] == 4


def test_the_wrong_kind_of_checkpoint_is_refused_by_name(setup, capsys):
    tmp, config = setup
    model, tok = build_default_model()
    full = save_hf_dir(model, tok, tmp / "step_1")
    assert cli_main(["publish", str(full), "--config", str(config)]) == 2
    assert "full-model checkpoint, but this run publishes LoRA adapters over base base v0" \
        in capsys.readouterr().err
    d = lora_checkpoint(tmp / "checkpoint-1", seed=1)
    plain = tmp / "plain.yaml"
    plain.write_text("run: run-a\nchain_dir: chain2\nkey: k\nstate_dir: pub2\n"
                     "watch: {settle_s: 0}\n")
    assert cli_main(["publish", str(d), "--config", str(plain)]) == 2
    assert "is a PEFT adapter checkpoint" in capsys.readouterr().err
    doc = json.loads((d / ADAPTER_CONFIG).read_text())
    (d / ADAPTER_CONFIG).write_text(json.dumps(doc | {"peft_type": "IA3"}))
    with pytest.raises(Refused, match="only LORA adapters"):
        inspect_checkpoint(d)
    empty = tmp / "nobase.yaml"
    empty.write_text("run: run-b\nchain_dir: chain3\nkey: k\nstate_dir: pub3\n"
                     "base_chain: missing\nwatch: {settle_s: 0}\n")
    assert cli_main(["publish", str(d), "--config", str(empty)]) == 2
    assert "holds no version yet" in capsys.readouterr().err
