"""What the fleet view costs the trainer's daemon at 100 regions x 100 nodes, measured on a real
daemon process, and the figures docs/SCALE.md derives from them.

Starts one trainer daemon (tests/integration/harness.py) and a stand-in region gateway (an
aiohttp server that answers the hello challenge with its identity key like a daemon; every
entry is signed by its own node's key and every report by the gateway's,
daemon/peering/identity.py),
then POSTs fleet reports the way a gateway forwards its region: one report holding the whole
fleet (`--nodes` entries over `--regions` regions), and a run of one-entry reports (what every
node reporting straight to the trainer would cost). Prints bytes per entry; the trainer's wall
time and its own CPU seconds (/proc, so a loaded host does not inflate them) per report and per
entry; its RSS before and after; the size and time of GET /v1/fleet; and, in this process,
validation time and board memory per entry and the sizes of a 1 TB model's manifests.

    python bench/fleet.py                      # 10,000 nodes in 100 regions, ~1 min
    python bench/fleet.py --nodes 1000 --json
"""

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: E402
    Ed25519PrivateKey,
)

from chain.digest import state_digest  # noqa: E402
from chain.manifest import Manifest, canonical_json  # noqa: E402
from daemon.fleet.board import NodeReport  # noqa: E402
from daemon.peering.identity import SIG_HEADER, NodeKey  # noqa: E402
from daemon.peering.peer_client import hello_proof  # noqa: E402
from tests.integration.harness import TOKEN, Cluster, free_port  # noqa: E402

GW_HOST = "127.0.0.77"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used: its cost, whatever else loads the host."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


KEYS: dict[str, NodeKey] = {}


def signed(doc: dict) -> dict:
    """`doc` signed now by its node's key (made once per node name)."""
    key = KEYS.get(doc["node"]) or KEYS.setdefault(
        doc["node"], NodeKey(Ed25519PrivateKey.generate(), doc["node"]))
    return key.sign_entry({k: v for k, v in doc.items() if k != "sig"})


def entries(nodes: int, regions: int, gw_url: str) -> list[dict]:
    """The gateway's own entry, then one forwarded entry per other node, with realistic
    counters (terabytes moved, long uptimes) so the JSON is as long as it gets; each signed
    by its node."""
    big = {"bytes_in": 987_654_321_012, "bytes_out": 123_456_789_012}
    links = {c: big for c in ("intra", "cross", "trainer", "unknown")}
    out = [NodeReport(node="gw", region="region-000", role="region", url=gw_url, version=41,
                      held_s=12.5, head=42, links=links,
                      trajectories_waiting=1234).model_dump(mode="json")]
    for i in range(1, nodes):
        out.append(NodeReport(
            node=f"node-{i:05d}.region-{i % regions:03d}", region=f"region-{i % regions:03d}",
            role="region", url=f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8700",
            version=41, held_s=12.5, head=42, age_s=3.2, hops=1, links=links,
            trajectories_waiting=1234).model_dump(mode="json"))
    return [signed(d) for d in out]


class Gateway:
    """Answers what the trainer asks a reporter: the hello proof and 'did you send this?'."""

    def __init__(self) -> None:
        self.port = free_port(GW_HOST)
        self.url = f"http://{GW_HOST}:{self.port}"
        self.sent: set[str] = set()
        self.key = KEYS.setdefault("gw", NodeKey(Ed25519PrivateKey.generate(), "gw"))

    def app(self) -> web.Application:
        async def healthz(request: web.Request) -> web.Response:
            nonce = request.query["challenge"]
            return web.json_response({"ok": True, "node": "gw", "url": self.url, "proof":
                                      hello_proof(TOKEN, nonce, self.url),
                                      "identity": self.key.hello(nonce, self.url)})

        async def sent(request: web.Request) -> web.Response:
            ok = request.match_info["digest"] in self.sent
            return web.json_response({"sent": ok}, status=200 if ok else 404)

        app = web.Application()
        app.add_routes([web.get("/healthz", healthz),
                        web.get("/v1/fleet/sent/{digest}", sent)])
        return app

    async def post(self, session: aiohttp.ClientSession, trainer: str, body: bytes) -> float:
        self.sent.add(hashlib.sha256(body).hexdigest())
        peer = f"{self.url} - gw"
        sig = self.key.sign_request("POST", "/v1/fleet/report", [], body, peer, "")
        t0 = time.perf_counter()
        async with session.post(f"{trainer}/v1/fleet/report", data=body, headers={
                "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json",
                "X-Deltaswarm-Peer": peer, SIG_HEADER: sig}) as r:
            reply = await r.read()
            if r.status != 200:
                raise SystemExit(f"report refused: {r.status} {reply[:300]!r}")
        return time.perf_counter() - t0


