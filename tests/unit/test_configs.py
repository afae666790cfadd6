"""Every shipped config that is not a daemon config parses with its own loader (the daemon's
are checked in tests/unit/daemon/test_config.py)."""

from pathlib import Path

import pytest

from rollout.worker import parse_args
from trainer.demo import load_demo_config

ROOT = Path(__file__).resolve().parents[2]


def test_demo_config_parses():
    cfg = load_demo_config(ROOT / "configs" / "demo.yaml")
    assert len(cfg.regions) == 3 and cfg.steps >= 10


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "rollout").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_rollout_worker_config_parses(path):
    cfg, _ = parse_args(["--config", str(path)])
    assert cfg.region == path.stem


def test_worker_flags_override_the_config_file():
    path = ROOT / "configs" / "rollout" / "eu-west.yaml"
    cfg, _ = parse_args(["--config", str(path), "--group-size", "4"])
    assert cfg.group_size == 4


def test_worker_config_with_unknown_field_is_refused(tmp_path):
    bad = tmp_path / "w.yaml"
    bad.write_text("daemon: http://x:1\ntoken: t\nsurprise: 1\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(bad)])
