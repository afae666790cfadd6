"""The chain store shared between the event loop and worker threads (asyncio.to_thread: sync's
manifest adds, retention's gc): readers never see a dict change size under them (issue: a region
crashed in `ChainStore.head()` while a thread's gc dropped artifacts)."""

import sys
import threading

from chain.policy import Retention
from chain.store import ChainStore
from tests.unit.chain.test_store import build_chain

ROUNDS = 25


def test_readers_survive_concurrent_add_and_gc(tmp_path, signing_key):
    source = ChainStore(tmp_path / "src", signing_key.public_key())
    build_chain(source, signing_key, 12, snapshot_every=4)
    raws = [source.manifest_bytes(a) for a in sorted(source.artifacts(),
                                                       key=lambda a: source.manifest(a).version)]
    store = ChainStore(tmp_path / "dst", signing_key.public_key())
    # The blocks travel too, so gc only drops manifests (what the readers iterate over).
    for bid in source.blocks.ids():
        store.blocks.put(source.blocks.get(bid))
    stop = threading.Event()
    errors: list[BaseException] = []
    reads = [0]

    def writer() -> None:
        try:
            for _ in range(ROUNDS):
                for raw in raws:
                    store.add_manifest(raw)
                store.gc(Retention(versions=1, behind_budget_bytes=0))
                # Keep every block: the next round re-adds the manifests that reference them.
                for bid in source.blocks.ids() - store.blocks.ids():
                    store.blocks.put(source.blocks.get(bid))
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            stop.set()

    def reader() -> None:
        try:
            while not stop.is_set():
                store.head()
                store.run()
                store.artifacts()
                store.manifests()
                store.gc(Retention(versions=100), protect=store.artifacts())
                reads[0] += 1
        except BaseException as e:  # reported below
            errors.append(e)
            stop.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=writer), *(threading.Thread(target=reader)
                                                      for _ in range(3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not errors, f"{type(errors[0]).__name__}: {errors[0]}"
    assert reads[0] > 0
    assert store.head() == 12
