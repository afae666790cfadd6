"""Shared test fixtures: small models as state dicts, a signing key, a chain with versions."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from chain import keys
from rollout import group_shm

# Two cores shared by test processes, daemons and workers: oversubscribed torch threads made
# single tests 10-50x slower here.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def children_tmp_dir(tmp_path_factory: pytest.TempPathFactory):
    """vLLM servers put their ZMQ IPC sockets in VLLM_RPC_BASE_PATH and `vllm_dist_*` files in
    the temp dir (both default to /tmp) and leave them behind when they stop. Every process the
    tests start (they inherit this environment) keeps its temp files in a directory removed at
    the end of the session, so a run leaves nothing in /tmp."""
    ipc = tmp_path_factory.mktemp("children-tmp")
    names = ("VLLM_RPC_BASE_PATH", "TMPDIR")
    old = {n: os.environ.get(n) for n in names}
    os.environ.update({n: str(ipc) for n in names})
    yield ipc
    for n, v in old.items():
        if v is None:
            os.environ.pop(n, None)
        else:
            os.environ[n] = v
    shutil.rmtree(ipc, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def shared_memory_left_clean():
    """A run leaves no POSIX shared memory behind: vLLM's servers map hundreds of MB of
    /dev/shm/psm_* each, and a killed server's segments outlive it unless its stop unlinks them
    (rollout/group_shm.py). Fails the session, naming them, if any new segment is left that no
    live process holds."""
    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.is_dir() else set()
    yield
    if not shm.is_dir():
        return
    live = group_shm.held_by_any()
    # psm_* only: the semaphores (sem.mp-*, 32 bytes) of any other Python on the host look the
    # same, and a check that blames this run for another program's leftovers is no check
    left = sorted(p.name for p in set(shm.iterdir()) - before - live
                  if p.name.startswith("psm_"))
    assert not left, f"the test run left shared memory in /dev/shm: {left}"


@pytest.fixture
def signing_key(tmp_path: Path):
    return keys.generate(tmp_path / "trainer.key")


def make_state(seed: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    """A few bf16 tensors shaped like a tiny transformer, plus odd ones (fp32, int, empty)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(64 * scale, 32, generator=g) * 0.02).bfloat16(),
        "layers.0.attn.qkv.weight": (torch.randn(96, 32 * scale, generator=g) * 0.05).bfloat16(),
        "layers.0.mlp.up.weight": (torch.randn(128, 32, generator=g) * 0.05).bfloat16(),
        "layers.0.norm.weight": torch.ones(32).bfloat16(),
        "master.bias": torch.randn(17, generator=g),
        "step.count": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 4).bfloat16(),
    }


def perturb(state: dict[str, torch.Tensor], seed: int, density: float = 0.01
            ) -> dict[str, torch.Tensor]:
    """Next version: about `density` of float elements move by a tiny relative step."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name, t in state.items():
        if t.is_floating_point() and t.numel():
            f = t.float()
            mask = torch.rand(f.shape, generator=g) < density
            f = torch.where(mask, f * (1 + 0.02 * torch.sign(torch.randn(f.shape, generator=g))),
                            f)
            out[name] = f.to(t.dtype)
        else:
            out[name] = t.clone()
    return out
