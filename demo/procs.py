"""Starting and stopping the demo's processes: each in its own session, logged to a file, and
stopped by its own pid (SIGTERM, then SIGKILL after a grace period) — never by name.

Each runs this checkout's code: PYTHONPATH starts with the repository root the demo itself was
imported from. Without it `python -m` found the packages through the working directory, and
from any other directory through the venv's editable install, which may point at another
checkout than the demo's own (a git worktree sharing one venv)."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root this demo was imported from."""


def _pythonpath() -> str:
    rest = os.environ.get("PYTHONPATH")
    return str(ROOT) + (os.pathsep + rest if rest else "")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Procs:
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, module: str, *args: str, env: dict | None = None) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath(),
                     **(env or {})},
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop_all(self, grace_s: float = 20.0) -> None:
        for p in self.procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
