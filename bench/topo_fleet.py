"""The daemons of bench/topo.py: one `python -m daemon.main --config` process per namespace,
their configs, the trainer's publisher, weight long-polls timing when each node holds the
version, and churn (kill -9, start new nodes). The orchestrator runs in the monitor namespace
(netns.RegionNet.enter_monitor), so every control URL is reachable without crossing a shaped
link."""

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench import netns
from chain import keys

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "topology-bench-token"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(url: str, timeout: float = 10.0) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with _OPENER.open(req, timeout=timeout) as r:
        return json.loads(r.read())


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the bench dies, so no daemon outlives a killed
    run (`ip netns exec` execs the daemon, which keeps this setting)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class D:
    name: str
    region: str
    node: netns.Node
    trainer: bool
    dir: Path
    proc: subprocess.Popen | None = None
    killed: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.node.ip}:8700"


class Fleet:
    def __init__(self, net: netns.RegionNet, root: Path, peering: str, args) -> None:
        self.net, self.root, self.peering, self.args = net, root, peering, args
        root.mkdir(parents=True, exist_ok=True)
        self.key_path = root / "trainer.key"
        self.public = keys.public_hex(keys.generate(self.key_path))
        self.daemons: dict[str, D] = {}
        self.holds: dict[str, float] = {}
        self.digests: dict[str, str] = {}
        self._lock = threading.Lock()

    # --- processes ------------------------------------------------------------------------
    def add(self, name: str, region: str, trainer: bool = False) -> D:
        a = self.args
        node = self.net.add_node(name, region, up_mbit=a.seed_mbit if trainer else None,
                                 host=2 if trainer else None)
        d = D(name, region, node, trainer, self.root / name)
        (d.dir / "state").mkdir(parents=True, exist_ok=True)
        cfg = {
            "node": name, "region": region, "role": "trainer" if trainer else "region",
            "state_dir": str(d.dir / "state"),
            "http": {"host": node.ip, "port": 8700},
            "bittorrent": {"host": node.ip, "port": 6881, "piece_size": a.piece_kib << 10},
            "bootstrap": [] if trainer else [self.daemons["trainer"].url],
            "trainer_public_key": self.public, "token": TOKEN,
            "long_poll_timeout_s": 10, "shutdown_timeout_s": 10, "max_peers": 64,
            "region_peering": {"mode": self.peering},
        }
        if trainer:
            cfg["seed_mode"] = True
        (d.dir / "config.yaml").write_text(yaml.safe_dump(cfg))
        self.daemons[name] = d
        return d

    def start(self, d: D) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("NOTIFY_SOCKET", None)
        with open(d.dir / "daemon.log", "ab") as log:
            d.proc = subprocess.Popen(
                d.node.argv(sys.executable, "-m", "daemon.main", "--config",
                            str(d.dir / "config.yaml")),
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent)

    def wait_up(self, ds: list[D], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for d in ds:
            while True:
                if d.proc.poll() is not None:
                    raise RuntimeError(f"{d.name} exited {d.proc.returncode}: {self.tail(d)}")
                try:
                    http_json(f"{d.url}/healthz", timeout=2)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{d.name} did not serve /healthz") from None
                    time.sleep(0.3)

    def start_all(self, timeout: float) -> None:
        trainer = self.daemons["trainer"]
        self.start(trainer)
        self.wait_up([trainer], timeout)
        rest = [d for d in self.daemons.values() if not d.trainer]
        for d in rest:
            self.start(d)
        self.wait_up(rest, timeout)

    def live(self) -> list[D]:
        return [d for d in self.daemons.values() if not d.trainer and not d.killed]

    def wait_mesh(self, timeout: float) -> bool:
        """Every region node knows every other node (and the trainer) with its region, trusted:
        the state a long-running fleet is in before a version is published."""
        deadline = time.monotonic() + timeout
        want = len(self.daemons) - 1
        while time.monotonic() < deadline:
            ok = 0
            for d in self.live():
                try:
                    peers = http_json(f"{d.url}/v1/peers", timeout=5)["peers"]
                except OSError:
                    continue
                ok += sum(1 for p in peers if p["bt"] and p["region"]
                          and (p["bootstrap"] or p["proven"])) >= want
            if ok == len(self.live()):
                return True
            time.sleep(1.0)
        return False

    def tail(self, d: D, n: int = 1500) -> str:
        path = d.dir / "daemon.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop_all(self) -> list[str]:
        """SIGTERM every daemon still running, kill what does not stop; the log tails of those
        that exited with an error (kill -9'd ones excepted)."""
        procs = [d for d in self.daemons.values() if d.proc is not None and d.proc.poll() is None]
        for d in procs:
            d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        out = []
        for d in procs:
            try:
                d.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
                out.append(f"{d.name} did not stop on SIGTERM")
        for d in self.daemons.values():
            if d.proc is not None and not d.killed and d.proc.returncode not in (0, None):
                out.append(f"--- {d.name} exited {d.proc.returncode}:\n{self.tail(d)}")
        return out

    # --- the version ----------------------------------------------------------------------
    def publish_snapshot(self, size_mb: float) -> dict:
        import torch

        from chain.policy import SnapshotPolicy
        from trainer.publisher import Publisher

        t = self.daemons["trainer"]
        g = torch.Generator().manual_seed(0)
        rows, cols = 1024, 2048
        count = max(1, round(size_mb * 1e6 / (rows * cols * 2)))
        state = {f"layers.{i}.weight": (torch.randn(rows, cols, generator=g) * 0.02).bfloat16()
                 for i in range(count)}
        pub = Publisher(chain_dir=t.dir / "state" / "chain", key_path=self.key_path, run="topo",
                        daemon_url=t.url, token=TOKEN, snapshots=SnapshotPolicy(every=1000),
                        block_size=self.args.block_mib << 20)
        out = pub.publish(0, state)
        if not out.notified:
            raise RuntimeError(f"the trainer daemon did not take v0: {self.tail(t)}")
        return {"payload_bytes": out.snapshot.payload_bytes,
                "state_digest": out.snapshot.state_digest}

    def watch_weights(self, ds: list[D] | None = None) -> None:
        for d in ds if ds is not None else self.live():
            threading.Thread(target=self._watch, args=(d,), daemon=True).start()

    def _watch(self, d: D) -> None:
        while not d.killed:
            try:
                cur = http_json(f"{d.url}/v1/weights/current?after=-1&timeout=10", timeout=20)
            except (OSError, ValueError):
                time.sleep(0.3)
                continue
            if cur.get("version") is not None:
                with self._lock:
                    self.holds[d.name] = time.time()
                    self.digests[d.name] = cur.get("state_digest")
                return

    def wait_all(self, deadline: float) -> dict[str, float]:
        while time.monotonic() < deadline:
            with self._lock:
                if all(d.name in self.holds for d in self.live()):
                    break
            time.sleep(0.2)
        with self._lock:
            return {d.name: self.holds[d.name] for d in self.live() if d.name in self.holds}

    def verified(self, digest: str) -> bool:
        with self._lock:
            return all(self.digests.get(d.name) == digest for d in self.live())

    def statuses(self) -> dict[str, dict]:
        out = {}
        for d in self.daemons.values():
            if d.killed:
                continue
            try:
                out[d.name] = http_json(f"{d.url}/v1/status", timeout=10)
            except (OSError, ValueError):
                continue
        return out

    @staticmethod
    def fetched(statuses: dict[str, dict]) -> dict[str, float]:
        """node → unix time its download of the version finished (pieces verified)."""
        out = {}
        for name, st in statuses.items():
            transfers = ((st.get("detail") or {}).get("sync") or {}).get("transfers") or {}
            done = [t["started"] + t["seconds"] for t in transfers.values()
                    if t.get("seconds") is not None]
            if done:
                out[name] = max(done)
        return out

    @staticmethod
    def download_seconds(statuses: dict[str, dict], names: set[str]) -> dict[str, float]:
        out = {}
        for name in sorted(names & statuses.keys()):
            transfers = ((statuses[name].get("detail") or {}).get("sync") or {}).get(
                "transfers") or {}
            secs = [t["seconds"] for t in transfers.values() if t.get("seconds") is not None]
            if secs:
                out[name] = round(max(secs), 2)
        return out

    @staticmethod
    def gateways(statuses: dict[str, dict]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, st in statuses.items():
            rp = st.get("region_peering") or {}
            if rp.get("gateway"):
                out.setdefault(st.get("region", "?"), []).append(name)
        return {r: sorted(v) for r, v in sorted(out.items())}

    # --- churn ----------------------------------------------------------------------------
    def churn(self, rng, home: str) -> dict:
        """kill -9 a third of the region nodes (one gateway outside the trainer's region among
        them, when there is one) and start as many new nodes in the same regions."""
        t_start = time.time()
        live = self.live()
        gws = [d for name, rs in self.gateways(self.statuses()).items() if name != home
               for d in live if d.name in rs]
        victims = [rng.choice(gws)] if gws else []
        rest = [d for d in live if d not in victims]
        victims += rng.sample(rest, max(0, len(live) // 3 - len(victims)))
        for d in victims:
            d.proc.kill()
            d.proc.wait()
            d.killed = True
        fresh = []
        for i, v in enumerate(victims):
            fresh.append(self.add(f"{v.region}-new{i + 1}", v.region))
            self.start(fresh[-1])
        self.watch_weights(fresh)
        return {"killed": [d.name for d in victims],
                "gateways_killed": [d.name for d in victims if d in gws],
                "started": [d.name for d in fresh], "took_s": round(time.time() - t_start, 2)}
