"""`deltaswarm ingest --config` as a real process for tests: restartable on the same store
directory and port, token from a file."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.integration.harness import ROOT, TOKEN, free_port, http, wait_until


class IngestProcess:
    """The trainer's ingest endpoint as its own process, restartable on the same dir and port."""

    def __init__(self, root: Path, host: str) -> None:
        self.root, self.host = root, host
        self.store_dir = root / "ingest"
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = root / "ingest.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        (self.root / "token").write_text(TOKEN + "\n")
        cfg = self.root / "ingest.yaml"
        cfg.write_text(f"store_dir: {self.store_dir}\nhost: {self.host}\nport: {self.port}\n"
                       "token_file: token\n")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daemon.cli", "ingest", "--config", str(cfg)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.starts += 1

        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"ingest exited {self.proc.returncode}:\n{self.log()}")
            return http(f"{self.url}/healthz", token=None, timeout=2)[0] == 200
        wait_until(up, 60, "the ingest process to serve /healthz")

    def stats(self) -> dict:
        code, body, _ = http(f"{self.url}/v1/ingest/stats", timeout=2)
        if code != 200:
            raise ValueError(f"ingest stats: {code} {body[:200]!r}")
        return json.loads(body)

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"ingest did not stop on SIGTERM:\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
