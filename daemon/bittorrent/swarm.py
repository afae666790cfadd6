"""The daemon's BitTorrent layer: one libtorrent session seeding and fetching artifact torrents.

`Swarm(SwarmConfig(...))` wraps one `lt.session`: TCP only, no DHT/LSD/UPnP/NAT-PMP, rate limits
that apply on private addresses too, optional seed-side choking (`seed_mode`, for the trainer).
Peers come only from the caller: `download(..., peers=)` / `add_peers()` with the BitTorrent
endpoints that other daemons report on their control plane; ut_pex (on by default) spreads the
rest. Methods are synchronous and short; `pump(timeout)` turns alerts into `SwarmEvent`s
(call it from a thread, e.g. `await asyncio.to_thread(swarm.pump, 1.0)`).

Bans are per (peer endpoint, artifact). What libtorrent 2.1 allows, read from its source: the
smart_ban plugin is on by default (`lt.session(settings)` adds the default plugins) but is not
instantiated for v2 torrents, which ours all are: for them libtorrent itself names the sender,
banning a peer for a failed piece only when that peer sent the whole piece, or, once it has
fetched the piece's 16 KiB block hashes, only the peers whose blocks failed; a peer in a failed
piece with others only loses trust points (banned after about four such pieces), and parole mode
(on by default) then gives it whole pieces alone, so its next failure is its own. That ban lives
in that torrent's peer list (one `torrent_peer` per ip:port), so it is per torrent; we turn each
`peer_ban_alert` into a 'banned' event and re-apply held bans through `banned_peers` when a
torrent is added. libtorrent has no call to lift it, and with several connections per IP allowed
an incoming connection from the banned peer that announces the same listen port replaces the
banned entry; so a torrent that holds bans also applies the session `ip_filter`, which holds
every banned address: per IP, but only on torrents with a ban. Every other torrent ignores the
filter, so the peer, and any innocent daemon on its address, trade all other artifacts freely.

Dialling: libtorrent connects the peers given to a torrent once a second (its connect tick), so a
new artifact waited up to a second per hop before its first byte. Each download also names this
swarm's loopback tracker (daemon/bittorrent/tracker.py), whose reply (those same peers) is
dialled at once (`dial_at_once`; bench/dial.py).
"""

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import libtorrent as lt

from chain.atomic import write_atomic
from daemon.bittorrent import torrents
from daemon.bittorrent.tracker import LocalTracker, announce_hashes

Peer = tuple[str, int]

# Trainer-side choking (seed_mode): few, fast-rotating unchokes so each piece leaves the trainer
# about once while the regions serve each other. libtorrent keeps unchoke_slots_limit - 1 regular
# unchokes (the other slot waits for an optimistic unchoke the hour-long interval never grants)
# and rotates them every second. A peer choked mid-download has its queued requests rejected and
# may fetch that backlog from the trainer again later, so egress runs a little above 1x:
# bench/swarm.py, 6 nodes, 96 MB: egress 1.04-1.17x, time 1.16-1.23x the ideal; 3 nodes, 20 MB:
# egress 1.01-1.32x. Serving one peer per artifact without rotation (max_uploads 1) measured
# 1.000x egress and 1.12-1.14x time on uniform links, but one slow region that got the slot first
# then paced every other region: with one node at 20 Mbit/s (--slow-node-mbit 20, 48 MB), the
# fast nodes finished at 35 s instead of 8.6 s in half the runs. Rotation keeps them at 8.6-9.1 s.
SEED_SETTINGS = {
    "unchoke_slots_limit": 2,
    "unchoke_interval": 1,
    "allowed_fast_set_size": 0,
    "optimistic_unchoke_interval": 3600,
}


ALL_STATUS = 0x7FFFFFFF
"""Every status flag libtorrent defines (torrent_handle.status()'s default, 0xffffffff, differs
in an unused top bit the binding's signed argument cannot take)."""


class SwarmError(RuntimeError):
    """A swarm call was given something it cannot use (unknown artifact, missing files)."""


@dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    listen: str = "0.0.0.0:6881"
    """host:port to accept peers on (port 0: any free port, see Swarm.listen_port)."""
    upload_rate: int = 0
    """Session upload cap in bytes/s; 0 means unlimited."""
    download_rate: int = 0
    """Session download cap in bytes/s; 0 means unlimited."""
    seed_mode: bool = False
    """Trainer-side choking (SEED_SETTINGS): few, fast-rotating unchokes so each piece leaves
    this seed about once."""
    max_connections: int = 200
    pex: bool = True
    """ut_pex peer exchange; off when the daemon chooses its peers by region
    (daemon/peering/regions.py),
    else peers would learn and dial every other region's nodes."""
    extra_settings: dict = field(default_factory=dict)
    """Raw libtorrent settings applied last (for experiments)."""
    dial_at_once: bool = True
    """Downloads announce to this swarm's loopback tracker (daemon/bittorrent/tracker.py), which
    hands libtorrent their peers so the first connection goes out at once rather than on its
    once-a-second connect tick; off: connect_peer only (bench/dial.py compares the two)."""


@dataclass(frozen=True)
class Progress:
    artifact: str
    state: str
    done: int
    total: int
    download_rate: int
    upload_rate: int
    peers: int
    connections: int
    """Connections of any kind, connects still in flight too (`peers` leaves those out)."""
    seeds: int
    finished: bool
    uploaded: int
    downloaded: int
    error: str


@dataclass(frozen=True)
class SwarmEvent:
    kind: str
    """'finished' (a download is complete and flushed to disk; seeds never emit it),
    'hash_failed', 'banned' or 'error'."""
    artifact: str | None
    detail: str
    peer: str | None = None


@dataclass
class _Torrent:
    handle: lt.torrent_handle
    save_path: str
    seeding: bool
    status: lt.torrent_status
    """A status of this torrent, for `Swarm._statuses` to refresh (its handle is what counts)."""
    complete: bool = False
    """Finished and its write cache flushed: every block file is on disk and readable."""
    announce: tuple[bytes, ...] = ()
    """The info-hashes the local tracker knows this download by (empty: not announced)."""
    flushes_sent: int = 0
    flushes_done: int = 0
    finish_flush: int = 0

    def flush(self) -> int:
        """Ask libtorrent to write its cache out; returns the count cache_flushed must reach."""
        self.flushes_sent += 1
        self.handle.flush_cache()
        return self.flushes_sent


