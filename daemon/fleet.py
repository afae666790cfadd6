"""The fleet board: what this daemon knows of other nodes from their fleet reports (name, region,
role, version held and since when, bytes per link class, trajectories waiting), and the view
an operator reads first (`GET /v1/fleet`, `deltaswarm status --fleet`, per-region metrics).

Reports travel up: every daemon posts its own report plus the fresh ones it holds to its
upstreams (daemon/fleet_link.py), so the trainer's daemon sees regions behind chained upstreams.
Times travel as ages (`age_s`: seconds since the node made the report, grown by each hop's
holding time; `held_s`: seconds it has held its version), never as another host's clock, so
clock skew cannot make an entry look fresh; an entry forwarded in a loop only ever gets older.

A node can report only for itself: the direct reporter's own entry must name the node and URL
its `X-Deltaswarm-Peer` header announces, and that URL must have answered a hello challenge with
that node name (fleet_link.Verifier). A name is bound to the URL it was first reported at while
its entry lives (`forget_s`), so another token holder cannot overwrite it (a node that moves to
a new URL shows again once its old entry is forgotten). With one shared token that is as far as
identity goes (THREAT_MODEL.md).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from daemon.names import NODE_NAME, BadName, check_url

MAX_VERSION = 2**62
MAX_HOPS = 16
"""Entries forwarded more often than this are dropped: a chain of regions deeper than 16 is a
misconfiguration, and the bound stops a forwarding loop early (ages stop it anyway)."""
MAX_AGE_S = 86_400.0
MAX_REPORT_NODES = 20_000
"""Most entries in one report: a whole 100 x 100 fleet forwarded by one gateway, with room."""
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

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        try:
            return _checked_url(v)
        except BadName as e:
            raise ValueError(str(e)) from None


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
                 forget_s: float = 120.0) -> None:
        self.self_node = self_node
        self.max_nodes = max_nodes
        self.forget_s = forget_s
        self.entries: dict[str, Entry] = {}
        self.head_seen: dict[int, float] = {}
        """version → when this daemon first saw it as head (for lag in seconds)."""
        self.refused = 0
        self.last_refusal = ""

    # --- writing -----------------------------------------------------------------------------
    def accept(self, reporter: str, reporter_url: str, reports: Iterable[NodeReport],
               now: float) -> Accepted:
        """Store a verified reporter's report: its own entry first, then what it forwards.
        Entries that conflict (another URL for a bound name, about this node, stale, full
        board) are refused one by one with a reason; the reporter's own entry must be present
        and must match it, else BadReport and nothing is stored."""
        reports = list(reports)
        own = [r for r in reports if r.node == reporter]
        if len(own) != 1 or own[0].url != reporter_url or own[0].hops != 0 or own[0].age_s > 60:
            raise BadReport(f"a fleet report from {reporter} must hold exactly one fresh entry "
                            f"for {reporter} itself at {reporter_url} (hops 0); a node reports "
                            "for itself and forwards what it was sent")
        self.prune(now)
        stored, refused = 0, []
        for r in reports:
            why = self._store(r, None if r is own[0] else reporter, now)
            if why is None:
                stored += 1
            else:
                refused.append({"node": r.node, "error": why})
        if refused:
            self.refused += len(refused)
            self.last_refusal = f"{refused[0]['node']}: {refused[0]['error']}"[:300]
        return Accepted(stored, refused)

    def _store(self, r: NodeReport, via: str | None, now: float) -> str | None:
        if r.node == self.self_node:
            return "an entry about this node itself is not taken from others"
        if r.age_s >= self.forget_s:
            return f"older than forget_s ({r.age_s:.0f}s >= {self.forget_s:.0f}s)"
        seen = now - r.age_s
        old = self.entries.get(r.node)
        if old is not None:
            if old.report.url != r.url:
                return (f"node {r.node} is reported at {old.report.url} (seen "
                        f"{now - old.seen:.0f}s ago), not {r.url}: a node reports only for "
                        "itself")
            if old.seen >= seen:
                return None  # not newer: nothing to do, not an error (the same news twice)
        elif len(self.entries) >= self.max_nodes:
            return f"the fleet board holds max_nodes={self.max_nodes} nodes"
        self.entries[r.node] = Entry(r, seen, via)
        return None

    def prune(self, now: float) -> None:
        for name in [n for n, e in self.entries.items() if now - e.seen >= self.forget_s]:
            del self.entries[name]

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
