"""The region's sync loop: newer head → manifests → plan → torrents → swarm download → adopt
blocks → journaled apply → mark current → notify the engine → keep seeding → retention.

Manifests enter only through `ChainStore.add_manifest` (signature, run and parent checks);
refusals are counted with their kind (the exception's type). Peers are asked concurrently
(`FANOUT` at a time, first answer wins) so a silent peer never holds up one that answers; a peer
whose claimed head it cannot back with a manifest is struck (daemon/peering/peers.py). The plan's
artifacts download concurrently and apply in order in a worker thread; a stop request abandons
an apply between tensors (the journal makes that safe) and downloads keep their resume data.

Plans follow what exists (issue 11): before its first plan a region gathers heads from several
peers (`head_quorum`, `head_wait_s`) so it plans once toward the real head; each plan counts, per
artifact, the peers whose index lists it as held, and prefers a path every artifact of which has
a holder; a download that gains no bytes for `progress_timeout_s`, or an artifact nobody lists
or serves for `unoffered_timeout_s`, is given up for a while and the region replans (a later
snapshot plus deltas). Retention runs after every step, failed ones included. A stalled
artifact's next attempt starts from a fresh torrent (libtorrent never re-dials a peer that refused
a few connects, e.g. a trainer restarted on the same endpoint) and also dials the peers listing it
as held, across regions too (`_dial_for`).
"""

import asyncio
import contextlib
import logging
import random
import shutil
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from chain.adapters import BaseNotHeld, find_base
from chain.errors import (
    BadBlock,
    BadManifest,
    BadSignature,
    ChainError,
    NoPath,
    OtherRun,
    Replay,
    Unsigned,
    WrongParent,
)
from chain.manifest import BlockEntry, Manifest, parse_artifact
from chain.sizes import Sizes, new_file_bytes
from chain.store import ChainStore
from chain.weights import Current, WeightsDir
from daemon.bittorrent import torrents
from daemon.bittorrent.artifacts import Artifacts
from daemon.bittorrent.redial import Redial
from daemon.bittorrent.swarm import SwarmError
from daemon.config import SyncConfig
from daemon.engines.first import EngineFirst
from daemon.peering.asking import HeadQuorum, first_good
from daemon.peering.holders import Holders
from daemon.peering.peer_client import BadReply, PeerClient, PeerError, torrent_cap
from daemon.peering.peers import (
    INDEX_PEERS,
    BadPeer,
    Peer,
    PeerBook,
    check_node,
    parse_endpoint,
)
from daemon.peering.regions import heard_from
from daemon.versions.longpoll import Board
from daemon.versions.retain import Keeper

log = logging.getLogger("deltaswarm.sync")
Notify = Callable[..., Awaitable[object]]
T = TypeVar("T")
TRAINER_INDEX_S = 30.0
"""A node that hears the trainer through another (a region's member, a region's fetcher)
re-reads the trainer's index, and asks its head, at most this often per TRAINER_INDEX_READERS
nodes (`glance_s`); between reads the trainer is taken to hold what it published
(refresh_holders). Scaled by the fleet so the trainer answers about TRAINER_INDEX_READERS such
reads per TRAINER_INDEX_S up to GLANCE_MAX_S apart (docs/SCALE.md 7.3)."""
TRAINER_INDEX_READERS = 8
GLANCE_MAX_S = 600.0
FIRST_ROUND_S = 5.0
"""Longest a version's manifests or torrent are asked of peers other than the trainer before
the trainer is asked too (ask_sparing_trainer): a claimant that never answers costs this, not
a request timeout (15-60 s)."""
"""(version, path, state_digest, patch: Path | None): the engines, patch first (engine_first)."""
PROGRESS_CHECK_S = 0.5
"""A download's periodic checks (stall, holders to dial); completion itself wakes it at once."""


class SyncError(RuntimeError):
    """A sync step could not complete (no peer served what was needed); it is retried."""


class Stalled(SyncError):
    """A download gained no bytes for `progress_timeout_s`; the region plans around it."""


class Abandoned(Exception):
    """The daemon is stopping; the apply stops between tensors (the journal resumes it)."""


