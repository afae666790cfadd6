"""Engine-first decoding: a delta decoded once into a verified Patch (chain/decode.py), the
patch file round trip (chain/patchfile.py), and the directory on disk brought forward later from
the patches, several versions at once (WeightsDir.apply_changes), bit-exact."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from chain.decode import NotPatchable, decode_patch, merge
from chain.errors import ChainError, DigestMismatch
from chain.patchfile import BadPatch, read_patch, write_patch
from chain.safetensors_io import TensorFiles
from chain.store import ChainStore
from chain.versiondir import read_info
from chain.weights import WeightsDir
from tests.unit.chain.test_store import build_chain
from tests.unit.chain.test_weights import getter, same


def _patches(store: ChainStore, w: WeightsDir, upto: int) -> list:
    cur = w.current()
    files, digests = TensorFiles(cur.path), read_info(cur.path).tensors
    out = []
    for v in range(cur.version + 1, upto + 1):
        out.append(decode_patch(store.manifest(f"v{v:08d}.delta"), files, cur.version, digests,
                                out, getter(store)))
    return out


@pytest.mark.parametrize("direct", [-1, 1000], ids=["ranks", "direct-positions"])
def test_patches_over_the_disk_version_rebuild_every_later_version(tmp_path, signing_key,
                                                                    monkeypatch, direct):
    """With positions coded either way (chain.codec.api.DIRECT), overlays included."""
    monkeypatch.setattr("chain.fill.BATCH", 1)  # a batch per tensor, as at model sizes
    monkeypatch.setattr("chain.fill.PART", 64)  # and written in several jobs
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 5, direct_positions=direct)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    patches = _patches(store, w, 5)
    assert [p.version for p in patches] == [2, 3, 4, 5]
    # each patch, applied to its parent state, gives the next version bit for bit
    state = {k: v.clone() for k, v in states[1].items()}
    for p in patches:
        rt = read_patch(write_patch(tmp_path / f"v{p.version}.patch", p))
        assert (rt.version, rt.parent, rt.state_digest) == (p.version, p.parent, p.state_digest)
        for t in rt.tensors:
            flat = state[t.name].reshape(-1)
            bits = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
            bits[torch.from_numpy(t.indices)] = torch.from_numpy(t.values.view(
                bits.numpy().dtype))
        assert same(state, states[p.version])
    # the disk catches up from v1 to v5 in one pass, from the merged patches
    cur = w.apply_changes(store.manifest("v00000005.delta"), 1, merge(patches), getter(store))
    assert cur.version == 5 and w.verify().version == 5
    assert same(load_file(cur.path / "model.safetensors"), states[5])


def test_in_place_single_steps_are_exact(tmp_path, signing_key, monkeypatch):
    """One patch at a time over the older spare directory (in place), in batches of one
    tensor."""
    monkeypatch.setattr("chain.fill.BATCH", 1)
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 4)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 2), getter(store))
    for v in (3, 4):
        (p,) = _patches(store, w, v)
        w.apply_changes(store.manifest(f"v{v:08d}.delta"), v - 1, merge([p]), getter(store))
        assert same(load_file(w.current().path / "model.safetensors"), states[v])
    w.verify()


def test_a_tampered_patch_layer_or_wrong_base_is_refused(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 3)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    (p2,) = _patches(store, w, 2)
    cur = w.current()
    files, digests = TensorFiles(cur.path), read_info(cur.path).tensors
    good = p2.tensors[0].parent_digest
    p2.tensors[0].parent_digest = "0" * 32  # a layer that does not follow v1
    with pytest.raises(ChainError, match="does not follow"):
        decode_patch(store.manifest("v00000003.delta"), files, 1, digests, [p2], getter(store))
    p2.tensors[0].parent_digest = good
    p2.tensors[0].digest = "0" * 32  # nor lead to v2's state
    with pytest.raises(DigestMismatch, match="parent digest"):
        decode_patch(store.manifest("v00000003.delta"), files, 1, digests, [p2], getter(store))
    with pytest.raises(NotPatchable):
        decode_patch(store.manifest("v00000003.delta"), files, 1, digests, [], getter(store))
    with pytest.raises(NotPatchable):
        decode_patch(store.manifest("v00000000.snapshot"), files, 1, digests, [],
                     getter(store))


def test_a_damaged_patch_file_is_a_clear_error(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 2)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    (p,) = _patches(store, w, 2)
    path = write_patch(tmp_path / "p", p)
    raw = bytearray(path.read_bytes())
    raw[10:20] = b"#" * 10
    path.write_bytes(bytes(raw))
    with pytest.raises(BadPatch, match="unreadable"):
        read_patch(path)
    path.write_bytes(b"")
    with pytest.raises(BadPatch):
        read_patch(path)
    t = p.tensors[0]
    good = t.indices.copy()
    t.indices = good.copy()
    t.indices[-1] = np.int64(10**9)
    with pytest.raises(BadPatch, match="outside"):
        read_patch(write_patch(tmp_path / "q", p))
    assert good.size >= 3
    t.indices = good.copy()
    t.indices[1] = np.int64(-5)  # ends in range, a wild position inside: the kernels would write it
    with pytest.raises(BadPatch, match="not strictly ascending"):
        read_patch(write_patch(tmp_path / "r", p))


def test_the_disk_catch_up_takes_the_compiled_kernels_for_unchanged_tensors(tmp_path,
                                                                           signing_key):
    """A tensor no patch changed (here `step.count`) must not send the catch-up's digest move
    to numba's JIT (an empty change set typed uint8 once did: a compile mid-pass on a fresh
    host, 0.16 s from a warm cache)."""
    from chain.codec import aot

    if aot.status()["kernels"] != "aot":
        pytest.skip(f"compiled kernels not in use here: {aot.status()['reason']}")
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 3)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    patches = _patches(store, w, 3)
    assert "step.count" not in {t.name for p in patches for t in p.tensors}
    before = dict(aot.status()["jit_fallbacks"])
    cur = w.apply_changes(store.manifest("v00000003.delta"), 1, merge(patches), getter(store))
    assert cur.version == 3
    assert aot.status()["jit_fallbacks"] == before
