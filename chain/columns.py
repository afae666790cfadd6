"""What the manifest's column tables share (chain/tensortable.py, chain/blocktable.py).

Each table holds one list of a manifest (its tensors, its blocks) as columns, reads as the
sequence of rows it replaces, and is a pydantic field that validates the JSON list and dumps
back to it unchanged (the manifest's signed bytes). This base gives both the sequence protocol,
equality with a table or a plain list of entries, and the pydantic glue; each table gives its
rows, its JSON form and its checks.
"""

from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError
from pydantic_core import core_schema


class Columns(Sequence):
    """A manifest list held as columns. Subclasses define `WHAT` (the manifest field),
    `__len__`, `_row(i)`, `__iter__`, `as_dicts()`, `_same(other)` and `of(rows)`."""

    __slots__ = ()
    WHAT: ClassVar[str]

    def _row(self, i: int) -> Any:
        raise NotImplementedError

    def _same(self, other: "Columns") -> bool:
        raise NotImplementedError

    def as_dicts(self) -> list[dict]:
        raise NotImplementedError

    @classmethod
    def of(cls, rows: Any) -> "Columns":
        raise NotImplementedError

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._row(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.WHAT} index {i} out of range for {n} {self.WHAT}")
        return self._row(i % n)

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self._same(other)  # type: ignore[arg-type]
        if isinstance(other, Sequence) and not isinstance(other, str | bytes | Columns):
            return len(self) == len(other) and all(
                a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} {self.WHAT})"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._validate,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda t: t.as_dicts(), when_used="always"))

    @classmethod
    def _validate(cls, value: Any) -> "Columns":
        if isinstance(value, cls):
            return value
        if not isinstance(value, list | tuple):
            raise ValueError(f"{cls.WHAT} must be a list of entries, got {type(value).__name__}")
        return cls.of(value)


def refusal(what: str, i: int, model: type[BaseModel], row: Any) -> str | None:
    """Why entry `i` of the manifest list `what` is refused, in `model`'s own words (pydantic's
    message and field path); None if `model` takes it."""
    try:
        model.model_validate(row)
    except ValidationError as e:
        err = e.errors()[0]
        return f"{what}.{'.'.join(str(p) for p in (i, *err['loc']))}: {err['msg']}"
    return None