async def measure(trainer_url: str, pid: int, nodes: int, regions: int, small: int) -> dict:
    gw = Gateway()
    runner = web.AppRunner(gw.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, GW_HOST, gw.port).start()
    try:
        async with aiohttp.ClientSession() as s:
            rss0 = rss_kib(pid)
            one = entries(1, 1, gw.url)
            small_times = []
            await gw.post(s, trainer_url, json.dumps({"reports": one}).encode())  # the hello
            c0 = cpu_s(pid)
            for i in range(small):  # one-entry reports: a node reporting straight to the trainer
                one[0] = signed(one[0] | {"held_s": float(i)})
                small_times.append(await gw.post(s, trainer_url, json.dumps(
                    {"reports": one}).encode()))
            small_cpu = (cpu_s(pid) - c0) / small
            docs = entries(nodes, regions, gw.url)
            big_times, body = [], b""
            c0 = cpu_s(pid)
            for i in range(5):
                # every node re-signs each interval: the trainer verifies every entry anew
                docs = [signed(d | {"held_s": float(i)}) for d in docs]
                body = json.dumps({"reports": docs}, separators=(",", ":")).encode()
                big_times.append(await gw.post(s, trainer_url, body))
            big_cpu = (cpu_s(pid) - c0) / 5
            rss1 = rss_kib(pid)
            auth = {"Authorization": f"Bearer {TOKEN}"}
            t0 = time.perf_counter()
            async with s.get(f"{trainer_url}/v1/fleet", headers=auth) as r:
                view = await r.read()
            view_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            async with s.get(f"{trainer_url}/v1/status", headers=auth) as r:
                status = await r.read()
            status_s = time.perf_counter() - t0
            rss2 = rss_kib(pid)
            shown = json.loads(view)["nodes"]
    finally:
        await runner.cleanup()
    big = statistics.median(big_times)
    return {
        "nodes": nodes, "regions": regions, "nodes_shown": shown,
        "entry_bytes": round(len(body) / nodes, 1), "report_bytes": len(body),
        "one_entry_report_s": round(statistics.median(small_times), 5),
        "one_entry_report_cpu_ms": round(1e3 * small_cpu, 3),
        "one_entry_reports_per_cpu_s": round(1 / small_cpu, 1) if small_cpu else None,
        "whole_fleet_report_s": round(big, 3),
        "whole_fleet_report_cpu_s": round(big_cpu, 3),
        "cpu_us_per_entry": round(1e6 * big_cpu / nodes, 1),
        "rss_idle_mib": round(rss0 / 1024, 1), "rss_with_board_mib": round(rss1 / 1024, 1),
        "board_kib_per_node": round((rss1 - rss0) / nodes, 2),
        "rss_after_view_mib": round(rss2 / 1024, 1),
        "fleet_view_bytes": len(view), "fleet_view_s": round(view_s, 3),
        "status_bytes": len(status), "status_s": round(status_s, 3),
    }


