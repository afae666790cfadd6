"""The trainer's control plane stays flat in the number of nodes (issue 21, item 1), between real
daemons on loopback: a region of three nodes learns each new version's manifest and torrent
from its own gateway, so the trainer serves each version's manifest and torrent about once for
the whole region instead of once per node, and every node still ends on the trainer's digest.

On the old code every node asked the trainer (first in `by_head` order, FANOUT at a time) for
both files: 3 manifests and 3 torrents per version here; the bound below allows one of each per
version plus one spare. The members also stop long-polling the trainer's head (they hear it from
their region's fetcher), and still every node ends on the trainer's digest.
"""

from daemon.observe.served import route_counts
from daemon.peering.names import rank
from tests.integration.harness import Cluster, http, step, tiny_model
from tests.support import wait_until

EU = ["eu1", "eu2", "eu3"]
ROUTES = ("/v1/chain/manifests/{artifact}", "/v1/chain/torrents/{artifact}")


def served(trainer) -> dict[str, float]:
    _, text, _ = http(f"{trainer.url}/metrics")
    got = route_counts(text.decode(), "deltaswarm_http_responses")
    return {r: got.get(r, 0.0) for r in ROUTES}


def test_a_region_takes_new_versions_from_one_member_not_the_trainer(tmp_path) -> None:
    with Cluster(tmp_path) as c:
        trainer = c.trainer(region="tr")
        for name in EU:
            c.region(name, region="eu")
        c.start_all()
        state = tiny_model(0, tensors=6, rows=64, cols=256)
        c.publish(0, state, snapshot=True)
        c.wait_all_at(0, 120)

        def knows_region() -> bool:  # fetch roles are computed from each node's own book
            return all(sum(p["region"] == "eu" and p["bt"] and (p["bootstrap"] or p["proven"])
                           for p in c.daemons[n].get("/v1/peers")["peers"]) == 2 for n in EU)

        wait_until(knows_region, 60, "every eu node to know the two others with their region")
        before = served(trainer)
        versions = 3
        for v in range(1, versions + 1):
            state = step(state, v, density=0.02)
            c.publish(v, state)
            c.wait_all_at(v, 60)
        after = served(trainer)
        took = {r: after[r] - before[r] for r in ROUTES}
        assert all(n <= versions + 1 for n in took.values()), took
        asked = [c.daemons[n].status()["sync"].get("control_asked", {}) for n in EU]
        assert sum(a.get("region", 0) for a in asked) >= 2 * versions, asked
        digest = trainer.status()["state_digest"]
        assert all(c.daemons[n].status()["state_digest"] == digest for n in EU)
        # a sync step's index read leaves out the peer list (it grows with the fleet)
        _, body, _ = http(f"{trainer.url}/v1/chain/index?peers=0")
        _, full, _ = http(f"{trainer.url}/v1/chain/index")
        assert b'"peers": []' in body and b'"node": "eu1"' in full


