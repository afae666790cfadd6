"""Swarm vs star: time until every region holds a delta, and what the trainer's uplink sends.

Builds network namespaces (a bridge plus one namespace per node, `tc tbf` shaping, no delay): a
trainer with a thin uplink seeding one artifact, nodes in three regions fetching it, each node a
separate process (bench/swarm_node.py). Runs the BitTorrent swarm (daemon.bittorrent.swarm,
seed-side
settings on the trainer) and a star baseline (every node GETs the same blocks from an aiohttp
server on the trainer) in the same run, and prints both against the ideal
max(F/u_seed, F/d_min, N·F/(u_seed + Σu)). Needs root.

    sudo .venv/bin/python bench/swarm.py                 # 96 MB in 8 MiB blocks, 6 nodes
    sudo .venv/bin/python bench/swarm.py --nodes 3 --size-mb 20 --modes swarm --json
"""

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import netns  # noqa: E402
from chain.digest import block_id  # noqa: E402
from daemon.bittorrent import torrents  # noqa: E402

ARTIFACT = "v00000001.delta"
REGIONS = ("eu", "us", "ap")
WORKER = str(ROOT / "bench" / "swarm_node.py")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    lines: "queue.Queue[dict]" = field(default_factory=queue.Queue)

    def start_reader(self) -> None:
        def read() -> None:
            for line in self.popen.stdout:
                try:
                    self.lines.put(json.loads(line))
                except json.JSONDecodeError:
                    continue
            self.lines.put({"exited": self.popen.wait()})

        threading.Thread(target=read, daemon=True).start()

    def expect(self, key: str, deadline: float) -> dict:
        while True:
            try:
                msg = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no {key!r} before the deadline") from None
            if key in msg:
                return msg
            if "exited" in msg:
                raise RuntimeError(f"{self.name} exited ({msg['exited']}) before {key!r}")

    def send(self, line: str) -> None:
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()


def make_artifact(workdir: Path, size: int, block: int, piece: int) -> tuple[Path, Path, int]:
    """Random blocks under workdir/trainer/<artifact>/ab/<id>; returns (seed dir, torrent, F)."""
    seed_dir, pairs, total = workdir / "trainer", [], 0
    while total < size:
        data = os.urandom(min(block, size - total))
        dst = torrents.block_path(seed_dir, ARTIFACT, block_id(data))
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        pairs.append((block_id(data), dst))
        total += len(data)
    torrent = workdir / f"{ARTIFACT}.torrent"
    torrent.write_bytes(torrents.make_torrent(ARTIFACT, pairs, piece))
    return seed_dir, torrent, total


