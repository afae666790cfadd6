"""Helpers for integration tests: daemons as real processes on loopback, each on its own
127.0.0.x address (bans are per address), plus a tiny bf16 model and a real Publisher.

    with Cluster(tmp_path) as c:
        c.trainer(); c.region("r1"); c.start_all()
        c.publish(0, state)
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch
import yaml

from chain import keys
from rollout.ports import free_port
from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "integration-test-token"


def tiny_model(seed: int = 0, tensors: int = 4, rows: int = 256, cols: int = 1024
               ) -> dict[str, torch.Tensor]:
    """`tensors` bf16 matrices of rows×cols (512 KiB each by default)."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": (torch.randn(rows, cols, generator=g) * 0.02).bfloat16()
            for i in range(tensors)}


def step(state: dict[str, torch.Tensor], seed: int, density: float = 0.01
         ) -> dict[str, torch.Tensor]:
    """The next version: about `density` of the elements change in their last bits."""
    g = torch.Generator().manual_seed(10_000 + seed)
    out = {}
    for name, t in state.items():
        bits = t.view(torch.int16).clone()
        mask = torch.rand(bits.shape, generator=g) < density
        bits[mask] += 1
        out[name] = bits.view(torch.bfloat16)
    return out


def http(url: str, body: bytes | None = None, token: str | None = TOKEN, timeout: float = 10.0,
         content_type: str = "application/json") -> tuple[int, bytes, dict]:
    headers = {"Content-Type": content_type}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, headers=headers,
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


