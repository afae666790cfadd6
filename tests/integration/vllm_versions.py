"""Versions as a region hands them to its vLLM backend, without a swarm: verified version
directories (HF files, model.safetensors, VERSION.json with the chain's digests) and the patch
file between two versions (chain/patchfile.py). Shared by test_vllm_patch_serve and
bench/engine_vllm.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from chain import dtypes
from chain.digest import state_digest
from chain.patchfile import Patch, TensorPatch, write_patch
from chain.versiondir import VersionInfo, write_info
from chain.weights import version_dir_name
from rollout.engine_check import digest_of
from trainer.model import WEIGHTS_FILE


def write_version(weights: Path, version: int, state: dict[str, torch.Tensor],
                  files: dict[str, bytes]) -> tuple[Path, dict[str, str]]:
    """weights/vNNNNNNNN, complete, renamed into place; returns it and its tensor digests."""
    final = weights / version_dir_name(version)
    tmp = weights / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    digests = {n: digest_of(t) for n, t in state.items()}
    write_info(tmp, VersionInfo(version, state_digest(digests), "test", digests), None)
    os.rename(tmp, final)
    return final, digests


def step(state: dict[str, torch.Tensor], seed: int, density: float,
         names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The next version: about `density` of the elements of `names` (default all float
    tensors) get their lowest bit flipped (an RL step's shape: last-place moves)."""
    rng = np.random.default_rng(seed)
    out = dict(state)
    for name in names or [n for n, t in state.items() if t.is_floating_point()]:
        t = state[name].clone()
        bits = dtypes.bits_view(t)  # shares t's memory
        k = max(1, int(bits.size * density))
        pos = np.unique(rng.integers(0, bits.size, k))
        bits[pos] ^= 1
        out[name] = t
    return out


def write_patch_between(path: Path, version: int, old: dict[str, torch.Tensor],
                        new: dict[str, torch.Tensor], old_digests: dict[str, str],
                        new_digests: dict[str, str]) -> Path:
    """The region's patch file from `old` (v{version-1}) to `new` (v{version})."""
    tensors = []
    for name in sorted(new):
        ob, nb = dtypes.bits_view(old[name]), dtypes.bits_view(new[name])
        pos = np.flatnonzero(ob != nb).astype(np.int64)
        if pos.size:
            tensors.append(TensorPatch(name, dtypes.of_tensor(new[name]).name,
                                       list(new[name].shape), pos, nb[pos].copy(),
                                       old_digests[name], new_digests[name]))
    return write_patch(path, Patch(version, version - 1, state_digest(old_digests),
                                   state_digest(new_digests), tensors))
