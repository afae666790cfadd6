"""`deltaswarm watch` follows a directory a separate trainer process writes checkpoints into:
the writer is SIGKILLed mid-write (and later rewrites that step), the watcher itself is
SIGKILLed and restarted; every whole checkpoint is published once, in step order, through a
real trainer daemon, and a region daemon rebuilds each version bit-exactly."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from chain.sources import FileSource, StateDictSource, source_digest
from chain.store import ChainStore
from tests.integration.ckpt_writer import state_at
from tests.integration.harness import ROOT, TOKEN, Cluster
from tests.support import wait_until

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _writer(root: Path, steps: str, progress: Path, pause: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.integration.ckpt_writer", str(root),
                             "--steps", steps, "--progress", str(progress), "--pause",
                             str(pause)], cwd=ROOT, env=ENV)


def _watcher(ckpts: Path, cfg: Path, log: Path) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 (owned by the child)
    try:
        return subprocess.Popen([sys.executable, "-m", "daemon.cli", "watch", str(ckpts),
                                 "--config", str(cfg)], cwd=ROOT, env=ENV, stdout=out,
                                stderr=subprocess.STDOUT)
    finally:
        out.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _head(chain: Path) -> int | None:
    return ChainStore(chain).head() if chain.exists() else None


def test_watch_publishes_only_whole_checkpoints_in_order_across_kills(tmp_path: Path) -> None:
    ckpts, progress = tmp_path / "ckpts", tmp_path / "progress"
    ckpts.mkdir()
    procs: list[subprocess.Popen] = []
    with Cluster(tmp_path / "cluster") as c:
        t = c.trainer()
        r1 = c.region("r1")
        c.start_all()
        (tmp_path / "token").write_text(TOKEN + "\n")
        cfg = tmp_path / "publish.yaml"
        cfg.write_text(yaml.safe_dump({
            "run": c.run, "chain_dir": str(t.state_dir / "chain"), "key": str(c.key_path),
            "state_dir": str(tmp_path / "publish"),
            "daemon": {"url": t.url, "token_file": str(tmp_path / "token")},
            "watch": {"settle_s": 1.0, "poll_s": 0.2, "abandon_s": 600},
            "snapshot_every": 3}))
        log = tmp_path / "watch.log"
        chain = t.state_dir / "chain"
        try:
            watcher = _watcher(ckpts, cfg, log)
            procs.append(watcher)
            # Writer 1: steps 1-3 whole, then SIGKILL in the middle of step 4's second shard.
            w1 = _writer(ckpts, "1,2,3,4", progress, pause=0.05)
            procs.append(w1)
            wait_until(lambda: "4 model-00002-of-00002.safetensors 32768"
                       in progress.read_text(), 60, "writer 1 to be mid-way through step 4")
            w1.kill()
            w1.wait()
            wait_until(lambda: _head(chain) == 2, 60, "steps 1-3 to be published as v0-v2")
            # The torn step 4 stays unpublished however long it sits there.
            time.sleep(3)
            assert _head(chain) == 2, log.read_text()
            # The watcher dies too (SIGKILL) and comes back: it resumes after step 3.
            watcher.kill()
            watcher.wait()
            watcher = _watcher(ckpts, cfg, log)
            procs.append(watcher)
            # Writer 2 resumes the run: rewrites step 4 in place, then 5 and 6.
            w2 = _writer(ckpts, "4,5,6", progress, pause=0.01)
            procs.append(w2)
            assert w2.wait(120) == 0
            wait_until(lambda: _head(chain) == 5, 90, "steps 4-6 to be published")
            c.wait_all_at(5, 90)
        finally:
            for p in procs:
                _stop(p)
        store = ChainStore(chain)
        versions = sorted({m.version for m in store.manifests().values()})
        assert versions == list(range(6))
        for v in versions:  # version v is step v+1's checkpoint, bit for bit
            m = store.get(v, "delta") or store.get(v, "snapshot")
            assert m.state_digest == source_digest(StateDictSource(state_at(v + 1))), v
            assert {f.name for f in m.files} == {"config.json", "tokenizer.json"}
        assert [(p["step"], p["version"]) for p in yaml.safe_load(
            (tmp_path / "publish" / "published.json").read_text())["published"]] == \
            [(s, s - 1) for s in range(1, 7)]
        cur = r1.state_dir / "weights" / "current"
        got, want = FileSource(cur), StateDictSource(state_at(6))
        assert got.names() == want.names()
        for name in want.names():
            assert (got.bits(name) == want.bits(name)).all(), name
        assert (cur / "config.json").read_text() == (ckpts / "step_6" / "config.json").read_text()
        assert not (cur / "optimizer.pt").exists()
