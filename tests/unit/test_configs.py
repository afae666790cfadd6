"""Every config in configs/ parses with its own process's loader; every config field of every
process is documented; every loader names the file and all bad fields at once; and the demo's
per-process configs are built as objects that load back unchanged."""

import io
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from chain.config_base import ConfigError, read_yaml, to_yaml, undocumented, validate
from daemon.config import Config, load_config
from demo.config import DemoConfig, build_layout, load_demo_config, with_overrides, write_layout
from deploy.examples import KINDS, PRESETS, example, preset_text
from deploy.examples import main as examples_main
from rollout.config import WorkerConfig, parse_args
from trainer.ckpt_cli import PublishConfig, load_publish_config
from trainer.config import TrainerConfig, load_trainer_config
from trainer.ingest_service import IngestServiceConfig, load_ingest_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
KEY = "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c"


def load_worker(path: Path) -> WorkerConfig:
    return parse_args(["--config", str(path)])[0]


LOADERS = {  # which process reads which shipped file
    "trainer.yaml": lambda p: load_config(p, check_paths=False),
    "regions/*.yaml": lambda p: load_config(p, check_paths=False),
    "train.yaml": load_trainer_config,
    "rollout/*.yaml": load_worker,
    "demo.yaml": load_demo_config,
    "publish.yaml": load_publish_config,
    "ingest.yaml": load_ingest_config,
}


def shipped() -> list[tuple[Path, str]]:
    return sorted((p, pattern) for pattern in LOADERS for p in CONFIGS.glob(pattern))


@pytest.mark.parametrize(("path", "pattern"), shipped(),
                         ids=lambda v: str(v.relative_to(CONFIGS)) if isinstance(v, Path) else "")
def test_every_shipped_config_parses_with_its_loader(path, pattern):
    assert isinstance(LOADERS[pattern](path), BaseModel)


def test_every_file_in_configs_has_a_loader_and_every_process_an_example():
    covered = {p for p, _ in shipped()}
    assert set(CONFIGS.rglob("*.yaml")) == covered
    assert {pattern for _, pattern in shipped()} == set(LOADERS)


@pytest.mark.parametrize("model", [Config, TrainerConfig, WorkerConfig, DemoConfig,
                                   PublishConfig, IngestServiceConfig],
                         ids=lambda m: m.__name__)
def test_every_config_field_is_documented(model):
    assert undocumented(model) == []


@pytest.mark.parametrize(("text", "load"), [
    ("run: r\nstate_dir: s\nchain_dir: c\nkey: k\ningest: {port: 0, token: short}\n"
     "steps: 0\nsurprise: 1\n", load_trainer_config),
    ("daemon: ftp://x\ntoken: t\ngroup_size: 0\nsurprise: 1\nregion: 'a b'\n", load_worker),
    ("steps: 1\nbase_port: 80\nrollout: {group_size: 1}\nsurprise: 1\n", load_demo_config),
], ids=["trainer", "worker", "demo"])
def test_every_bad_field_is_named_at_once_with_the_file(tmp_path, capsys, text, load):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    try:
        load(path)
        raise AssertionError("the bad config loaded")
    except ConfigError as e:
        message = str(e)
    except SystemExit:  # the worker's argparse entry prints the same message and exits 2
        message = capsys.readouterr().err
    assert str(path) in message
    assert message.count("field ") >= 4, message
    assert "surprise" in message


def test_worker_flags_override_the_config_file():
    cfg, _ = parse_args(["--config", str(CONFIGS / "rollout" / "eu-west.yaml"),
                         "--group-size", "4"])
    assert cfg.group_size == 4 and cfg.region == "eu-west"


def _refused_worker(tmp_path, capsys, extra: str) -> tuple[Path, str]:
    """A worker config of the required fields plus `extra`, refused: its path and the error."""
    bad = tmp_path / "w.yaml"
    bad.write_text("daemon: http://x:1\ntoken: t\n" + extra)
    with pytest.raises(SystemExit):
        parse_args(["--config", str(bad)])
    return bad, capsys.readouterr().err


def test_worker_config_with_unknown_field_is_refused(tmp_path, capsys):
    _, err = _refused_worker(tmp_path, capsys, "surprise: 1\n")
    assert "surprise" in err


def test_a_vllm_worker_needs_its_servers_url_and_passes_it_to_the_engine(tmp_path, capsys):
    bad, err = _refused_worker(tmp_path, capsys, "engine: vllm\n")
    assert "engine: vllm needs vllm_url" in err
    cfg, _ = parse_args(["--config", str(bad), "--vllm-url", "http://127.0.0.1:8000"])
    assert cfg.engine_kwargs() == {"base_url": "http://127.0.0.1:8000", "model": "deltaswarm"}
    from rollout.engine import make_engine

    engine = make_engine(cfg.engine, **cfg.engine_kwargs())  # builds; nothing is dialled yet
    assert engine.hook.base_url == "http://127.0.0.1:8000" and engine.version is None


