"""Real `deltaswarm watch` and `deltaswarm publish` processes fed the checkpoints issue 20 broke
them with (findings 5, 7, 8, 9): a header dimension `true`, a tensor name over 1024
characters, a carried file named `notes copy.txt` or `résumé.md`, a tokenizer that is a
symbolic link out of the directory, a config.json that is a named pipe. Each is refused with
the file and field named, recorded in published.json (`watch --status` prints it), and the
next good step still publishes; SIGTERM stops the watcher at once, mid-publish too. A weights
file rewritten in place while `publish` reads it is reported as changed (and read again), never
a SIGBUS."""

import json
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from chain import keys
from chain.store import ChainStore
from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _state(seed: int, rows: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(rows, 64, generator=g).to(torch.bfloat16)
            for i in range(4)}


def _ckpt(d: Path, seed: int) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "tokenizer.json").write_text('{"v": 1}')
    save_file(_state(seed), str(d / "model.safetensors"))
    return d


def raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    """A safetensors file with exactly this header (what a buggy or hostile writer makes)."""
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def _config(tmp_path: Path, **watch) -> Path:
    keys.generate(tmp_path / "k")
    cfg = tmp_path / "publish.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": "r", "chain_dir": str(tmp_path / "chain"), "key": str(tmp_path / "k"),
        "state_dir": str(tmp_path / "pub"),
        "watch": {"settle_s": 0.3, "poll_s": 0.2, "abandon_s": 600, **watch}}))
    return cfg


