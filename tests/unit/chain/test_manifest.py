"""Manifests: canonical signing, and refusal of every malformed or forged field."""

import json

import pytest

from chain import keys
from chain.blocks import BlockStore
from chain.errors import BadManifest, BadSignature
from chain.manifest import Manifest
from chain.sources import StateDictSource
from chain.writer import write_artifact
from tests.conftest import make_state, perturb


@pytest.fixture
def snapshot(tmp_path, signing_key):
    blocks = BlockStore(tmp_path / "blocks")
    m, _ = write_artifact(blocks, signing_key, run="r1", version=0, kind="snapshot",
                          new=StateDictSource(make_state()), files={"config.json": b"{}"})
    return m


def _doc(m: Manifest) -> dict:
    return json.loads(m.to_bytes())


def test_signed_manifest_round_trips(snapshot, signing_key):
    parsed = Manifest.parse(snapshot.to_bytes(), signing_key.public_key())
    assert parsed == snapshot
    assert parsed.to_bytes() == snapshot.to_bytes()


def test_unsigned_manifest_is_refused(snapshot, signing_key):
    raw = snapshot.model_copy(update={"signature": None}).to_bytes()
    with pytest.raises(BadSignature, match="unsigned"):
        Manifest.parse(raw, signing_key.public_key())


def test_manifest_signed_by_another_key_is_refused(snapshot, signing_key, tmp_path):
    other = keys.generate(tmp_path / "other.key")
    raw = snapshot.signed(other).to_bytes()
    with pytest.raises(BadSignature, match="not the pinned trainer key"):
        Manifest.parse(raw, signing_key.public_key())


def test_altered_field_breaks_the_signature(snapshot, signing_key):
    doc = _doc(snapshot)
    doc["created"] = doc["created"] + 1
    with pytest.raises(BadSignature, match="does not verify"):
        Manifest.parse(json.dumps(doc).encode(), signing_key.public_key())


def test_signature_with_the_right_key_id_but_forged_bytes_is_refused(snapshot, signing_key):
    doc = _doc(snapshot)
    doc["signature"]["sig"] = "00" * 64
    with pytest.raises(BadSignature):
        Manifest.parse(json.dumps(doc).encode(), signing_key.public_key())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format=4), "format 4 is not supported"),
        (lambda d: d.update(format=1), "format 1 was written by an older deltaswarm whose "
                                       "tensor digests"),
        (lambda d: d.update(version=-1), "version"),
        (lambda d: d.update(kind="weird"), "kind"),
        (lambda d: d["blocks"][0].update(id="xyz"), "blocks.0.id"),
        (lambda d: d["blocks"][0].update(size=0), "blocks.0.size"),
        (lambda d: d["tensors"][0].update(dtype="complex64"), "unsupported dtype"),
        (lambda d: d["tensors"][0].update(shape=[-1]), "tensors.0.shape"),
        (lambda d: d["tensors"].reverse(), "sorted by name"),
        (lambda d: d["tensors"][0].update(digest="0" * 32), "state_digest does not match"),
        (lambda d: d.update(parent={"version": 0, "state_digest": "0" * 32}), "no parent"),
        (lambda d: d.update(surprise=1), "surprise"),
        (lambda d: d["files"][0].update(name="../etc/passwd"), "files.0.name"),
    ],
)
def test_malformed_field_is_named_in_the_error(snapshot, mutate, message):
    doc = _doc(snapshot)
    mutate(doc)
    with pytest.raises(BadManifest, match=message):
        Manifest.parse(json.dumps(doc).encode(), None)


def test_non_json_and_truncated_manifests_are_refused(snapshot):
    raw = snapshot.to_bytes()
    for bad in (b"", b"[]", raw[: len(raw) // 2], b"\xff\xfe"):
        with pytest.raises(BadManifest):
            Manifest.parse(bad, None)


def test_delta_must_name_the_previous_version_as_parent(tmp_path, signing_key, snapshot):
    blocks = BlockStore(tmp_path / "blocks")
    s0 = make_state()
    m, _ = write_artifact(blocks, signing_key, run="r1", version=1, kind="delta",
                          new=StateDictSource(perturb(s0, 1)), parent=StateDictSource(s0),
                          parent_manifest=snapshot)
    doc = _doc(m)
    doc["version"] = 5
    with pytest.raises(BadManifest, match="must have parent v4"):
        Manifest.parse(json.dumps(doc).encode(), None)


def test_canonical_bytes_do_not_depend_on_key_order(snapshot, signing_key):
    doc = _doc(snapshot)
    shuffled = json.dumps(dict(reversed(list(doc.items()))), indent=2).encode()
    assert Manifest.parse(shuffled, signing_key.public_key()).canonical() == snapshot.canonical()