def test_only_the_fleets_fetcher_watches_the_trainer_and_reports_come_per_region(tmp_path) -> None:
    """Two regions: once every node knows the others, the trainer's head long-polls come from
    one node of the fleet (the fleet's fetcher; each other region's fetcher hears heads from
    it), and every member's fleet report reaches the trainer through its region's fetcher
    (aggregated there), so neither grows with the number of nodes or regions. On the code
    before, every region's fetcher polled the trainer and every node reported to it."""
    regions = {"eu": ["eu1", "eu2", "eu3"], "us": ["us1", "us2", "us3"]}
    fleet = {"interval_s": 1.0, "forget_s": 30.0}
    with Cluster(tmp_path) as c:
        trainer = c.trainer(region="tr", fleet=fleet)
        for region, names in regions.items():
            for name in names:
                c.region(name, region=region, fleet=fleet)
        c.start_all()
        state = tiny_model(0, tensors=6, rows=64, cols=256)
        c.publish(0, state, snapshot=True)
        c.wait_all_at(0, 120)
        version = 0

        def pollers() -> set[str]:  # each poll renews its node's entry; the fleet's fetcher
            # re-polls as soon as a version lands (the check runs just after one)
            nodes = trainer.status()["retention"]["nodes"]
            return {n["node"] for n in nodes if n["seen_s_ago"] <= 3.0}

        def via() -> dict[str, str | None]:
            rows = [row for reg in trainer.get("/v1/fleet")["regions"].values()
                    for row in reg["nodes"]]
            return {row["node"]: row["via"] for row in rows if row["role"] == "region"}

        def settled() -> bool:
            nonlocal state, version
            version += 1  # keep versions coming: nodes learn their peers from them too
            state = step(state, version, density=0.02)
            c.publish(version, state)
            c.wait_all_at(version, 60)
            hops = via()
            if len(hops) < 6 or len(pollers()) != 1:  # a glance (timeout=0) also counts
                return False
            for names in regions.values():  # each region reports through one of its own
                relays = {hops[n] or n for n in names}
                if len(relays) != 1 or not relays <= set(names):
                    return False
            return True

        wait_until(settled, 120, "one trainer poller and reports through each region's fetcher",
                   interval=0.5)
        # the trainer counts the fleet for those that glance at it seldom (Syncer.glance_s)
        assert trainer.get("/v1/chain/head?timeout=0")["nodes"] == 6

        # and every node relays that count, so a node that hears the trainer through it paces
        # its glances by the fleet's size from its first reply (Syncer.trainer_fleet)
        def relayed() -> bool:
            nonlocal state, version
            version += 1
            state = step(state, version, density=0.02)
            c.publish(version, state)
            c.wait_all_at(version, 60)
            return all(c.daemons[n].get("/v1/chain/head?timeout=0").get("trainer_nodes") == 6
                       for names in regions.values() for n in names)

        wait_until(relayed, 60, "every region node relays the trainer's count", interval=0.5)
        digest = trainer.status()["state_digest"]
        assert all(c.daemons[n].status()["state_digest"] == digest
                   for names in regions.values() for n in names)


def test_a_region_larger_than_its_nodes_books_still_has_one_fetcher(tmp_path) -> None:
    """Six nodes of one region whose peer books hold two peers (`max_peers: 2`, the trainer
    among them): each book keeps the region's first-ranked members beyond that (anchors), so
    every node agrees on one fetcher and the trainer still serves each version's manifest and
    torrent about once. On the code before, a full book took no newcomer: each node knew the
    trainer and one other member, and every node that knew no better-ranked member fetched
    for the region itself (the wait below timed out)."""
    names = [f"eu{i}" for i in range(1, 7)]
    first = min(names, key=lambda n: rank("eu", n))
    with Cluster(tmp_path) as c:
        trainer = c.trainer(region="tr")
        for name in names:
            c.region(name, region="eu", max_peers=2)
        c.start_all()
        state = tiny_model(0, tensors=6, rows=64, cols=256)
        c.publish(0, state, snapshot=True)
        c.wait_all_at(0, 120)

        def first_known() -> bool:
            return all(any(p["node"] == first and p["bt"] and p["proven"]
                           for p in c.daemons[n].get("/v1/peers")["peers"])
                       for n in names if n != first)

        wait_until(first_known, 90, f"every eu node to hold {first}, eu's first by rank")
        before = served(trainer)
        versions = 3
        for v in range(1, versions + 1):
            state = step(state, v, density=0.02)
            c.publish(v, state)
            c.wait_all_at(v, 60)
        took = {r: served(trainer)[r] - before[r] for r in ROUTES}
        assert all(n <= versions + 1 for n in took.values()), took
        books = [len(c.daemons[n].get("/v1/peers")["peers"]) for n in names]
        assert max(books) <= 2 + 2 + 1, books  # max_peers, eu's two anchors, the trainer
        digest = trainer.status()["state_digest"]
        assert all(c.daemons[n].status()["state_digest"] == digest for n in names)
