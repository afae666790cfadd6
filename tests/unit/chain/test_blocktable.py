"""A manifest's blocks held as columns: same bytes, same refusals, a fraction of the memory."""

import tracemalloc

import pytest

from chain.blocktable import BlockTable
from chain.manifest import BlockEntry

SNAPSHOT_BLOCKS = 119_210
"""A 1 TB snapshot in 8 MiB blocks."""


def rows(n: int) -> list[dict]:
    return [{"id": f"{i:032x}", "size": 8 << 20, "root": f"{i:064x}"} for i in range(n)]


def test_a_table_reads_and_dumps_as_the_entries_it_was_made_of():
    r = rows(50)
    table = BlockTable.of(r)
    entries = [BlockEntry.model_validate(x) for x in r]
    assert table.as_dicts() == r and table == entries and entries == list(table)
    assert table[3] == entries[3] and table[-1].id == r[-1]["id"]
    assert table.ids() == [x["id"] for x in r] and table.total() == 50 * (8 << 20)
    assert BlockTable.of(entries) == table and table[2:4] == entries[2:4]


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda r: r.update(id="xyz"), r"blocks\.2\.id"),
    (lambda r: r.update(size=0), r"blocks\.2\.size"),
    (lambda r: r.update(size=(64 << 20) + 1), r"blocks\.2\.size"),
    (lambda r: r.update(size=True), r"blocks\.2\.size"),
    (lambda r: r.update(root="0" * 63), r"blocks\.2\.root"),
    (lambda r: r.update(more=1), r"blocks\.2\.more"),
])
def test_a_bad_entry_is_refused_by_its_index_and_field(mutate, message):
    r = rows(4)
    mutate(r[2])
    with pytest.raises(ValueError, match=message):
        BlockTable.of(r)


def test_a_1tb_snapshots_blocks_cost_under_80_bytes_each():
    """Pydantic entries cost ~700 bytes a block: 80 MiB for one 1 TB snapshot manifest."""
    r = rows(SNAPSHOT_BLOCKS)
    tracemalloc.start()
    try:
        table = BlockTable.of(r)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held / SNAPSHOT_BLOCKS < 80, f"{held / SNAPSHOT_BLOCKS:.0f} B per block"
    assert len(table) == SNAPSHOT_BLOCKS


def test_rows_are_read_only():
    row = BlockTable.of(rows(2))[0]
    with pytest.raises(AttributeError, match="read-only"):
        row.id = "ab"
