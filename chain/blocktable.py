"""A manifest's block list held as columns, not as one object per block.

A 1 TB snapshot lists ~120,000 blocks of 8 MiB; as pydantic objects (`BlockEntry`) they held
~80 MiB of a daemon's memory for one parsed manifest (bench/fleet.py `parsed_mib`). Here a
block is 16 bytes of id, 8 of size and 32 of pieces root. The table reads as the list of
`BlockEntry` it replaces, validates a JSON list with `BlockEntry`'s rules (a bad entry is
re-checked by `BlockEntry` for pydantic's message) and dumps back to the same list, so the
manifest's signed bytes are unchanged (chain/columns.py: what this and the tensor table
share).
"""

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from chain.columns import Columns, refusal

MAX_SIZE = 64 * 1024 * 1024
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_KEYS = frozenset(("id", "size", "root"))


class BlockRow:
    """One block of a table, as read: id, size and root like `BlockEntry`, cheap to make."""

    __slots__ = ("id", "root", "size")

    def __init__(self, id: str, size: int, root: str) -> None:
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "root", root)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"a block row is read-only (set {key!r}): build a new table")

    def model_dump(self, **_: Any) -> dict:
        return {"id": self.id, "size": self.size, "root": self.root}

    def __eq__(self, other: object) -> bool:
        try:
            return (self.id, self.size, self.root) == (other.id, other.size, other.root)  # type: ignore
        except AttributeError:
            return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockRow(id={self.id!r}, size={self.size}, root={self.root!r})"


class BlockTable(Columns):
    """The blocks of a manifest, in order."""

    __slots__ = ("_ids", "_roots", "_sizes")
    WHAT = "blocks"

    def __init__(self, ids: bytes, sizes: np.ndarray, roots: bytes) -> None:
        self._ids, self._sizes, self._roots = ids, sizes, roots

    @classmethod
    def of(cls, rows: Iterable[Any]) -> "BlockTable":
        """A table from `BlockEntry` objects, rows, or dicts as JSON has them (checked as
        `BlockEntry` checks them; ValueError names the first bad one)."""
        if isinstance(rows, BlockTable):
            return rows
        from chain.manifest import BlockEntry

        ids: list[str] = []
        sizes: list[int] = []
        roots: list[str] = []
        for i, row in enumerate(rows):
            if type(row) is BlockEntry or type(row) is BlockRow:
                bid, size, root = row.id, row.size, row.root
            elif type(row) is dict and row.keys() == _KEYS and _plain(row):
                bid, size, root = row["id"], row["size"], row["root"]
            else:
                raise ValueError(_why(i, row))
            ids.append(bid)
            sizes.append(size)
            roots.append(root)
        table = cls(bytes.fromhex("".join(ids)), np.array(sizes, np.int64),
                    bytes.fromhex("".join(roots)))
        if len(table._ids) != 16 * len(sizes) or len(table._roots) != 32 * len(sizes):
            raise ValueError("block ids or roots of the wrong length")
        return table

    def __len__(self) -> int:
        return len(self._ids) // 16

    def _row(self, i: int) -> BlockRow:
        return BlockRow(self._ids[16 * i:16 * i + 16].hex(), int(self._sizes[i]),
                        self._roots[32 * i:32 * i + 32].hex())

    def __iter__(self) -> Iterator[BlockRow]:
        for bid, size, root in zip(self.ids(), self._sizes.tolist(), self._roots_hex(),
                                   strict=True):
            yield BlockRow(bid, size, root)

    def ids(self) -> list[str]:
        raw = self._ids.hex()
        return [raw[k:k + 32] for k in range(0, len(raw), 32)]

    def _roots_hex(self) -> list[str]:
        raw = self._roots.hex()
        return [raw[k:k + 64] for k in range(0, len(raw), 64)]

    def total(self) -> int:
        """The bytes of every block together."""
        return int(self._sizes.sum())

    def as_dicts(self) -> list[dict]:
        return [{"id": b, "size": s, "root": r} for b, s, r in
                zip(self.ids(), self._sizes.tolist(), self._roots_hex(), strict=True)]

    def _same(self, other: "BlockTable") -> bool:
        return self._ids == other._ids and self._roots == other._roots \
            and np.array_equal(self._sizes, other._sizes)


def _plain(row: dict) -> bool:
    """The fast check of one JSON entry: what BlockEntry's strict schema accepts."""
    bid, size, root = row["id"], row["size"], row["root"]
    return (type(bid) is str and _HEX32.fullmatch(bid) is not None and type(size) is int
            and 0 < size <= MAX_SIZE and type(root) is str
            and _HEX64.fullmatch(root) is not None)


def _why(i: int, row: Any) -> str:
    """Why entry `i` is refused, in BlockEntry's own words."""
    from chain.manifest import BlockEntry

    return refusal("blocks", i, BlockEntry, row) or f"blocks.{i}: not a block entry"