def _start(args: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 (owned by the child)
    try:
        return subprocess.Popen([sys.executable, "-m", "daemon.cli", *args], cwd=ROOT, env=ENV,
                                stdout=out, stderr=subprocess.STDOUT)
    finally:
        out.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _ledger(tmp_path: Path) -> dict:
    path = tmp_path / "pub" / "published.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _head(chain: Path) -> int | None:
    return ChainStore(chain).head() if (chain / "manifests").exists() else None


def _reading(proc: subprocess.Popen, path: Path, tmp_path: Path) -> bool:
    """`proc` has begun encoding `path`: its version is pending and the file is open or mapped
    (inspecting it before does neither)."""
    if not _ledger(tmp_path).get("pending"):
        return False
    try:
        fds = [os.readlink(f) for f in Path(f"/proc/{proc.pid}/fd").iterdir()]
        return str(path) in fds or str(path) in Path(f"/proc/{proc.pid}/maps").read_text()
    except OSError:  # it exited meanwhile, or closed an fd as it was listed
        return False


def test_watch_refuses_each_bad_checkpoint_says_why_and_publishes_the_next(tmp_path):
    ckpts, secret = tmp_path / "ckpts", tmp_path / "secret.json"
    secret.write_text('{"password": "hunter2-outside-the-checkpoint"}')
    bad = {}
    d = _ckpt(ckpts / "step_1", 1)  # a header dimension that is a JSON boolean
    raw_safetensors(d / "model.safetensors",
                    {"w": {"dtype": "BF16", "shape": [True, 4], "data_offsets": [0, 8]}},
                    bytes(8))
    bad[1] = "step_1/model.safetensors.*tensor w has a malformed header entry"
    d = _ckpt(ckpts / "step_2", 2)  # a tensor name over 1024 characters
    save_file({"x" * 1100: torch.zeros(4)}, str(d / "model.safetensors"))
    bad[2] = "step_2/model.safetensors: tensor 'xxx.*name: String should have at most 1024"
    (_ckpt(ckpts / "step_3", 3) / "notes copy.txt").write_text("n")
    bad[3] = "step_3/notes copy.txt cannot travel.*name: String should match pattern"
    (_ckpt(ckpts / "step_4", 4) / "résumé.md").write_text("r")
    bad[4] = "step_4/résumé.md cannot travel"
    d = _ckpt(ckpts / "step_5", 5)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(secret)
    bad[5] = f"step_5/tokenizer.json is a symbolic link to {secret}"
    d = _ckpt(ckpts / "step_6", 6)
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    bad[6] = "step_6/config.json is a named pipe"
    _ckpt(ckpts / "step_7", 7)
    cfg = _config(tmp_path, extra_files=["*.txt", "*.md"])
    log = tmp_path / "watch.log"
    watcher = _start(["watch", str(ckpts), "--config", str(cfg)], log)
    try:
        # the ledger is written after the chain's head moves: wait for both (a CI run read
        # the ledger in between)
        wait_until(lambda: (_head(tmp_path / "chain") == 0 and _ledger(tmp_path).get("published"))
                   or watcher.poll() is not None, 120, "step 7 to be published")
        assert watcher.poll() is None, log.read_text()  # it goes on watching
        refused = {r["step"]: r["reason"] for r in _ledger(tmp_path)["refused"]}
        assert sorted(refused) == [1, 2, 3, 4, 5, 6], log.read_text()
        for step, reason in bad.items():
            assert re.search(reason, refused[step]), (step, refused[step])
            assert f"step {step} refused" in log.read_text()
        assert [(p["step"], p["version"]) for p in _ledger(tmp_path)["published"]] == [(7, 0)]
        # the same refusals in the chain dir, where the trainer daemon's status reads them
        from chain import refusals
        assert sorted(r["step"] for r in refusals.read(tmp_path / "chain")) == [1, 2, 3, 4, 5, 6]
        m = ChainStore(tmp_path / "chain").get(0, "snapshot")
        assert {f.name for f in m.files} == {"config.json", "tokenizer.json"}
        blocks = [p.read_bytes() for p in (tmp_path / "chain").rglob("*") if p.is_file()]
        assert not any(b"hunter2" in b for b in blocks)  # the file outside was never read
        status = subprocess.run([sys.executable, "-m", "daemon.cli", "watch", "--config",
                                 str(cfg), "--status"], cwd=ROOT, env=ENV, capture_output=True,
                                text=True, timeout=120)
        assert "last step 7 as v0" in status.stdout and "refused: 6" in status.stdout
        assert "config.json is a named pipe" in status.stdout
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(30) == 0
        assert "stopped by SIGTERM" in log.read_text()
    finally:
        _stop(watcher)


def test_a_named_pipe_config_neither_hangs_watch_nor_keeps_it_from_sigterm(tmp_path):
    ckpts = tmp_path / "ckpts"
    d = _ckpt(ckpts / "step_1", 1)
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")  # nobody ever writes into it
    log = tmp_path / "watch.log"
    watcher = _start(["watch", str(ckpts), "--config", str(_config(tmp_path))], log)
    try:
        try:
            # the ledger, not the log line: the refusal is logged a moment before it is recorded
            wait_until(lambda: _ledger(tmp_path).get("refused"), 60,
                       "step 1 to be recorded refused")
        finally:  # refused or not (the old watcher hung in open()), SIGTERM must stop it
            watcher.send_signal(signal.SIGTERM)
            rc = watcher.wait(30)
        assert rc == 0, log.read_text()
        assert "config.json is a named pipe" in _ledger(tmp_path)["refused"][0]["reason"]
    finally:
        _stop(watcher)


def _big_ckpt(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    state = {f"layers.{i}.weight": torch.randn(512, 512) for i in range(64)}  # 64 MiB, fp32
    save_file(state, str(d / "model.safetensors"))
    return d


def test_sigterm_stops_watch_in_the_middle_of_a_publish_and_a_restart_publishes_it(tmp_path):
    ckpts = tmp_path / "ckpts"
    weights = _big_ckpt(ckpts / "step_1") / "model.safetensors"
    cfg = _config(tmp_path, settle_s=0)
    log = tmp_path / "watch.log"
    watcher = _start(["watch", str(ckpts), "--config", str(cfg)], log)
    try:
        wait_until(lambda: _reading(watcher, weights, tmp_path) or watcher.poll() is not None, 120,
                   "the watcher to start encoding step 1", interval=0.001)
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(60) == 0, log.read_text()
    finally:
        _stop(watcher)
    assert "stopped by SIGTERM" in log.read_text()  # not after the publish: in the middle
    assert _head(tmp_path / "chain") is None and _ledger(tmp_path)["pending"] is None
    watcher = _start(["watch", str(ckpts), "--config", str(cfg)], log)
    try:
        wait_until(lambda: _head(tmp_path / "chain") == 0, 120, "step 1 to be published")
    finally:
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(60)
        _stop(watcher)
    assert [(p["step"], p["version"]) for p in _ledger(tmp_path)["published"]] == [(1, 0)]


def test_publish_reports_a_file_rewritten_in_place_while_read_never_a_sigbus(tmp_path):
    ckpt = _big_ckpt(tmp_path / "step_1")
    whole = (ckpt / "model.safetensors").read_bytes()
    cfg = _config(tmp_path, settle_s=0)
    log = tmp_path / "publish.log"
    proc = _start(["publish", str(ckpt), "--config", str(cfg)], log)
    try:
        wait_until(lambda: _reading(proc, ckpt / "model.safetensors", tmp_path)
                   or proc.poll() is not None, 120, "the publish to open the weights to encode",
                   interval=0.001)
        with open(ckpt / "model.safetensors", "r+b") as f:  # the trainer saves again in place
            f.truncate(0)
        assert proc.wait(120) == 2, log.read_text()
    finally:
        _stop(proc)
    out = log.read_text()
    assert "changed while it was being published; not signed" in out, out
    assert _head(tmp_path / "chain") is None
    (ckpt / "model.safetensors").write_bytes(whole)  # the save finishes: publish takes it
    proc = _start(["publish", str(ckpt), "--config", str(cfg)], log)
    try:
        assert proc.wait(120) == 0, log.read_text()
    finally:
        _stop(proc)
    assert _head(tmp_path / "chain") == 0
