"""What `inspect_checkpoint` lets into a version (trainer.checkpoints, issue 20 findings 5, 7, 8,
9) on real files: only regular files inside the directory are read (a symbolic link out or in,
a named pipe config.json are refused without being opened), only the config, tokenizer,
generation config and chat template travel unless a pattern adds more, every name and header
field is checked by the manifest's own rules before any encoding, and a weights file truncated
while it is read raises `FileChanged` instead of killing the reader with SIGBUS."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from chain import keys
from chain.manifest import file_problem, tensor_problem
from chain.safetensors_io import FileChanged, NotRegular, ReadFiles, read_header
from trainer.checkpoints import (
    Changed,
    CheckpointPublisher,
    Refused,
    inspect_checkpoint,
)

ROOT = Path(__file__).resolve().parents[3]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16)
            for i in range(2)}


def _ckpt(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "tokenizer.json").write_text('{"v": 1}')
    save_file(_state(), str(d / "model.safetensors"))
    return d


def raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    """A safetensors file with exactly this header (what a buggy or hostile writer makes)."""
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def test_only_the_config_tokenizer_and_chat_template_travel_unless_a_pattern_adds_more(
        tmp_path):
    d = _ckpt(tmp_path / "s")
    for name in ("generation_config.json", "chat_template.jinja", "notes.txt", "README.md",
                 "preprocessor_config.json", "optimizer.pt", "trainer_state.json"):
        (d / name).write_text("x")
    assert inspect_checkpoint(d).files == ("chat_template.jinja", "config.json",
                                           "generation_config.json", "tokenizer.json")
    assert inspect_checkpoint(d, extra_files=("*.md", "preprocessor_*", "*.json")).files == (
        "README.md", "chat_template.jinja", "config.json", "generation_config.json",
        "preprocessor_config.json", "tokenizer.json")  # training state never travels


@pytest.mark.parametrize("name", ["notes copy.txt", "résumé.txt"])
def test_a_carried_name_no_manifest_can_hold_is_refused_naming_the_file(tmp_path, name):
    d = _ckpt(tmp_path / "s")
    (d / name).write_text("x")
    assert inspect_checkpoint(d).files == ("config.json", "tokenizer.json")  # not carried
    with pytest.raises(Refused, match=rf"{name}.*cannot travel.*name: String should match"):
        inspect_checkpoint(d, extra_files=("*.txt",))


def test_a_symbolic_link_out_of_the_directory_is_refused_and_never_read(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text('{"api_key": "hunter2"}')
    d = _ckpt(tmp_path / "s")
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(secret)
    with pytest.raises(Refused, match=rf"tokenizer.json is a symbolic link to {secret}"):
        inspect_checkpoint(d)
    (d / "tokenizer.json").unlink()
    (d / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (d / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(Refused, match=r"model\.safetensors is a symbolic link"):
        inspect_checkpoint(d)
    (d / "notes").symlink_to(secret)  # not a file that travels: never looked at
    (d / "model.safetensors").unlink()
    (tmp_path / "elsewhere.safetensors").rename(d / "model.safetensors")
    assert inspect_checkpoint(d).files == ("config.json",)


def test_a_named_pipe_config_is_refused_without_blocking(tmp_path):
    d = _ckpt(tmp_path / "s")
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    with pytest.raises(Refused, match=r"config\.json is a named pipe"):
        inspect_checkpoint(d)
    with pytest.raises(NotRegular, match="named pipe"):
        read_header(d / "config.json")  # the read side refuses it too, never blocking


def test_a_file_larger_than_a_block_is_refused_before_it_is_read(tmp_path, monkeypatch):
    import trainer.checkpoints as ck

    d = _ckpt(tmp_path / "s")
    monkeypatch.setattr(ck, "MAX_FILE", 30)
    (d / "tokenizer.json").write_text("x" * 31)
    with pytest.raises(Refused, match=r"tokenizer\.json: 31 bytes is too large"):
        inspect_checkpoint(d)


@pytest.mark.parametrize("header, field", [
    ({"w": {"dtype": "BF16", "shape": [True, 4], "data_offsets": [0, 8]}},
     "malformed header entry"),
    ({"x" * 1025: {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}},
     "name: String should have at most 1024 characters"),
], ids=["bool-dimension", "long-name"])
def test_a_header_field_no_manifest_can_hold_is_refused_before_encoding(tmp_path, header,
                                                                        field):
    d = _ckpt(tmp_path / "s")
    raw_safetensors(d / "model.safetensors", header, bytes(8))
    with pytest.raises(Refused, match=f"model.safetensors.*{field}"):
        inspect_checkpoint(d)


def test_publish_command_names_the_file_and_field_instead_of_a_traceback(tmp_path, capsys):
    from daemon.cli import main as cli_main

    keys.generate(tmp_path / "k")
    (tmp_path / "p.yaml").write_text("run: r\nchain_dir: chain\nkey: k\nstate_dir: pub\n"
                                     "watch: {settle_s: 0, extra_files: ['*.txt']}\n")
    d = _ckpt(tmp_path / "s")
    (d / "notes copy.txt").write_text("n")
    assert cli_main(["publish", str(d), "--config", str(tmp_path / "p.yaml")]) == 2
    assert "notes copy.txt cannot travel with a version: name:" in capsys.readouterr().err
    (d / "notes copy.txt").rename(d / "notes.txt")
    assert cli_main(["publish", str(d), "--config", str(tmp_path / "p.yaml")]) == 0


def test_the_manifest_rules_are_the_ones_checked():
    assert tensor_problem("a", "bfloat16", [2, 3]) is None
    assert "shape.0" in tensor_problem("a", "bfloat16", [True, 3])
    assert "name" in tensor_problem("", "bfloat16", [1])
    assert file_problem("tokenizer.json", 3) is None
    assert "name" in file_problem("a b", 3)


def test_a_weights_file_truncated_while_it_is_read_raises_file_changed(tmp_path):
    d = _ckpt(tmp_path / "s")
    files = ReadFiles(d, ["model.safetensors"])
    try:
        before = files.bits("layers.1.weight").copy()
        base, _ = read_header(d / "model.safetensors")
        os.truncate(d / "model.safetensors", base + 100)  # the trainer rewrites it in place
        with pytest.raises(FileChanged, match=r"ended at byte .* layers\.1\.weight"):
            files.bits("layers.1.weight")
    finally:
        files.close()
    assert before.size == 8 * 16


def test_the_same_truncation_under_a_memory_map_is_a_sigbus(tmp_path):
    """Why the publisher reads a checkpoint with pread: the shared map it used dies."""
    d = _ckpt(tmp_path / "s")
    big = {"w": torch.zeros(1 << 20, dtype=torch.float32)}
    save_file(big, str(d / "model.safetensors"))
    code = ("import os, sys; from chain.safetensors_io import TensorFiles, read_header\n"
            "f = TensorFiles(sys.argv[1]); base, _ = read_header(sys.argv[1])\n"
            "os.truncate(sys.argv[1], base); print(int(f.bits('w')[-1]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(d / "model.safetensors")], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         timeout=120)
    assert out.returncode == -7  # SIGBUS


def test_a_publish_of_a_checkpoint_truncated_mid_read_is_changed_not_signed(tmp_path,
                                                                           monkeypatch):
    import trainer.checkpoints as ck

    keys.generate(tmp_path / "k")
    pub = CheckpointPublisher(tmp_path / "chain", tmp_path / "k", "r", tmp_path / "pub")
    d = _ckpt(tmp_path / "s")
    ckpt = inspect_checkpoint(d)
    real = ck.FileSource

    def opened_then_truncated(path, only=None):
        src = real(path, only=only)
        os.truncate(d / "model.safetensors", 64)
        return src

    monkeypatch.setattr(ck, "FileSource", opened_then_truncated)
    with pytest.raises(Changed, match="changed while it was being published; not signed"):
        pub.publish(ckpt)
    assert pub.store.head() is None and pub.ledger["pending"] is None
