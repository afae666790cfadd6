"""Prometheus exposition of NodeStatus: names, types, labels, private registries, no peer
addresses or names without the token, and a real aiohttp /metrics endpoint scraped over loopback
in both exposition formats."""

import aiohttp
from aiohttp import web
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from daemon.observe.metrics import build_registry, metrics_handler, render
from daemon.observe.status import (
    Ban,
    EngineStatus,
    NodeStatus,
    Peer,
    RefusedManifest,
    SpoolStatus,
    Totals,
    Transfer,
    Verification,
)


class Node:
    """Stands in for daemon.observe.report: a status the test can change between scrapes."""

    def __init__(self, node: str = "eu-1"):
        self.status = NodeStatus(
            node=node, region="eu", current_version=6, head_version=8, state_digest="ab" * 16,
            versions=[Transfer(artifact="v00000007.delta", version=7, total_bytes=4000,
                               tensor_bytes=1000, file_bytes=3000, done_bytes=1000, peers=3)],
            peers=[Peer(bt_endpoint="10.0.0.2:6881", node="us-1", bytes_down=700,
                        bytes_up=300)],
            totals=Totals(bytes_up=300, bytes_down=700, tensor_bytes=1000, file_bytes=2000,
                          new_file_bytes=500, full_tensor_bytes=98_000, versions_applied=1),
            verification=Verification(failures_by_kind={"piece": 2, "block": 1}),
            bans=[Ban(endpoint="10.0.0.9:6881", artifact="v00000001.delta",
                 reason="bad piece", since=1.0, expires=2.0)],
            refused_manifests=[RefusedManifest(kind="unsigned", reason="no signature", at=1.0)],
            refused_by_kind={"unsigned": 1},
            engine=EngineStatus(notifications=1, last_version=6),
            spool=SpoolStatus(depth=4, bytes=4096, forwarded=10),
        )

    def snapshot(self) -> NodeStatus:
        return self.status.model_copy(deep=True)


def board(node: str = "eu-1") -> Node:
    return Node(node)


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str, **labels) -> float:
    for fam in fams.values():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name} {labels} not exposed")


def test_exposes_versions_lag_and_totals():
    body, ctype = render(build_registry(board().snapshot))
    fams = families(body.decode())
    assert ctype.startswith("text/plain; version=0.0.4")
    assert value(fams, "deltaswarm_current_version") == 6
    assert value(fams, "deltaswarm_head_version") == 8
    assert value(fams, "deltaswarm_lag_versions") == 2
    assert value(fams, "deltaswarm_saved_bytes") == 97_000
    # tensors and carried files apart; the old sums stay, files in both
    assert value(fams, "deltaswarm_tensor_bytes_total") == 1000
    assert value(fams, "deltaswarm_full_tensor_bytes_total") == 98_000
    assert value(fams, "deltaswarm_carried_file_bytes_total") == 2000
    assert value(fams, "deltaswarm_new_carried_file_bytes_total") == 500
    assert value(fams, "deltaswarm_payload_bytes_total") == 3000
    assert value(fams, "deltaswarm_full_checkpoint_bytes_total") == 100_000
    assert value(fams, "deltaswarm_received_bytes_total") == 700
    assert value(fams, "deltaswarm_node_info", node="eu-1", region="eu", role="region") == 1


def test_counters_and_gauges_have_the_right_types():
    fams = families(render(build_registry(board().snapshot))[0].decode())
    counters = {"deltaswarm_sent_bytes", "deltaswarm_received_bytes",
                "deltaswarm_verification_failures", "deltaswarm_refused_manifests",
                "deltaswarm_engine_notifications", "deltaswarm_spool_forwarded",
                "deltaswarm_transfer_sent_bytes"}
    gauges = {"deltaswarm_current_version", "deltaswarm_lag_versions", "deltaswarm_spool_depth",
              "deltaswarm_transfer_done_bytes", "deltaswarm_banned_peers",
              "deltaswarm_download_bytes_per_second", "deltaswarm_uptime_seconds"}
    for name in counters:
        assert fams[name].type == "counter", name
    for name in gauges:
        assert fams[name].type == "gauge", name
    assert all(name.startswith("deltaswarm_") for name in fams)


