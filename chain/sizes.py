"""How big a version is, stated honestly: its tensor payload and its carried files apart.

An artifact's blocks are of two kinds: the tensor record stream (what the codec made of the
weights) and the files a version carries besides tensors (config.json, tokenizer.json, ...,
`Manifest.files`). Every version lists its carried files again, but they are content-addressed
blocks: an unchanged tokenizer is the same block id in every version, stored once, and a node
that holds it does not fetch it again. Counted into each version's size, the carried files were
71-78 % of every delta listed for a 22.7M-parameter model, which looked 45x smaller than a full
checkpoint where its tensors were 154-231x smaller (issue 22). So sizes are shown as two
numbers, and "x smaller" and "saved" are computed on tensors only.
"""

from collections.abc import Iterable
from dataclasses import dataclass

from chain.manifest import Manifest


@dataclass(frozen=True)
class Sizes:
    """One artifact's sizes, from its manifest."""

    tensor_bytes: int
    """The tensor payload: the record stream's blocks."""
    file_bytes: int
    """The carried files' blocks, each distinct content once."""
    dense_bytes: int
    """Every tensor uncompressed: what the tensors of a full checkpoint of this version weigh."""

    @classmethod
    def of(cls, m: Manifest) -> "Sizes":
        tensors = sum(b.size for b in m.stream_blocks)
        return cls(tensor_bytes=tensors, file_bytes=m.payload_bytes - tensors,
                   dense_bytes=sum(t.nbytes for t in m.tensors))

    @property
    def total(self) -> int:
        """All the artifact's blocks (`Manifest.payload_bytes`)."""
        return self.tensor_bytes + self.file_bytes

    @property
    def smaller(self) -> float | None:
        """Dense tensor bytes over tensor payload bytes ("x smaller", on tensors); None when the
        artifact has no tensor payload (a version that changed nothing)."""
        return self.dense_bytes / self.tensor_bytes if self.tensor_bytes else None

    def describe(self) -> str:
        """`12,510 B tensors + 816,000 B carried files`: exact, for logs and messages."""
        return f"{self.tensor_bytes:,} B tensors + {self.file_bytes:,} B carried files"


def file_blocks(m: Manifest) -> dict[str, int]:
    """The blocks holding `m`'s carried files: id -> size."""
    ids = {f.block for f in m.files}
    return {b.id: b.size for b in m.blocks if b.id in ids}


def new_file_bytes(m: Manifest, before: Iterable[Manifest]) -> int:
    """Bytes of `m`'s carried files in blocks none of `before` lists: what changed in them
    (their content) since those versions; unchanged files are the same blocks."""
    seen = {bid for p in before for bid in file_blocks(p)}
    return sum(size for bid, size in file_blocks(m).items() if bid not in seen)

