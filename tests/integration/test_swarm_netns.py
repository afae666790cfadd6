"""bench/swarm.py in small: a shaped trainer seed and three nodes in network namespaces, each a
separate process, fetch a 20 MB artifact over the swarm; the trainer sends it about once, the
nodes serve each other, and the bench leaves no namespace or process behind. Needs root."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import netns

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def namespaces_ok():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")


def test_swarm_in_namespaces_reaches_every_node_with_trainer_sending_about_once(namespaces_ok):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "swarm.py"), "--nodes", "3", "--size-mb", "20",
         "--modes", "swarm", "--json", "--timeout", "40"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=55)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
        pytest.fail(f"bench did not finish in 55 s:\n{out}\n{err}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"{out}\n{err}"
    summary = json.loads(out.strip().splitlines()[-1])
    size, swarm = summary["size"], summary["results"]["swarm"]
    assert swarm["verified"]
    assert len(swarm["per_node"]) == 3
    # the trainer's rotating unchokes (daemon.bittorrent.swarm SEED_SETTINGS) sent 1.01-1.32x F in
    # 8 runs of this setup on a 2-core VM (earlier builds up to 1.50x, a loaded CI run 1.63x); a
    # star, every node fetching from the trainer, sends 3x F: the bound sits between
    assert size <= swarm["seed_payload"] <= 2.0 * size
    assert swarm["peer_upload"] > 0.5 * size
    # the time over the shaped ideal is bench/swarm.py's figure, not a test's: a loaded host
    # moves it; the bench's own --timeout bounds the run
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"dsb{proc.pid}" not in left
