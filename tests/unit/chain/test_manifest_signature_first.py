"""A manifest's signature is checked before anything else reads it: forged or unsigned documents
are refused without schema validation (its cost is the attacker's lever), and hostile JSON
(deep nesting, NaN) is a clean refusal, never a RecursionError or ValueError."""

import json

import pytest

from chain.blocks import BlockStore
from chain.errors import BadManifest, BadSignature
from chain.manifest import Manifest
from chain.sources import StateDictSource
from chain.writer import write_artifact
from tests.conftest import make_state


@pytest.fixture
def signed_doc(tmp_path, signing_key) -> dict:
    m, _ = write_artifact(BlockStore(tmp_path / "blocks"), signing_key, run="r1", version=0,
                          kind="snapshot", new=StateDictSource(make_state()))
    return json.loads(m.to_bytes())


@pytest.fixture
def no_validation(monkeypatch):
    """Fails the test if the schema validation runs."""
    def refuse(*a, **k):
        raise AssertionError("schema validation ran before the signature was checked")
    monkeypatch.setattr(Manifest, "model_validate", refuse)


def test_a_signed_manifest_still_parses(signed_doc, signing_key):
    m = Manifest.parse(json.dumps(signed_doc).encode(), signing_key.public_key())
    assert m.version == 0 and m.signature is not None


@pytest.mark.parametrize("forge", [
    lambda d: d["signature"].update(sig="00" * 64),                      # forged signature
    lambda d: d.update(tensors=d["tensors"] * 1000),                     # padded after signing
    lambda d: d.update(kind="weird", blocks="x"),                        # invalid and unsigned-for
    lambda d: d.pop("signature"),                                        # unsigned
    lambda d: d.update(signature={"key": 5}),                            # signature not hex
    lambda d: d["signature"].update(key="ab" * 32),                      # another key
], ids=["forged-sig", "padded", "invalid-fields", "unsigned", "sig-not-hex", "other-key"])
def test_forged_manifests_are_refused_before_schema_validation(signed_doc, signing_key, forge,
                                                               no_validation):
    forge(signed_doc)
    with pytest.raises(BadSignature):
        Manifest.parse(json.dumps(signed_doc).encode(), signing_key.public_key())


def test_a_nan_in_a_signed_looking_manifest_is_a_bad_signature(signed_doc, signing_key):
    signed_doc["created"] = float("nan")
    with pytest.raises(BadSignature, match="NaN"):
        Manifest.parse(json.dumps(signed_doc).encode(), signing_key.public_key())


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"format": 1, "a": ' + b"[" * 100_000])
def test_deeply_nested_json_is_a_bad_manifest_not_a_recursion_error(raw, signing_key):
    for key in (None, signing_key.public_key()):
        with pytest.raises(BadManifest, match="not valid JSON"):
            Manifest.parse(raw, key)
