"""Telling the local inference engine that a new verified version is current.

One small seam, `EngineHook.notify(version, path, state_digest, patch=None)`, chosen by the config's
`engine.type`: none, an HTTP POST, a command, or a vLLM server: through vLLM's weight-transfer
API and the `deltaswarm` backend (daemon/engines/vllm.py, `transfer: backend`), or for older
vLLM by running `python -m rollout.vllm_server reload …` (`transfer: reload`, a process
boundary rather than an import), or LoRA adapters into a vLLM server on the base
(`vllm_lora`, daemon/engines/lora.py).
Failures are retried a few times, then counted; they never stop the sync.

Engine first (daemon/engines/first.py): a hook whose `takes_patches` is true is told each
verified version as soon as its patch file (chain/patchfile.py) is written, before the
directory `path` exists, and patches its live weights from it (the patch names its parent
version; an engine elsewhere waits for `path`); it is told a version on disk only if it has not
served it. The none and vLLM backend hooks take patches; http and command hooks are told versions
on disk (the built-in rollout worker fetches patches itself: rollout/worker.py).
"""

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Protocol

import aiohttp

from daemon.config import CommandHook, HttpHook, NoHook, VllmHook, VllmLoraHook
from daemon.engines.lora import VllmLoraEngine
from daemon.engines.vllm import VllmBackendHook

log = logging.getLogger("deltaswarm.hooks")


class HookFailed(RuntimeError):
    """The engine did not accept the notification."""


class EngineHook(Protocol):
    async def notify(self, version: int, path: Path, state_digest: str,
                     patch: Path | None = None) -> None: ...
    async def close(self) -> None: ...


def takes_patches(hook: object) -> bool:
    """Does this hook want each version as a patch, before its directory is on disk?"""
    return bool(getattr(hook, "takes_patches", False))


class NullHook:
    takes_patches = True  # nothing to tell: its "engine" serves at once

    async def notify(self, version: int, path: Path, state_digest: str,
                     patch: Path | None = None) -> None:
        return None

    async def close(self) -> None:
        return None


class HttpNotifyHook:
    def __init__(self, cfg: HttpHook, session: aiohttp.ClientSession, token: str) -> None:
        self.cfg = cfg
        self.session = session
        self.headers = {"Authorization": f"Bearer {token}"}

    async def notify(self, version: int, path: Path, state_digest: str,
                     patch: Path | None = None) -> None:
        body = {"version": version, "path": str(path), "state_digest": state_digest}
        if patch is not None:
            body["patch"] = str(patch)
        async with self.session.post(self.cfg.url, json=body, headers=self.headers,
                                     timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)) as r:
            if r.status >= 300:
                raise HookFailed(f"{self.cfg.url} answered HTTP {r.status}: "
                                 f"{(await r.text())[:200]}")

    async def close(self) -> None:
        return None


class CommandNotifyHook:
    def __init__(self, cfg: CommandHook) -> None:
        self.cfg = cfg

    async def notify(self, version: int, path: Path, state_digest: str,
                     patch: Path | None = None) -> None:
        values = {"version": str(version), "path": str(path), "state_digest": state_digest,
                  "patch": "" if patch is None else str(patch)}
        argv = [a.format_map(values) if "{" in a else a for a in self.cfg.argv]
        env = {**os.environ, "DELTASWARM_VERSION": values["version"],
               "DELTASWARM_PATH": values["path"], "DELTASWARM_STATE_DIGEST": state_digest,
               "DELTASWARM_PATCH": values["patch"]}
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            _, err = await asyncio.wait_for(proc.communicate(), self.cfg.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise HookFailed(f"{argv[0]} did not finish within {self.cfg.timeout_s}s") from None
        if proc.returncode != 0:
            raise HookFailed(f"{argv[0]} exited {proc.returncode}: "
                             f"{err.decode(errors='replace')[-300:]}")

    async def close(self) -> None:
        return None


class VllmNotifyHook(CommandNotifyHook):
    """pause → reload the verified directory → reset prefix cache → resume, run as
    `python -m rollout.vllm_server reload URL PATH VERSION`: a process boundary, so the daemon
    never imports rollout's internals (and only vLLM regions need its dependencies)."""

    def __init__(self, cfg: VllmHook) -> None:
        argv = [sys.executable, "-m", "rollout.vllm_server", "reload", cfg.url, "{path}",
                "{version}", "--timeout", str(cfg.timeout_s)]
        super().__init__(CommandHook(type="command", argv=argv, timeout_s=cfg.timeout_s + 30))


def build_hook(cfg: NoHook | HttpHook | CommandHook | VllmHook | VllmLoraHook,
               session: aiohttp.ClientSession, token: str, state_dir: Path | None = None
               ) -> EngineHook:
    """`state_dir`: where the vLLM backend's workers leave their reports (this node's)."""
    if cfg.type == "none":
        return NullHook()
    if cfg.type == "http":
        return HttpNotifyHook(cfg, session, token)
    if cfg.type == "command":
        return CommandNotifyHook(cfg)
    if cfg.type == "vllm" and cfg.transfer == "backend":
        if state_dir is None:
            raise ValueError("the vllm backend hook needs the node's state_dir for its reports")
        return VllmBackendHook(cfg, session, state_dir)
    if cfg.type == "vllm":
        return VllmNotifyHook(cfg)
    if cfg.type == "vllm_lora":
        if state_dir is None:
            raise ValueError("the vllm_lora hook needs the node's state_dir for adapter dirs")
        return VllmLoraEngine(cfg, session, state_dir)
    raise ValueError(f"unknown engine hook type {cfg.type!r}: expected "
                     "none|http|command|vllm|vllm_lora")


class Notifier:
    """Runs the hook with retries and keeps the counts the status reports."""

    def __init__(self, hook: EngineHook, kind: str, attempts: int = 3) -> None:
        self.hook = hook
        self.kind = kind
        self.attempts = attempts
        self.ok = 0
        self.failed = 0
        self.last_version: int | None = None
        self.last_error = ""
        self.last_seconds = 0.0
        self.last_ok_at: float | None = None
        self.last_error_at: float | None = None

    async def notify(self, version: int, path: Path, state_digest: str,
                     patch: Path | None = None) -> bool:
        delay = 0.5
        for attempt in range(1, self.attempts + 1):
            t0 = time.monotonic()
            try:
                if patch is None:
                    await self.hook.notify(version, path, state_digest)
                else:
                    await self.hook.notify(version, path, state_digest, patch=patch)
            except Exception as e:  # an engine failure must never stop the sync loop
                self.last_error = f"v{version}: {type(e).__name__}: {e}"[:400]
                self.last_error_at = time.time()
                log.warning("engine notification %d/%d failed: %s", attempt, self.attempts,
                            self.last_error)
                if attempt < self.attempts:
                    await asyncio.sleep(delay)
                    delay *= 2
                continue
            self.ok += 1
            self.last_version = version
            self.last_seconds = time.monotonic() - t0
            self.last_ok_at = time.time()
            return True
        self.failed += 1
        return False

    def status(self) -> dict:
        return {"type": self.kind, "ok": self.ok, "failed": self.failed,
                "last_version": self.last_version, "last_error": self.last_error,
                "last_seconds": round(self.last_seconds, 3)}
