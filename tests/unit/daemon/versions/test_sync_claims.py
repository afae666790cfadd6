"""A peer's head claim is checked only as far as the step fetched: a claim raised past the step's
target while the step ran (versions every second or two) is not a lie. The chaos run banned an
innocent region for it: two "refuted claims" while it caught up at 1.5 s a version."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from chain import keys
from chain.store import ChainStore
from daemon.versions.sync import Syncer
from trainer.publisher import Publisher


class _Client:
    """Serves the peer's index (the artifacts it lists) and manifests from a real chain."""

    def __init__(self, chain: ChainStore, listed: list[str]) -> None:
        self.chain, self.listed = chain, listed

    async def get_json(self, url: str, what: str, **kw) -> dict:
        return {"artifacts": self.listed}

    async def get(self, url: str, what: str, **kw) -> bytes:
        name = url.rsplit("/", 1)[1]
        return self.chain.manifests()[name].to_bytes()


class _Book:
    def __init__(self) -> None:
        self.lies: list[str] = []

    def succeeded(self, peer) -> None:
        pass

    def lied(self, peer, why: str) -> None:
        self.lies.append(why)


def _syncer(tmp_path: Path, peer_chain: ChainStore, listed: list[str], public) -> Syncer:
    s = Syncer.__new__(Syncer)  # only what fetch_manifests touches
    s.store = ChainStore(tmp_path / "mine", public)
    s.client, s.book = _Client(peer_chain, listed), _Book()
    s.refused_counts, s._refused_at, s.refused = {}, {}, []
    s._index_params = lambda: None
    s._learn_from_index = lambda peer, index: None

    async def bump() -> None:
        pass

    s.board = SimpleNamespace(bump=bump)

    async def ask(version, from_peer, settle=True):
        return await from_peer(s.peer)

    s.ask_sparing_trainer = ask
    return s


async def test_a_claim_raised_past_the_target_is_not_a_lie_but_an_unbacked_one_is(
        tmp_path: Path) -> None:
    key = keys.generate(tmp_path / "k")
    pub = Publisher(tmp_path / "peer", tmp_path / "k", run="r")
    for v in range(4):
        pub.publish(v, {"w": torch.full((64,), float(v)).bfloat16()})
    names = sorted(pub.store.manifests())
    # the step aimed at v2; meanwhile the peer announced v3 (its head watcher raised the claim)
    s = _syncer(tmp_path / "a", pub.store, names, key.public_key())
    s.peer = SimpleNamespace(url="http://peer", head=3)
    await s.fetch_manifests(target=2, cur=None)
    assert s.store.head() == 2 and s.book.lies == []
    # a peer claiming v2 whose index lists nothing past v1 is struck
    s = _syncer(tmp_path / "b", pub.store, [n for n in names if n < "v00000002"],
                key.public_key())
    s.peer = SimpleNamespace(url="http://peer", head=2)
    await s.fetch_manifests(target=2, cur=None)
    assert s.store.head() == 1
    assert s.book.lies == ["claimed head v2 but served no valid manifest of v2"]
