"""The launcher's port: drawn outside the ephemeral range, and a start whose picked port was taken
before vLLM bound it is made again on another port.

vLLM itself takes a minute to start on this CPU, so `vllm` here is a stand-in executable in a
venv-shaped folder that does what matters to the launcher: it binds the `--port` it is given
(printing Python's own OSError and exiting when the port is taken, as vLLM does) and answers
GET /health. The real server goes through the same launcher in tests/integration/test_vllm_*.
"""

import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from rollout import ports, vllm_launch
from rollout.vllm_launch import VllmLaunchConfig, VllmLaunchError

STAND_IN = f'''#!{sys.executable}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


@pytest.fixture
def stand_in(tmp_path: Path) -> VllmLaunchConfig:
    venv, model = tmp_path / "venv", tmp_path / "model"
    (venv / "bin").mkdir(parents=True)
    model.mkdir()
    (model / "config.json").write_text("{}")
    (venv / "bin" / "python").symlink_to(sys.executable)
    vllm = venv / "bin" / "vllm"
    vllm.write_text(STAND_IN)
    vllm.chmod(0o755)
    return VllmLaunchConfig(model=model, venv=venv, startup_timeout_s=30)


def outside_ephemeral(port: int) -> bool:
    low, high = ports.ephemeral_range()
    return port < low or port > high


def test_a_free_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    for _ in range(20):
        port = ports.free_port()
        assert port >= ports.LOW and outside_ephemeral(port)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_host_whose_ephemeral_range_leaves_no_room_gets_the_kernels_ports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tuned `1024 65535`: nothing outside it from 20000 up, so bind(0) after all (the race
    is back, but no start fails for want of a port), still never the same port twice."""
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == 50
    with pytest.raises(OSError, match="fewer than"):
        ports.free_port_block(8)


def test_no_port_is_handed_out_twice_before_it_is_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probes close their sockets, so a port stays free until its program binds it: a second
    probe must not return it (a daemon's two ports drawn in a row, one then failing to bind)."""
    monkeypatch.setattr(ports, "LOW", 30_000)
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (32_768, 60_999))
    # 7,303 ports outside the range from 30000: 400 random draws collide ~11 times without
    # the registry (the chance of none is about 2e-5)
    got = [ports.free_port() for _ in range(400)]
    assert len(set(got)) == len(got)
    assert all(outside_ephemeral(p) for p in got)


def test_a_block_stays_under_the_highest_port_its_program_accepts() -> None:
    """The demo refuses a base port above 60000; a quarter of the ports outside the ephemeral
    range lie above 61000, so without `high` some of these draws land there."""
    bases = [ports.free_port_block(40, step=100, high=60_000) for _ in range(30)]
    assert all(b + 39 <= 60_000 and outside_ephemeral(b) for b in bases)


def test_a_block_is_free_and_aligned() -> None:
    base = ports.free_port_block(8, step=100)
    assert base % 100 == 0 and outside_ephemeral(base) and outside_ephemeral(base + 7)
    socks = [socket.socket() for _ in range(8)]
    try:
        for i, s in enumerate(socks):
            s.bind(("127.0.0.1", base + i))
    finally:
        for s in socks:
            s.close()


def _held_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", ports.free_port()))
    s.listen()
    return s


def test_a_picked_port_taken_before_the_bind_is_picked_again(
        stand_in: VllmLaunchConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = _held_port()
    picks = iter([taken.getsockname()[1], taken.getsockname()[1], ports.free_port()])
    monkeypatch.setattr(vllm_launch, "free_port", lambda host: next(picks))
    try:
        server = vllm_launch.start(stand_in)
        try:
            port = int(server.base_url.rsplit(":", 1)[1])
            assert port != taken.getsockname()[1]
            with urllib.request.urlopen(server.base_url + "/health", timeout=5) as r:
                assert r.status == 200
        finally:
            server.stop()
        assert next(picks, None) is None  # three starts: two on the taken port, one after
    finally:
        taken.close()


def _counting_spawns(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    spawned: list[int] = []
    real = vllm_launch.spawn

    def spawn(cfg, log_path=None):
        server = real(cfg, log_path)
        spawned.append(int(server.base_url.rsplit(":", 1)[1]))
        return server

    monkeypatch.setattr(vllm_launch, "spawn", spawn)
    return spawned


def test_a_configured_port_that_is_taken_fails_with_the_reason_and_is_not_retried(
        stand_in: VllmLaunchConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = _held_port()
    spawned = _counting_spawns(monkeypatch)
    cfg = VllmLaunchConfig(model=stand_in.model, venv=stand_in.venv, startup_timeout_s=30,
                           port=taken.getsockname()[1])
    try:
        with pytest.raises(VllmLaunchError, match="Address already in use"):
            vllm_launch.start(cfg)
        assert spawned == [taken.getsockname()[1]]
    finally:
        taken.close()


def test_the_picked_port_is_given_up_after_three_tries(
        stand_in: VllmLaunchConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = _held_port()
    spawned = _counting_spawns(monkeypatch)
    monkeypatch.setattr(vllm_launch, "free_port", lambda host: taken.getsockname()[1])
    try:
        with pytest.raises(VllmLaunchError, match="Address already in use"):
            vllm_launch.start(stand_in)
        assert len(spawned) == vllm_launch.PORT_TRIES == 3
    finally:
        taken.close()


def test_a_start_reads_only_its_own_output_in_a_shared_log(
        stand_in: VllmLaunchConfig, tmp_path: Path) -> None:
    """A caller's log is appended to by every start: an earlier start's "address already in
    use" must not make a later start that failed otherwise be retried, nor show in its
    error."""
    log = tmp_path / "vllm.log"
    log.write_text("OSError: [Errno 98] Address already in use\n")
    server = vllm_launch.start(stand_in, log_path=log)
    try:
        assert vllm_launch.PORT_TAKEN not in server.log_tail()
        assert vllm_launch.PORT_TAKEN in log.read_text()
    finally:
        server.stop()
