"""Write leases: a publisher declares the version it is writing into a chain directory, and
retention, in whatever process it runs, never deletes what that version is made of.

Issue 20, finding 1: the trainer daemon runs retention on every `POST /v1/publish`, and
retention deleted every block no manifest named, including the blocks a publisher in another
process had written for the version it had not signed yet: the signed delta then lacked blocks,
nobody could serve the head, and every later publish failed.

A lease is a file `<chain>/writing/vNNNNNNNN-<pid>-<nonce>.json` saying who writes which version
since when. While any lease is live, retention deletes no block whose file was modified at or
after the oldest live lease's start (less `SLACK_S`, for coarse file clocks), and no block any
manifest file on disk names (`ChainStore.apply_decision`). A writer that reuses a block already
in the store refreshes its mtime under the chain lock (`BlockStore.put`, `BlockStore.claim`), so
such a block is either kept or already gone, and then written again. Leases are taken, and
retention runs, under the chain lock (`ChainLock`: `<chain>/.lock`, flock plus a thread lock), so
a retention pass never starts between a lease being taken and being seen.

A lease is live while its holder renews it (a thread touches the file every `ttl_s / 4`), or,
on the same machine and boot, while the holder process (pid and start time) exists: a paused
publisher (SIGSTOP, a debugger, swapping) keeps its blocks as long as it lives. A killed one's
lease stops counting `ttl_s` after its last renewal and is then removed by the next retention
pass. A holder on another host (a shared filesystem) that stops renewing for `ttl_s` loses it;
its commit then finds blocks missing and signs nothing (`ChainStore.add` raises `LostBlocks`).
"""

import contextlib
import fcntl
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from chain.atomic import write_atomic
from chain.errors import ChainError

log = logging.getLogger("deltaswarm.lease")

LEASE_DIR = "writing"
LOCK_FILE = ".lock"
DEFAULT_TTL_S = 120.0
"""A lease nobody renews stops counting after this long (unless its holder is seen alive)."""
RETENTION_WAIT_S = 10.0
"""How long a retention pass waits for the chain lock before it is skipped."""
SLACK_S = 60.0
"""Blocks modified up to this long before a live lease began are kept too (file clocks are
coarse, and on a shared filesystem the writer's clock is not the reader's)."""


class LostBlocks(ChainError):
    """A version's blocks vanished while it was written; nothing of it was signed."""


class ChainBusy(ChainError):
    """The chain lock stayed held too long for a retention pass; it was skipped."""


