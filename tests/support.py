"""What tests share beyond fixtures: one config builder per process (typed objects, re-validated
on every change, written as YAML for a real process) and one wait-until helper (sync and async).

    from tests.support import daemon_config, write_config, wait_until
"""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from chain.config_base import Section, replace, to_yaml
from daemon.config import Config
from rollout.config import WorkerConfig
from trainer.config import TrainerConfig

TOKEN = "integration-test-token"
KEY = "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c"
RETRY_ON = (OSError, ValueError, KeyError)


def daemon_config(state_dir: Path, role: str = "region", name: str = "n1",
                  public_key: str = KEY, **changes: Any) -> Config:
    """A daemon config on loopback with test-friendly bounds; `changes` as in `replace` (a
    mapping merges into a section: `http={"port": 8123}`)."""
    base = Config(node=name, region=name, role=role, state_dir=state_dir,
                  trainer_public_key=public_key, token=TOKEN, long_poll_timeout_s=5,
                  shutdown_timeout_s=10, seed_mode=role == "trainer",
                  bittorrent={"host": "127.0.0.1", "port": 0, "piece_size": 65536})
    return replace(base, **changes) if changes else base


def worker_config(daemon_url: str, **changes: Any) -> WorkerConfig:
    """A rollout worker config with a small batch shape."""
    base = WorkerConfig(daemon=daemon_url, token=TOKEN, region="eu", worker="w1",
                        prompts_per_batch=2, group_size=3, max_tokens=4, poll_timeout_s=2.0,
                        retry_max_s=0.2)
    return replace(base, **changes) if changes else base


def trainer_config(root: Path, ingest_port: int, **changes: Any) -> TrainerConfig:
    """A trainer config with a tiny model, no daemon, state under `root`."""
    base = TrainerConfig(run="test", state_dir=root / "trainer", chain_dir=root / "chain",
                         key=root / "trainer.key", ingest={"port": ingest_port, "token": TOKEN},
                         model={"hidden": 32, "layers": 1, "heads": 2},
                         warmup={"steps": 0}, steps=2, batch=8)
    return replace(base, **changes) if changes else base


def write_config(cfg: Section, path: Path) -> Path:
    """`cfg` as the YAML file a process is started with."""
    path.write_text(to_yaml(cfg))
    return path


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """`pred()`'s first truthy value, polling every `interval`; an error naming `what` (and the
    last transient error: connection refused, a half-written file) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except RETRY_ON as e:
            last_exc = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                         + (f" (last error: {last_exc})" if last_exc else ""))


async def async_wait_until(pred: Callable[[], Any | Awaitable[Any]], timeout: float, what: str,
                           interval: float = 0.05) -> Any:
    """`wait_until` for async tests: `pred` may be a plain or an async function."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
        except RETRY_ON as e:
            last_exc = e
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                         + (f" (last error: {last_exc})" if last_exc else ""))


class HealthProbe(threading.Thread):
    """Times GET /healthz from its own thread, back to back, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.times, self.done = url, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            t0 = time.monotonic()
            with urllib.request.urlopen(self.url, timeout=30) as r:
                assert r.status == 200
            self.times.append(time.monotonic() - t0)
            time.sleep(0.01)


def run_child_appends(child: str, root: Path, plan: list) -> list[str]:
    """Run `child` (a script taking a store root and a JSON plan of (batch, fail) appends, the
    failing ones under RLIMIT_FSIZE) in a fresh interpreter; its stdout lines, one per append."""
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", child, str(root), json.dumps(plan)],
                         cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                         capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == len(plan), out.stdout + out.stderr
    return lines