class Syncer:
    """Follows the swarm for a region. Receives what it uses: the chain store, the weights,
    the peer book and client, the artifact component, the board, and `notify` (the engine)."""

    def __init__(self, *, store: ChainStore, weights: WeightsDir, book: PeerBook,
                 client: PeerClient, artifacts: Artifacts, board: Board, notify: Notify,
                 keeper: Keeper, settings: SyncConfig,
                 engine_first: EngineFirst | None = None,
                 adapter_base: Path | None = None, adapters: bool = False,
                 adapter_run: str | None = None) -> None:
        """`adapters`: this region follows a LoRA run, whose versions apply only over a base
        held under `adapter_base` (the base daemon's weights directory; chain/adapters.py)."""
        self.store = store
        self.weights = weights
        self.book = book
        self.client = client
        self.artifacts = artifacts
        self.board = board
        self.notify = notify
        self.keeper = keeper
        self.settings = settings
        self.stopping = False
        self.wake = asyncio.Event()
        self.downloads: dict[str, asyncio.Task] = {}
        self.transfers: dict[str, dict] = {}
        self.refused: deque[dict] = deque(maxlen=50)
        self.refused_counts: Counter[str] = Counter()
        self._refused_at: dict[tuple[str, str], float] = {}
        self.failures: Counter[str] = Counter()
        self.applied: deque[dict] = deque(maxlen=50)
        self.bytes_saved = 0
        """Dense minus payload tensor bytes of the deltas applied since start."""
        self.totals: Counter[str] = Counter()
        """Sizes of the versions applied since start (see _applied)."""
        self._last_applied: Manifest | None = None
        self.applying: dict | None = None
        self.last_error = ""
        self._notify_pending: tuple[int, Path, str, Path | None] | None = None
        self._notify_disk: tuple[int, Path, str, None] | None = None
        self.engine_first = engine_first
        self.writing = asyncio.Lock()
        """Held while this syncer writes the weights, and by `set_aside_damaged`."""
        self.weights_damaged: str | None = None
        """What the last confirmed find of the weights check did (None: none since start)."""
        self._notify_wake = asyncio.Event()
        self._head_heard = asyncio.Event()
        self._index_read: dict[str, float] = {}
        """peer url → when its index was last read (monotonic)."""
        """Set on every head reply: a wait for a peer of this region to claim a version."""
        self.control = Counter()
        """Manifest and torrent fetches by whom they were asked of: region, other, trainer;
        `waited_s`: time spent waiting for this region (daemon/peering/peers.py `sources`)."""
        self.holders = Holders(settings)
        self.heads = HeadQuorum(settings.head_quorum, settings.head_wait_s)
        self.plan_now: list[str] = []
        self.plan_holders: dict[str, int] = {}
        self.plans = 0
        self.replans = 0
        self.stalled: set[str] = set()
        """Artifacts whose download stalled: their holders are dialled directly (_dial_for)."""
        self._finished: dict[str, asyncio.Event] | None = None
        """Set when the swarm reports an artifact complete on disk (_swarm_moved)."""
        self.adapters, self.adapter_base, self.adapter_run = adapters, adapter_base, adapter_run
        self.base_problem: str | None = None
        """Why the newest adapter version is not applied (its base is not held), else None."""
        self.base_held: dict | None = None
        """The base the last checked adapter version applies over: run, version, digest, path."""

    def reconfigure(self, settings: SyncConfig) -> None:
        self.settings = self.holders.settings = settings
        self.heads.quorum, self.heads.wait_s = settings.head_quorum, settings.head_wait_s

    # --- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        delay = 1.0
        while not self.stopping:
            # Cleared before the step, not after: a head announced while a step runs (the next
            # version, published meanwhile) starts the next step at once instead of after
            # `delay` (issue 19: up to a second per version when versions come every 2 s).
            self.wake.clear()
            try:
                progressed = await self.step()
                self.last_error = "" if progressed is not None else self.last_error
                delay = 1.0
            except (ChainError, SyncError, SwarmError, OSError, PeerError) as e:
                self.last_error = f"{type(e).__name__}: {e}"[:500]
                log.warning("sync step failed: %s", self.last_error)
                delay = 1.0 if isinstance(e, Stalled) else min(delay * 2, 15.0)
                await self.gc_quietly()
            except Abandoned:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), delay)

    async def on_head(self, peer: Peer, version: int | None) -> None:
        self.heads.reply(peer.url, version)
        self._head_heard.set()
        self.wake.set()

    def current_version(self) -> int | None:
        """The newest verified version: patched into the engines (engine first) or on disk."""
        top = self.engine_first.verified() if self.engine_first is not None else None
        if top is not None:
            return top.patch.version
        cur = self.weights.current()
        return None if cur is None else cur.version

    async def step(self) -> int | None:
        if not self.heads.check(self.book):
            await self.refresh_holders()  # reading indexes is how the other peers are learned
            if not self.heads.check(self.book):
                return None
        claimed = self.book.claimed_head()
        target = max((h for h in (claimed, self.store.head()) if h is not None), default=None)
        cur = self.current_version()
        if target is None or (cur is not None and cur >= target):
            return None
        if self.store.head() is None or self.store.head() < target:
            await self.fetch_manifests(target, cur)
        head = self.store.head()
        if head is None or (cur is not None and head <= cur):
            raise SyncError(f"peers claim v{target} but no valid manifest past "
                            f"v{cur if cur is not None else 'nothing'} could be fetched")
        await self.refresh_holders()
        holders = self.holder_counts()
        try:
            plan = self.store.plan(cur, head, holders)
        except NoPath as e:
            raise SyncError(str(e)) from None
        for m in plan:
            self._check_base(m)
        names = [m.artifact for m in plan]
        self.plan_holders = {a: holders.get(a, 0) for a in names}
        if names != self.plan_now:
            self.replans += bool(self.plan_now)
            self.plans += 1
            self.plan_now = names
            log.info("plan v%s → v%d: %s (holders %s)", cur, head, names,
                     [self.plan_holders[a] for a in names])
        self.holders.note_plan(names, holders)
        for m in plan:
            if m.artifact not in self.downloads or self.downloads[m.artifact].cancelled():
                self.downloads[m.artifact] = asyncio.create_task(self.download(m),
                                                                 name=f"dl:{m.artifact}")
        for m in plan:
            task = self.downloads[m.artifact]
            try:
                await asyncio.shield(task)
            finally:
                if task.done():
                    self.downloads.pop(m.artifact, None)
            await self.apply(m)
        self.plan_now = []
        await self.gc()
        return head

    def _check_base(self, m: Manifest) -> None:
        """Before any block is fetched: an adapter version applies only over the base it was
        trained on, and a full-model version never goes to an adapter region (or the reverse)."""
        try:
            if self.adapter_run is not None and m.run != self.adapter_run:
                raise BaseNotHeld(f"{m.artifact} is of run {m.run!r}; this daemon serves run "
                                  f"{self.adapter_run!r} (adapter.run): check its bootstrap and "
                                  "trainer_public_key")
            if m.base is None and self.adapters:
                raise BaseNotHeld(
                    f"{m.artifact} of run {m.run!r} is a full-model version, but this daemon is "
                    "set up for LoRA adapters (adapter: in its config); point it at the run's "
                    "adapter chain, or drop adapter: to follow full models")
            if m.base is not None:
                path = find_base(self.adapter_base if self.adapters else None, m.base,
                                 m.artifact)
                self.base_held = {**m.base.model_dump(), "path": str(path)}
        except BaseNotHeld as e:
            self.base_problem = str(e)
            raise
        self.base_problem = None

    # --- who holds what ---------------------------------------------------------------------
    async def refresh_holders(self) -> None:
        """Re-read the index of every usable peer whose listing is old (or older than the head
        it now claims), all at once and bounded: what each holds in full, and whom it knows."""

        async def read(peer: Peer) -> None:
            try:
                index = await self.client.get_json(f"{peer.url}/v1/chain/index", "index",
                                                   timeout=5.0, params=self._index_params())
                self._index_read[peer.url] = time.monotonic()
                self._learn_from_index(peer, index)
                self.book.succeeded(peer)
            except (PeerError, BadPeer) as e:
                self.book.failed(peer, e)

        spare = self.upstream() is not None
        every_s = self.glance_s()
        where = self.book.where
        now = time.monotonic()
        todo = []
        for p in self.book.by_head():
            if not self.holders.stale(p.url, p.head):
                continue
            last_read = self._index_read.get(p.url)
            if (spare and where(p)[1] == "trainer" and last_read is not None
                    and now - last_read < every_s):
                # what the trainer published since it last listed, from our own store (this
                # node does not poll the trainer's head: hears_elsewhere): it holds its new
                # head (retention keeps the newest versions), and reading its index on every
                # version from every node grows its load with the fleet
                head = max((h for h in (p.head, self.store.head()) if h is not None),
                           default=None)
                since = self.holders.listed_head(p.url)
                if head is not None:
                    self.holders.extend(p.url, head, [
                        a for a in self.store.artifacts()
                        if (since if since is not None else -1) < parse_artifact(a)[0] <= head])
                continue
            todo.append(p)
        if todo:
            await asyncio.gather(*(read(p) for p in todo))

    def _index_params(self) -> dict[str, str] | None:
        """Indexes without their peer list once the heads settled: before the first plan the
        lists are how this node learns the fleet (HeadQuorum); after it, the peer discovery
        loop keeps learning (daemon/peering/regions.py) and a list on every read would grow
        each reply with the fleet."""
        return {"peers": "0"} if self.heads.settled else None

    def holder_counts(self) -> dict[str, int]:
        now = time.monotonic()

        def usable(url: str) -> bool:
            peer = self.book.peers.get(url)
            return peer is not None and not peer.banned(now)

        return self.holders.counts(usable, self.artifacts.held())

    # --- manifests ------------------------------------------------------------------------
    async def fetch_manifests(self, target: int, cur: int | None) -> None:
        """Ask peers (claiming `target` first, FANOUT at a time) for their index and the
        manifests past `cur` we lack; stop once the store reaches `target` or moved forward (a
        later step chases the rest, so a liar's far claim never delays what honest peers
        serve). A peer whose own claim stays unbacked after we took everything it listed is
        struck."""
        before = self.store.head()

        async def from_peer(peer: Peer) -> bool:
            # The claim as it stood before asking: the head watcher may raise it meanwhile
            # (a version published while we read the index), which refutes nothing.
            claim = peer.head
            index = await self.client.get_json(f"{peer.url}/v1/chain/index", "index",
                                               timeout=15.0, params=self._index_params())
            self._learn_from_index(peer, index)
            names = index.get("artifacts")
            if not isinstance(names, list) or len(names) > 1_000_000:
                raise BadReply(peer.url, "index has no artifact list")
            want = []
            for name in names:
                try:
                    version, kind = parse_artifact(name)
                except (BadManifest, TypeError):
                    continue
                if (version > (cur if cur is not None else -1) and version <= target
                        and self.store.get(version, kind) is None
                        and not self._recently_refused(peer.url, name)):
                    want.append((version, kind, name))
            for _, _, name in sorted(want):
                raw = await self.client.get(f"{peer.url}/v1/chain/manifests/{name}",
                                            "manifest", timeout=60.0)
                await asyncio.to_thread(self._add_manifest, peer.url, name, raw)
            self.book.succeeded(peer)
            head = self.store.head()
            have = -1 if head is None else head
            # Only what this step asked for can refute a claim: a claim past `target` (the peer
            # announced a newer version since the step began) is checked by a later step.
            if claim is not None and have < min(claim, target):
                self.book.lied(peer, f"claimed head v{claim} but served no valid manifest "
                                     f"of v{min(claim, target)}")
            return have >= target or (before is None and head is not None) or (
                before is not None and have > before)

        await self.ask_sparing_trainer(target, from_peer)
        if self.store.head() != before:  # wake our long-pollers: this region's other members
            await self.board.bump()      # take the manifest from us (ask_sparing_trainer)

    # --- whom to ask: this region before the trainer ---------------------------------------
    async def ask_sparing_trainer(self, version: int, ask: Callable[[Peer], Awaitable[T]],
                                  settle: bool = True) -> T | None:
        """`first_good` over the peers that can serve `version`'s manifests or torrent, asking
        the trainer only when no other peer that claims it answered (PeerBook.sources).

        Before that, while nobody suitable claims the version yet, a node waits for someone to
        (`_wait_plan`, RegionPeering.fetch_role): a region's members wait for its fetcher, each
        region's fetcher for the fleet's, which asks the trainer at once. So the trainer serves
        each version's control-plane files about once, not once per node or region, and each
        other hop adds one fetch's time (a region hop on the way to every node)."""
        first, rest = self.book.sources(version)
        need, wait_s = self._wait_plan()
        t0 = time.monotonic()
        deadline = t0 + wait_s

        def satisfied() -> bool:
            return bool(first) and (need == "any" or self._in_region(first))

        while need and not satisfied() and time.monotonic() < deadline:
            self._head_heard.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._head_heard.wait(), deadline - time.monotonic())
            first, rest = self.book.sources(version)
        if need:
            self.control["waited_s"] += time.monotonic() - t0
        while first:
            try:  # a silent claimant must not hold the version up for a whole request timeout
                got = await asyncio.wait_for(first_good(first, self._counted(ask), self.book,
                                                        settle=settle), FIRST_ROUND_S)
            except TimeoutError:
                self.control["first_round_timeouts"] += 1
                break
            if got:
                return got
            # a peer that holds the manifest may not hold the torrent yet (it asks for it right
            # after): ask again shortly rather than the trainer at once
            if not need or time.monotonic() + 0.1 >= deadline:
                break
            await asyncio.sleep(0.1)
            first, rest = self.book.sources(version)
        return await first_good(rest, self._counted(ask), self.book, settle=settle)

    def _in_region(self, peers: list[Peer]) -> bool:
        """Whether `peers` (PeerBook.sources' first round: own region first) has one here."""
        return bool(peers) and self.book.where(peers[0])[0] == self.book.region

    def _wait_plan(self) -> tuple[str | None, float]:
        """(whom to wait for: "region", "any" or None, for how long), by this node's fetch role
        (RegionPeering.fetch_role; aware peering only): a region's member waits for its region
        up to `region_wait_s` (jittered from half of it); a region's fetcher waits for any
        other region up to a quarter of it; the fleet's fetcher asks at once."""
        w = self.settings.region_wait_s
        role = self._fetch_role()
        if w <= 0 or role is None or role == "fleet":
            return None, 0.0
        if role == "member":
            return "region", random.uniform(0.5, 1.0) * w
        return "any", 0.25 * w

    def hears_elsewhere(self, peer: Peer) -> bool:
        """Whether this node need not long-poll `peer`'s head: the trainer, when this node
        hears it through another (`upstream`: a member through its region's fetcher, a
        region's fetcher through the fleet's, which alone polls the trainer). Every node or
        region polling the trainer costs it a held request and a reply per version each
        (docs/SCALE.md 5.1); the trainer's retention still learns these nodes' versions from
        their fleet reports (`report_targets`)."""
        region, role = self.book.where(peer)
        return (role == "trainer" and region is not None
                and peer.bt is not None  # heard first-hand once: region, role and endpoint
                and self.upstream() is not None)

    def glance_s(self) -> float:
        """How often a node that hears the trainer through another still reads the trainer's
        index or asks its head (without holding the request): TRAINER_INDEX_S per
        TRAINER_INDEX_READERS nodes, counting the peers this node knows or, when more, the live
        nodes the trainer's last head reply said it knows (a book holds at most `max_peers`),
        or that count as relayed by the peer it hears the trainer through: about
        TRAINER_INDEX_READERS such asks per TRAINER_INDEX_S over the whole fleet, until the
        GLANCE_MAX_S cap (at 160 nodes), then N per GLANCE_MAX_S."""
        return min(GLANCE_MAX_S, TRAINER_INDEX_S * max(
            1.0, max(len(self.book.peers), self.trainer_fleet() or 0) / TRAINER_INDEX_READERS))

    def trainer_fleet(self) -> int | None:
        """The trainer's live-node count as last heard: from a trainer peer's head reply, or
        relayed by the peer this node hears the trainer through (this node's head replies
        relay it in turn, app.head_doc). Only those two are believed: an inflated count delays
        this node's glances at the trainer to GLANCE_MAX_S at most."""
        where = self.book.where
        heard = [p.fleet_nodes for p in self.book.peers.values()
                 if p.fleet_nodes is not None and where(p)[1] == "trainer"]
        up = self.book.peers.get(self._through()[1] or "")
        if up is not None and up.trainer_nodes is not None:
            heard.append(up.trainer_nodes)
        return max(heard, default=None)

    def upstream(self) -> str | None:
        """The URL of the peer this node hears the trainer through (RegionPeering.fetchers),
        when it is known and not banned; None for the fleet's fetcher, blind peering, and when
        `sync.region_wait_s` is 0 (every node asks the trainer itself)."""
        return self._through()[1]

    def watched(self) -> list[str]:
        """URLs this node long-polls whatever their standing in its book (HeadWatcher): the
        peer it hears the trainer through, else the trainer itself (the fleet's fetcher, and
        every node with blind peering or `region_wait_s` 0, must not lose it from view when
        the book holds more peers than it watches)."""
        via = self.upstream()
        return [via] if via is not None else self.trainers()

    def report_targets(self) -> list[str]:
        """Where this node's fleet reports go when `fleet.report_to` is unset (daemon/node.py):
        a region's member to its region's fetcher, which holds its region's entries; a fetcher
        (the region's or the fleet's) to its bootstrap peers outside its own region (a chain of
        regions reports up the chain, as the operator laid it out), else to the trainer as it
        heard it first-hand: a bootstrap peer in its own region reports to the fetcher, and
        would get the region's entries back (a loop that never reaches the trainer). []: the
        bootstrap list (blind peering, or before any of this is known)."""
        role, url = self._through()
        if role == "member":
            return [url] if url is not None else []
        if role not in ("region", "fleet"):
            return []
        where = self.book.where
        up = sorted(p.url for p in self.book.peers.values()
                    if p.bootstrap and where(p)[0] != self.book.region)
        return up or self.trainers()

    def trainers(self) -> list[str]:
        """Trusted, unbanned peers that said first-hand they are the trainer."""
        now = time.monotonic()
        where = self.book.where
        return sorted(p.url for p in self.book.peers.values()
                      if where(p)[1] == "trainer" and p.bt is not None and p.trusted
                      and not p.banned(now))

    def _through(self) -> tuple[str | None, str | None]:
        fetchers = getattr(self.book.peering, "fetchers", None)
        if self.settings.region_wait_s <= 0 or fetchers is None:
            return None, None
        role, url = fetchers(self.book)
        peer = self.book.peers.get(url) if url is not None else None
        return (role, url) if peer is not None and peer.trusted and not peer.banned() else \
            (role, None)

    def _fetch_role(self) -> str | None:
        fetch_role = getattr(self.book.peering, "fetch_role", None)
        return None if fetch_role is None else fetch_role(self.book)

    def _counted(self, ask: Callable[[Peer], Awaitable[T]]) -> Callable[[Peer], Awaitable[T]]:
        where = self.book.where

        async def counted(peer: Peer) -> T:
            region, role = where(peer)
            self.control["trainer" if role == "trainer" else
                         "region" if region == self.book.region else "other"] += 1
            return await ask(peer)
        return counted

    def _learn_from_index(self, peer: Peer, index: dict) -> None:
        held = index.get("held")
        if held is not None and not (isinstance(held, list) and len(held) <= 1_000_000):
            raise BadReply(peer.url, "index held is not a list")
        head = index.get("head")
        self.holders.record(peer.url, head if isinstance(head, int) else None,
                            (a for a in held or () if isinstance(a, str)))
        self.heads.read_index = True
        if index.get("bt"):
            try:
                self.book.learn(peer.url, parse_endpoint(index["bt"]))
            except BadPeer:
                raise BadReply(peer.url, "index has a bt endpoint that is not ip:port") from None
        with contextlib.suppress(BadPeer):
            self.book.learn(peer.url, region=index.get("region"), role=index.get("role"))
        heard_from(self.book, peer.url, index)
        listed = index.get("peers") or []
        if not isinstance(listed, list):
            raise BadReply(peer.url, "index peers is not a list")
        for p in listed[:INDEX_PEERS]:
            if isinstance(p, dict):
                with contextlib.suppress(BadPeer):
                    bt = parse_endpoint(p["bt"]) if p.get("bt") else None
                    node = check_node(p["node"]) if p.get("node") is not None else None
                    self.book.learn(p.get("url"), bt, node, region=p.get("region"),
                                    role=p.get("role"))

    def _add_manifest(self, source: str, name: str, raw: bytes) -> Manifest | None:
        try:
            m = self.store.add_manifest(raw)
            if m.artifact != name:
                raise BadManifest(f"asked for {name}, the peer served {m.artifact}")
        except BadManifest as e:
            self.refuse(source, name, e)
            return None
        log.info("accepted manifest %s from %s", name, source)
        return m

    def refuse(self, source: str, name: str, err: BadManifest) -> None:
        kind = refusal_kind(err)
        self.refused_counts[kind] += 1
        self._refused_at[(source, name)] = time.monotonic()
        self.refused.append({"artifact": name, "source": source, "error": type(err).__name__,
                             "kind": kind, "reason": str(err)[:400],
                             "time": round(time.time(), 3)})
        log.warning("refused manifest %s from %s: %s", name, source, err)

    def _recently_refused(self, source: str, name: str) -> bool:
        at = self._refused_at.get((source, name))
        return at is not None and time.monotonic() - at < 60.0

    # --- transfer -------------------------------------------------------------------------
    async def torrent_bytes(self, m: Manifest) -> bytes:
        raw = await asyncio.to_thread(self.artifacts.held_torrent, m)
        if raw is not None:
            return raw
        cap = torrent_cap([b.size for b in m.blocks], self.artifacts.piece_size)

        async def from_peer(peer: Peer) -> bytes:
            data = await self.client.get(f"{peer.url}/v1/chain/torrents/{m.artifact}",
                                         "torrent", cap=cap, timeout=60.0)
            try:
                await asyncio.to_thread(self.artifacts.check_torrent, m, data)
            except torrents.BadTorrent:
                self.failures["torrent"] += 1
                raise BadReply(peer.url, f"torrent of {m.artifact} does not match its signed "
                                         "manifest") from None
            return data

        got = await self.ask_sparing_trainer(m.version, from_peer, settle=False)
        if got is None:
            self.holders.torrent_missing(m.artifact)
            raise SyncError(f"no peer served a valid torrent for {m.artifact}")
        self.holders.torrent_found(m.artifact)
        await asyncio.to_thread(self.artifacts.keep_torrent, m.artifact, got)
        return got

    async def download(self, m: Manifest) -> None:
        arts, swarm = self.artifacts, self.artifacts.swarm
        assert swarm is not None
        save = arts.swarm_dir
        tb = await self.torrent_bytes(m)
        held = [(b.id, self.store.blocks.path(b.id)) for b in m.blocks
                if self.store.blocks.has(b.id)]
        if held:
            await asyncio.to_thread(torrents.link_blocks, m.artifact, held, save)
        info = self.transfers.setdefault(m.artifact, {"artifact": m.artifact, "total": 0,
                                                      "resumed_bytes": None, "started": time.time(),
                                                      "seconds": None, "downloaded": 0})
        if m.artifact not in swarm.artifacts():
            resume = swarm.load_resume_data(arts.resume_dir, m.artifact)
            swarm.download(m.artifact, tb, save, peers=self.book.swarm_endpoints(),
                           resume_data=resume)
            log.info("downloading %s", download_line(m, {bid for bid, _ in held},
                                                      resume is not None))
        known: set = set()
        t0 = moved_at = time.monotonic()
        moved = -1
        redial = Redial()
        while True:
            p = swarm.progress(m.artifact)
            info.update(total=p.total, done=p.done, downloaded=p.downloaded, state=p.state)
            if info["resumed_bytes"] is None and "checking" not in p.state:
                info["resumed_bytes"] = p.done
            if p.finished:
                break
            now = time.monotonic()
            if p.done + p.downloaded != moved:
                moved, moved_at = p.done + p.downloaded, now
            elif now - moved_at > self.settings.progress_timeout_s:
                why = (f"no bytes for {now - moved_at:.0f}s at {p.done} of {p.total} "
                       f"({p.peers} peers)")
                self.holders.give_up(m.artifact, why)
                self.stalled.add(m.artifact)
                await self._fresh_peer_list(m.artifact)
                raise Stalled(f"{m.artifact}: {why}; its partial data is kept")
            endpoints = self._dial_for(m.artifact)
            if endpoints and redial.due(p.connections, now, "checking" in p.state):  # redial.py
                await self._fresh_peer_list(m.artifact, "no connection")
                known = set()
            if endpoints - known:
                swarm.add_peers(m.artifact, endpoints - known)
                known = endpoints
            elif time.monotonic() - t0 > 10:
                swarm.add_peers(m.artifact, endpoints)
                t0 = time.monotonic()
            await self._swarm_moved(m.artifact, PROGRESS_CHECK_S)
        info["seconds"] = round(time.time() - info["started"], 3)
        self.stalled.discard(m.artifact)
        try:
            await asyncio.to_thread(self._adopt, m)
        except BadBlock as e:
            self.failures["block"] += 1
            swarm.remove(m.artifact)
            shutil.rmtree(save / m.artifact, ignore_errors=True)
            raise SyncError(f"{m.artifact}: downloaded data failed the block check ({e}); "
                            "refetching") from None
        log.info("downloaded %s in %.2fs (%d payload bytes this run)", m.artifact,
                 info["seconds"], info["downloaded"])

    async def _swarm_moved(self, artifact: str, timeout: float) -> None:
        """Wait until the swarm reports `artifact` complete on disk (its pump thread calls the
        listener the moment the write cache is flushed), or `timeout` for the periodic checks
        (stall, new holders to dial): a finished download is seen at once, not at the next
        poll."""
        swarm = self.artifacts.swarm
        assert swarm is not None
        if self._finished is None:
            loop = asyncio.get_running_loop()
            self._finished = {}

            def wake(name: str) -> None:
                ev = self._finished.get(name)  # only a waiting download: no entry is left
                if ev is not None:
                    ev.set()

            swarm.add_listener(lambda name: loop.call_soon_threadsafe(wake, name))
        ev = self._finished[artifact] = asyncio.Event()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), timeout)
        finally:
            if self._finished.get(artifact) is ev:
                del self._finished[artifact]

    def _dial_for(self, artifact: str) -> set:
        """What the swarm dials for `artifact`: the region peering's choice, plus, once a
        download of it stalled, every usable peer whose index lists it as held. Region-aware
        peering lets only gateways dial across regions; a node whose own region holds none of
        an artifact (its gateway skipped it: restarted onto a later snapshot) would otherwise
        wait for it forever. Only after a stall, so the trainer's uplink still sends one copy
        per region in the normal case."""
        endpoints = set(self.book.swarm_endpoints())
        if artifact in self.stalled:
            now = time.monotonic()
            for url, (_, _, held) in list(self.holders.listed.items()):
                peer = self.book.peers.get(url)
                if (artifact in held and peer is not None and peer.bt is not None
                        and peer.trusted and not peer.banned(now)):
                    endpoints.add(peer.bt)
        return endpoints

    async def _fresh_peer_list(self, artifact: str, why: str = "for the next attempt") -> None:
        """After a stall the next attempt starts from a new torrent (same data, clean peer
        list): libtorrent stops dialling a peer that refused a few connects, so a holder that
        restarted on the same endpoint (the trainer, killed while it alone held a new delta)
        would otherwise never be dialled again by this torrent (Swarm.refresh)."""
        swarm = self.artifacts.swarm
        assert swarm is not None
        loop = asyncio.get_running_loop()
        try:
            if await loop.run_in_executor(self.artifacts.exec, swarm.refresh, artifact):
                log.info("%s: re-added with a fresh peer list (%s)", artifact, why)
        except SwarmError as e:
            log.warning("%s: could not re-add it with a fresh peer list: %s", artifact, e)

    def _adopt(self, m: Manifest) -> None:
        save = self.artifacts.swarm_dir
        for b in m.blocks:
            self.store.blocks.adopt(b.id, torrents.block_path(save, m.artifact, b.id), b.size)

    # --- apply ----------------------------------------------------------------------------
    async def apply(self, m: Manifest) -> None:
        async with self.writing:
            await self._apply(m)

    async def set_aside_damaged(self, version: int, names: list[str] | None) -> str | None:
        """The weights check found `version`'s directory differing from its digests (in
        `names`, or unreadable: None): hold every writer of the weights (this syncer's
        applies, engine first's decodes and disk passes), check again, and if it still
        differs set the directory aside as the start-up check does. A current one takes the
        patches decoded over it along (the engines keep serving what they hold; the disk is
        rebuilt from a snapshot, and engines hear only of versions past theirs). Shielded: a
        shutdown never lets an apply in before the directory is set aside. Returns what was
        done, or None when the damage did not hold up (an apply renamed the directory while
        the check read it)."""
        return await asyncio.shield(self._set_aside_held(version, names))

    async def _set_aside_held(self, version: int, names: list[str] | None) -> str | None:
        ef = self.engine_first
        async with self.writing, (ef.lock if ef is not None else contextlib.nullcontext()):
            if not self.weights.path(version).is_dir():
                return None  # renamed by an apply: no longer that version's directory
            try:
                still = await asyncio.to_thread(self.weights.damaged, version, names)
            except (ChainError, OSError) as e:  # still there, and unreadable
                still = [f"({type(e).__name__}: {e})"[:300]]
            if not still:
                return None
            if self.weights.is_current(version):
                if ef is not None:
                    ef.forget_pending()
                self._notify_pending = None  # its patch file is gone
                self._notify_disk = None  # it names the directory being set aside
            try:
                what = await asyncio.to_thread(self.weights.set_aside, version)
            except OSError as e:
                log.error("weights check: v%d is damaged and could not be set aside: %s",
                          version, e)
                return None
        tensors = ", ".join(still[:3]) + (f" and {len(still) - 3} more" if len(still) > 3
                                          else "")
        self.weights_damaged = (f"v{version} on disk differed from its digests at a scheduled "
                                f"check ({tensors}): {what}")
        log.error("weights check: %s", self.weights_damaged)
        self.wake.set()
        return what

    async def _apply(self, m: Manifest) -> None:
        cur = self.current_version()
        if cur is not None and cur >= m.version:
            return
        if cur is None and m.kind == "delta":  # planned before the weights were set aside
            raise SyncError(f"no weights to apply {m.artifact} over (set aside by the weights "
                            "check); planning again from a snapshot")
        self.applying = {"artifact": m.artifact, "done": 0, "total": len(m.tensors)}

        def progress(artifact: str, done: int, total: int) -> None:
            self.applying = {"artifact": artifact, "done": done, "total": total}
            if self.stopping:
                raise Abandoned(f"stopping during {artifact} at tensor {done}/{total}")

        def get_block(b: BlockEntry) -> bytes:
            return self.store.blocks.get(b.id, b.size)

        t0 = time.monotonic()
        ef = self.engine_first
        try:
            if ef is not None:
                first = await ef.decode(m, progress)
                if first is not None:
                    self._applied(m, time.monotonic() - t0)
                    log.info("v%d verified and patched (%s, %d changes, %.2fs); disk follows",
                             m.version, m.artifact, first.patch.elements,
                             time.monotonic() - t0)
                    await self.board.bump()
                    self._notify_pending = (m.version, self.weights.path(m.version),
                                            m.state_digest, first.path)
                    self._notify_wake.set()
                    return
                await ef.catch_up(progress)  # a snapshot or reshape applies over the newest
                t0 = time.monotonic()
            current = await asyncio.to_thread(self.weights.apply, [m], get_block, progress)
        except Abandoned:
            log.info("apply of %s abandoned for shutdown; the journal resumes it", m.artifact)
            raise
        except ChainError as e:
            self.failures["tensor"] += 1
            raise SyncError(f"applying {m.artifact} failed verification: {e}") from None
        finally:
            self.applying = None
        seconds = time.monotonic() - t0
        self._applied(m, seconds)
        log.info("v%d current (%s, digest %s…, %.2fs)", current.version, m.artifact,
                 current.state_digest[:12], seconds)
        await self.on_disk(current)

    def _applied(self, m: Manifest, seconds: float) -> None:
        """Count an applied version's sizes: tensors and carried files apart, and "saved" on
        tensors (chain/sizes.py). Running totals, not sums over `applied` (its last 50)."""
        size = Sizes.of(m)
        new_files = new_file_bytes(m, [self._last_applied] if self._last_applied else [])
        self._last_applied = m
        if m.kind == "delta":
            self.bytes_saved += max(0, size.dense_bytes - size.tensor_bytes)
        self.totals.update(tensor_bytes=size.tensor_bytes, file_bytes=size.file_bytes,
                           new_file_bytes=new_files, dense_bytes=size.dense_bytes, versions=1)
        self.applied.append({"artifact": m.artifact, "version": m.version,
                             "bytes": size.total, "tensor_bytes": size.tensor_bytes,
                             "file_bytes": size.file_bytes, "new_file_bytes": new_files,
                             "dense_bytes": size.dense_bytes,
                             "apply_seconds": round(seconds, 3), "time": round(time.time(), 3)})

    async def on_disk(self, current: Current) -> None:
        """A version is current on disk: wake the long-polls, tell the engines its path."""
        await self.board.bump()
        self._notify_disk = (current.version, current.path, current.state_digest, None)
        self._notify_wake.set()

    async def disk_loop(self) -> None:
        """Engine first: the disk catch-up, off the sync loop (daemon/engines/first.py)."""
        if self.engine_first is None:
            return

        def progress(artifact: str, done: int, total: int) -> None:
            if self.stopping:
                raise Abandoned(f"stopping during the disk catch-up to {artifact}")

        await self.engine_first.loop(progress, self.on_disk)

    async def notify_loop(self) -> None:
        """Tell the engines about the newest version on disk, then the newest patch (latest
        wins, in order)."""
        while True:
            await self._notify_wake.wait()
            self._notify_wake.clear()
            disk, self._notify_disk = self._notify_disk, None
            pending, self._notify_pending = self._notify_pending, None
            if disk is not None:
                await self.notify(*disk)
            if pending is not None:
                await self.notify(*pending)

    # --- retention ------------------------------------------------------------------------
    async def gc(self) -> None:
        """Retention: the window, what live peers behind need (this node's own version
        counted), the current version, and what is downloading or planned."""
        cur = self.current_version()
        protect = set(self.downloads) | set(self.plan_now)
        if self.engine_first is not None:  # what the disk still needs to reach `cur`
            protect |= self.engine_first.protected()
        if cur is not None:
            protect |= {a for a in self.store.artifacts() if parse_artifact(a)[0] == cur}
        dropped = await asyncio.to_thread(self.keeper.run, protect, [cur])
        for a in dropped:
            self.artifacts.forget(a)
            self.transfers.pop(a, None)
            self.holders.forget(a)
            self.stalled.discard(a)
        if dropped:
            log.info("retention dropped %s", dropped)

    async def gc_quietly(self) -> None:
        """Retention after a failed step too: a stuck node must not keep stale data forever."""
        try:
            await self.gc()
        except (ChainError, OSError, SwarmError) as e:
            log.warning("retention after a failed step failed: %s", e)

    def sync_status(self) -> dict:
        return {"heads_settled": self.heads.settled, "heads_heard": len(self.heads.heard),
                "plan": list(self.plan_now), "holders": dict(self.plan_holders),
                "plans": self.plans, "replans": self.replans,
                "given_up": self.holders.status(),
                "progress_timeout_s": self.settings.progress_timeout_s,
                "unoffered_timeout_s": self.settings.unoffered_timeout_s,
                "control_asked": {k: round(v, 3) for k, v in self.control.items()}}

    def status(self) -> dict:
        return {"refused": list(self.refused), "refused_counts": dict(self.refused_counts),
                "failures": dict(self.failures),
                "applied": list(self.applied), "bytes_saved": self.bytes_saved,
                "applying": self.applying, "transfers": dict(self.transfers),
                "last_error": self.last_error,
                "engine_first": self.engine_first.status() if self.engine_first else None}


def download_line(m: Manifest, held: set[str], resumed: bool) -> str:
    """What the "downloading" log line says of `m`: its tensors and carried files apart, and
    how much of it this node already holds (linked in, not fetched again: unchanged carried
    files are the same blocks as the version before)."""
    have = sum(b.size for b in m.blocks if b.id in held)
    return (f"{m.artifact}: {Sizes.of(m).describe()}, {have:,} B of it already held here; "
            f"resume data: {'yes' if resumed else 'no'}")


def refusal_kind(err: BadManifest) -> str:
    """The kind of a refused manifest, from the exception's type (chain/errors.py)."""
    for cls, kind in ((Unsigned, "unsigned"), (BadSignature, "bad_signature"),
                      (WrongParent, "wrong_parent"), (Replay, "replay"), (OtherRun, "other_run")):
        if isinstance(err, cls):
            return kind
    return "invalid"
