"""Manifests a region refuses: unsigned, signed by another key, replayed (a different manifest for
an artifact already held) and wrong-parent ones never change the stored chain, and each refusal
is reported with its kind in /v1/status (in process, through the real aiohttp app)."""

import json
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from chain import keys
from chain.blocks import BlockStore
from chain.manifest import Manifest
from chain.sources import StateDictSource
from chain.writer import write_artifact
from daemon.app import build_app
from daemon.config import load_config
from daemon.node import Node
from tests.integration.harness import TOKEN, step, tiny_model


def chain_of(key, blocks: BlockStore, seed: int, n: int) -> list[Manifest]:
    state = tiny_model(seed, tensors=2, rows=64, cols=128)
    out = []
    m, _ = write_artifact(blocks, key, run="r", version=0, kind="snapshot",
                          new=StateDictSource(state))
    out.append(m)
    for v in range(1, n):
        new = step(state, v)
        m, _ = write_artifact(blocks, key, run="r", version=v, kind="delta",
                              new=StateDictSource(new), parent=StateDictSource(state),
                              parent_manifest=out[-1])
        out.append(m)
        state = new
    return out


def region_node(tmp_path: Path, public_hex: str) -> Node:
    (tmp_path / "state").mkdir()
    cfg_path = tmp_path / "region.yaml"
    cfg_path.write_text(f"node: r1\nregion: r1\nrole: region\nstate_dir: {tmp_path / 'state'}\n"
                        f"trainer_public_key: {public_hex}\ntoken: {TOKEN}\n")
    return Node(load_config(cfg_path), cfg_path)


async def test_bad_manifests_are_refused_reported_and_change_nothing(tmp_path: Path) -> None:
    key = keys.generate(tmp_path / "trainer.key")
    other = keys.generate(tmp_path / "other.key")
    blocks = BlockStore(tmp_path / "scratch")
    good = chain_of(key, blocks, seed=1, n=2)
    alt = chain_of(key, blocks, seed=2, n=3)
    node = region_node(tmp_path, keys.public_hex(key))
    syncer = node.syncer
    peer = "http://127.0.0.1:1"
    for m in good:
        assert syncer._add_manifest(peer, m.artifact, m.to_bytes()) is not None
    before = {a: node.store.manifest_bytes(a) for a in node.store.artifacts()}

    unsigned = alt[2].model_copy(update={"signature": None})
    foreign = alt[2].model_copy(update={"signature": None}).signed(other)
    cases = {
        "unsigned": unsigned.to_bytes(),
        "bad_signature": foreign.to_bytes(),
        "replay": alt[1].to_bytes(),
        "wrong_parent": alt[2].to_bytes(),
    }
    for kind, raw in cases.items():
        name = json.loads(raw)["version"]
        art = f"v{name:08d}.delta"
        assert syncer._add_manifest(peer, art, raw) is None, kind
    # the same manifest again (an old, already held one) is accepted idempotently
    assert syncer._add_manifest(peer, good[1].artifact, good[1].to_bytes()) is not None
    # a peer serving a different artifact than asked for
    assert syncer._add_manifest(peer, "v00000007.delta", good[1].to_bytes()) is None

    after = {a: node.store.manifest_bytes(a) for a in node.store.artifacts()}
    assert after == before
    assert sorted(p.name for p in node.paths.chain.joinpath("manifests").iterdir()) == \
        sorted(f"{a}.json" for a in before)

    async with TestClient(TestServer(build_app(node.parts))) as client:
        r = await client.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status == 200
        unauth = await client.get("/v1/status")
        assert unauth.status == 401
        status = await r.json()
    by_kind = status["refused_by_kind"]
    for kind in ("unsigned", "bad_signature", "replay", "wrong_parent"):
        assert by_kind.get(kind) == 1, (kind, by_kind)
    assert status["refused_total"] == 5
    reasons = {r["kind"]: r["reason"] for r in status["refused_manifests"]}
    assert "unsigned" in reasons["unsigned"]
    assert "wrong parent" in reasons["wrong_parent"]
    assert all(r["source"] == peer for r in status["refused_manifests"])
