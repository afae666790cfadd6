"""trainer.consume.Trajectories on a store the real IngestStore wrote: order, whole GRPO
groups on request, ack and rewind bounds, and a clear error for a wrong directory."""

from pathlib import Path

import pytest

from tests.trajectories import batch, ids, rows
from trainer.consume import Trajectories
from trainer.ingest import IngestStore, IngestStoreError


async def _store(root: Path, items: list[dict]) -> None:
    store = IngestStore(root, keep_pending=False)
    await store.append(rows(items))
    store.close()


async def test_whole_groups_completes_a_group_cut_by_n(tmp_path: Path) -> None:
    items = batch(12)
    for i, t in enumerate(items):
        t["group"] = f"g{i // 4}"
    await _store(tmp_path, items)
    with Trajectories(tmp_path) as t:
        assert [x["id"] for x in t.next(5, whole_groups=True)] == ids(items)[:8]
        assert [x["id"] for x in t.next(1)] == ids(items)[8:9]
        assert t.waiting() == 3 and t.held() == 12


async def test_ack_persists_and_rewind_is_bounded(tmp_path: Path) -> None:
    items = batch(6)
    await _store(tmp_path, items)
    with Trajectories(tmp_path) as t:
        t.next(4)
        assert t.ack() == 4
        with pytest.raises(ValueError, match=r"outside 0\.\.6"):
            t.rewind_to(7)
        with pytest.raises(ValueError, match="n must be at least 1"):
            t.next(0)
    with Trajectories(tmp_path) as t:
        assert t.acked == 4 and [x["id"] for x in t.next(10)] == ids(items)[4:]
    assert IngestStore(tmp_path, keep_pending=False).stats()["consumed"] == 4


def test_a_directory_without_a_store_is_named(tmp_path: Path) -> None:
    with pytest.raises(IngestStoreError, match="does not exist"):
        Trajectories(tmp_path / "nowhere")
