"""A version the publisher wrote while the trainer's daemon could not be told (down, starting, or
the notify failing) is seeded on the next publish (issue 11 chaos finding: the daemon scans the
chain dir before it listens, the publisher's notify failed, and the next publish seeded only its
own version, so regions could never get the missed one). Real daemons, real publisher."""

from tests.integration.harness import Cluster, free_port, step, tiny_model


def test_a_version_whose_notify_failed_is_seeded_by_the_next_publish(tmp_path):
    with Cluster(tmp_path) as c:
        t = c.trainer()
        c.start_all()
        pub = c.publisher()
        state = tiny_model()
        c.publish(0, state, snapshot=True)

        url = pub.daemon_url
        pub.daemon_url = f"http://{t.host}:{free_port(t.host)}"  # nobody listens: notify fails
        state = step(state, 1)
        assert not pub.publish(1, state).notified
        pub.daemon_url = url
        assert "v00000001.delta" not in t.get("/v1/chain/index")["seeding"]

        state = step(state, 2)
        out = c.publish(2, state)
        assert out.notified
        index = t.get("/v1/chain/index")
        want = {"v00000000.snapshot", "v00000001.delta", "v00000002.delta"}
        assert want <= set(index["seeding"]), index["seeding"]
        assert want <= set(index["artifacts"]) and index["head"] == 2
        assert "v00000001.delta" in t.status()["detail"]["caught_up"]

        # Served, not just listed: a region joining now follows v0 → v1 → v2 from the trainer.
        c.region("r1")
        c.start_all()
        c.wait_all_at(2, 60)
