"""Shared-memory files a process group holds, so stopping the group can remove what it leaves.

vLLM's engine core and API server talk through POSIX shared memory (`/dev/shm/psm_*`, hundreds
of MB) and semaphores (`/dev/shm/sem.mp-*`). Python's resource tracker unlinks them on a clean
exit, but a server that has to be killed (SIGKILL, or its children after the parent left) leaves
them behind, and each leftover is RAM the host never gets back until reboot. The only reliable
record of which files are *this* server's is what its processes have open or mapped, so
`held_by_group` reads /proc before the kill and `remove` unlinks those paths after it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def group_pids(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """PIDs whose process group is `pgid` (field 5 of /proc/PID/stat, after the comm's ')')."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


def held_by(pid: int, shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> set[Path]:
    """Files under `shm_dir` that process `pid` has mapped or open (already unlinked ones, which
    /proc marks " (deleted)", are not: their name may since belong to another file)."""
    prefix, held = str(shm_dir) + "/", set()
    with contextlib.suppress(OSError):
        for line in (proc / str(pid) / "maps").read_text().splitlines():
            parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = parts[5] if len(parts) == 6 else ""
            if path.startswith(prefix) and not path.endswith(" (deleted)"):
                held.add(Path(path))
    with contextlib.suppress(OSError):
        for fd in (proc / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith(prefix) and not target.endswith(" (deleted)"):
                    held.add(Path(target))
    return held


def held_by_any(shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> set[Path]:
    """Files under `shm_dir` any live process has mapped or open."""
    held: set[Path] = set()
    for entry in proc.iterdir():
        if entry.name.isdigit():
            held |= held_by(int(entry.name), shm_dir, proc)
    return held


def held_by_group(pgid: int, shm_dir: Path = SHM_DIR) -> set[Path]:
    """Every file under `shm_dir` any process of group `pgid` has mapped or open right now."""
    held: set[Path] = set()
    for pid in group_pids(pgid):
        held |= held_by(pid, shm_dir)
    return held


def remove(paths: set[Path]) -> list[Path]:
    """Unlink those of `paths` still present that no live process holds (the group is gone; a
    segment the server only attached to, created and still used by another process, stays);
    returns what was removed."""
    removed, live = [], held_by_any()
    for path in sorted(paths - live):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed
