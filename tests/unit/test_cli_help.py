"""What a newcomer first reads: every command's --help description is whole (not cut at the
first line of its docstring), and `deltaswarm status` with no arguments asks the port a daemon
listens on by default."""

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.config import HttpListen
from daemon.observe import status_cli

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["daemon", "status"])
def test_help_description_is_a_whole_paragraph(command):
    out = subprocess.run([sys.executable, "-m", "daemon.cli", command, "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    description = out.stdout.split("\n\n")[1]
    assert description.rstrip().endswith((".", ":")), description


def test_status_defaults_to_the_port_a_daemon_listens_on_by_default():
    assert status_cli.DEFAULT_URL.endswith(f":{HttpListen().port}")
