"""`deltaswarm status --fleet` renders the fleet view as tables: one line per region with its
lag and link bytes, one per node; and refuses a reply that is not a fleet view."""

import io
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.console import Console

from daemon.fleet.board import EntrySig, FleetBoard, NodeReport, sign_report
from daemon.fleet.link import encode_view
from daemon.observe.status_cli import main
from daemon.observe.status_fleet import fleet_render
from daemon.peering.identity import NodeKey


def view() -> dict:
    board = FleetBoard("trainer")
    for v, t in ((3, 100.0), (4, 110.0)):
        board.note_head(v, t)
    links = {"cross": {"bytes_in": 3 << 20, "bytes_out": 0}}
    a = NodeReport.model_validate({"node": "a", "region": "east", "role": "region", "version": 3,
                                   "url": "http://10.0.0.1:1", "held_s": 30.0, "links": links})
    b = NodeReport(node="b", region="west", role="region", version=4, url="http://10.0.0.2:1")
    a, b = (sign_report(r, NodeKey(Ed25519PrivateKey.generate(), r.node), 130.0) for r in (a, b))
    board.accept("a", a.url, [a, b], 130.0)
    return board.view(head=4, now=130.0)


def test_the_fleet_tables_show_each_region_and_node_with_lag_and_bytes() -> None:
    out = io.StringIO()
    Console(file=out, width=250, color_system=None).print(fleet_render(view(), nodes=True))
    text = out.getvalue()
    assert "fleet seen from trainer · head v4 · 2 nodes" in text
    east = next(line for line in text.splitlines() if line.strip("│ ").startswith("east")
                and "MiB" in line)
    assert "3.0 MiB / 0 B" in east and " 20s" in east  # lag: v4 became head 20 s ago
    assert any(" b " in line and "west" in line for line in text.splitlines())


def serve(body: bytes, paths: list[str] | None = None) -> tuple[HTTPServer, str]:
    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if paths is not None:
                paths.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_status_fleet_json_prints_the_view_and_refuses_what_is_not_one(capsys) -> None:
    srv, url = serve(json.dumps(view()).encode())
    try:
        assert main(["--fleet", "--json", "--url", url, "--token", "t"]) == 0
        assert set(json.loads(capsys.readouterr().out)["regions"]) == {"east", "west"}
    finally:
        srv.shutdown()
        srv.server_close()
    srv, url = serve(b'{"node": "x"}')
    try:
        assert main(["--fleet", "--url", url]) == 1
        assert "not return a deltaswarm fleet view" in capsys.readouterr().err
    finally:
        srv.shutdown()
        srv.server_close()


def test_status_fleet_prints_a_region_summary_of_10k_signed_nodes_by_default() -> None:
    """Issue 20, finding 10: 20,000 node rows took 19-26 s to print. The default is one line
    per region, fetched without node lists (`?nodes=0`); `--nodes` asks for them."""
    now = time.time()
    board = FleetBoard("trainer", max_nodes=20_000, max_per_reporter=200)
    for g in range(50):  # 50 gateways, each forwarding 199 nodes of its region
        gw = NodeKey(Ed25519PrivateKey.generate(), f"gw{g}")
        reps = [sign_report(NodeReport(node=f"gw{g}", region=f"region-{g}", role="region",
                                       version=7, url=f"http://10.1.{g}.1:8700"), gw, now)]
        # Synthetic signatures: the board takes the origin checks as given (they run off
        # the loop before it, tests/unit/daemon/fleet/test_fleet.py covers them).
        sig = EntrySig(key=gw.public, ts=now, sig="0" * 128)
        reps += [NodeReport(node=f"n{g}-{i}", region=f"region-{g}", role="region",
                            version=6 + i % 2, url=f"http://10.1.{g}.{i + 2}:8700", hops=1,
                            sig=sig) for i in range(199)]
        assert board.accept(f"gw{g}", reps[0].url, reps, now).stored == 200
    assert len(board.entries) == 10_000
    full = board.view(head=7, now=now)
    paths: list[str] = []
    srv, url = serve(encode_view(full, nodes=False), paths)
    try:
        buf = io.StringIO()
        t0 = time.monotonic()
        assert main(["--fleet", "--url", url, "--token", "t"],
                    Console(file=buf, width=250, color_system=None)) == 0
        took = time.monotonic() - t0
    finally:
        srv.shutdown()
        srv.server_close()
    out = buf.getvalue()
    assert paths == ["/v1/fleet?nodes=0"]
    assert "10000 nodes" in out and out.count("region-") == 50 and "n3-7" not in out
    print(f"status --fleet at 10k nodes: {took:.2f}s, load {os.getloadavg()}")
