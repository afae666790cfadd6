"""Retention that knows who is behind (issue 11, finding 4), with real daemons: a region seen at
v1 keeps its cheap path (deltas from v1) through the trainer's daemon being killed and restarted
while the publisher goes on, under a short retention window; the trainer's status says for whom
it kept them."""

from chain.policy import Retention, SnapshotPolicy
from tests.integration.harness import Cluster, step, tiny_model
from tests.support import wait_until


def test_a_region_behind_reaches_the_head_by_deltas_through_a_trainer_restart(tmp_path):
    with Cluster(tmp_path) as c:
        t = c.trainer(retention={"versions": 2})
        r1 = c.region("r1")
        c.start_all()
        pub = c.publisher()
        pub.retention = Retention(versions=2)  # the trainer's own short window (issue 11 run: 4)
        state = tiny_model()
        c.publish(0, state, snapshot=True)
        state = step(state, 1)
        c.publish(1, state)
        c.wait_all_at(1, 60)
        # r1's head polls tell the trainer what it holds; retention reads them on each publish
        wait_until(lambda: {"node": "r1", "region": "r1", "have": 1} in [
            {k: n[k] for k in ("node", "region", "have")}
            for n in t.status()["retention"]["nodes"]], 20, "the trainer to hear r1 holds v1")
        r1.stop()  # r1 is behind now; the trainer saw it live at v1 moments ago

        for v in range(2, 5):
            state = step(state, v)
            c.publish(v, state)
        t.kill9()
        for v in range(5, 9):  # the daemon is down; the publisher goes on
            state = step(state, v)
            pub.snapshots = SnapshotPolicy(every=1 if v == 5 else 1000)
            assert not pub.publish(v, state).notified
        pub.snapshots = SnapshotPolicy(every=1000)
        t.start()
        t.wait_ready()
        state = step(state, 9)
        c.publish(9, state)
        ret = t.status()["retention"]
        assert ret["kept_for"] == [1] and ret["fell_back"] == [], ret
        assert 0 < ret["used_bytes"] <= ret["budget_bytes"]

        r1.start()
        r1.wait_ready()
        c.wait_all_at(9, 60)
        applied = [a["artifact"] for a in r1.status()["detail"]["sync"]["applied"]]
        assert applied == [f"v{v:08d}.delta" for v in range(2, 10)], applied
