"""One daemon process: wiring only. `Node` builds the parts and hands each what it uses; the
parts never see the node.

    peer client ─┬─ HeadWatcher ─┐
    peer book ───┤               ├─ RegionRole (sync)      ┐
    chain store ─┼─ Syncer ──────┘                         ├─ app routes (Parts), status
    weights ─────┤                                         │
    artifacts ───┴─ Seeder ──────── TrainerRole (publish) ─┘

`serve()` builds the aiohttp app whose `cleanup_ctx` starts the parts in order (HTTP client,
engine hook, swarm, role, spool, systemd) and stops them in reverse, bounded by
`shutdown_timeout_s`. SIGHUP calls `reload()`: each reloadable part's `reconfigure()`, the rest
listed as "restart to apply", wrapped in sd_notify RELOADING=1 / READY=1.
"""

import asyncio
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import aiohttp
from aiohttp import web

from chain import keys
from chain.atomic import write_atomic
from chain.errors import ChainError
from chain.store import ChainStore
from chain.weights import WeightsDir
from daemon import sdnotify
from daemon.app import Parts, build_app
from daemon.bittorrent.artifacts import Artifacts
from daemon.bittorrent.bans import BanList, BanRecord
from daemon.bittorrent.selfcheck import SelfCheck
from daemon.bittorrent.swarm import SwarmConfig
from daemon.config import Config, ConfigError, load_config
from daemon.engines.first import EngineFirst
from daemon.engines.hooks import Notifier, build_hook, takes_patches
from daemon.fleet.board import FleetBoard
from daemon.fleet.link import FleetParts, Reporter, Verifier
from daemon.observe import metrics
from daemon.observe.report import Sources, build_status
from daemon.observe.served import ServedBytes
from daemon.peering.asking import HeadWatcher, prove_loop
from daemon.peering.identity import Identities
from daemon.peering.peer_client import PeerClient, PeerError
from daemon.peering.peers import BadPeer, Peer, PeerBook, check_url
from daemon.peering.regions import (
    GatewayMetrics,
    RegionPeering,
    discover_loop,
    link_bytes,
    wanting,
)
from daemon.roles import RegionRole, TrainerRole
from daemon.tasks import stop as stop_task
from daemon.tasks import watched, within
from daemon.trajectories.intake import Intake
from daemon.trajectories.spool import Forwarder, Spool
from daemon.versions.live import LiveNodes
from daemon.versions.longpoll import Board
from daemon.versions.publish import Seeder
from daemon.versions.retain import Keeper
from daemon.versions.sync import Syncer
from daemon.versions.weights_check import WeightsCheck

log = logging.getLogger("deltaswarm.node")
RELOADABLE = frozenset({"bootstrap", "limits", "retention", "sync", "trajectories",
                        "long_poll_timeout_s", "max_peers", "token", "token_file"})
"""Config fields SIGHUP applies; any other change is logged as "restart to apply"."""


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


def bt_host(cfg: Config, config_path: Path, timeout: float = 5.0) -> str:
    """The BitTorrent host to advertise as an IP literal: other daemons dial it with libtorrent,
    which takes nothing else. A name (`advertise_host: trainer.example.internal`) is resolved
    once here, bounded, before the event loop serves; failing that, a ConfigError names the
    field."""
    field = "bittorrent.advertise_host" if cfg.bittorrent.advertise_host else "bittorrent.host"
    host = cfg.bt_advertise().strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.is_unspecified:
            raise ConfigError(f"config {config_path}: field {field}: {host} cannot be dialled; "
                              "set bittorrent.advertise_host to this host's address")
        return str(ip)
    ex = ThreadPoolExecutor(1, thread_name_prefix="resolve")
    try:  # getaddrinfo has no timeout of its own: stop waiting for its thread instead
        infos = ex.submit(socket.getaddrinfo, host, None, 0, socket.SOCK_STREAM).result(timeout)
    except FutureTimeout:
        raise ConfigError(f"config {config_path}: field {field}: resolving {host!r} took over "
                          f"{timeout:.0f}s; give an IP address") from None
    except OSError as e:
        raise ConfigError(f"config {config_path}: field {field}: cannot resolve {host!r} "
                          f"({e.strerror or e}); give an IP address or a name that resolves"
                          ) from None
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    addrs = [i[4][0] for i in infos]
    v4 = [a for a in addrs if ":" not in a]
    chosen = (v4 or addrs)[0]
    log.info("%s %s resolves to %s; advertising that", field, host, chosen)
    return chosen


