"""Content-addressed block store: immutable blobs named by the xxh3-128 of their bytes.

Blocks are what the swarm moves, so their size is bounded (`MAX_BLOCK`) and every read is
verified: a block whose bytes no longer match its name is reported, never returned.
"""

import contextlib
import os
import re
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path

from chain.atomic import write_atomic
from chain.digest import block_id
from chain.errors import BadBlock

MAX_BLOCK = 64 * 1024 * 1024
DEFAULT_BLOCK = 8 * 1024 * 1024
_ID = re.compile(r"^[0-9a-f]{32}$")


def check_id(bid: str) -> str:
    if not isinstance(bid, str) or not _ID.match(bid):
        raise BadBlock(f"invalid block id {bid!r}: expected 32 lowercase hex digits (xxh3-128)")
    return bid


class BlockStore:
    """Blocks at `root/ab/<id>`; `put` is atomic and idempotent.

    `lock`: the chain directory's lock (chain.lease), held while a block already stored is
    claimed again (its mtime refreshed), so a retention pass sparing what write leases cover
    either sees the fresh mtime or has deleted the block before `put` writes it anew."""

    def __init__(self, root: Path, lock: AbstractContextManager | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = lock

    def path(self, bid: str) -> Path:
        check_id(bid)
        return self.root / bid[:2] / bid

    def has(self, bid: str) -> bool:
        return self.path(bid).is_file()

    def put(self, data: bytes | memoryview) -> str:
        if len(data) > MAX_BLOCK:
            raise BadBlock(f"block of {len(data)} bytes exceeds the {MAX_BLOCK}-byte limit")
        bid = block_id(data)
        path = self.path(bid)
        if not path.exists() or self.claim([bid]):  # new, or gone before it could be claimed
            write_atomic(path, data)
        return bid

    def claim(self, ids: Iterable[str]) -> list[str]:
        """Mark blocks already stored as written now (mtime), for the write lease of the
        version about to use them; returns those of `ids` not in the store."""
        missing = []
        with self.lock or contextlib.nullcontext():
            for bid in ids:
                try:
                    os.utime(self.path(bid))
                except FileNotFoundError:
                    missing.append(bid)
                except PermissionError:  # another user's file: rewritten as ours (put), so
                    missing.append(bid)  # its mtime, which the write lease counts, is now
        return missing

    def mtime(self, bid: str) -> float | None:
        try:
            return self.path(bid).stat().st_mtime
        except FileNotFoundError:
            return None

    def get(self, bid: str, size: int | None = None) -> bytes:
        path = self.path(bid)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BadBlock(f"block {bid} is not in the store at {self.root}") from None
        if size is not None and len(data) != size:
            raise BadBlock(f"block {bid} has {len(data)} bytes, the manifest says {size}")
        if block_id(data) != bid:
            raise BadBlock(f"block {bid} is corrupt on disk ({path}); delete it to refetch")
        return data

    def adopt(self, bid: str, src: Path, size: int | None = None) -> None:
        """Move a downloaded file into the store after checking its content (hard link if
        possible, so a seeding copy keeps serving)."""
        data = Path(src).read_bytes()
        if (size is not None and len(data) != size) or block_id(data) != bid:
            raise BadBlock(f"downloaded file {src} does not match block {bid}")
        dst = self.path(bid)
        if dst.exists():
            return
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            write_atomic(dst, data)

    def delete(self, bid: str) -> None:
        self.path(bid).unlink(missing_ok=True)

    def ids(self) -> set[str]:
        return {p.name for p in self.root.glob("??/*") if _ID.match(p.name)}
