"""Engine first, with real processes: a region daemon hands each verified delta to a real rollout
worker (the built-in torch engine) as a patch file, and the worker generates with version N
while the daemon's disk still holds an older version; a worker killed mid-way comes back on a
verified version (the disk's, then the patches); a region killed -9 during its deferred disk
catch-up restarts verified and converges, disk and engine on the trainer's state digest."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.harness import ROOT, TOKEN, Cluster, step
from tests.support import wait_until
from trainer.model import build_default_model, hf_files, state_dict_as


def _model(hidden: int = 128, layers: int = 2) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    model, tok = build_default_model(seed=0, hidden=hidden, layers=layers)
    return state_dict_as(model, torch.bfloat16), hf_files(model, tok)


def _phases(d) -> dict[int, dict]:
    ef = d.status()["detail"]["sync"]["engine_first"]
    return {p["version"]: p for p in ef["versions"]}


def _served(d, version: int, worker: str, how: str | None = None) -> bool:
    s = _phases(d).get(version, {}).get("served", {}).get(worker)
    return s is not None and (how is None or s["how"] == how)


class Worker:
    """`python -m rollout.worker` against a daemon, as its own process."""

    def __init__(self, root: Path, daemon_url: str, name: str) -> None:
        self.name, self.url = name, daemon_url
        self.log_path = root / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the child)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout.worker", "--daemon", self.url, "--token", TOKEN,
             "--worker", self.name, "--prompts-per-batch", "2", "--group-size", "2",
             "--max-tokens", "2", "--poll-timeout-s", "5", "--threads", "1"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
            stderr=subprocess.STDOUT)
        log.close()

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill9()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_engine_serves_each_version_from_its_patch_before_the_disk(tmp_path: Path) -> None:
    state, files = _model()
    # the disk catch-up waits (batch of 100, an hour idle) so the order is deterministic
    with Cluster(tmp_path / "c") as c:
        c.trainer()
        r1 = c.region("r1", sync={"disk_batch_versions": 100, "disk_idle_s": 3600})
        c.start_all()
        w = Worker(tmp_path, r1.url, "w1")
        try:
            c.publisher().publish(0, state, files)
            c.wait_all_at(0, 120)
            w.start()
            wait_until(lambda: _served(r1, 0, "w1", "load"), 120, "the worker to load v0",
                       interval=0.3)
            states = [state]
            for v in (1, 2):
                states.append(step(states[-1], v))
                c.publisher().publish(v, states[-1], files)
            wait_until(lambda: _served(r1, 2, "w1", "patch"), 120,
                       "the worker to serve v2 from its patch", interval=0.3)
            st = r1.status()
            ph = _phases(r1)
            assert st["current_version"] == 0, "the disk was not meant to move yet"
            assert not (r1.state_dir / "weights" / "v00000002").exists()
            assert _served(r1, 1, "w1", "patch")
            assert st["detail"]["sync"]["engine_first"]["pending"] == [1, 2]
            for v in (1, 2):
                assert ph[v]["decoded_s"] >= 0 and ph[v]["patch_written_s"] >= 0
                assert "disk_current_s" not in ph[v]
            assert (r1.state_dir / "patches" / "v00000002.patch").is_file()

            # a worker restarted mid-way loads the verified disk version, then the patches
            w.kill9()
            w2 = Worker(tmp_path, r1.url, "w2")
            w2.start()
            try:
                wait_until(lambda: _served(r1, 2, "w2", "patch"), 120,
                           "the restarted worker to come back on v2", interval=0.3)
                assert _served(r1, 0, "w2", "load")
            finally:
                w2.stop()
        except AssertionError:
            print(w.log())
            print(r1.log())
            raise
        finally:
            w.stop()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_region_killed_during_its_disk_catch_up_restarts_verified(tmp_path: Path) -> None:
    state, files = _model(hidden=512, layers=4)  # ~13M parameters: the catch-up takes a while
    with Cluster(tmp_path / "c") as c:
        c.trainer()
        r1 = c.region("r1", sync={"disk_batch_versions": 3, "disk_idle_s": 3600})
        c.start_all()
        c.publisher().publish(0, state, files)
        c.wait_all_at(0, 120)
        states = [state]
        for v in (1, 2, 3):
            states.append(step(states[-1], v))
            c.publisher().publish(v, states[-1], files)
        staging = r1.state_dir / "weights" / ".staging-v00000003.delta"
        deadline = time.monotonic() + 120
        while not staging.exists() and time.monotonic() < deadline \
                and r1.current() != 3:
            time.sleep(0.001)
        during = staging.exists()
        r1.kill9()
        print(f"killed with the catch-up {'under way' if during else 'not under way'}")
        r1.start()
        r1.wait_ready(120)
        c.wait_all_at(3, 180)
        st = r1.status()
        want = c.publisher().store.manifest("v00000003.delta").state_digest
        assert st["state_digest"] == want
        assert st["weights_problem"] is None
        wait_until(lambda: not list((r1.state_dir / "weights").glob(".staging-*")), 30,
                   "no staging directory left")
        # the restarted region verifies its disk version from scratch: every digest recomputed
        from chain.weights import WeightsDir

        r1.stop()
        assert WeightsDir(r1.state_dir / "weights").verify().state_digest == want
