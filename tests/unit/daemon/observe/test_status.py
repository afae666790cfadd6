"""NodeStatus: derived fields, validation, JSON round trip, the status CLI against a real
aiohttp server, and its error messages."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from pydantic import ValidationError
from rich.console import Console

from daemon.observe import status_cli
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

ROOT = Path(__file__).resolve().parents[4]


def busy_status() -> NodeStatus:
    """A region node mid-download, the way daemon.observe.report fills one in."""
    return NodeStatus(
        node="eu-1", region="eu", http_url="http://10.0.0.1:8700", bt_endpoint="10.0.0.1:6881",
        time=1042.0, uptime_s=42.0, current_version=6, head_version=7, state_digest="ab" * 16,
        versions=[
            Transfer(artifact="v00000006.delta", version=6, state="seeding", total_bytes=3000,
                     tensor_bytes=1000, file_bytes=2000, done_bytes=3000, bytes_up=9000),
            Transfer(artifact="v00000007.delta", version=7, total_bytes=4000, done_bytes=1000,
                     tensor_bytes=1536, file_bytes=2464, peers=3, download_rate=512.0),
        ],
        peers=[Peer(bt_endpoint="10.0.0.2:6881", node="us-1", bytes_down=700,
                    http_url="http://10.0.0.2:8700", last_seen=1000.0),
               Peer(http_url="http://10.0.0.3:8700", last_seen=1000.0)],
        totals=Totals(bytes_up=9000, bytes_down=7000, tensor_bytes=1000, file_bytes=2000,
                      new_file_bytes=0, full_tensor_bytes=98_000, versions_applied=1),
        verification=Verification(failures_by_kind={"piece": 1},
                                  last_error="piece: hash mismatch from 10.0.0.9", last_at=1000),
        bans=[Ban(endpoint="10.0.0.9:6881", artifact="v00000001.delta",
                 reason="sent a piece failing its v2 hash", since=1000.0, expires=4600.0)],
        refused_manifests=[RefusedManifest(artifact="v00000008.delta",
                                           source="http://10.0.0.9:8700", kind="unsigned",
                                           reason="no signature", at=1000.0)],
        refused_by_kind={"unsigned": 1},
        engine=EngineStatus(notifications=1, last_version=6, last_ok_at=1000.0),
        spool=SpoolStatus(depth=5, bytes=12_000, received=20, forwarded=15),
    )


def test_lag_is_head_minus_current_and_none_without_a_version():
    assert NodeStatus().lag == 0
    assert NodeStatus(head_version=5).lag is None
    assert NodeStatus(head_version=5, current_version=3).lag == 2
    assert NodeStatus(head_version=3, current_version=5).lag == 0


def test_transfer_progress_is_done_over_total():
    s = busy_status()
    assert [t.progress for t in s.versions] == [1.0, 0.25]
    assert Transfer(artifact="v00000001.delta").progress == 0.0


def test_transfer_rejects_an_unknown_state_and_negative_bytes():
    with pytest.raises(ValidationError):
        Transfer(artifact="v00000001.delta", state="downloading")
    with pytest.raises(ValidationError):
        Transfer(artifact="v00000001.delta", done_bytes=-1)
    t = Transfer(artifact="v00000001.delta")
    with pytest.raises(ValidationError):
        t.state = "downloading"  # assignments are validated too


def test_bytes_saved_and_the_ratio_are_on_tensors_and_never_negative():
    t = busy_status().totals
    assert (t.bytes_saved, t.smaller_on_tensors) == (97_000, 98.0)
    assert (t.payload_bytes, t.full_bytes) == (3000, 100_000)  # carried files in both
    # carried files change neither: an unchanged tokenizer is not a saving nor a cost
    files = Totals(tensor_bytes=10, full_tensor_bytes=1000, file_bytes=10**6)
    assert (files.bytes_saved, files.smaller_on_tensors) == (990, 100.0)
    assert Totals(tensor_bytes=10, full_tensor_bytes=4).bytes_saved == 0
    assert Totals().smaller_on_tensors is None


def test_failure_and_refusal_totals_add_up_the_kinds():
    v = Verification(failures_by_kind={"piece": 2, "block": 1, "state": 1})
    assert v.failures == 4
    s = NodeStatus(refused_by_kind={"unsigned": 3, "replay": 2})
    assert s.refused_total == 5


def test_json_round_trip_keeps_every_field():
    s = busy_status()
    again = NodeStatus.model_validate_json(s.model_dump_json())
    assert again == s
    raw = json.loads(s.model_dump_json())
    assert raw["lag"] == 1 and raw["totals"]["bytes_saved"] == 97_000
    assert raw["versions"][1]["progress"] == 0.25
    assert raw["verification"]["failures"] == 1 and raw["refused_total"] == 1


# -- the status CLI, against a real aiohttp server on loopback -------------------------------


STATUS_REQUESTS: list[str] = []
"""Every /v1/status request the `server` fixture answered (cleared by the fixture)."""


@pytest.fixture
def server() -> Iterator[tuple[str, NodeStatus]]:
    """A real control plane serving /v1/status; requires token 'secret-token'."""
    board = busy_status()
    started = threading.Event()
    holder: dict = {}

    async def status(request: web.Request) -> web.Response:
        STATUS_REQUESTS.append(request.path)
        if request.headers.get("Authorization") != "Bearer secret-token":
            return web.json_response({"error": "bad token"}, status=401)
        return web.Response(body=board.model_dump_json(),
                            content_type="application/json")

    async def serve() -> None:
        app = web.Application()
        app.router.add_get("/v1/status", status)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["port"] = runner.addresses[0][1]
        holder["stop"] = asyncio.Event()
        started.set()
        await holder["stop"].wait()
        await runner.cleanup()

    STATUS_REQUESTS.clear()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    assert started.wait(5)
    try:
        yield f"http://127.0.0.1:{holder['port']}", board
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(5)
        loop.close()


def wide_console() -> Console:
    return Console(width=200, record=True, force_terminal=False, color_system=None)


def test_cli_renders_summary_peers_and_versions(server):
    url, _ = server
    console = wide_console()
    rc = status_cli.main(["--url", url, "--token", "secret-token", "--peers", "--versions"],
                         console=console)
    out = console.export_text()
    assert rc == 0
    assert "eu-1" in out and "6 / head 7" in out
    assert "94.7 KiB on tensors (99.0% of full checkpoints' tensors, 98.0x smaller)" in out
    assert "1000 B tensors + 2.0 KiB carried files (0 B of them changed) in 1 version" in out
    assert "us-1" in out and "10.0.0.2:6881" in out
    assert "banned on v00000001.delta: sent a piece failing its v2 hash" in out
    assert "v00000007.delta" in out and "25.0%" in out
    row = next(line for line in out.splitlines() if "v00000007.delta" in line)
    assert "1.5 KiB" in row and "2.4 KiB" in row  # tensors and carried files, apart
    assert "refused unsigned: no signature" in out


def test_cli_piped_prints_every_cell_whole_however_narrow_columns_says(server):
    """Captured or piped (not a terminal), with $COLUMNS=40: no cell cut to an ellipsis, and
    the sizes (tensors and carried files apart) all there (issue 22)."""
    url, _ = server
    r = subprocess.run([sys.executable, "-m", "daemon.observe.status_cli", "--url", url, "--token",
                        "secret-token", "--peers", "--versions"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "COLUMNS": "40"})
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout, r.stdout
    assert "banned on v00000001.delta: sent a piece failing its v2 hash" in r.stdout
    line = next(x for x in r.stdout.splitlines() if "v00000007.delta" in x)
    assert "1.5 KiB" in line and "2.4 KiB" in line, r.stdout
    assert "98.0x smaller" in r.stdout


def test_cli_json_prints_the_status_document(server, capsys):
    url, _ = server
    rc = status_cli.main(["--url", url, "--token", "secret-token", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert doc["node"] == "eu-1" and doc["lag"] == 1


def test_cli_takes_url_and_token_from_a_daemon_config(server, tmp_path, capsys):
    url, _ = server
    port = url.rsplit(":", 1)[1]
    (tmp_path / "token").write_text("secret-token\n")
    cfg = tmp_path / "eu.yaml"
    cfg.write_text(f"node: eu-1\nhttp:\n  host: 0.0.0.0\n  port: {port}\ntoken_file: token\n")
    assert status_cli.main(["--config", str(cfg), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["region"] == "eu"


def test_cli_says_the_token_was_refused(server, capsys):
    url, _ = server
    assert status_cli.main(["--url", url, "--token", "wrong-token"]) == 1
    err = capsys.readouterr().err
    assert "HTTP 401" in err and "--token" in err


def test_cli_names_the_unreachable_url_and_what_to_check(capsys):
    with socket_on_free_port() as port:
        pass
    assert status_cli.main(["--url", f"http://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert f"http://127.0.0.1:{port}/v1/status" in err
    assert "refused" in err.lower() and "--url" in err and "--config" in err


def test_cli_reports_an_unreadable_config(tmp_path, capsys):
    assert status_cli.main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_cli_watch_refreshes_count_times(server):
    url, _ = server
    console = wide_console()
    rc = status_cli.main(["--url", url, "--token", "secret-token", "--watch", "--interval",
                          "0.05", "--count", "3"], console=console)
    assert rc == 0
    assert "eu-1" in console.export_text()
    assert len(STATUS_REQUESTS) == 3, STATUS_REQUESTS


def test_cli_watch_exits_cleanly_on_ctrl_c(server):
    url, _ = server
    env = {**os.environ, "DELTASWARM_TOKEN": "secret-token", "PYTHONPATH": str(ROOT),
           "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.observe.status_cli", "--url", url, "--watch", "--interval",
        "0.1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        first = proc.stdout.readline()
        assert first, proc.stderr.read().decode()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)  # 10 s was too short on a CI host at load 6
        assert proc.returncode == 0, err.decode()
        assert b"Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaps it and closes both pipes on every path


class socket_on_free_port:
    """Bind port 0, yield the port, close: nothing listens there afterwards."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_render_of_an_empty_node_says_so():
    console = wide_console()
    console.print(status_cli.render(NodeStatus(node="fresh", region="eu", head_version=4),
                                    peers=True, versions=True))
    out = console.export_text()
    assert "no version yet" in out and "no peers known yet" in out and "no transfers" in out


def test_names_and_reasons_from_peers_are_shown_literally_not_as_markup():
    hostile = "[/oops]"
    s = NodeStatus(
        node="[bold]me", region="eu", current_version=1, head_version=1,
        peers=[Peer(node=hostile, bt_endpoint="10.0.0.2:6881", http_url="http://[::1]:1")],
        bans=[Ban(endpoint="10.0.0.9:6881", artifact="v00000001.delta",
                 node="[red]x[/]", reason="[/] bad piece", since=1.0, expires=2.0)],
        versions=[Transfer(artifact="v00000001.delta", version=1, state="failed",
                           error="peer said [/link]")],
        refused_manifests=[RefusedManifest(kind="unsigned", reason="[/", at=1.0)],
        verification=Verification(failures=1, last_error="[/i]"),
    )
    console = wide_console()
    console.print(status_cli.render(s, peers=True, versions=True))
    out = console.export_text()
    for literal in (hostile, "[bold]me", "[red]x[/]", "v00000001.delta: [/] bad piece",
                    "failed: peer said [/link]", "refused unsigned: [/", "(last: [/i])"):
        assert literal in out, literal
