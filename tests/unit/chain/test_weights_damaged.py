"""What an apply cannot see, `WeightsDir.damaged` finds: a flipped bit in an element of the spare
directory that no later version changes is carried through an in-place bring-forward (each
tensor is verified from its old digest and the words the delta touched, not re-hashed), and the
directory it lands in is current and wrong until something re-hashes it. `damaged` names the
tensor; `set_aside` takes the directory out of use as the start-up check does."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from chain.safetensors_io import read_header
from chain.store import ChainStore
from chain.versiondir import read_info, write_info
from chain.weights import STATE_DIGEST, WeightsDir
from tests.unit.chain.test_store import build_chain
from tests.unit.chain.test_weights import getter, same

SHARD = "model.safetensors"
NAME = "layers.0.mlp.up.weight"


def _unchanged_index(states: list[dict[str, torch.Tensor]], name: str) -> int:
    """An element of `name` equal in every version (bf16 bits)."""
    bits = [s[name].view(torch.int16).reshape(-1) for s in states]
    same_everywhere = torch.ones_like(bits[0], dtype=torch.bool)
    for b in bits[1:]:
        same_everywhere &= b == bits[0]
    return int(torch.nonzero(same_everywhere)[0])


def _flip_low_bit(d: Path, name: str, index: int) -> None:
    """The lowest mantissa bit of bf16 element `index`: its exponent, and so its rank context,
    stays the same."""
    base, slots = read_header(d / SHARD)
    at = base + slots[name].start + 2 * index
    with open(d / SHARD, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("direct", [-1, 1000], ids=["ranks", "direct"])
def test_damage_carried_through_an_in_place_apply_is_found_and_set_aside(
        tmp_path, signing_key, direct) -> None:
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 3, direct_positions=direct)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    w.apply([store.manifest("v00000002.delta")], getter(store))
    assert w.versions() == [1, 2] and w.damaged(1) == [] and w.damaged(2) == []

    _flip_low_bit(w.path(1), NAME, _unchanged_index(states, NAME))
    assert w.damaged(1) == [NAME]
    assert w.damaged(1, [NAME, "embed.weight"]) == [NAME]  # just the names asked about

    # The spare is brought forward to v3 in place, and the apply passes: the blind spot.
    cur = w.apply([store.manifest("v00000003.delta")], getter(store))
    assert cur.version == 3 and w.current() == cur
    assert not same(load_file(cur.path / SHARD), states[3])
    assert w.damaged(3) == [NAME] and w.damaged(2) == []

    assert "set aside" in w.set_aside(3)
    assert w.current() is None and (w.root / ".bad-v00000003").is_dir()
    cur = w.apply(store.plan(None, 3), getter(store))  # rebuilt from the snapshot
    assert cur.version == 3 and w.verify() == cur
    assert same(load_file(cur.path / SHARD), states[3])


def test_a_damaged_spare_is_deleted_and_the_next_version_written_whole(tmp_path,
                                                                       signing_key) -> None:
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 3)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    w.apply([store.manifest("v00000002.delta")], getter(store))
    _flip_low_bit(w.path(1), NAME, _unchanged_index(states, NAME))
    assert "deleted" in w.set_aside(1)
    assert w.versions() == [2] and w.current().version == 2
    cur = w.apply([store.manifest("v00000003.delta")], getter(store))
    assert w.verify() == cur and same(load_file(cur.path / SHARD), states[3])


def test_a_tensor_the_directory_does_not_hold_counts_as_damaged(tmp_path, signing_key) -> None:
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 1)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    assert w.damaged(1, ["no.such.tensor"]) == ["no.such.tensor"]


def test_a_state_digest_that_disagrees_with_its_tensors_is_damage(tmp_path, signing_key) -> None:
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 1)
    w = WeightsDir(tmp_path / "w")
    cur = w.apply(store.plan(None, 1), getter(store))
    assert w.is_current(1) and not w.is_current(0)
    info = read_info(cur.path)
    write_info(cur.path, info.__class__(info.version, "0" * len(info.state_digest), info.run,
                                        info.tensors), None)
    assert w.damaged(1) == [STATE_DIGEST]
    assert w.damaged(1, [STATE_DIGEST]) == [STATE_DIGEST]  # the re-check reads no tensor
    write_info(cur.path, info, None)
    assert w.damaged(1, [STATE_DIGEST]) == [] and w.damaged(1) == []
    assert w.is_current(1)  # read from the link: answers whatever VERSION.json holds
