"""The torch engine's engine-first path: a patch file written into the live weights in place
(fp32 engine over bf16 checkpoint bits), checked from the words it touched; a patch over another
version is refused with nothing written, one that does not land leaves the engine versionless."""

from pathlib import Path

import numpy as np
import pytest
import torch

from chain.digest import state_digest, tensor_digest
from chain.dtypes import bits_view
from chain.patchfile import Patch, TensorPatch, write_patch
from chain.versiondir import VersionInfo, write_info
from rollout.engine_torch import PatchMismatch, PatchRefused, TorchEngine
from tests.integration.harness import step
from trainer.model import build_default_model, save_hf_dir, state_dict_as


def _digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: tensor_digest("bfloat16", list(v.shape), bits_view(v)) for k, v in state.items()}


def _patch(old: dict, new: dict, version: int) -> Patch:
    do, dn = _digests(old), _digests(new)
    tensors = []
    for k in sorted(new):
        a, b = bits_view(old[k]), bits_view(new[k])
        pos = np.flatnonzero(a != b).astype(np.int64)
        if pos.size:
            tensors.append(TensorPatch(k, "bfloat16", list(new[k].shape), pos, b[pos].copy(),
                                       do[k], dn[k]))
    return Patch(version, version - 1, state_digest(do), state_digest(dn), tensors)


@pytest.fixture
def v0(tmp_path: Path) -> tuple[Path, dict]:
    model, tok = build_default_model(seed=0)
    path = save_hf_dir(model, tok, tmp_path / "v0")
    state = state_dict_as(model, torch.bfloat16)
    d = _digests(state)
    write_info(path, VersionInfo(0, state_digest(d), "r", d), None)
    return path, state


def test_a_patch_lands_in_place_bit_exact_and_checked(v0, tmp_path: Path) -> None:
    path, s0 = v0
    engine = TorchEngine(str(path), 0)
    params = engine.model.state_dict()
    before = {k: v.data_ptr() for k, v in params.items()}
    s1 = step(s0, 1, density=0.02)
    s2 = step(s1, 2, density=0.02)
    for v, (old, new) in enumerate(((s0, s1), (s1, s2)), start=1):
        n = engine.apply_patch(write_patch(tmp_path / f"v{v}.patch", _patch(old, new, v)))
        assert n > 0 and engine.version == v
        live = engine.model.state_dict()
        for k, t in new.items():
            assert torch.equal(live[k].to(torch.bfloat16).view(torch.int16),
                               t.view(torch.int16)), k
    assert {k: v.data_ptr() for k, v in engine.model.state_dict().items()} == before
    assert engine.digests == _digests(s2) and engine.patches == 2


def test_a_patch_over_another_version_is_refused_untouched(v0, tmp_path: Path) -> None:
    path, s0 = v0
    engine = TorchEngine(str(path), 0)
    s1, s2 = step(s0, 1), step(step(s0, 1), 2)
    with pytest.raises(PatchRefused, match="over v1"):
        engine.apply_patch(write_patch(tmp_path / "p", _patch(s1, s2, 2)))
    assert engine.version == 0
    live = engine.model.state_dict()
    assert all(torch.equal(live[k].to(torch.bfloat16), s0[k]) for k in s0)
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a patch")
    with pytest.raises(PatchRefused, match="unreadable"):
        engine.apply_patch(bad)


def test_a_patch_whose_values_do_not_match_its_digests_drops_the_version(v0, tmp_path: Path
                                                                        ) -> None:
    path, s0 = v0
    engine = TorchEngine(str(path), 0)
    p = _patch(s0, step(s0, 1), 1)
    p.tensors[0].values = p.tensors[0].values.copy()
    p.tensors[0].values[0] ^= 1
    with pytest.raises(PatchMismatch):
        engine.apply_patch(write_patch(tmp_path / "p", p))
    assert engine.version is None  # the worker reloads a verified directory
    engine.load_version(str(path), 0)
    assert engine.version == 0 and engine.digests == _digests(s0)


def test_the_digest_from_touched_words_is_exact_at_a_short_last_word(v0) -> None:
    """Every path of _patch_one: fp32 over bf16 (widened bits), same dtype, torch fallback."""
    engine = TorchEngine(str(v0[0]), 0)
    for ck, held, name in ((torch.bfloat16, torch.float32, "bfloat16"),
                           (torch.bfloat16, torch.bfloat16, "bfloat16"),
                           (torch.float16, torch.float32, "float16")):
        for n in (7, 8, 1):
            old = torch.randn(n).to(ck)
            new = old.clone()
            pos = np.array(sorted({0, n - 1}), np.int64)
            new.view(torch.int16)[torch.from_numpy(pos)] += 1
            live = old.to(held)
            t = TensorPatch("x", name, [n], pos, bits_view(new)[pos].copy(),
                            tensor_digest(name, [n], bits_view(old)),
                            tensor_digest(name, [n], bits_view(new)))
            assert engine._patch_one(live, t) == t.digest, (name, held, n)
            assert torch.equal(live.to(ck).view(torch.int16), new.view(torch.int16))
