"""Start-up failures are clear: a bad config, a missing state directory and a port already in
use each exit with status 2 and a message naming the file, the field and the problem."""

import socket
import subprocess
import sys
from pathlib import Path

import yaml

from tests.integration.harness import ROOT, free_port

KEY = "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c"


def config(tmp_path: Path, **over) -> Path:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    doc = {"node": "n1", "region": "r1", "role": "region", "state_dir": str(state),
           "trainer_public_key": KEY, "token": "integration-token",
           "http": {"host": "127.0.0.1", "port": free_port("127.0.0.1")},
           "bittorrent": {"host": "127.0.0.1", "port": free_port("127.0.0.1")}, **over}
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daemon.main", "--config", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_bad_config_names_file_field_and_problem(tmp_path: Path) -> None:
    path = config(tmp_path, retention={"versions": 0}, engine={"type": "http"})
    r = run(path)
    assert r.returncode == 2
    assert str(path) in r.stderr
    assert "retention.versions" in r.stderr and "greater than or equal to 1" in r.stderr
    assert "engine.url" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_state_dir_is_a_clear_error(tmp_path: Path) -> None:
    path = config(tmp_path, state_dir=str(tmp_path / "no" / "such"))
    r = run(path)
    assert r.returncode == 2
    assert "state_dir" in r.stderr and "does not exist" in r.stderr and "mkdir -p" in r.stderr
    assert "Traceback" not in r.stderr


def test_ports_in_use_name_the_address_and_field(tmp_path: Path) -> None:
    path = config(tmp_path)
    doc = yaml.safe_load(path.read_text())
    for field in ("http", "bittorrent"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", doc[field]["port"]))
            s.listen()
            r = run(path)
        assert r.returncode == 2, r.stderr
        assert f"{field}.port" in r.stderr
        assert f"127.0.0.1:{doc[field]['port']}" in r.stderr and "already in use" in r.stderr
        assert "Traceback" not in r.stderr
