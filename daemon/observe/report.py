"""Filling the `NodeStatus` model (daemon/observe/status.py) from a running node's parts.

Built fresh on each request from the live objects (swarm, syncer, seeder, spool, notifier), so
there is one source of truth per number and nothing to keep in step.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

from chain.manifest import parse_artifact
from chain.sizes import Sizes
from chain.store import ChainStore
from daemon.bittorrent.artifacts import Artifacts
from daemon.engines.hooks import Notifier
from daemon.observe.status import (
    AdapterStatus,
    Ban,
    EngineCheckStatus,
    EngineStatus,
    NodeStatus,
    Peer,
    Rates,
    RefusedManifest,
    SelfCheckStatus,
    SpoolStatus,
    Totals,
    Transfer,
    Verification,
    Warmup,
    WeightsCheckStatus,
)
from daemon.peering.peers import PeerBook
from daemon.trajectories.intake import Intake
from daemon.versions.sync import Syncer


@dataclass
class Sources:
    """What status is read from: the node's parts, never the node."""

    node: str
    region: str
    role: str
    url: str
    bt: Callable[[], str]
    started: float
    store: ChainStore
    book: PeerBook
    artifacts: Artifacts
    current: Callable[[], dict | None]
    syncer: Syncer | None
    intake: Intake
    notifier: Callable[[], Notifier | None]
    engine_type: str
    upstream: str | None
    weights_problem: Callable[[], str | None] = lambda: None
    self_check: Callable[[], dict] = dict
    """SelfCheck.status() (daemon/bittorrent/selfcheck.py)."""
    weights_check: Callable[[], dict | None] = lambda: None
    """WeightsCheck.status() on a region (daemon/versions/weights_check.py)."""
    warmup: Callable[[], dict] = dict
    """The codec warm-up's state (daemon/node.py)."""


