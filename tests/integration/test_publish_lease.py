"""A publish retention cannot break (issue 20, findings 1 and 2), with a real trainer daemon and
`deltaswarm publish` / `watch` as real processes.

1. A publisher has written some blocks of v2 and waits for the rest of its input (the last
   tensor of the state dict), and a token holder's `POST /v1/publish {"version": 1}` makes the
   daemon run retention meanwhile: the publish still signs a whole v2 the daemon takes, and
   the next publish works (before: v2 lost blocks, the daemon refused it, the chain was
   wedged). The same with `deltaswarm publish` SIGSTOPped once its first block of v2 is on
   disk (where exactly it stops depends on timing; the first test does not).
2. A region behind at v1: the deltas the daemon keeps for it survive every `deltaswarm
   publish` and `watch`, however short their own `retention_versions` (before: they were
   deleted while the daemon's index still listed them).
"""

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from chain.policy import SnapshotPolicy
from chain.store import ChainStore
from tests.integration.harness import ROOT, TOKEN, Cluster, http, step, tiny_model
from tests.support import wait_until
from trainer.publisher import Publisher

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _config(tmp: Path, c: Cluster, **extra) -> Path:
    t = c.daemons["trainer"]
    (tmp / "token").write_text(TOKEN + "\n")
    cfg = tmp / "publish.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": c.run, "chain_dir": str(t.state_dir / "chain"), "key": str(c.key_path),
        "state_dir": str(tmp / "publish"), "block_size": 1 << 16,
        "daemon": {"url": t.url, "token_file": str(tmp / "token")},
        "watch": {"settle_s": 0.0, "poll_s": 0.2}, **extra}))
    return cfg


def _checkpoint(d: Path, state: dict[str, torch.Tensor]) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    save_file(state, str(d / "model.safetensors"))
    return d


def _cli(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "daemon.cli", *argv], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finished(proc: subprocess.Popen, timeout: float = 180) -> str:
    """Its output once it exited; killed (by pid) if it did not within `timeout`."""
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _published(proc: subprocess.Popen, version: int) -> None:
    out = _finished(proc)
    assert proc.returncode == 0, out
    assert f"as v{version}" in out and "daemon not told" not in out, out


def _whole(chain: Path) -> None:
    store = ChainStore(chain)
    for a, m in store.manifests().items():
        assert store.missing_blocks(m) == [], f"{a} lost blocks"


