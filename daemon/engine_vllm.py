"""The daemon's `vllm` engine hook on vLLM's own weight-transfer API, with proof that the weights
landed.

vLLM (0.32+, started with `--weight-transfer-config '{"backend": "deltaswarm"}'` and
VLLM_SERVER_DEV_MODE=1) runs the `deltaswarm` backend (rollout/vllm_transfer.py) in each worker.
This hook speaks only HTTP to it (the daemon never imports rollout): it names the verified
version, the backend loads what changed from this node's weights directory, and after vLLM's
post-load processing each worker reads its weights back and compares them with the version's
digests, writing a report into this node's state directory (the backend runs on this host:
it reads the weights directory). A mismatch, or a report that never came, triggers a full
reload of the same verified directory; if that does not verify either, vLLM is left paused
(it never serves weights that are not the version) and the hook fails, so the notifier retries.
"""

import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from daemon.config import VllmHook

log = logging.getLogger("deltaswarm.engine")


class EngineRoundFailed(RuntimeError):
    """vLLM refused a step of the update, or no verdict came back; vLLM was left paused."""


@dataclass
class EngineCheck:
    """The status's `engine_check`: what the read-back after each update found."""

    enabled: bool = True
    last_version: int | None = None
    ok: bool | None = None
    """False: live weights differ from the version; None: nothing checked yet / unreadable."""
    mode: str | None = None
    """How the last update was applied: patch | changed | full."""
    checked: int = 0
    unreadable: int = 0
    mismatched: list[str] = field(default_factory=list)
    """Tensors that differed at the last mismatch (first 20)."""
    loaded_tensors: int = 0
    loaded_bytes: int = 0
    update_s: float = 0.0
    """Wall time of the last update, pause to resume, as the daemon saw it."""
    check_s: float = 0.0
    checks: int = 0
    mismatches: int = 0
    repairs: int = 0
    repair_failures: int = 0
    last_mismatch_version: int | None = None
    last_mismatch_at: float | None = None
    last_error: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per HTTP step of the last update (repeated steps add up), for where time goes."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def verdict(reports: list[dict]) -> tuple[bool, str]:
    """(passed, why not) over every worker's report for one round."""
    if not reports:
        return False, "no worker report came back"
    bad = []
    for r in reports:
        c = r.get("check")
        if r.get("error"):
            bad.append(f"{r.get('worker')}: {r['error']}")
        elif c is None:
            bad.append(f"{r.get('worker')}: no check ran")
        elif c.get("ok") is False:
            bad.append(f"{r.get('worker')}: {c.get('mismatched_count')} tensors differ, e.g. "
                       f"{c.get('mismatched', [])[:3]}")
    return not bad, "; ".join(bad)


class VllmBackendHook:
    """pause → start → update_weights(version) → finish → read the verdict → (on a mismatch:
    another round in mode full) → reset prefix cache → resume."""

    def __init__(self, cfg: VllmHook, session: aiohttp.ClientSession, state_dir: Path) -> None:
        self.cfg = cfg
        self.session = session
        self.base = str(cfg.url).rstrip("/")
        self.report_dir = Path(state_dir) / "engine-reports"
        self.check = EngineCheck(enabled=cfg.check)

    async def _post(self, route: str, body: dict | None = None,
                    params: dict[str, str] | None = None) -> Any:
        t0 = time.monotonic()
        try:
            return await self._post_once(route, body, params)
        finally:
            step = route.strip("/")
            self.check.phases[step] = self.check.phases.get(step, 0.0) + time.monotonic() - t0

    async def _post_once(self, route: str, body: dict | None,
                         params: dict[str, str] | None) -> Any:
        async with self.session.post(self.base + route, json=body or {}, params=params,
                                     timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)) as r:
            text = await r.text()
            if r.status != 200:
                raise EngineRoundFailed(f"POST {route} -> HTTP {r.status}: {text[:400]}")
            return json.loads(text) if text else None

    def _reports(self, ticket: str) -> list[dict]:
        out = []
        for f in sorted(self.report_dir.glob("*.json")):
            try:
                doc = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if doc.get("ticket") == ticket:
                out.append(doc)
        return out

    async def _round(self, version: int, path: Path, mode: str) -> list[dict]:
        ticket = f"v{version}-{mode}-{uuid.uuid4().hex[:12]}"
        await self._post("/start_weight_update")
        await self._post("/update_weights", {"update_info": {
            "version": version, "path": str(path), "mode": mode, "check": self.cfg.check,
            "ticket": ticket}})
        await self._post("/finish_weight_update", {"weight_version": str(version)})
        return self._reports(ticket)

    def _record(self, version: int, reports: list[dict]) -> None:
        c = self.check
        c.last_version = version
        c.mode = reports[0].get("mode") if reports else None
        c.loaded_tensors = sum(r.get("loaded_tensors", 0) for r in reports)
        c.loaded_bytes = sum(r.get("loaded_bytes", 0) for r in reports)
        checks = [r["check"] for r in reports if r.get("check")]
        c.checked = sum(k.get("checked", 0) for k in checks)
        c.unreadable = sum(k.get("unreadable_count", 0) for k in checks)
        c.check_s = max((k.get("seconds", 0.0) for k in checks), default=0.0)
        if checks:
            c.checks += 1
        oks = [k.get("ok") for k in checks]
        c.ok = False if False in oks else (True if True in oks else None)

    async def notify(self, version: int, path: Path, state_digest: str,
                     patch: Path | None = None) -> None:
        t0 = time.monotonic()
        self.check.phases = {}
        self.report_dir.mkdir(parents=True, exist_ok=True)
        await self._post("/init_weight_transfer_engine", {"init_info": {
            "weights_dir": str(Path(path).parent), "report_dir": str(self.report_dir)}})
        await self._post("/pause", params={"mode": "keep"})
        try:
            reports = await self._round(version, path, self.cfg.mode)
            self._record(version, reports)
            passed, why = verdict(reports)
            if self.cfg.check and not passed:
                await self._repair(version, path, reports, why)
            await self._post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        except (EngineRoundFailed, aiohttp.ClientError, TimeoutError) as e:
            self.check.last_error = f"v{version}: {e}"[:400]
            raise EngineRoundFailed(f"v{version} from {path}: {e}; vLLM left paused") from e
        await self._post("/resume")
        self.check.update_s = time.monotonic() - t0
        self.check.last_error = None

    async def _repair(self, version: int, path: Path, reports: list[dict], why: str) -> None:
        c = self.check
        c.mismatches += 1
        c.last_mismatch_version, c.last_mismatch_at = version, time.time()
        c.mismatched = sorted({n for r in reports for n in (r.get("check") or {})
                               .get("mismatched", [])})[:20]
        log.warning("engine check failed for v%d (%s): full reload from %s", version, why, path)
        full = await self._round(version, path, "full")
        self._record(version, full)
        c.mode = "full"
        passed, why = verdict(full)
        if not passed:
            c.repair_failures += 1
            raise EngineRoundFailed(f"weights still differ after a full reload: {why}")
        c.repairs += 1

    async def close(self) -> None:
        return None
