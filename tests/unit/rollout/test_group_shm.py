"""A killed server's shared memory goes with it: VllmServer.stop() on a real process group."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from rollout import group_shm
from rollout.vllm_launch import VllmServer

# A parent and a child in their own session, both mapping one POSIX shared-memory segment, as
# vLLM's API server and engine core do; SIGTERM is ignored so stop() has to SIGKILL the group,
# which is when Python's resource tracker never gets to unlink it.
HOLDER = r"""
import os, signal, sys, time
from multiprocessing import shared_memory
signal.signal(signal.SIGTERM, signal.SIG_IGN)
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
shm.buf[:4] = b"live"
if os.fork() == 0:
    peer = shared_memory.SharedMemory(name=shm.name)
    while True:
        time.sleep(1)
print(shm.name, flush=True)
while True:
    time.sleep(1)
"""


def spawn_holder(tmp_path: Path) -> tuple[VllmServer, Path]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    name = proc.stdout.readline().strip()
    assert name, "the holder did not create its segment"
    state = tmp_path / "state"
    state.mkdir()
    return VllmServer(proc, "http://127.0.0.1:9", state, state / "log"), Path("/dev/shm") / name


def test_held_by_group_sees_the_segment_in_parent_and_child(tmp_path: Path) -> None:
    server, segment = spawn_holder(tmp_path)
    try:
        deadline = time.monotonic() + 10
        holders: list[int] = []
        while len(holders) < 2 and time.monotonic() < deadline:  # parent, then its child
            holders = [pid for pid in group_shm.group_pids(server.pid)
                       if segment in group_shm.held_by(pid)]
            time.sleep(0.05)
        assert server.pid in holders and len(holders) == 2, holders
        assert segment in group_shm.held_by_group(server.pid)
        assert group_shm.held_by_group(server.pid + 10**7) == set()  # no such group
    finally:
        server.stop(timeout_s=1)
        server.proc.stdout.close()


def test_stop_kills_the_group_and_unlinks_what_it_held(tmp_path: Path) -> None:
    server, segment = spawn_holder(tmp_path)
    bystander = Path("/dev/shm") / f"deltaswarm-test-bystander-{server.pid}"
    bystander.write_bytes(b"not the server's")  # in /dev/shm but never opened by the group
    try:
        assert segment.exists()
        server.stop(timeout_s=1)
        assert server.proc.poll() is not None
        assert group_shm.group_pids(server.pid) == []
        assert not segment.exists(), f"{segment} outlived the server that held it"
        assert bystander.read_bytes() == b"not the server's"
        assert not server.state_dir.exists()
    finally:
        server.proc.stdout.close()
        bystander.unlink(missing_ok=True)
        segment.unlink(missing_ok=True)


def test_a_segment_another_live_process_still_holds_is_left_alone(tmp_path: Path) -> None:
    from multiprocessing import shared_memory

    mine = shared_memory.SharedMemory(create=True, size=4096)  # this process keeps it mapped
    try:
        path = Path("/dev/shm") / mine.name
        assert path in group_shm.held_by_any()
        assert group_shm.remove({path}) == [] and path.exists()
    finally:
        mine.close()
        mine.unlink()
