"""The daemon config: every shipped example parses, and bad configs fail with a message naming
the file, the field and the problem."""

from pathlib import Path

import pytest

from daemon.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
KEY = "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(text)
    return path


def minimal(state_dir: Path, extra: str = "") -> str:
    return (f"node: n1\nregion: r1\nrole: region\nstate_dir: {state_dir}\n"
            f"trainer_public_key: {KEY}\ntoken: secret-token\n{extra}")


@pytest.mark.parametrize("path", sorted([ROOT / "configs/trainer.yaml",
                                         *(ROOT / "configs/regions").glob("*.yaml")]),
                         ids=lambda p: p.name)
def test_every_shipped_daemon_config_parses(path: Path) -> None:
    cfg = load_config(path, check_paths=False)
    assert cfg.role == ("trainer" if path.name == "trainer.yaml" else "region")


def test_there_are_three_region_examples() -> None:
    assert len(list((ROOT / "configs/regions").glob("*.yaml"))) >= 3


def test_minimal_config_gets_documented_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, minimal(tmp_path)))
    assert cfg.engine.type == "none"
    assert cfg.trajectories.upstream is None
    assert cfg.bearer() == "secret-token"
    assert cfg.http.url() == "http://127.0.0.1:7600"


def test_unknown_field_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, minimal(tmp_path, "limits:\n  upload: 5\n"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and "limits.upload" in str(e.value)


def test_out_of_range_port_is_named_with_the_value(tmp_path: Path) -> None:
    path = write(tmp_path, minimal(tmp_path, "http:\n  port: 70000\n"))
    with pytest.raises(ConfigError, match=r"http\.port.*70000"):
        load_config(path)


def test_engine_hook_union_reports_the_member_field(tmp_path: Path) -> None:
    path = write(tmp_path, minimal(tmp_path, "engine:\n  type: http\n"))
    with pytest.raises(ConfigError, match=r"engine\.url"):
        load_config(path)
    path = write(tmp_path, minimal(tmp_path, "engine:\n  type: carrier-pigeon\n"))
    with pytest.raises(ConfigError, match=r"engine"):
        load_config(path)


def test_missing_state_dir_says_how_to_fix_it(tmp_path: Path) -> None:
    path = write(tmp_path, minimal(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"state_dir.*does not exist.*mkdir -p"):
        load_config(path)


def test_relative_state_dir_is_resolved_against_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    cfg = load_config(write(tmp_path, minimal(Path("state"))))
    assert cfg.state_dir == tmp_path / "state"


def test_token_and_token_file_are_exclusive(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.write_text("file-token-123\n")
    path = write(tmp_path, minimal(tmp_path, f"token_file: {tok}\n"))
    with pytest.raises(ConfigError, match="exactly one of"):
        load_config(path)
    text = minimal(tmp_path).replace("token: secret-token\n", f"token_file: {tok}\n")
    assert load_config(write(tmp_path, text)).bearer() == "file-token-123"


def test_bad_public_key_and_piece_size(tmp_path: Path) -> None:
    path = write(tmp_path, minimal(tmp_path, "bittorrent:\n  piece_size: 100000\n")
                 .replace(KEY, "xyz"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "trainer_public_key" in str(e.value) and "bittorrent.piece_size" in str(e.value)


def test_not_yaml_and_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "node: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_seed_mode_only_for_trainer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="seed_mode"):
        load_config(write(tmp_path, minimal(tmp_path, "seed_mode: true\n")))


def test_command_hook_with_an_unknown_placeholder_fails_at_load(tmp_path):
    from daemon.config import CommandHook

    with pytest.raises(ValueError, match="may be substituted"):
        CommandHook(type="command", argv=["reload", "{verison}"])
    ok = CommandHook(type="command", argv=["reload", "{version}", "{path}"])
    assert ok.argv[1] == "{version}"
