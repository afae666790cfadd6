r"""The rollout worker: follow the local daemon's verified weights, generate groups of
completions, score them with the task, and post them as trajectories to the daemon's spool.

Run: python -m rollout.worker --daemon http://127.0.0.1:7001 --token T --region eu
A new version is loaded between batches: as the daemon's patch files while the daemon serves a
version ahead of its disk (engine first: `serving.patches` of /v1/weights/current, applied in
place by an engine with `apply_patch`, each reported to POST /v1/engine/served), else from the
verified directory on disk (and a restarted worker loads the disk version, then the patches).
Posts retry with the same body (same ids) on
connection errors and 5xx, wait out 429 + Retry-After, and stop on a rejected request.
SIGTERM/SIGINT: finish delivering the current batch (bounded by --drain-s), then exit 0;
a second signal exits at once.
"""

import asyncio
import contextlib
import json
import logging
import math
import random
import signal
import sys
import time
import uuid
from typing import Any

import aiohttp
from pydantic import ValidationError

from chain.trajectory import LOGPROB_FLOOR, Trajectory, describe, retry_after_s
from rollout.config import WorkerConfig, parse_args

__all__ = ["RejectedError", "RolloutWorker", "WorkerConfig", "build_trajectories", "main",
           "parse_args"]
log = logging.getLogger("rollout.worker")


class RejectedError(RuntimeError):
    """The daemon refused a batch for a reason a retry cannot fix (bad token, bad data)."""


def build_trajectories(completions: list[Any], task: Any, group_size: int, region: str,
                       worker: str, stats: dict[str, int] | None = None,
                       run: str | None = None) -> list[dict[str, Any]]:
    """One trajectory per completion; completions are prompt-major, `group_size` per prompt.

    Each is checked against the shared model (chain.trajectory) before it is sent, so a worker
    never posts what its daemon and the trainer would refuse. A -inf log-prob (a token the
    engine gave probability 0, e.g. after top-k/top-p or an fp16 underflow) is clamped to
    LOGPROB_FLOOR: the trainer's truncated importance weight is the same cap either way, and the
    rest of the trajectory (and its group) still trains. Anything else invalid (a NaN reward or
    log-prob, a bad token id) is an engine or task bug: that trajectory is dropped, counted in
    `stats["dropped_invalid"]` and logged, rather than blocking the batch."""
    stats = {} if stats is None else stats
    now = time.time()
    out = []
    group = ""
    for i, c in enumerate(completions):
        if i % group_size == 0:
            group = uuid.uuid4().hex
        logprobs = [float(x) for x in c.logprobs]
        clamped = sum(x == -math.inf for x in logprobs)
        if clamped:
            logprobs = [LOGPROB_FLOOR if x == -math.inf else x for x in logprobs]
            stats["clamped_logprobs"] = stats.get("clamped_logprobs", 0) + clamped
        record = {
            "id": uuid.uuid4().hex, "version": c.version, "group": group,
            "prompt": c.prompt, "completion": c.text, "prompt_ids": list(c.prompt_ids),
            "completion_ids": list(c.token_ids), "logprobs": logprobs,
            "reward": float(task.reward(c.prompt, c.text)), "region": region,
            "worker": worker, "created": now, **({"run": run} if run else {}),
        }
        try:
            Trajectory.model_validate(record)
        except ValidationError as e:
            stats["dropped_invalid"] = stats.get("dropped_invalid", 0) + 1
            log.warning("dropping an invalid trajectory of version %s: %s", c.version,
                        describe(e))
            continue
        out.append(record)
    return out