class _LateState(Mapping):
    """A trainer's state dict whose last tensor is not ready yet: reading it waits for `go`."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state, self.late = state, sorted(state)[-1]
        self.reached, self.go = threading.Event(), threading.Event()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == self.late and not self.go.is_set():
            self.reached.set()
            self.go.wait(300)
        return self.state[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def test_retention_during_a_publish_leaves_every_block_of_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("chain.writer.BATCH_ELEMENTS", 1)  # blocks go out tensor by tensor
    with Cluster(tmp_path / "cluster") as c:
        t = c.trainer(retention={"versions": 1})
        c.start_all()
        chain = t.state_dir / "chain"
        pub = Publisher(chain, c.key_path, c.run, t.url, TOKEN, SnapshotPolicy(every=1000),
                        block_size=1 << 16)
        state = tiny_model(0)
        for v in range(2):
            assert pub.publish(v, state).notified
            state = step(state, v + 1)
        state = step(state, 2, density=0.5)  # a large delta: blocks for every tensor
        before = ChainStore(chain).blocks.ids()
        late = _LateState(state)
        out: list = []
        writer = threading.Thread(target=lambda: out.append(pub.publish(2, late)))
        writer.start()
        try:
            assert late.reached.wait(120), "the publisher never got to the last tensor"
            assert ChainStore(chain).blocks.ids() - before, "no block of v2 written yet"
            code, body, _ = http(f"{t.url}/v1/publish", b'{"version": 1}', timeout=60)
            assert code == 200, body
        finally:
            late.go.set()
            writer.join(120)
        assert out and out[0].notified, f"the daemon refused v2:\n{t.log()}"
        _whole(chain)
        assert pub.publish(3, step(state, 3)).notified
        _whole(chain)


def test_a_publish_paused_mid_write_survives_the_daemons_retention(tmp_path: Path) -> None:
    with Cluster(tmp_path / "cluster") as c:
        t = c.trainer(retention={"versions": 1})
        c.start_all()
        cfg = _config(tmp_path, c, snapshot_every=1)  # a snapshot per version: many blocks
        chain = t.state_dir / "chain"
        state = tiny_model(0, tensors=4, rows=1024, cols=1024)  # 8 MiB: 128 blocks a snapshot
        for v in range(2):
            _published(_cli("publish", str(_checkpoint(tmp_path / f"step_{v}", state)),
                            "--config", str(cfg)), v)
            state = step(state, v + 1)
        before = ChainStore(chain).blocks.ids()
        blocks = chain / "blocks"
        pub = _cli("publish", str(_checkpoint(tmp_path / "step_2", state)), "--config", str(cfg))
        try:
            wait_until(lambda: pub.poll() is not None or any(
                p.name not in before for p in blocks.glob("??/*") if not p.name.startswith(".")),
                120, "the publisher to write its first block of v2", interval=0.002)
            os.kill(pub.pid, signal.SIGSTOP)
            signed = (chain / "manifests" / "v00000002.delta.json").exists()
            code, body, _ = http(f"{t.url}/v1/publish", b'{"version": 1}', timeout=60)
            assert code == 200, body
            ret = t.status()["retention"]
            print(f"paused {'after' if signed else 'before'} signing; retention {ret}")
        except BaseException:
            pub.kill()  # stopped or not, it must not outlive the test
            _finished(pub)
            raise
        finally:
            if pub.poll() is None:
                os.kill(pub.pid, signal.SIGCONT)
        _published(pub, 2)
        _whole(chain)
        state = step(state, 3)
        _published(_cli("publish", str(_checkpoint(tmp_path / "step_3", state)), "--config",
                        str(cfg)), 3)
        _whole(chain)
        assert t.status()["head_version"] == 3


def test_deltas_kept_for_a_node_behind_survive_publish_and_watch(tmp_path: Path) -> None:
    with Cluster(tmp_path / "cluster") as c:
        t = c.trainer(retention={"versions": 2})
        r1 = c.region("r1")
        c.start_all()
        cfg = _config(tmp_path, c, snapshot_every=3, retention_versions=1)
        ckpts = tmp_path / "ckpts"
        states = [tiny_model(0, tensors=4, rows=64, cols=256)]
        for v in range(1, 7):
            states.append(step(states[-1], v, density=0.02))
        for v in range(2):
            _published(_cli("publish", str(_checkpoint(ckpts / f"step_{v}", states[v])),
                            "--config", str(cfg), "--step", str(v)), v)
        c.wait_all_at(1, 180)
        wait_until(lambda: {"node": "r1", "region": "r1", "have": 1} in [
            {k: n[k] for k in ("node", "region", "have")}
            for n in t.status()["retention"]["nodes"]], 60, "the trainer to hear r1 holds v1")
        r1.stop()  # behind at v1 from now on
        for v in range(2, 6):
            _published(_cli("publish", str(_checkpoint(ckpts / f"step_{v}", states[v])),
                            "--config", str(cfg), "--step", str(v)), v)
        _checkpoint(ckpts / "step_6", states[6])
        watch = _cli("watch", str(ckpts), "--config", str(cfg), "--once")
        out = _finished(watch)
        assert watch.returncode == 0 and "step 6 -> v6" in out, out
        chain = t.state_dir / "chain"
        for v in range(2, 7):
            code, body, _ = http(f"{t.url}/v1/chain/manifests/v{v:08d}.delta")
            assert code == 200, f"v{v}.delta kept for r1 is gone: {code} {body[:200]!r}"
        assert t.status()["retention"]["kept_for"] == [1]
        _whole(chain)