class Node:
    """Builds the parts of one daemon from its config and wires them together."""

    def __init__(self, cfg: Config, config_path: Path, advertise_bt: str | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.started = time.monotonic()
        self.stopping = False
        self.stop_requested = asyncio.Event()
        self.failure: str | None = None
        self.paths = Paths(cfg.state_dir)
        try:
            self.identity = Identities.open(cfg.state_dir, cfg.node)
        except ChainError as e:
            raise ConfigError(f"config {config_path}: field state_dir: {e}") from None
        try:
            self.url = check_url(cfg.http.url())
            self.book = PeerBook(self.url, (advertise_bt or cfg.bt_advertise(),
                                            cfg.bittorrent.port),
                                 cfg.node, list(cfg.bootstrap), cfg.max_peers)
        except BadPeer as e:
            raise ConfigError(f"config {config_path}: field http.advertise_url or bootstrap: "
                              f"{e}") from None
        self.peering = RegionPeering(cfg.region_peering.mode, cfg.region_peering.gateways,
                                     cfg.region_peering.gateway_deadline_s,
                                     cfg.region_peering.gateway_demote_s)
        self.book.set_region(cfg.region, cfg.role, self.peering)
        self.peering.book = self.book
        self.book.pin = lambda node, key, source: self.identity.claim(node, key, source)
        self.store = ChainStore(self.paths.chain, keys.parse_public(cfg.trainer_public_key))
        self.weights = WeightsDir(self.paths.weights, keep=cfg.retention.weight_dirs)
        self.board = Board()
        self.live = LiveNodes(cfg.retention.live_within_s)
        self.client = PeerClient(None, cfg.bearer(), self.book.announce)
        self.client.signer = self.identity.own
        self.artifacts = Artifacts(self.paths.torrents, self.paths.swarm, self.paths.resume,
                                   cfg.bittorrent.piece_size,
                                   BanList(self.paths.root / "bans.json", cfg.bans.expiry_s))
        self.intake = Intake(cfg.trajectories.retry_initial_s, cfg.trajectories.retry_max_s)
        self.notifier: Notifier | None = None
        self.weights_problem: str | None = None
        self.role = self._role()
        self.fleet = self._fleet()
        self.selfcheck = SelfCheck(self.store, self.artifacts, cfg.self_check,
                                   self.book.bt_endpoints, self._fetching)
        self.artifacts.on_bad_piece = lambda a: self.selfcheck.request(a, "hash_failed")
        self.artifacts.on_ban = self._complain
        self._complaints: set[asyncio.Task] = set()
        self.warmup: dict = {"state": "pending", "seconds": None, "error": None}
        self.parts = Parts(
            node=cfg.node, url=self.url, token=self.client.token, bt=self.bt_advertised,
            long_poll_timeout_s=cfg.long_poll_timeout_s,
            max_body_bytes=cfg.http.max_body_bytes, store=self.store, book=self.book,
            board=self.board, artifacts=self.artifacts, role=self.role, intake=self.intake,
            status=self.status, metrics=self.metrics_text, stopping=lambda: self.stopping,
            fleet=self.fleet, live=self.live, identity=self.identity,
            complaint=lambda artifact: self.selfcheck.request(artifact, "complaint"),
            engine_check=self._engine_full_check)
        self._registry = metrics.build_registry(self.status_model)
        self._registry.register(GatewayMetrics(self.peering))  # daemon/peering/regions.py
        self.served = ServedBytes()  # daemon/observe/served.py: the control plane's cost
        self._registry.register(self.served)
        self._forwarding: asyncio.Task | None = None

    def _live_versions(self) -> list[int | None]:
        """Versions live nodes hold, one per node, for retention: the nodes that long-poll this
        daemon's head, and those further down a chain that only fleet reports tell us about
        (a poll, being first-hand, wins over a forwarded report)."""
        now = time.time()
        held: dict[str, int | None] = {}
        fleet = getattr(self, "fleet", None)
        if fleet is not None:
            held = {e.report.node: e.report.version
                    for e in fleet.board.live(now, self.cfg.retention.live_within_s)}
        return list((held | self.live.held(now)).values())

    def _role(self) -> TrainerRole | RegionRole:
        """Trainer or region behaviour, chosen here once."""
        cfg = self.cfg
        keeper = Keeper(self.store, cfg.retention.policy(), self._live_versions,
                        cfg.retention.live_within_s, record=cfg.role == "trainer")
        if cfg.role == "trainer":
            return TrainerRole(Seeder(self.store, self.artifacts, self.board, keeper),
                               self.store)
        first = EngineFirst(self.weights, self.paths.root / "patches",
                            lambda b: self.store.blocks.get(b.id, b.size),
                            # adapters are small and vLLM loads them from a directory
                            enabled=cfg.sync.engine_first and cfg.adapter is None,
                            batch=cfg.sync.disk_batch_versions,
                            idle_s=cfg.sync.disk_idle_s)
        syncer = Syncer(store=self.store, weights=self.weights, book=self.book,
                        client=self.client, artifacts=self.artifacts, board=self.board,
                        notify=self._notify, keeper=keeper, settings=cfg.sync,
                        engine_first=first, adapters=cfg.adapter is not None,
                        adapter_base=cfg.adapter.base_weights if cfg.adapter else None,
                        adapter_run=cfg.adapter.run if cfg.adapter else None)

        def poller() -> dict[str, str]:
            have = syncer.current_version()
            return {"node": cfg.node, "region": cfg.region,
                    "have": "" if have is None else str(have)}

        watcher = HeadWatcher(self.book, self.client, syncer.on_head, self.store.head,
                              cfg.max_peers, cfg.long_poll_timeout_s, poller,
                              elsewhere=syncer.hears_elsewhere, through=syncer.watched,
                              glance_s=syncer.glance_s)
        check = WeightsCheck(self.weights, cfg.self_check, syncer.set_aside_damaged)
        return RegionRole(syncer, watcher, self.weights, self.store, self.artifacts,
                          self.cfg.node, check)

    def _fleet(self) -> FleetParts:
        """The fleet board and the reports this daemon sends upstream (daemon/fleet/board.py)."""
        f = self.cfg.fleet
        book = self.book

        def peers_at(ip: str) -> list[tuple[str | None, str | None, str | None]]:
            # region and role as announced (topo's Peer.region / Peer.role, where merged)
            return [(p.node, getattr(p, "region", None), getattr(p, "role", None))
                    for p in book.peers.values() if p.bt is not None and p.bt[0] == ip]

        parts = FleetParts(
            node=self.cfg.node, region=self.cfg.region, role=self.role.name, url=self.url,
            board=FleetBoard(self.cfg.node, f.max_nodes, f.forget_s, f.max_per_reporter),
            key=self.identity.own,
            verifier=Verifier(self.client), current=self.role.current, head=self.store.head,
            torrents=lambda: self.artifacts.status()["torrents"], peers_at=peers_at,
            waiting=lambda: self.intake.spool.depth() if self.intake.spool is not None else 0)
        parts.reporter = Reporter(
            board=parts.board, client=self.client, directory=parts.directory,
            own=parts.own_report, interval_s=f.interval_s, tick=parts.tick,
            upstreams=lambda: self._report_upstreams(parts))
        return parts

    def _report_upstreams(self, parts: FleetParts) -> list[str]:
        """Where this node's fleet reports go: `fleet.report_to` when set; else where its fetch
        role says (Syncer.report_targets: a member to its region's fetcher, a fetcher to its
        bootstrap peers outside its region, else the trainer), with the bootstrap list too
        while one of those does not take them; else the bootstrap list. So the trainer answers
        a report per region per interval, not one per node (docs/SCALE.md 7.2)."""
        f = self.cfg.fleet
        if f.report_to is not None:
            return list(f.report_to)
        boot = list(self.cfg.bootstrap)
        targets = self.role.syncer.report_targets() if self.role.syncer is not None else []
        if not targets:
            return boot
        state = parts.reporter.state if parts.reporter is not None else {}
        if any(state.get(u) is not None and state[u].last_error for u in targets):
            return [*targets, *(u for u in boot if u not in targets)]
        return targets

    @property
    def syncer(self) -> Syncer | None:
        return self.role.syncer

    def _fetching(self, artifact: str) -> bool:
        return self.role.syncer is not None and artifact in self.role.syncer.downloads

    # --- bans and self-checks ---------------------------------------------------------------
    def _complain(self, rec: BanRecord) -> None:
        """Tell the banned peer (if the book knows its control URL) so it re-checks what it
        serves; its own self-check decides, our word is only a trigger."""
        peer = self.book.at_endpoint(rec.endpoint)
        if peer is None or self.client.session is None:
            return
        task = asyncio.get_running_loop().create_task(self._send_complaint(peer, rec))
        self._complaints.add(task)
        task.add_done_callback(self._complaints.discard)

    async def _send_complaint(self, peer: Peer, rec: BanRecord) -> None:
        body = json.dumps({"artifact": rec.artifact, "reason": rec.reason}).encode()
        try:
            await self.client.request("POST", f"{peer.url}/v1/swarm/complaints", "ack",
                                      auth=True, timeout=10.0, data=body,
                                      headers={"Content-Type": "application/json"})
            log.info("told %s it sent bad data for %s", peer.url, rec.artifact)
        except PeerError as e:
            log.info("could not tell %s about its bad data: %s", peer.url, e)

    def start_warmup(self) -> None:
        """Compile the codec kernels in a daemon thread (chain/warmup.py); a stop never waits
        for it, and a real apply meanwhile waits only for the kernel it needs."""
        def run() -> None:
            from chain.warmup import warm

            self.warmup["state"] = "running"
            t0 = time.monotonic()
            try:
                self.warmup["kernels"] = warm(self.paths.root).get("kernels")
            except Exception as e:
                self.warmup.update(state="failed", error=f"{type(e).__name__}: {e}"[:300])
                log.warning("codec warm-up failed: %s", self.warmup["error"])
            else:
                self.warmup["state"] = "ready"
                log.info("codec kernels ready in %.1fs", time.monotonic() - t0)
            finally:
                self.warmup["seconds"] = round(time.monotonic() - t0, 3)

        if self.role.syncer is None:  # the trainer's daemon seeds; it never applies
            self.warmup["state"] = "off"
            return
        for stale in self.paths.root.glob("deltaswarm-warmup-*"):  # left by a kill -9
            shutil.rmtree(stale, ignore_errors=True)
        threading.Thread(target=run, name="warmup", daemon=True).start()

    async def _engine_full_check(self) -> dict:
        """POST /v1/engine/check: the engine hook's whole read-back, if it has one."""
        run = getattr(self.notifier.hook if self.notifier else None, "full_check", None)
        if run is None:
            raise LookupError(f"the engine hook ({self.cfg.engine.type}) has no weight check")
        return await run()

    async def _notify(self, version: int, path: Path, digest: str,
                      patch: Path | None = None) -> None:
        """A hook that takes patches gets each version it has not served yet, as its patch
        (engine first) or from disk; any other hook gets versions on disk."""
        n = self.notifier
        if n is None:
            return
        patches = takes_patches(n.hook)
        if patch is not None and not patches:
            return
        if patches and (n.last_version or -1) >= version:
            return  # it has it (or, after a rebuild from a snapshot, something newer)
        if await n.notify(version, path, digest, patch) and n.kind != "none":
            syncer = self.role.syncer
            if syncer is not None and syncer.engine_first is not None:
                syncer.engine_first.served(f"hook:{n.kind}", version,
                                           "patch" if patch is not None else "load")

    def bt_advertised(self) -> str:
        host, port = self.book.self_bt
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def current(self) -> dict | None:
        return self.role.current()

    def sources(self) -> Sources:
        return Sources(node=self.cfg.node, region=self.cfg.region, role=self.role.name,
                       url=self.url, bt=self.bt_advertised, started=self.started,
                       store=self.store, book=self.book, artifacts=self.artifacts,
                       current=self.role.current, syncer=self.role.syncer, intake=self.intake,
                       notifier=lambda: self.notifier, engine_type=self.cfg.engine.type,
                       upstream=self.cfg.trajectories.upstream,
                       weights_problem=self._weights_problem,
                       weights_check=self.role.weights_check,
                       self_check=self.selfcheck.status, warmup=lambda: dict(self.warmup))

    def _weights_problem(self) -> str | None:
        """The newest problem with the stored weights: the running check's, else start's."""
        syncer = self.role.syncer
        return (syncer.weights_damaged if syncer is not None and syncer.weights_damaged
                else self.weights_problem)

    def status_model(self, swarm: dict | None = None):
        return build_status(self.sources(), swarm)

    def status(self) -> dict:
        sections = self.role.sections()
        sections["retention"]["nodes"] = self.live.snapshot()
        swarm = self.artifacts.status()  # one walk over every torrent's peers, used thrice
        return (self.status_model(swarm).model_dump(mode="json") | sections
                | {"identity": self.identity_status(),
                   "detail": self.detail(swarm),
                   "fleet": self.fleet.board.summary(self.fleet.view()),
                   "region_peering": {**self.peering.status(),
                                      "bytes": link_bytes(self.book, swarm)}})

    def identity_status(self) -> dict:
        """This node's key fingerprint and the claims to other names it refused."""
        return self.identity.status() | {
            "refused_headers": self.book.refused_headers,
            "last_refused_header": self.book.last_refused_header or None,
            "unsigned_polls": self.live.unsigned}

    def detail(self, swarm: dict) -> dict:
        return {"url": self.url, "peer_book": self.book.snapshot(),
                "spool_duplicates": self.intake.duplicates,
                "rate_limits": {k: swarm.get(k) for k in ("upload_rate_limit",
                                                          "download_rate_limit")},
                **self.role.detail()}

    def metrics_text(self) -> tuple[bytes, str]:
        body, content_type = metrics.render(self._registry)
        return body + metrics.render(self.identity.metrics())[0], content_type

    def fail(self, why: str) -> None:
        """A part of the node died: stop, and exit non-zero so the service is restarted."""
        if self.failure is None:
            self.failure = why
        self.stop_requested.set()

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        return watched(coro, name, self.fail)

    async def check_weights(self) -> None:
        """Verify the current weights at start, off the loop (`WeightsDir.check_at_start`
        recomputes every digest: one pass over memory). A damaged version is set aside, so the
        planner rebuilds from the best snapshot; the problem is shown in status."""
        held = await asyncio.to_thread(_dir_bytes, self.weights.root)
        # The check reads every held weight file once; from a cold disk at a pessimistic
        # 200 MB/s that can outlast TimeoutStartSec (120 s in the unit) for a 70B model.
        sdnotify.extend_timeout(60 + held / 200e6)
        _, problem = await asyncio.to_thread(self.weights.check_at_start)
        if problem:
            self.weights_problem = str(problem)[:500]
            log.warning("weights at start: %s", self.weights_problem)

    # --- trajectories forwarding ----------------------------------------------------------
    def start_forwarder(self) -> None:
        assert self.intake.spool is not None and self.client.session is not None
        self.intake.forwarder = Forwarder(self.intake.spool, self.cfg.trajectories,
                                          self.client.token, self.client.session,
                                          self.book.announce())
        self._forwarding = self.spawn(self.intake.forwarder.run(), "forwarder")

    async def stop_forwarder(self) -> None:
        if self._forwarding is not None:
            await stop_task(self._forwarding)
            self._forwarding = None

    # --- config reload --------------------------------------------------------------------
    async def reload(self) -> None:
        """SIGHUP: apply what each part can take while running; list the rest."""
        sdnotify.reloading()
        try:
            try:
                new = load_config(self.config_path)
                token = new.bearer()
                self.book.reconfigure(list(new.bootstrap), new.max_peers)
            except (ConfigError, BadPeer) as e:
                log.error("SIGHUP: config not reloaded: %s", e)
                return
            old, old_token = self.cfg, self.client.token
            self.artifacts.set_rate_limits(new.limits.upload_bytes_per_s,
                                           new.limits.download_bytes_per_s)
            self.role.reconfigure(new)
            self.live.within_s = new.retention.live_within_s
            self.weights.keep = new.retention.weight_dirs
            self.client.reconfigure(token)
            self.parts.token = token
            self.parts.long_poll_timeout_s = new.long_poll_timeout_s
            t = new.trajectories
            self.intake.reconfigure(t.retry_initial_s, t.retry_max_s)
            if self.intake.spool is not None:
                self.intake.spool.max_bytes = t.spool_max_bytes
            self.cfg = old.model_copy(update={k: getattr(new, k) for k in RELOADABLE})
            if (t != old.trajectories or token != old_token) and self.intake.spool:
                await self.stop_forwarder()  # rebuilt: new upstream, new token
                self.start_forwarder()
            restart = sorted(k for k in Config.model_fields if k not in RELOADABLE
                             and getattr(new, k) != getattr(old, k))
            log.info("SIGHUP: reloaded %s%s", sorted(RELOADABLE),
                     f"; restart to apply {restart}" if restart else "")
        finally:
            sdnotify.ready(f"{self.cfg.node}: reloaded")


# --- cleanup contexts (started in this order, stopped in reverse) -----------------------------
def _node(app: web.Application) -> Node:
    return app[NODE_OBJ]


NODE_OBJ: web.AppKey[Node] = web.AppKey("node-object")


async def _http_client(app: web.Application) -> AsyncIterator[None]:
    node = _node(app)
    session = aiohttp.ClientSession()
    node.client.session = session
    node.notifier = Notifier(build_hook(node.cfg.engine, session, node.client.token,
                                        node.cfg.state_dir), node.cfg.engine.type)
    yield
    await node.notifier.hook.close()
    await session.close()


async def _swarm(app: web.Application) -> AsyncIterator[None]:
    node, cfg = _node(app), _node(app).cfg
    swarm = node.artifacts.open(SwarmConfig(
        listen=f"{cfg.bittorrent.host}:{cfg.bittorrent.port}",
        upload_rate=cfg.limits.upload_bytes_per_s, download_rate=cfg.limits.download_bytes_per_s,
        seed_mode=cfg.seed_mode, pex=cfg.region_peering.mode == "blind"))
    node.book.self_bt = (node.book.self_bt[0], swarm.listen_port)
    pump = node.spawn(node.artifacts.pump(), "swarm-pump")
    saver = node.spawn(node.artifacts.resume_saver(node.role.downloading), "resume-saver")
    yield
    for task in (saver, pump):
        await stop_task(task)
    await node.artifacts.close()


def _dir_bytes(root: Path) -> int:
    """Bytes of the regular files under `root` (links are not followed)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


async def _role(app: web.Application) -> AsyncIterator[None]:
    node = _node(app)
    await node.check_weights()
    prover = node.spawn(prove_loop(node.book, node.client), "prove-peers")
    discover = (node.spawn(discover_loop(node.book, node.client), "discover-peers")
                if node.cfg.role == "region" else None)
    await node.role.start(node.spawn)
    checker = node.spawn(node.selfcheck.run(), "self-check")
    gateways = node.spawn(node.peering.watch(
        node.book, lambda: node.artifacts.swarm,
        lambda: wanting(node.role.syncer, node.artifacts.swarm, node.book)), "gateway-watch")
    yield
    node.stopping = True
    node.selfcheck.stop()
    await stop_task(checker)
    await stop_task(gateways)
    await node.role.stop(node.cfg.shutdown_timeout_s / 2)
    await stop_task(prover)
    if discover is not None:
        await stop_task(discover)


async def _spool(app: web.Application) -> AsyncIterator[None]:
    node = _node(app)
    node.intake.spool = await asyncio.to_thread(Spool, node.paths.spool,
                                                node.cfg.trajectories.spool_max_bytes)
    node.start_forwarder()
    yield
    await node.stop_forwarder()
    node.intake.spool.close()


async def _fleet(app: web.Application) -> AsyncIterator[None]:
    node = _node(app)
    assert node.fleet.reporter is not None
    task = node.spawn(node.fleet.reporter.run(), "fleet-reports")
    pins = node.spawn(_save_pins(node), "save-pins")
    yield
    for t in (pins, task):
        await stop_task(t)
    node.identity.save(force=True)


async def _save_pins(node: Node) -> None:
    """Pins made since the last save reach disk within 5 s (and at stop); the durable write
    runs off the event loop."""
    while True:
        await asyncio.sleep(5.0)
        data = node.identity.dump()
        if data is not None:
            await asyncio.to_thread(write_atomic, node.identity.path, data)


async def _systemd(app: web.Application) -> AsyncIterator[None]:
    node = _node(app)

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
    node = Node(cfg, config_path, await asyncio.to_thread(bt_host, cfg, config_path))
    app = build_app(node.parts)
    node.served.attach(app)
    app[NODE_OBJ] = node
    node.start_warmup()
    app.cleanup_ctx.extend([_http_client, _swarm, _role, _spool, _fleet, _systemd])
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
    loop.add_signal_handler(signal.SIGHUP, lambda: node.spawn(node.reload(), "reload"))
    await runner.setup()
    site = web.TCPSite(runner, cfg.http.host, cfg.http.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"config {config_path}: field http.port: cannot listen on "
                          f"{cfg.http.host}:{cfg.http.port}: {e.strerror or e}") from None
    log.info("%s (%s, %s) serving on %s, BitTorrent on %s, identity key %s", cfg.node,
             cfg.role, cfg.region, node.url, node.bt_advertised(),
             node.identity.own.fingerprint)
    serving = node.spawn(node.role.serving(), "serving")
    sdnotify.ready(f"{cfg.node}: serving on {node.url}")
    await node.stop_requested.wait()
    if node.failure:
        log.error("stopping after a failure (%s), bounded by %.0fs", node.failure,
                  cfg.shutdown_timeout_s)
    else:
        log.info("stopping (bounded by %.0fs)", cfg.shutdown_timeout_s)
    node.stopping = True
    await stop_task(serving)
    await node.board.bump()
    if not await within(runner.cleanup(), cfg.shutdown_timeout_s):
        # `within` returns at the deadline without waiting for the cancelled cleanup (aiohttp
        # would run every remaining cleanup context first); exit without the loop's teardown.
        log.error("shutdown took longer than %.0fs; exiting anyway", cfg.shutdown_timeout_s)
        logging.shutdown()
        os._exit(1)
    if node.failure:
        log.error("stopped after a failure: %s", node.failure)
        return 1
    log.info("stopped cleanly")
    return 0
