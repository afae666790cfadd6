"""How long a small artifact takes from `download()` to finished between two swarms that have
already exchanged artifacts (as a region and its source do every version), with the swarm's
loopback tracker (`dial_at_once`, daemon/bittorrent/tracker.py) and without it, in one run.

Without it libtorrent dials a new torrent's peers from its connect scheduler, once a second, so
each artifact waits for the next tick (0-1 s, uniform as publishes fall); with it the first
connection goes out on the tracker reply. Downloads start at staggered offsets so the tick
phase is sampled, not fixed.

    python bench/dial.py [--artifacts 10] [--size 12000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chain.blocks import block_id  # noqa: E402
from daemon.bittorrent import torrents  # noqa: E402
from daemon.bittorrent.swarm import Swarm, SwarmConfig  # noqa: E402


def run(dial_at_once: bool, artifacts: int, size: int, tmp: Path, ip: int) -> list[float]:
    """Seconds per artifact, seed -> one peer, both sessions kept across artifacts."""
    times = []
    with Swarm(SwarmConfig(listen=f"127.0.0.{ip}:0", dial_at_once=dial_at_once)) as seed, \
            Swarm(SwarmConfig(listen=f"127.0.0.{ip + 1}:0", dial_at_once=dial_at_once)) as peer:
        for i in range(artifacts + 1):  # the first connects a fresh session: not counted
            art = f"v{i:08d}.delta"
            data = os.urandom(size)
            path = tmp / "store" / block_id(data)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            tb = torrents.make_torrent(art, [(block_id(data), path)], 1 << 16)
            torrents.link_blocks(art, [(block_id(data), path)], tmp / f"seed{ip}")
            seed.seed(art, tb, tmp / f"seed{ip}")
            seed.pump(0.01)
            time.sleep((i * 0.37) % 1.0)  # sample the connect tick's phase
            t0 = time.monotonic()
            peer.download(art, tb, tmp / f"peer{ip}", [seed.endpoint])
            while not peer.progress(art).finished:
                if time.monotonic() - t0 > 30:
                    raise TimeoutError(f"{art} did not arrive in 30 s")
                seed.pump(0.002)
                peer.pump(0.002)
            if i:
                times.append(time.monotonic() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifacts", type=int, default=10)
    ap.add_argument("--size", type=int, default=12000, help="bytes per artifact")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dial-") as d:
        tick = run(False, a.artifacts, a.size, Path(d), 80)
        at_once = run(True, a.artifacts, a.size, Path(d), 90)
    out = {"artifacts": a.artifacts, "size": a.size, "loadavg": os.getloadavg()[0],
           "connect_tick_s": round(statistics.median(tick), 4),
           "dial_at_once_s": round(statistics.median(at_once), 4),
           "tick_over_at_once": round(statistics.median(tick) / statistics.median(at_once), 2),
           "tick_s": [round(t, 3) for t in tick], "at_once_s": [round(t, 3) for t in at_once]}
    if not a.json:
        print(f"median per artifact: connect tick {out['connect_tick_s']} s, dial at once "
              f"{out['dial_at_once_s']} s ({out['tick_over_at_once']}x)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