def board_figures(nodes: int, regions: int) -> dict:
    """In this process: validating a whole-fleet report (JSON to models) and the memory the
    board then holds per node (tracemalloc, live objects only)."""
    from daemon.fleet.board import FleetBoard, parse_report

    body = json.dumps({"reports": entries(nodes, regions, "http://127.0.0.77:1")},
                      separators=(",", ":")).encode()
    parse_report(body)  # warm the URL check cache, as a gateway's second report finds it
    tracemalloc.start()
    t0 = time.perf_counter()
    report = parse_report(body)
    parse_s = time.perf_counter() - t0
    board = FleetBoard("trainer", max_nodes=nodes + 1)
    board.accept("gw", "http://127.0.0.77:1", report.reports, time.time())
    del report
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"validate_us_per_entry": round(1e6 * parse_s / nodes, 1),
            "board_bytes_per_node": round(held / nodes)}


def manifest_figures(tensors: int, blocks: int) -> dict:
    """Bytes of a manifest with `tensors` MoE-style tensor entries and `blocks` block entries,
    and the memory its parsed `Manifest` holds (tracemalloc): what each node fetches over HTTP
    per version, and what a daemon keeps per manifest it has parsed."""
    experts = max(1, tensors // (61 * 3))
    names = sorted(f"model.layers.{i // (experts * 3)}.mlp.experts.{i // 3 % experts}."
                   f"{('gate', 'up', 'down')[i % 3]}_proj.weight" for i in range(tensors))
    ts = [{"name": n, "dtype": "bfloat16", "shape": [2048, 7168], "digest": f"{i:032x}"}
          for i, n in enumerate(names)]
    doc = {"format": 2, "run": "run-2026-11-30", "version": 1234, "kind": "delta",
           "parent": {"version": 1233, "state_digest": "0" * 32},
           "state_digest": state_digest({t["name"]: t["digest"] for t in ts}), "tensors": ts,
           "blocks": [{"id": f"{i:032x}", "size": 8 << 20, "root": f"{i:064x}"}
                      for i in range(blocks)], "files": [], "stats": {}, "created": 1.7e9}
    raw = canonical_json(doc)
    for i, t in enumerate(ts):  # the next version: the same tensors, new digests
        t["digest"] = f"{i + 1:032x}"
    doc |= {"version": 1235, "parent": {"version": 1234, "state_digest": "0" * 32},
            "state_digest": state_digest({t["name"]: t["digest"] for t in ts})}
    raw_next = canonical_json(doc)
    del ts, doc
    tracemalloc.start()
    m = Manifest.model_validate(json.loads(raw))
    held = tracemalloc.get_traced_memory()[0]
    m_next = Manifest.model_validate(json.loads(raw_next))
    held_next = tracemalloc.get_traced_memory()[0] - held
    tracemalloc.stop()
    del m, m_next
    return {"tensors": tensors, "blocks": blocks, "bytes": len(raw),
            "parsed_mib": round(held / 2**20, 1), "parsed_next_mib": round(held_next / 2**20, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--regions", type=int, default=100)
    ap.add_argument("--small", type=int, default=200, help="one-entry reports to time")
    ap.add_argument("--manifest-tensors", type=int, default=50_000,
                    help="tensors of the model whose manifests are sized (0: skip)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    man = board_figures(a.nodes, a.regions)
    if a.manifest_tensors:
        # 8 MiB blocks: a 6.28 GB delta (docs/SCALE.md) and a 1 TB snapshot
        man |= {"manifest_delta": manifest_figures(a.manifest_tensors, -(-6_280_000_000 >> 23)),
               "manifest_snapshot": manifest_figures(a.manifest_tensors, -(-10**12 >> 23))}
    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp)) as c:
        t = c.trainer(fleet={"max_nodes": max(a.nodes + 10, 20_000),
                             "max_per_reporter": max(a.nodes, 2_000)})
        t.start()
        t.wait_ready()
        assert t.proc is not None
        out = asyncio.run(measure(t.url, t.proc.pid, a.nodes, a.regions, a.small)) | man
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>26}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
