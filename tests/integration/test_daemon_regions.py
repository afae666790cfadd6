"""Region-aware peering between real daemons on loopback (no namespaces needed): regions travel
in announcements and indexes, every node of a region elects the same single gateway, and a node
that is not its region's gateway fetches the version from its own region only."""

from tests.integration.harness import Cluster, tiny_model
from tests.support import wait_until


def test_only_the_gateway_fetches_across_and_the_others_fetch_in_region(tmp_path):
    with Cluster(tmp_path) as c:
        c.trainer(region="eu")
        for name, region in (("us1", "us"), ("us2", "us"), ("us3", "us"), ("ap1", "ap")):
            c.region(name, region=region)
        c.start_all()
        names = ["us1", "us2", "us3", "ap1"]

        def meshed() -> bool:
            for n in names:
                peers = c.daemons[n].get("/v1/peers")["peers"]
                known = [p for p in peers if p["region"] and p["bt"]
                         and (p["bootstrap"] or p["proven"])]
                if len(known) < len(names):
                    return False
            return True

        wait_until(meshed, 60, "every node to know every other with its region")
        state = tiny_model(tensors=8)
        c.publish(0, state)
        c.wait_all_at(0, 90, names)

        st = {n: c.daemons[n].status() for n in names}
        views = {n: s["region_peering"]["gateways"] for n, s in st.items()}
        us_views = [views[n]["us"] for n in ("us1", "us2", "us3")]
        assert all(v == us_views[0] and len(v) == 1 for v in us_views), views
        gateway = us_views[0][0]
        assert views["ap1"]["ap"] == ["ap1"] and views["ap1"]["us"] == [gateway]
        assert st["ap1"]["region_peering"]["gateway"]
        for n in ("us1", "us2", "us3"):
            rp = st[n]["region_peering"]
            assert rp["gateway"] == (n == gateway), (n, rp)
            if n != gateway:
                assert rp["bytes"]["cross"]["down"] == 0, (n, rp)
                assert rp["bytes"]["local"]["down"] > 0, (n, rp)
        digest = c.daemons["us1"].status()["state_digest"]
        assert all(s["state_digest"] == digest for s in st.values())
