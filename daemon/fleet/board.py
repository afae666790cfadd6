"""The fleet board: what this daemon knows of other nodes from their fleet reports (name, region,
role, version held and since when, bytes per link class, trajectories waiting), and the view
an operator reads first (`GET /v1/fleet`, `deltaswarm status --fleet`, per-region metrics).

Reports travel up: every daemon posts its own report plus the fresh ones it holds to its
upstreams (daemon/fleet/link.py), so the trainer's daemon sees regions behind chained upstreams.
Times travel as ages (`age_s`: seconds since the node made the report, grown by each hop's
holding time; `held_s`: seconds it has held its version), never as another host's clock, so
clock skew cannot make an entry look fresh; an entry forwarded in a loop only ever gets older.

A node can report only for itself, and a relay can forward but not forge: every entry carries
its origin's signature (daemon/peering/identity.py: content and origin time, not the age and hop
count
relays change), the entry's node name must be pinned to the signing key (first key seen pins
it), and the direct reporter's request is signed by its own key, whose URL answered a hello
challenge as that node (fleet_link.Verifier). An entry is taken only if its origin time is newer
than the one held, so a replayed entry cannot undo a newer one. Each reporter may have at most
`max_per_reporter` entries it forwarded on the board; when the board is full the stalest entry
makes room (a flood of fresh entries cannot lock a real node out, and a flood needs many signed,
proven reporters to displace anyone).
"""

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from daemon.peering.identity import Identities, NodeKey, fingerprint
from daemon.peering.names import NODE_NAME, BadName, check_url

MAX_VERSION = 2**62
MAX_HOPS = 16
"""Entries forwarded more often than this are dropped: a chain of regions deeper than 16 is a
misconfiguration, and the bound stops a forwarding loop early (ages stop it anyway)."""
MAX_AGE_S = 86_400.0
MAX_REPORT_NODES = 20_000
"""Most entries in one report: a whole 100 x 100 fleet forwarded by one gateway, with room."""
MAX_PER_REPORTER = 2_000
"""Default most entries one reporter may have forwarded onto a board: a gateway of a region of
a few hundred nodes, with room; `fleet.max_per_reporter`."""
REPORT_MAX_BYTES = 16 << 20
"""A report of MAX_REPORT_NODES entries at ~600 bytes each is ~12 MB; anything larger is refused."""
LINK_CLASSES = ("intra", "cross", "trainer", "unknown")
"""intra: same region; cross: another region; trainer: the trainer's node on either end;
unknown: a peer whose region this node has not learned yet."""

Count = Annotated[StrictInt, Field(ge=0, lt=MAX_VERSION)]
Name = Annotated[str, Field(pattern=NODE_NAME)]


class BadReport(ValueError):
    """A fleet report is malformed; the message names the entry and the field."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


LinkClass = Literal["intra", "cross", "trainer", "unknown"]
Flow = dict[Literal["bytes_in", "bytes_out"], Count]
"""Bytes in and out over one link class (a missing count is 0)."""
Links = dict[LinkClass, Flow]
"""Bytes since the daemon started, per link class, from libtorrent's per-peer counters. Plain
dicts with literal keys, not nested models: four nested models per entry were a third of a
report's validation time (bench/fleet.py)."""


def flows(links: Links) -> dict[str, dict[str, int]]:
    """Every link class with both counts (0 where the report left one out)."""
    return {c: {"bytes_in": links.get(c, {}).get("bytes_in", 0),
                "bytes_out": links.get(c, {}).get("bytes_out", 0)} for c in LINK_CLASSES}


class EntrySig(_Wire):
    """An entry's origin signature (daemon/peering/identity.py `NodeKey.sign_entry`)."""

    key: str = Field(pattern=r"^[0-9a-f]{64}$")
    ts: float = Field(ge=0, le=1e11)
    """The origin's Unix time when it signed (bounds replay; ages still come from `age_s`)."""
    sig: str = Field(pattern=r"^[0-9a-f]{128}$")