def run_mode(mode: str, topo: netns.Topology, trainer: netns.Node, nodes: list[netns.Node],
             workdir: Path, seed_dir: Path, torrent: Path, procs: list[Proc],
             timeout: float) -> dict:
    def spawn(node: netns.Node, role: str, listen: str, directory: Path, peers: str) -> Proc:
        log = open(workdir / f"{mode}-{node.name}.log", "w")  # noqa: SIM115
        popen = subprocess.Popen(
            node.argv(sys.executable, WORKER, "--role", role, "--listen", listen,
                      "--dir", str(directory), "--torrent", str(torrent), "--peers", peers),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        log.close()
        proc = Proc(f"{mode}/{node.name}", popen)
        proc.start_reader()
        procs.append(proc)
        return proc

    deadline = time.monotonic() + timeout
    if mode == "swarm":
        seed = spawn(trainer, "swarm-seed", f"{trainer.ip}:6881", seed_dir, "")
        endpoints = [f"{n.ip}:6881" for n in [trainer, *nodes]]
        peers = [spawn(n, "swarm-peer", f"{n.ip}:6881", workdir / mode / n.name,
                       ",".join(e for e in endpoints if not e.startswith(n.ip + ":")))
                 for n in nodes]
    else:
        seed = spawn(trainer, "http-seed", f"{trainer.ip}:8080", seed_dir, "")
        peers = [spawn(n, "http-peer", "", workdir / mode / n.name, f"{trainer.ip}:8080")
                 for n in nodes]
    for p in [seed, *peers]:
        p.expect("ready", deadline)
    tx0 = topo.tx_bytes(trainer)
    t0 = time.time()
    for p in peers:
        p.send("go")
    done = {p.name: p.expect("done", deadline) for p in peers}
    tx1 = topo.tx_bytes(trainer)
    for p in [seed, *peers]:
        p.send("stop")
    finals = {p.name: p.expect("final", time.monotonic() + 20)["final"] for p in [seed, *peers]}
    for p in [seed, *peers]:
        p.popen.wait(timeout=20)
    return {
        "time": max(d["done"] for d in done.values()) - t0,
        "per_node": {k.split("/")[1]: round(d["done"] - t0, 2) for k, d in done.items()},
        "verified": all(d["verified"] for d in done.values()),
        "seed_payload": finals[seed.name].get("uploaded"),
        "seed_wire": tx1 - tx0,
        "seed_last_upload": (finals[seed.name]["last_upload"] - t0
                             if "last_upload" in finals[seed.name] else None),
        "peer_upload": sum(finals[p.name].get("uploaded", 0) for p in peers),
    }


def print_table(results: dict, size: int, ideal: float, args: argparse.Namespace) -> None:
    print(f"\nartifact {size / 1e6:.1f} MB in {args.block_mib} MiB blocks, "
          f"{args.piece_kib} KiB pieces; trainer uplink {args.seed_mbit} Mbit/s, "
          f"{args.nodes} nodes in {min(args.nodes, 3)} regions at {args.node_mbit} Mbit/s"
          + (f" (the first at {args.slow_node_mbit})" if args.slow_node_mbit else ""))
    print(f"ideal max(F/u_seed, F/d_min, N*F/(u_seed+sum u)) = {ideal:.2f} s\n")
    head = f"{'mode':<6} {'time s':>8} {'x ideal':>8} {'trainer payload':>16} {'x F':>6} " \
           f"{'trainer wire':>13} {'x F':>6} {'peer upload':>12} {'verified':>9}"
    print(head)
    print("-" * len(head))
    for mode, r in results.items():
        payload = r["seed_payload"] if r["seed_payload"] is not None else r["seed_wire"]
        wire = r["seed_wire"]
        print(f"{mode:<6} {r['time']:>8.2f} {r['time'] / ideal:>8.2f} {payload / 1e6:>13.1f} MB "
              f"{payload / size:>6.2f} {wire / 1e6:>10.1f} MB {wire / size:>6.2f} "
              f"{r['peer_upload'] / 1e6:>9.1f} MB {'yes' if r['verified'] else 'NO':>9}")
    if "swarm" in results:
        r = results["swarm"]
        print(f"\ngoals (swarm): trainer payload <= 1.05x F: "
              f"{'met' if r['seed_payload'] <= 1.05 * size else 'MISSED'} "
              f"({r['seed_payload'] / size:.3f}x); time to all <= 1.2x ideal: "
              f"{'met' if r['time'] <= 1.2 * ideal else 'MISSED'} ({r['time'] / ideal:.3f}x)")
        if "star" in results:
            print(f"swarm vs star: {results['star']['time'] / r['time']:.2f}x faster, "
                  f"{results['star']['seed_wire'] / max(r['seed_wire'], 1):.2f}x less trainer "
                  f"egress")
    for mode, r in results.items():
        print(f"{mode} per node (s): {r['per_node']}")
        if r.get("seed_last_upload") is not None:
            print(f"{mode} trainer's last upload at {r['seed_last_upload']:.2f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mb", type=float, default=96)
    p.add_argument("--block-mib", type=int, default=8)
    p.add_argument("--piece-kib", type=int, default=256)
    p.add_argument("--seed-mbit", type=float, default=50)
    p.add_argument("--node-mbit", type=float, default=200)
    p.add_argument("--slow-node-mbit", type=float, default=0,
                   help="give the first node this rate up and down (a slow region); the other "
                        "nodes' finish times then show whether it holds them back")
    p.add_argument("--nodes", type=int, default=6)
    p.add_argument("--modes", default="swarm,star", help="comma list of swarm, star")
    p.add_argument("--timeout", type=float, default=300, help="seconds per mode")
    p.add_argument("--json", action="store_true", help="also print one JSON summary line")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"swarm", "star"}:
        p.error(f"--modes must list swarm and/or star, got {args.modes!r}")

    reason = netns.unavailable_reason()
    if reason:
        print(f"bench/swarm.py: cannot run: {reason}", file=sys.stderr)
        return 2

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    workdir = Path(tempfile.mkdtemp(prefix=f"dsbench{os.getpid()}-"))
    topo, procs = netns.Topology(prefix="dsb"), []
    try:
        seed_dir, torrent, size = make_artifact(workdir, int(args.size_mb * 1e6),
                                                args.block_mib << 20, args.piece_kib << 10)
        trainer = topo.add_node("trainer", args.seed_mbit, args.node_mbit)
        rates = [args.slow_node_mbit if i == 0 and args.slow_node_mbit else args.node_mbit
                 for i in range(args.nodes)]
        nodes = [topo.add_node(f"{REGIONS[i % 3]}-{i // 3 + 1}", r, r)
                 for i, r in enumerate(rates)]
        bits = size * 8 / 1e6
        ideal = max(bits / args.seed_mbit, bits / min(rates),
                    args.nodes * bits / (args.seed_mbit + sum(rates)))
        results = {m: run_mode(m, topo, trainer, nodes, workdir, seed_dir, torrent, procs,
                               args.timeout) for m in modes}
        print_table(results, size, ideal, args)
        if args.json:
            print(json.dumps({"size": size, "ideal": ideal, "results": results}))
        return 0 if all(r["verified"] for r in results.values()) else 1
    except (TimeoutError, RuntimeError) as exc:
        print(f"bench/swarm.py: failed: {exc}", file=sys.stderr)
        for log in sorted(workdir.glob("*.log")):
            tail = log.read_text()[-600:]
            if tail.strip():
                print(f"--- {log.name}\n{tail}", file=sys.stderr)
        return 1
    finally:
        for proc in procs:
            if proc.popen.poll() is None:
                proc.popen.terminate()
        for proc in procs:
            try:
                proc.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        topo.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