class RolloutWorker:
    def __init__(self, config: WorkerConfig, engine: Any, task: Any) -> None:
        self.config = config
        self.engine = engine
        self.task = task
        self.stop = asyncio.Event()
        self.latest: tuple[int, str] | None = None
        """The newest verified version on the daemon's disk, and its directory."""
        self.serving: dict | None = None
        """Engine first: the versions verified past the disk, as patch files (daemon side)."""
        self.seen = -1
        self.refused_patch: tuple[int, str] | None = None
        """The last patch the engine refused: not read again (a directory follows)."""
        self._new_version = asyncio.Event()
        self._stop_at: float | None = None
        self.stats = {"batches": 0, "posted": 0, "retries": 0, "pushbacks": 0, "loads": 0,
                      "undelivered": 0, "clamped_logprobs": 0, "dropped_invalid": 0,
                      "patches": 0, "patch_failures": 0}
        self.pacing = {"generated": 0, "waits": 0}
        self._pace_from: int | None = None

    def request_stop(self) -> None:
        if not self.stop.is_set():
            self._stop_at = time.monotonic()
            self.stop.set()

    async def run(self) -> dict[str, int]:
        cfg = self.config
        headers = {"Authorization": f"Bearer {cfg.token}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            watcher = asyncio.create_task(self._watch(session))
            try:
                await self._loop(session)
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
        return self.stats

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        cfg = self.config
        rng = random.Random(cfg.seed)
        while not self.stop.is_set():
            if cfg.max_batches is not None and self.stats["batches"] >= cfg.max_batches:
                return
            await self._paced()
            if self.stop.is_set():
                return
            if self.seen != self.engine.version:
                if self.latest is None and self.engine.version is None:
                    await self._wait_any(self._new_version.wait())
                    continue
                await self._follow(session)
                if self.engine.version is None:
                    self._new_version.clear()
                    await self._wait_any(self._new_version.wait())
                    continue
            self.pacing["generated"] += cfg.prompts_per_batch * cfg.group_size
            prompts = self.task.sample_prompts(rng, cfg.prompts_per_batch)
            seed = rng.getrandbits(63)
            completions = await asyncio.to_thread(
                self.engine.generate, prompts, cfg.group_size, cfg.max_tokens,
                cfg.temperature, seed)
            trajs = build_trajectories(completions, self.task, cfg.group_size, cfg.region,
                                       cfg.worker, self.stats, cfg.run)
            if trajs:
                await self._post(session, trajs)
            self.stats["batches"] += 1

    async def _follow(self, session: aiohttp.ClientSession) -> None:
        """Bring the engine to the newest verified version: patches from its own version
        where the daemon has them, else the directory on disk, then patches from there."""
        await self._patches(session)
        have = self.engine.version
        if self.latest is not None and (have is None or have < self.latest[0]):
            version, path = self.latest
            try:
                await asyncio.to_thread(self.engine.load_version, path, version)
                self.stats["loads"] += 1
                log.info("loaded version %d from %s", version, path)
                await self._served(session, version, "load")
            except (OSError, ValueError) as e:
                log.error("cannot load version %d from %s: %s", version, path, e)
            await self._patches(session)

    async def _patches(self, session: aiohttp.ClientSession) -> None:
        apply = getattr(self.engine, "apply_patch", None)
        serving = self.serving
        if apply is None or serving is None:
            return
        for p in serving.get("patches") or []:
            have = self.engine.version
            if have is None or p["version"] <= have:
                continue
            if p["parent"] != have or (p["version"], p["path"]) == self.refused_patch:
                return
            t0 = time.monotonic()
            try:
                await asyncio.to_thread(apply, p["path"])
            except (OSError, ValueError) as e:  # refused or mismatched: a directory follows
                self.stats["patch_failures"] += 1
                self.refused_patch = (p["version"], p["path"])
                log.warning("patch v%s not applied (%s); waiting for its directory",
                            p["version"], e)
                return
            self.stats["patches"] += 1
            log.info("patched to version %d from %s in %.2fs", p["version"], p["path"],
                     time.monotonic() - t0)
            await self._served(session, p["version"], "patch")

    async def _served(self, session: aiohttp.ClientSession, version: int, how: str) -> None:
        """Tell the daemon this engine now generates with `version` (its status shows it)."""
        url = f"{self.config.daemon.rstrip('/')}/v1/engine/served"
        try:
            async with session.post(url, json={"engine": self.config.worker, "version": version,
                                               "how": how},
                                    timeout=aiohttp.ClientTimeout(total=5)) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.info("could not report serving v%d: %s", version, e)

    def has_credit(self) -> bool:
        """Pacing: may another batch start? Each version seen since the first grants
        `pace_per_version` trajectories, plus `pace_ahead` versions' worth up front; a batch
        starts while the worker is under its credit (so the first always does)."""
        cfg = self.config
        if cfg.pace_per_version is None or self.seen < 0:
            return True
        if self._pace_from is None:
            self._pace_from = self.seen
        versions = self.seen - self._pace_from + 1 + cfg.pace_ahead
        return self.pacing["generated"] < cfg.pace_per_version * versions

    async def _paced(self) -> None:
        """Wait (for a newer version, or stop) until pacing allows another batch: the trainer
        consumes a batch per version, so trajectories generated beyond that share would queue
        up and be dropped as stale."""
        while not self.stop.is_set():
            self._new_version.clear()
            if self.has_credit():
                return
            self.pacing["waits"] += 1
            await self._wait_any(self._new_version.wait())

    async def _wait_any(self, aw: Any) -> None:
        """Wait for `aw` or for stop, whichever first."""
        task = asyncio.ensure_future(aw)
        stopper = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for t in (task, stopper):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _watch(self, session: aiohttp.ClientSession) -> None:
        """Long-poll the daemon for verified versions newer than the latest seen."""
        cfg = self.config
        url = f"{cfg.daemon.rstrip('/')}/v1/weights/current"
        backoff = 0.2
        timeout = aiohttp.ClientTimeout(total=cfg.poll_timeout_s + 15)
        while True:
            # an engine that could not follow the patches waits for the disk to catch up
            behind = self.engine.version != self.seen and self.latest is not None
            after = self.latest[0] if behind else self.seen
            try:
                async with session.get(url, params={"after": after,
                                                    "timeout": cfg.poll_timeout_s},
                                       timeout=timeout) as r:
                    if r.status != 200:
                        raise aiohttp.ClientResponseError(r.request_info, (), status=r.status,
                                                          message=await r.text())
                    body = await r.json()
                backoff = 0.2
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
                log.warning("weights poll failed (%s); retrying in %.1fs", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, cfg.retry_max_s)
                continue
            version = body.get("version") if isinstance(body, dict) else None
            serving = body.get("serving") if isinstance(body, dict) else None
            serving = serving if isinstance(serving, dict) else None
            # an engine that cannot patch follows versions on disk only (it would otherwise
            # be "behind" the serving head for a whole disk batch, polling every 0.5 s)
            patches = getattr(self.engine, "apply_patch", None) is not None
            top = max(version if isinstance(version, int) else -1,
                      serving["version"] if patches and serving
                      and isinstance(serving.get("version"), int) else -1)
            if isinstance(version, int) and (self.latest is None or version > self.latest[0]):
                self.latest = (version, str(body["path"]))
                self._new_version.set()
            if top > self.seen:
                self.serving, self.seen = serving, top
                self._new_version.set()
            elif behind:
                await asyncio.sleep(0.5)

    def _drain_left(self) -> float | None:
        if self._stop_at is None:
            return None
        return self._stop_at + self.config.drain_s - time.monotonic()

    async def _post(self, session: aiohttp.ClientSession, trajs: list[dict[str, Any]]) -> None:
        """Deliver one batch; the body (and so every id) is identical on every attempt."""
        cfg = self.config
        url = f"{cfg.daemon.rstrip('/')}/v1/trajectories"
        body = b"".join(json.dumps(t, separators=(",", ":")).encode() + b"\n" for t in trajs)
        ids = [t["id"] for t in trajs]
        backoff = 0.2
        while True:
            left = self._drain_left()
            if left is not None and left <= 0:
                self.stats["undelivered"] += len(trajs)
                log.error("stopping with %d trajectories undelivered", len(trajs))
                return
            wait = backoff
            try:
                async with session.post(url, data=body, headers={
                        "Content-Type": "application/x-ndjson"}) as r:
                    text = await r.text()
                    if r.status == 200:
                        accepted = set(json.loads(text).get("held", []))
                        if accepted.issuperset(ids):
                            self.stats["posted"] += len(ids)
                            return
                        log.warning("daemon holds %d of %d; resending", len(accepted), len(ids))
                    elif r.status == 429:
                        self.stats["pushbacks"] += 1
                        wait = retry_after_s(r.headers.get("Retry-After"), backoff, 0.05,
                                             cfg.retry_max_s)
                    elif r.status < 500:
                        raise RejectedError(f"daemon refused trajectories: {r.status} {text[:300]}")
                    else:
                        log.warning("daemon error %d: %s", r.status, text[:200])
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
                log.warning("posting trajectories failed (%s); retrying in %.1fs", e, backoff)
            self.stats["retries"] += 1
            left = self._drain_left()
            await asyncio.sleep(wait if left is None else max(0.0, min(wait, left)))
            if wait == backoff:
                backoff = min(backoff * 2, cfg.retry_max_s)




async def _amain(config: WorkerConfig, threads: int) -> int:
    from rollout.engine import make_engine
    from rollout.tasks import load_task

    if threads:
        import torch
        torch.set_num_threads(threads)
    engine = make_engine(config.engine, **config.engine_kwargs())
    worker = RolloutWorker(config, engine, load_task(config.task))
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def on_signal() -> None:
        if worker.stop.is_set() and main is not None:
            main.cancel()
        worker.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        stats = await worker.run()
    except RejectedError as e:
        log.error("%s", e)
        return 2
    except asyncio.CancelledError:
        log.error("forced exit: %s", worker.stats)
        return 1
    log.info("stopped: %s, pacing %s", stats, worker.pacing)
    return 0


def main(argv: list[str] | None = None) -> int:
    config, threads = parse_args(argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(_amain(config, threads))


if __name__ == "__main__":
    sys.exit(main())
