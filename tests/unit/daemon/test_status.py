"""NodeStatus and StatusBoard: derived fields, bounded history, snapshots, JSON round trip, the
status CLI against a real aiohttp server, and its error messages."""

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

from daemon import status_cli
from daemon.status import NodeStatus, RateMeter, StatusBoard

ROOT = Path(__file__).resolve().parents[3]


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def busy_board() -> StatusBoard:
    clock = FakeClock()
    b = StatusBoard("eu-1", "eu", clock=clock, monotonic=clock)
    b.update(http_url="http://10.0.0.1:8700", bt_endpoint="10.0.0.1:6881")
    b.set_head(7)
    b.set_current(6, "ab" * 16)
    b.transfer("v00000007.delta", version=7, total_bytes=4000, done_bytes=1000, peers=3,
               download_rate=512.0)
    b.transfer("v00000006.delta", version=6, state="seeding", total_bytes=3000,
               done_bytes=3000, bytes_up=9000)
    b.peer("10.0.0.2:6881", node="us-1", bytes_down=700, http_url="http://10.0.0.2:8700")
    b.peer("http://10.0.0.3:8700")
    b.add_bytes(up=9000, down=7000)
    b.applied(6, payload_bytes=3000, full_bytes=100_000)
    b.verification_failed("piece", "hash mismatch from 10.0.0.9")
    b.ban("10.0.0.9", "sent a piece failing its v2 hash")
    b.refuse_manifest("no signature", kind="unsigned", artifact="v00000008.delta",
                      source="http://10.0.0.9:8700")
    b.engine_notified(6)
    b.spool_state(5, 12_000)
    b.spool_received(20)
    b.spool_forwarded(15)
    clock.t += 42
    return b


def test_lag_is_head_minus_current_and_none_without_a_version():
    assert NodeStatus().lag == 0
    assert NodeStatus(head_version=5).lag is None
    assert NodeStatus(head_version=5, current_version=3).lag == 2
    assert NodeStatus(head_version=3, current_version=5).lag == 0


def test_set_current_raises_head_but_head_never_goes_back():
    b = StatusBoard("n", "r")
    b.set_current(4, "d")
    assert b.snapshot().head_version == 4
    b.set_head(9)
    b.set_head(2)
    s = b.snapshot()
    assert (s.current_version, s.head_version, s.lag, s.state_digest) == (4, 9, 5, "d")


def test_snapshot_is_independent_of_later_updates():
    b = busy_board()
    s = b.snapshot()
    b.transfer("v00000007.delta", done_bytes=4000, state="current")
    b.peer("10.0.0.2:6881", bytes_down=9999)
    assert s.versions[1].done_bytes == 1000 and s.versions[1].state == "fetching"
    assert s.peers[0].bytes_down == 700


def test_snapshot_reports_uptime_and_time_from_the_clocks():
    s = busy_board().snapshot()
    assert s.uptime_s == 42
    assert s.time == 1042


def test_transfers_are_updated_in_place_and_kept_sorted():
    b = busy_board()
    b.transfer("v00000007.delta", done_bytes=2000)
    s = b.snapshot()
    assert [t.artifact for t in s.versions] == ["v00000006.delta", "v00000007.delta"]
    assert s.versions[1].progress == 0.5
    b.drop_transfer("v00000006.delta")
    assert [t.artifact for t in b.snapshot().versions] == ["v00000007.delta"]


def test_transfer_rejects_an_unknown_state_and_negative_bytes():
    b = StatusBoard("n", "r")
    with pytest.raises(ValidationError):
        b.transfer("v00000001.delta", state="downloading")
    with pytest.raises(ValidationError):
        b.transfer("v00000001.delta", done_bytes=-1)


def test_peer_is_found_by_any_of_its_keys_and_stamped_seen():
    clock = FakeClock(50.0)
    b = StatusBoard("n", "r", clock=clock)
    b.peer("10.0.0.2:6881", node="us-1", http_url="http://10.0.0.2:8700")
    clock.t = 60.0
    b.peer("http://10.0.0.2:8700", bytes_up=5)
    b.peer("us-1", bytes_down=6)
    s = b.snapshot()
    assert len(s.peers) == 1
    p = s.peers[0]
    assert (p.bytes_up, p.bytes_down, p.last_seen, p.bt_endpoint) == (5, 6, 60.0, "10.0.0.2:6881")
    b.drop_peer("us-1")
    assert b.snapshot().peers == []


def test_bytes_saved_is_full_minus_payload():
    s = busy_board().snapshot()
    assert s.totals.bytes_saved == 97_000
    assert s.totals.versions_applied == 1


