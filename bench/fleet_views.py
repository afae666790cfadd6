"""How far the views of a fleet larger than a peer book agree (daemon/peering/peers.py,
anchors): real PeerBooks, RegionPeerings and index listings/learning, the HTTP between them a
function call and a hello's proof taken as given. Every node reads one random peer's index per
round (a daemon reads one every 2 s for its first minute, then every 30 s); then each node
computes its fetch role and its region's gateway from its own book.

    python bench/fleet_views.py [--regions 20] [--per-region 30] [--max-peers 32] [--rounds 12]

Prints, per region, how many nodes believe they fetch for it and how many believe they are its
gateway (1 and 1 when every view agrees), and with --json one JSON line last.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.peering.peers import BookFull, PeerBook
from daemon.peering.regions import RegionPeering, learn_index

TRAINER = "http://10.250.0.1:8700"


class Fleet:
    """A trainer in region r0 and `regions` x `per_region` nodes, each bootstrapping from the
    trainer and one random node, books of `max_peers`."""

    def __init__(self, regions: int, per_region: int, max_peers: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.who: dict[str, tuple[str, tuple[str, int], str, str]] = {
            TRAINER: ("trainer", ("10.250.0.1", 6881), "r0", "trainer")}
        for k in range(regions * per_region):
            ip = f"10.{k // 250}.{k % 250}.1"
            self.who[f"http://{ip}:8700"] = (f"r{k // per_region}n{k % per_region}", (ip, 6881),
                                              f"r{k // per_region}", "region")
        urls = [u for u in self.who if u != TRAINER]
        self.books: dict[str, PeerBook] = {}
        for url, (node, bt, region, role) in self.who.items():
            boot = [] if url == TRAINER else [TRAINER, self.rng.choice(urls)]
            b = PeerBook(url, bt, node, boot, max_peers)
            b.set_region(region, role, RegionPeering("aware", 1))
            self.books[url] = b
            self.prove_all(b)

    def prove_all(self, b: PeerBook) -> None:
        """What a hello does for each peer not yet proven and alive: its own answer, then the
        proof."""
        for p in list(b.peers.values()):
            if not p.proven and p.url in self.who and p.url in getattr(self, "books", {p.url: 0}):
                node, bt, region, role = self.who[p.url]
                b.learn_own(p.url, node, None, bt=bt, region=region, role=role)
                if p.url in b.peers:
                    b.proved(p)

    def round(self) -> None:
        """Every node reads the index of one random usable peer; the peer learns the reader
        from its request's announcement."""
        for b in self.books.values():
            usable = [p for p in b.peers.values() if p.usable()]
            if not usable:
                continue
            p = self.rng.choice(usable)
            other = self.books.get(p.url)
            if other is None:  # a dead node: the read fails
                b.failed(p, "connection refused")
                continue
            try:
                back = other.learn(b.self_url, b.self_bt, b.node, region=b.region, role=b.role)
                if back is not None:
                    other.proved(back)
            except BookFull:
                pass
            learn_index(b, p, {"region": other.region, "role": other.role,
                               "peers": other.listing(b.region)})
            self.prove_all(b)

    def fetchers(self) -> dict[str, list[str]]:
        """region -> nodes that believe they fetch for it ("region" or "fleet")."""
        out: dict[str, list[str]] = {}
        for b in self.books.values():
            if b.role != "trainer" and b.peering.fetch_role(b) in ("region", "fleet"):
                out.setdefault(b.region, []).append(b.node)
        return out

    def gateways(self) -> dict[str, list[str]]:
        """region -> nodes that elect themselves its gateway."""
        out: dict[str, list[str]] = {}
        for b in self.books.values():
            if b.role != "trainer" and b.node in {m.node for m in
                                                  b.peering.elect(b).get(b.region, [])}:
                out.setdefault(b.region, []).append(b.node)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regions", type=int, default=20)
    ap.add_argument("--per-region", type=int, default=30)
    ap.add_argument("--max-peers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    fleet = Fleet(args.regions, args.per_region, args.max_peers, args.seed)
    for _ in range(args.rounds):
        fleet.round()
    fetchers, gateways = fleet.fetchers(), fleet.gateways()
    regions = [f"r{i}" for i in range(args.regions)]
    out = {"nodes": args.regions * args.per_region, "regions": args.regions,
           "max_peers": args.max_peers, "rounds": args.rounds,
           "fetchers_per_region": [len(fetchers.get(r, [])) for r in regions],
           "gateways_per_region": [len(gateways.get(r, [])) for r in regions],
           "largest_book": max(len(b.peers) for b in fleet.books.values()),
           "agreed": all(len(fetchers.get(r, [])) == 1 and len(gateways.get(r, [])) == 1
                         for r in regions),
           "seconds": round(time.monotonic() - t0, 1)}
    print(f"{out['nodes']} nodes in {args.regions} regions, books of {args.max_peers}, "
          f"{args.rounds} index reads each: fetchers per region {out['fetchers_per_region']}, "
          f"gateways per region {out['gateways_per_region']}, largest book "
          f"{out['largest_book']}; every view agrees: {out['agreed']}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