# --- the chain lock ------------------------------------------------------------------------
class ChainLock:
    """Exclusive across processes (flock on `<chain>/.lock`) and threads, re-entrant within a
    thread. Get it with `chain_lock(chain_dir)`: one instance per directory per process, so two
    stores of one directory in one process share it instead of deadlocking on two flocks."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._thread = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    def acquire(self, timeout: float | None = None) -> bool:
        """Take the lock; False if `timeout` seconds passed first (None: wait as long as it
        takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._thread.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            if self._depth == 0:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    if not _flock(fd, deadline):
                        os.close(fd)
                        self._thread.release()
                        return False
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            self._depth += 1
        except BaseException:
            self._thread.release()
            raise
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self._thread.release()

    @contextlib.contextmanager
    def within(self, timeout: float, what: str) -> Iterator[None]:
        """Hold the lock, or raise ChainBusy after `timeout` seconds (for housekeeping that
        can wait for its next turn: a paused publisher must not stall a daemon)."""
        if not self.acquire(timeout):
            raise ChainBusy(f"{what} skipped: {self.path} stayed locked for {timeout:g} s (a "
                            "publisher paused while committing?); it runs again next time")
        try:
            yield
        finally:
            self.release()

    def __enter__(self) -> "ChainLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _flock(fd: int, deadline: float | None) -> bool:
    if deadline is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


_locks: dict[Path, ChainLock] = {}
_locks_guard = threading.Lock()


def chain_lock(chain_dir: Path) -> ChainLock:
    path = Path(os.path.abspath(chain_dir)) / LOCK_FILE
    with _locks_guard:
        lock = _locks.get(path)
        if lock is None:
            lock = _locks[path] = ChainLock(path)
        return lock


# --- who holds a lease ---------------------------------------------------------------------
def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process, or no
    /proc); with the pid it names one process for the life of a boot."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class LeaseInfo:
    """A lease as another process reads it."""

    path: Path
    version: int | None
    pid: int | None
    host: str | None
    boot: str | None
    proc_start: int | None
    started: float
    ttl_s: float
    renewed: float
    """The file's mtime: the holder's last renewal."""

    def holder_alive(self) -> bool | None:
        """True/False when the holder runs on this machine and boot; None when that cannot be
        told (another host, no /proc)."""
        if self.pid is None or self.host != os.uname().nodename or self.boot is None \
                or self.boot != _boot_id():
            return None
        if self.proc_start is None:
            return _pid_exists(self.pid)
        return _proc_start(self.pid) == self.proc_start

    def live(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return now - self.renewed < self.ttl_s or self.holder_alive() is True

    def as_status(self, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        return {"version": self.version, "pid": self.pid, "host": self.host,
                "age_s": round(now - self.started, 1),
                "renewed_s_ago": round(now - self.renewed, 1)}


def read_lease(path: Path) -> LeaseInfo | None:
    """The lease at `path`; None if it vanished. An unreadable one counts from its mtime."""
    try:
        st = path.stat()
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        return LeaseInfo(path, int(doc["version"]), int(doc["pid"]), str(doc["host"]),
                         doc.get("boot"), doc.get("proc_start"), float(doc["started"]),
                         float(doc["ttl_s"]), st.st_mtime)
    except (ValueError, KeyError, TypeError):
        return LeaseInfo(path, None, None, None, None, None, st.st_mtime, DEFAULT_TTL_S,
                         st.st_mtime)


def leases(chain_dir: Path) -> list[LeaseInfo]:
    d = Path(chain_dir) / LEASE_DIR
    found = (read_lease(p) for p in sorted(d.glob("v*.json"))) if d.is_dir() else ()
    return [info for info in found if info is not None]


def sweep(chain_dir: Path, now: float | None = None) -> list[LeaseInfo]:
    """The live leases; dead ones (holder gone, not renewed for ttl_s) are removed. Call under
    the chain lock."""
    live = []
    for info in leases(chain_dir):
        if info.live(now):
            live.append(info)
        else:
            log.warning("removing the stale write lease %s (v%s, pid %s on %s, not renewed for "
                        "%.0f s): its publisher is gone", info.path.name, info.version,
                        info.pid, info.host, (now or time.time()) - info.renewed)
            try:
                info.path.unlink(missing_ok=True)
            except OSError as e:  # another user's file: it just stays, dead
                log.warning("could not remove %s: %s", info.path, e)
    return live


# --- holding a lease -----------------------------------------------------------------------
class Lease:
    """Held by a publisher from before its first block until its manifests are stored (or the
    version is abandoned): a context manager; `ChainStore.writing` makes one."""

    def __init__(self, chain_dir: Path, version: int, lock: ChainLock,
                 ttl_s: float = DEFAULT_TTL_S, holders: list["Lease"] | None = None) -> None:
        self.chain_dir = Path(chain_dir)
        self.holders = holders if holders is not None else []
        """Where the holding store lists its leases while they are held."""
        self.version = version
        self.lock = lock
        self.ttl_s = ttl_s
        self.path = self.chain_dir / LEASE_DIR / \
            f"v{version:08d}-{os.getpid()}-{secrets.token_hex(4)}.json"
        self.started: float | None = None
        self.lost = False
        """The file vanished while held (another process judged this holder dead)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "Lease":
        pid = os.getpid()
        with self.lock:  # no retention pass runs between this and the first block
            self.started = time.time()
            doc = {"version": self.version, "pid": pid, "host": os.uname().nodename,
                   "boot": _boot_id(), "proc_start": _proc_start(pid),
                   "started": self.started, "ttl_s": self.ttl_s}
            write_atomic(self.path, json.dumps(doc).encode(), mode=0o644)
            self.holders.append(self)
        self._thread = threading.Thread(target=self._renew, name=f"lease-v{self.version}",
                                        daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                self.lost = True
                log.warning("the write lease for v%d was removed while held; its blocks are "
                            "checked before signing", self.version)
                return
            except OSError as e:
                log.warning("could not renew the write lease for v%d: %s", self.version, e)

    def release(self) -> None:
        if self in self.holders:
            self.holders.remove(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