def build_status(node: Sources, swarm: dict | None = None) -> NodeStatus:
    """The head reported is the newest manifest this node verified: a head a peer only claims
    (maybe 10**12) is a hint for sync, never shown as this node's head. `swarm`: the
    Artifacts.status() the caller already read (it walks every torrent's peers), else read."""
    sw = node.artifacts.status() if swarm is None else swarm
    cur = node.current()
    syncer = node.syncer
    heads = [h for h in (node.store.head(),) if h is not None]
    applying = syncer.applying if syncer is not None else None
    transfers = syncer.transfers if syncer is not None else {}

    versions = []
    by_ip: dict[str, list[int]] = {}
    rate_dn = rate_up = 0.0
    for artifact, t in sorted(sw["torrents"].items()):
        version = parse_artifact(artifact)[0]
        if applying and applying.get("artifact") == artifact:
            state = "applying"
        elif not t["finished"]:
            state = "failed" if t["error"] else "fetching"
        elif cur is not None and version == cur["version"]:
            state = "current"
        else:
            state = "seeding"
        versions.append(Transfer(
            artifact=artifact, version=version, state=state, done_bytes=t["done"],
            total_bytes=t["total"], **_split(node.store, artifact),
            download_rate=t["download_rate"],
            upload_rate=t["upload_rate"], bytes_up=t["uploaded"], peers=t["peers"],
            error=t["error"] or None))
        rate_dn += t["download_rate"]
        rate_up += t["upload_rate"]
        for p in t["peer_list"]:
            acc = by_ip.setdefault(p["peer"].rpartition(":")[0], [0, 0])
            acc[0] += p["uploaded"]
            acc[1] += p["downloaded"]
    for artifact, info in transfers.items():
        if artifact not in sw["torrents"]:
            versions.append(Transfer(artifact=artifact, version=parse_artifact(artifact)[0],
                                     state="fetching", total_bytes=info.get("total") or 0,
                                     **_split(node.store, artifact)))

    peers = []
    for p in node.book.peers.values():
        up, down = by_ip.pop(p.bt[0], [0, 0]) if p.bt else (0, 0)
        peers.append(Peer(node=p.node, http_url=p.url,
                          bt_endpoint=f"{p.bt[0]}:{p.bt[1]}" if p.bt else None,
                          bytes_up=up, bytes_down=down, last_seen=p.last_seen or None))
    for ip, (up, down) in by_ip.items():
        peers.append(Peer(bt_endpoint=ip, bytes_up=up, bytes_down=down))

    sizes = syncer.totals if syncer is not None else {}
    failures: dict[str, int] = {}
    refused, refused_by = [], {}
    if syncer is not None:
        failures = dict(syncer.failures)
        for r in syncer.refused:
            refused.append(RefusedManifest(artifact=r["artifact"], source=r["source"],
                                           kind=r["kind"], reason=r["reason"], at=r["time"]))
        refused_by = dict(syncer.refused_counts)
    if sw.get("hash_failures"):
        failures["piece"] = sw["hash_failures"]

    n = node.notifier()
    engine = EngineStatus(type=node.engine_type)
    check = getattr(n.hook, "check", None) if n is not None else None
    engine_check = EngineCheckStatus(**check.as_dict()) if check is not None else None
    if n is not None:
        engine = EngineStatus(type=n.kind, notifications=n.ok, failures=n.failed,
                              last_version=n.last_version, last_error=n.last_error or None,
                              last_ok_at=n.last_ok_at, last_error_at=n.last_error_at)
    lora = getattr(n.hook, "lora", None) if n is not None else None
    adapter = None
    if lora is not None or (syncer is not None and syncer.adapters):
        adapter = AdapterStatus(
            base=syncer.base_held if syncer else None,
            base_problem=syncer.base_problem if syncer else None,
            lora_name=lora.lora_name if lora else None,
            engine_version=lora.version if lora else None,
            engine_adapters=dict(lora.served) if lora else {}, load_s=lora.load_s if lora else 0)
    spool = SpoolStatus(upstream=node.upstream)
    intake = node.intake
    if intake.forwarder is not None and intake.spool is not None:
        f = intake.forwarder
        spool = SpoolStatus(upstream=f.cfg.upstream, depth=intake.spool.depth(),
                            bytes=intake.spool.bytes, received=intake.accepted,
                            forwarded=f.forwarded, forward_rate=f.rate(),
                            rejected_full=intake.refusals, errors=f.errors,
                            rejected_invalid=intake.spool.rejected,
                            last_rejected=f.last_rejected or None,
                            last_error=f.last_error or None)

    return NodeStatus(
        node=node.node, region=node.region, role=node.role, http_url=node.url,
        bt_endpoint=node.bt(), time=time.time(),
        uptime_s=time.monotonic() - node.started,
        current_version=cur["version"] if cur else None, head_version=max(heads, default=None),
        state_digest=cur["state_digest"] if cur else None, versions=versions, peers=peers,
        totals=Totals(bytes_up=sw["uploaded"], bytes_down=sw["downloaded"],
                      tensor_bytes=sizes.get("tensor_bytes", 0),
                      full_tensor_bytes=sizes.get("dense_bytes", 0),
                      file_bytes=sizes.get("file_bytes", 0),
                      new_file_bytes=sizes.get("new_file_bytes", 0),
                      versions_applied=sizes.get("versions", 0)),
        rates=Rates(download=rate_dn, upload=rate_up),
        verification=Verification(failures_by_kind=failures),
        bans=[Ban(endpoint=b.endpoint, artifact=b.artifact, reason=b.reason, since=b.since,
                  expires=b.expires, node=_node_of(node.book, b.endpoint))
              for b in node.artifacts.bans.active()],
        self_check=SelfCheckStatus(**node.self_check()),
        weights_check=_weights_check(node),
        warmup=Warmup(**node.warmup()),
        refused_manifests=refused, refused_by_kind=refused_by, engine=engine, spool=spool,
        engine_check=engine_check, adapter=adapter,
        weights_problem=node.weights_problem(),
        last_apply_s=syncer.applied[-1]["apply_seconds"] if syncer and syncer.applied else None)


def _weights_check(node: Sources) -> WeightsCheckStatus | None:
    doc = node.weights_check()
    return None if doc is None else WeightsCheckStatus(**doc)


def _split(store: ChainStore, artifact: str) -> dict[str, int]:
    """An artifact's tensor and carried-file bytes, from its manifest (none yet: nothing)."""
    m = store.get(*parse_artifact(artifact))
    if m is None:
        return {}
    size = Sizes.of(m)
    return {"tensor_bytes": size.tensor_bytes, "file_bytes": size.file_bytes}


def _node_of(book: PeerBook, endpoint: str) -> str | None:
    peer = book.at_endpoint(endpoint)
    return peer.node if peer is not None else None
