"""One daemon process: the shared state of a node and the wiring of its parts.

`Node` holds the config, chain store, weights, peer book, swarm and counters; `serve()` builds
the aiohttp app whose `cleanup_ctx` starts the parts in order (HTTP client, engine hook, swarm,
seeding, spool, sync, systemd) and stops them in reverse, bounded by `shutdown_timeout_s`.
"""

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
from aiohttp import web

from chain import keys
from chain.atomic import write_atomic
from chain.store import ChainStore
from chain.weights import WeightsDir
from daemon import metrics, sdnotify
from daemon.app import NODE, Board, build_app
from daemon.config import Config, ConfigError, load_config
from daemon.hooks import Notifier, build_hook
from daemon.peers import HEADER, HeadWatcher, PeerBook
from daemon.publish import Seeder, current_of_head
from daemon.report import build_status
from daemon.spool import Forwarder, Spool
from daemon.status import NodeStatus
from daemon.swarm import Swarm, SwarmConfig, SwarmError
from daemon.sync import Syncer
from daemon.tasks import stop as stop_task
from daemon.tasks import watched

log = logging.getLogger("deltaswarm.node")


class Paths:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.chain = root / "chain"
        self.torrents = root / "torrents"
        self.swarm = root / "swarm"
        self.resume = root / "resume"
        self.weights = root / "weights"
        self.spool = root / "spool"
        for p in (self.chain, self.torrents, self.swarm, self.resume, self.weights, self.spool):
            p.mkdir(parents=True, exist_ok=True)


