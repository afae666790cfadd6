"""Atomic file writes: temporary file in the same directory, fsync, rename, fsync the directory.

Every file deltaswarm stores goes through here, so a process killed at any instant leaves either
the old file or the new one, never a torn one.
"""

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: Path, mode: int | None = None, durable: bool = True
                  ) -> Iterator[BinaryIO]:
    """Yield a binary file; on clean exit it replaces `path` atomically, on error it vanishes.
    `mode`: permission bits for the file (default: mkstemp's 0600). `durable=False` skips the
    fsyncs: the rename is still atomic against a killed process, not against power loss."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes | memoryview, mode: int | None = None,
                 durable: bool = True) -> None:
    with atomic_writer(path, mode, durable) as f:
        f.write(data)


def symlink_atomic(target: str, link: Path) -> None:
    """Point `link` at `target` atomically (create a temp link, rename over the old one)."""
    link = Path(link)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)