def test_verification_failures_count_by_kind():
    b = StatusBoard("n", "r")
    for kind in ("piece", "piece", "block", "state"):
        b.verification_failed(kind, "x")
    v = b.snapshot().verification
    assert v.failures_by_kind == {"piece": 2, "block": 1, "state": 1}
    assert v.failures == 4
    assert v.last_error == "state: x"


def test_a_peer_is_banned_once_and_can_be_unbanned():
    b = StatusBoard("n", "r")
    b.ban("10.0.0.9", "bad piece")
    b.ban("10.0.0.9", "bad block")
    bans = b.snapshot().bans
    assert len(bans) == 1 and bans[0].reason == "bad block"
    b.unban("10.0.0.9")
    assert b.snapshot().bans == []


def test_refused_manifests_keep_the_last_n_but_count_all():
    b = StatusBoard("n", "r", keep=3)
    for i in range(5):
        b.refuse_manifest(f"reason {i}", kind="replay" if i % 2 else "unsigned",
                          artifact=f"v{i:08d}.delta")
    s = b.snapshot()
    assert [r.reason for r in s.refused_manifests] == ["reason 2", "reason 3", "reason 4"]
    assert s.refused_by_kind == {"unsigned": 3, "replay": 2}
    assert s.refused_total == 5


def test_engine_notifications_and_failures():
    b = StatusBoard("n", "r")
    b.engine_notified(3)
    b.engine_failed(4, "connection refused")
    e = b.snapshot().engine
    assert (e.notifications, e.failures, e.last_version) == (1, 1, 3)
    assert e.last_error == "v4: connection refused"


def test_spool_counters_and_forward_rate():
    clock = FakeClock(0.0)
    b = StatusBoard("n", "r", monotonic=clock)
    for _ in range(200):
        clock.t += 0.1
        b.spool_forwarded(2)
    b.spool_rejected()
    b.spool_error("upstream 503")
    s = b.snapshot().spool
    assert s.forwarded == 400 and s.rejected_full == 1 and s.errors == 1
    assert s.forward_rate == pytest.approx(20.0, rel=0.05)
    assert s.last_error == "upstream 503"


def test_rate_meter_decays_after_silence():
    clock = FakeClock(0.0)
    m = RateMeter(tau=5.0, clock=clock)
    for _ in range(100):
        clock.t += 0.5
        m.add(50)
    assert m.value() == pytest.approx(100.0, rel=0.05)
    clock.t += 50
    assert m.value() < 0.01


def test_rate_meter_reads_a_steady_rate_from_the_start():
    clock = FakeClock(0.0)
    m = RateMeter(tau=10.0, clock=clock)
    for _ in range(4):
        clock.t += 0.5
        m.add(10)
    assert m.value() == pytest.approx(20.0, rel=0.01)


def test_json_round_trip_keeps_every_field():
    s = busy_board().snapshot()
    again = NodeStatus.model_validate_json(s.model_dump_json())
    assert again == s
    raw = json.loads(s.model_dump_json())
    assert raw["lag"] == 1 and raw["totals"]["bytes_saved"] == 97_000
    assert raw["versions"][1]["progress"] == 0.25


def test_board_is_safe_under_concurrent_updates():
    b = StatusBoard("n", "r")

    def work() -> None:
        for _ in range(2000):
            b.add_bytes(up=1, down=2)
            b.verification_failed("piece", "x")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = b.snapshot()
    assert (s.totals.bytes_up, s.totals.bytes_down, s.verification.failures) == (8000, 16000, 8000)


# -- the status CLI, against a real aiohttp server on loopback -------------------------------


@pytest.fixture
def server() -> Iterator[tuple[str, StatusBoard]]:
    """A real control plane serving /v1/status from a board; requires token 'secret-token'."""
    board = busy_board()
    started = threading.Event()
    holder: dict = {}

    async def status(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer secret-token":
            return web.json_response({"error": "bad token"}, status=401)
        return web.Response(body=board.snapshot().model_dump_json(),
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
    assert "94.7 KiB (97.0% of full checkpoints)" in out
    assert "us-1" in out and "10.0.0.2:6881" in out
    assert "banned: sent a piece failing its v2 hash" in out
    assert "v00000007.delta" in out and "25.0%" in out
    assert "refused unsigned: no signature" in out


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


def test_cli_watch_exits_cleanly_on_ctrl_c(server):
    url, _ = server
    env = {**os.environ, "DELTASWARM_TOKEN": "secret-token", "PYTHONPATH": str(ROOT),
           "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.status_cli", "--url", url, "--watch", "--interval", "0.1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        first = proc.stdout.readline()
        assert first, proc.stderr.read().decode()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err.decode()
        assert b"Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
