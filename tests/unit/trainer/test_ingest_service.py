"""`deltaswarm ingest --config`: the config's token comes from a file (or the config, never the
command line), and every bad config is refused with the field named, before anything listens."""

from pathlib import Path

import pytest

from chain.config_base import ConfigError
from daemon.cli import main as cli_main
from trainer.ingest_service import load_ingest_config


def test_token_is_read_from_the_file_named_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("a-long-token\nignored\n")
    (tmp_path / "ingest.yaml").write_text("store_dir: store\ntoken_file: token\nport: 9000\n")
    cfg = load_ingest_config(tmp_path / "ingest.yaml")
    assert cfg.bearer() == "a-long-token"
    assert cfg.store_dir == tmp_path / "store" and cfg.port == 9000


@pytest.mark.parametrize("body, message", [
    ("store_dir: s\n", "set exactly one of `token` and `token_file`"),
    ("store_dir: s\ntoken: abcdefgh\ntoken_file: t\n", "set exactly one"),
    ("store_dir: s\ntoken: short\n", "field token"),
    ("store_dir: s\ntoken: abcdefgh\nport: 0\n", "field port"),
    ("token: abcdefgh\n", "field store_dir"),
])
def test_bad_configs_are_refused_naming_the_field(tmp_path: Path, body: str, message: str) -> None:
    (tmp_path / "ingest.yaml").write_text(body)
    with pytest.raises(ConfigError, match=message):
        load_ingest_config(tmp_path / "ingest.yaml")


def test_the_command_exits_2_on_an_unreadable_token_file(tmp_path: Path, capsys) -> None:
    (tmp_path / "ingest.yaml").write_text("store_dir: s\ntoken_file: missing\n")
    assert cli_main(["ingest", "--config", str(tmp_path / "ingest.yaml")]) == 2
    assert "token_file" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
