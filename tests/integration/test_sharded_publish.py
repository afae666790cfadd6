"""A two-rank FSDP2 trainer (gloo, CPU; tests/integration/fsdp_worker.py) publishes every step
through ShardedPublisher into a real trainer daemon, and a region daemon rebuilds each version
bit-identical to what a single-process Publisher makes of the gathered weights. One rank is
SIGKILLed mid-publish (its part written, before the gather): that version is absent, not
half-signed; the restarted group resumes, the killed rank reuses its part, and the chain goes
on to the head with every state digest equal to the reference's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chain.store import ChainStore
from chain.weights import WeightsDir
from tests.integration.harness import ROOT, TOKEN, Cluster, free_port

WORLD = 2


def run_group(c: Cluster, root: Path, group: str, steps: int,
              die: dict[int, int] | None = None, timeout: float = 120) -> list[int]:
    """Start WORLD worker processes on a fresh rendezvous port; their exit codes. Each group
    logs to its own files (`logs(root, group)`), so a failure shows that group's output."""
    port = free_port("127.0.0.1")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(WORLD):
        argv = [sys.executable, "-m", "tests.integration.fsdp_worker", "--rank", str(rank),
                "--world", str(WORLD), "--port", str(port), "--steps", str(steps),
                "--chain", str(c.daemons["trainer"].state_dir / "chain"),
                "--ref-chain", str(root / "ref"), "--key", str(c.key_path),
                "--daemon-url", c.daemons["trainer"].url, "--token", TOKEN,
                "--log", str(root / "versions.jsonl")]
        if die and rank in die:
            argv += ["--die-before-gather", str(die[rank])]
        with open(root / f"{group}-rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
    try:
        return [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def logs(root: Path, group: str) -> str:
    return "\n".join(f"--- {group}, rank {r}:\n" +
                     (root / f"{group}-rank{r}.log").read_text()[-3000:] for r in range(WORLD))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp2_ranks_publish_bit_exact_and_a_killed_rank_leaves_no_half_version(tmp_path):
    with Cluster(tmp_path, run="fsdp") as c:
        c.trainer()
        c.region("r1")
        c.start_all()
        chain_dir = c.daemons["trainer"].state_dir / "chain"

        codes = run_group(c, tmp_path, "killed", steps=3, die={1: 3})
        assert codes[1] == -9 and codes[0] != 0, (codes, logs(tmp_path, "killed"))
        store = ChainStore(chain_dir)
        assert store.head() == 2, store.artifacts()
        assert store.get(3, "delta") is None and store.get(3, "snapshot") is None
        assert (chain_dir / "parts" / "v00000003" / "rank00001.json").is_file()

        assert run_group(c, tmp_path, "resumed", steps=5) == [0, 0], logs(tmp_path, "resumed")
        rows = [json.loads(line) for line in (tmp_path / "versions.jsonl").read_text().splitlines()]
        assert [r["version"] for r in rows] == [0, 1, 2, 3, 4, 5], rows
        assert all(r["digest"] == r["ref"] for r in rows), rows
        assert all(r["format"] == 3 and r["notified"] for r in rows), rows
        assert all(r["changed"] > 0 for r in rows[1:]), rows
        assert 1 in rows[3]["reused"], rows[3]  # the killed rank did not encode v3 again
        assert all(len(r["streams"]) == WORLD for r in rows), rows
        assert not list((chain_dir / "parts").glob("v*")), "parts of signed versions remain"

        c.wait_all_at(5, timeout=60)
        region = c.daemons["r1"].status()
        assert region["state_digest"] == rows[5]["ref"], region

        store = ChainStore(chain_dir)
        wd = WeightsDir(tmp_path / "rebuilt")
        for v in range(6):  # every version, one delta at a time, each verified on apply
            m = store.get(v, "delta") or store.get(v, "snapshot")
            cur = wd.apply([m], lambda b: store.blocks.get(b.id, b.size))
            assert cur.state_digest == rows[v]["ref"]
