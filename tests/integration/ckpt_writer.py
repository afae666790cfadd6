"""A stand-in for a trainer that saves HF checkpoints: writes `DIR/step_N/` for each step given,
slowly and in place (no temp dir, no rename), so a watcher sees every partial state.

    python -m tests.integration.ckpt_writer DIR --steps 1,2,3 --progress FILE

Even steps are sharded (two shards, preallocated to full size and then filled, index written
last); odd steps are one unsharded file appended chunk by chunk. After each chunk a line
`STEP FILE BYTES` is appended to the progress file, so a test can SIGKILL it mid-write. The
weights of step N are `state_at(N)`: the same in the test that checks what was published.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save

from tests.integration.harness import step, tiny_model

CHUNK = 16 * 1024


def state_at(n: int) -> dict[str, torch.Tensor]:
    """Step n's weights: step 0's with n successive small sparse changes."""
    state = tiny_model(0, tensors=4, rows=64, cols=256)
    for i in range(1, n + 1):
        state = step(state, i, density=0.02)
    return state


def _write_slowly(path: Path, data: bytes, prealloc: bool, progress, n: int, pause: float) -> None:
    with open(path, "r+b" if prealloc and path.exists() else "wb") as f:
        if prealloc:
            f.truncate(len(data))
        for off in range(0, len(data), CHUNK):
            f.write(data[off:off + CHUNK])
            f.flush()
            progress.write(f"{n} {path.name} {off + CHUNK}\n")
            progress.flush()
            time.sleep(pause)


def write_step(root: Path, n: int, progress, pause: float) -> None:
    d = root / f"step_{n}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "step": n}))
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "vocab": list("abc")}))
    (d / "optimizer.pt").write_bytes(os.urandom(1024))  # training state: never published
    state = state_at(n)
    if n % 2:
        _write_slowly(d / "model.safetensors", save(state), False, progress, n, pause)
    else:
        names = sorted(state)
        shards = {"model-00001-of-00002.safetensors": names[:2],
                  "model-00002-of-00002.safetensors": names[2:]}
        for fname, part in shards.items():
            (d / fname).touch()
            _write_slowly(d / fname, save({k: state[k] for k in part}), True, progress, n,
                          pause)
        index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    progress.write(f"{n} done\n")
    progress.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir", type=Path)
    p.add_argument("--steps", required=True)
    p.add_argument("--progress", required=True, type=Path)
    p.add_argument("--pause", type=float, default=0.02)
    a = p.parse_args()
    with open(a.progress, "a") as progress:
        for n in (int(s) for s in a.steps.split(",")):
            write_step(a.dir, n, progress, a.pause)


if __name__ == "__main__":
    main()
