"""`deltaswarm init` to a running swarm with the generated files unchanged: a trainer node's
daemon and two regions start from them, `deltaswarm publish` (publish.yaml) publishes two HF
checkpoints, and both regions hold the second one bit-exact."""

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from chain.config_base import ConfigError
from daemon.config import load_config
from rollout.ports import free_port_block
from tests.integration.harness import ROOT, http, step, tiny_model
from tests.support import wait_until
from trainer.ckpt_cli import load_publish_config
from trainer.ingest_service import load_ingest_config

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def cli(*argv: str, timeout: float = 180) -> str:
    proc = subprocess.run([sys.executable, "-m", "daemon.cli", *argv], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def checkpoint(d: Path, state: dict[str, torch.Tensor]) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    save_file(state, str(d / "model.safetensors"))
    return d


def test_init_writes_a_swarm_that_runs_as_written(tmp_path: Path) -> None:
    base = free_port_block(32, step=10)
    out = cli("init", str(tmp_path / "swarm"), "--regions", "eu,us", "--base-port", str(base))
    d = tmp_path / "swarm"
    public = out.split("trainer public key ", 1)[1].split(")", 1)[0]
    assert stat.S_IMODE((d / "token").stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "trainer.key").stat().st_mode) == 0o600
    token = (d / "token").read_text().strip()
    configs = {"trainer": d / "trainer.yaml", "eu": d / "regions" / "eu.yaml",
               "us": d / "regions" / "us.yaml"}
    cfgs = {n: load_config(p) for n, p in configs.items()}  # state dirs exist, token readable
    assert {c.trainer_public_key for c in cfgs.values()} == {public}
    assert cfgs["eu"].bootstrap == [cfgs["trainer"].http.url()]
    ingest = load_ingest_config(d / "ingest.yaml")
    assert cfgs["us"].trajectories.upstream == f"http://127.0.0.1:{ingest.port}/v1/ingest"
    assert load_publish_config(d / "publish.yaml").chain_dir == cfgs["trainer"].state_dir / "chain"
    # a second init into the same directory keeps the key and token
    again = subprocess.run([sys.executable, "-m", "daemon.cli", "init", str(d)], cwd=ROOT,
                           env=ENV, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr
    assert (d / "token").read_text().strip() == token

    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, path in configs.items():
            log = open(tmp_path / f"{name}.log", "ab")  # noqa: SIM115 (owned by the child)
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "daemon.cli", "daemon", "--config", str(path)],
                cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)
            log.close()
        for name, cfg in cfgs.items():
            wait_until(lambda cfg=cfg, name=name: procs[name].poll() is None and http(
                f"{cfg.http.url()}/healthz", token=None, timeout=2)[0] == 200, 90,
                f"{name} to serve /healthz")
        state = tiny_model(0)
        for v in (0, 1):
            state = state if v == 0 else step(state, v)
            ckpt = checkpoint(tmp_path / f"step_{v}", state)
            assert f"as v{v}" in cli("publish", str(ckpt), "--config", str(d / "publish.yaml"))

        def current(name: str) -> int | None:
            code, body, _ = http(f"{cfgs[name].http.url()}/v1/status", token=token)
            return json.loads(body)["current_version"] if code == 200 else None

        wait_until(lambda: current("eu") == 1 and current("us") == 1, 180,
                   "both regions to hold v1")
        for name in ("eu", "us"):
            got = load_file(str(cfgs[name].state_dir / "weights" / "current"
                                / "model.safetensors"))
            assert set(got) == set(state)
            for k, t in state.items():
                assert torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), (name, k)
    finally:
        codes = {}
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in procs.items():
            try:
                codes[name] = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait()
    assert codes == {n: 0 for n in configs}, (codes, [
        (tmp_path / f"{n}.log").read_text(errors="replace")[-2000:] for n in configs])


def test_init_refuses_bad_words_before_writing_anything(tmp_path: Path) -> None:
    from deploy.init import write
    for regions, base, what in (("eu,eu", 7600, "twice"), ("a b", 7600, "node name"),
                                ("eu", 80, "--base-port"), ("trainer", 7600, "twice")):
        try:
            write(tmp_path / "x", regions, "127.0.0.1", base)
            raise AssertionError(f"{regions!r} {base} was taken")
        except (ValueError, ConfigError) as e:
            assert what in str(e), e
        assert not (tmp_path / "x").exists()