class Node:
    def __init__(self, cfg: Config, config_path: Path) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.token = cfg.bearer()
        self.url = cfg.http.url()
        self.started = time.monotonic()
        self.paths = Paths(cfg.state_dir)
        self.store = ChainStore(self.paths.chain, keys.parse_public(cfg.trainer_public_key))
        self.weights = WeightsDir(self.paths.weights, keep=cfg.retention.weight_dirs)
        self.board = Board()
        self.stopping = False
        self.stop_requested = asyncio.Event()
        self.failure: str | None = None
        self.swarm: Swarm | None = None
        self.swarm_exec = ThreadPoolExecutor(1, thread_name_prefix="swarm")
        self.book: PeerBook = PeerBook(self.url, (cfg.bt_advertise(), cfg.bittorrent.port),
                                       cfg.node, list(cfg.bootstrap))
        self.session: aiohttp.ClientSession | None = None
        self.notifier: Notifier | None = None
        self.syncer: Syncer | None = Syncer(self) if cfg.role == "region" else None
        self.seeder: Seeder | None = Seeder(self) if cfg.role == "trainer" else None
        self.spool: Spool | None = None
        self.forwarder: Forwarder | None = None
        self.spool_accepted = 0
        self.spool_duplicates = 0
        self.spool_refusals = 0
        self.bans: dict[str, dict] = {}
        self.piece_failures = 0
        self._registry = metrics.build_registry(self.status_model)

    # --- helpers used by the parts --------------------------------------------------------
    def bt_advertised(self) -> str:
        host, port = self.book.self_bt
        return f"{host}:{port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", HEADER: self.book.header()}

    async def get_bytes(self, url: str, limit: int = 64 << 20, timeout: float = 30.0) -> bytes:
        assert self.session is not None
        async with self.session.get(url, headers=self.headers(),
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                raise ValueError(f"GET {url}: HTTP {r.status}: {(await r.text())[:200]}")
            data = await r.content.read(limit + 1)
            if len(data) > limit:
                raise ValueError(f"GET {url}: reply larger than {limit} bytes")
            return data

    async def get_json(self, url: str) -> dict:
        import json

        doc = json.loads(await self.get_bytes(url, limit=16 << 20))
        if not isinstance(doc, dict):
            raise ValueError(f"GET {url}: reply is not a JSON object")
        return doc

    @staticmethod
    def write_file(path: Path, data: bytes) -> None:
        write_atomic(path, data)

    def forget_artifact(self, artifact: str) -> None:
        """Stop seeding an artifact dropped by retention and delete its swarm files."""
        if self.swarm is not None:
            self.swarm.remove(artifact)
        shutil.rmtree(self.paths.swarm / artifact, ignore_errors=True)
        (self.paths.torrents / f"{artifact}.torrent").unlink(missing_ok=True)
        (self.paths.resume / f"{artifact}.resume").unlink(missing_ok=True)

    def current(self) -> dict | None:
        if self.cfg.role == "trainer":
            return current_of_head(self)
        cur = self.weights.current()
        if cur is None:
            return None
        return {"version": cur.version, "state_digest": cur.state_digest, "path": str(cur.path)}

    def retry_after_s(self) -> int:
        t = self.cfg.trajectories
        return max(1, int(min(t.retry_max_s, 5 * t.retry_initial_s) + 0.5))

    def status_model(self) -> NodeStatus:
        return build_status(self)

    def status(self) -> dict:
        return build_status(self).model_dump(mode="json") | {"detail": self.detail()}

    def detail(self) -> dict:
        out: dict = {"url": self.url, "peer_book": self.book.snapshot(),
                     "spool_duplicates": self.spool_duplicates}
        if self.syncer is not None:
            out["sync"] = self.syncer.status()
        if self.seeder is not None:
            out["published"] = self.seeder.published[-10:]
        return out

    def metrics_text(self) -> tuple[bytes, str]:
        return metrics.render(self._registry)

    # --- swarm events ---------------------------------------------------------------------
    async def pump(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            assert self.swarm is not None
            events = await loop.run_in_executor(self.swarm_exec, self.swarm.pump, 0.5)
            for ev in events:
                if ev.kind == "banned" and ev.peer:
                    self.bans[ev.peer] = {"reason": ev.detail, "at": time.time()}
                    log.warning("banned peer %s: %s", ev.peer, ev.detail)
                elif ev.kind == "hash_failed":
                    self.piece_failures += 1
                    log.warning("%s: %s", ev.artifact, ev.detail)
                elif ev.kind == "error":
                    log.warning("swarm error on %s: %s", ev.artifact, ev.detail)

    async def save_resume(self) -> None:
        if self.swarm is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.swarm_exec, self.swarm.save_resume_data,
                                       self.paths.resume, 5.0)
        except SwarmError as e:
            log.warning("saving resume data: %s", e)

    async def resume_saver(self) -> None:
        """Save resume data every few seconds while something downloads (kill -9 safety)."""
        while True:
            await asyncio.sleep(2.0)
            if self.syncer is not None and self.syncer.downloads:
                await self.save_resume()

    def fail(self, why: str) -> None:
        """A part of the node died: stop, and exit non-zero so the service is restarted."""
        if self.failure is None:
            self.failure = why
        self.stop_requested.set()

    def spawn(self, coro, name: str) -> asyncio.Task:
        return watched(coro, name, self.fail)

    # --- config reload --------------------------------------------------------------------
    def reload(self) -> None:
        try:
            new = load_config(self.config_path)
        except ConfigError as e:
            log.error("SIGHUP: config not reloaded: %s", e)
            return
        self.book.set_bootstrap(list(new.bootstrap))
        if self.swarm is not None:
            self.swarm.set_rate_limits(new.limits.upload_bytes_per_s,
                                       new.limits.download_bytes_per_s)
        keep = {"bootstrap", "limits", "retention", "trajectories", "long_poll_timeout_s",
                "max_peers"}
        ignored = [k for k in Config.model_fields if k not in keep
                   and getattr(new, k) != getattr(self.cfg, k)]
        self.cfg = self.cfg.model_copy(update={k: getattr(new, k) for k in keep})
        if self.forwarder is not None:
            self.forwarder.cfg = self.cfg.trajectories
        log.info("SIGHUP: reloaded peers, limits, retention%s",
                 f"; restart to apply {ignored}" if ignored else "")
        self.book.changed.set()


# --- cleanup contexts (started in this order, stopped in reverse) -----------------------------
async def _http_client(app: web.Application) -> AsyncIterator[None]:
    node = app[NODE]
    node.session = aiohttp.ClientSession()
    node.notifier = Notifier(build_hook(node.cfg.engine, node.session, node.token),
                             node.cfg.engine.type)
    yield
    await node.notifier.hook.close()
    await node.session.close()


async def _swarm(app: web.Application) -> AsyncIterator[None]:
    node, cfg = app[NODE], app[NODE].cfg
    node.swarm = Swarm(SwarmConfig(
        listen=f"{cfg.bittorrent.host}:{cfg.bittorrent.port}",
        upload_rate=cfg.limits.upload_bytes_per_s, download_rate=cfg.limits.download_bytes_per_s,
        seed_mode=cfg.seed_mode))
    node.book.self_bt = (cfg.bt_advertise(), node.swarm.listen_port)
    pump = node.spawn(node.pump(), "swarm-pump")
    saver = node.spawn(node.resume_saver(), "resume-saver")
    yield
    for task in (saver, pump):
        await stop_task(task)
    await node.save_resume()
    node.swarm.close()
    node.swarm_exec.shutdown(wait=True)


async def _seeding(app: web.Application) -> AsyncIterator[None]:
    node = app[NODE]
    if node.seeder is not None:
        await node.seeder.start()
    else:
        await asyncio.to_thread(_reseed, node)
    yield


def _reseed(node: Node) -> None:
    """A restarted region keeps serving what it fully holds."""
    from daemon import torrents

    assert node.swarm is not None
    for name in node.store.artifacts():
        m = node.store.manifest(name)
        tpath = node.paths.torrents / f"{name}.torrent"
        if not tpath.is_file() or not node.store.has_blocks(m):
            continue
        torrents.link_blocks(name, [(b.id, node.store.blocks.path(b.id)) for b in m.blocks],
                             node.paths.swarm)
        try:
            node.swarm.seed(name, tpath.read_bytes(), node.paths.swarm)
        except SwarmError as e:
            log.warning("not reseeding %s: %s", name, e)


async def _spool(app: web.Application) -> AsyncIterator[None]:
    node = app[NODE]
    assert node.session is not None
    node.spool = await asyncio.to_thread(Spool, node.paths.spool,
                                         node.cfg.trajectories.spool_max_bytes)
    node.forwarder = Forwarder(node.spool, node.cfg.trajectories, node.token, node.session,
                               {HEADER: node.book.header()})
    task = node.spawn(node.forwarder.run(), "forwarder")
    yield
    await stop_task(task)
    node.spool.close()


async def _sync(app: web.Application) -> AsyncIterator[None]:
    node = app[NODE]
    if node.syncer is None:
        yield
        return
    assert node.session is not None
    syncer = node.syncer

    def known() -> int | None:
        return node.store.head()

    watcher = HeadWatcher(node.book, node.session, node.headers(), syncer.on_head, known,
                          node.cfg.max_peers, node.cfg.long_poll_timeout_s)
    tasks = [node.spawn(watcher.run(), "heads"), node.spawn(syncer.notify_loop(), "notify")]
    loop_task = node.spawn(syncer.run(), "sync")
    yield
    node.stopping = True
    syncer.wake.set()
    for task in tasks:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # timeout or a reported crash
        await asyncio.wait_for(asyncio.shield(loop_task), node.cfg.shutdown_timeout_s / 2)
    for task in [*tasks, loop_task, *syncer.downloads.values()]:
        await stop_task(task)


async def _systemd(app: web.Application) -> AsyncIterator[None]:
    node = app[NODE]

    async def report() -> None:
        while True:
            cur = node.current()
            sdnotify.status(f"v{cur['version'] if cur else '-'} current, head "
                            f"v{node.store.head()}, {len(node.book.peers)} peers")
            await asyncio.sleep(5.0)

    tasks = [node.spawn(sdnotify.watchdog_loop(lambda: not node.stopping), "watchdog"),
             node.spawn(report(), "systemd-status")]
    yield
    sdnotify.stopping(f"{node.cfg.node}: stopping")
    for task in tasks:
        await stop_task(task)


async def serve(cfg: Config, config_path: Path) -> int:
    node = Node(cfg, config_path)
    app = build_app(node)
    app.cleanup_ctx.extend([_http_client, _swarm, _seeding, _spool, _sync, _systemd])
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=3.0, access_log=None)
    loop = asyncio.get_running_loop()
    signals = {"n": 0}

    def on_stop() -> None:
        signals["n"] += 1
        if signals["n"] > 1:
            log.error("second stop signal: exiting now")
            os._exit(1)
        node.stop_requested.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)
    loop.add_signal_handler(signal.SIGHUP, node.reload)
    await runner.setup()
    site = web.TCPSite(runner, cfg.http.host, cfg.http.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"config {config_path}: field http.port: cannot listen on "
                          f"{cfg.http.host}:{cfg.http.port}: {e.strerror or e}") from None
    log.info("%s (%s, %s) serving on %s, BitTorrent on %s", cfg.node, cfg.role, cfg.region,
             node.url, node.bt_advertised())
    sdnotify.ready(f"{cfg.node}: serving on {node.url}")
    await node.stop_requested.wait()
    if node.failure:
        log.error("stopping after a failure (%s), bounded by %.0fs", node.failure,
                  cfg.shutdown_timeout_s)
    else:
        log.info("stopping (bounded by %.0fs)", cfg.shutdown_timeout_s)
    node.stopping = True
    await node.board.bump()
    try:
        await asyncio.wait_for(runner.cleanup(), cfg.shutdown_timeout_s)
    except TimeoutError:
        log.error("shutdown took longer than %.0fs; exiting anyway", cfg.shutdown_timeout_s)
        return 1
    if node.failure:
        log.error("stopped after a failure: %s", node.failure)
        return 1
    log.info("stopped cleanly")
    return 0
