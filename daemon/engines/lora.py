"""The daemon's `vllm_lora` engine hook: each verified adapter version goes into a running vLLM
server (`vllm serve BASE --enable-lora`, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) under the run's
name, so rollout workers keep asking for the same model name and get the newest adapter.

vLLM loads adapters from a directory only (its adapter-only in-memory update is an open RFC), so
each version is copied into its own PEFT directory (`<state>/lora/<name>/v00000007`, never
rewritten) and loaded in place under the run's name (`load_inplace`). A unique directory per
version, then a prefix-cache reset: vLLM keyed cached prefixes by adapter name, and a same-name
reload that skips the reset serves stale KV blocks computed with the old adapter. The proof it
landed is vLLM's own model list afterwards: the name must point at this version's directory.
Several runs' daemons can share one vLLM server; each loads only its own name, and the status
shows every adapter the server holds with the version its directory names.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from chain.adapters import write_peft_dir
from daemon.config import VllmLoraHook

_VERSION_DIR = re.compile(r"/v(\d{8})/?$")


class LoraLoadFailed(RuntimeError):
    """vLLM refused the adapter, or its model list does not show the version afterwards."""


@dataclass
class LoraServing:
    """The status's `adapter.engine`: what this hook put into vLLM and what vLLM holds."""

    lora_name: str | None = None
    version: int | None = None
    path: str | None = None
    load_s: float = 0.0
    """Wall time of the last load: copy, load_lora_adapter, cache reset, model-list check."""
    loads: int = 0
    served: dict[str, int | None] = field(default_factory=dict)
    """Every adapter the vLLM server listed (all runs sharing it) right after this hook's last
    load: name -> version of its dir. Other runs' later loads show in their own status."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def roots_listed(models: dict) -> dict[str, str]:
    """Adapters in a /v1/models answer (entries with a `parent`): name -> root directory."""
    return {str(e.get("id")): str(e.get("root", "")) for e in models.get("data", [])
            if isinstance(e, dict) and e.get("parent")}


def versions_listed(models: dict) -> dict[str, int | None]:
    """Adapters in a /v1/models answer: name -> version its root directory names (None for a
    directory not made by this hook)."""
    found = {name: _VERSION_DIR.search(root) for name, root in roots_listed(models).items()}
    return {name: int(m.group(1)) if m else None for name, m in found.items()}


class VllmLoraEngine:
    """copy the version to its PEFT dir → load_lora_adapter(load_inplace) → reset prefix cache
    → check /v1/models names this directory → drop directories older than `keep`."""

    def __init__(self, cfg: VllmLoraHook, session: aiohttp.ClientSession, state_dir: Path
                 ) -> None:
        self.cfg = cfg
        self.session = session
        self.base = str(cfg.url).rstrip("/")
        self.name = cfg.lora_name
        self.dirs = Path(state_dir) / "lora" / self.name
        self.lora = LoraServing(lora_name=self.name)
        self.lock = asyncio.Lock()

    async def _call(self, method: str, route: str, body: dict | None = None) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
        async with self.session.request(method, self.base + route, json=body,
                                        headers={"Connection": "close"}, timeout=timeout) as r:
            text = await r.text()
            if r.status != 200:
                hint = ("; serve the base with --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                        "and VLLM_SERVER_DEV_MODE=1 (rollout.vllm_launch --max-lora-rank R does)"
                        if r.status == 404 else "")
                raise LoraLoadFailed(f"{method} {route} -> HTTP {r.status}: {text[:400]}{hint}")
            return await r.json(content_type=None) if route == "/v1/models" else text

    async def listed(self) -> dict[str, str]:
        """Adapter name -> root directory the server holds now (also refreshes the status)."""
        models = await self._call("GET", "/v1/models")
        self.lora.served = versions_listed(models)
        return roots_listed(models)

    async def notify(self, version: int, path: Path, state_digest: str) -> None:
        async with self.lock:
            t0 = time.monotonic()
            dest = self.dirs / f"v{version:08d}"
            await asyncio.to_thread(write_peft_dir, path, dest, state_digest)
            await self._call("POST", "/v1/load_lora_adapter",
                             {"lora_name": self.name, "lora_path": str(dest),
                              "load_inplace": True})
            await self._call("POST", "/reset_prefix_cache")
            held = await self.listed()
            if held.get(self.name) != str(dest):
                raise LoraLoadFailed(f"after loading v{version} from {dest}, vLLM lists "
                                     f"{self.name!r} at {held.get(self.name, 'nothing')}; it did "
                                     "not take it (or another daemon loads the same name)")
            self.lora.version, self.lora.path = version, str(dest)
            self.lora.loads += 1
            self.lora.load_s = round(time.monotonic() - t0, 3)
            await asyncio.to_thread(self._prune)

    def _prune(self) -> None:
        """Keep the newest `keep` directories: the one loaded and a few a restart could reuse."""
        for old in sorted(self.dirs.glob("v[0-9]*"))[:-self.cfg.keep]:
            shutil.rmtree(old, ignore_errors=True)

    async def close(self) -> None:
        return None
