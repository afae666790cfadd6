"""A manifest's block list held as columns, not as one object per block.

A 1 TB snapshot lists ~120,000 blocks of 8 MiB; as pydantic objects (`BlockEntry`) they held
~80 MiB of a daemon's memory for one parsed manifest (bench/fleet.py `parsed_mib`). Here a
block is 16 bytes of id, 8 of size and 32 of pieces root. The table reads as the list of
`BlockEntry` it replaces, validates a JSON list with `BlockEntry`'s rules (a bad entry is
re-checked by `BlockEntry` for pydantic's message) and dumps back to the same list, so the
manifest's signed bytes are unchanged (the same scheme as chain/tensortable.py).
"""

import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np
from pydantic import ValidationError
from pydantic_core import core_schema

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


class BlockTable(Sequence):
    """The blocks of a manifest, in order."""

    __slots__ = ("_ids", "_roots", "_sizes")

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

    @overload
    def __getitem__(self, i: int) -> BlockRow: ...
    @overload
    def __getitem__(self, i: slice) -> list[BlockRow]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._row(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"block index {i} out of range for {n} blocks")
        return self._row(i % n)

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

    def nbytes(self) -> int:
        return len(self._ids) + self._sizes.nbytes + len(self._roots)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTable):
            return self._ids == other._ids and self._roots == other._roots \
                and np.array_equal(self._sizes, other._sizes)
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(
                a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockTable({len(self)} blocks)"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._validate,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda t: t.as_dicts(), when_used="always"))

    @classmethod
    def _validate(cls, value: Any) -> "BlockTable":
        if isinstance(value, BlockTable):
            return value
        if not isinstance(value, list | tuple):
            raise ValueError(f"blocks must be a list of entries, got {type(value).__name__}")
        return cls.of(value)


def _plain(row: dict) -> bool:
    """The fast check of one JSON entry: what BlockEntry's strict schema accepts."""
    bid, size, root = row["id"], row["size"], row["root"]
    return (type(bid) is str and _HEX32.fullmatch(bid) is not None and type(size) is int
            and 0 < size <= MAX_SIZE and type(root) is str
            and _HEX64.fullmatch(root) is not None)


def _why(i: int, row: Any) -> str:
    from chain.manifest import BlockEntry

    try:
        BlockEntry.model_validate(row)
    except ValidationError as e:
        err = e.errors()[0]
        return f"blocks.{'.'.join(str(p) for p in (i, *err['loc']))}: {err['msg']}"
    return f"blocks.{i}: not a block entry"