def test_labels_per_artifact_peer_and_kind():
    fams = families(render(build_registry(board().snapshot, peers=True))[0].decode())
    art = "v00000007.delta"
    assert value(fams, "deltaswarm_transfer_done_bytes", artifact=art) == 1000
    assert value(fams, "deltaswarm_transfer_size_bytes", artifact=art) == 4000
    assert value(fams, "deltaswarm_transfer_tensor_bytes", artifact=art) == 1000
    assert value(fams, "deltaswarm_transfer_carried_file_bytes", artifact=art) == 3000
    assert value(fams, "deltaswarm_transfer_state", artifact=art, state="fetching") == 1
    assert value(fams, "deltaswarm_transfer_state", artifact=art, state="current") == 0
    assert value(fams, "deltaswarm_peer_received_bytes_total", peer="10.0.0.2:6881",
                 peer_node="us-1") == 700
    assert value(fams, "deltaswarm_verification_failures_total", kind="piece") == 2
    assert value(fams, "deltaswarm_verification_failures_total", kind="block") == 1
    assert value(fams, "deltaswarm_refused_manifests_total", kind="unsigned") == 1


def test_lag_is_absent_while_the_node_holds_no_version():
    fams = families(render(build_registry(lambda: NodeStatus(head_version=3)))[0].decode())
    assert "deltaswarm_lag_versions" not in fams
    assert "deltaswarm_current_version" not in fams
    assert value(fams, "deltaswarm_head_version") == 3


def test_each_scrape_reads_a_fresh_snapshot():
    b = board()
    reg = build_registry(b.snapshot)
    before = families(render(reg)[0].decode())
    b.status.current_version = 8
    b.status.totals.bytes_down += 300
    after = families(render(reg)[0].decode())
    assert value(before, "deltaswarm_lag_versions") == 2
    assert value(after, "deltaswarm_lag_versions") == 0
    assert value(after, "deltaswarm_received_bytes_total") == 1000


def test_two_nodes_in_one_process_have_separate_registries():
    a, b = board("eu-1"), board("us-1")
    b.status.current_version = 8
    ra, rb = build_registry(a.snapshot), build_registry(b.snapshot)
    fa, fb = families(render(ra)[0].decode()), families(render(rb)[0].decode())
    assert value(fa, "deltaswarm_current_version") == 6
    assert value(fb, "deltaswarm_current_version") == 8
    assert REGISTRY.get_sample_value("deltaswarm_current_version") is None


def test_open_exposition_names_no_peer_address_or_peer_node():
    text = render(build_registry(board().snapshot))[0].decode()
    for secret in ("10.0.0.2", "us-1", "10.0.0.9"):
        assert secret not in text, secret
    fams = families(text)
    assert value(fams, "deltaswarm_peers") == 1 and value(fams, "deltaswarm_banned_peers") == 1
    assert value(fams, "deltaswarm_received_bytes_total") == 700


async def scrape(url: str, **headers: str) -> tuple[str, str]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        assert r.status == 200
        return await r.text(), r.headers["Content-Type"]


async def serve_metrics(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"


async def test_metrics_endpoint_serves_text_and_openmetrics():
    runner, url = await serve_metrics(metrics_handler(board().snapshot))
    try:
        text, ctype = await scrape(url)
        om, om_type = await scrape(url, Accept="application/openmetrics-text; version=1.0.0")
    finally:
        await runner.cleanup()
    assert ctype.startswith("text/plain; version=0.0.4")
    assert value(families(text), "deltaswarm_current_version") == 6
    assert om_type.startswith("application/openmetrics-text")
    assert om.rstrip().endswith("# EOF")
    assert "deltaswarm_verification_failures_total{kind=\"piece\"} 2.0" in om


async def test_per_peer_series_only_for_a_scrape_with_the_token():
    runner, url = await serve_metrics(metrics_handler(board().snapshot, token="secret-token"))
    try:
        anonymous, _ = await scrape(url)
        wrong, _ = await scrape(url, Authorization="Bearer nope")
        authed, _ = await scrape(url, Authorization="Bearer secret-token")
    finally:
        await runner.cleanup()
    assert "10.0.0.2" not in anonymous and "us-1" not in anonymous
    assert "10.0.0.2" not in wrong
    assert value(families(authed), "deltaswarm_peer_received_bytes_total",
                 peer="10.0.0.2:6881", peer_node="us-1") == 700
