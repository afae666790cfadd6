"""Gateways earn their role (issue 20, finding 4), between real daemons on loopback.

1. A token holder runs a node of region eu (a real daemon with its own identity key) whose name
   ranks first in the election and whose BitTorrent uplink is held to 1 byte/s. On the old code
   both eu nodes elected it and waited for the stall timeout
   on every version; now it is passed over within `gateway_deadline_s` (2 s here) and never
   elected once the eu nodes have served each other, so versions keep reaching eu promptly.
2. Another token holder tries to rewrite the eu gateway's region in the other eu node's book
   (X-Deltaswarm-Region on its own requests, naming the gateway): the book keeps the region the
   gateway signs for itself, and the node still elects the gateway instead of electing itself
   and pulling across regions.

Bounds: `sync.progress_timeout_s` is 120 s, so the old stall path needs >= 120 s per version;
each version after the first is given 60 s here (30 times the 2 s deadline; it takes a second
or two), the first 240 s (its apply waits for the codec warm-up on a loaded machine).
"""

import contextlib
import threading
import urllib.request

from daemon.peering.peers import HEADER, REGION_HEADER
from tests.integration.harness import (
    TOKEN,
    Cluster,
    http,
    step,
    tiny_model,
)
from tests.support import wait_until
from tests.unit.daemon.peering.test_regions import fake_first

REGION = {"sync": {"progress_timeout_s": 120},
          "region_peering": {"gateway_deadline_s": 2.0}}


def announce(url: str, header: str, region: str) -> None:
    """One authenticated request carrying a peer announcement, as any token holder can send."""
    req = urllib.request.Request(f"{url}/v1/peers", headers={
        "Authorization": f"Bearer {TOKEN}", HEADER: header, REGION_HEADER: region})
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()


def knows(d, node: str, region: str) -> bool:
    return any(p["node"] == node and p["region"] == region and (p["bootstrap"] or p["proven"])
               and p["bt"] for p in d.get("/v1/peers")["peers"])


def start_eu(c: Cluster) -> list[str]:
    c.trainer(region="tr")
    for name in ("eu1", "eu2"):
        c.region(name, region="eu", **REGION)
    c.start_all()
    eu = ["eu1", "eu2"]
    wait_until(lambda: all(knows(c.daemons[a], b, "eu") and knows(c.daemons[a], "trainer", "tr")
                           for a in eu for b in eu if a != b),
               60, "the eu nodes to know each other and the trainer with their regions")
    return eu


def test_a_silent_first_ranking_gateway_is_passed_over_and_versions_keep_coming(tmp_path):
    with Cluster(tmp_path) as c:
        eu = start_eu(c)
        fake = fake_first("eu", eu)
        # The token holder runs a real daemon (its own identity key, so its claims are
        # believed) under a first-ranking name, whose BitTorrent uplink is held to 1 byte/s:
        # it never delivers what a gateway must.
        d = c.region(fake, bootstrap=[c.daemons[n].url for n in eu], region="eu",
                     limits={"upload_bytes_per_s": 1}, **REGION)
        d.start()
        d.wait_ready()
        for n in eu:
            wait_until(lambda n=n: knows(c.daemons[n], fake, "eu"), 60,
                       f"{n} to take the fake {fake} as a proven eu node")
        # nobody has served yet, so the first-ranking name wins the election once it has
        # ranked best for a deadline (daemon/peering/regions.py _settle): the attack's premise
        for n in eu:
            wait_until(lambda n=n: c.daemons[n].status()["region_peering"]["gateways"]["eu"]
                       == [fake], 30, f"{n} to elect the fake {fake}")
        state = tiny_model(tensors=8)
        c.publish(0, state)
        c.wait_all_at(0, 240, eu)  # the first apply waits for the codec warm-up
        for v in (1, 2, 3):
            state = step(state, v)
            c.publish(v, state)
            c.wait_all_at(v, 60, eu)
        st = {n: c.daemons[n].status()["region_peering"] for n in eu}
        for n, rp in st.items():
            assert fake not in rp["gateways"]["eu"], (n, rp)
            cand = {x["node"]: x for x in rp["candidates"]}
            assert fake not in cand or not cand[fake]["served"], (n, rp)
        demoted = [d for rp in st.values() for d in rp["demoted"] if d["node"] == fake]
        assert demoted and all(d["reason"] and d["since"] for d in demoted), st
        metrics = http(f"{c.daemons[eu[0]].url}/metrics", token=None)[1].decode()
        assert "deltaswarm_gateway_demotions_total" in metrics


def test_a_rewritten_region_in_the_book_does_not_make_a_node_elect_itself(tmp_path):
    with Cluster(tmp_path) as c:
        eu = start_eu(c)
        state = tiny_model(tensors=8)
        c.publish(0, state)
        c.wait_all_at(0, 240, eu)  # the first apply waits for the codec warm-up
        views = {n: c.daemons[n].status()["region_peering"]["gateways"]["eu"] for n in eu}
        assert views["eu1"] == views["eu2"] and len(views["eu1"]) == 1, views
        gw = views["eu1"][0]
        other = next(n for n in eu if n != gw)
        g, e = c.daemons[gw], c.daemons[other]
        forged = f"{g.url} {g.host}:{g.bt_port} {gw}"
        log_from = len(e.log_path.read_bytes())
        stop = threading.Event()

        sent = []

        def forge() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    announce(e.url, forged, "mallory region")
                    sent.append(1)
                stop.wait(0.05)

        t = threading.Thread(target=forge, daemon=True)
        t.start()
        seen = []
        try:
            wait_until(lambda: len(sent) >= 20, 30, "20 forged announcements to be accepted")
            # unsigned by the gateway's key, they are hints: the book keeps the region the
            # gateway gives itself (before node identity they rewrote it to 'mallory')
            regions = {p["region"] for p in e.get("/v1/peers")["peers"] if p["node"] == gw}
            assert regions == {"eu"}, regions
            for v in (1, 2):
                state = step(state, v)
                c.publish(v, state)
                for _ in range(10):
                    seen.append(e.status()["region_peering"])
                c.wait_all_at(v, 60, eu)
        finally:
            stop.set()
            t.join(5)
        assert not any(rp["gateway"] for rp in seen), [rp["gateways"] for rp in seen]
        assert all(rp["gateways"]["eu"] == [gw] for rp in seen), [rp["gateways"] for rp in seen]
        new_log = e.log_path.read_bytes()[log_from:].decode(errors="replace")
        assert "(this node is one)" not in new_log, new_log[-3000:]