class NodeReport(_Wire):
    """One node's report as it travels (small: ~600 bytes of JSON)."""

    node: Name
    region: Name
    role: Literal["trainer", "region"]
    url: str = Field(max_length=300)
    version: Count | None = None
    """The version it holds, verified (None: none yet)."""
    held_s: float | None = Field(None, ge=0, le=10 * 365 * 86_400.0)
    """Seconds it has held `version`, at the time of the report."""
    head: Count | None = None
    """The newest manifest it verified."""
    age_s: float = Field(0.0, ge=0, le=MAX_AGE_S)
    """Seconds since the node made this report (0 from the node itself; each hop adds)."""
    hops: StrictInt = Field(0, ge=0, le=MAX_HOPS)
    links: Links = Field(default_factory=dict)
    trajectories_waiting: Count = 0
    sig: EntrySig | None = None
    """Its origin's signature; entries without one are refused."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        try:
            return _checked_url(v)
        except BadName as e:
            raise ValueError(str(e)) from None


def sign_report(report: NodeReport, key: NodeKey, now: float | None = None) -> NodeReport:
    """`report` signed by its origin's key (daemon/peering/identity.py `NodeKey.sign_entry`)."""
    return NodeReport.model_validate(key.sign_entry(report.model_dump(mode="json"), now))


@lru_cache(maxsize=65_536)
def _checked_url(url: str) -> str:
    """check_url, remembered: a gateway sends the same 10k URLs every interval, and yarl's
    parse was two thirds of a report's validation (bench/fleet.py)."""
    return check_url(url)


class Report(_Wire):
    reports: list[NodeReport] = Field(min_length=1, max_length=MAX_REPORT_NODES)


def parse_report(body: bytes) -> Report:
    """Validate a report body; BadReport naming the first problems (entry index and field)."""
    if len(body) > REPORT_MAX_BYTES:
        raise BadReport(f"fleet report is {len(body)} bytes, over {REPORT_MAX_BYTES}")
    try:
        return Report.model_validate_json(body)
    except ValidationError as e:
        probs = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}"
                          for err in e.errors()[:5])
        raise BadReport(f"fleet report refused ({e.error_count()} problems): {probs}") from None


@dataclass
class Entry:
    report: NodeReport
    seen: float
    """Local epoch seconds when the node made the report (now - age_s on arrival)."""
    via: str | None
    """The node that forwarded it here; None when the node reported here itself."""
    key: str = ""
    """The origin's identity key (its signature verified)."""
    ts: float = 0.0
    """The origin's signing time (a newer one replaces it; an older or equal one does not)."""

    @property
    def since(self) -> float | None:
        r = self.report
        return None if r.held_s is None or r.version is None else self.seen - r.held_s


@dataclass
class Accepted:
    stored: int
    refused: list[dict]


