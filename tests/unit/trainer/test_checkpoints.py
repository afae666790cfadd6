"""Checkpoint directories as versions (trainer.checkpoints, trainer.ckpt_cli.Watcher) on real
safetensors files and a real chain dir: every kind of partial checkpoint is refused with the
reason, a directory is published once, a publish cut short by a crash is recognised after a
restart, and an abandoned torn step is passed only once it is stale and a later one is whole."""

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from chain import keys
from chain.errors import ChainError
from chain.sources import FileSource, StateDictSource, source_digest
from daemon.cli import main as cli_main
from trainer.checkpoints import CheckpointPublisher, Incomplete, inspect_checkpoint, settled
from trainer.ckpt_cli import Watcher, WatchSection


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(16, 32, generator=g).to(torch.bfloat16)
            for i in range(4)}


def _write(d: Path, state: dict[str, torch.Tensor], sharded: bool = True) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "tokenizer.json").write_text('{"v": 1}')
    (d / "trainer_state.json").write_text('{"global_step": 1}')
    names = sorted(state)
    if not sharded:
        save_file(state, str(d / "model.safetensors"))
        return d
    shards = {"model-00001-of-00002.safetensors": names[:2],
              "model-00002-of-00002.safetensors": names[2:]}
    for fname, part in shards.items():
        save_file({k: state[k] for k in part}, str(d / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def _publisher(tmp_path: Path) -> CheckpointPublisher:
    if not (tmp_path / "k").exists():
        keys.generate(tmp_path / "k")
    return CheckpointPublisher(tmp_path / "chain", tmp_path / "k", "r", tmp_path / "pub")


def test_a_whole_checkpoint_carries_config_and_tokenizer_but_not_training_state(tmp_path):
    ck = inspect_checkpoint(_write(tmp_path / "s", _state(0)))
    assert ck.weights == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    assert ck.files == ("config.json", "tokenizer.json")


@pytest.mark.parametrize("damage, reason", [
    (lambda d: (d / "model.safetensors.index.json").unlink(), "no model.safetensors.index"),
    (lambda d: (d / "model-00002-of-00002.safetensors").unlink(), "the index names"),
    (lambda d: _truncate(d / "model-00002-of-00002.safetensors", 100), "still being written"),
    (lambda d: _keep(d / "model-00001-of-00002.safetensors", 20), "header not readable"),
    (lambda d: (d / "config.json").write_text('{"model_'), "config.json missing or not"),
    (lambda d: (d / "model.safetensors.index.json").write_text('{"weight'), "not a complete"),
    (lambda d: save_file({"other": torch.zeros(2)}, str(d / "model-00002-of-00002.safetensors")),
     "which lacks it"),
])
def test_each_kind_of_partial_checkpoint_is_refused_with_its_reason(tmp_path, damage, reason):
    d = _write(tmp_path / "s", _state(0))
    damage(d)
    with pytest.raises(Incomplete, match=reason):
        inspect_checkpoint(d)


def _truncate(path: Path, drop: int) -> None:
    _keep(path, path.stat().st_size - drop)


def _keep(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def test_a_marker_is_required_when_configured_and_settling_catches_a_rewrite(tmp_path):
    d = _write(tmp_path / "s", _state(0), sharded=False)
    with pytest.raises(Incomplete, match="marker file COMPLETE"):
        inspect_checkpoint(d, marker="COMPLETE")
    (d / "COMPLETE").touch()
    assert inspect_checkpoint(d, marker="COMPLETE").files == ("config.json", "tokenizer.json")
    rewrite = threading.Timer(0.1, lambda: save_file(_state(1), str(d / "model.safetensors")))
    rewrite.start()
    with pytest.raises(Incomplete, match="changed during"):
        settled(d, 1.5)
    rewrite.join()


def test_each_directory_is_published_once_and_a_crash_after_the_chain_write_is_recognised(
        tmp_path):
    pub = _publisher(tmp_path)
    a, b = _write(tmp_path / "a", _state(0)), _write(tmp_path / "b", _state(1), sharded=False)
    assert pub.publish(inspect_checkpoint(a), step=10).version == 0
    assert pub.publish(inspect_checkpoint(b), step=20).version == 1
    with pytest.raises(ChainError, match="already published as v0"):
        pub.publish(inspect_checkpoint(a))
    # A crash after v1 reached the chain, before the ledger recorded it.
    doc = json.loads(pub.ledger_path.read_text())
    doc["pending"] = doc["published"].pop()
    pub.ledger_path.write_text(json.dumps(doc))
    again = _publisher(tmp_path)
    assert again.last_step() == 20 and again.was_published(b)["version"] == 1
    m = again.store.get(1, "delta")
    assert m.state_digest == source_digest(StateDictSource(_state(1)))
    head = FileSource(again.head_dir.current().path)
    assert source_digest(head) == m.state_digest


def test_a_torn_step_blocks_later_ones_until_it_is_stale_then_is_passed(tmp_path):
    root = tmp_path / "ckpts"
    _write(root / "step_1", _state(1))
    _write(root / "step_2", _state(2))
    _truncate(root / "step_2" / "model-00002-of-00002.safetensors", 64)  # writer killed
    _write(root / "step_3", _state(3), sharded=False)
    (root / "step_3.tmp").mkdir()  # not a step name: ignored
    pub = _publisher(tmp_path)
    w = Watcher(pub, root, WatchSection(settle_s=0.2, abandon_s=60, poll_s=0.1))
    assert w.scan() == []  # nothing has been seen unchanged for settle_s yet
    time.sleep(0.3)
    assert w.scan() == [1]  # step 2 is torn and recent: step 3 waits
    hour_ago = time.time() - 3600
    for f in [root / "step_2", *(root / "step_2").iterdir()]:
        os.utime(f, (hour_ago, hour_ago))  # left torn long ago (the writer died)
    assert w.scan() == [3]
    assert [(p["step"], p["version"]) for p in pub.published()] == [(1, 0), (3, 1)]
    assert pub.store.get(1, "delta").state_digest == source_digest(StateDictSource(_state(3)))
    assert Watcher(_publisher(tmp_path), root, w.cfg).scan() == []  # restart: nothing again


def test_publish_command_reports_a_bad_config_and_an_incomplete_directory(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("run: r\n")
    assert cli_main(["publish", str(tmp_path), "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "chain_dir" in capsys.readouterr().err
    keys.generate(tmp_path / "k")
    (tmp_path / "ok.yaml").write_text("run: r\nchain_dir: chain\nkey: k\nstate_dir: pub\n"
                                      "watch: {settle_s: 0}\n")
    d = _write(tmp_path / "s", _state(0))
    (d / "model.safetensors.index.json").unlink()
    assert cli_main(["publish", str(d), "--config", str(tmp_path / "ok.yaml")]) == 2
    assert "no model.safetensors.index.json" in capsys.readouterr().err
    _write(d, _state(0))
    assert cli_main(["publish", str(d), "--config", str(tmp_path / "ok.yaml")]) == 0
    assert "as v0" in capsys.readouterr().out


def test_a_checkpoint_rewritten_while_it_is_read_is_not_signed(tmp_path, monkeypatch):
    import trainer.checkpoints as ck

    pub = _publisher(tmp_path)
    pub.publish(inspect_checkpoint(_write(tmp_path / "a", _state(0))))
    b = _write(tmp_path / "b", _state(1))
    seen = inspect_checkpoint(b)
    real = ck.write_artifact

    def trainer_saves_again(*args, **kwargs):
        out = real(*args, **kwargs)
        save_file({k: v for k, v in _state(2).items() if k < "layers.2"},
                  str(b / "model-00001-of-00002.safetensors"))
        return out

    monkeypatch.setattr(ck, "write_artifact", trainer_saves_again)
    with pytest.raises(Incomplete, match="changed while it was being published"):
        pub.publish(seen)
    assert pub.store.head() == 0 and pub.ledger["pending"] is None
    monkeypatch.setattr(ck, "write_artifact", real)
    assert pub.publish(inspect_checkpoint(b)).version == 1
