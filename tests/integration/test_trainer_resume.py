"""The reference trainer (`python -m trainer.main`, a real process) restarts into its last
published version: after a kill -9 at v1 it resumes without a second warm-up and publishes v2
and v3 on top of v1, the chain verifies with the trainer's key, and v3 rebuilt from the chain is
bit-identical to the trainer's own v3. Also the crash window between checkpoint and publish: a
checkpoint one version ahead of the chain head is published on restart. Trajectories are real
rollouts of the published v0 weights (the built-in torch engine)."""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from chain import keys
from chain.sources import StateDictSource, source_digest
from chain.store import ChainStore
from chain.weights import WeightsDir
from tests.integration.harness import ROOT, free_port, http, wait_until
from trainer.ingest import IngestStore

TOKEN = "resume-test-token"
HOST = "127.0.0.80"
MODEL = {"seed": 0, "hidden": 32, "layers": 1, "heads": 2}
GROUP = 4
# Enough supervised warm-up (about 1 s here) that rollouts earn graded rewards: with 5 steps
# every reward was 0, every advantage 0, and no version changed a single weight.
WARMUP = {"steps": 60, "lr": 0.01, "batch": 32}


class Trainer:
    """`python -m trainer.main --config cfg.yaml` with a tiny config and no daemon."""

    def __init__(self, root: Path, steps: int) -> None:
        self.root = root
        self.port = free_port(HOST)
        self.chain_dir = root / "chain"
        self.state_dir = root / "state"
        self.key = root / "trainer.key"
        self.cfg_path = root / "trainer.yaml"
        self.log_path = root / "trainer.log"
        self.proc: subprocess.Popen | None = None
        self.public_key = keys.generate(self.key).public_key()
        self.write_config(steps)

    def write_config(self, steps: int) -> None:
        self.cfg_path.write_text(yaml.safe_dump({
            "run": "resume-test", "state_dir": str(self.state_dir),
            "chain_dir": str(self.chain_dir), "key": str(self.key),
            "daemon": {"url": None}, "ingest": {"host": HOST, "port": self.port, "token": TOKEN},
            "model": MODEL, "warmup": WARMUP, "steps": steps, "batch": 8,
            "wait_timeout_s": 90, "block_size": 1 << 16,
        }))

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.main", "--config", str(self.cfg_path)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"trainer exited {self.proc.returncode}:\n{self.log()}")
        return True

    def events(self) -> list[dict[str, Any]]:
        path = self.state_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_event(self, event: str, version: int, timeout: float) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            self.alive()
            return next((e for e in self.events()
                         if e["event"] == event and e.get("version") == version), None)
        return wait_until(found, timeout, f"a {event} event at v{version}")

    def ingest(self, batch: list[dict[str, Any]]) -> None:
        body = "\n".join(json.dumps(t) for t in batch).encode()
        code, raw, _ = http(f"http://{HOST}:{self.port}/v1/ingest", body, token=TOKEN,
                            content_type="application/x-ndjson")
        assert code == 200 and json.loads(raw)["held"] == [t["id"] for t in batch], raw[:300]

    def wait_ingest(self, timeout: float = 60) -> None:
        wait_until(lambda: self.alive() and http(f"http://{HOST}:{self.port}/healthz",
                                                 token=None, timeout=2)[0] == 200,
                   timeout, "the trainer's ingest endpoint")

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"trainer still running after {timeout}s:\n{self.log()}"
                                 ) from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def store(self) -> ChainStore:
        return ChainStore(self.chain_dir, self.public_key)


def rebuild(store: ChainStore, version: int, root: Path):
    """Reconstruct `version` from the chain into a fresh weights dir, verified."""
    wd = WeightsDir(root)
    cur = wd.apply(store.plan(None, version), get_block=lambda b: store.blocks.get(b.id, b.size))
    assert wd.verify() == cur
    return cur


def rollouts(store: ChainStore, version: int, root: Path, prompts: int, seed: int
             ) -> list[dict[str, Any]]:
    """`prompts` groups of GROUP real samples from the published `version` (as a worker would)."""
    from rollout.engine_torch import TorchEngine
    from rollout.tasks.arithmetic import make_task
    from rollout.worker import build_trajectories

    cur = rebuild(store, version, root)
    task = make_task()
    engine = TorchEngine(str(cur.path), version=version)
    completions = engine.generate(task.sample_prompts(random.Random(seed), prompts), n=GROUP,
                                  max_tokens=6, temperature=1.0, seed=seed)
    return build_trajectories(completions, task, GROUP, region="test", worker="test")


def bf16_digest_of_checkpoint(path: Path) -> str:
    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    return source_digest(StateDictSource({k: v.to(torch.bfloat16).contiguous()
                                          for k, v in state.items()}))