class Daemon:
    def __init__(self, cluster: "Cluster", name: str, role: str, host: str,
                 overrides: dict[str, Any]) -> None:
        self.name, self.role, self.host = name, role, host
        self.dir = cluster.root / name
        self.state_dir = self.dir / "state"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.http_port = free_port(host)
        self.bt_port = free_port(host)
        self.url = f"http://{host}:{self.http_port}"
        self.log_path = self.dir / "daemon.log"
        self.proc: subprocess.Popen | None = None
        doc: dict[str, Any] = {
            "node": name, "region": name, "role": role, "state_dir": str(self.state_dir),
            "http": {"host": host, "port": self.http_port},
            "bittorrent": {"host": host, "port": self.bt_port, "piece_size": 65536},
            "bootstrap": [], "trainer_public_key": cluster.public_hex, "token": TOKEN,
            "long_poll_timeout_s": 5, "shutdown_timeout_s": 10,
        }
        if role == "trainer":
            doc["seed_mode"] = True
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(doc.get(key), dict):
                doc[key] = {**doc[key], **value}
            else:
                doc[key] = value
        self.config = doc
        self.cfg_path = self.dir / "config.yaml"
        self.write_config()

    def write_config(self) -> None:
        self.cfg_path.write_text(yaml.safe_dump(self.config))

    def start(self, env_extra: dict[str, str] | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("NOTIFY_SOCKET", None)
        env.update(env_extra or {})
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the child)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.main", "--config", str(self.cfg_path)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.log()}")
            return http(f"{self.url}/healthz", token=None, timeout=2)[0] == 200
        wait_until(up, timeout, f"{self.name} to serve /healthz")

    def get(self, path: str, timeout: float = 10.0) -> dict:
        code, body, _ = http(f"{self.url}{path}", timeout=timeout)
        if code != 200:
            raise ValueError(f"{self.name} GET {path}: {code} {body[:300]!r}")
        return json.loads(body)

    def status(self) -> dict:
        return self.get("/v1/status")

    def current(self) -> int | None:
        return self.status()["current_version"]

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not stop within {timeout}s:\n{self.log()}"
                                 ) from None

    def kill9(self) -> None:
        """SIGKILL on purpose: the exit that follows is the test's doing, not a crash."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.killed_on_purpose = self.proc

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:] if self.log_path.exists() else ""


class Cluster:
    def __init__(self, root: Path, run: str = "itest") -> None:
        self.root = Path(root)
        self.key_path = self.root / "trainer.key"
        self.public_hex = keys.public_hex(keys.generate(self.key_path))
        self.run = run
        self.daemons: dict[str, Daemon] = {}
        self._next_ip = 10
        self._publisher = None

    def _host(self) -> str:
        self._next_ip += 1
        return f"127.0.0.{self._next_ip}"

    def trainer(self, **overrides: Any) -> Daemon:
        d = Daemon(self, "trainer", "trainer", self._host(), overrides)
        self.daemons[d.name] = d
        return d

    def region(self, name: str, bootstrap: list[str] | None = None, **overrides: Any) -> Daemon:
        if bootstrap is None:
            bootstrap = [self.daemons["trainer"].url]
        d = Daemon(self, name, "region", self._host(), {"bootstrap": bootstrap, **overrides})
        self.daemons[d.name] = d
        return d

    def lora_run(self, lora_name: str, base_weights: Path, vllm_url: str) -> "Daemon":
        """A LoRA run's trainer daemon and region daemon (adapters over the base held under
        `base_weights`, loaded into the vLLM server at `vllm_url`), started; the region."""
        self.trainer()
        region = self.region(f"{lora_name}-r", adapter={"base_weights": str(base_weights),
                                                        "run": self.run},
                             engine={"type": "vllm_lora", "url": vllm_url,
                                     "lora_name": lora_name})
        self.start_all()
        return region

    def start_all(self, timeout: float = 90.0) -> None:
        for d in self.daemons.values():
            if d.proc is None or d.proc.poll() is not None:
                d.start()
        for d in self.daemons.values():
            d.wait_ready(timeout)

    def publisher(self):
        if self._publisher is None:
            from chain.policy import SnapshotPolicy
            from trainer.publisher import Publisher

            t = self.daemons["trainer"]
            self._publisher = Publisher(
                chain_dir=t.state_dir / "chain", key_path=self.key_path, run=self.run,
                daemon_url=t.url, token=TOKEN, snapshots=SnapshotPolicy(every=1000),
                block_size=256 * 1024)
        return self._publisher

    def publish(self, version: int, state: dict[str, torch.Tensor], snapshot: bool = False):
        pub = self.publisher()
        if snapshot:
            from chain.policy import SnapshotPolicy

            pub.snapshots = SnapshotPolicy(every=1)
        try:
            out = pub.publish(version, state)
        finally:
            from chain.policy import SnapshotPolicy

            pub.snapshots = SnapshotPolicy(every=1000)
        assert out.notified, f"trainer daemon did not take v{version}:\n" \
            f"{self.daemons['trainer'].log()}"
        return out

    def wait_all_at(self, version: int, timeout: float, names: list[str] | None = None) -> None:
        names = names or [n for n, d in self.daemons.items() if d.role == "region"]

        def done() -> bool:
            for n in names:
                d = self.daemons[n]
                if d.proc is not None and d.proc.poll() is not None:
                    raise AssertionError(f"{n} exited {d.proc.returncode}:\n{d.log()}")
                if d.current() != version:
                    return False
            return True

        try:
            wait_until(done, timeout, f"{names} to reach v{version}", interval=0.3)
        except AssertionError:
            for n in names:
                with contextlib.suppress(Exception):
                    st = self.daemons[n].status()
                    print(f"--- {n}: current {st['current_version']}, head {st['head_version']}, "
                          f"detail {json.dumps(st.get('detail', {}).get('sync', {}))[:1500]}")
                print(f"--- {n} log:\n{self.daemons[n].log(3000)}")
            raise

    def stop_all(self, timeout: float = 30.0) -> list[str]:
        """SIGTERM every running daemon and wait; returns what went wrong: a daemon that hung on
        SIGTERM (then killed), one that exited non-zero on it, or one that had already died on
        its own (not by `kill9`) with a non-zero code. `__exit__` turns these into a failure."""
        problems = []
        for d in self.daemons.values():
            if d.proc is None or d.proc.poll() is None:
                continue
            if d.proc.returncode != 0 and getattr(d, "killed_on_purpose", None) is not d.proc:
                problems.append(f"{d.name} had exited {d.proc.returncode} on its own:\n"
                                f"{d.log(1500)}")
        running = [d for d in self.daemons.values() if d.proc is not None and d.proc.poll() is None]
        for d in running:
            d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for d in running:
            try:
                code = d.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
                problems.append(f"{d.name} hung on SIGTERM (killed after {timeout:g}s):\n"
                                f"{d.log(1500)}")
                continue
            if code != 0:
                problems.append(f"{d.name} exited {code} on SIGTERM:\n{d.log(1500)}")
        return problems

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        problems = self.stop_all()
        if problems and exc_type is None:  # never mask the test's own failure
            raise AssertionError("daemons did not stop cleanly:\n" + "\n".join(problems))
        for p in problems:
            print(p)


class Hostile:
    """A hostile peer process (tests/integration/hostile.py) on its own loopback address."""

    def __init__(self, root: Path, host: str, mode: str, chain_dir: Path | None = None,
                 extra: list[str] | None = None) -> None:
        self.mode, self.host = mode, host
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.dir = Path(root) / f"hostile-{mode}-{host}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "requests.log"
        self.log_path.touch()
        argv = [sys.executable, "-m", "tests.integration.hostile", "--host", host, "--port",
                str(self.port), "--mode", mode, "--token", TOKEN, "--log", str(self.log_path)]
        if chain_dir is not None:
            argv += ["--chain-dir", str(chain_dir)]
        argv += extra or []
        out = open(self.dir / "server.log", "ab")  # noqa: SIM115 (owned by the child)
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                     stdout=out, stderr=subprocess.STDOUT)
        out.close()

    def wait_ready(self) -> "Hostile":
        wait_until(self._up, 30, f"hostile peer {self.mode} to listen")
        return self

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"hostile {self.mode} exited {self.proc.returncode}")
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex((self.host, self.port)) == 0

    def requests(self) -> list[str]:
        return self.log_path.read_text().splitlines()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # holds no state; its never-answering handlers would stall a drain
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
