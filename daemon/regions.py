"""Region-aware peering: which BitTorrent peers a daemon dials so that each piece crosses into a
region about once, nodes inside a region serve each other, and the trainer's uplink sends about
one copy.

Design (issue 14): every region elects `gateways` nodes (default one) by a hash of their names
among the region's live members; everyone computes the same election from the peer book
(regions and roles travel in X-Deltaswarm-Region and index entries). A daemon dials

- every trusted peer of its own region (the trainer too, when it lives here), and
- when it is one of its region's gateways: the gateways of every other region.

Nobody else dials across, and ut_pex is off (SwarmConfig.pex), so cross-region connections exist
only between gateways. The trainer is never a gateway while its region has another live node:
all data enters the swarm in the trainer's region, its gateway holds each piece before any other
region can, so other regions never send pieces back into it, and the trainer serves only its own
region (rotating unchokes, SEED_SETTINGS) instead of one copy per region. A region whose only
live node is the trainer is represented by the trainer itself.

Liveness: a member is live while its last control-plane contact succeeded (`Peer.failures == 0`;
head long-polls fail within a second or two of a kill -9), so when a gateway dies the next node
by hash takes over and dials the other gateways, and they dial it back when they see it; pieces
the dead gateway fetched stay in the region (its neighbours hold them). A one-node region is its
own gateway. A region behind a slow link only slows its own gateway: other gateways fetch from
every gateway they are connected to. A peer whose region is not known yet is dialled (blind),
so an old daemon or a half-learned book costs bytes, never liveness.

Cost: a transient double import when two nodes of a region briefly disagree on who is gateway
(views differ for a poll interval), and BitTorrent's end-game duplicates at the gateway.
"""

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daemon.names import Endpoint

if TYPE_CHECKING:
    from daemon.peers import Peer, PeerBook

MODES = ("aware", "blind")


def rank(region: str, node: str) -> str:
    """Election order inside a region: the same on every daemon (not Python's salted hash)."""
    return hashlib.sha256(f"{region}/{node}".encode()).hexdigest()


@dataclass
class RegionPeering:
    mode: str = "aware"
    gateways: int = 1
    last: dict = field(default_factory=dict)
    """What the last `endpoints` call chose (for status)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"region peering mode must be one of {MODES}, got {self.mode!r}")
        if self.gateways < 1:
            raise ValueError(f"gateways per region must be >= 1, got {self.gateways}")

    def endpoints(self, book: "PeerBook") -> list[Endpoint]:
        dialable = book.bt_endpoints()
        if self.mode == "blind" or book.region is None:
            self.last = {"mode": self.mode, "dialled": len(dialable)}
            return dialable
        allowed = set(dialable)
        live = [p for p in book.peers.values() if p.bt in allowed and p.failures == 0]
        chosen = gateways_by_region(book, live, self.gateways)
        me_gateway = book.node in chosen.get(book.region, ())
        dial: list[Endpoint] = []
        for p in book.peers.values():
            if p.bt is None or p.bt not in allowed:
                continue
            local = p.region is None or p.region == book.region
            if local or (me_gateway and p.node in chosen.get(p.region, ())):
                dial.append(p.bt)
        self.last = {"mode": self.mode, "region": book.region, "gateway": me_gateway,
                     "gateways": {r: sorted(n) for r, n in sorted(chosen.items())},
                     "dialled": len(dial), "known": len(dialable)}
        return dial

    def status(self) -> dict:
        return {"mode": self.mode, "gateways_per_region": self.gateways, **self.last}


def gateways_by_region(book: "PeerBook", live: "list[Peer]", per_region: int
                       ) -> dict[str, set[str]]:
    """region → the node names elected as its gateways, this node included in its own region.
    Non-trainer members by rank first; a trainer only fills a region with no other member."""
    members: dict[str, list[tuple[bool, str, str]]] = {}
    for p in live:
        if p.region is not None and p.node is not None:
            members.setdefault(p.region, []).append((p.role == "trainer", rank(p.region, p.node),
                                                     p.node))
    if book.region is not None and book.role != "trainer":
        members.setdefault(book.region, []).append((False, rank(book.region, book.node),
                                                    book.node))
    out = {}
    for region, m in members.items():
        others = sorted((rk, n) for trainer, rk, n in m if not trainer)
        out[region] = ({n for _, n in others[:per_region]}
                       or {n for trainer, _, n in m if trainer})
    return out
