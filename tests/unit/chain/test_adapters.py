"""Adapter versions: a LoRA run's chain pins its base by digest; regions find (or refuse) it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from chain import keys
from chain.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    BadAdapter,
    BaseNotHeld,
    check_config,
    find_base,
    is_adapter_dir,
    peft_dir_digest,
    pin_for,
    write_peft_dir,
)
from chain.errors import BadSignature, ChainError
from chain.manifest import Manifest
from chain.store import ChainStore
from chain.weights import WeightsDir
from tests.conftest import make_state
from trainer.publisher import Publisher

CONFIG = json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                     "target_modules": ["q_proj"]}).encode()


def adapter_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"base_model.model.layers.{i}.q_proj.lora_{ab}.weight":
            (torch.randn(*shape, generator=g) * 0.01).bfloat16()
            for i in range(2) for ab, shape in (("A", (4, 32)), ("B", (32, 4)))}


def publish_base(tmp_path: Path) -> tuple[Manifest, WeightsDir]:
    """A base chain with one snapshot, reconstructed the way a base daemon would."""
    base = Publisher(tmp_path / "base-chain", tmp_path / "base.key", run="base")
    m = base.publish(0, make_state(0)).snapshot
    weights = WeightsDir(tmp_path / "base-weights")
    weights.apply([m], lambda b: base.store.blocks.get(b.id, b.size))
    return m, weights


@pytest.fixture
def keyfiles(tmp_path: Path) -> Path:
    keys.generate(tmp_path / "base.key")
    keys.generate(tmp_path / "lora.key")
    return tmp_path


def test_adapter_versions_carry_a_signed_base_pin_and_rebuild_as_a_peft_dir(keyfiles: Path):
    tmp = keyfiles
    base_m, base_w = publish_base(tmp)
    pin = pin_for(base_m)
    pub = Publisher(tmp / "lora-chain", tmp / "lora.key", run="run-a", base=pin)
    states = [adapter_state(s) for s in range(3)]
    for v, st in enumerate(states):
        pub.publish(v, st, files={ADAPTER_CONFIG: CONFIG})
    store = ChainStore(tmp / "lora-chain", keys.load_private(tmp / "lora.key").public_key())
    plan = store.plan(None, 2)
    assert all(m.base == pin for m in plan)
    assert find_base(base_w.root, plan[-1].base, plan[-1].artifact) == base_w.current().path
    w = WeightsDir(tmp / "lora-weights")
    cur = w.apply(plan, lambda b: store.blocks.get(b.id, b.size))
    peft = write_peft_dir(cur.path, tmp / "engine" / "v00000002", cur.state_digest)
    assert is_adapter_dir(peft) and peft_dir_digest(peft) == plan[-1].state_digest
    got = load_file(str(peft / ADAPTER_WEIGHTS))
    assert set(got) == set(states[2])
    assert all(torch.equal(got[k], states[2][k]) for k in got)
    assert (peft / ADAPTER_CONFIG).read_bytes() == CONFIG
    # asked again (a retry): the directory an engine may be serving is kept, not rewritten
    inode = (peft / ADAPTER_WEIGHTS).stat().st_ino
    assert write_peft_dir(cur.path, peft, cur.state_digest) == peft
    assert (peft / ADAPTER_WEIGHTS).stat().st_ino == inode
    # a version directory that has moved on is refused, not copied under the old name
    with pytest.raises(BadAdapter, match="no longer holds the adapter version"):
        v1 = store.get(1, "delta") or store.get(1, "snapshot")
        write_peft_dir(cur.path, tmp / "engine" / "v00000001", v1.state_digest)
    assert not (tmp / "engine" / "v00000001").exists()
    assert [p.name for p in (tmp / "engine").iterdir()] == ["v00000002"]  # no temp left


def test_the_pin_is_signed_and_absent_from_full_model_manifests(keyfiles: Path):
    tmp = keyfiles
    base_m, _ = publish_base(tmp)
    assert b'"base":' not in base_m.canonical()  # full models' bytes are as before
    pub = Publisher(tmp / "lora-chain", tmp / "lora.key", run="run-a", base=pin_for(base_m))
    m = pub.publish(0, adapter_state(0), files={ADAPTER_CONFIG: CONFIG}).snapshot
    doc = json.loads(m.to_bytes())
    doc["base"]["state_digest"] = "0" * 32  # a relay swaps the base for another
    public = keys.load_private(tmp / "lora.key").public_key()
    with pytest.raises(BadSignature):
        Manifest.parse(json.dumps(doc).encode(), public)
    assert Manifest.parse(m.to_bytes(), public).base == pin_for(base_m)


def test_only_the_base_daemons_current_version_is_a_base(keyfiles: Path):
    tmp = keyfiles
    base = Publisher(tmp / "base-chain", tmp / "base.key", run="base")
    v0 = base.publish(0, make_state(0)).snapshot
    v1 = base.publish(1, make_state(1)).delta
    weights = WeightsDir(tmp / "base-weights")
    weights.apply([v0], lambda b: base.store.blocks.get(b.id, b.size))
    assert find_base(weights.root, pin_for(v0), "a") == weights.current().path
    weights.apply([v1], lambda b: base.store.blocks.get(b.id, b.size))
    assert find_base(weights.root, pin_for(v1), "a") == weights.current().path
    with pytest.raises(BaseNotHeld, match=r"holds base v1 .* as current \(the pinned one is an "
                       r"older version it keeps\)"):
        find_base(weights.root, pin_for(v0), "a")


def test_a_base_not_held_is_refused_naming_both_versions(keyfiles: Path):
    tmp = keyfiles
    base_m, base_w = publish_base(tmp)
    other = pin_for(base_m).model_copy(update={"version": 9, "state_digest": "ab" * 16})
    with pytest.raises(BaseNotHeld, match=r"base base v9 \(digest abababababab…\).*does not "
                       r"hold.*holds base v0"):
        find_base(base_w.root, other, "v00000003.delta")
    with pytest.raises(BaseNotHeld, match=r"no adapter\.base_weights"):
        find_base(None, pin_for(base_m), "v00000003.delta")
    with pytest.raises(BaseNotHeld, match="no finished version"):
        find_base(tmp / "empty", pin_for(base_m), "v00000003.delta")


def test_an_adapter_version_needs_a_lora_config(keyfiles: Path):
    tmp = keyfiles
    base_m, _ = publish_base(tmp)
    pub = Publisher(tmp / "lora-chain", tmp / "lora.key", run="run-a", base=pin_for(base_m))
    with pytest.raises(ChainError, match=r"adapter_config\.json"):
        pub.publish(0, adapter_state(0))
    with pytest.raises(BadAdapter, match="positive integer rank"):
        pub.publish(0, adapter_state(0), files={ADAPTER_CONFIG: b'{"r": 0, "lora_alpha": 1}'})
    assert pub.head is None  # nothing was written
    with pytest.raises(BadAdapter, match="only LORA"):
        check_config(b'{"peft_type": "IA3", "r": 4, "lora_alpha": 8}')
    with pytest.raises(BadAdapter, match="not JSON"):
        check_config(b"{")
    with pytest.raises(BadAdapter, match="is not an adapter version"):
        write_peft_dir(tmp / "base-weights" / "current", tmp / "x", "0" * 32)

