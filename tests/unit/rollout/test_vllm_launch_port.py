"""The launcher's port: drawn below the ephemeral range, and a start whose picked port was taken
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


def test_a_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOW <= port < ports.ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_no_port_is_handed_out_twice_before_it_is_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probes close their sockets, so a port stays free until its program binds it: a second
    probe must not return it (a daemon's two ports drawn in a row, one then failing to bind)."""
    monkeypatch.setattr(ports, "LOW", 30_000)
    got = [ports.free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    base = ports.free_port_block(8, step=1, low=30_000)
    assert not set(range(base, base + 8)) & set(got)


def test_a_block_is_free_and_aligned() -> None:
    base = ports.free_port_block(8, step=100)
    assert base % 100 == 0 and base + 8 <= ports.ephemeral_low()
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


def test_a_configured_port_that_is_taken_fails_with_the_reason(
        stand_in: VllmLaunchConfig) -> None:
    taken = _held_port()
    cfg = VllmLaunchConfig(model=stand_in.model, venv=stand_in.venv, startup_timeout_s=30,
                           port=taken.getsockname()[1])
    try:
        with pytest.raises(VllmLaunchError, match="Address already in use"):
            vllm_launch.start(cfg)
    finally:
        taken.close()


def test_the_picked_port_is_given_up_after_three_tries(
        stand_in: VllmLaunchConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = _held_port()
    monkeypatch.setattr(vllm_launch, "free_port", lambda host: taken.getsockname()[1])
    try:
        with pytest.raises(VllmLaunchError, match="Address already in use"):
            vllm_launch.start(stand_in)
    finally:
        taken.close()