def verify_cli(chain_dir: Path, key: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "chain", "verify", str(chain_dir), "--key",
         keys.public_hex(keys.load_private(key))],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_trainer_killed_at_v1_resumes_without_warmup_and_publishes_v2_v3(tmp_path: Path) -> None:
    t = Trainer(tmp_path, steps=3)
    try:
        t.start()
        wait_until(lambda: t.alive() and t.store().head() == 0, 90, "v0 to be published")
        batches = rollouts(t.store(), 0, tmp_path / "w0", prompts=6, seed=1)
        t.wait_ingest()
        t.ingest(batches[:8])
        v1 = t.chain_dir / "manifests" / "v00000001.delta.json"
        wait_until(lambda: t.alive() and v1.exists(), 60, "v1 to be published", interval=0.005)
        t.kill9()  # maybe before the ingest commit and the step record: resume must cope
        killed_after_step = any(e["event"] == "step" for e in t.events())

        t.start()
        resume = t.wait_event("resume", 1, 90)
        t.wait_ingest()
        t.ingest(batches[8:16])
        t.ingest(batches[16:])
        assert t.wait_exit(90) == 0, t.log()
    finally:
        t.stop()

    events = t.events()
    kinds = [e["event"] for e in events]
    assert kinds.count("warmup") == 1, kinds
    assert kinds.count("resume") == 1 and resume["version"] == 1
    steps = [e for e in events if e["event"] == "step"]
    assert [e["version"] for e in steps] == [1, 2, 3][1 - killed_after_step:], kinds
    assert all(e["kept"] == 8 and e["dropped_stale"] == 0 for e in steps), steps
    assert events[-1] == {**events[-1], "event": "done", "version": 3}

    ingest = IngestStore(t.state_dir / "ingest").stats()
    assert (ingest["held"], ingest["consumed"], ingest["pending"]) == (24, 24, 0), ingest

    out = verify_cli(t.chain_dir, t.key)
    assert "4 ok, 0 bad" in out, out
    store = t.store()
    assert store.head() == 3
    assert [store.get(v, "delta").parent.version for v in (1, 2, 3)] == [0, 1, 2]
    v3 = rebuild(store, 3, tmp_path / "w3")
    assert v3.state_digest == store.get(3, "delta").state_digest
    assert bf16_digest_of_checkpoint(t.state_dir / "ckpt-v3.pt") == v3.state_digest
    digests = [store.get(0, "snapshot").state_digest] + [
        store.get(v, "delta").state_digest for v in (1, 2, 3)]
    assert len(set(digests)) == 4, "a GRPO step left the bf16 weights unchanged"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_crash_between_checkpoint_and_publish_republishes_without_retraining(tmp_path: Path
                                                                            ) -> None:
    """The trainer really crashes after `save_checkpoint(v1)` and before `publish(v1)`: a
    directory squats on the v1 manifest's path, so writing it fails. On restart (path freed)
    the trainer publishes v1 from its checkpoint and does not train the batch inside ckpt-v1 a
    second time: v2 is made from fresh trajectories only."""
    t = Trainer(tmp_path, steps=2)
    try:
        t.start()
        wait_until(lambda: t.alive() and t.store().head() == 0, 90, "v0 to be published")
        t.wait_ingest()
        first = rollouts(t.store(), 0, tmp_path / "w0", prompts=4, seed=2)
        squat = t.chain_dir / "manifests" / "v00000001.delta.json"
        squat.mkdir()
        (squat / "x").write_bytes(b"")
        t.ingest(first[:8])
        assert t.wait_exit(60) != 0
        published = sorted(p.name for p in (t.chain_dir / "manifests").glob("v*.json")
                           if p.is_file())
        assert (t.state_dir / "ckpt-v1.pt").exists(), t.log()
        assert published == ["v00000000.snapshot.json"], published
        assert "v00000001.delta.json" in t.log()
        expected = bf16_digest_of_checkpoint(t.state_dir / "ckpt-v1.pt")
        (squat / "x").unlink()
        squat.rmdir()

        t.start()
        t.wait_event("resume", 1, 90)
        assert t.store().head() == 1
        t.wait_ingest()  # the resume publishes before the ingest endpoint listens
        t.ingest(first[8:])
        step = t.wait_event("step", 2, 60)
        assert t.wait_exit(60) == 0, t.log()
    finally:
        t.stop()

    kinds = [e["event"] for e in t.events()]
    assert kinds.count("warmup") == 1 and kinds.count("step") == 1, kinds
    assert step["kept"] == 8
    ingest = IngestStore(t.state_dir / "ingest").stats()
    assert (ingest["held"], ingest["consumed"], ingest["pending"]) == (16, 16, 0), \
        f"the batch inside ckpt-v1 was handed out again after the restart: {ingest}"
    assert "3 ok, 0 bad" in verify_cli(t.chain_dir, t.key)
    store = t.store()
    assert store.get(1, "delta").state_digest == expected
    assert rebuild(store, 2, tmp_path / "w2").state_digest == store.get(2, "delta").state_digest
