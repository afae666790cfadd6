"""A shortened `deltaswarm demo` as real processes: trainer + daemon, three regions with
daemons and paced rollout workers; every region must end on the final version with the
trainer's state digest, the held-out set must be scored before and after RL, no trajectory may
be dropped as stale, and the demo must leave no process behind."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from annotated_types import Le

from chain.config_base import to_yaml
from demo.config import DemoConfig, WarmupConfig, load_demo_config, with_overrides
from rollout.ports import free_port_block
from trainer.ingest import IngestStore

REPO = Path(__file__).resolve().parents[2]

MAX_BASE_PORT = next(m.le for m in DemoConfig.model_fields["base_port"].metadata
                     if isinstance(m, Le))
"""The demo's own limit on `base_port`: a block drawn above it (rollout.ports draws above the
ephemeral range too) fails the demo's config check."""


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_demo_converges_every_region_and_cleans_up(tmp_path):
    shipped = load_demo_config(REPO / "configs" / "demo.yaml")
    cfg = with_overrides(
        shipped, out_dir=tmp_path, steps=3,
        base_port=free_port_block(40, step=100, high=MAX_BASE_PORT),
        batch=32, warmup=WarmupConfig(steps=20, lr=0.003, batch=32), timeout_s=600,
        min_reward_gain=-1.0, rollout={"prompts_per_batch": 4, "group_size": 4},
        heldout={"prompts": 16, "samples": 2, "every": 2})
    config = tmp_path / "demo.yaml"
    config.write_text(to_yaml(cfg))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "demo.main", "--config", str(config), "--out", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=800,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for region in ("us-east", "eu-west", "ap-south"):
        assert f"{region} is on v3 with the trainer's state digest" in out
    assert (run_dir / "demo.png").stat().st_size > 10_000
    # the held-out set was scored on a region's weights before RL (v0) and on the last version
    scores = json.loads((run_dir / "heldout.json").read_text())["scores"]
    assert scores[0]["version"] == 0 and scores[-1]["version"] == 3
    # paced workers: each generates while under its credit of ceil(32 / 3) = 11 trajectories
    # per version seen plus one version ahead, so at most 48 + one batch of 16 each by v3
    # (unpaced, they generate until the demo stops them)
    store = IngestStore(run_dir / "trainer" / "ingest")
    held = len(store.held_ids())
    store.close()
    assert 96 <= held <= 3 * 64, held
    assert "trajectories dropped as stale" in out and "codec bench" in out
    # none dropped as stale, read from the trainer's own metrics (the summary prints N of M
    # whatever N is)
    metrics = [json.loads(line) for line in
               (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in metrics if m.get("event") in ("step", "skip")]
    assert steps and sum(m.get("received", 0) for m in steps) > 0, metrics[-3:]
    assert sum(m.get("dropped_stale", 0) for m in steps) == 0, steps
    assert _processes_mentioning(str(run_dir)) == []