class FleetBoard:
    """Reports of other nodes, newest per node name, at most `max_nodes`, forgotten after
    `forget_s` without news. `now` is epoch seconds everywhere (tests pass it explicitly)."""

    def __init__(self, self_node: str, max_nodes: int = MAX_REPORT_NODES,
                 forget_s: float = 120.0, max_per_reporter: int = MAX_PER_REPORTER) -> None:
        self.self_node = self_node
        self.max_nodes = max_nodes
        self.forget_s = forget_s
        self.max_per_reporter = max_per_reporter
        self.entries: dict[str, Entry] = {}
        self.per_via: dict[str, int] = {}
        """reporter → entries it forwarded that are on the board (the quota's count)."""
        self.head_seen: dict[int, float] = {}
        """version → when this daemon first saw it as head (for lag in seconds)."""
        self.refused = 0
        self.last_refusal = ""
        self.evicted = 0

    # --- writing -----------------------------------------------------------------------------
    def accept(self, reporter: str, reporter_url: str, reports: Iterable[NodeReport],
               now: float, checks: list[str | None] | None = None,
               identities: Identities | None = None, source: str = "") -> Accepted:
        """Store a verified reporter's report: its own entry first, then what it forwards.
        `checks[i]`: why entry i's origin signature failed (None: good; identity.check_entry,
        run off the loop); `identities` pins each entry's name to its key. Entries that
        conflict (unsigned, another key for a pinned name, about this node, stale, over the
        reporter's quota) are refused one by one with a reason; the reporter's own entry must
        be present, signed and must match it, else BadReport and nothing is stored."""
        reports = list(reports)
        checks = checks if checks is not None else [None] * len(reports)
        mine = [i for i, r in enumerate(reports) if r.node == reporter]
        own = reports[mine[0]] if len(mine) == 1 else None
        if own is None or own.url != reporter_url or own.hops != 0 or own.age_s > 60:
            raise BadReport(f"a fleet report from {reporter} must hold exactly one fresh entry "
                            f"for {reporter} itself at {reporter_url} (hops 0); a node reports "
                            "for itself and forwards what it was sent")
        if checks[mine[0]] is not None or own.sig is None:
            raise BadReport(f"{reporter}'s own entry: {checks[mine[0]] or 'unsigned'}")
        self.prune(now)
        self._room(reports, checks, own, reporter, now)
        stored, refused = 0, []
        for r, why in zip(reports, checks, strict=True):
            if why is None:
                why = self._store(r, None if r is own else reporter, now, identities,
                                  source or reporter_url)
            if why is None:
                stored += 1
            else:
                refused.append({"node": r.node, "error": why})
        if refused:
            self.refused += len(refused)
            self.last_refusal = f"{refused[0]['node']}: {refused[0]['error']}"[:300]
        return Accepted(stored, refused)

    def _room(self, reports: list[NodeReport], checks: list[str | None], own: NodeReport,
              reporter: str, now: float) -> None:
        """Make room for the report's new names by evicting the stalest entries (only those
        older than the newcomers). Only entries that could be stored count: signed, with a
        good origin signature, fresh, and within the reporter's remaining quota, so one
        reporter's forged or excess entries never evict anyone."""
        quota = self.max_per_reporter - self.per_via.get(reporter, 0)
        new = []
        for r, why in zip(reports, checks, strict=True):
            if (why is not None or r.sig is None or r.node in self.entries
                    or r.node == self.self_node or r.age_s >= self.forget_s):
                continue
            if r is not own:
                if quota <= 0:
                    continue
                quota -= 1
            new.append(r)
        over = len(self.entries) + len(new) - self.max_nodes
        if over <= 0:
            return
        newest = max(now - r.age_s for r in new)
        for e in heapq.nsmallest(over, self.entries.values(), key=lambda e: e.seen):
            if e.seen >= newest:
                break
            self._drop(e.report.node)
            self.evicted += 1

    def _drop(self, name: str) -> None:
        e = self.entries.pop(name)
        if e.via is not None:
            self.per_via[e.via] -= 1
            if not self.per_via[e.via]:
                del self.per_via[e.via]

    def _store(self, r: NodeReport, via: str | None, now: float,
               identities: Identities | None, source: str) -> str | None:
        if r.node == self.self_node:
            return "an entry about this node itself is not taken from others"
        if r.age_s >= self.forget_s:
            return f"older than forget_s ({r.age_s:.0f}s >= {self.forget_s:.0f}s)"
        if r.sig is None:
            return "unsigned (a node signs its own entry; an old daemon's entries are not taken)"
        seen = now - r.age_s
        old = self.entries.get(r.node)
        if old is None:
            if len(self.entries) >= self.max_nodes:
                return f"the fleet board holds max_nodes={self.max_nodes} fresher nodes"
            if via is not None and self.per_via.get(via, 0) >= self.max_per_reporter:
                return (f"{via} already has max_per_reporter={self.max_per_reporter} entries "
                        "it forwarded on this board")
        if identities is not None and not identities.claim(
                r.node, r.sig.key, f"fleet entry via {via or r.node} ({source})", now):
            return (f"node {r.node} is pinned to another key than {fingerprint(r.sig.key)}: "
                    "a relay forwards, it cannot forge")
        if old is not None:
            if old.key != r.sig.key:
                return (f"node {r.node} is on the board under key {fingerprint(old.key)}, not "
                        f"{fingerprint(r.sig.key)}: a relay forwards, it cannot forge")
            if old.ts >= r.sig.ts:
                return None  # not newer: nothing to do, not an error (the same news twice)
        if old is not None:
            self._drop(r.node)
        self.entries[r.node] = Entry(r, seen, via, r.sig.key, r.sig.ts)
        if via is not None:
            self.per_via[via] = self.per_via.get(via, 0) + 1
        return None

    def prune(self, now: float) -> None:
        for name in [n for n, e in self.entries.items() if now - e.seen >= self.forget_s]:
            self._drop(name)

    def note_head(self, version: int | None, now: float) -> None:
        """Record when this daemon first saw `version` as its head (bounded history)."""
        if version is not None and version not in self.head_seen:
            self.head_seen[version] = now
            if len(self.head_seen) > 10_000:
                for v in sorted(self.head_seen)[:1000]:
                    del self.head_seen[v]

    # --- reading -----------------------------------------------------------------------------
    def live(self, now: float, within_s: float) -> list[Entry]:
        return [e for e in self.entries.values() if now - e.seen <= within_s]

    def live_versions(self, now: float, within_s: float) -> list[int | None]:
        """Versions held by the nodes heard from within `within_s` (retention keeps what they
        need to catch up); None for a node that holds no version yet."""
        return [e.report.version for e in self.live(now, within_s)]

    def forwardable(self, now: float, to: str | None) -> list[dict]:
        """Fresh entries to pass up (as JSON-ready dicts), aged by their time here; never one
        back to the node it came from or about the receiver itself."""
        out = []
        for e in self.entries.values():
            age = now - e.seen
            r = e.report
            if (age >= self.forget_s or r.hops >= MAX_HOPS or r.node == to
                    or (to is not None and e.via == to)):
                continue
            out.append(r.model_dump(mode="json") | {"age_s": round(max(0.0, age), 3),
                                                    "hops": r.hops + 1})
        return out

    def lag_s(self, version: int | None, head: int | None, now: float) -> float | None:
        """Seconds the node has been behind: since this daemon first saw the oldest version it
        lacks as head (0 when it holds the head; None when that time is unknown)."""
        if head is None or (version is not None and version >= head):
            return 0.0
        missing = [t for v, t in self.head_seen.items()
                   if v <= head and (version is None or v > version)]
        return max(0.0, now - min(missing)) if missing else None

    def row(self, r: NodeReport, seen: float, since: float | None, via: str | None,
            head: int | None, now: float) -> dict:
        lag = None if head is None else (head + 1 if r.version is None
                                         else max(0, head - r.version))
        return {"node": r.node, "region": r.region, "role": r.role, "url": r.url,
                "version": r.version, "since": since, "head": r.head,
                "last_seen": round(seen, 3), "age_s": round(max(0.0, now - seen), 1),
                "via": via, "hops": r.hops, "lag_versions": lag,
                "lag_s": self.lag_s(r.version, head, now),
                "links": flows(r.links), "trajectories_waiting": r.trajectories_waiting}

    def snapshot(self, head: int | None, now: float) -> "FleetBoard":
        """A copy to build the view from in a worker thread (on the loop: note the head,
        prune, then copy the dicts; entries themselves are never changed, only replaced)."""
        self.note_head(head, now)
        self.prune(now)
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.entries, copy.head_seen = dict(self.entries), dict(self.head_seen)
        copy.per_via = dict(self.per_via)
        return copy

    def view(self, head: int | None, now: float, me: NodeReport | None = None,
             stale_s: float = 30.0) -> dict:
        """The fleet by region: each node's version, since, lag (versions and seconds behind
        this daemon's head), bytes per link class, trajectories waiting; `me` is this daemon's
        own report (shown too). Nodes not heard from within `stale_s` are marked stale."""
        self.note_head(head, now)
        self.prune(now)
        rows = [self.row(e.report, e.seen, e.since, e.via, head, now)
                for e in self.entries.values()]
        if me is not None:
            since = None if me.held_s is None or me.version is None else now - me.held_s
            rows.append(self.row(me, now, since, None, head, now) | {"self": True})
        regions: dict[str, dict] = {}
        for row in sorted(rows, key=lambda x: (x["region"], x["node"])):
            row["stale"] = row["age_s"] > stale_s
            reg = regions.setdefault(row["region"], {
                "nodes": [], "links": {c: {"bytes_in": 0, "bytes_out": 0} for c in LINK_CLASSES},
                "trajectories_waiting": 0})
            reg["nodes"].append(row)
            for c in LINK_CLASSES:
                for k in ("bytes_in", "bytes_out"):
                    reg["links"][c][k] += row["links"][c][k]
            reg["trajectories_waiting"] += row["trajectories_waiting"]
        for reg in regions.values():
            fresh = [n for n in reg["nodes"] if not n["stale"]]
            held = [n["version"] for n in fresh if n["version"] is not None]
            lags = [n["lag_versions"] for n in fresh if n["lag_versions"] is not None]
            lag_s = [n["lag_s"] for n in fresh if n["lag_s"] is not None]
            reg |= {"node_count": len(reg["nodes"]), "stale": len(reg["nodes"]) - len(fresh),
                    "at_head": sum(1 for n in fresh if n["lag_versions"] == 0),
                    "min_version": min(held, default=None),
                    "max_version": max(held, default=None),
                    "max_lag_versions": max(lags, default=None),
                    "max_lag_s": max(lag_s, default=None)}
        return {"node": self.self_node, "head": head, "time": now, "stale_s": stale_s,
                "forget_s": self.forget_s, "nodes": len(rows), "refused": self.refused,
                "last_refusal": self.last_refusal or None, "regions": regions}

    def summary(self, view: dict) -> dict:
        """The `fleet` key of /v1/status: per region counts only (the node table is
        /v1/fleet, which can be megabytes at 10k nodes)."""
        return {k: view[k] for k in ("head", "nodes", "refused", "last_refusal")} | {
            "regions": {name: {k: v for k, v in reg.items() if k != "nodes"}
                        for name, reg in view["regions"].items()}}
