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

Given the region's patch file (`notify(..., patch=P)`, issue 19), the round names it instead:
the backend patches in place and checks only the words it touched (O(changes)); every
`full_check_every`-th update, and on request (`POST /v1/engine/check`), every tensor is read
back too, and `engine_check.full_check` in the status says when that last ran and what it found.
If the backend refuses the patch (it does not hold the parent and cannot check it, e.g. after a
restart), or the check after it fails, the round is run again from the version directory, which
the region writes right after the patch (vLLM stays paused meanwhile).
"""

import asyncio
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
    reason: str | None = None
    """Why the last update was not all patched in place (module reload, or no patch given)."""
    kind: str | None = None
    """What the last check read: incremental (the words a patch touched) | full."""
    words: int = 0
    """64-bit words the last incremental check read back."""
    state_digest_ok: bool | None = None
    """The digests the engine tracks through patches sum to the patch's state digest."""
    full_check: dict[str, Any] = field(default_factory=dict)
    """The last whole read-back: at (unix time), version, ok, checked, unreadable, mismatched,
    seconds, why (scheduled | requested | update)."""

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

    takes_patches = True
    """The region hands it each version's patch file as soon as it is written (engine first,
    daemon/engine_first.py), before the version's directory is on disk."""

    def __init__(self, cfg: VllmHook, session: aiohttp.ClientSession, state_dir: Path) -> None:
        self.cfg = cfg
        self.session = session
        self.base = str(cfg.url).rstrip("/")
        self.report_dir = Path(state_dir) / "engine-reports"
        self.check = EngineCheck(enabled=cfg.check)
        self.updates = 0
        self.lock = asyncio.Lock()
        self.inited: dict[str, str] | None = None
        """The init the backend took last; sent again only when it changes or after a failed
        round (a restarted vLLM has lost it): 11-16 ms a version otherwise."""
        self.held: tuple[int, Path] | None = None
        """(version, weights dir) of the last update that verified: what a requested check
        reads back against."""

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
        # one connection per call: vLLM drops connections after an error answer, and a
        # pooled one then fails the next call ("connection reset")
        async with self.session.post(self.base + route, json=body or {}, params=params,
                                     headers={"Connection": "close"},
                                     timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)) as r:
            text = await r.text()
            if r.status != 200:
                r.close()  # vLLM drops the connection after an error: never reuse it
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

    async def _round(self, version: int, path: Path | None, mode: str,
                     patch: Path | None = None, full_check: bool = False) -> list[dict]:
        ticket = f"v{version}-{mode}-{uuid.uuid4().hex[:12]}"
        info: dict[str, Any] = {"version": version, "mode": mode, "check": self.cfg.check,
                                "ticket": ticket, "full_check": full_check}
        if path is not None:
            info["path"] = str(path)
        if patch is not None:
            info["patch"] = str(patch)
        await self._post("/start_weight_update")
        # a refused update closes vLLM's update session itself (its worker resets it on any
        # exception; a finish then would be refused), so there is nothing to close here
        await self._post("/update_weights", {"update_info": info})
        await self._post("/finish_weight_update", {"weight_version": str(version)})
        return self._reports(ticket)

    def _record(self, version: int, reports: list[dict]) -> None:
        c = self.check
        c.last_version = version
        c.mode = reports[0].get("mode") if reports else None
        c.loaded_tensors = sum(r.get("loaded_tensors", 0) for r in reports)
        c.loaded_bytes = sum(r.get("loaded_bytes", 0) for r in reports)
        checks = [r["check"] for r in reports if r.get("check")]
        c.reason = next((r["reason"] for r in reports if r.get("reason")), None)
        c.kind = checks[0].get("kind", "full") if checks else None
        c.words = sum(k.get("words", 0) for k in checks)
        states = [k.get("state_digest_ok") for k in checks]
        c.state_digest_ok = False if False in states else (True if True in states else None)
        fulls = [r["full"] for r in reports if r.get("full")]
        if fulls:
            self._record_full(version, fulls, "scheduled")
        elif c.kind == "full" and checks:
            self._record_full(version, checks, "update")
        c.checked = sum(k.get("checked", 0) for k in checks)
        c.unreadable = sum(k.get("unreadable_count", 0) for k in checks)
        c.check_s = max((k.get("seconds", 0.0) for k in checks), default=0.0)
        if checks:
            c.checks += 1
        oks = [k.get("ok") for k in checks]
        c.ok = False if False in oks else (True if True in oks else None)

    def _record_full(self, version: int, checks: list[dict], why: str) -> None:
        oks = [k.get("ok") for k in checks]
        self.check.full_check = {
            "at": time.time(), "version": version, "why": why,
            "ok": False if False in oks else (True if True in oks else None),
            "checked": sum(k.get("checked", 0) for k in checks),
            "unreadable": sum(k.get("unreadable_count", 0) for k in checks),
            "mismatched": sorted({n for k in checks for n in k.get("mismatched", [])})[:20],
            "seconds": max((k.get("seconds", 0.0) for k in checks), default=0.0)}

    async def _init(self, weights_dir: Path, patch: Path | None) -> bool:
        """Tell the backend where versions, patches and reports are; True if it was sent now
        (False: the backend was told this already)."""
        self.report_dir.mkdir(parents=True, exist_ok=True)
        init: dict[str, str] = {"weights_dir": str(weights_dir),
                                "report_dir": str(self.report_dir)}
        if patch is not None and not Path(patch).resolve().is_relative_to(
                Path(weights_dir).resolve()):
            init["patches_dir"] = str(Path(patch).parent)
        if init == self.inited:
            return False
        await self._post("/init_weight_transfer_engine", {"init_info": init})
        self.inited = init
        return True

    async def _told_round(self, told: bool, weights_dir: Path, patch: Path | None,
                          version: int, path: Path | None, mode: str) -> list[dict]:
        """`_round`; if it fails when the init was skipped (`told` False), vLLM may have
        restarted and forgotten where things are: it is told again and the round repeated once."""
        try:
            return await self._round(version, path, mode)
        except EngineRoundFailed:
            self.inited = None
            if told:
                raise
        await self._init(weights_dir, patch)
        return await self._round(version, path, mode)

    async def notify(self, version: int, path: Path, state_digest: str,
                     patch: Path | None = None) -> None:
        async with self.lock:
            await self._notify(version, Path(path), patch)

    async def _notify(self, version: int, path: Path, patch: Path | None) -> None:
        if version < 1:  # the backend refuses v0 (it serves the model it was started with):
            log.info("v%d: not sent to vLLM (start it from %s)", version, path)  # no pause
            return
        t0 = time.monotonic()
        self.check.phases = {}
        self.updates += 1
        every = getattr(self.cfg, "full_check_every", 0)
        full = bool(patch is not None and every and self.updates % every == 0)
        on_disk = (path / "VERSION.json").exists()
        told = await self._init(path.parent, patch)
        await self._post("/pause", params={"mode": "keep"})
        try:
            reports = None
            if patch is not None:
                try:
                    reports = await self._round(version, path if on_disk else None,
                                                self.cfg.mode, patch, full)
                except EngineRoundFailed as e:
                    log.info("v%d: the backend refused the patch (%s); loading %s", version,
                             e, path)
                    self.inited = None  # perhaps a restarted vLLM: tell it again
                    told = await self._init(path.parent, patch)
            if reports is None:
                if patch is not None:  # engine first: the directory follows the patch
                    await self._on_disk(version, path)
                reports = await self._told_round(told, path.parent, patch, version, path,
                                                 self.cfg.mode)
            self._record(version, reports)
            if patch is None:
                self.check.reason = self.check.reason or "no patch file given"
            passed, why = verdict(reports)
            if self.cfg.check and not passed:
                await self._repair(version, path, reports, why, wait=patch is not None)
            await self._post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        except (EngineRoundFailed, aiohttp.ClientError, TimeoutError) as e:
            self.inited = None
            self.check.last_error = f"v{version}: {e}"[:400]
            raise EngineRoundFailed(f"v{version} from {patch or path}: {e}; vLLM left paused") \
                from e
        await self._post("/resume")
        self.held = (version, path.parent)
        self.check.update_s = time.monotonic() - t0
        self.check.last_error = None

    async def full_check(self) -> dict[str, Any]:
        """Read every tensor back now (no pause: reads only) against the digests the engine
        tracks for the version it holds; the result lands in `engine_check.full_check`."""
        async with self.lock:
            if self.held is None:
                raise EngineRoundFailed("no verified update yet: nothing to check against")
            version, weights_dir = self.held
            told = await self._init(weights_dir, None)
            reports = await self._told_round(told, weights_dir, None, version, None, "check")
            checks = [r["check"] for r in reports if r.get("check")]
            if not checks:
                raise EngineRoundFailed(f"no check came back: {verdict(reports)[1]}")
            self._record_full(version, checks, "requested")
            return self.check.full_check

    async def _repair(self, version: int, path: Path, reports: list[dict], why: str,
                      wait: bool = False) -> None:
        c = self.check
        c.mismatches += 1
        c.last_mismatch_version, c.last_mismatch_at = version, time.time()
        c.mismatched = sorted({n for r in reports for n in (r.get("check") or {})
                               .get("mismatched", [])})[:20]
        log.warning("engine check failed for v%d (%s): full reload from %s", version, why, path)
        if wait:
            await self._on_disk(version, path)
        full = await self._round(version, path, "full")
        self._record(version, full)
        c.mode = "full"
        passed, why = verdict(full)
        if not passed:
            c.repair_failures += 1
            raise EngineRoundFailed(f"weights still differ after a full reload: {why}")
        c.repairs += 1

    async def _on_disk(self, version: int, path: Path) -> None:
        """Wait (vLLM paused: it never serves weights that are not a verified version) until
        the region has written v{version}'s directory, which it does right after the patch;
        for a patch the backend refused or a check that failed. EngineRoundFailed after the
        hook's timeout."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while not (path / "VERSION.json").exists():
            if time.monotonic() > deadline:
                raise EngineRoundFailed(f"v{version}'s directory {path} did not appear within "
                                        f"{self.cfg.timeout_s:g}s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        return None