def test_relative_trainer_paths_resolve_against_the_config_file(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("run: r\nstate_dir: s\nchain_dir: ../c\nkey: k.key\n"
                    "ingest: {token: '12345678'}\nmodel: {path: hf}\n")
    cfg = load_trainer_config(path)
    assert cfg.state_dir == tmp_path / "s" and cfg.key == tmp_path / "k.key"
    assert cfg.chain_dir == tmp_path / ".." / "c" and cfg.model.path == tmp_path / "hf"


def test_demo_builds_every_process_config_as_objects_that_load_back(tmp_path):
    cfg = with_overrides(load_demo_config(CONFIGS / "demo.yaml"), steps=3, base_port=30000)
    layout = build_layout(cfg, tmp_path, KEY, token="demo-token-1234")
    paths = write_layout(layout, tmp_path)
    assert set(paths) == {"trainer", "trainer-daemon", *(f"{r}-{kind}" for r in cfg.regions
                                                          for kind in ("daemon", "worker"))}
    for name, daemon in layout.daemons.items():
        assert load_config(paths[f"{name}-daemon"]) == daemon
    for region, worker in layout.workers.items():
        assert load_worker(paths[f"{region}-worker"]) == worker
    assert load_trainer_config(paths["trainer"]) == layout.trainer
    assert layout.trainer.steps == 3 and layout.trainer.grpo == cfg.grpo
    # each region bootstraps from the one before it, the first from the trainer
    urls = layout.urls()
    assert layout.daemons[cfg.regions[0]].bootstrap == [urls["trainer"]]
    assert layout.daemons[cfg.regions[1]].bootstrap == [urls[cfg.regions[0]]]


def test_demo_overrides_are_validated():
    cfg = load_demo_config(CONFIGS / "demo.yaml")
    with pytest.raises(ConfigError, match="steps"):
        with_overrides(cfg, steps=0)
    assert to_yaml(with_overrides(cfg, steps=5)).count("steps: 5") == 1


def test_demo_workers_share_the_trainer_batch_when_paced():
    cfg = with_overrides(load_demo_config(CONFIGS / "demo.yaml"), batch=100, pace_ahead=2)
    workers = build_layout(cfg, Path("/tmp/x"), KEY, token="demo-token-1234").workers.values()
    assert [w.pace_per_version for w in workers] == [34, 34, 34]  # ceil(100 / 3) each
    assert {w.pace_ahead for w in workers} == {2}
    unpaced = build_layout(with_overrides(cfg, pace_ahead=None), Path("/tmp/x"), KEY,
                           token="demo-token-1234").workers.values()
    assert {w.pace_per_version for w in unpaced} == {None}


def test_demo_workers_sample_at_the_trainers_temperature():
    """The trainer recomputes log-probs at grpo.temperature; workers sampling at another one
    would make every importance ratio wrong."""
    cfg = with_overrides(load_demo_config(CONFIGS / "demo.yaml"), grpo={"temperature": 0.7})
    workers = build_layout(cfg, Path("/tmp/x"), KEY, token="demo-token-1234").workers.values()
    assert {w.temperature for w in workers} == {0.7}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_shipped_config_is_what_the_models_generate(name):
    """configs/ is generated (make configs): a default, field or description changed in code
    and not in the shipped file fails here, naming the command that fixes it."""
    assert (CONFIGS / name).read_text() == preset_text(name), (
        f"configs/{name} differs from what deploy/examples.py generates: run `make configs`")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_config_example_prints_every_field_with_its_description_and_loads_back(kind, tmp_path):
    text = io.StringIO()
    assert examples_main(["example", kind], out=text.write) == 0
    path = tmp_path / f"{kind}.yaml"
    path.write_text(text.getvalue())
    model = KINDS[kind].model
    loaded = validate(model, read_yaml(path), path, tagged=KINDS[kind].tagged)
    assert loaded == example(kind)
    for name, field in model.model_fields.items():  # every top-level field, documented
        assert f"\n{name}:" in text.getvalue(), name
        first = " ".join(field.description.split())[:40].rsplit(" ", 1)[0]
        assert first in " ".join(line.lstrip("# ") for line in text.getvalue().splitlines()), (
            name, first)


def test_config_example_set_overrides_a_field_and_bad_values_are_named(capsys):
    text = io.StringIO()
    assert examples_main(["example", "daemon", "--set", "http.port=7601", "--set",
                          "bootstrap=[http://10.0.0.1:7600]"], out=text.write) == 0
    doc = yaml.safe_load(text.getvalue())
    assert doc["http"]["port"] == 7601 and doc["bootstrap"] == ["http://10.0.0.1:7600"]
    assert examples_main(["example", "daemon", "--set", "http.port=99999", "--set",
                          "surprise=1"], out=text.write) == 2
    err = capsys.readouterr().err
    assert "http.port" in err and "surprise" in err