class Swarm:
    def __init__(self, config: SwarmConfig) -> None:
        self.config = config
        host, _, port = config.listen.rpartition(":")
        if not host or not port.isdigit():
            raise SwarmError(f"listen {config.listen!r} is not host:port")
        self._host = host.strip("[]")
        settings = {
            "listen_interfaces": config.listen,
            "enable_dht": False, "enable_lsd": False,
            "enable_upnp": False, "enable_natpmp": False,
            "enable_outgoing_utp": False, "enable_incoming_utp": False,
            "allow_multiple_connections_per_ip": True,
            "ignore_limits_on_local_network": False,
            "upload_rate_limit": config.upload_rate,
            "download_rate_limit": config.download_rate,
            "connections_limit": config.max_connections,
            # libtorrent drops a peer whose HAVE for its last piece makes it a seed if we were
            # not interested in it a moment before, although that piece may be the one we lack
            # (disconnect_if_redundant runs before the interest update): the last piece then came
            # from the trainer, up to a second later. Idle connections still time out
            # (inactivity_timeout) once the connection limit is near.
            "close_redundant_connections": False,
            # Small versions land in round trips, not ticks (issue 19): libtorrent dials the
            # peers it was given, and re-evaluates unchokes and requests, on its session tick
            # (500 ms by default), so a new artifact waited up to a tick per hop before its first
            # connect. 50 ms costs a few wake-ups a second per daemon.
            "tick_interval": 50,
            "alert_mask": (lt.alert_category.error | lt.alert_category.status
                           | lt.alert_category.peer | lt.alert_category.storage
                           | lt.alert_category.ip_block),
            "user_agent": "deltaswarm",
        }
        if self._host not in ("0.0.0.0", "::"):
            settings["outgoing_interfaces"] = self._host
        if config.seed_mode:
            settings.update(SEED_SETTINGS)
        settings.update(config.extra_settings)
        self._session: lt.session | None = lt.session(settings)
        self._tracker: LocalTracker | None = None
        if config.dial_at_once:
            wildcard = self._host in ("0.0.0.0", "::", "")
            self._tracker = LocalTracker("127.0.0.1" if wildcard else self._host)
        self._torrents: dict[str, _Torrent] = {}
        self._by_hash: dict[str, str] = {}
        self._bans: dict[str, set[Peer]] = {}
        """artifact → endpoints banned on its torrent (kept across remove(), for a refetch)."""
        self._lock = threading.RLock()
        self._resume: dict[str, bytes] = {}
        self._resume_failed: dict[str, str] = {}
        self._pending: list[SwarmEvent] = []
        self.hash_failures = 0
        self._listeners: list[Callable[[str], None]] = []
        self._removed_up = 0
        self._removed_down = 0

    @property
    def listen_port(self) -> int:
        return self._ses().listen_port()

    @property
    def endpoint(self) -> Peer:
        """The (host, port) other nodes should connect to (host as configured)."""
        return self._host, self.listen_port

    def seed(self, artifact: str, torrent_bytes: bytes, save_path: str | os.PathLike) -> None:
        """Serve an artifact whose blocks sit at `torrents.block_path(save_path, artifact, id)`.
        Files are checked for presence and size here; piece hashes on first upload."""
        ti = self._info(artifact, torrent_bytes)
        missing = []
        for block, size in torrents.torrent_blocks(torrent_bytes)[1].items():
            path = torrents.block_path(save_path, artifact, block)
            if not path.is_file() or path.stat().st_size != size:
                missing.append(str(path))
        if missing:
            raise SwarmError(f"cannot seed {artifact}: {len(missing)} block files missing or of "
                             f"the wrong size under {save_path}, e.g. {missing[0]}; save_path is "
                             f"the parent of the {artifact}/ directory")
        self._add(artifact, ti, save_path, None, [], seeding=True)

    def download(self, artifact: str, torrent_bytes: bytes, save_path: str | os.PathLike,
                 peers: Iterable[Peer] = (), resume_data: bytes | None = None) -> None:
        """Fetch an artifact into save_path (existing files are rechecked, or trusted as recorded
        in resume_data) from the given peers and any they introduce. Block files are written in
        place while downloading: read them only after the 'finished' event. Once finished the
        torrent keeps seeding; there is no need to call seed() for it."""
        self._add(artifact, self._info(artifact, torrent_bytes), save_path, resume_data,
                  list(peers), seeding=False)

    def add_listener(self, fn: Callable[[str], None]) -> None:
        """Call fn(artifact), from the thread running `pump`, the moment a download is complete
        on disk (the 'finished' event), so a waiter needs no progress polling."""
        self._listeners.append(fn)

    def add_peers(self, artifact: str, peers: Iterable[Peer]) -> None:
        t = self._get(artifact)
        handle = t.handle
        banned = self._bans.get(artifact, set())
        peers = list(peers)
        if self._tracker is not None and t.announce:  # told again on a re-announce
            self._tracker.offer(t.announce, [p for p in peers if p not in banned])
        for host, port in peers:
            if (host, port) not in banned and (host, port) != self.endpoint:
                try:
                    handle.connect_peer((host, int(port)))
                except (TypeError, ValueError, RuntimeError) as e:
                    # libtorrent takes IP literals only (Boost.Python.ArgumentError is a
                    # TypeError); peers.parse_endpoint refuses names before they get here, so
                    # this is a last line: skip the endpoint, never kill the caller.
                    self._pending.append(SwarmEvent("error", artifact,
                                                    f"not dialling {host!r:.80}:{port}: "
                                                    f"{type(e).__name__}"))

    def progress(self, artifact: str) -> Progress:
        t = self._get(artifact)
        try:
            s = t.handle.status()
        except RuntimeError:  # invalid handle: removed by another thread since _get
            raise SwarmError(f"{artifact} left the swarm while its progress was read") from None
        return self._progress(artifact, t, s)

    def _progress(self, artifact: str, t: _Torrent, s: lt.torrent_status) -> Progress:
        if s.is_finished and not t.complete and not t.finish_flush:
            with self._lock:  # finished without a torrent_finished_alert (e.g. resumed)
                if not t.finish_flush:
                    t.finish_flush = t.flush()
        return Progress(
            artifact=artifact, state=str(s.state), done=s.total_wanted_done,
            total=s.total_wanted, download_rate=s.download_payload_rate,
            upload_rate=s.upload_payload_rate, peers=s.num_peers, connections=s.num_connections,
            seeds=s.num_seeds,
            finished=t.complete and bool(s.is_finished or s.is_seeding),
            uploaded=s.total_payload_upload, downloaded=s.total_payload_download,
            error=s.errc.message() if s.errc.value() else "")

    def _statuses(self, flags: int = ALL_STATUS
                  ) -> list[tuple[str, _Torrent, lt.torrent_status]]:
        """Every torrent's (artifact, torrent, status), in one call into libtorrent's thread.
        A call a torrent (its status, then its peers) cost ~35 us each, four a torrent every
        second between the status loop and the region watch: what grew with the versions a
        trainer seeds. `refresh_torrent_status`, not `get_torrent_status`: the latter's binding
        calls its Python filter on libtorrent's thread without the GIL (libtorrent issues 6385,
        7599: an abort under `python -X dev`, a deadlock with two callers). `flags`: what
        libtorrent computes (torrent_handle.status's; 0 for the counters alone)."""
        with self._lock:
            items = list(self._torrents.items())
        by_handle = {t.handle: (a, t) for a, t in items}
        out = []
        for s in self._ses().refresh_torrent_status([t.status for _, t in items], flags):
            found = by_handle.get(s.handle)
            if found is not None:
                out.append((*found, s))
        return out

    def status(self) -> dict:
        """JSON-able snapshot: per-torrent progress with peers, session payload totals, bans.
        Peers are asked for only on torrents with connections."""
        out, up, down = {}, self._removed_up, self._removed_down
        for artifact, t, s in sorted(self._statuses(), key=lambda x: x[0]):
            try:  # _progress may ask for a flush
                p = self._progress(artifact, t, s)
                infos = t.handle.get_peer_info() if s.num_connections else []
            except RuntimeError:
                continue  # removed or re-added meanwhile (retention, refresh): skip this once
            up, down = up + p.uploaded, down + p.downloaded
            peers = [{"peer": f"{pi.ip[0]}:{pi.ip[1]}", "uploaded": pi.total_upload,
                      "downloaded": pi.total_download, "seed": bool(pi.flags & pi.seed),
                      "hashfails": pi.num_hashfails} for pi in infos]
            out[artifact] = {**p.__dict__, "seeding": t.seeding, "peer_list": peers}
        limits = self._ses().get_settings()  # a dict of every setting: read once
        return {"listen": f"{self._host}:{self.listen_port}", "torrents": out,
                "uploaded": up, "downloaded": down, "hash_failures": self.hash_failures,
                "bans": sum(len(b) for b in self._bans.values()),
                "banned": {a: sorted(f"{h}:{p}" for h, p in b)
                           for a, b in sorted(self._bans.items()) if b},
                "upload_rate_limit": int(limits["upload_rate_limit"]),
                "download_rate_limit": int(limits["download_rate_limit"])}

    def peer_bytes(self) -> list[tuple[str, str, int, int]]:
        """(artifact, connection `ip:port`, payload bytes received from it, sent to it) for every
        current connection, as libtorrent counts them per connection (daemon/peering/regions.py sums
        them per peer: which peers actually serve data). Peers are asked for only on torrents
        with connections (`_statuses`: one call for all, twice a second)."""
        out = []
        for artifact, t, s in self._statuses(0):
            if not s.num_connections:
                continue
            try:
                infos = t.handle.get_peer_info()
            except RuntimeError:
                continue  # removed meanwhile
            out += [(artifact, _fmt((pi.ip[0], int(pi.ip[1]))), pi.total_download,
                     pi.total_upload) for pi in infos]
        return out

    def set_rate_limits(self, upload: int, download: int) -> None:
        """Session caps in bytes/s (0: unlimited); safe while transfers run (SIGHUP reload)."""
        if upload < 0 or download < 0:
            raise SwarmError(f"rate limits must be >= 0 bytes/s, got {upload}, {download}")
        self._ses().apply_settings({"upload_rate_limit": upload, "download_rate_limit": download})

    def ban(self, artifact: str, endpoint: Peer, reason: str = "banned by operator") -> None:
        """Refuse this endpoint on this artifact's torrent (and, per IP, on that torrent only)."""
        with self._lock:
            self._bans.setdefault(artifact, set()).add(endpoint)
            self._refilter()
            self._pending.append(SwarmEvent("banned", artifact, reason,
                                            _fmt(endpoint)))

    def set_bans(self, artifact: str, endpoints: Iterable[Peer]) -> None:
        """Make the bans of one artifact exactly `endpoints` (held bans at start, expiry).
        Lifting a ban stops our filter and dialling refusing it; libtorrent's own ban of that
        peer in a running torrent has no undo and lasts until the torrent is added again."""
        with self._lock:
            eps = set(endpoints)
            if eps == self._bans.get(artifact, set()):
                return
            if eps:
                self._bans[artifact] = eps
            else:
                self._bans.pop(artifact, None)
            self._refilter()

    def _refilter(self) -> None:
        """Session ip_filter = every banned address; only torrents holding a ban apply it."""
        f = lt.ip_filter()
        for addr in sorted({h for eps in self._bans.values() for h, _ in eps}):
            f.add_rule(addr, addr, 1)
        for artifact, t in self._torrents.items():
            if self._bans.get(artifact):
                t.handle.set_flags(lt.torrent_flags.apply_ip_filter)
            else:
                t.handle.unset_flags(lt.torrent_flags.apply_ip_filter)
        self._ses().set_ip_filter(f)

    def remove(self, artifact: str, delete_files: bool = False) -> None:
        with self._lock:
            t = self._torrents.pop(artifact, None)
            if t is None:
                return
            self._by_hash = {h: a for h, a in self._by_hash.items() if a != artifact}
        if self._tracker is not None:
            self._tracker.forget(t.announce)
        s = t.handle.status()
        self._removed_up += s.total_payload_upload
        self._removed_down += s.total_payload_download
        self._ses().remove_torrent(t.handle, lt.session.delete_files if delete_files else 0)

    def refresh(self, artifact: str, timeout: float = 5.0) -> bool:
        """Re-add an unfinished torrent with a fresh peer list, keeping what it has (in-memory
        resume data; a full recheck of its files if that does not come in time). Returns whether
        it was re-added (a complete or unknown torrent is left alone).

        Why: libtorrent counts refused connects per peer of a torrent; after `max_failcount` (3)
        it never dials that peer again, and `connect_peer` on an endpoint already in the list
        does not reset the count. A daemon that was killed and restarted on the same ip:port (the
        trainer holding the only copy of a new delta) is then never reached by a torrent that
        tried it while it was down, however often the control plane re-announces it. A new
        torrent object starts with clean counts. Blocking: call from the swarm thread."""
        with self._lock:
            t = self._torrents.get(artifact)
            if t is None or t.complete:
                return False
            ti = t.handle.torrent_file()
            self._resume.pop(artifact, None)
            self._resume_failed.pop(artifact, None)
            n = t.flush()
        deadline = time.monotonic() + timeout
        resume: bytes | None = None
        try:
            self._wait(lambda: {artifact} if t.flushes_done < n else set(), deadline,
                       "write-cache flush")
            t.handle.save_resume_data(lt.torrent_handle.save_info_dict)
            self._wait(lambda: ({artifact} - self._resume.keys()
                                - self._resume_failed.keys()), deadline, "resume data")
            resume = self._resume.pop(artifact, None)
        except SwarmError:
            resume = None  # libtorrent rechecks the files instead
        with self._lock:
            if self._torrents.get(artifact) is not t:
                return False  # removed meanwhile (retention)
            self.remove(artifact)
            self._add(artifact, ti, t.save_path, resume, [], seeding=False)
        return True

    def save_resume_data(self, directory: str | os.PathLike, timeout: float = 10.0) -> list[Path]:
        """Write `<directory>/<artifact>.resume` (atomically) for every unfinished torrent, and for
        finished ones that changed or have no file yet; returns the paths written. Flushes
        libtorrent's write cache first: pieces still in memory are left out of resume data."""
        with self._lock:
            items = [(a, t) for a, t in self._torrents.items()
                     if not t.complete or t.handle.need_save_resume_data()
                     or not (Path(directory) / f"{a}.resume").is_file()]
            for artifact, _ in items:
                self._resume.pop(artifact, None)
                self._resume_failed.pop(artifact, None)
            targets = [(a, t, t.flush()) for a, t in items]
        wanted = {a for a, _ in items}
        deadline = time.monotonic() + timeout
        self._wait(lambda: {a for a, t, n in targets if t.flushes_done < n}, deadline,
                   "write-cache flush")
        for _, t in items:
            t.handle.save_resume_data(lt.torrent_handle.save_info_dict)
        self._wait(lambda: wanted - self._resume.keys() - self._resume_failed.keys(), deadline,
                   "resume data")
        Path(directory).mkdir(parents=True, exist_ok=True)
        written = []
        for artifact in sorted(wanted & self._resume.keys()):
            path = Path(directory) / f"{artifact}.resume"
            write_atomic(path, self._resume.pop(artifact))
            written.append(path)
        return written

    @staticmethod
    def load_resume_data(directory: str | os.PathLike, artifact: str) -> bytes | None:
        path = Path(directory) / f"{artifact}.resume"
        return path.read_bytes() if path.is_file() else None

    def pump(self, timeout: float = 0.0) -> list[SwarmEvent]:
        """Handle pending alerts (waiting up to timeout seconds for the first) and return events."""
        self._drain(timeout)
        with self._lock:
            events, self._pending = self._pending, []
        return events

    def artifacts(self) -> list[str]:
        return sorted(self._torrents)

    def is_complete(self, artifact: str) -> bool:
        """Seeded, or downloaded and flushed: every block file is whole on disk (a piece that
        later fails a seed's lazy hash check does not undo this)."""
        t = self._torrents.get(artifact)
        return t is not None and t.complete

    def complete(self) -> list[str]:
        """Artifacts held in full (seeded, or downloaded and flushed)."""
        return sorted(a for a, t in list(self._torrents.items()) if t.complete)

    def close(self) -> None:
        if self._session is not None:
            self._session.pause()
            self._session = None
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, artifact: str, ti: lt.torrent_info, save_path: str | os.PathLike,
             resume_data: bytes | None, peers: list[Peer], seeding: bool) -> None:
        with self._lock:
            if artifact in self._torrents:
                raise SwarmError(f"{artifact} is already in the swarm; remove() it first")
            params = lt.read_resume_data(resume_data) if resume_data else lt.add_torrent_params()
            params.ti = ti
            params.save_path = str(save_path)
            params.flags = (params.flags | lt.torrent_flags.seed_mode if seeding
                            else params.flags & ~lt.torrent_flags.seed_mode)
            params.flags &= ~(lt.torrent_flags.paused | lt.torrent_flags.auto_managed)
            banned = sorted(self._bans.get(artifact, set()))
            if banned:
                params.flags |= lt.torrent_flags.apply_ip_filter
                params.banned_peers = [(h, int(p)) for h, p in banned]
            else:
                params.flags &= ~lt.torrent_flags.apply_ip_filter
            if not self.config.pex:
                params.flags |= lt.torrent_flags.disable_pex
            announce: tuple[bytes, ...] = ()
            if self._tracker is not None and not seeding:
                announce = announce_hashes(ti)
                self._tracker.offer(announce, [p for p in peers if p not in banned])
                params.trackers = [self._tracker.url]
            handle = self._ses().add_torrent(params)
            self._torrents[artifact] = _Torrent(handle, str(save_path), seeding,
                                                handle.status(0), complete=seeding,
                                                announce=announce)
            self._by_hash[str(ti.info_hashes().v2)] = artifact
        self.add_peers(artifact, peers)

    def _info(self, artifact: str, torrent_bytes: bytes) -> lt.torrent_info:
        try:
            name, _ = torrents.torrent_blocks(torrent_bytes)
        except torrents.BadTorrent as exc:
            raise SwarmError(f"bad torrent for {artifact}: {exc}") from None
        if name != artifact:
            raise SwarmError(f"torrent named {name!r} given for {artifact}")
        return lt.torrent_info(lt.bdecode(torrent_bytes))

    def _wait(self, missing, deadline: float, what: str) -> None:
        while left := missing():
            if time.monotonic() >= deadline:
                raise SwarmError(f"no {what} from libtorrent in time for {sorted(left)}")
            self._drain(min(deadline - time.monotonic(), 0.2))

    def _drain(self, timeout: float) -> None:
        ses = self._ses()
        if timeout > 0:
            ses.wait_for_alert(int(timeout * 1000))
        with self._lock:
            for alert in ses.pop_alerts():
                self._handle(alert)

    def _handle(self, a: lt.alert) -> None:
        artifact = self._artifact_of(a)
        t = self._torrents.get(artifact) if artifact else None
        if isinstance(a, lt.cache_flushed_alert):
            if t is not None:
                t.flushes_done += 1
                if t.finish_flush and not t.complete and t.flushes_done >= t.finish_flush:
                    t.complete = True
                    self._pending.append(SwarmEvent("finished", artifact,
                                                    f"{artifact} is complete on disk"))
                    for fn in self._listeners:
                        fn(artifact)
        elif isinstance(a, lt.save_resume_data_alert):
            self._resume[artifact] = lt.write_resume_data_buf(a.params)
        elif isinstance(a, lt.save_resume_data_failed_alert):
            self._resume_failed[artifact] = a.message()
        elif isinstance(a, lt.torrent_finished_alert):
            if t is not None and not t.seeding and not t.complete:
                t.finish_flush = t.flush()
        elif isinstance(a, lt.hash_failed_alert):
            self.hash_failures += 1
            self._pending.append(SwarmEvent("hash_failed", artifact,
                                            f"piece {a.piece_index} failed its hash check"))
        elif isinstance(a, lt.peer_ban_alert):
            if artifact is not None:
                self.ban(artifact, (a.endpoint[0], int(a.endpoint[1])),
                         "sent data failing the v2 hash check (libtorrent named the sender)")
        elif isinstance(a, lt.torrent_error_alert | lt.file_error_alert | lt.listen_failed_alert):
            self._pending.append(SwarmEvent("error", artifact, a.message()))

    def _artifact_of(self, a: lt.alert) -> str | None:
        handle = getattr(a, "handle", None)
        if handle is None or not handle.is_valid():
            return None
        return self._by_hash.get(str(handle.info_hashes().v2))

    def _get(self, artifact: str) -> _Torrent:
        t = self._torrents.get(artifact)
        if t is None:
            raise SwarmError(f"{artifact} is not in the swarm; seed() or download() it first")
        return t

    def _ses(self) -> lt.session:
        if self._session is None:
            raise SwarmError("the swarm is closed")
        return self._session



def _fmt(endpoint: Peer) -> str:
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
