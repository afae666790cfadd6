"""The fleet from one place, with real daemons: a trainer, region `east` (r1, bootstraps from the
trainer) and region `west` (r2, bootstraps from r1 only). r2's reports reach the trainer through
r1, and `deltaswarm status --fleet --json` on the trainer shows both regions with the versions
they hold, their lag in versions and seconds, and bytes per link class; a node that stops shows
as behind and stale, and catches up when it returns. A token holder announcing r1's URL cannot
report as r1."""

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import ROOT, TOKEN, Cluster, http, step, tiny_model
from tests.support import wait_until

FLEET = {"interval_s": 1, "forget_s": 60}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root: Path = tmp_path_factory.mktemp("fleet")
    with Cluster(root) as c:
        c.trainer(fleet=FLEET)
        r1 = c.region("r1", region="east", fleet=FLEET)
        c.region("r2", bootstrap=[r1.url], region="west", fleet=FLEET)
        c.start_all()
        state = tiny_model(0)
        c.publish(0, state)
        c.publish(1, step(state, 1))
        c.wait_all_at(1, 90)
        c.state = step(step(state, 1), 2)  # type: ignore[attr-defined]
        yield c


def fleet_json(c: Cluster) -> dict:
    """What an operator runs on the trainer: `deltaswarm status --fleet --nodes --json`."""
    out = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "status", "--fleet", "--nodes", "--json", "--url",
         c.daemons["trainer"].url, "--token", TOKEN],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def nodes(view: dict) -> dict[str, dict]:
    return {n["node"]: n | {"region_name": region}
            for region, r in view["regions"].items() for n in r["nodes"]}


def wait_view(c: Cluster, pred, what: str, timeout: float = 30.0) -> dict:
    seen: dict = {}

    def ok() -> bool:
        seen["view"] = fleet_json(c)
        return pred(nodes(seen["view"]))

    try:
        wait_until(ok, timeout, what, interval=0.5)
    except AssertionError:
        print(json.dumps(seen.get("view"), indent=1)[:6000])
        raise
    return seen["view"]


def test_the_trainer_sees_both_regions_through_the_chain_with_versions_and_lag(
        cluster: Cluster) -> None:
    view = wait_view(cluster, lambda n: {"r1", "r2"} <= set(n) and all(
        n[x]["version"] == 1 and not n[x]["stale"] for x in ("r1", "r2")), "r1 and r2 at v1")
    assert view["head"] == 1 and {"east", "west", "trainer"} <= set(view["regions"])
    n = nodes(view)
    assert n["r1"]["region_name"] == "east" and n["r2"]["region_name"] == "west"
    assert n["r1"]["via"] is None and n["r2"]["via"] == "r1"  # r2 reports only to r1
    for name in ("r1", "r2"):
        assert (n[name]["lag_versions"], n[name]["lag_s"]) == (0, 0.0)
        assert n[name]["since"] is not None and n[name]["since"] <= view["time"]
    assert n["trainer"]["self"] is True and n["trainer"]["version"] == 1
    east = view["regions"]["east"]
    assert (east["node_count"], east["at_head"], east["min_version"]) == (1, 1, 1)
    # status builds its own view (at most 1 s old), where r2's entry, two hops of reports
    # away, can be stale for a moment: the summary must show it at head, not at once
    trainer = cluster.daemons["trainer"]
    wait_until(lambda: trainer.status()["fleet"]["regions"]["west"]["at_head"] == 1, 30,
               "the trainer's status to count west's node at head", interval=0.5)


def test_bytes_are_counted_per_link_class_from_each_nodes_view(cluster: Cluster) -> None:
    def classified(n: dict) -> bool:
        return all(x in n and n[x]["links"]["unknown"]["bytes_in"] == 0
                   and n[x]["links"]["trainer"]["bytes_in"] + n[x]["links"]["cross"]["bytes_in"]
                   > 0 for x in ("r1", "r2"))

    n = nodes(wait_view(cluster, classified, "r1 and r2 to classify every byte they fetched"))
    for name in ("r1", "r2"):
        assert n[name]["links"]["intra"]["bytes_in"] == 0  # alone in its region
    assert n["trainer"]["links"]["trainer"]["bytes_out"] > 0
    assert sum(n["trainer"]["links"][c]["bytes_out"] for c in ("intra", "cross", "unknown")) == 0


def test_a_stopped_region_shows_behind_and_stale_then_catches_up(cluster: Cluster) -> None:
    r2 = cluster.daemons["r2"]
    r2.stop()
    cluster.publish(2, cluster.state)  # type: ignore[attr-defined]
    cluster.wait_all_at(2, 60, names=["r1"])
    view = wait_view(cluster, lambda n: n["r2"]["stale"] and n["r1"]["version"] == 2,
                     "r2 to go stale at v1 while r1 reaches v2")
    n = nodes(view)
    assert n["r2"]["version"] == 1 and n["r2"]["lag_versions"] == 1 and n["r2"]["lag_s"] > 0
    assert view["regions"]["west"]["max_lag_versions"] is None  # only stale nodes there
    assert view["regions"]["west"]["stale"] == 1
    r2.start()
    r2.wait_ready()
    cluster.wait_all_at(2, 60, names=["r2"])
    wait_view(cluster, lambda n: n["r2"]["version"] == 2 and n["r2"]["lag_versions"] == 0
              and not n["r2"]["stale"], "r2 to report v2 again")


def test_a_token_holder_cannot_report_as_another_node(cluster: Cluster) -> None:
    r1 = cluster.daemons["r1"]
    fake = {"reports": [{"node": "r1", "region": "east", "role": "region", "url": r1.url,
                         "version": 0}]}
    code, body, _ = http_with_header(cluster, fake, f"{r1.url} - r1")
    assert code == 403 and b"must be signed by its node's identity key" in body
    code, body, _ = http_with_header(cluster, fake, "http://127.0.0.250:9 - r1")
    assert code in (400, 403)
    code, body, _ = http_with_header(cluster, {"reports": [{"node": "x"}]}, f"{r1.url} - r1")
    assert code == 403 and b"must be signed" in body  # the sender is checked before parsing
    n = nodes(fleet_json(cluster))
    assert n["r1"]["version"] != 0


def http_with_header(c: Cluster, doc: dict, announce: str) -> tuple[int, bytes, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"{c.daemons['trainer'].url}/v1/fleet/report", data=json.dumps(doc).encode(),
        method="POST", headers={"Authorization": f"Bearer {TOKEN}",
                                "Content-Type": "application/json",
                                "X-Deltaswarm-Peer": announce})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_the_fleet_routes_need_the_token_and_metrics_show_regions_only_with_it(
        cluster: Cluster) -> None:
    url = cluster.daemons["trainer"].url
    assert http(f"{url}/v1/fleet", token=None)[0] == 401
    assert http(f"{url}/v1/fleet/sent/{'0' * 64}", token=None)[0] == 401
    code, open_text, _ = http(f"{url}/metrics", token=None)
    assert code == 200 and b"deltaswarm_fleet_" not in open_text
    code, text, _ = http(f"{url}/metrics")
    assert code == 200 and b'deltaswarm_fleet_nodes{region="west"} 1.0' in text
    assert b"deltaswarm_current_version" in text and b'"r2"' not in text
